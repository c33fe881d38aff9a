"""A policy that decides a step jointly through the controller: one act(obs, ids, step) per step (the one protocol)."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import PROMPTS, controller_of, greedy  # noqa: E402


class Recording:
    """A stateful batch policy that records what it is given and answers k = 2 for every row."""

    name = "recording-batch"

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[tuple[int, ...], list[str]]] = []
        self.released: list[str] = []
        self.fail = fail

    def reset(self) -> None:
        self.calls.clear()

    def act(self, obs, streams=None, step=None):  # noqa: ANN001, ANN201
        self.calls.append((np.shape(obs), list(streams)))
        if self.fail:
            return np.zeros(len(streams) + 1, dtype=np.int64)  # wrong shape: every request gets the fallback
        return np.full(len(streams), 2)

    def release(self, streams) -> None:  # noqa: ANN001
        self.released += list(streams)


def test_batch_policy_gets_the_whole_step(engine, plain_reference):
    ctl = controller_of(engine)
    pol = Recording()
    ctl.set_policy(pol)
    seen: list[int] = []
    prev = ctl.round_callback  # the shared backend's own callback: put back afterwards

    def on_round(rid, out):  # noqa: ANN001, ANN202
        seen.append(out["K"])
        if prev is not None:
            prev(rid, out)

    ctl.round_callback = on_round
    try:
        outs = engine.generate(PROMPTS[:4], greedy(24), use_tqdm=False)
    finally:
        ctl.round_callback = prev
        ctl.set_policy(None)
    assert pol.calls, "act was never called"
    ids = {rid for _, streams in pol.calls for rid in streams}
    assert len(ids) == 4  # one stable id per request
    for shape, streams in pol.calls:
        assert shape[0] == len(streams) == len(set(streams)) and shape[1] == ctl.spec.dim
    assert max(len(s) for _, s in pol.calls) == 4  # the whole batch in one call
    assert sorted(pol.released) == sorted(ids)  # every finished request released
    rounds = [k for k in seen]
    assert rounds and set(rounds) <= {2} | set(range(0, 2))  # k = 2 (fewer only when fewer drafts existed)
    assert rounds.count(2) > len(rounds) // 2
    # greedy speculative decoding stays lossless
    for p, o in zip(PROMPTS[:4], outs, strict=True):
        assert list(o.outputs[0].token_ids) == plain_reference[p]["token_ids"][:24]


def test_batch_policy_wrong_shape_falls_back(engine):
    ctl = controller_of(engine)
    before, errors = ctl.stats["fallbacks"], list(ctl.stats["errors"])
    ctl.set_policy(Recording(fail=True))
    try:
        engine.generate(PROMPTS[:2], greedy(8), use_tqdm=False)
        fell_back = ctl.stats["fallbacks"] - before
        logged = ctl.stats["errors"][len(errors) :]
    finally:
        ctl.set_policy(None)
        # the session's engine is shared: leave its counters as they were (other tests count from 0)
        ctl.stats["fallbacks"], ctl.stats["errors"] = before, errors
    assert fell_back > 0
    if len(errors) < 5:  # the controller logs its first five errors
        assert any(re.search(r"act returned shape \((\d+),\) for (\d+) observations", e) for e in logged), logged


def test_exported_survival_controller_serves_and_decides_as_the_in_memory_one(engine, plain_reference, tmp_path):
    """The learned-survival batch controller, exported in numpy form, served on the live engine.

    The in-memory controller (a fitted scikit-learn regressor) is served first, every call recorded;
    the exported one (``policy.json`` + ``weights.npz``, numpy only) replays those calls -- the live
    engine's rows, request ids and batch features -- with the same budgets, and served itself it
    stays lossless.
    """
    from sklearn.neural_network import MLPRegressor

    from policies.batch.export import NumpyRegressor, export_survival, load_survival
    from policies.batch.learn import SurvivalGoodputBatch
    from specenv.cost.batch import BatchCostModel
    from specenv.observation.batch import BatchObservationSpec

    ctl = controller_of(engine)
    base = ctl.spec
    K, B = int(ctl.num_spec_tokens), int(ctl.vllm_config.scheduler_config.max_num_seqs)
    spec = BatchObservationSpec(base, B)
    rng = np.random.default_rng(0)
    X = rng.uniform(0, 1, size=(256, base.dim))
    Y = np.cumprod(rng.uniform(0.3, 1.0, size=(256, K)), axis=1)
    reg = MLPRegressor(hidden_layer_sizes=(16,), max_iter=50, random_state=0).fit(X, Y)
    bc = BatchCostModel.linear(
        b0=10.0, b_pos=0.5, alpha=0.1, c=0.0, b_req=0.2, d0=0.1, d_step=0.3, d_tok=0.05,
        kmax=K, max_batch=B, top_k=max(ctl.top_k, 1), n_experts=max(ctl.n_experts, 2), n_layers=2,
    )  # fmt: skip
    mem = SurvivalGoodputBatch(spec, bc, np.full(K + 1, float(max(ctl.top_k, 1))), reg)
    calls: list[tuple[np.ndarray, list[str], object, np.ndarray]] = []

    class Recorded:
        """The in-memory controller, each call's arguments and budgets kept."""

        name, spec, drafting, stateless = mem.name, mem.spec, mem.drafting, True

        def reset(self) -> None:
            mem.reset()

        def act(self, obs, ids=None, step=None):  # noqa: ANN001, ANN201
            k = mem.act(obs, ids, step)
            calls.append((np.array(obs, copy=True), list(ids), step, np.array(k, copy=True)))
            return k

    back = load_survival(export_survival(mem, tmp_path / "ctl"))
    assert isinstance(back.model, NumpyRegressor)
    outs = {}
    for name, pol in (("memory", Recorded()), ("exported", back)):
        ctl.set_policy(pol)
        try:
            outs[name] = engine.generate(PROMPTS[:4], greedy(24), use_tqdm=False)
        finally:
            ctl.set_policy(None)
    assert calls and max(len(ids) for _, ids, _, _ in calls) > 1  # the live steps held several requests
    for obs, ids, step, k in calls:
        np.testing.assert_array_equal(back.act(obs, ids, step), k)
    for name, res in outs.items():
        for p, o in zip(PROMPTS[:4], res, strict=True):
            assert list(o.outputs[0].token_ids) == plain_reference[p]["token_ids"][:24], name
