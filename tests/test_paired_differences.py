"""Paired bootstrap intervals of the difference of two pooled speedups (specenv.stats.paired_difference_ci)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from specenv.stats import bootstrap_indices, bootstrap_ratio_ci, paired_difference_ci


def test_hand_built_case_every_resample_of_two_units() -> None:
    # two generations: AR cost 10 and 20; policy a costs 5 and 10, policy b 10 and 10.
    # The four resamples (0,0), (0,1), (1,0), (1,1) give pooled a = 2, 2, 2, 2 and pooled b = 1, 1.5, 1.5, 2,
    # so the differences are 1, 0.5, 0.5, 0; sorted (0, 0.5, 0.5, 1), numpy's linear percentiles are
    # 2.5%: 0 + 0.075 * 0.5 = 0.0375 and 97.5%: 0.5 + 0.925 * 0.5 = 0.9625; on the units 30/15 - 30/20 = 0.5.
    ar = np.array([10.0, 20.0])
    idx = np.array([[0, 0], [0, 1], [1, 0], [1, 1]])
    got = paired_difference_ci(ar, np.array([5.0, 10.0]), ar, np.array([10.0, 10.0]), indices=idx)
    assert got["value"] == pytest.approx(0.5)
    assert got["low"] == pytest.approx(0.0375)
    assert got["high"] == pytest.approx(0.9625)


def test_pairing_separates_what_the_marginal_intervals_cannot() -> None:
    """Generations of very different difficulty, a 3% cheaper than b on each: only the paired interval excludes 0."""
    rng = np.random.default_rng(1)
    ar = rng.uniform(50.0, 500.0, size=30)
    cost_b = ar / rng.uniform(1.2, 2.8, size=30)
    cost_a = cost_b * 0.97 * rng.uniform(0.99, 1.01, size=30)
    idx = bootstrap_indices(30, 4000, seed=0)
    a = bootstrap_ratio_ci(ar, cost_a, indices=idx)["pooled"]
    b = bootstrap_ratio_ci(ar, cost_b, indices=idx)["pooled"]
    assert a["low"] < b["high"]  # the two intervals overlap
    d = paired_difference_ci(ar, cost_a, ar, cost_b, indices=idx)
    assert d["value"] == pytest.approx(a["value"] - b["value"])
    assert 0.0 < d["low"] < d["value"] < d["high"]


def test_matches_scipy_paired_percentile_bootstrap() -> None:
    """The same interval as scipy.stats.bootstrap(paired=True, method='percentile'), to Monte-Carlo error."""
    rng = np.random.default_rng(7)
    n = 25
    ar = rng.uniform(50.0, 300.0, size=n)
    cost_a, cost_b = ar / rng.uniform(1.5, 2.5, size=n), ar / rng.uniform(1.4, 2.4, size=n)

    def diff(x, ya, yb, axis=-1):  # noqa: ANN001, ANN202
        return x.sum(axis) / ya.sum(axis) - x.sum(axis) / yb.sum(axis)

    ref = sps.bootstrap(
        (ar, cost_a, cost_b), diff, paired=True, vectorized=True, n_resamples=40_000, method="percentile", rng=3
    ).confidence_interval
    got = paired_difference_ci(ar, cost_a, ar, cost_b, n_boot=40_000, seed=11)
    width = ref.high - ref.low
    assert got["low"] == pytest.approx(ref.low, abs=0.03 * width)
    assert got["high"] == pytest.approx(ref.high, abs=0.03 * width)


def test_refuses_unequal_or_empty_arrays_and_bad_indices() -> None:
    one = np.ones(3)
    with pytest.raises(ValueError, match="four arrays"):
        paired_difference_ci(one, one, one, np.ones(2))
    with pytest.raises(ValueError, match="four arrays"):
        paired_difference_ci(*(np.ones(0),) * 4)
    with pytest.raises(ValueError, match="indices"):
        paired_difference_ci(one, one, one, one, indices=np.zeros((5, 2), dtype=int))


def test_bench_rows_carry_their_paired_differences(small_traces) -> None:  # noqa: ANN001
    from policies.bench.single import ORACLE_ROW, run_benchmark
    from policies.bench.tables import single_table

    only = ["fixed k=", "UCB", "goodput", "cascade"]
    res = run_benchmark(str(small_traces), episodes=2, only=only, n_boot=500)
    s = res.summary.set_index("policy")
    ctx = res.context
    k_best, peer = ctx["best_fixed_k_test"], ctx["vs"]
    # the default peer: the best adaptive row that is not learned
    adaptive = s[(s["evaluation"] != "exact") & ~s["learned"].astype(bool)]
    assert peer == adaptive["speedup_pooled"].idxmax()
    # no fixed budget beats the best one in hindsight; the oracle beats it
    fixed = s[s.index.str.contains("fixed k=") | s.index.str.startswith("autoregressive")]
    assert len(fixed) >= 2 and (fixed["vs_best_fixed"] <= 1e-12).all()
    assert s.loc[ORACLE_ROW, "vs_best_fixed"] >= 0.0
    assert ctx["best_fixed_k_test_pooled"] >= fixed["speedup_pooled"].max() - 1e-12
    for name, r in s.iterrows():
        assert r["vs_peer_ci95_low"] <= r["vs_peer"] <= r["vs_peer_ci95_high"], name
        assert r["vs_peer"] == pytest.approx(r["speedup_pooled"] - s.loc[peer, "speedup_pooled"], abs=1e-12)
        assert r["vs_best_fixed"] == pytest.approx(r["speedup_pooled"] - ctx["best_fixed_k_test_pooled"], abs=1e-12)
    assert s.loc[peer, ["vs_peer", "vs_peer_ci95_low", "vs_peer_ci95_high"]].tolist() == [0.0, 0.0, 0.0]
    assert f"vs fixed k={k_best} (test, hindsight)" in single_table(res) and f"vs {peer} [95% CI]" in single_table(res)


def test_bench_vs_names_one_row(small_traces, tmp_path) -> None:  # noqa: ANN001
    from typer.testing import CliRunner

    from policies.bench.single import run_benchmark
    from specenv.cli import app

    res = run_benchmark(str(small_traces), episodes=1, only=["fixed k=1", "UCB", "cascade"], n_boot=200, vs="k=1")
    assert res.context["vs"] == "fixed k=1"
    assert res.summary.set_index("policy").loc["fixed k=1", "vs_peer"] == 0.0
    bad = CliRunner().invoke(app, ["bench", str(small_traces), "--only", "UCB", "--vs", "nope", "--out", str(tmp_path)])
    assert bad.exit_code == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope" in lines[0] and "UCB" in lines[0]
