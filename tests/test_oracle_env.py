"""The oracle against the replay environment: same costs, and Monte Carlo through the env agrees."""

from __future__ import annotations

import numpy as np
import pytest

import oracle
from policies.heuristics import FixedK
from specenv.cost.source import cost_model_for
from specenv.envs.rollout import OnlinePolicy, evaluate_in_env
from specenv.observation.single import ObservationSpec
from specenv.replay.tables import replay_data
from specenv.traces.datasets import load_dataset
from specenv.traces.splits import select_split


@pytest.mark.parametrize("lookahead", [0, 3])
def test_cost_table_matches_environment(lookahead: int) -> None:
    ts = load_dataset("paper-default")
    arrays = select_split(ts.arrays(), "test")
    data = replay_data("paper-default", None, "test", "fit", lookahead)
    C = oracle.cost_table(arrays, cost_model_for(ts, "fit"), lookahead=lookahead)
    np.testing.assert_array_equal(data.cost, C)  # one charged-cost function: bit-identical
    np.testing.assert_array_equal(data.generation_ids, arrays.generation_ids)
    np.testing.assert_allclose(data.ar_total_ms, oracle.ar_costs(arrays, cost_model_for(ts, "fit")), rtol=1e-12)


def test_env_monte_carlo_brackets_exact_evaluation() -> None:
    ts = load_dataset("paper-default")
    model = cost_model_for(ts, "fit")
    arrays = select_split(ts.arrays(), "test")
    gids = arrays.generation_ids[:6]
    pol = FixedK(ObservationSpec(kmax=arrays.kmax), 5)
    assert isinstance(pol, OnlinePolicy)
    ev = evaluate_in_env(pol, split="test", episodes=8, seed=2, generation_ids=gids)
    again = evaluate_in_env(pol, split="test", episodes=8, seed=2, generation_ids=gids)
    np.testing.assert_array_equal(ev.cost, again.cost)
    exact = oracle.evaluate_policy(arrays.select(np.arange(6)), model, 5)
    s = ev.summary()
    assert s["episodes"] == 48 and s["generations"] == 6
    assert s["mean_k"]["value"] == 5.0
    np.testing.assert_allclose(ev.ar, np.repeat(exact.ar, 8), rtol=1e-12)
    assert abs(s["speedup_pooled"]["value"] - exact.speedup_pooled) < 1.5 * s["speedup_pooled"]["ci95"]
    assert abs(s["mean_accepted"]["value"] - exact.mean_accepted) < 1.5 * s["mean_accepted"]["ci95"]
    # the oracle is an upper bound on what the online policy achieves
    assert oracle.solve(arrays.select(np.arange(6)), model).speedup_pooled > s["speedup_pooled"]["value"]
