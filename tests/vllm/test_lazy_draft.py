"""The lazy drafter: idle steps skip the draft forward, speculation resumes lossless and KV-consistent.

A stateless policy alternates stretches of k = 0 (every request, so the controller's
``draft_horizon="policy"`` asks the drafter for nothing and :class:`LazyDraftProposer` skips it) with
stretches of k = 3 (the drafter runs again and first catches the skipped positions up). Checked at
batch 1 (the shared engine) and batch 8 (an engine of its own):

* lossless: every output equals plain greedy decoding (the reference engine without speculation);
* KV-consistent: every round's K, accepted count and verified tokens equal those of the same engine
  with the drafter run in every step (vLLM's own behaviour, ``lazy = False``) -- the drafts after a
  catch-up are the drafts of a drafter that never skipped;
* the check can fail (batch 8, a fresh engine): skipping *without* the catch-up stays lossless but
  changes the accepted counts (the draft then attends over KV gaps);
* the skip happened (the proposer's counters).
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


def drafter_of(llm) -> LazyDraftProposer:
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    drafter = worker.model_runner.drafter
    assert isinstance(drafter, LazyDraftProposer), type(drafter)
    return drafter


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


def run(llm, prompts, rec):
    ctl = controller_of(llm)
    shutil.rmtree(rec, ignore_errors=True)
    ctl.start_recording(str(rec))
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    ctl.stop_recording()
    return [list(o.outputs[0].token_ids) for o in outs], rounds(rec)


def check(llm, prompts, reference, tmp_path, control: bool = False):
    """Lazy vs eager drafter on ``prompts``; with ``control``, first a run that skips without catching up.

    The control runs first on a fresh engine: the slots its skipped positions leave unwritten hold no
    earlier run's KV (a later run of the same prompts could find the very values an earlier run
    wrote there, and the control could not tell the difference).
    """
    ctl = controller_of(llm)
    spec = ObservationSpec(kmax=KMAX, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)
    ctl.set_policy(Stretches(spec))
    ctl.settings.draft_horizon = "policy"
    drafter = drafter_of(llm)
    try:
        if control:
            drafter.catch_up = False
            gap_out, gap_rounds = run(llm, prompts, tmp_path / "gaps")
            drafter.catch_up = True
        before = dict(drafter.stats)
        lazy_out, lazy_rounds = run(llm, prompts, tmp_path / "lazy")
        after = dict(drafter.stats)
        drafter.lazy = False
        eager_out, eager_rounds = run(llm, prompts, tmp_path / "eager")
    finally:
        drafter.lazy, drafter.catch_up = True, True
        ctl.set_policy(None)
        ctl.settings.draft_horizon = "max"
    for p, out in zip(prompts, lazy_out, strict=True):
        assert out == reference[p]["token_ids"], p
    assert after["skipped"] > before["skipped"] and after["catchups"] > before["catchups"]
    # every skipped step left one position per request to catch up, except the last stretch of k = 0
    # of a request that ends in it (nothing drafts after it)
    assert after["caught_up"] > 0
    assert {r[2] for r in lazy_rounds} == {0, 3}  # both stretches ran
    assert lazy_out == eager_out
    assert lazy_rounds == eager_rounds  # the same drafts were accepted, round by round
    if control:
        for p, out in zip(prompts, gap_out, strict=True):
            assert out == reference[p]["token_ids"], p  # gaps in the draft KV never change the output
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


def test_engines_above_max_seqs_keep_vllms_drafter():
    # the lazy drafter is installed up to MAX_SEQS concurrent sequences only (a batch-16 run corrupted the
    # heap; see lazydraft.MAX_SEQS): a larger runner keeps vLLM's own proposer, untouched
    from types import SimpleNamespace

    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    from specenv.engines.vllm import lazydraft

    for n in (lazydraft.MAX_SEQS + 1, 16, 256):
        drafter = object.__new__(DraftModelProposer)  # no engine needed: make_lazy decides on the runner
        assert lazydraft.make_lazy(SimpleNamespace(drafter=drafter, max_num_reqs=n)) is None
        assert type(drafter) is DraftModelProposer
    assert lazydraft.MAX_SEQS >= 8  # batch 1 and 8 are what test_batch_*_idle_steps_* prove lossless here
