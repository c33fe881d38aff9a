"""The ``specenv oracle`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specenv.cli import app

runner = CliRunner()
# Pinned figures: tests/golden.json (scripts/golden.py), the oracle on paper-default with the CLI's defaults.
GOLDEN = json.loads((Path(__file__).parent / "golden.json").read_text())

KEYS = {
    "dataset",
    "split",
    "cost_model",
    "kmax",
    "lookahead",
    "generations",
    "tokens",
    "s_max_pooled",
    "s_max_mean",
    "mean_k",
    "mean_accepted",
    "expected_rounds",
    "v0_ms",
    "ar_ms",
    "mc",
}


def test_oracle_json_keys_and_values() -> None:
    res = runner.invoke(app, ["oracle", "paper-default", "--json", "--episodes", "1"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert KEYS <= set(obj)
    pinned, rel = GOLDEN["oracle"], GOLDEN["rel_tolerance"]
    assert {key: obj[key] for key in pinned["setting"]} == pinned["setting"]
    for key in ("s_max_pooled", "s_max_mean", "mean_k", "mean_accepted", "expected_rounds"):
        assert obj[key] == pytest.approx(pinned[key], rel=rel), key
    assert obj["mc"]["episodes"] == 128


def test_oracle_sweep_delta_plots_on_test_split(tmp_path) -> None:
    res = runner.invoke(
        app,
        [
            "oracle",
            "paper-default",
            "--kmax",
            "4",
            "--split",
            "test",
            "--sweep",
            "--delta",
            "--plot",
            str(tmp_path / "figs"),
            "--episodes",
            "0",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["kmax"] == 4 and obj["split"] == "test" and obj["mc"] is None
    assert [r["kmax"] for r in obj["sweep"]] == [1, 2, 3, 4]
    assert set(obj["delta"]["quadrants"]) == {"I", "II", "III", "IV", "axis"}
    from specenv.io import OUTPUTS_MARK

    figs = ["oracle_delta.png", "oracle_sweep.png"]
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted([*figs, OUTPUTS_MARK])
    assert sorted(json.loads((tmp_path / "figs" / OUTPUTS_MARK).read_text())) == figs  # the output rule's record


def test_oracle_human_output() -> None:
    res = runner.invoke(app, ["oracle", "paper-default", "--kmax", "2", "--episodes", "0", "--cost-model", "profile"])
    assert res.exit_code == 0, res.output
    assert "S_max" in res.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kmax", "11"], "--kmax"),
        (["--kmax", "0"], "--kmax"),
        (["--split", "validation"], "--split"),
        (["--cost-model", "nope.json"], "--cost-model"),
        (["--lookahead", "-1"], "--lookahead"),
        (["--episodes", "-2"], "--episodes"),
        (["--plot", "somewhere"], "--plot"),
    ],
)
def test_oracle_bad_args_exit_2(args: list[str], needle: str) -> None:
    res = runner.invoke(app, ["oracle", "paper-default", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("specenv: error: ") and needle in lines[0], lines


def test_oracle_unknown_dataset_exit_2() -> None:
    res = runner.invoke(app, ["oracle", "no-such-set"])
    assert res.exit_code == 2
    assert "no-such-set" in res.stderr
