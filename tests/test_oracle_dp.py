"""Property tests of the exact oracle against brute-force enumeration of position-indexed policies."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import oracle
from oracle.delta import _separating_slope
from specenv.cost.model import CostModel
from specenv.traces.traceset import PositionArrays


# ------------------------------------------------------------------ random instances
def make_instance(seed: int, lengths: list[int], kmax: int, greedy: bool) -> tuple[PositionArrays, CostModel]:
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    if greedy:
        rho = (rng.random((n, kmax)) < 0.6).astype(np.float64)
    else:
        rho = rng.random((n, kmax))
        rho[rng.random((n, kmax)) < 0.15] = 1.0  # exact 0/1 mixed in
        rho[rng.random((n, kmax)) < 0.15] = 0.0
    U = np.cumsum(rng.uniform(0.0, 10.0, size=(n, kmax + 1)), axis=1)  # non-decreasing in k
    L = rng.uniform(1.0, 2000.0, size=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    arrays = PositionArrays(
        generation_ids=np.arange(len(lengths), dtype=np.int64) * 7 + 3,
        categories=np.array(["x"] * len(lengths), dtype=object),
        offsets=offsets,
        L=L,
        rho=rho,
        q=rho.copy(),
        U=U,
        greedy=greedy,
    )
    model = CostModel(
        beta0=rng.uniform(0.0, 10.0, kmax + 1),
        alpha=rng.uniform(0.0, 0.5, kmax + 1),
        c=rng.uniform(0.0, 0.002, kmax + 1),
        d1=float(rng.uniform(0.0, 1.0)),
        d0=float(rng.uniform(0.0, 0.5)),
        top_k=8,
    )
    return arrays, model


instances = st.builds(
    lambda seed, lengths, kmax, greedy, h: (*make_instance(seed, lengths, kmax, greedy), h),
    st.integers(0, 2**32 - 1),
    st.lists(st.integers(1, 8), min_size=1, max_size=3),
    st.integers(1, 3),
    st.booleans(),
    st.sampled_from([0, 0, 1, 2]),
)


# ------------------------------------------------------------------ brute force (independent code)
def pmf_from_rho(rho_t: np.ndarray, k: int) -> np.ndarray:
    """P(a) for a = 0..k straight from the conditional acceptances."""
    p = np.zeros(k + 1)
    reach = 1.0
    for a in range(k + 1):
        p[a] = reach * ((1.0 - rho_t[a]) if a < k else 1.0)
        if a < k:
            reach *= rho_t[a]
    return p


def policy_values(C: np.ndarray, rho: np.ndarray, pols: np.ndarray) -> np.ndarray:
    """V_p(t) for every policy row of ``pols`` (P, N) of one generation; shape (P, N+1)."""
    P, N = pols.shape
    K = C.shape[1] - 1
    V = np.zeros((P, N + 1))
    pm = np.zeros((N, K + 1, K + 1))  # pm[t, k, a]
    for t in range(N):
        for k in range(K + 1):
            pm[t, k, : k + 1] = pmf_from_rho(rho[t], k)
    for t in reversed(range(N)):
        k = pols[:, t]
        acc = C[t, k].copy()
        for a in range(K + 1):
            acc += pm[t, k, a] * V[:, min(t + a + 1, N)]
        V[:, t] = acc
    return V


def all_policies(N: int, K: int) -> np.ndarray:
    return np.array(list(itertools.product(range(K + 1), repeat=N)), dtype=np.int64)


def gen_slice(arrays: PositionArrays, g: int) -> slice:
    return slice(int(arrays.offsets[g]), int(arrays.offsets[g + 1]))


# ------------------------------------------------------------------ properties
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_dp_equals_brute_force_over_all_position_policies(inst) -> None:
    arrays, model, h = inst
    res = oracle.solve(arrays, model, lookahead=h)
    C = oracle.cost_table(arrays, model, lookahead=h)
    for g in range(arrays.n_generations):
        sl = gen_slice(arrays, g)
        N = int(arrays.lengths[g])
        pols = all_policies(N, arrays.kmax)
        V = policy_values(C[sl], arrays.rho[sl], pols)
        best = V.min(axis=0)[:N]
        np.testing.assert_allclose(res.value[sl], best, rtol=1e-10, atol=1e-9)
        assert res.cost[g] == pytest.approx(best[0], rel=1e-10, abs=1e-9)
        # the oracle's own policy, evaluated by brute force, attains V
        mine = np.flatnonzero((pols == res.k[sl]).all(axis=1))
        assert len(mine) == 1
        np.testing.assert_allclose(V[mine[0], :N], res.value[sl], rtol=1e-10, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(instances, st.integers(0, 2**32 - 1))
def test_exact_policy_evaluation_matches_brute_force_and_oracle_is_a_lower_bound(inst, pseed) -> None:
    arrays, model, h = inst
    res = oracle.solve(arrays, model, lookahead=h)
    C = oracle.cost_table(arrays, model, lookahead=h)
    rng = np.random.default_rng(pseed)
    policies: list[int | np.ndarray] = list(range(arrays.kmax + 1))
    policies += [rng.integers(0, arrays.kmax + 1, size=len(arrays.L)) for _ in range(3)]
    for pol in policies:
        ev = oracle.evaluate_policy(arrays, model, pol, lookahead=h)
        krows = np.full(len(arrays.L), pol) if isinstance(pol, int) else pol
        for g in range(arrays.n_generations):
            sl = gen_slice(arrays, g)
            N = int(arrays.lengths[g])
            V = policy_values(C[sl], arrays.rho[sl], krows[sl][None, :])[0, :N]
            np.testing.assert_allclose(ev.value[sl], V, rtol=1e-10, atol=1e-9)
        assert np.all(res.cost <= ev.cost * (1 + 1e-12) + 1e-9)
        assert np.all(res.value <= ev.value * (1 + 1e-12) + 1e-9)


@settings(max_examples=60, deadline=None)
@given(instances)
def test_value_finite_nonnegative_and_path_identities(inst) -> None:
    arrays, model, h = inst
    res = oracle.solve(arrays, model, lookahead=h)
    C = oracle.cost_table(arrays, model, lookahead=h)
    assert np.all(np.isfinite(res.value)) and np.all(res.value >= 0)
    assert np.all((res.k >= 0) & (res.k <= arrays.kmax))
    starts = arrays.offsets[:-1]
    assert np.all(res.occupancy[starts] == 1.0)
    assert np.all((res.occupancy >= -1e-12) & (res.occupancy <= 1 + 1e-12))
    # expected cost along the occupancy = V(0); rounds + accepted = N
    along = np.add.reduceat(res.occupancy * C[np.arange(len(C)), res.k], starts)
    np.testing.assert_allclose(along, res.cost, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(res.rounds + res.accepted_sum, res.lengths)
    assert np.all(res.rounds >= 1 - 1e-12) and np.all(res.rounds <= res.lengths + 1e-9)
    # a weighted mean of budgets in 0..kmax (k* may be kmax everywhere: allow the division's last-bit rounding)
    assert 0 <= res.mean_k <= arrays.kmax * (1 + 1e-12)
    # action values: min over k is V, argmin is k*
    Q = oracle.action_values(arrays, model, res.value, lookahead=h)
    np.testing.assert_allclose(Q.min(axis=1), res.value, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(Q[np.arange(len(Q)), res.k], res.value, rtol=1e-12, atol=1e-9)
    # AR cost never includes drafting
    np.testing.assert_allclose(res.ar, np.add.reduceat(model.ar_ms(arrays.L), starts))


@settings(max_examples=40, deadline=None)
@given(instances)
def test_greedy_traces_give_integer_counts_and_deterministic_simulation(inst) -> None:
    arrays, model, h = inst
    if not arrays.greedy:
        arrays = PositionArrays(
            arrays.generation_ids,
            arrays.categories,
            arrays.offsets,
            arrays.L,
            (arrays.rho > 0.5).astype(np.float64),
            arrays.q,
            arrays.U,
            True,
        )
    res = oracle.solve(arrays, model, lookahead=h)
    assert set(np.unique(res.occupancy)) <= {0.0, 1.0}
    for arr in (res.rounds, res.k_sum, res.accepted_sum):
        np.testing.assert_array_equal(arr, np.round(arr))
    sim = oracle.simulate(arrays, model, res.k, episodes=2, seed=1, lookahead=h)
    np.testing.assert_allclose(sim.cost, np.repeat(res.cost, 2), rtol=1e-12)
    np.testing.assert_array_equal(sim.rounds, np.repeat(res.rounds, 2))
    np.testing.assert_array_equal(sim.accepted_sum, np.repeat(res.accepted_sum, 2))
    np.testing.assert_array_equal(sim.visits > 0, res.occupancy > 0)


@settings(max_examples=30, deadline=None)
@given(instances)
def test_more_budgets_never_hurt_and_sweep_shape(inst) -> None:
    arrays, model, h = inst
    table = oracle.kmax_sweep(arrays, model, lookahead=h)
    assert list(table["kmax"]) == list(range(1, arrays.kmax + 1))
    s = table["s_max_pooled"].to_numpy()
    assert np.all(np.diff(s) >= -1e-12 * s[1:])
    assert np.all(table["mean_k"].to_numpy() <= table["kmax"].to_numpy() + 1e-12)
    assert np.all(table["best_fixed_speedup"].to_numpy() <= s * (1 + 1e-12))


@settings(max_examples=30, deadline=None)
@given(instances)
def test_delta_analysis_counts_every_rejected_candidate(inst) -> None:
    arrays, model, h = inst
    res = oracle.solve(arrays, model, lookahead=h)
    an = oracle.delta_analysis(arrays, model, lookahead=h, result=res)
    visited = int((res.occupancy > 1e-9).sum())
    assert an.decisions == visited
    assert an.points == visited * arrays.kmax
    assert sum(an.quadrants.values()) == an.points
    assert np.all(an.k != an.kstar)
    if np.any(np.abs(an.da) > an.tol_a):
        assert 0.0 <= an.sep_error <= 1.0
    else:  # every candidate on the dE[a] = 0 axis: no slope to fit
        assert np.isnan(an.lambda_sep)


# ------------------------------------------------------------------ deterministic checks
def test_stochastic_simulation_agrees_with_exact_evaluation() -> None:
    arrays, model = make_instance(11, [60, 45, 80], kmax=4, greedy=False)
    res = oracle.solve(arrays, model)
    sim = oracle.simulate(arrays, model, res.k, episodes=400, seed=3)
    s = sim.summary()
    for key, exact in (
        ("speedup_pooled", res.speedup_pooled),
        ("mean_k", res.mean_k),
        ("mean_accepted", res.mean_accepted),
    ):
        assert abs(s[key]["value"] - exact) < 3 * s[key]["ci95"] / 1.96 + 1e-12, key
    again = oracle.simulate(arrays, model, res.k, episodes=400, seed=3)
    np.testing.assert_array_equal(sim.cost, again.cost)


def test_hand_computed_two_position_instance() -> None:
    # N = 2, kmax = 1, rho = 1 at t = 0: one k = 1 round finishes; costs C(t,0) = 5, C(t,1) = 6
    arrays = PositionArrays(
        np.array([0]),
        np.array(["x"], dtype=object),
        np.array([0, 2]),
        L=np.zeros(2),
        rho=np.array([[1.0], [0.5]]),
        q=np.zeros((2, 1)),
        U=np.array([[8.0, 8.0], [8.0, 8.0]]),
        greedy=False,
    )
    model = CostModel(beta0=np.array([5.0, 6.0]), alpha=np.zeros(2), c=np.zeros(2), d1=0.0, d0=0.0, top_k=8)
    res = oracle.solve(arrays, model)
    assert res.cost[0] == pytest.approx(6.0)
    np.testing.assert_array_equal(res.k, [1, 0])
    assert res.speedup_pooled == pytest.approx(10.0 / 6.0)
    assert res.rounds[0] == pytest.approx(1.0) and res.accepted_sum[0] == pytest.approx(1.0)
    # the last position cannot use its accepted draft: k = 1 there costs 6 for the same progress
    np.testing.assert_allclose(oracle.evaluate_policy(arrays, model, 1).value, [6.0, 6.0])


def test_separating_slope_finds_a_separating_line() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(0.1, 3, 200), -rng.uniform(0.1, 3, 200)])
    ratio = np.concatenate([rng.uniform(2.5, 9, 200), rng.uniform(0.2, 1.9, 200)])
    y = ratio * x
    mu, err = _separating_slope(x, y, np.ones_like(x), 1e-9)
    assert err == 0.0
    assert 1.9 < mu < 2.5


def test_bad_inputs_raise() -> None:
    arrays, model = make_instance(1, [3], kmax=2, greedy=False)
    with pytest.raises(ValueError, match="budgets"):
        oracle.evaluate_policy(arrays, model, 3)
    with pytest.raises(ValueError, match="shape"):
        oracle.evaluate_policy(arrays, model, np.zeros(2, dtype=int))
    with pytest.raises(ValueError, match="lookahead"):
        oracle.solve(arrays, model, lookahead=-1)
    small = CostModel(beta0=np.ones(2), alpha=np.ones(2), c=np.ones(2), d1=0.1, d0=0.1, top_k=8)
    with pytest.raises(ValueError, match="with_kmax"):
        oracle.solve(arrays, small)
    with pytest.raises(ValueError, match="states"):
        oracle.delta_analysis(arrays, model, states="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="method"):
        oracle.boundary_slope(arrays, model, method="nope")  # type: ignore[arg-type]


def test_step_tables_are_built_once_per_positions_model_and_mode() -> None:
    from oracle import dp

    arrays, model = make_instance(5, [6, 3, 8], 3, greedy=False)
    lay, Ct, St = dp.step_tables(arrays, model)
    assert dp.step_tables(arrays, model)[1] is Ct  # the same tables, not rebuilt
    assert not Ct.flags.writeable and not St.flags.writeable
    # what a table depends on is in the key: the lookahead/drafting mode and the cost model's content
    assert dp.step_tables(arrays, model, 2, "block")[1] is not Ct
    assert dp.step_tables(arrays, model, 0, "sequential")[1] is not Ct
    other = dataclasses.replace(model, beta0=model.beta0 + 1.0)
    assert not np.array_equal(dp.step_tables(arrays, other)[1], Ct)
    # a copy of the positions is another table (identity), with equal contents
    copy = arrays.with_kmax(arrays.kmax)
    assert dp.step_tables(copy, model)[1] is not Ct and np.array_equal(dp.step_tables(copy, model)[1], Ct)
    # an entry goes with its positions table
    n = len(dp._TABLES)
    del copy
    assert len(dp._TABLES) == n - 1
    # a solve on cached tables equals one that builds them
    cached = oracle.solve(arrays, model)
    dp._TABLES.clear()
    fresh = oracle.solve(arrays, model)
    assert np.array_equal(cached.value, fresh.value) and np.array_equal(cached.k, fresh.k)
    assert np.array_equal(cached.occupancy, fresh.occupancy)


def test_survival_and_expected_accepted_of_one_row_equal_the_table_forms() -> None:
    from specenv.traces.traceset import expected_accepted_table, survival_table

    rng = np.random.default_rng(2)
    rho = rng.uniform(-0.1, 1.1, (6, 9))  # out of [0, 1] on purpose: clipped the same way
    table = expected_accepted_table(rho)
    for i in range(len(rho)):
        row = expected_accepted_table(rho[i])  # the 1-D path
        assert row.shape == (10,) and row[0] == 0.0 and np.array_equal(row, table[i])
        assert np.array_equal(survival_table(rho[i].copy()), survival_table(rho.T.copy(), axis=0)[:, i])
        want = np.cumsum(np.cumprod(np.clip(rho[i], 0.0, 1.0)))  # by hand: the sequential sums of products
        assert np.array_equal(row[1:], want)


@pytest.mark.parametrize("greedy", [False, True])
def test_wide_and_narrow_backward_steps_give_the_same_floats(monkeypatch, greedy) -> None:
    """The wide form of a backward step (row-wise cumsum, min/equal/max argmin) equals cumsum/argmin bit for bit."""
    from oracle import dp

    rng = np.random.default_rng(7)
    arrays, model = make_instance(11, [int(x) for x in rng.integers(1, 40, 60)], 6, greedy)
    monkeypatch.setattr(dp, "_KERNELS", None)  # the numpy sweeps (the compiled ones: tests/test_oracle_kernels.py)
    out = {}
    for wide in (1, 10**9):  # every step wide; every step narrow
        monkeypatch.setattr(dp, "_WIDE", wide)
        dp._TABLES.clear()
        best = oracle.solve(arrays, model)
        fixed = oracle.evaluate_policy(arrays, model, best.k)
        out[wide] = (best.value, best.k, best.occupancy, fixed.value)
    for a, b in zip(out[1], out[10**9], strict=True):
        assert a.tobytes() == b.tobytes()
    # ties (greedy tables have many): the smallest budget of least value in both forms
    assert np.array_equal(out[1][1], out[10**9][1])
