"""The benchmark: every policy reported with its % of the oracle bound, none beating the bound."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from policies.bench.context import build_context
from policies.bench.single import default_entries, run_benchmark, run_policy
from specenv.cli import app

ORACLE = "oracle bound (SSP)"
# Every policy of the benchmark on the bench set below (Kmax = 6; best fixed k on its train split = 5),
# in display order, then the oracle row. Written out here: a policy that disappears fails this test.
EXPECTED_POLICIES = [
    "autoregressive (k=0)",
    "fixed k=1",
    "fixed k=4",
    "fixed k=6",
    "best fixed k=5 (train)",
    "transformers heuristic",
    "confidence 0.4",
    "confidence ROC",
    "goodput (SmartSpec)",
    "cascade utility",
    "UCB bandit",
    "delta-space (oracle lambda)",
    "delta-space (adaptive lambda)",
    "delta-space + confidences (h=3)",
    # the peers (policies/peers.py)
    "AdaEDL (entropy bound)",
    "SVIP (entropy)",
    "SpecDec++ (acceptance head)",
    "DISCO (stop classifier)",
    "vLLM adaptive verification",
    "vLLM DSD table (batch 1)",
    ORACLE,
]
# Outer cap on a pooled speedup over the bound (the test's tolerance before the per-policy margin
# below existed; every policy here sits at <= 94% of the bound, so it only bites on a real bug).
POOLED_CAP = 0.03


@pytest.fixture(scope="module")
def bench_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specenv.generator import generate_paper

    path = tmp_path_factory.mktemp("bench") / "set"
    generate_paper(15, kmax=6, seed=21, name="bench-small").save(path)
    return path


def assert_within_bound(summary: pd.DataFrame, episodes: pd.DataFrame) -> None:
    """No policy beats the exact bound beyond Monte-Carlo noise, per generation and pooled.

    Every policy is online, so its expected cost on a generation is >= V(0) of that generation (the
    oracle's exact optimum); an estimate can fall below only by Monte-Carlo noise.

    * per generation: the benchmark's own ``beats_bound`` count (mean cost below V(0) by more than 4
      standard errors) is 0 for every row;
    * pooled: the policy's total cost is a sum of independent per-generation means, with standard
      error se = sqrt(sum_g var_g / n_g). Its pooled speedup may exceed the bound's by the factor
      V0 / (V0 - 4 se) at most (4 SEs: a false alarm has probability ~3e-5 per policy under
      normality), and never by more than ``POOLED_CAP``.
    """
    rows = summary.set_index("policy")
    assert (rows["beats_bound"] == 0).all(), rows["beats_bound"]
    bound = float(rows.loc[ORACLE, "speedup_pooled"])
    per_gen = episodes.groupby(["policy", "generation_id"], sort=False).agg(
        cost=("cost_ms", "mean"), var=("cost_ms", "var"), n=("cost_ms", "size"), ar=("ar_ms", "first")
    )
    for name, d in per_gen.groupby("policy", sort=False):
        ar, cost = float(d["ar"].sum()), float(d["cost"].sum())
        assert float(rows.loc[name, "speedup_pooled"]) == pytest.approx(ar / cost, rel=1e-9), name
        v0 = ar / bound  # the bound's total cost on the same generations
        se = float(np.sqrt((d["var"].fillna(0.0) / d["n"]).sum()))
        margin = min(POOLED_CAP, 4.0 * se / max(v0 - 4.0 * se, 1e-12))
        assert ar / cost <= bound * (1.0 + margin) + 1e-12, (name, ar / cost, bound, margin)


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
    assert names == EXPECTED_POLICIES
    for p in obj["policies"]:
        assert 0.0 < p["oracle_pct"] and np.isfinite(p["speedup_mean"])
    assert obj["policies"][-1]["oracle_pct"] == 100.0
    assert_within_bound(pd.DataFrame(obj["policies"]), pd.read_csv(tmp_path / "out" / "episodes.csv"))
    assert {"summary.csv", "categories.csv", "bench.json", "bench.md", "speedup.png", "generations.csv"} <= {
        f.name for f in (tmp_path / "out").iterdir()
    }
    assert obj["context"]["test_generations"] == 3
    # fixed budgets are evaluated exactly, the adaptive policies by Monte Carlo; fitted on train only
    exact = {p["policy"] for p in obj["policies"] if p["evaluation"] == "exact"}
    assert exact == set(EXPECTED_POLICIES[:5]) | {"vLLM DSD table (batch 1)", ORACLE}
    assert obj["context"]["cost_model"] == "fit-train" and obj["context"]["cost_model_fitted_on"] == "train split"
    assert "(exact)" in (tmp_path / "out" / "bench.md").read_text()


@pytest.mark.slow  # seconds of work; the full suite runs it
def test_no_policy_beats_the_oracle_bound(bench_set: Path) -> None:
    res = run_benchmark(str(bench_set), episodes=3, policy_dir=None)
    assert list(res.summary["policy"]) == EXPECTED_POLICIES
    assert_within_bound(res.summary, res.episodes)


def test_fixed_k_monte_carlo_matches_exact_evaluation(bench_set: Path) -> None:
    from oracle.dp import evaluate_policy

    ctx = build_context(str(bench_set), None, "fit", None)
    entry = next(e for e in default_entries(ctx) if e.name == "fixed k=4")
    df, _ = run_policy(entry, ctx, episodes=40, seed=0)
    exact = evaluate_policy(ctx.test, ctx.cost_model, 4).cost.sum()
    mc = df.groupby("generation_id")["cost_ms"].mean().sum()
    assert mc == pytest.approx(exact, rel=0.02)


def test_missing_learner_notes_follow_only(bench_set: Path, tmp_path: Path) -> None:
    """``--only imitation`` on a folder without PPO or DQN runs does not tell the user to train them."""
    from policies.bench.single import select_entries

    empty = tmp_path / "runs"
    empty.mkdir()

    def missing(only: list[str] | None) -> list[str]:
        ctx = build_context(str(bench_set), None, "fit", empty)
        select_entries(ctx, only, None)
        return [n.split("'")[1] for n in ctx.notes if n.startswith("no trained")]

    assert missing(None) == ["ppo", "dqn", "imitation"]
    assert missing(["imitation"]) == ["imitation"]
    assert missing(["(learned)"]) == ["ppo", "dqn", "imitation"]
    assert missing(["fixed k=1", "dqn"]) == ["dqn"]
    assert missing(["fixed k=1"]) == []


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


def test_block_bound_has_its_categories(bench_set: Path) -> None:
    """The block bound's row of the category table is its pooled speedup per category (was NaN)."""
    res = run_benchmark(str(bench_set), episodes=1, seed=0, drafting="block", only=["confidences"])
    piv = res.categories.pivot(index="policy", columns="category", values="speedup_pooled")
    block = next(p for p in piv.index if p.startswith("oracle bound, block h="))
    assert piv.loc[block].notna().all(), piv.loc[block]
    # each category's block bound pays the trimmed drafts: never above the bound of mode none
    assert (piv.loc[block] <= piv.loc[ORACLE] + 1e-12).all()
    # and its pooled row stays below the bound of mode none too
    row = res.summary.set_index("policy").loc[block]
    assert 0 < row["speedup_pooled"] <= float(res.summary.set_index("policy").loc[ORACLE, "speedup_pooled"])


def test_a_loaded_trace_set_is_read_once_and_gives_the_rows_of_its_name(
    bench_set: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_benchmark takes a loaded TraceSet: no file is read again, the rows equal the run by folder name."""
    from specenv.replay.tables import replay_data
    from specenv.traces.datasets import load_dataset
    from specenv.traces.traceset import TraceSet

    rows = ["fixed k=1", "UCB bandit"]  # an exact row and a Monte-Carlo row (its env reads the set by folder)
    by_name = run_benchmark(str(bench_set), episodes=1, only=rows)
    ts = load_dataset(str(bench_set))
    reads: list[object] = []
    real = TraceSet.load.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(TraceSet, "load", classmethod(lambda cls, *a, **k: reads.append(a) or real(cls, *a, **k)))
    given = run_benchmark(ts, episodes=1, only=rows)
    assert reads == []
    assert given.context["dataset"] == "bench-small"  # a loaded set is named by its manifest
    pd.testing.assert_frame_equal(given.summary, by_name.summary)
    # every row is charged by the run's one cost-model object: the Monte-Carlo row's env holds the same one
    ctx = build_context(ts, None, "fit-train", None)
    assert replay_data(ctx.source, ctx.kmax, "test", ctx.cost_model_arg).cost_model is ctx.cost_model
