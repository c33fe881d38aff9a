"""The batch fit (specenv/cost/batchfit.py): the shipped vLLM recording, recovery on synthetic steps, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from specenv.cli import app
from specenv.cost.batch import BatchCostModel, load_batch_cost_model, union_shared
from specenv.cost.batchfit import STEPS_FORMAT, check_steps, fit_batch_cost, load_steps, write_steps
from specenv.io import package_data

FACTS = {"n_layers": 6, "n_experts": 64, "top_k": 4}
TRUE = {"b0": 1.5, "b_pos": 0.05, "alpha": 0.03, "c": 0.0004, "b_req": 0.02, "d0": 0.3, "d_step": 0.5, "d_tok": 0.04}


@pytest.fixture(scope="module")
def shipped():
    return load_steps("live-vllm-batch-v1")


@pytest.fixture(scope="module")
def shipped_fit(shipped):
    steps, manifest = shipped
    return fit_batch_cost(steps, manifest, source={"recording": manifest["name"]})


def test_shipped_model_is_the_fit_of_the_shipped_steps(shipped_fit):
    ship = load_batch_cost_model("live-vllm-batch-v1")
    refit = shipped_fit.model
    for name in ("beta0", "alpha", "c"):
        np.testing.assert_allclose(getattr(ship, name), getattr(refit, name), rtol=1e-9)
    for name in ("b_req", "d0", "d_step", "d_tok", "u_theta"):
        assert getattr(ship, name) == pytest.approx(getattr(refit, name), rel=1e-6), name
    assert ship.predictor == refit.predictor


def test_shipped_fit_figures(shipped, shipped_fit):
    steps, _ = shipped
    assert set(range(1, 9)) <= set(steps["B"])  # every batch size 1..8 was recorded
    pred = shipped_fit.predictors.set_index("predictor")
    # popular experts are shared: the independent union overestimates, the fitted exponent corrects it
    assert pred.loc["independent", "U_batch_bias"] > 0
    assert pred.loc["shared", "U_batch_mape_pct"] < pred.loc["independent", "U_batch_mape_pct"] / 2
    assert shipped_fit.model.predictor == "shared" and 0 < shipped_fit.model.u_theta < 1
    # the out-of-sample error of the step time stays small (measured 5.7% at the commit of the recording)
    assert shipped_fit.summary["step_oos_mape_pct"] < 10.0
    coef = shipped_fit.coefficients.set_index("term")
    for term in ("b_pos", "alpha", "d_step"):  # the expert, position and draft-step terms are real
        assert coef.loc[term, "value"] > 3 * coef.loc[term, "se"], term


def _synthetic(theta: float, seed: int = 0, groups: int = 40) -> tuple[pd.DataFrame, dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        B0 = int(rng.integers(1, 9))
        L = rng.integers(50, 400, size=B0)
        for step in range(25):
            B = max(1, B0 - step // 10)
            k = rng.integers(0, 9, size=B)
            U = np.minimum(4 * (k + 1) ** 0.62 * rng.uniform(0.9, 1.1, size=B), 64).clip(4, 64)
            U[k == 0] = 4.0
            ub = float(np.clip(union_shared(U, 64, theta) + rng.normal(0, 0.5), U.max(), min(64, U.sum())))
            P, sL, n = int(np.sum(k + 1)), int(L[:B].sum() + B * step), int(rng.integers(1, 9))
            t = TRUE["b0"] + TRUE["b_pos"] * P + TRUE["alpha"] * ub + TRUE["c"] * sL + TRUE["b_req"] * (B - 1)
            d = TRUE["d0"] + TRUE["d_step"] * n + TRUE["d_tok"] * n * B
            t_noisy, d_noisy = t * rng.lognormal(0, 0.03), d * rng.lognormal(0, 0.03)
            rows.append(
                {
                    "run": "syn", "batch": B0, "group": g, "step": step, "B": B, "positions": P, "context_sum": sL,
                    "U_batch": ub, "T_T_ms": t_noisy * 1.3, "T_D_ms": d_noisy * 1.3, "T_T_cpu_ms": t_noisy,
                    "T_D_cpu_ms": d_noisy, "draft_calls": n, "step_ms": (t_noisy + d_noisy) * 1.6, "drafted": n,
                    "committed": B, "k": k.tolist(), "U": U.tolist(), "L": (L[:B] + step).tolist(),
                    "accepted": [0] * B, "U_batch_layer": [ub] * 6,
                }
            )  # fmt: skip
    manifest = {"format": STEPS_FORMAT, "name": "syn", "model": FACTS, "kmax": 8, "max_batch": 8}
    return pd.DataFrame(rows), manifest


@pytest.mark.parametrize("theta", [0.4, 1.0])
def test_fit_recovers_known_coefficients(theta):
    steps, manifest = _synthetic(theta)
    check_steps(steps, manifest)
    rep = fit_batch_cost(steps, manifest)
    coef = rep.coefficients.set_index("term")
    for term, value in TRUE.items():
        est, se = coef.loc[term, "value"], coef.loc[term, "se"]
        assert abs(est - value) < max(4 * se, 0.1 * value), (term, est, se, value)
    assert rep.summary["u_theta"] == pytest.approx(theta, abs=0.05)
    assert rep.summary["step_oos_mape_pct"] < 5.0
    if theta < 1:
        assert rep.model.predictor == "shared"


def test_write_and_load_round_trip(tmp_path):
    steps, manifest = _synthetic(0.5, groups=6)
    folder = write_steps(tmp_path / "rec", steps, manifest, fit=True)
    back, mf = load_steps(folder)
    lists = ["k", "U", "L", "accepted", "U_batch_layer"]
    pd.testing.assert_frame_equal(back.drop(columns=lists), steps.drop(columns=lists), check_dtype=False)
    assert [list(x) for x in back["k"]] == list(steps["k"])
    assert mf["files"]["steps"]["rows"] == len(steps)
    assert isinstance(load_batch_cost_model(folder), BatchCostModel)
    with pytest.raises(ValueError, match="already exists"):
        write_steps(folder, steps, manifest)
    other = tmp_path / "not-a-recording"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not a steps recording"):
        write_steps(other, steps, manifest, replace=True)
    assert (other / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("column", "edit", "match"),
    [
        ("positions", lambda s: s.loc.__setitem__((3, "positions"), 999), "column 'positions', row 3"),
        ("U_batch", lambda s: s.loc.__setitem__((5, "U_batch"), 1.0), "column 'U_batch', row 5"),
        ("k", lambda s: s.at.__setitem__((2, "k"), [1]), "column 'k', row 2"),
        ("T_T_ms", lambda s: s.loc.__setitem__((7, "T_T_ms"), -1.0), "column 'T_T_ms', row 7"),
        ("B", lambda s: s.loc.__setitem__((0, "B"), 0), "column 'B', row 0"),
        ("drafted", lambda s: s.__delitem__("drafted"), "column 'drafted'"),
    ],
)
def test_bad_tables_are_one_line(column, edit, match):
    steps, manifest = _synthetic(0.5, groups=2)
    steps = steps.copy()
    edit(steps)
    with pytest.raises(ValueError, match=match) as err:
        check_steps(steps, manifest, "steps.parquet")
    assert "\n" not in str(err.value)


def test_tampered_recording_is_refused(tmp_path):
    folder = tmp_path / "rec"
    shutil.copytree(package_data("live-vllm-batch-v1"), folder)
    data = bytearray((folder / "steps.parquet").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "steps.parquet").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256") as err:
        load_steps(folder)
    assert "\n" not in str(err.value)
    mf = json.loads((folder / "manifest.json").read_text())
    mf["model"]["top_k"] = 100
    (folder / "manifest.json").write_text(json.dumps(mf))
    with pytest.raises(ValueError, match="manifest.json: field 'model'"):
        load_steps(folder)
    with pytest.raises(ValueError, match="no such file"):
        load_steps(tmp_path / "missing")


def test_cli_fit_batch(tmp_path):
    out = tmp_path / "b.json"
    res = CliRunner().invoke(app, ["fit-batch", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "chosen predictor: shared" in res.stdout and "OOS MAPE of the step time" in res.stdout
    assert BatchCostModel.load(out).predictor == "shared"
    for args, needle in (
        (["fit-batch", str(tmp_path / "nope")], "no such file"),
        (["fit-batch", "--timing", "gpu"], "--timing"),
        (["fit-batch", "--folds", "500"], "--folds"),
    ):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_plain_table_round_trip_and_refusals(tmp_path):
    from specenv.cost.batchfit import PLAIN_FILE, check_plain, load_plain

    steps, manifest = _synthetic(0.5, groups=6)
    plain = pd.DataFrame(
        {
            "run": ["rep0"] * 6,
            "batch": [2] * 6,
            "group": [0, 0, 0, 1, 1, 1],
            "B": [2, 2, 1, 2, 2, 2],
            "context_sum": [100, 102, 52, 80, 82, 84],
            "engine_step_ms": [20.0, 20.5, 15.0, 19.0, 19.5, 19.7],
        }
    )
    folder = write_steps(tmp_path / "rec", steps, manifest, fit=False, plain=plain)
    mf = json.loads((folder / "manifest.json").read_text())
    assert mf["files"]["plain"]["rows"] == 6
    back = load_plain(folder)
    pd.testing.assert_frame_equal(back, plain, check_dtype=False)
    # a recording without the table has none
    assert load_plain(write_steps(tmp_path / "bare", steps, manifest, fit=False)) is None
    # a tampered table is refused by its sha256, in one line naming the file
    data = bytearray((folder / PLAIN_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / PLAIN_FILE).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{PLAIN_FILE}: sha256") as err:
        load_plain(folder)
    assert "\n" not in str(err.value)
    # bad rows: one line naming the column and the row; nothing written
    bad = plain.copy()
    bad.loc[4, "engine_step_ms"] = 0.0
    with pytest.raises(ValueError, match="column 'engine_step_ms', row 4"):
        check_plain(bad)
    with pytest.raises(ValueError, match="column 'B', row 2"):
        write_steps(tmp_path / "never", steps, manifest, fit=False, plain=plain.assign(B=[2, 2, 0, 2, 2, 2]))
    assert not (tmp_path / "never").exists()
    with pytest.raises(ValueError, match="missing column"):
        check_plain(plain.drop(columns=["context_sum"]))
