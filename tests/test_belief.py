"""The belief oracle (oracle/belief.py): its calibration, and where it sits against the clairvoyant bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from oracle.belief import belief_oracle, fit_belief
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
