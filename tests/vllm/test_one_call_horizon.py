"""The draft horizon in the step's one policy call: the same horizons and decisions as asking twice.

With ``draft_horizon="policy"`` the controller needs, before every step, the largest k the policy would
pick after that step's round if every draft in flight were accepted (``num_spec_tokens_to_schedule``).
The two-call path asks it at ``schedule`` (a second policy call per step, ``horizon_one_call=False``);
the one-call path asks it in the step before, in the same call as the decisions, for every K a request
may then verify (:meth:`SpecControlScheduler._what_ifs`), and ``schedule`` reads it.

* no engine: a bare controller driven through decide/schedule steps (requests joining, vLLM scheduling
  fewer drafts than decided, a request left out of a step): one policy call per step where the
  two-call path makes two, and every horizon and trimmed draft list equal;
* engines (the shipped models, batch 1 on the shared engine and batch 8 on one of its own): a policy
  whose k is a hash of every bit of its observation row (rounds priced by a fitted cost model, so that
  no observation depends on the clock), both paths on the same prompts: every step's
  horizon, every recorded round (K, drafted, policy_k, accepted, verified tokens) equal, outputs equal
  to plain greedy decoding, and the policy called once per step but in the steps whose schedule holds
  a request's first round (its prefill just ran: nothing asked its horizon before).
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from vhelpers import KMAX, MAX_TOKENS, PROMPTS, controller_of, greedy, llm_kwargs  # noqa: E402

from scripts.horizon_cpu import bare_controller  # noqa: E402
from specenv.engines.vllm import SpecenvSettings, load_recording  # noqa: E402
from specenv.engines.vllm.settings import engine_kwargs  # noqa: E402
from specenv.observation.single import ObservationSpec  # noqa: E402
from specenv.policy.base import Policy  # noqa: E402


class RowHash(Policy):
    """Stateless, rowwise: k is a hash of every bit of the row (any change of an observation shows).

    Logs every call as ``(clock(), rows)`` (``clock``: the controller's step number, set by the test).
    """

    name = "row-hash"
    stateless = True

    def __init__(self, spec: ObservationSpec):
        super().__init__(spec)
        self.calls: list[tuple[int, int]] = []
        self.clock = lambda: 0

    def _act_rows(self, obs):
        self.calls.append((self.clock(), len(obs)))
        h = np.ascontiguousarray(obs, dtype=np.float32).view(np.uint32).astype(np.uint64).sum(axis=1)
        return (h * np.uint64(2654435761) % np.uint64(2**32) % np.uint64(self.spec.kmax + 1)).astype(np.int64)


# ------------------------------------------------------------------------------------------ no engine
def bare(policy, spec: ObservationSpec, num_spec: int, one_call: bool):
    """A controller without an engine: the attributes its decide and horizon paths read."""
    assert policy.spec is spec
    return bare_controller(policy, num_spec, one_call)


class FakeRequest:
    def __init__(self, rid: str, prompt: int):
        self.request_id, self.num_tokens, self.num_output_tokens = rid, prompt, 0
        self.is_prefill_chunk = False

    def is_finished(self):
        return False


def drive(one_call: bool, steps: int = 40, seed: int = 0):
    """Decide/schedule steps of a bare controller; per step (horizon, trimmed drafts), policy calls per step."""
    from vllm.v1.outputs import DraftTokenIds

    spec = ObservationSpec(kmax=6, lookahead=0, max_new_tokens=400, n_experts=64)
    pol = RowHash(spec)
    ctl = bare(pol, spec, num_spec=6, one_call=one_call)
    pol.clock = lambda: ctl._step
    rng = np.random.default_rng(seed)
    inflight: dict[str, list[int]] = {}  # request -> drafts the next step verifies
    log = []
    unasked = set()  # steps whose schedule holds a request no earlier call asked the horizon of
    decided: set[str] = set()  # requests decided in the previous step
    for s in range(steps):
        if s in (0, 5, 17):  # requests join: their prefill runs in this step, their first round next
            for i in range(3 if s == 0 else 1):
                rid = f"r{s}-{i}"
                ctl.requests[rid] = FakeRequest(rid, int(rng.integers(20, 60)))
                ctl._state(rid)
                inflight[rid] = []
        # schedule: vLLM may schedule fewer drafts than decided (token budget); one request sits out
        sched, spec_tokens = {}, {}
        for rid, d in inflight.items():
            if s % 7 == 3 and rid == "r0-1":
                continue
            if not ctl.requests[rid].num_output_tokens or rid not in decided:
                unasked.add(s + 1)
            if ctl.requests[rid].num_output_tokens and s % 5 == 2:
                d = d[: len(d) // 2]
            sched[rid] = len(d) + 1 if ctl.requests[rid].num_output_tokens else ctl.requests[rid].num_tokens
            if d:
                spec_tokens[rid] = d
        ctl._step += 1
        h = ctl._horizon(SimpleNamespace(num_scheduled_tokens=sched, scheduled_spec_decode_tokens=spec_tokens))
        # the step runs: prefills sample one token; rounds accept some drafts, fold into the statistics
        slots, ks, accs, Us, costs = [], [], [], [], []
        for rid in sched:
            req, st = ctl.requests[rid], ctl._reqs[rid]
            if req.num_output_tokens == 0:
                req.num_tokens += 1
                req.num_output_tokens = 1
                continue
            K = len(spec_tokens.get(rid, ()))
            acc = int(rng.integers(0, K + 1))
            U = float(rng.uniform(4, 40))
            slots.append(st.slot), ks.append(K), accs.append(acc), Us.append(U), costs.append(rng.uniform(0.5, 3))
            st.last_U[K] = U
            req.num_tokens += acc + 1
            req.num_output_tokens += acc + 1
        if slots:
            ctl._slots.update(np.array(slots), np.array(ks), np.array(accs), np.array(Us), np.array(costs))
        # the drafter proposed h tokens for every scheduled request; the controller trims them
        ids = list(sched)
        dti = DraftTokenIds(ids, [list(rng.integers(0, 1000, size=h)) for _ in ids])
        trimmed = ctl._decide(dti)
        for rid, d in zip(trimmed.req_ids, trimmed.draft_token_ids, strict=True):
            inflight[rid] = list(d)
        log.append((h, [list(map(int, d)) for d in trimmed.draft_token_ids]))
        decided = set(sched)
    per_step = np.bincount([c for c, _ in pol.calls], minlength=steps + 1)[1:]
    return log, per_step, ctl.stats, unasked


def test_one_call_per_step_gives_the_two_call_horizons_without_an_engine():
    log1, calls1, stats1, unasked = drive(one_call=True)
    log2, calls2, stats2, _ = drive(one_call=False)
    assert log1 == log2  # every horizon and every trimmed draft list
    hs = [h for h, _ in log1]
    assert len(set(hs)) >= 3 and 0 < max(hs) <= 6  # the horizon moved (the test can tell paths apart)
    # two-call path: every step asks at schedule and at decide
    assert (calls2 == 2).all() and stats2["horizon_calls"] == len(calls2)
    # one-call path: once per step, twice only where a request's first round comes next (its prefill
    # ran in the step: steps 1, 6, 18) or the request sat the previous step out (every 7th from 5)
    assert unasked == {1, 6, 18} | {5, 12, 19, 26, 33, 40}
    assert set(np.flatnonzero(calls1 == 2) + 1) == unasked and (calls1 >= 1).all() and calls1.max() == 2
    assert stats1["horizon_calls"] == len(unasked)
    assert stats1["decisions"] == stats2["decisions"] and stats1["fallbacks"] == stats2["fallbacks"] == 0


def test_a_policy_that_is_not_rowwise_keeps_its_own_horizon_call():
    from policies.heuristics import UCBBandit

    spec = ObservationSpec(kmax=4, lookahead=0, max_new_tokens=100, n_experts=64)
    ctl = bare(UCBBandit(spec), spec, num_spec=4, one_call=True)
    assert not ctl._one_call()
    ctl = bare(RowHash(spec), spec, num_spec=4, one_call=True)
    assert ctl._one_call()
    ctl.settings.draft_horizon = "max"
    assert not ctl._one_call()


# ------------------------------------------------------------------------------------------ engines
#: Recorded columns compared between the two paths (generation_id and step relative to the run's first).
COLUMNS = ("generation_id", "round", "step", "K", "m", "accepted", "drafted", "policy_k", "fallback", "capped")
COLUMNS += ("U_r", "E_max")  # (drafting after the outcome: read once inside the step on the one-call path)


def served_run(llm, waves: list[list[str]], one_call: bool, rec, horizon: str = "policy"):
    """``waves`` (each one ``generate`` call) through RowHash on both paths' settings; what to compare."""
    from policies.bench.context import build_context

    ctl = controller_of(llm)
    # a fitted cost model prices every round (prev_cost), so that no observation depends on the clock
    ctl.cost_model = build_context("live-cpu", KMAX, "fit-train", None).cost_model
    spec = ObservationSpec(kmax=KMAX, lookahead=0, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)
    pol = RowHash(spec)
    pol.clock = lambda: ctl._step
    ctl.set_policy(pol)
    ctl.settings.draft_horizon = horizon
    ctl.settings.horizon_one_call = one_call
    assert ctl.draft_tokens is None
    assert (ctl._one_call() if horizon == "policy" else ctl._outcome_one_call()) == one_call
    horizons: list[tuple[int, int]] = []
    inner = ctl._horizon

    def spy(out):  # noqa: ANN001, ANN202
        h = inner(out)
        horizons.append((ctl._step, h))
        return h

    ctl._horizon = spy  # the instance's: what schedule calls
    shutil.rmtree(rec, ignore_errors=True)
    before = dict(ctl.stats)
    step0 = ctl._step
    try:
        ctl.start_recording(str(rec))
        tokens = []
        for prompts in waves:
            outs = llm.generate(prompts, greedy(), use_tqdm=False)
            tokens += [list(o.outputs[0].token_ids) for o in outs]
        ctl.stop_recording()
    finally:
        del ctl._horizon
        ctl.set_policy(None)
        ctl.cost_model = None
        ctl.settings.draft_horizon = "max"
        ctl.settings.horizon_one_call = True
    df = load_recording(rec).rounds.sort_values(["step", "generation_id"]).reset_index(drop=True)
    df["generation_id"] -= df["generation_id"].min()
    df["step"] -= step0
    rows = {c: df[c].tolist() for c in COLUMNS}
    rows["verified_tokens"] = [list(map(int, v)) for v in df["verified_tokens"]]
    per_step = np.bincount([c - step0 for c, _ in pol.calls])
    keys = ("horizon_calls", "outcome_calls", "fallbacks", "capped", "decisions")
    delta = {k: ctl.stats[k] - before[k] for k in keys}
    return {
        "tokens": tokens,
        "rows": rows,
        "horizons": [(s - step0, h) for s, h in horizons],
        "per_step": per_step,
        "stats": delta,
    }


def compare_paths(llm, waves, plain_reference, tmp_path, requests_first_steps: int):
    one = served_run(llm, waves, True, tmp_path / "one")
    two = served_run(llm, waves, False, tmp_path / "two")
    prompts = [p for w in waves for p in w]
    for p, toks in zip(prompts, one["tokens"], strict=True):
        assert toks == plain_reference[p]["token_ids"], p
    assert one["tokens"] == two["tokens"]
    assert one["horizons"] == two["horizons"]  # every step's num_spec_tokens_to_schedule
    assert one["rows"] == two["rows"]  # every round: K, drafted, the policy's k, accepted, verified tokens
    assert one["stats"]["decisions"] == two["stats"]["decisions"] > 0
    assert one["stats"]["fallbacks"] == two["stats"]["fallbacks"] == 0
    # the run exercised the horizon: it moved, and rounds verified fewer drafts than were proposed
    hs = {h for _, h in one["horizons"]}
    assert len(hs) >= 3, hs
    rows = one["rows"]
    assert any(k < d for k, d in zip(rows["K"], rows["drafted"], strict=True))
    # two-call path: the horizon asked at every schedule holding a round or a first round
    assert two["stats"]["horizon_calls"] >= len(set(rows["step"]))
    # one-call path: the policy called once per step, twice only in a step whose schedule held a
    # request's first round (its prefill ran in that step: nothing had asked its horizon)
    assert one["per_step"].max() == 2
    assert (one["per_step"] == 2).sum() == one["stats"]["horizon_calls"] == requests_first_steps
    # the decisions' calls are the same on both paths (one per step that decided something)
    assert one["per_step"].sum() - requests_first_steps == two["per_step"].sum() - two["stats"]["horizon_calls"]


def test_batch_1_one_call_equals_two_calls_on_a_recorded_run(engine, plain_reference, tmp_path):
    waves = [[p] for p in PROMPTS[:3]]  # one request at a time: each prefill step holds a first round
    compare_paths(engine, waves, plain_reference, tmp_path, requests_first_steps=3)


_KEEP: list = []


@pytest.fixture(scope="session")
def engine8(model_dirs):
    """A batch-8 engine kept for the whole session: neither shut down nor collected at this module's end.

    Its shutdown (explicit, or the LLM's finalizer when it is collected) tears down vLLM's in-process
    distributed state (the model-parallel groups) that the session's shared engine (conftest.py) uses in the
    modules that follow: 9 of them failed with "pipeline model parallel group is not initialized".
    """
    from vllm import LLM

    kw = llm_kwargs(dirs=model_dirs, max_num_seqs=8)
    kw.update(engine_kwargs(SpecenvSettings(record_tokens=True), tap=True))
    llm = LLM(**kw)
    _KEEP.append(llm)
    yield llm
    controller_of(llm).stop_recording()


def test_batch_8_one_call_equals_two_calls_on_a_recorded_run(engine8, plain_reference, tmp_path):
    waves = [(PROMPTS + PROMPTS)[:8]]  # 8 requests in one batch, their prefills in one step
    compare_paths(engine8, waves, plain_reference, tmp_path, requests_first_steps=1)


# ------------------------------------------------------------------ drafting after the outcome, one call
def compare_outcome_paths(llm, waves, plain_reference, tmp_path):
    """``draft_horizon="outcome"``: the peek inside the step is the step's decisions (one call) or not (two)."""
    one = served_run(llm, waves, True, tmp_path / "one", horizon="outcome")
    two = served_run(llm, waves, False, tmp_path / "two", horizon="outcome")
    prompts = [p for w in waves for p in w]
    for p, toks in zip(prompts, one["tokens"], strict=True):
        assert toks == plain_reference[p]["token_ids"], p
    assert one["tokens"] == two["tokens"]
    # every round equal: the k taken from the peek is the k the policy answers on the row _decide builds
    # (RowHash reads every bit of it: a row that differed in one bit would change the k)
    assert one["rows"] == two["rows"]
    assert one["stats"] == two["stats"]
    assert one["stats"]["decisions"] > 0 and one["stats"]["outcome_calls"] > 0
    assert one["stats"]["fallbacks"] == 0
    assert len(set(one["rows"]["policy_k"])) >= 3  # the hash moved the budget
    # one call per step against two (the peek inside the step, then the decisions), but in a step whose
    # requests all finished (the peek asked, nothing left to decide): at most one such step per request
    assert one["per_step"].max() == 1
    extra = two["per_step"] - one["per_step"]
    assert set(extra.tolist()) == {0, 1}
    assert extra[one["per_step"] == 0].sum() == 0
    assert (extra[one["per_step"] == 1] == 0).sum() <= len(prompts)


def test_batch_1_outcome_one_call_equals_two_calls(engine, plain_reference, tmp_path):
    compare_outcome_paths(engine, [[p] for p in PROMPTS[:3]], plain_reference, tmp_path)


def test_batch_8_outcome_one_call_equals_two_calls(engine8, plain_reference, tmp_path):
    compare_outcome_paths(engine8, [(PROMPTS + PROMPTS)[:8]], plain_reference, tmp_path)
