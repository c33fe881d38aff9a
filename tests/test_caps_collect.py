"""Collecting a trace set with expert caps (issue 17 item 2): collector, cap grid, CLI, shipped set."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from specenv.engines.counterfactual import choose_caps
from specenv.traces.traceset import TraceSet


def test_choose_caps_is_the_rounded_quantiles():
    u = np.arange(1, 101)  # quartiles 25.75, 50.5, 75.25
    assert choose_caps(u, n_experts=128) == [26, 50, 75]  # np.rint rounds half to even
    assert choose_caps(np.full(40, 7), n_experts=64) == [7]  # equal quantiles collapse
    with pytest.raises(ValueError, match="no quantile of the unions lies in 1..63"):
        choose_caps(np.full(10, 64), n_experts=64)
    with pytest.raises(ValueError, match="no verification passes"):
        choose_caps(np.zeros(0), n_experts=64)


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    pytest.importorskip("transformers")
    from specenv.engines.hf.collect import collect_live

    ts = collect_live(n_prompts=2, kmax=2, max_new_tokens=8, caps=[5, 7], name="caps-tiny")
    path = tmp_path_factory.mktemp("capcollect") / "set"
    ts.save(path)
    return TraceSet.load(path)


def test_collected_set_with_caps(collected):
    m = collected.manifest
    assert m.caps == [5, 7] and m.extensions == ["caps-v1"]
    assert m.extra["lossless"]["mismatched_runs"] == 0  # the uncapped runs stay lossless
    r = collected.rounds
    assert sorted(r["cap"].unique().tolist()) == [0, 5, 7]
    assert (r.loc[r["cap"] == 0, "K"].sort_values().unique() == [0, 1, 2]).all()
    for B in (5, 7):
        capped = r[r["cap"] == B]
        assert sorted(capped["K"].unique().tolist()) == [1, 2]  # k = 0 is never capped: no capped K = 0 run
        assert (capped["U_r"] <= B).all()
        assert (capped["run"] == capped["K"].map(lambda K, B=B: f"fixed-K{K}-cap{B}")).all()
    ca = collected.arrays().cap_arrays()
    assert ca.caps.tolist() == [5, 7] and ca.acc.shape[:2] == (2, 3)
    assert m.extra["caps"]["rule"] == "given" and set(m.extra["caps"]["capped_runs"]) == {"5", "7"}


def test_cli_caps_refusals(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "specenv.cli", "collect", "--out", str(tmp_path / "o"), *args],
            capture_output=True,
            text=True,
        )

    for args, msg in [
        (["--caps", "9,7"], "--caps: caps must be positive and strictly ascending"),
        (["--caps", "nine"], "--caps: expected 'auto' or comma-separated whole numbers"),
        (["--caps", "auto", "--engine", "vllm"], "--caps: the expert cap runs in the hf engine only"),
    ]:
        res = run(*args)
        assert res.returncode == 2, res.stderr
        assert msg in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_capped_transfer_detects_an_overhead_of_the_cap():
    """On rounds whose capped T_T follows the uncapped model exactly, the uncapped fit transfers;
    with 1 ms added to every capped round it under-predicts them by about that much."""
    from rows import cap_trace_set

    from specenv.cost.fit import capped_transfer, fit_replay_model
    from specenv.traces.splits import split_ids

    ts = cap_trace_set(n_generations=6, kmax=4)
    r = ts.rounds.astype({"T_T_ms": np.float64})
    base = fit_replay_model(r[r["cap"] == 0], 4, ts.facts.top_k)
    capped = (r["cap"] > 0).to_numpy()
    r.loc[capped, "T_T_ms"] = base.target_ms(
        r.loc[capped, "K"].to_numpy(), r.loc[capped, "U_r"].to_numpy(np.float64), r.loc[capped, "L"].to_numpy()
    )
    ids = ts.arrays().generation_ids
    train, test = split_ids(ids, "train"), split_ids(ids, "test")
    exact = capped_transfer(r, 4, ts.facts.top_k, train, test)
    assert exact["test_rounds_K_ge_1"]["capped"] > 100
    assert exact["uncapped_fit"]["mape_capped_pct"] < 2.0
    assert abs(exact["uncapped_fit"]["bias_capped_pct"]) < 2.0
    r.loc[capped, "T_T_ms"] += 1.0
    over = capped_transfer(r, 4, ts.facts.top_k, train, test)
    y = r.loc[capped & r["generation_id"].isin(test).to_numpy() & (r["K"] >= 1).to_numpy(), "T_T_ms"].to_numpy()
    expected = -100.0 * np.mean(1.0 / y)  # the 1 ms the uncapped fit does not know about
    assert over["uncapped_fit"]["bias_capped_pct"] == pytest.approx(expected, abs=2.0)
    assert over["pooled_fit"]["mape_capped_pct"] < over["uncapped_fit"]["mape_capped_pct"]
    with pytest.raises(ValueError, match="no capped rounds"):
        capped_transfer(r[r["cap"] == 0], 4, ts.facts.top_k, train, test)


def test_shipped_caps_set():
    """live-cpu-caps: the grid follows its rule, the test split has several generations, the fit uses capped U."""
    from specenv.cost.source import cost_model_for
    from specenv.traces.datasets import load_dataset
    from specenv.traces.splits import select_split

    ts = load_dataset("live-cpu-caps")
    m = ts.manifest
    note = m.extra["caps"]
    assert m.caps == note["caps"] and m.extensions == ["caps-v1"] and len(m.caps) == 3
    q = note["layer_union_quantiles"]
    assert m.caps == sorted({int(np.rint(q[str(x)])) for x in (0.25, 0.5, 0.75)})
    assert m.extra["lossless"]["mismatched_runs"] == 0
    arrays = ts.arrays()
    test = select_split(arrays, "test")
    assert test.n_generations >= 5
    qual = test.cap_quality()
    assert (qual["mismatch_rate"][:, 0] == 0).all() and qual["mismatch_rate"][0, -1] > 0
    r = ts.rounds
    assert set(r["cap"].unique()) == {0, *m.caps}
    model = cost_model_for(ts, "fit")
    n_k1 = {rec["K"]: rec["N"] for rec in model.diagnostics["per_k"]}
    assert n_k1[1] == int((r["K"] == 1).sum()) > int(((r["K"] == 1) & (r["cap"] == 0)).sum())
