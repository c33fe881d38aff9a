"""Batch > 1 through the controller: one act per step, a k per request, one recorded row per request and round.

One in-process engine of its own (``max_num_seqs=8``, controller + routing tap, and vLLM's dynamic
speculative decoding table so that the engine without a policy is the ``dynamic`` arm of ``specenv
abtest``), plus the session's plain greedy reference: two engines for this module.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import KMAX, PROMPTS, controller_of, greedy, llm_kwargs  # noqa: E402

from specenv.engines.vllm import SpecenvSettings, engine_kwargs, load_recording  # noqa: E402
from specenv.observation.single import ObservationSpec  # noqa: E402

TOKENS = 16
BATCH = 8
#: 8 concurrent requests (the 6 test prompts, then the first two again).
REQUESTS = [*PROMPTS, *PROMPTS[:2]]
DYNAMIC_SD = [(1, 1, 2), (2, BATCH, 3)]


@pytest.fixture(scope="module")
def llm8(model_dirs, plain_reference_proc):
    from vllm import LLM

    from specenv.engines.vllm.tap import register

    register()
    kw = llm_kwargs(model_dirs, max_num_seqs=BATCH, enable_prefix_caching=False)
    kw["speculative_config"] = {**kw["speculative_config"], "num_speculative_tokens_per_batch_size": DYNAMIC_SD}
    kw.update(engine_kwargs(SpecenvSettings(), tap=True))
    llm = LLM(**kw)
    yield llm
    controller_of(llm).stop_recording()


@pytest.fixture
def ctl(llm8):
    c = controller_of(llm8)
    yield c
    c.stop_recording()
    c.set_policy(None)
    c.settings.draft_horizon = "max"


def generate(llm, prompts, batch):
    """Token ids per request, ``batch`` concurrent requests at a time."""
    out = []
    for i in range(0, len(prompts), batch):
        out += [
            list(o.outputs[0].token_ids) for o in llm.generate(prompts[i : i + batch], greedy(TOKENS), use_tqdm=False)
        ]
    return out


def expected(reference, prompts):
    return [reference[p]["token_ids"][:TOKENS] for p in prompts]


class BatchProbe:
    """A stateless policy: a different k per row, recording every act call (the one protocol)."""

    name = "batch-probe"
    stateless = True

    def __init__(self, spec):
        self.spec = spec
        self.sizes = []

    def reset(self):
        pass

    def act(self, obs, ids=None, step=None):
        n = len(obs)
        self.sizes.append(n)
        return (np.arange(n) + len(self.sizes)) % (self.spec.kmax + 1)


def test_eight_concurrent_requests_one_act_per_step_own_k_one_row_per_round(llm8, ctl, plain_reference, tmp_path):
    probe = BatchProbe(ObservationSpec(KMAX, 0, TOKENS, ctl.n_experts or 128))
    ctl.set_policy(probe)
    ctl.start_recording(str(tmp_path / "rec"), run="batch8")
    decisions0, steps0 = ctl.stats["decisions"], ctl.steps_logged
    outs = generate(llm8, REQUESTS, BATCH)
    ctl.stop_recording()
    assert outs == expected(plain_reference, REQUESTS)
    # one call per engine step that had drafts to trim, on the whole batch
    steps = ctl.steps_logged - steps0
    assert 1 <= len(probe.sizes) <= steps
    assert max(probe.sizes) == BATCH
    assert sum(probe.sizes) == ctl.stats["decisions"] - decisions0
    r = load_recording(tmp_path / "rec").rounds
    assert not r.duplicated(["request_id", "round"]).any()  # one row per request per round
    assert not r.duplicated(["request_id", "step"]).any()
    assert r["request_id"].nunique() == BATCH
    per_req = r.groupby("request_id")["round"].agg(["min", "max", "count"])
    assert (per_req["min"] == 0).all() and (per_req["count"] == per_req["max"] + 1).all()
    # every request verified its own k: the policy's (capped at what the drafter proposed: this engine's
    # dynamic-SD table drafts 3 tokens at batch > 1), several different k in the same step
    assert (r["K"] == np.minimum(r["policy_k"], r["drafted"])).all()
    assert (r["capped"] == (r["policy_k"] > r["drafted"])).all()
    full = r.groupby("step").filter(lambda g: len(g) == BATCH)
    assert len(full) and (full.groupby("step")["K"].nunique() > 1).all()
    assert (r.groupby("step").size() <= r.groupby("step")["batch_size"].first()).all()


@pytest.mark.parametrize("batch", [1, BATCH])
def test_every_arm_is_identical_to_plain_greedy(llm8, ctl, plain_reference, batch):
    from policies.bench.context import build_context
    from specenv.abtest import make_policy

    c = build_context("live-cpu", KMAX, "fit-train", None)
    pdesc = {"kmax": KMAX, "max_new_tokens": TOKENS}
    arms = [None]  # no policy: vLLM's dynamic speculative decoding table
    arms += [{"kind": "fixed", "k": k, **pdesc} for k in range(KMAX + 1)]
    arms += [{"kind": "heuristic", **pdesc}, {"kind": "constant-mlp", "k": 2, **pdesc}]
    cm = c.cost_model
    path = None
    delta = {"kind": "delta", "u_prior": c.u_prior.tolist(), "rho_prior": c.rho_prior.tolist(), **pdesc}
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/cm.json"
        cm.save(path)
        arms += [
            {**delta, "cost_model": path, "lam_ms": float(c.lam_ms)},
            {**delta, "cost_model": path, "adaptive": True},
        ]
        prompts = REQUESTS[:2] if batch == 1 else REQUESTS
        want = expected(plain_reference, prompts)
        for desc in arms:
            ctl.set_policy(None if desc is None else make_policy(desc, ctl))
            ctl.settings.draft_horizon = "policy" if desc is not None else "max"
            fb = ctl.stats["fallbacks"]
            assert generate(llm8, prompts, batch) == want, desc
            assert ctl.stats["fallbacks"] == fb, (desc, ctl.stats["errors"])
