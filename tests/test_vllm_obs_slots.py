"""The vLLM controller's observation slots (:class:`specenv.engines.vllm.bookkeeping.ObsSlots`).

The controller folds a step's rounds with ``update`` and then builds the observations of the same rows with
``subset(slots, reuse=True)``: the subset ``update`` left is reused (no second gather) only while it still
equals the state's rows. No vLLM needed.
"""

from __future__ import annotations

import numpy as np

from specenv.engines.vllm.bookkeeping import ObsSlots
from specenv.observation.single import ObservationSpec, ObservationState

SPEC = ObservationSpec(kmax=4, lookahead=0, max_new_tokens=64, n_experts=64)


def _reference(rounds: list[tuple[int, int, int, float, float]], n: int) -> ObservationState:
    """One ObservationState per stream, updated round by round (what the slots must equal)."""
    ref = ObservationState(SPEC, n)
    for slot, k, acc, U, cost in rounds:
        mask = np.zeros(n, dtype=bool)
        mask[slot] = True
        v = np.zeros(n)
        ref.update(v + k, v + acc, v + U, v + cost, v + acc + 1, mask=mask)
    return ref


def test_update_then_reused_subset_equals_a_fresh_gather():
    rng = np.random.default_rng(0)
    s = ObsSlots(SPEC, n=4)
    slots = [s.alloc() for _ in range(6)]  # grows the state past its first size
    history = []
    for _ in range(20):
        pick = rng.choice(slots, size=int(rng.integers(1, 5)), replace=False)
        k = rng.integers(0, SPEC.kmax + 1, size=len(pick))
        acc = np.minimum(k, rng.integers(0, SPEC.kmax + 1, size=len(pick)))
        U = rng.uniform(4, 40, size=len(pick))
        cost = rng.uniform(0.5, 3.0, size=len(pick))
        s.update(np.asarray(pick, dtype=np.intp), k.astype(np.int64), acc.astype(np.int64), U, cost)
        history += list(zip(pick.tolist(), k.tolist(), acc.tolist(), U.tolist(), cost.tolist(), strict=True))
        L, t = rng.uniform(10, 500, size=len(pick)), rng.uniform(0, 60, size=len(pick))
        reused = s.subset(pick.tolist(), reuse=True).build(L, t).copy()
        fresh = s.subset(pick.tolist()).build(L, t)  # a plain subset gathers again
        np.testing.assert_array_equal(reused, fresh)
    ref = _reference(history, s.state.n)
    np.testing.assert_array_equal(s.state._P[slots], ref._P[slots])
    np.testing.assert_array_equal(s.state._E[slots], ref._E[slots])


def test_reuse_only_while_the_subset_is_the_last_update():
    s = ObsSlots(SPEC, n=8)
    a, b = s.alloc(), s.alloc()
    one = np.array([1]), np.array([1]), np.array([10.0]), np.array([1.5])
    s.update(np.array([a], dtype=np.intp), *one)
    sub = s.subset([a], reuse=True)
    assert s.subset([a], reuse=True) is sub  # the rows update left, as they are
    assert s.subset([b], reuse=True) is sub  # same size: the scratch, gathered again for b ...
    np.testing.assert_array_equal(sub._E[0], s.state._E[b])  # ... with b's rows
    s.update(np.array([a], dtype=np.intp), *one)
    hyp = s.subset([a])  # a hypothetical update on a plain subset ...
    hyp.update(np.array([4]), np.array([4]), np.array([30.0]), np.array([9.0]), np.array([5.0]))
    got = s.subset([a], reuse=True)  # ... is never reused: gathered from the state again
    np.testing.assert_array_equal(got._E, s.state._E[[a]])
    np.testing.assert_array_equal(got._P, s.state._P[[a]])
    s.update(np.array([a], dtype=np.intp), *one)
    c = s.alloc()  # a new slot (its row reset) ends the reuse
    assert s._fresh is None
    s.update(np.array([a], dtype=np.intp), *one)
    s.release(c)
    assert s._fresh is None


def test_alloc_resets_a_reused_slot_to_the_priors():
    s = ObsSlots(SPEC, n=2)
    a = s.alloc()
    s.update(np.array([a], dtype=np.intp), np.array([3]), np.array([2]), np.array([20.0]), np.array([2.0]))
    s.release(a)
    b = s.alloc()
    assert b == a
    fresh = ObservationState(SPEC, 1)
    np.testing.assert_array_equal(s.state._E[b], fresh._E[0])
    np.testing.assert_array_equal(s.state._P[b], fresh._P[0])


def test_mlp_policy_marks_rows_with_non_finite_scores_invalid():
    """The served MLP: argmax per row; -1 (an invalid k, replaced by the controller) where a score is not finite."""
    from specenv.policy.mlp import MLPPolicy

    rng = np.random.default_rng(1)
    n_out = SPEC.kmax + 1
    layers = [(rng.normal(size=(SPEC.dim, 8)), np.zeros(8)), (rng.normal(size=(8, n_out)), np.zeros(n_out))]
    pol = MLPPolicy(SPEC, layers)
    obs = rng.uniform(0, 1, size=(5, SPEC.dim)).astype(np.float32)
    want = np.argmax(pol.scores(obs), axis=1)
    got = pol.act(obs, list(range(5)))
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)
    obs[1, :] = np.nan
    obs[3, 2] = np.nan
    got = pol.act(obs, list(range(5)))
    assert got[1] == -1 and got[3] == -1
    np.testing.assert_array_equal(got[[0, 2, 4]], want[[0, 2, 4]])
    huge = [(np.full((SPEC.dim, 8), 1e30), np.zeros(8)), (np.full((8, n_out), 1e30), np.arange(n_out, dtype=float))]
    ks = MLPPolicy(SPEC, huge, activation="relu").act(np.ones((2, SPEC.dim), dtype=np.float32), [0, 1])
    assert (ks == -1).all()  # float32 overflow: inf scores are invalid too


def test_update_after_a_what_if_of_the_same_rounds_equals_folding_again():
    """draft_horizon="outcome": the what-if of a round's known outcome is folded; update of it scatters those rows."""
    rng = np.random.default_rng(3)
    plain, memo = ObsSlots(SPEC, n=4), ObsSlots(SPEC, n=4)
    slots = [plain.alloc() for _ in range(5)]
    assert [memo.alloc() for _ in range(5)] == slots
    history = []
    for step in range(30):
        pick = np.asarray(rng.choice(slots, size=int(rng.integers(1, 5)), replace=False), dtype=np.intp)
        k = rng.integers(0, SPEC.kmax + 1, size=len(pick))
        acc = np.minimum(k, rng.integers(0, SPEC.kmax + 1, size=len(pick)))
        U = rng.uniform(4, 40, size=len(pick))
        cost = rng.uniform(0.5, 3.0, size=len(pick))
        L, t = rng.uniform(10, 500, size=len(pick)), rng.uniform(0, 60, size=len(pick))
        # the outcome step's what-if, then the real fold: of the same rounds, or (every 3rd step) another U
        memo.what_if(pick, k.astype(np.float64), U, L, t, accepted=acc.astype(np.float64), cost=cost)
        U_real = U if step % 3 else U + 1.0
        for s in (plain, memo):
            s.update(pick, k.astype(np.int64), acc.astype(np.int64), U_real, cost)
        history += list(zip(pick.tolist(), k.tolist(), acc.tolist(), U_real.tolist(), cost.tolist(), strict=True))
        np.testing.assert_array_equal(memo.state._P, plain.state._P)
        np.testing.assert_array_equal(memo.state._E, plain.state._E)
        # the subset update left is reusable (its rows are the state's) on both
        np.testing.assert_array_equal(
            memo.subset(pick.tolist(), reuse=True).build(L, t), plain.subset(pick.tolist()).build(L, t)
        )
    ref = _reference(history, plain.state.n)
    np.testing.assert_array_equal(memo.state._E[slots], ref._E[slots])
    # a slot released and allocated between the what-if and the update: folded again from its priors
    a = slots[0]
    memo.what_if(np.array([a]), np.array([2.0]), [9.0], np.array([50.0]), np.array([3.0]), accepted=np.array([1.0]))
    memo.release(a)
    assert memo.alloc() == a
    memo.update(np.array([a], dtype=np.intp), np.array([2]), np.array([1]), np.array([9.0]), np.array([1.0]))
    fresh = ObservationState(SPEC, 1)
    fresh.update(np.array([2]), np.array([1]), np.array([9.0]), np.array([1.0]), np.array([2.0]))
    np.testing.assert_array_equal(memo.state._E[a], fresh._E[0])
