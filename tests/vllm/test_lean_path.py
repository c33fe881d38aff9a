"""The controller's lean per-step path gives the old path's records: same rows, observations and decisions.

``lean_reference.json`` was written by the controller before the lean path (commit 806c87d: per-round
dicts and rows, a routing copy and two routing reads per step, ``span_expert_stats``) with
``python tests/vllm/test_lean_path.py OUT.json`` on the shipped ``small-moe-v1``: the same workload on a
fresh engine of the same settings (batch 1, then 4 concurrent requests; greedy; no prefix caching), a
policy whose k depends on every bit of the observation it gets, rounds priced by the ``live-cpu`` cost
model fitted on its train split (so that no observation depends on the machine's clock). The test
replays the workload through the current controller and compares every recorded column that does not
depend on the clock, every observation vector and the batch features the policy saw, and the generated tokens.

One in-process engine of its own (``max_num_seqs=4``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import KMAX, PROMPTS, controller_of, greedy, llm_kwargs  # noqa: E402

REFERENCE = Path(__file__).with_name("lean_reference.json")
TOKENS = 24
#: Columns of the recording that do not depend on the machine's clock (``generation_id`` and ``step``
#: are compared relative to the run's first).
COLUMNS = (
    "generation_id",
    "round",
    "K",
    "m",
    "accepted",
    "accepted_raw",
    "L",
    "t",
    "U_r",
    "E_max",
    "step",
    "batch_size",
    "batch_tokens",
    "drafted",
    "policy_k",
    "fallback",
    "capped",
    "greedy",
    "timing",
    "run",
    "category",
    "verified_tokens",
)


class ObsHash:
    """A stateless policy whose k is a hash of the exact observation row; logs what it was given."""

    name = "obs-hash"
    stateless = True

    def __init__(self, spec):
        self.spec = spec
        self.obs: list[list[list[float]]] = []
        self.steps: list[list[float]] = []

    def reset(self):
        pass

    def act(self, obs, ids=None, step=None):
        self.obs.append(obs.tolist())
        self.steps.append([step.n_active, step.queue, step.prev_U_batch])
        h = obs.astype(np.float64).view(np.uint64).sum(axis=1, dtype=np.uint64)
        return (h % np.uint64(KMAX + 1)).astype(np.int64)


def make_engine(dirs):
    from vllm import LLM

    from specenv.engines.vllm import SpecenvSettings, engine_kwargs
    from specenv.engines.vllm.tap import register

    register()
    kw = llm_kwargs(dirs, max_num_seqs=4, enable_prefix_caching=False)
    kw.update(engine_kwargs(SpecenvSettings(record_tokens=True), tap=True))
    return LLM(**kw)


def workload(llm, folder) -> dict:
    """Two requests one at a time, then four at once, recorded; the doc the reference holds."""
    from policies.bench.context import build_context
    from specenv.engines.vllm import load_recording
    from specenv.observation.single import ObservationSpec

    ctl = controller_of(llm)
    # a fitted cost model prices every round (prev_cost), so that no observation depends on the clock
    ctl.cost_model = build_context("live-cpu", KMAX, "fit-train", None).cost_model
    pol = ObsHash(ObservationSpec(KMAX, 0, TOKENS, ctl.n_experts or 128))
    ctl.set_policy(pol)
    ctl.start_recording(str(folder), run="lean", category="code")
    tokens = []
    for p in PROMPTS[:2]:
        tokens += [list(o.outputs[0].token_ids) for o in llm.generate([p], greedy(TOKENS), use_tqdm=False)]
    tokens += [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[2:6], greedy(TOKENS), use_tqdm=False)]
    ctl.stop_recording()
    ctl.set_policy(None)
    ctl.cost_model = None
    r = load_recording(folder).rounds.sort_values(["step", "generation_id"]).reset_index(drop=True)
    r["generation_id"] -= r["generation_id"].min()
    r["step"] -= r["step"].min()
    rows = {c: [v.tolist() if isinstance(v, np.ndarray) else v for v in r[c]] for c in COLUMNS}
    timed = bool((r["T_T_ms"] > 0).all() and (r["step_ms"] >= r["T_T_ms"]).all())
    return {"model": "small-moe-v1", "rows": rows, "obs": pol.obs, "steps": pol.steps,
            "tokens": tokens, "timed": timed}  # fmt: skip


#: Engines of this module kept alive for the whole session: garbage-collecting an in-process vLLM engine
#: tears down the process-wide distributed state that the session's shared engine still uses.
_ALIVE: list = []


@pytest.fixture(scope="module")
def lean_llm(model_dirs):
    llm = make_engine(model_dirs)
    _ALIVE.append(llm)
    yield llm
    controller_of(llm).stop_recording()


def test_lean_path_records_what_the_old_path_recorded(lean_llm, model_dirs, tmp_path):
    ref = json.loads(REFERENCE.read_text())
    if model_dirs.source.name != ref["model"]:
        pytest.skip("the reference was recorded on the shipped small-moe-v1 (tiny test models in use)")
    got = workload(lean_llm, tmp_path / "rec")
    assert got["tokens"] == ref["tokens"]
    assert len(got["obs"]) == len(ref["obs"])
    for i, (a, b) in enumerate(zip(got["obs"], ref["obs"], strict=True)):
        assert a == b, f"act call {i}: observation differs"
    assert got["steps"] == ref["steps"]
    for c in COLUMNS:
        assert got["rows"][c] == ref["rows"][c], c
    assert got["timed"] and ref["timed"]
    # the workload exercised what the lean path changed: batch 1 and 4, k = 0 rounds, several k in a step
    rows = ref["rows"]
    assert set(rows["batch_size"]) >= {1, 4} and 0 in rows["K"] and len(set(rows["K"])) == KMAX + 1


if __name__ == "__main__":  # write the reference: python tests/vllm/test_lean_path.py OUT.json
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import tempfile

    from specenv.engines.vllm.models import vllm_model_dirs

    with tempfile.TemporaryDirectory() as tmp:
        doc = workload(make_engine(vllm_model_dirs("small-moe-v1")), Path(tmp) / "rec")
    Path(sys.argv[1]).write_text(json.dumps(doc))
