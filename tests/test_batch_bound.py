"""The batch bound (oracle/batch.py): valid against brute force, against every policy, and the split rule itself."""

from __future__ import annotations

import numpy as np
import pytest

from oracle.batch import (
    batch_bound,
    expected_costs,
    intercept_splits,
    joint_optimum,
    pathwise_costs,
    share_model,
    tail_model,
)
from oracle.dp import solve
from specenv.batchcost import BatchCostModel
from specenv.batchreplay import ar_schedule_ms, request_draws
from specenv.costmodel import CostModel
from specenv.envs.batch import MoESpecBatchEnv
from specenv.schema import ModelFacts
from specenv.traceset import PositionArrays

FACTS = ModelFacts(n_layers=6, n_experts=64, top_k=4)


def _arrays(rng: np.random.Generator, G: int, nmax: int, K: int, greedy: bool, L0: np.ndarray) -> PositionArrays:
    lens = rng.integers(2, nmax + 1, size=G)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    n = int(offsets[-1])
    rho = (rng.random((n, K)) < 0.7).astype(float) if greedy else rng.uniform(0.2, 0.95, (n, K))
    U = np.cumsum(np.concatenate([np.full((n, 1), 4.0), rng.uniform(0.5, 3.0, (n, K))], axis=1), axis=1)
    t = np.arange(n) - np.repeat(offsets[:-1], lens)
    L = (np.repeat(L0, lens) + t).astype(float)
    return PositionArrays(np.arange(G), np.array(["x"] * G, dtype=object), offsets, L, rho, rho.copy(), U, greedy)


def _models(K: int, B: int, rng: np.random.Generator) -> list[BatchCostModel]:
    cm = CostModel.paper_profile(kmax=K)
    cm.top_k = FACTS.top_k
    scaled = BatchCostModel.from_cost_model(cm, FACTS, max_batch=B)
    rough = BatchCostModel(  # categorical tables that are not monotone in P
        beta0=rng.uniform(2.0, 6.0, B * (K + 1)),
        alpha=rng.uniform(0.0, 0.3, B * (K + 1)),
        c=rng.uniform(0.0, 0.01, B * (K + 1)),
        b_req=0.4,
        d0=0.2,
        d_step=0.5,
        d_tok=0.3,
        kmax=K,
        max_batch=B,
        top_k=FACTS.top_k,
        n_experts=FACTS.n_experts,
        n_layers=FACTS.n_layers,
    )
    return [scaled, rough]


def _bound_cost(arrays, model, B, gens):
    return float(expected_costs(arrays, model, B, np.asarray(gens)[None, :])[0][0])


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("B", [2, 3])
def test_bound_is_above_the_brute_force_joint_optimum(B, greedy, capsys):
    rng = np.random.default_rng(10 * B + greedy)
    gaps: dict[str, list[float]] = {"scaled": [], "rough": []}
    for _trial in range(3):
        K = 2
        L0 = rng.integers(10, 60, size=3)
        arrays = _arrays(rng, 3, 4, K, greedy, L0)
        for kind, model in zip(("scaled", "rough"), _models(K, B, rng), strict=True):
            gens = rng.integers(0, 3, size=B + 1)  # one request more than slots: a refill happens
            joint = joint_optimum(arrays, L0, model, B, list(gens))
            lower = _bound_cost(arrays, model, B, gens)
            assert lower <= joint * (1 + 1e-12)
            ar = ar_schedule_ms(model, gens, arrays.lengths, L0, B)
            gaps[kind].append((ar / lower) / (ar / joint) - 1.0)
    with capsys.disabled():
        for kind, g in gaps.items():
            print(
                f"\nbatch bound vs brute force, B={B} greedy={greedy} {kind} model: bound/optimum speedup - 1 "
                f"mean {np.mean(g):.1%}, max {np.max(g):.1%}"
            )


@pytest.mark.parametrize("B", [2, 4, 8])
def test_split_rule_never_charges_more_than_the_step(B):
    """General and tail charges on any step of n <= B requests; full-batch charges on steps of exactly B."""
    rng = np.random.default_rng(B)
    K = 6
    for model in _models(K, B, rng):
        general = [share_model(model, B, K, s) for s in [None, *intercept_splits(model, B, K)]]
        full = [share_model(model, B, K, s, full=True) for s in [None, *intercept_splits(model, B, K, full=True)]]
        tails = [tail_model(g, f) for g in general for f in full]
        for _ in range(300):
            n = int(rng.integers(1, B + 1))
            for charges, size in ((general + tails, n), (full, B)):
                k = rng.integers(0, K + 1, size=size)
                u = np.clip(4.0 * (k + 1) * rng.uniform(0.5, 1.0, size), 4.0, 64.0)
                L = rng.uniform(0, 4000, size=size)
                step = model.step_ms(k, k, u, L)
                for share in charges:
                    assert float(np.sum(share.charged_ms(k, u, L))) <= step * (1 + 1e-12) + 1e-12


def test_fair_share_at_batch_one_is_the_single_request_cost():
    from oracle.batch import FairShare

    rng = np.random.default_rng(2)
    K = 4
    cm = CostModel.paper_profile(kmax=K)
    model = BatchCostModel.from_cost_model(cm, ModelFacts(48, 128, 8), max_batch=1)
    L0 = rng.integers(10, 60, size=3)
    arrays = _arrays(rng, 3, 6, K, False, L0)
    U = np.maximum(arrays.U, 8.0)
    np.testing.assert_allclose(
        FairShare(model, 1).charged_table(U, arrays.L, K), cm.charged_table(U, arrays.L, K), rtol=1e-12
    )


def test_pathwise_equals_the_ssp_on_greedy_traces_and_is_below_realisations():
    rng = np.random.default_rng(0)
    L0 = rng.integers(10, 60, size=4)
    model = _models(3, 2, rng)[0]
    greedy = _arrays(rng, 4, 12, 3, True, L0)
    share = share_model(model, 2, 3, full=True)
    V = solve(greedy, share).cost
    for g in range(4):
        assert pathwise_costs(greedy, share, g, rng.random(greedy.lengths[g])) == pytest.approx(V[g], rel=1e-12)


@pytest.mark.parametrize("dataset", ["live-vllm", "small"])
def test_bound_is_above_every_policy_on_every_episode(dataset, small_traces):
    """Pathwise bound >= the realised speedup of fixed, random and adaptive budgets, episode by episode."""
    from policies.batch import DSDBatch, FixedBatch, GoodputBatch

    ds = str(small_traces) if dataset == "small" else dataset
    B = 3
    cm = "profile" if dataset == "small" else "fit"
    env = MoESpecBatchEnv(ds, batch_size=B, n_requests=5, split="test", cost_model=cm)
    from specenv.datasets import load_dataset
    from specenv.replay import select_positions

    arrays = select_positions(load_dataset(ds), env.kmax, "test")
    rng = np.random.default_rng(1)
    spec = env.spec_batch
    policies = [
        FixedBatch(spec, 2),
        FixedBatch(spec, env.kmax),
        DSDBatch(spec, "1-1:4;2-3:2"),
        GoodputBatch(spec, env.batch_cost, arrays.U.mean(0)),
    ]
    for e in range(3):
        seeds = None
        realised = []
        for pol in [*policies, "random"]:
            obs, info = env.reset(seed=100 + e)
            seeds = info["seeds"]
            done = False
            while not done:
                k = rng.integers(0, env.kmax + 1, size=B) if pol == "random" else pol.act(obs)
                obs, _, done, _, info = env.step(k)
            realised.append(info["speedup"])
        bb = batch_bound(arrays, env.data.L0, env.batch_cost, B, np.array([seeds]), pathwise=True)
        assert bb.ar[0] == pytest.approx(info["ar_cost_ms"], rel=1e-12)
        assert max(realised) <= bb.speedup_pathwise[0] * (1 + 1e-12)
        if arrays.greedy:
            assert bb.speedup_pathwise[0] == pytest.approx(bb.speedup_expected[0], rel=1e-12)
    # the draws the bound uses are the environment's
    assert [request_draws(s, arrays.lengths)[0] for s in seeds] == list(bb.generations[0])
