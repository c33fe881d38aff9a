"""`specenv train` without data options reads only the train split: its cost model is the train split's fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specenv.cli import app

#: The splits a training run may ask for ("all" or "test" would read a held-out generation).
TRAIN_SPLITS = {"train", "train-fit", "train-val"}


def _spy_splits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Every split asked of specenv.traces.splits (its mask and its name check), with no fit remembered."""
    import specenv.cost.source as source
    import specenv.traces.splits as splits

    # a remembered fit (in the process or on disk) would be served without reading any split: start empty
    monkeypatch.setenv("SPECENV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(source, "_FIT_CACHE", {})
    asked: list[str] = []
    real_mask, real_check = splits.split_mask, splits.check_split

    def mask(ids, split):  # noqa: ANN001, ANN202
        asked.append(split)
        return real_mask(ids, split)

    def check(split):  # noqa: ANN001, ANN202
        asked.append(split)
        return real_check(split)

    monkeypatch.setattr(splits, "split_mask", mask)
    monkeypatch.setattr(splits, "check_split", check)
    return asked


@pytest.mark.parametrize(
    "algo_args",
    [
        ("--algo", "imitation", "--iterations", "1", "--epochs", "2"),
        ("--algo", "ppo", "--timesteps", "1000", "--n-envs", "4"),
        ("--algo", "imitation", "--expert", "belief", "--iterations", "1", "--epochs", "2"),
        ("--algo", "imitation", "--expert", "belief", "--drafting", "sequential", "--iterations", "1", "--epochs", "2"),
    ],
    ids=["imitation", "ppo", "imitation-belief", "imitation-belief-seq"],
)
def test_train_without_options_never_reads_test_rounds(
    algo_args: tuple[str, ...], small_traces: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asked = _spy_splits(monkeypatch, tmp_path)
    out = tmp_path / "runs"
    res = CliRunner().invoke(app, ["train", "--traces", str(small_traces), *algo_args, "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert asked and set(asked) <= TRAIN_SPLITS, sorted(set(asked))
    summary = json.loads(res.stdout)
    meta = json.loads((Path(summary["policy"]) / "policy.json").read_text())["meta"]
    assert meta["cost_model"] == "fit-train" and meta["trace_set"]["split"] == "train"


def test_train_with_fit_reads_every_round(small_traces: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The spy sees the all-rounds fit when asked for it (so the test above could fail)."""
    asked = _spy_splits(monkeypatch, tmp_path)
    args = ["train", "--traces", str(small_traces), "--algo", "imitation", "--iterations", "1", "--epochs", "2"]
    res = CliRunner().invoke(app, [*args, "--cost-model", "fit", "--out", str(tmp_path / "runs"), "--json"])
    assert res.exit_code == 0, res.output
    assert "all" in asked
    meta = json.loads((Path(json.loads(res.stdout)["policy"]) / "policy.json").read_text())["meta"]
    assert meta["cost_model"] == "fit"
