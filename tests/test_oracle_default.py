"""The oracle on the shipped default set: pinned numbers (deterministic) and the analyses' outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import oracle
from specenv.cost.source import cost_model_for
from specenv.traces.datasets import load_dataset
from specenv.traces.splits import select_split

# The pinned figures live in tests/golden.json only (written by scripts/golden.py, which documents their
# setting: paper-default, cost model "fit", Kmax = 10, split "all", lookahead 0; Monte Carlo 4 episodes
# per generation, seed 0; delta space on the occupancy-weighted optimal path).
GOLDEN = json.loads((Path(__file__).parent / "golden.json").read_text())
REL = GOLDEN["rel_tolerance"]
PINNED = GOLDEN["oracle"]
PINNED_MC = GOLDEN["oracle_mc"]
PINNED_DELTA = GOLDEN["delta"]


@pytest.fixture(scope="module")
def default():
    setting, mc = PINNED["setting"], PINNED_MC["setting"]
    ts = load_dataset(setting["dataset"])
    arrays = ts.arrays()
    assert arrays.kmax == setting["kmax"] and setting["split"] == "all" and setting["lookahead"] == 0
    model = cost_model_for(ts, setting["cost_model"])
    res = oracle.solve(arrays, model, mc_episodes=mc["episodes_per_generation"], seed=mc["seed"])
    return arrays, model, res


def test_pinned_oracle_numbers(default) -> None:
    arrays, _, res = default
    assert arrays.kmax == 10 and arrays.n_generations == 128
    assert res.speedup_pooled == pytest.approx(PINNED["s_max_pooled"], rel=REL)
    assert res.speedup_mean == pytest.approx(PINNED["s_max_mean"], rel=REL)
    assert res.mean_k == pytest.approx(PINNED["mean_k"], rel=REL)
    assert res.mean_accepted == pytest.approx(PINNED["mean_accepted"], rel=REL)
    assert float(res.rounds.sum()) == pytest.approx(PINNED["expected_rounds"], rel=REL)
    mc = res.extra["mc"]
    assert mc["episodes"] == 4 * 128
    for key in ("speedup_pooled", "mean_k", "mean_accepted"):
        val = PINNED_MC[key]
        assert mc[key]["value"] == pytest.approx(val, rel=REL), key
        # and the Monte-Carlo estimate brackets the exact value
        exact = {"speedup_pooled": res.speedup_pooled, "mean_k": res.mean_k, "mean_accepted": res.mean_accepted}[key]
        assert abs(mc[key]["value"] - exact) <= mc[key]["ci95"], key


def test_oracle_beats_every_fixed_k(default) -> None:
    arrays, model, res = default
    for k in range(arrays.kmax + 1):
        ev = oracle.evaluate_policy(arrays, model, k)
        assert np.all(res.cost <= ev.cost + 1e-9)
    assert oracle.evaluate_policy(arrays, model, 0).speedup_pooled == pytest.approx(1.0)


def test_pinned_delta_space(default) -> None:
    arrays, model, res = default
    an = oracle.delta_analysis(arrays, model, result=res)
    assert an.quadrants == PINNED_DELTA["quadrants"]
    assert an.quadrants["II"] == 0 and an.quadrants["IV"] > 0
    assert an.points == 10 * an.decisions
    for key in ("lambda_sep", "lambda_ls", "r2_origin"):
        assert getattr(an, key) == pytest.approx(PINNED_DELTA[key], rel=REL), key
    # the boundary slope is the optimal cost per committed token (within 5%)
    assert an.lambda_sep == pytest.approx(an.v0_per_token, rel=0.05)
    assert an.lambda_sep == pytest.approx(an.marginal_dv, rel=0.05)
    assert an.sep_error < 0.15
    # quadrant IV comes from the cost model: a 4-draft round can be cheaper than a 3-draft one
    iv = (an.da < -an.tol_a) & (an.dc > an.tol_cost)
    assert np.all(an.k[iv] < an.kstar[iv])
    assert set(np.unique(an.k[iv])) <= {1, 2, 3}


def test_boundary_slope_on_train_split(default) -> None:
    arrays, model, _ = default
    train = select_split(arrays, "train")
    lam = oracle.boundary_slope(train, model)
    assert lam == pytest.approx(GOLDEN["boundary_slope_train"]["lambda"], rel=REL)
    assert oracle.boundary_slope(train, model, method="ls") < lam
    v0 = oracle.boundary_slope(train, model, method="v0")
    assert v0 == pytest.approx(lam, rel=0.05)
    ar_unit = float(oracle.ar_costs(train, model).sum() / train.lengths.sum())
    assert oracle.boundary_slope(train, model, unit_ms=ar_unit) == pytest.approx(lam / ar_unit)
    # the rule with this lambda (and true acceptance) is close to the oracle
    rule = oracle.evaluate_policy(train, model, oracle.delta_rule_policy(train, model, lam))
    best = oracle.solve(train, model)
    assert rule.speedup_pooled > 0.95 * best.speedup_pooled


def test_kmax_sweep_saturates(default, tmp_path) -> None:
    arrays, model, res = default
    table = oracle.kmax_sweep(arrays, model)
    assert list(table["kmax"]) == list(range(1, 11))
    s = table["s_max_pooled"].to_numpy()
    assert np.all(np.diff(s) > 0)
    assert s[-1] == pytest.approx(res.speedup_pooled, rel=1e-12)
    gains = np.diff(s)
    assert gains[-1] < 0.1 * gains[:4].max()  # diminishing returns
    assert np.all(np.diff(table["mean_accepted"].to_numpy()) > 0)
    path = oracle.plot_kmax_sweep(table, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 1000 and path.endswith("sweep.png")


def test_delta_mc_states_and_plot(tmp_path) -> None:
    ts = load_dataset("paper-default")
    arrays = ts.arrays().select(np.arange(8))
    model = cost_model_for(ts, "fit")
    an = oracle.delta_analysis(arrays, model, states="mc", episodes=2, seed=0)
    again = oracle.delta_analysis(arrays, model, states="mc", episodes=2, seed=0)
    assert an.quadrants == again.quadrants
    assert an.quadrants["II"] == 0
    oracle.plot_delta(an, str(tmp_path / "delta.png"), max_points=500)
    assert (tmp_path / "delta.png").stat().st_size > 1000
