"""The compiled sweeps (oracle.kernels, numba) against the numpy sweeps of oracle.dp: the same floats, bit for bit.

The brute-force tests of tests/test_oracle_dp.py check the path ``oracle.solve`` takes (the compiled one
where numba is installed); these tie the numpy fallback to it, state by state, on random tables with
ties (greedy), exact 0/1 acceptances, lookahead charges, single-position generations and K = 0 and 1.
"""

from __future__ import annotations

import numpy as np
import pytest

import oracle
from oracle import dp
from oracle.caps import evaluate_joint, solve_joint
from tests.test_oracle_dp import make_instance

pytest.importorskip("numba")
kernels = pytest.importorskip("oracle.kernels")


@pytest.fixture
def numpy_only(monkeypatch):
    """Run oracle.dp on its numpy sweeps (as without numba, or with SPECENV_NUMBA=0)."""

    def use(on: bool) -> None:
        monkeypatch.setattr(dp, "_KERNELS", None if on else kernels)
        dp._TABLES.clear()

    return use


def _instances():
    rng = np.random.default_rng(2028)
    for case in range(12):
        kmax = [0, 1, 3, 6, 10][case % 5]
        lengths = [int(x) for x in rng.integers(1, 60, int(rng.integers(1, 40)))]
        lengths[0] = 1  # a generation of one position
        yield case, kmax, lengths, bool(case % 2)


def test_the_compiled_kernels_are_the_ones_in_use() -> None:
    dp._KERNELS = False  # look them up again, as a fresh process does
    assert dp._kernels() is kernels


@pytest.mark.parametrize(("seed", "kmax", "lengths", "greedy"), list(_instances()))
def test_compiled_sweeps_equal_the_numpy_sweeps_bit_for_bit(seed, kmax, lengths, greedy) -> None:
    arrays, model = make_instance(seed, lengths, kmax, greedy)
    lay, Ct, St = dp.step_tables(arrays, model)
    rng = np.random.default_rng(seed)
    pol = rng.integers(0, kmax + 1, len(arrays.L))
    for policy in (None, pol, np.zeros_like(pol), np.full_like(pol, kmax)):
        Vc, kc = dp._backward(Ct, St, lay, policy)  # compiled (the tables are the cache's, read-only)
        Vn, kn = dp._backward_numpy(Ct, St, lay, policy)
        assert Vc.tobytes() == Vn.tobytes() and kc.tobytes() == kn.tobytes()
        oc, on = dp._forward(St, kc, lay), dp._forward_numpy(St, kn, lay)
        assert oc.tobytes() == on.tobytes()
        # writeable copies (the benchmark's tables) take the same kernel
        assert dp._backward(Ct.copy(), St.copy(), lay, policy)[0].tobytes() == Vn.tobytes()
    # the optimal budgets are the least-value ones, smallest first (checked here without the sweeps)
    if kmax:
        q = dp.action_values(arrays, model, dp.solve(arrays, model).value)
        assert np.array_equal(dp.solve(arrays, model).k, np.argmin(q, axis=1))


@pytest.mark.parametrize("h", [0, 2])
@pytest.mark.parametrize("drafting", [None, "sequential"])
def test_solve_and_evaluate_give_the_same_bytes_with_and_without_numba(numpy_only, h, drafting) -> None:
    arrays, model = make_instance(5, [int(x) for x in np.random.default_rng(5).integers(1, 300, 50)], 8, False)
    out = {}
    for off in (False, True):
        numpy_only(off)
        best = oracle.solve(arrays, model, lookahead=h, drafting=drafting)
        fixed = oracle.evaluate_policy(arrays, model, 3, lookahead=h, drafting=drafting)
        out[off] = [
            x.tobytes()
            for e in (best, fixed)
            for x in (e.cost, e.value, e.k, e.occupancy, e.rounds, e.k_sum, e.accepted_sum)
        ]
    assert out[False] == out[True]


def test_the_joint_oracle_gives_the_same_bytes_with_and_without_numba(numpy_only) -> None:
    """oracle.caps evaluates through dp._backward / dp._forward (its own extra hook stays numpy)."""
    from tests.test_oracle_caps import make_caps

    arrays, model = make_instance(9, [7, 30, 1, 18], 4, False)
    caps = make_caps(arrays, 2, 9)
    out = {}
    for off in (False, True):
        numpy_only(off)
        best = solve_joint(arrays, model, 0.5, caps=caps)
        ev = evaluate_joint(arrays, model, (best.k, best.cap), caps=caps)
        out[off] = [x.tobytes() for e in (best, ev) for x in (e.cost, e.value, e.occupancy, e.mismatches, e.lpgap)]
    assert out[False] == out[True]


def test_specenv_numba_0_selects_the_numpy_sweeps(monkeypatch) -> None:
    monkeypatch.setattr(dp, "_KERNELS", False)
    monkeypatch.setenv("SPECENV_NUMBA", "0")
    assert dp._kernels() is None
    monkeypatch.setattr(dp, "_KERNELS", False)
    monkeypatch.setenv("SPECENV_NUMBA", "1")
    assert dp._kernels() is kernels


@pytest.mark.parametrize("order", ["C", "F"])
def test_compiled_gather_into_step_order_equals_numpy_take(numpy_only, order) -> None:
    arrays, _ = make_instance(4, [3, 1, 12, 7, 7], 5, False)
    lay = dp._Layout.of(arrays)
    x = np.asarray(np.random.default_rng(4).normal(size=(len(arrays.L), 6)), order=order)
    numpy_only(False)
    got = lay.to_steps(x)
    numpy_only(True)
    want = lay.to_steps(x)
    assert got.tobytes() == want.tobytes()
    assert np.array_equal(want, x[lay.perm].T)  # by hand: row perm[c] of x is column c
