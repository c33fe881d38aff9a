"""The belief oracle (oracle/belief.py): its calibration, and where it sits against the clairvoyant bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oracle.belief import belief_oracle, fit_belief, fit_draft_belief
from oracle.dp import evaluate_policy, solve
from specenv.traces.traceset import PositionArrays


def _arrays(rho: np.ndarray, q: np.ndarray, lengths: list[int]) -> PositionArrays:
    n, K = rho.shape
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    assert offsets[-1] == n
    return PositionArrays(
        generation_ids=np.arange(len(lengths), dtype=np.int64),
        categories=np.array(["c"] * len(lengths), dtype=object),
        offsets=offsets,
        L=np.arange(n, dtype=np.float64) + 10.0,
        rho=rho,
        q=q,
        U=np.full((n, K + 1), 8.0),
        greedy=bool(np.all((rho == 0) | (rho == 1))),
    )


def test_depth_prior_is_the_frequency_among_rounds_that_reach_the_depth() -> None:
    # four rows, K = 2. Depth 1 accepted in rows 0, 1, 2 (3/4). Depth 2 counts only where depth 1 was
    # accepted: rows 0, 1, 2 with depth-2 outcomes 1, 0, 1 -> 2/3 (row 3's depth-2 "1" is never reached).
    rho = np.array([[1, 1], [1, 0], [1, 1], [0, 1]], dtype=np.float64)
    b = fit_belief(_arrays(rho, np.full((4, 2), 0.5), [4]), signals=())
    np.testing.assert_allclose(b.rate[:, 0], [0.75, 2.0 / 3.0])
    np.testing.assert_allclose(b.predict(_arrays(rho, np.zeros((4, 2)), [4])), [[0.75, 2.0 / 3.0]] * 4)


def test_confidence_belief_separates_what_the_confidence_tells() -> None:
    rng = np.random.default_rng(0)
    n, K = 4000, 3
    q = rng.uniform(size=(n, K))
    rho = (q > 0.5).astype(np.float64)  # a draft is accepted exactly when its confidence is above 0.5
    b = fit_belief(_arrays(rho, q, [n]), n_bins=8)
    probe = _arrays(np.zeros((2, K)), np.array([[0.9] * K, [0.1] * K]), [2])
    np.testing.assert_allclose(b.predict(probe), [[1.0] * K, [0.0] * K], atol=1e-12)


def test_refuses_unknown_signals_and_unreached_depths() -> None:
    rho = np.array([[0.0, 1.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="depth 2"):
        fit_belief(_arrays(rho, np.full((2, 2), 0.5), [2]), signals=())
    with pytest.raises(ValueError, match="signals"):
        fit_belief(_arrays(np.ones((2, 2)), np.full((2, 2), 0.5), [2]), signals=("ent",))


@pytest.mark.parametrize("signals", [(), ("q",)])
def test_belief_plan_costs_no_less_than_the_clairvoyant_bound(small_traces: Path, signals: tuple[str, ...]) -> None:
    """Its plan is one position-indexed policy on the true acceptances: the SSP optimum is at most its cost."""
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions
    from specenv.traces.traceset import TraceSet

    ts = TraceSet.load(small_traces)
    model = cost_model_for(ts, "fit-train")
    train, test = select_positions(ts, None, "train"), select_positions(ts, None, "test")
    bo = belief_oracle(test, model, fit_belief(train, signals))
    bound = solve(test, model)
    assert np.all(bo.realised.cost >= bound.cost - 1e-9 * bound.cost)
    # the realised cost is the exact evaluation of the planned budgets, and the plan is optimal for its belief
    np.testing.assert_allclose(bo.realised.cost, evaluate_policy(test, model, bo.planned.k).cost)
    fixed = min(evaluate_policy(test, model, k).cost.sum() for k in range(test.kmax + 1))
    assert bo.realised.cost.sum() <= fixed * 1.02  # the belief plan is about as good as any fixed k or better


def test_draft_belief_reads_only_the_confidences_seen() -> None:
    """Hand-built: a round is easy (every draft accepted, every confidence 0.9) or hard (none, 0.1), half each.

    Having seen n >= 1 drafts the belief knows the round: the probability that the first j drafts are
    all accepted (the product of the conditional acceptances) is 1 for the easy round and 0 for the
    hard one at every depth; having seen none it knows the depth rates only: depth 1 is accepted in
    half the rounds, depths 2 and 3, among the rounds that reach them (the easy ones), always.
    """
    n, K = 400, 3
    easy = np.arange(n) % 2 == 0
    rho = np.where(easy[:, None], 1.0, 0.0) * np.ones((n, K))
    q = np.where(easy[:, None], 0.9, 0.1) * np.ones((n, K))
    arrays = _arrays(rho, q, [n])
    b = fit_draft_belief(arrays, n_bins=4)
    rows = np.array([0, 1])  # an easy round, a hard round
    np.testing.assert_allclose(b.predict(arrays, rows, 0), [[0.5, 1.0, 1.0], [0.5, 1.0, 1.0]])
    for seen in (1, 2, 3):
        survival = np.cumprod(b.predict(arrays, rows, seen), axis=1)
        np.testing.assert_allclose(survival, [[1.0] * K, [0.0] * K], err_msg=f"n={seen}")


def test_draft_belief_ends_are_the_confidence_and_depth_beliefs() -> None:
    rng = np.random.default_rng(1)
    n, K = 3000, 4
    q = rng.uniform(size=(n, K))
    rho = (rng.uniform(size=(n, K)) < q).astype(np.float64)
    arrays = _arrays(rho, q, [n])
    b = fit_draft_belief(arrays, n_bins=8)
    rows = np.arange(n)
    np.testing.assert_array_equal(b.predict(arrays, rows, K), fit_belief(arrays, ("q",), 8).predict(arrays))
    np.testing.assert_allclose(b.predict(arrays, rows, 0), fit_belief(arrays, (), 8).predict(arrays), rtol=1e-12)
    with pytest.raises(ValueError, match="outside 0..4"):
        b.predict(arrays, rows, K + 1)


def test_action_values_with_the_tables_own_acceptances_are_unchanged(small_traces: Path) -> None:
    from oracle.dp import action_values
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions
    from specenv.traces.traceset import TraceSet

    ts = TraceSet.load(small_traces)
    model = cost_model_for(ts, "fit-train")
    arrays = select_positions(ts, None, "train")
    sol = solve(arrays, model)
    rows = np.arange(0, len(arrays.L), 7)
    base = action_values(arrays, model, sol.value, rows)
    np.testing.assert_array_equal(action_values(arrays, model, sol.value, rows, rho=arrays.rho[rows]), base)
    sure = action_values(arrays, model, sol.value, rows, rho=np.ones((len(rows), arrays.kmax)))
    never = action_values(arrays, model, sol.value, rows, rho=np.zeros((len(rows), arrays.kmax)))
    assert np.all(never[:, 0] == base[:, 0]) and np.all(sure[:, 0] == base[:, 0])  # k = 0 drafts nothing
    with pytest.raises(ValueError, match="shape"):
        action_values(arrays, model, sol.value, rows, rho=np.ones((len(rows), arrays.kmax + 1)))
