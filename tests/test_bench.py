"""The benchmark: every policy reported with its % of the oracle bound, none beating the bound."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from policies.benchmark import build_context, default_entries, run_benchmark, run_policy
from specenv.cli import app


@pytest.fixture(scope="module")
def bench_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specenv.generator import generate_paper

    path = tmp_path_factory.mktemp("bench") / "set"
    generate_paper(15, kmax=6, seed=21, name="bench-small").save(path)
    return path


@pytest.mark.slow
def test_bench_json_emits_every_policy_with_oracle_pct(bench_set: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(
        app,
        [
            "bench",
            str(bench_set),
            "--json",
            "--episodes",
            "2",
            "--out",
            str(tmp_path / "out"),
            "--policies",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    names = [p["policy"] for p in obj["policies"]]
    ctx = build_context(str(bench_set), None, "fit", None)
    expected = [e.name for e in default_entries(ctx)] + ["oracle bound (SSP)"]
    assert names == expected
    for p in obj["policies"]:
        assert 0.0 < p["oracle_pct"] < 110.0
        assert np.isfinite(p["speedup_mean"])
    assert {"summary.csv", "categories.csv", "bench.json", "bench.md", "speedup.png"} <= {
        f.name for f in (tmp_path / "out").iterdir()
    }
    assert obj["context"]["test_generations"] == 3


def test_no_policy_beats_the_oracle_bound(bench_set: Path) -> None:
    res = run_benchmark(str(bench_set), episodes=3, policy_dir=None)
    assert (res.summary["beats_bound"] == 0).all(), res.summary[["policy", "beats_bound"]]
    bound = res.summary.set_index("policy").loc["oracle bound (SSP)", "speedup_pooled"]
    # pooled speedups can exceed the bound only by Monte-Carlo noise (3 episodes per generation)
    assert (res.summary["speedup_pooled"] <= bound * 1.03).all()


def test_fixed_k_monte_carlo_matches_exact_evaluation(bench_set: Path) -> None:
    from oracle.dp import evaluate_policy

    ctx = build_context(str(bench_set), None, "fit", None)
    entry = next(e for e in default_entries(ctx) if e.name == "fixed k=4")
    df, _ = run_policy(entry, ctx, episodes=40, seed=0)
    exact = evaluate_policy(ctx.test, ctx.cost_model, 4).cost.sum()
    mc = df.groupby("generation_id")["cost_ms"].mean().sum()
    assert mc == pytest.approx(exact, rel=0.02)


def test_bench_bad_arguments_exit_2(bench_set: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["bench", str(bench_set), "--kmax", "99", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "kmax" in r.stderr
    r = runner.invoke(app, ["bench", "nope-not-a-set"])
    assert r.exit_code == 2 and "nope-not-a-set" in r.stderr
    r = runner.invoke(app, ["bench", str(bench_set), "--policies", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "--policies" in r.stderr
    r = runner.invoke(app, ["bench", str(bench_set), "--only", "no-such-policy", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "only" in r.stderr
