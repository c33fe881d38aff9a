"""The batch bound (oracle/batch/): valid against brute force, against every policy, and the split rule itself."""

from __future__ import annotations

import numpy as np
import pytest
from batch_bruteforce import joint_optimum

from oracle.batch import (
    batch_bound,
    expected_costs,
    expert_share,
    intercept_splits,
    lagrangian_costs,
    lagrangian_split,
    pathwise_costs,
    share_model,
    switch_costs,
    tail_model,
)
from oracle.dp import solve
from specenv.cost.batch import BatchCostModel
from specenv.cost.model import CostModel
from specenv.envs.batch import MoESpecBatchEnv
from specenv.replay.batch import ar_schedule_ms, request_draws
from specenv.traces.schema import ModelFacts
from specenv.traces.traceset import PositionArrays

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
    gaps: dict[tuple[str, str], list[float]] = {}
    for _trial in range(3):
        K = 2
        L0 = rng.integers(10, 60, size=3)
        arrays = _arrays(rng, 3, 4, K, greedy, L0)
        for kind, model in zip(("scaled", "rough"), _models(K, B, rng), strict=True):
            gens = rng.integers(0, 3, size=B + 1)  # one request more than slots: a refill happens
            joint = joint_optimum(arrays, L0, model, B, list(gens))
            old = _bound_cost(arrays, model, B, gens)
            lag = float(lagrangian_costs(arrays, model, B, np.asarray(gens)[None, :])[0][0])
            assert old <= joint * (1 + 1e-12)
            assert lag <= joint * (1 + 1e-12)  # the Lagrangian splits alone are valid, not only their max with old
            new = max(old, lag)  # what batch_bound(method="lagrangian") keeps
            ar = ar_schedule_ms(model, gens, arrays.lengths, L0, B)
            gaps.setdefault((kind, "old"), []).append((ar / old) / (ar / joint) - 1.0)
            gaps.setdefault((kind, "new"), []).append((ar / new) / (ar / joint) - 1.0)
    with capsys.disabled():
        for (kind, which), g in gaps.items():
            print(
                f"\nbatch bound ({which}) vs brute force, B={B} greedy={greedy} {kind} model: bound/optimum - 1 "
                f"mean {np.mean(g):.1%}, max {np.max(g):.1%}"
            )
    for kind in ("scaled", "rough"):
        assert np.all(np.array(gaps[kind, "new"]) <= np.array(gaps[kind, "old"]) + 1e-12)
    # tighter somewhere: the rough tables (non-monotone in P) leave the split rule room
    assert np.mean(gaps["rough", "new"]) < np.mean(gaps["rough", "old"])


@pytest.mark.parametrize("B", [2, 4])
def test_lagrangian_charges_never_exceed_the_step(B):
    """Full-batch Lagrangian charges on steps of exactly B requests, tail charges on steps of 1..B-1."""
    rng = np.random.default_rng(100 + B)
    K = 4
    L0 = rng.integers(10, 60, size=4)
    arrays = _arrays(rng, 4, 8, K, False, L0)
    Uk = arrays.U[:, : K + 1]
    weights = np.ones(4)
    for model in _models(K, B, rng):
        for expert in ("chord", "max"):
            full = lagrangian_split(arrays, model, B, weights, True, expert)
            tail = lagrangian_split(arrays, model, B, weights, False, expert)
            assert full is not None and tail is not None
            assert full.source["gap"] is not None and full.source["gap"] < 1e-3  # the cutting planes converged
            for _ in range(300):
                for ch, size in ((full, B), (tail, int(rng.integers(1, B)))):
                    rows = rng.integers(0, len(arrays.L), size=size)
                    k = rng.integers(0, K + 1, size=size)
                    u = Uk[rows, k]  # counts of the table (the charges hold on the table's U range)
                    L = rng.uniform(0, 4000, size=size)
                    step = model.step_ms(k, k, u, L)
                    tot = sum(
                        float(ch.charged_by_budget(Uk[rows[i]][:, None], L[i : i + 1])[k[i], 0]) for i in range(size)
                    )
                    assert tot <= step * (1 + 1e-12) + 1e-12
            # the switch from full to tail charges is optional: never above the full-charge optimum
            vf = solve(arrays, full).cost
            vs = switch_costs(arrays, full, solve(arrays, tail).value)
            assert np.all(vs <= vf * (1 + 1e-12)) and np.all(vs > 0)


@pytest.mark.parametrize("full", [True, False])
def test_chord_share_is_below_the_predicted_union(full):
    """sum_i e(U_i) <= U_batch of both predictors for every batch of counts in the range (B requests, or 1..B)."""
    rng = np.random.default_rng(7)
    B, K = 6, 4
    cm = CostModel.paper_profile(kmax=K)
    cm.top_k = FACTS.top_k
    base = BatchCostModel.from_cost_model(cm, FACTS, max_batch=B)
    lo, hi = 4.0, 40.0
    for i, model in enumerate((base, base.replace(predictor="independent", u_theta=1.0), base.replace(u_theta=0.1))):
        e0, eu, ew = expert_share(model, B, lo, hi, full)
        n = model.n_experts
        for _ in range(2000):
            size = B if full else int(rng.integers(1, B + 1))
            u = rng.choice([lo, hi, *rng.uniform(lo, hi, 3)], size=size)
            share = np.sum(e0 + eu * u - ew * np.log1p(-u / n))
            union = float(model.predict_u_batch(u))
            assert share <= union * (1 + 1e-12)
        if i < 2:  # the measured theta and independence: B requests at the top charge more than sum_i U_i / B = hi
            assert B * (e0 + eu * hi - ew * np.log1p(-hi / n)) > 1.2 * hi


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
    from policies.batch.controllers import DSDBatch, FixedBatch, GoodputBatch

    ds = str(small_traces) if dataset == "small" else dataset
    B = 3
    cm = "profile" if dataset == "small" else "fit"
    env = MoESpecBatchEnv(ds, batch_size=B, n_requests=5, split="test", cost_model=cm)
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

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
        assert bb.method == "lagrangian"
        assert bb.ar[0] == pytest.approx(info["ar_cost_ms"], rel=1e-12)
        assert max(realised) <= bb.speedup_pathwise[0] * (1 + 1e-12)
        if e == 0:  # never looser than the split rule alone
            old = batch_bound(arrays, env.data.L0, env.batch_cost, B, np.array([seeds]), method="linear")
            assert bb.speedup_pathwise[0] <= old.speedup_pathwise[0] * (1 + 1e-12)
            assert bb.speedup_expected[0] <= old.speedup_expected[0] * (1 + 1e-12)
            # the split rule's figures reported beside the bound are the split rule's own
            np.testing.assert_allclose(bb.linear_pathwise, old.pathwise, rtol=1e-12)
            assert bb.linear_summary() == old.summary()
        if arrays.greedy:
            assert bb.speedup_pathwise[0] == pytest.approx(bb.speedup_expected[0], rel=1e-12)
    # the draws the bound uses are the environment's
    assert [request_draws(s, arrays.lengths)[0] for s in seeds] == list(bb.generations[0])


def _pathwise_by_recursion(S, C, u, exit=None):
    """The pathwise bound from its definition: a memoised recursion over (t, j), one budget at a time."""
    import functools

    N, K = S.shape

    @functools.cache
    def V(t: int, j: int) -> float:
        if t >= N:
            return 0.0
        best = float("inf")
        for k in range(K + 1):
            a = 0
            while a < k and u[j] < S[t, a]:  # draft a+1 is accepted while u_j < P(a >= a+1 | t)
                a += 1
            a = min(a, N - t - 1)  # capped at the end
            best = min(best, float(C[t, k]) + V(t + a + 1, j + 1))
        return best if exit is None else min(best, float(exit[t, j]))

    import sys

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10 * N + 100))
    try:
        return V(0, 0)
    finally:
        sys.setrecursionlimit(old)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_pathwise_compiled_equals_numpy_bit_for_bit_and_the_recursion(K, monkeypatch):
    """The compiled pathwise loop (bound._pathwise_loop) gives the numpy reference's floats exactly, and both the
    definition's (a memoised recursion), with and without an exit table, on stochastic traces."""
    from oracle.batch import bound

    if bound._kernel() is None:
        pytest.skip("numba not available (or SPECENV_NUMBA=0): only the numpy form runs")
    rng = np.random.default_rng(260 + K)
    L0 = rng.integers(10, 60, size=5)
    arrays = _arrays(rng, 5, 40, K, False, L0)
    B = 3
    for model in _models(K, B, rng):
        full = share_model(model, B, K, full=True)
        tail = tail_model(share_model(model, B, K), full)
        for g in range(len(arrays.lengths)):
            N = int(arrays.lengths[g])
            for trial in range(3):
                u = rng.random(N) if trial else np.full(N, 0.5)
                fast = pathwise_costs(arrays, full, g, u, table=True)
                ref = bound.pathwise_costs_numpy(arrays, full, g, u, table=True)
                assert np.array_equal(fast, ref)
                S, C, uu = bound._pathwise_inputs(arrays, full, g, u)
                assert fast[0, 0] == pytest.approx(_pathwise_by_recursion(S, C, uu), rel=1e-12)
                # with the tail charge's table as the exit (lagrangian phase of batch_bound)
                vt = pathwise_costs(arrays, tail, g, u, table=True)
                assert np.array_equal(vt, bound.pathwise_costs_numpy(arrays, tail, g, u, table=True))
                v = pathwise_costs(arrays, full, g, u, exit=vt)
                assert v == bound.pathwise_costs_numpy(arrays, full, g, u, exit=vt)
                assert v == pytest.approx(_pathwise_by_recursion(S, C, uu, vt), rel=1e-12)
                assert v <= fast[0, 0]
                # batch_bound's sweep of several charges at once (only the reachable states, K+2 rows kept)
                flat = [full, tail, full, tail, full]
                many = bound._pathwise_values(arrays, flat, [-1, -1, -1, -1, 3], g, u)
                assert many == [fast[0, 0], vt[0, 0], fast[0, 0], vt[0, 0], v]
    # SPECENV_NUMBA=0: the numpy form runs, same floats
    u = rng.random(int(arrays.lengths[0]))
    on = pathwise_costs(arrays, full, 0, u)
    monkeypatch.setenv("SPECENV_NUMBA", "0")
    assert bound._kernel() is None
    assert pathwise_costs(arrays, full, 0, u) == on
    assert bound._pathwise_values(arrays, [full, tail, full], [-1, -1, 1], 0, u)[0] == on


def test_pathwise_nan_propagates_as_in_numpy():
    """A NaN charge or exit value gives the numpy form's NaN (numpy's min and minimum propagate it)."""
    from oracle.batch import bound

    if bound._kernel() is None:
        pytest.skip("numba not available (or SPECENV_NUMBA=0)")
    rng = np.random.default_rng(7)
    S = np.sort(rng.random((6, 2)), axis=1)[:, ::-1].copy()
    C = rng.uniform(1, 2, (6, 3))
    C[3, 1] = np.nan
    u = rng.random(6)
    V = bound._kernel()(S, C, u, np.zeros((0, 0)), False)
    assert np.isnan(V[3, :4]).all() and np.isfinite(V[4, :5]).all()
    ex = np.zeros((7, 7))
    ex[2, 1] = np.nan
    C[3, 1] = 1.5
    V = bound._kernel()(S, C, u, ex, True)
    assert np.isnan(V[2, 1]) and not np.isnan(V[2, 0])


@pytest.mark.parametrize("full", [True, False])
def test_multisets_built_as_arrays_equal_the_one_at_a_time_form(full):
    """The Lagrangian LP's rows and right-hand sides: same numbers, same order as the straightforward loop."""
    from oracle.batch.lagrangian import _multisets, _multisets_reference

    rng = np.random.default_rng(26)
    for B, K in [(1, 3), (2, 2), (3, 4), (5, 2), (4, 6)]:
        for model in _models(K, B, rng):
            A, b = _multisets(model, B, K, full)
            A0, b0 = _multisets_reference(model, B, K, full)
            assert A.dtype == A0.dtype and b.dtype == b0.dtype
            assert np.array_equal(A, A0) and np.array_equal(b, b0)


def test_batch_bound_reports_its_phases_and_matches_the_numpy_forms(monkeypatch):
    """batch_bound's progress: the Lagrangian splits (done of 4, each LP named), then the pathwise bounds; the
    compiled pathwise sweep gives the numpy reference's bounds exactly, episode by episode."""
    rng = np.random.default_rng(2626)
    K, B = 2, 3
    L0 = rng.integers(10, 60, size=4)
    arrays = _arrays(rng, 4, 30, K, False, L0)
    model = _models(K, B, rng)[0]
    seeds = rng.integers(0, 2**31, size=(2, 5))
    calls: list[tuple[int, int, str]] = []
    bb = batch_bound(arrays, L0, model, B, seeds, progress=lambda d, t, w: calls.append((d, t, w)))
    lag = [c for c in calls if c[2].startswith("lagrangian:")]
    path = [c for c in calls if not c[2].startswith("lagrangian:")]
    assert calls.index(path[0]) == len(lag)  # the splits first, then the pathwise bounds
    assert {t for _, t, _ in lag} == {4} and lag[-1][0] == 4
    assert [d for d, _, _ in lag] == sorted(d for d, _, _ in lag)
    assert any("cutting-plane LP 1" in w for _, _, w in lag)
    n = len({int(s) for s in seeds.ravel()})
    assert path[-1] == (2 * n, 2 * n, "pathwise bound")
    monkeypatch.setenv("SPECENV_NUMBA", "0")
    ref = batch_bound(arrays, L0, model, B, seeds)
    assert np.array_equal(bb.pathwise, ref.pathwise) and np.array_equal(bb.linear_pathwise, ref.linear_pathwise)
    assert np.array_equal(bb.expected, ref.expected)
