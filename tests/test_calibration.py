"""The shipped paper-profile set reproduces the paper's published figures (Tables 4, A4, A6; Fig. A6)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from specenv.cli import app
from specenv.cost.fit import FitReport, fit_cost_model
from specenv.cost.model import CostModel
from specenv.generator import generate_paper
from specenv.traces import paper
from specenv.traces.datasets import load_dataset


@pytest.fixture(scope="module")
def default_set():
    return load_dataset("paper-default")


@pytest.fixture(scope="module")
def report(default_set) -> FitReport:
    return fit_cost_model(default_set.rounds, default_set.kmax, default_set.facts.top_k)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 6, 8])
def test_per_k_coefficients_within_2pct_of_table_a4(report: FitReport, K: int) -> None:
    row = report.per_k.set_index("K").loc[K]
    alpha, c, beta0 = paper.TABLE_A4[K][:3]
    assert row["alpha"] == pytest.approx(alpha, rel=0.02)
    assert row["c"] == pytest.approx(c, rel=0.02)
    assert row["beta0"] == pytest.approx(beta0, rel=0.02)
    assert row["alpha_p"] < 1e-3


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 6])
def test_oos_mape_and_r2_same_order_as_paper(report: FitReport, K: int) -> None:
    row = report.per_k.set_index("K").loc[K]
    ref_r2, ref_mape = paper.TABLE_A4[K][3], paper.TABLE_A4[K][4]
    assert 0.5 * ref_mape <= row["oos_mape_pct"] <= 2.0 * ref_mape
    # unexplained variance within a factor of three of the paper's
    assert (1 - row["R2"]) <= 3.0 * (1 - ref_r2) + 0.01
    assert row["oos_r2"] > 0.9


def test_alpha_jumps_threefold_between_m4_and_m5(report: FitReport) -> None:
    a = report.per_k.set_index("K")["alpha"]
    assert 2.5 < a[4] / a[3] < 4.0


def test_table_a6_categorical_form_dominates(report: FitReport) -> None:
    forms = report.forms.set_index("model")
    for name, (r2, _rmse, mape) in paper.TABLE_A6.items():
        assert forms.loc[name, "R2"] == pytest.approx(r2, abs=0.05)
        assert forms.loc[name, "cv_mape_pct"] == pytest.approx(mape, rel=0.5)
    assert forms.loc["U_r x C(K) + L", "cv_rmse_ms"] < 0.2 * forms.loc["U_r + L", "cv_rmse_ms"]


def test_draft_time_matches_figure_a6(report: FitReport) -> None:
    assert report.draft["d1"] == pytest.approx(paper.DRAFT_D1, rel=0.01)
    assert report.draft["d0"] == pytest.approx(paper.DRAFT_D0, abs=0.01)


def test_ar_step_is_extrapolated_and_flagged(report: FitReport) -> None:
    assert report.ar["extrapolated"] is True
    assert report.model.ar_extrapolated
    # the AR step is cheaper than a K=1 round at the median context
    assert report.model.round_ms(0, 8.0, 600.0) < report.model.round_ms(1, 12.1, 600.0)


@pytest.mark.parametrize("m", sorted(paper.TABLE4_MEDIAN_U))
def test_median_unique_experts_within_5pct_of_table4(default_set, m: int) -> None:
    med = default_set.rounds.loc[default_set.rounds["m"] == m, "U_r"].median()
    assert med == pytest.approx(paper.TABLE4_MEDIAN_U[m], rel=0.05)


def test_u_curve_extends_concavely_to_m11(default_set) -> None:
    med = default_set.rounds.groupby("m")["U_r"].median()
    assert list(med.index) == list(range(2, 12))
    steps = np.diff(np.r_[8.0, med.to_numpy()])
    assert np.all(steps > 0)
    assert steps[-1] < steps[0]


def test_median_context_near_600(default_set) -> None:
    med = default_set.rounds.groupby("K")["L"].median()
    assert med.between(540, 660).all(), med


def test_acceptance_in_eagle3_range(default_set) -> None:
    r8 = default_set.rounds[default_set.rounds["K"] == 8]
    acc = (r8.groupby("category")["accepted"].mean() + 1).to_dict()
    for cat in ("coding", "code_math"):
        assert 4.3 <= acc[cat] <= 6.0, acc
    for cat in ("qa", "rag", "translation", "stem"):
        assert 3.0 <= acc[cat] <= 4.3, acc


def test_categories_are_the_papers(default_set) -> None:
    assert set(default_set.positions["category"].unique()) == set(paper.CATEGORY_ROUNDS)


def test_transitions_couple_rejection_and_new_experts(default_set) -> None:
    """Chains whose first draft is likely rejected touch more experts at m = 2 (paper Figs. B3-B5)."""
    pos = default_set.positions
    low = pos.loc[pos["rho_1"] < 0.5, "U_1"].mean()
    high = pos.loc[pos["rho_1"] >= 0.5, "U_1"].mean()
    assert low > high + 0.3


@pytest.mark.slow  # seconds of work; the full suite runs it
def test_generator_is_deterministic_given_seed() -> None:
    a = generate_paper(3, kmax=4, seed=11)
    b = generate_paper(3, kmax=4, seed=11)
    c = generate_paper(3, kmax=4, seed=12)
    pd.testing.assert_frame_equal(a.positions, b.positions)
    pd.testing.assert_frame_equal(a.rounds, b.rounds)
    assert not a.positions[["rho_1", "U_2"]].equals(c.positions[["rho_1", "U_2"]])


def test_greedy_generation_has_binary_rho() -> None:
    ts = generate_paper(2, kmax=5, seed=2, greedy=True, with_rounds=False)
    rho = ts.positions[[f"rho_{j}" for j in range(1, 6)]].to_numpy()
    assert set(np.unique(rho)) <= {0.0, 1.0}
    assert ts.rounds is None


def test_cost_model_json_roundtrip(report: FitReport, tmp_path) -> None:
    path = report.model.save(tmp_path / "cm.json")
    back = CostModel.load(path)
    np.testing.assert_array_equal(back.alpha, report.model.alpha)
    assert back.ar_extrapolated is True
    assert back.round_ms(3, 18.0, 600.0) == pytest.approx(report.model.round_ms(3, 18.0, 600.0))


def test_cost_model_bad_json_names_file(tmp_path) -> None:
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="bad.json"):
        CostModel.load(p)


def test_profile_fills_gaps_from_m5_regime() -> None:
    cm = CostModel.paper_profile(10)
    assert cm.alpha[6] > cm.alpha[7] > cm.alpha[8]
    assert cm.alpha[3] < cm.alpha[0] + 0.01  # AR step in the low-m regime
    assert cm.ar_extrapolated


def test_fit_cli_json_and_out(tmp_path) -> None:
    out = tmp_path / "cm.json"
    res = CliRunner().invoke(app, ["fit", "paper-default", "--json", "--out", str(out), "--folds", "2"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert {r["model"] for r in obj["forms"]} == set(paper.TABLE_A6)
    assert obj["ar"]["extrapolated"] is True
    assert CostModel.load(out).kmax == 10


def test_generate_cli_refuses_existing_folder(tmp_path) -> None:
    res = CliRunner().invoke(app, ["generate", "--out", str(tmp_path), "-n", "1"])
    assert res.exit_code == 2
    assert "--out" in res.stderr
