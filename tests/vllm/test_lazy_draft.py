"""The lazy drafter: idle steps skip the draft forward, speculation resumes lossless and KV-consistent.

A stateless policy alternates stretches of k = 0 (every request, so the controller's
``draft_horizon="policy"`` asks the drafter for nothing and :class:`LazyDraftProposer` skips it) with
stretches of k = 3 (the drafter runs again and first catches the skipped positions up). Checked at
batch 1 (the shared engine), batch 8 and batch 16 (engines of their own; at 16, 32 requests of two
lengths, so that requests finish and others join while the rest have positions to catch up, and a token
budget the joining prefills fill, so that the catch-up does not fit the step's forward and runs in one
of its own):

* lossless: every output equals plain greedy decoding (the reference engine without speculation);
* KV-consistent: every round's K, accepted count and verified tokens equal those of the same engine
  with the drafter run in every step (vLLM's own behaviour, ``lazy = False``) -- the drafts after a
  catch-up are the drafts of a drafter that never skipped;
* the check can fail (batch 8, a fresh engine): skipping *without* the catch-up stays lossless but
  changes the accepted counts (the draft then attends over KV gaps);
* the skip happened (the proposer's counters), and idle steps ran as plain steps (vLLM's
  non-speculative sampling path, :class:`specenv.engines.vllm.lazydraft.PlainIdleSteps`), while the
  steps around them (k = 0 verified, k = 3 drafted next) took vLLM's drafter on those steps' inputs.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # live vLLM engines

from vhelpers import KMAX, MAX_TOKENS, PROMPTS, controller_of, greedy, llm_kwargs  # noqa: E402

from specenv.engines.vllm import SpecenvSettings, load_recording  # noqa: E402
from specenv.engines.vllm.lazydraft import LazyDraftProposer  # noqa: E402
from specenv.engines.vllm.settings import LAZY_WORKER_CLS, engine_kwargs  # noqa: E402
from specenv.observation.single import ObservationSpec  # noqa: E402

#: Tokens per stretch: k = 0 for STRETCH generated tokens, then k = 3 for STRETCH, and so on.
STRETCH = 8
#: Batch 16: k = 3 in the last PHASE_SPEC of every PHASE engine steps, else 0 (:class:`Phases`).
PHASE, PHASE_SPEC = 8, 2
#: max_num_batched_tokens of the batch-16 engine: 16 decoding requests verifying k = 3 (64 tokens) and
#: their drafting slots (16) fit; joining prefills fill the rest.
BUDGET16 = 96


class Stretches:
    """k = 0 while ``(tokens generated // STRETCH)`` is even, else 3 (stateless: from ``progress``)."""

    name = "stretches"
    stateless = True

    def __init__(self, spec: ObservationSpec):
        self.spec = spec  # the server builds observations to this spec (max_new_tokens scales progress)
        self.col = spec.names.index("progress")
        self.mnt = spec.max_new_tokens

    def reset(self):
        pass

    def act(self, obs, ids=None, step=None):
        t = np.rint(np.asarray(obs)[:, self.col] * self.mnt).astype(np.int64)
        return np.where((t // STRETCH) % 2 == 0, 0, 3).astype(np.int64)


class Phases:
    """k = 3 in the last PHASE_SPEC of every PHASE steps the policy decides, else 0, for every request.

    The requests of a step share their k whatever their progress (16 requests that started and
    accepted differently still have k = 0 steps together). Stateful: reset before each run.
    """

    name = "phases"

    def __init__(self):
        self.calls = 0

    def reset(self):
        self.calls = 0

    def act(self, obs, ids=None, step=None):
        k = 3 if self.calls % PHASE >= PHASE - PHASE_SPEC else 0
        self.calls += 1
        return np.full(len(obs), k, dtype=np.int64)


def drafter_of(llm) -> LazyDraftProposer:
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    drafter = worker.model_runner.drafter
    assert isinstance(drafter, LazyDraftProposer), type(drafter)
    return drafter


def spy_steps(ctl, steps: list, what) -> None:
    """Wrap the controller's ``schedule`` (the engine core calls it once per step; undo: ``del ctl.schedule``).

    Each step appends ``what(out, n)`` to ``steps``: ``out`` the scheduled step, ``n`` its requests that
    are not mid-prefill (those the step decides).
    """
    base = ctl.schedule

    def schedule(*args, **kwargs):
        out = base(*args, **kwargs)
        reqs = ctl.requests
        steps.append(what(out, sum(1 for r in out.num_scheduled_tokens if not reqs[r].is_prefill_chunk)))
        return out

    ctl.schedule = schedule


def rounds(rec) -> list[tuple]:
    """Every recorded round as (request's order in the call, round, K, accepted, verified tokens)."""
    df = load_recording(rec).rounds
    first = int(df["generation_id"].min())
    return sorted(
        (int(g) - first, int(r), int(k), int(a), tuple(int(x) for x in v))
        for g, r, k, a, v in zip(
            df["generation_id"], df["round"], df["K"], df["accepted"], df["verified_tokens"], strict=True
        )
    )


def run(llm, prompts, rec, params=None):
    ctl = controller_of(llm)
    ctl.policy.reset()  # every run starts the policy afresh
    shutil.rmtree(rec, ignore_errors=True)
    ctl.start_recording(str(rec))
    outs = llm.generate(prompts, params or greedy(), use_tqdm=False)
    ctl.stop_recording()
    return [list(o.outputs[0].token_ids) for o in outs], rounds(rec)


def check(llm, prompts, reference, tmp_path, control: bool = False, max_tokens: list[int] | None = None, policy=None):
    """Lazy vs eager drafter on ``prompts``; with ``control``, first a run that skips without catching up.

    The control runs first on a fresh engine: the slots its skipped positions leave unwritten hold no
    earlier run's KV (a later run of the same prompts could find the very values an earlier run
    wrote there, and the control could not tell the difference). ``max_tokens``: per prompt (default
    MAX_TOKENS each); greedy, so each output is the first tokens of the reference. ``policy``: default
    :class:`Stretches`.
    """
    lengths = max_tokens or [MAX_TOKENS] * len(prompts)
    params = [greedy(m) for m in lengths]
    ctl = controller_of(llm)
    spec = ObservationSpec(kmax=KMAX, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)
    ctl.set_policy(policy or Stretches(spec))
    ctl.settings.draft_horizon = "policy"
    drafter = drafter_of(llm)
    try:
        if control:
            drafter.catch_up = False
            gap_out, gap_rounds = run(llm, prompts, tmp_path / "gaps", params)
            drafter.catch_up = True
        before = dict(drafter.stats)
        lazy_out, lazy_rounds = run(llm, prompts, tmp_path / "lazy", params)
        after = dict(drafter.stats)
        drafter.lazy = False
        eager_out, eager_rounds = run(llm, prompts, tmp_path / "eager", params)
    finally:
        drafter.lazy, drafter.catch_up = True, True
        ctl.set_policy(None)
        ctl.settings.draft_horizon = "max"
    for p, m, out in zip(prompts, lengths, lazy_out, strict=True):
        assert out == reference[p]["token_ids"][:m], p
    assert after["skipped"] > before["skipped"] and after["catchups"] > before["catchups"]
    # the draft prefill of a request that starts at k = 0 was skipped (and caught up when it speculated):
    # every request under Stretches and the table (k = 0 first), some under Phases (k = 3 every 4th step)
    assert after["deferred"] - before["deferred"] >= (1 if isinstance(policy, Phases) else len(prompts))
    # idle steps ran as plain steps (no rejection sampler, no drafter input preparation): PlainIdleSteps
    assert after["plain_steps"] > before["plain_steps"]
    assert type(drafter._runner).__name__.startswith("PlainIdle")
    # every skipped step left one position per request to catch up, except the last stretch of k = 0
    # of a request that ends in it (nothing drafts after it)
    assert after["caught_up"] > 0
    assert {r[2] for r in lazy_rounds} == {0, 3}  # both stretches ran
    assert lazy_out == eager_out
    assert lazy_rounds == eager_rounds  # the same drafts were accepted, round by round
    if control:
        for p, m, out in zip(prompts, lengths, gap_out, strict=True):
            assert out == reference[p]["token_ids"][:m], p  # gaps in the draft KV never change the output
        acc = lambda rs: [r[3] for r in rs]  # noqa: E731
        assert acc(gap_rounds) != acc(eager_rounds), "without the catch-up the drafts should differ"


def test_engine_kwargs_install_the_lazy_drafter_on_cpu():
    assert engine_kwargs(SpecenvSettings())["worker_cls"] == LAZY_WORKER_CLS
    assert "worker_cls" not in engine_kwargs(SpecenvSettings(lazy_draft=False))


def test_batch_1_idle_steps_skip_the_drafter_lossless_and_kv_consistent(engine, plain_reference, tmp_path):
    check(engine, PROMPTS[:1], plain_reference, tmp_path)


@pytest.fixture(scope="module")
def engine8(model_dirs):
    from vllm import LLM

    kw = llm_kwargs(dirs=model_dirs, max_num_seqs=8)
    kw.update(engine_kwargs(SpecenvSettings(record_tokens=True), tap=True))
    llm = LLM(**kw)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_batch_8_idle_steps_skip_the_drafter_lossless_and_kv_consistent(engine8, plain_reference, tmp_path):
    prompts = (PROMPTS + PROMPTS)[:8]  # 8 requests in one batch (two prompts twice)
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    check(engine8, prompts, plain_reference, tmp_path, control=True)


def test_batch_8_the_dynamic_sd_table_served_runs_plain_steps_then_speculates_as_the_batch_shrinks(
    engine8, plain_reference, tmp_path
):
    """vLLM's dynamic-SD table through the controller (the A/B's ``table`` arm): k = 0 while 5-8 requests run.

    Half the requests are short: once they finish, four remain and the table's k = 3 resumes speculation,
    every request catching up the positions its k = 0 steps skipped; lossless, and round by round what the
    eager drafter verifies.
    """
    from policies.batch.controllers import DSDBatch
    from specenv.observation.batch import BatchObservationSpec

    ctl = controller_of(engine8)
    spec = ObservationSpec(kmax=KMAX, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)
    table = DSDBatch(BatchObservationSpec(spec, 8), [(1, 4, 3), (5, 8, 0)])
    prompts = (PROMPTS + PROMPTS)[:8]
    lengths = [MAX_TOKENS // 3] * 4 + [MAX_TOKENS] * 4
    check(engine8, prompts, plain_reference, tmp_path, max_tokens=lengths, policy=table)


def test_batch_8_a_policy_gated_by_the_table_is_asked_only_once_the_batch_shrinks(engine8, plain_reference, tmp_path):
    """The A/B's ``gated`` arm: a per-request policy (fixed k = 3, observing) under the table's gate, full path.

    While 5-8 requests run the gate is shut (k = 0, plain steps, the policy not asked); once the short
    requests end, the policy's k = 3 resumes: lossless, and round by round what the eager drafter verifies.
    """
    from policies.batch.controllers import TableGated
    from policies.heuristics import FixedK
    from specenv.observation.batch import BatchObservationSpec

    ctl = controller_of(engine8)
    spec = ObservationSpec(kmax=KMAX, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)

    class Observing(FixedK):  # as an MLP: the controller builds its observations (the full path, not the blind one)
        observes = True

    gated = TableGated(BatchObservationSpec(spec, 8), Observing(spec, 3), [(1, 4, 1), (5, 8, 0)])
    assert gated.observes and not gated.observes_at(5) and gated.observes_at(4)
    prompts = (PROMPTS + PROMPTS)[:8]
    lengths = [MAX_TOKENS // 3] * 4 + [MAX_TOKENS] * 4
    # recorded (check: lazy vs eager drafter, round by round): the full path in every step
    check(engine8, prompts, plain_reference, tmp_path, max_tokens=lengths, policy=gated)
    # served as the A/B serves it (no recording): the step's own n decides the path
    steps: list[tuple[int, bool, bool]] = []
    spy_steps(ctl, steps, lambda out, n: (n, ctl._blind_step, ctl.tap.capturing))
    ctl.set_policy(gated)
    ctl.settings.draft_horizon = "policy"
    try:
        outs = engine8.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False)
    finally:
        del ctl.schedule
        ctl.set_policy(None)
        ctl.settings.draft_horizon = "max"
    for p, m, o in zip(prompts, lengths, outs, strict=True):
        assert list(o.outputs[0].token_ids) == plain_reference[p]["token_ids"][:m], p
    # blind (no routing capture, no bookkeeping) while the gate is shut at 5-8 requests, the full path where
    # the policy reads its rows (1-4 requests)
    decoding = [(n, blind, cap) for n, blind, cap in steps if n]
    assert {n for n, *_ in decoding} >= {4, 8}
    assert all(blind == (n >= 5) and cap == (not blind) for n, blind, cap in decoding), decoding


def test_batch_8_a_gated_block_policy_drafts_nothing_where_its_gate_is_shut(engine8, plain_reference, tmp_path):
    """A gated policy with a lookahead block (h = 3, draft confidences) drafts its block only where it reads.

    The table shuts the gate at 5-8 requests: there the horizon is 0 (the lazy drafter skips, a plain
    step), not h; at 1-4 the drafter proposes the block of h and the policy reads its confidences. The
    same horizons served as the A/B serves it (no recording: blind where shut) and recorded (the full
    path in every step); lossless both ways, and no step falls back for want of signals.
    """
    from policies.batch.controllers import TableGated
    from policies.heuristics import ConfidenceThreshold
    from specenv.observation.batch import BatchObservationSpec

    h = 3
    ctl = controller_of(engine8)
    spec = ObservationSpec(kmax=KMAX, lookahead=h, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)
    gated = TableGated(BatchObservationSpec(spec, 8), ConfidenceThreshold(spec, threshold=0.4), [(1, 4, 1), (5, 8, 0)])
    assert gated.drafting == "block" and not gated.observes_at(5) and gated.observes_at(4)
    prompts = (PROMPTS + PROMPTS)[:8]
    lengths = [MAX_TOKENS // 3] * 4 + [MAX_TOKENS] * 4  # 8 requests (gate shut), then 4 (open)
    steps: list[tuple[int, int, bool]] = []
    drafter = drafter_of(engine8)
    runs = {}
    spy_steps(ctl, steps, lambda out, n: (n, out.num_spec_tokens_to_schedule, ctl._blind_step))
    ctl.set_policy(gated)
    ctl.settings.draft_horizon = "policy"
    try:
        for mode in ("served", "recorded"):
            ctl.policy.reset()
            steps.clear()
            before = {k: ctl.stats[k] for k in ("no_signals", "fallbacks", "decisions")}
            skipped = drafter.stats["skipped"]
            if mode == "recorded":
                ctl.start_recording(str(tmp_path / "rec"))
            outs = engine8.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False)
            if mode == "recorded":
                ctl.stop_recording()
            counts = {k: ctl.stats[k] - v for k, v in before.items()}
            runs[mode] = ([list(o.outputs[0].token_ids) for o in outs], list(steps), counts)
            runs[mode] += (drafter.stats["skipped"] - skipped,)
    finally:
        del ctl.schedule
        ctl.set_policy(None)
        ctl.settings.draft_horizon = "max"
    for mode, (outs, stp, counts, skipped) in runs.items():
        for p, m, out in zip(prompts, lengths, outs, strict=True):
            assert out == plain_reference[p]["token_ids"][:m], (mode, p)
        decoding = [(n, hz, blind) for n, hz, blind in stp if n]
        assert {n for n, *_ in decoding} >= {4, 8}, (mode, decoding)
        # the block where the policy reads (1-4 requests), nothing where the gate is shut (5-8)
        assert all(hz == (0 if n >= 5 else h) for n, hz, _ in decoding), (mode, decoding)
        assert all(blind == (mode == "served" and n >= 5) for n, _, blind in decoding), (mode, decoding)
        assert counts["decisions"] > 0 and counts["no_signals"] == 0 and counts["fallbacks"] == 0, (mode, counts)
        assert skipped > 0, mode  # the shut steps ran without the draft forward
    rec = load_recording(tmp_path / "rec").rounds
    assert not rec["fallback"].any() and rec["K"].max() > 0  # speculation resumed once the gate opened


@pytest.fixture(scope="module")
def engine16(model_dirs):
    from vllm import LLM

    kw = llm_kwargs(dirs=model_dirs, max_num_seqs=16, max_num_batched_tokens=BUDGET16)
    kw.update(engine_kwargs(SpecenvSettings(record_tokens=True), tap=True))
    llm = LLM(**kw)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def test_batch_16_requests_join_while_others_catch_up_lossless_and_kv_consistent(engine16, plain_reference, tmp_path):
    # 32 requests, 16 slots, half of them 20 tokens long: requests finish and waiting ones join while
    # the others have positions to catch up; joining prefills fill the step's token budget, so a catch-up
    # does not fit the step's forward (before the fix it was written past the drafter's buffers: glibc
    # "double free or corruption", exit 134)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    lengths = [20 if i % 2 == 0 else MAX_TOKENS for i in range(32)]
    drafter = drafter_of(engine16)
    assert drafter.max_num_tokens == BUDGET16
    before = dict(drafter.stats)
    check(engine16, prompts, plain_reference, tmp_path, control=True, max_tokens=lengths, policy=Phases())
    after = drafter.stats
    assert after["split"] > before["split"]  # a catch-up ran in a forward of its own (only the lazy run can)
    # and some needed several: 16 deferred prompts do not fit one forward of BUDGET16 tokens
    assert after["windows"] - before["windows"] > after["split"] - before["split"]
    assert after["catchups"] - before["catchups"] > after["split"] - before["split"]  # and some in the step's
    assert 0 < after["largest"] <= BUDGET16  # no catching-up forward held more than vLLM's buffers


def test_engines_of_any_size_get_the_lazy_drafter():
    # the catch-up keeps every draft forward inside vLLM's buffers whatever the batch (the batch-16 test
    # above): the lazy drafter goes on engines of any max_num_seqs
    from types import SimpleNamespace

    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from specenv.engines.vllm import lazydraft

    assert not hasattr(lazydraft, "MAX_SEQS")
    for n in (1, 8, 16, 256):
        drafter = object.__new__(DraftModelProposer)  # no engine needed: make_lazy looks at the drafter only
        assert lazydraft.make_lazy(SimpleNamespace(drafter=drafter, max_num_reqs=n)) is drafter
        assert type(drafter) is LazyDraftProposer and drafter.lazy and drafter.catch_up
    other = object.__new__(SpecDecodeBaseProposer)  # not vLLM's draft-model proposer: left as it is
    assert lazydraft.make_lazy(SimpleNamespace(drafter=other, max_num_reqs=16)) is None


def test_only_decoding_steps_that_verify_no_draft_run_as_plain_steps():
    # PlainIdleSteps._plain_step on hand-built scheduler outputs (no engine: the decision alone)
    from types import SimpleNamespace

    from specenv.engines.vllm import lazydraft

    class Runner:  # what the mixin reads of vLLM's runner
        def __init__(self):
            self.drafter = SimpleNamespace(lazy=True)
            self.use_async_scheduling = False
            self.uses_mrope = False

    lazydraft.make_plain_idle(runner := Runner())
    cls = type(runner)
    lazydraft.make_plain_idle(runner)  # idempotent: one subclass, not a subclass of it
    assert type(runner) is cls and cls.__mro__[1] is lazydraft.PlainIdleSteps

    def so(tokens: dict[str, int], spec: dict[str, list[int]] | None = None):
        return SimpleNamespace(
            num_scheduled_tokens=tokens,
            total_num_scheduled_tokens=sum(tokens.values()),
            scheduled_spec_decode_tokens=spec or {},
        )

    idle = so({"a": 1, "b": 1})
    assert runner._plain_step(idle)
    assert not runner._plain_step(so({"a": 2, "b": 1}, {"a": [7]}))  # a request verifies a draft
    assert not runner._plain_step(so({"a": 5, "b": 1}))  # a prefill (chunk) beside a decoding request
    runner.drafter.lazy = False  # the eager drafter: vLLM's speculative path in every step
    assert not runner._plain_step(idle)
    runner.drafter.lazy = True
    runner.use_async_scheduling = True
    assert not runner._plain_step(idle)
    runner.use_async_scheduling, runner.uses_mrope = False, True
    assert not runner._plain_step(idle)


def test_batch_8_the_table_unrecorded_takes_the_blind_path_step_for_step(engine8, plain_reference):
    """The batch-size table served as abtest's ``table`` arm (no recording, no callback) runs the blind path.

    ``DSDBatch.observes`` is False: the controller asks it about rows of zeros and keeps no per-round
    bookkeeping, and the tap captures no routing (its buffer keeps a sentinel through the whole run).
    Against the same table on the full path (a round callback makes the controller observe): the same
    horizon and the same verified K per request in every step, the same decisions, and both lossless.
    """
    from policies.batch.controllers import DSDBatch
    from specenv.observation.batch import BatchObservationSpec

    ctl = controller_of(engine8)
    spec = ObservationSpec(kmax=KMAX, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)
    table = DSDBatch(BatchObservationSpec(spec, 8), [(1, 4, 3), (5, 8, 0)])
    prompts = (PROMPTS + PROMPTS)[:8]
    lengths = [MAX_TOKENS // 3] * 4 + [MAX_TOKENS] * 4  # 8 requests (k = 0), then 4 (k = 3)
    steps: list[tuple] = []

    def step_of(out, n):
        spec_tokens = out.scheduled_spec_decode_tokens  # only the requests that verify drafts
        ks = tuple(sorted(len(spec_tokens.get(r, ())) for r in out.num_scheduled_tokens))
        return (out.num_spec_tokens_to_schedule, ks, ctl._blind_step, ctl.tap.capturing)

    prev_cb = ctl.round_callback
    runs = {}
    spy_steps(ctl, steps, step_of)
    ctl.set_policy(table)
    ctl.settings.draft_horizon = "policy"
    try:
        for mode in ("blind", "full"):
            ctl.round_callback = (lambda rid, out: None) if mode == "full" else None
            ctl.policy.reset()
            steps.clear()
            ctl.tap.buf.fill_(-7)  # a sentinel no router writes
            before = {k: ctl.stats[k] for k in ("decisions", "fallbacks", "capped", "rounds")}
            outs = engine8.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False)
            counts = {k: ctl.stats[k] - v for k, v in before.items()}
            untouched = bool((ctl.tap.buf == -7).all())
            runs[mode] = ([list(o.outputs[0].token_ids) for o in outs], list(steps), counts, untouched)
    finally:
        del ctl.schedule
        ctl.round_callback = prev_cb
        ctl.set_policy(None)
        ctl.settings.draft_horizon = "max"
    for mode, (outs, _, counts, _) in runs.items():
        for p, m, out in zip(prompts, lengths, outs, strict=True):
            assert out == plain_reference[p]["token_ids"][:m], (mode, p)
        assert counts["decisions"] > 0 and counts["fallbacks"] == 0, (mode, counts)
    blind, full = runs["blind"], runs["full"]
    assert all(b and not cap for *_, b, cap in blind[1][1:])  # every step after the first decided blind
    assert all(not b and cap for *_, b, cap in full[1])
    assert blind[3] and not full[3]  # the blind run captured no routing; the full run did
    assert blind[2]["rounds"] == 0 and full[2]["rounds"] > 0  # no per-round bookkeeping on the blind path
    assert {k for _, ks, *_ in blind[1] for k in ks} == {0, 3}  # both table rows ran
    assert [s[:2] for s in blind[1]] == [s[:2] for s in full[1]]  # the same horizons and K, step for step
    assert blind[2]["decisions"] == full[2]["decisions"] and blind[2]["capped"] == full[2]["capped"]
