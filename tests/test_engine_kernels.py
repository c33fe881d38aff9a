"""The compiled bookkeeping kernels of a live engine (:mod:`specenv.engines.kernels`) against their numpy forms.

Each kernel must give the numpy form's numbers bit for bit: the expert statistics of a forward
(:class:`specenv.engines.base.StepExperts`, and :func:`specenv.engines.base.span_expert_stats`, the
reference written without buffers), the what-if rows of :class:`specenv.engines.vllm.bookkeeping.ObsSlots`
and the scatter of a what-if fold by ``update``; and fall back to numpy where a kernel does not apply (a budget
above the statistics' table, an expert id out of range). numba is a dependency of the project: the
compiled forms must be there. No vLLM needed.
"""

from __future__ import annotations

import numpy as np
import pytest

from specenv.engines.base import StepExperts, span_expert_stats
from specenv.engines.kernels import kernels
from specenv.engines.vllm.bookkeeping import ObsSlots
from specenv.observation.single import ObservationSpec

SPEC = ObservationSpec(kmax=6, lookahead=0, max_new_tokens=128, n_experts=64)


def test_the_kernels_compile_here_and_switch_off_with_the_environment_variable(monkeypatch) -> None:
    assert kernels() is not None
    assert StepExperts(2, 8, 2, 16)._kernel is not None
    monkeypatch.setenv("SPECENV_NUMBA", "0")
    assert kernels() is None
    assert StepExperts(2, 8, 2, 16)._kernel is None
    assert ObsSlots(SPEC)._kernels is None


def _spans(rng: np.random.Generator, T: int) -> tuple[list[int], list[int]]:
    """Random non-overlapping passes in a forward of T tokens, with tokens of no pass between them."""
    offsets, lens, t = [], [], int(rng.integers(0, 3))
    while t < T:
        m = int(rng.integers(1, 9))
        if t + m > T:
            break
        offsets.append(t)
        lens.append(m)
        t += m + int(rng.integers(0, 3))
    return offsets, lens


@pytest.mark.parametrize("shape", [(6, 64, 4), (3, 128, 8), (2, 16, 1)])
def test_expert_counts_equal_the_numpy_form_bit_for_bit(shape: tuple[int, int, int]) -> None:
    L, E, k = shape
    rng = np.random.default_rng(L * E + k)
    compiled, numpy_form = StepExperts(L, E, k, 64), StepExperts(L, E, k, 64, compiled=False)
    assert compiled._kernel is not None and numpy_form._kernel is None
    buf = np.zeros((L, 256, k), dtype=np.int32)  # a tap's host buffer: the forward's tokens are a slice of it
    seen_one = False
    for trial in range(60):
        T = int(rng.integers(1, 60))
        for layer in range(L):
            for t in range(T):
                buf[layer, t] = rng.choice(E, size=k, replace=False)
        routing = buf[:, :T]
        if trial % 4 == 0:  # one pass filling the forward (batch 1: the numpy form's fast path)
            offsets, lens = [0], [T]
            seen_one = True
        else:
            offsets, lens = _spans(rng, T)
            if not offsets:
                continue
        U, Em, union = compiled.step(routing, offsets, lens)
        U0, E0, union0 = numpy_form.step(routing, offsets, lens)
        np.testing.assert_array_equal(U, U0)
        np.testing.assert_array_equal(Em, E0)
        assert union == union0
        # and the reference without buffers
        Ur, Er = span_expert_stats(routing, list(zip(offsets, lens, strict=True)), E)
        np.testing.assert_array_equal(U, Ur)
        np.testing.assert_array_equal(Em, Er)
        # the union by hand: experts any token of the forward reached, mean over layers
        assert union == np.mean([len(set(routing[layer].ravel().tolist())) for layer in range(L)])
    assert seen_one


def test_an_expert_id_out_of_range_fails_as_the_numpy_form_does() -> None:
    routing = np.zeros((2, 3, 2), dtype=np.int32)
    routing[:, :, 1] = 1
    routing[1, 2, 0] = 9  # no expert 9 of 8
    with pytest.raises(ValueError):
        StepExperts(2, 8, 2, 16, compiled=False).step(routing, [0], [3])
    with pytest.raises(ValueError):
        StepExperts(2, 8, 2, 16).step(routing, [0], [3])


def test_what_if_rows_and_their_commit_equal_the_numpy_form_bit_for_bit() -> None:
    """Random steps: what-if rows (outcome known or not, cost known or not), then the rounds that ran folded.

    The rounds that ran are the what-if's (the commit), or differ in one value (folded again), or come
    with a NaN cost (never equal); budgets above the statistics' table take the numpy form in both.
    """
    rng = np.random.default_rng(7)
    fast, ref = ObsSlots(SPEC, n=4), ObsSlots(SPEC, n=4, compiled=False)
    assert fast._kernels is not None and ref._kernels is None
    slots = [fast.alloc() for _ in range(6)]
    assert [ref.alloc() for _ in range(6)] == slots
    commits = 0
    for step in range(200):
        n = int(rng.integers(1, 6))
        pick = np.asarray(rng.choice(slots, size=n, replace=False), dtype=np.intp)
        top = SPEC.kmax + (3 if step % 37 == 5 else 0)  # now and then a budget above the table
        k = rng.integers(0, top + 1, size=n).astype(np.float64)
        acc = np.minimum(k, rng.integers(0, top + 1, size=n)).astype(np.float64)
        U = rng.uniform(4, 40, size=n)
        cost = rng.uniform(0.5, 3.0, size=n)
        L = rng.integers(10, 3000, size=n).astype(np.float64)
        t = rng.integers(1, 200, size=n).astype(np.float64)
        kw = {}
        if step % 3:
            kw["accepted"] = acc
        if step % 2:
            kw["cost"] = cost
        a = fast.what_if(pick, k, U, L, t, **kw)
        b = ref.what_if(pick, k, U, L, t, **kw)
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(fast.state._P, ref.state._P)  # a what-if changes nothing
        # the rounds that ran
        ran_acc = kw.get("accepted", k).astype(np.int64)
        ran_cost = kw["cost"].copy() if "cost" in kw else fast._folded[1][3].copy()
        mode = step % 5
        if mode == 3:
            ran_cost[0] += 0.25  # another round: folded again
        if mode == 4:
            ran_cost[-1] = np.nan  # never equal
        commits += mode < 3
        args = (pick, k.astype(np.int64), ran_acc, U.copy(), ran_cost)
        fast.update(*args)
        ref.update(*args)
        np.testing.assert_array_equal(fast.state._P, ref.state._P)
        np.testing.assert_array_equal(fast.state._E, ref.state._E)
        # the rows the controller then builds from the subset update left
        Ls, ts = L + 1.0, t + 1.0
        np.testing.assert_array_equal(
            fast.subset(pick, reuse=True).build(Ls, ts), ref.subset(pick, reuse=True).build(Ls, ts)
        )
        # the one-call horizon's rows: the step's rows, then per request K = 0..c-1 all accepted
        counts = rng.integers(1, SPEC.kmax + 2, size=n)
        K = np.concatenate([np.arange(c, dtype=np.float64) for c in counts])
        src = np.concatenate([np.arange(n), np.repeat(np.arange(n), counts)])
        K1 = K + 1.0
        lay = (src, K, K1, np.concatenate([np.zeros(n), K1]), rng.uniform(4, 40, size=len(K)))
        np.testing.assert_array_equal(
            fast.stacked(pick, L.tolist(), t.tolist(), *lay), ref.stacked(pick, L.tolist(), t.tolist(), *lay)
        )
        np.testing.assert_array_equal(fast.state._E, ref.state._E)  # (and changes nothing)
    assert commits > 50


@pytest.mark.parametrize("folder", ["live-vllm-wide-v1/ppo", "live-vllm-v1/dqn"])
def test_compiled_mlp_budgets_equal_the_numpy_form_except_float32_ties(folder: str) -> None:
    """The served three-layer MLP (one compiled call) answers as ``MLPPolicy._act_rows`` off near-ties.

    Its scores are summed in float64 and rounded (numpy sums float32 in BLAS's order): a budget may
    differ only where numpy's two best scores are within 1e-4 of each other. Rows: uniform over the
    observation Box, the Box's corners, and rows with a NaN or an infinite feature (budget -1 where a
    score is not finite).
    """
    from pathlib import Path

    from specenv.engines.vllm.served import ServedPolicy
    from specenv.policy.mlp import MLPPolicy

    pol = MLPPolicy.load(Path(__file__).resolve().parents[1] / "policies" / "shipped" / folder)
    served = ServedPolicy(pol, pol.spec, 8)
    assert served._mlp is not None and served._mlp[-1] == (pol.activation == "relu")
    rng = np.random.default_rng(3)
    hi = pol.spec.high()
    rows = (rng.random((20000, pol.spec.dim)) * hi).astype(np.float32)
    rows[:2000] = np.where(rng.random((2000, pol.spec.dim)) < 0.5, 0.0, hi)  # corners of the Box
    rows[-3, 4] = np.nan
    rows[-2, 0] = np.inf
    rows[-1] = -np.inf
    want = pol._act_rows(rows)
    got = served.act(rows, [None] * len(rows), None)
    assert got.dtype == np.int64 and got.shape == want.shape
    np.testing.assert_array_equal(got[-3:], want[-3:])  # (an infinite input may saturate to finite scores)
    assert got[-3] == -1  # a NaN feature: no valid budget
    top2 = np.sort(pol.scores(rows[:-3]), axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-4
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(got[:-3][clear], want[:-3][clear])
    assert (got[:-3] != want[:-3]).sum() <= (~clear).sum()
    assert len(set(want[:-3].tolist())) > 1  # the rows reach several budgets


def test_a_policy_not_of_that_shape_keeps_its_own_rows() -> None:
    from specenv.engines.vllm.served import ServedPolicy, compiled_mlp
    from specenv.policy.mlp import MLPPolicy

    spec = ObservationSpec(kmax=3, lookahead=0, max_new_tokens=64, n_experts=64)
    rng = np.random.default_rng(0)
    two = MLPPolicy(spec, [(rng.normal(size=(spec.dim, 8)), np.zeros(8)), (rng.normal(size=(8, 4)), np.zeros(4))])
    assert compiled_mlp(two) is None
    obs = rng.random((5, spec.dim)).astype(np.float32)
    np.testing.assert_array_equal(ServedPolicy(two, spec, 4).act(obs, list(range(5)), None), two._act_rows(obs))
