"""The joint (k, expert cap) oracle against brute force, against the k-only oracle, and its frontier."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

import oracle
from oracle.caps import evaluate_joint, frontier, joint_action_values, solve_joint
from specenv.replay.caps import joint_tables
from tests.test_oracle_dp import make_instance


def make_caps(arrays, n_levels: int, seed: int, zero_mis: bool = False):
    """Random caps extension over the rows of ``arrays``: capped acceptance, cheaper U, some mismatches."""
    rng = np.random.default_rng(seed + 1)
    K, n = arrays.kmax, len(arrays.L)
    acc = np.zeros((n_levels, K + 1, n), dtype=np.int64)
    for k in range(1, K + 1):
        acc[:, k, :] = rng.integers(0, k + 1, size=(n_levels, n))
    U = np.repeat(arrays.U.T[None], n_levels, axis=0) * rng.uniform(0.3, 1.0, size=(n_levels, K + 1, n))
    U[:, 0, :] = arrays.U[:, 0]
    mis = np.zeros((n_levels, K + 1, n))
    if not zero_mis:
        mis[:, 1:, :] = rng.integers(0, 3, size=(n_levels, K, n)) * (rng.random((n_levels, K, n)) < 0.4)
    lpgap = np.where(mis > 0, rng.uniform(0.0, 2.0, size=mis.shape), 0.0)
    return SimpleNamespace(caps=np.arange(2, 2 + 2 * n_levels, 2), acc=acc, U=U, mis=mis, lpgap=lpgap)


def _brute(arrays, caps, model, lam_units: float):
    """Min over every position-indexed joint policy of cost + lam * mismatches, per generation.

    Independent of the oracle's sweep: a plain recursion per policy, costs from ``CostModel.charged_ms``.
    """
    tab = joint_tables(arrays, model, caps=caps)
    lam = lam_units * tab.unit_ms
    K = arrays.kmax
    C = len(caps.caps)
    S = arrays.survival()
    acts = [(0, 0)] + [(k, c) for k in range(1, K + 1) for c in range(C + 1)]
    best = []
    for g in range(arrays.n_generations):
        lo, N = int(arrays.offsets[g]), int(arrays.lengths[g])

        def value(policy, t=0, lo=lo, N=N):
            if t >= N:
                return 0.0
            k, c = policy[t]
            r = lo + t
            if c == 0:
                cost = float(model.charged_ms(k, arrays.U[r, k], arrays.L[r]))
                probs = [1.0] + [S[r, i - 1] for i in range(1, k + 1)] + [0.0]
                return cost + sum((probs[a] - probs[a + 1]) * value(policy, t + a + 1, lo, N) for a in range(k + 1))
            a = int(caps.acc[c - 1, k, r])
            committed = min(a + 1, N - t)
            cost = float(model.charged_ms(k, caps.U[c - 1, k, r], arrays.L[r]))
            return cost + lam * min(caps.mis[c - 1, k, r], committed) + value(policy, t + a + 1, lo, N)

        best.append(min(value(p) for p in itertools.product(acts, repeat=N)))
    return np.array(best)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("lam_units", [0.0, 0.7])
def test_joint_oracle_equals_brute_force(seed, lam_units):
    arrays, model = make_instance(seed, [3, 4, 2], kmax=2, greedy=seed % 2 == 0)
    caps = make_caps(arrays, 2, seed)
    res = solve_joint(arrays, model, lam_units, caps=caps)
    np.testing.assert_allclose(res.value[arrays.offsets[:-1]], _brute(arrays, caps, model, lam_units), rtol=1e-12)
    # the optimal policy evaluated exactly reproduces the penalised value
    ev = evaluate_joint(arrays, model, (res.k, res.cap), caps=caps)
    np.testing.assert_allclose(ev.cost, res.cost, rtol=1e-12)
    np.testing.assert_allclose(ev.mismatches, res.mismatches, rtol=1e-12, atol=1e-12)
    tab = joint_tables(arrays, model, caps=caps)
    np.testing.assert_allclose(res.cost + lam_units * tab.unit_ms * res.mismatches, res.value[arrays.offsets[:-1]])


@pytest.mark.parametrize("seed", range(4))
def test_no_cap_level_is_the_k_only_oracle_bit_for_bit(seed):
    arrays, model = make_instance(seed, [5, 9, 1, 7], kmax=3, greedy=seed % 2 == 1)
    empty = SimpleNamespace(
        caps=np.zeros(0, dtype=np.int64),
        acc=np.zeros((0, 4, len(arrays.L))),
        U=np.zeros((0, 4, len(arrays.L))),
        mis=np.zeros((0, 4, len(arrays.L))),
        lpgap=np.zeros((0, 4, len(arrays.L))),
    )
    joint = solve_joint(arrays, model, caps=empty)
    ref = oracle.solve(arrays, model)
    assert np.array_equal(joint.value, ref.value)
    assert np.array_equal(joint.k, ref.k)
    assert np.array_equal(joint.cost, ref.cost)
    assert not joint.cap.any() and joint.mismatch_rate == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_joint_bound_at_least_the_k_only_bound_per_generation(seed):
    arrays, model = make_instance(seed, [12, 30, 7], kmax=3, greedy=seed % 2 == 0)
    caps = make_caps(arrays, 3, seed)
    ref = oracle.solve(arrays, model)
    for w in (0.0, 1.0, float("inf")):
        joint = solve_joint(arrays, model, w, caps=caps)
        # penalised value never above the k-only cost (the uncapped actions are a subset)
        assert np.all(joint.value[arrays.offsets[:-1]] <= ref.cost * (1 + 1e-12))
    speed = solve_joint(arrays, model, caps=caps)
    assert np.all(speed.speedup >= ref.speedup * (1 - 1e-12))
    assert speed.speedup_pooled > ref.speedup_pooled  # the random caps are cheaper somewhere


def test_caps_that_change_nothing_give_the_k_only_value():
    arrays, model = make_instance(3, [10, 6], kmax=3, greedy=True)
    K, n = arrays.kmax, len(arrays.L)
    acc = np.zeros((1, K + 1, n), dtype=np.int64)
    surv = arrays.survival()
    for k in range(1, K + 1):
        acc[0, k] = (surv[:, :k] > 0.5).sum(axis=1)
    same = SimpleNamespace(
        caps=np.array([4]),
        acc=acc,
        U=arrays.U.T[None].copy(),
        mis=np.zeros((1, K + 1, n)),
        lpgap=np.zeros((1, K + 1, n)),
    )
    joint = solve_joint(arrays, model, float("inf"), caps=same)
    np.testing.assert_allclose(joint.value, oracle.solve(arrays, model).value, rtol=1e-12)


def test_fixed_policy_evaluation_matches_dp_and_counts_mismatches():
    arrays, model = make_instance(5, [9, 14], kmax=3, greedy=False)
    caps = make_caps(arrays, 2, 5)
    # uncapped fixed k equals oracle.dp's evaluation
    ev = evaluate_joint(arrays, model, (2, 0), caps=caps)
    np.testing.assert_allclose(ev.cost, oracle.evaluate_policy(arrays, model, 2).cost, rtol=1e-12)
    assert ev.mismatch_rate == 0.0
    # a fixed cap with fixed k on a deterministic path: walk it by hand
    ev = evaluate_joint(arrays, model, (3, 2), caps=caps)
    for g in range(arrays.n_generations):
        lo, N, t, cost, mis = int(arrays.offsets[g]), int(arrays.lengths[g]), 0, 0.0, 0.0
        while t < N:
            r = lo + t
            a = int(caps.acc[1, 3, r])
            cost += float(model.charged_ms(3, caps.U[1, 3, r], arrays.L[r]))
            mis += min(caps.mis[1, 3, r], min(a + 1, N - t))
            t += a + 1
        assert ev.cost[g] == pytest.approx(cost, rel=1e-12)
        assert ev.mismatches[g] == pytest.approx(mis, rel=1e-12)
    assert ev.capped_share == 1.0


def test_action_values_and_frontier_are_monotone():
    arrays, model = make_instance(11, [20, 25, 18], kmax=3, greedy=True)
    caps = make_caps(arrays, 3, 11)
    tab = joint_tables(arrays, model, caps=caps)
    res = solve_joint(arrays, model, 0.5, caps=caps)
    Q = joint_action_values(arrays, tab, model, res.value, quality_weight=0.5)
    np.testing.assert_allclose(Q.min(axis=1), res.value, rtol=1e-12)
    assert np.array_equal(Q.argmin(axis=1), res.cap * (arrays.kmax + 1) + res.k)
    pts = frontier(arrays, model, (0.0, 0.1, 1.0, 10.0, float("inf")), caps=caps)
    speed = [p.speedup_pooled for p in pts]
    rate = [p.mismatch_rate for p in pts]
    assert all(a >= b - 1e-12 for a, b in zip(speed, speed[1:], strict=False))  # more weight, less speed
    assert all(a >= b - 1e-12 for a, b in zip(rate, rate[1:], strict=False))  # ... and fewer mismatches
    assert rate[-1] == 0.0 and rate[0] > 0.0


def test_bad_caps_are_refused_with_the_array_named():
    arrays, model = make_instance(1, [4], kmax=2, greedy=True)
    caps = make_caps(arrays, 1, 1)
    caps.acc[0, 1, 2] = 2
    with pytest.raises(ValueError, match=r"caps.acc\[0, 1, 2\] = 2"):
        solve_joint(arrays, model, caps=caps)
    caps = make_caps(arrays, 1, 1)
    caps.U = caps.U[:, :, :-1]
    with pytest.raises(ValueError, match="caps.U: shape"):
        solve_joint(arrays, model, caps=caps)
