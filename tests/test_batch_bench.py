"""`specenv bench --batch B` (policies/bench/batch.py) and the learned batch controllers (policies/batch/learn.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from specenv.cli import app

ROWS = [
    "fixed k=0",
    "fixed k=1",
    "fixed k=4",
    "fixed k=8",
    "vllm-dsd-table",
    "vllm-adaptive-verification",
    "tetris-greedy",
    "smartspec-goodput",
    "delta-space per request (oracle lambda)",
    "batch-goodput",
]


def test_cli_bench_batch_runs_every_row_below_the_bound(tmp_path):
    out = tmp_path / "bb"
    res = CliRunner().invoke(
        app,
        ["bench", "live-vllm", "--batch", "2", "--episodes", "3", "--no-learners", "--out", str(out)],
    )
    assert res.exit_code == 0, res.output
    assert "bound" in res.output and "vllm-dsd-table" in res.output
    data = json.loads((out / "bench-batch2.json").read_text())
    names = [r["policy"] for r in data["policies"]]
    for want in ROWS:  # a row that disappears fails here
        assert any(n.startswith(want) for n in names), (want, names)
    bound = data["bound"]
    assert bound["method"] == "lagrangian" and bound["linear"]["method"] == "linear"  # both bound rows
    assert bound["speedup_pooled_pathwise"] <= bound["linear"]["speedup_pooled_pathwise"] * (1 + 1e-12)
    assert "bound, split rule only" in (out / "bench-batch2.md").read_text()
    for row in data["policies"]:
        assert row["bound_violations"] == 0, row
        assert row["speedup_pooled"] <= bound["speedup_pooled_pathwise"] * (1 + 1e-12)
        assert row["ci95_low"] <= row["speedup_pooled"] <= row["ci95_high"]
        assert row["drafting"] in ("none", "block")
    k0 = next(r for r in data["policies"] if r["policy"] == "fixed k=0")
    assert k0["speedup_pooled"] == pytest.approx(1.0, rel=1e-12)
    assert (out / "bench-batch2.md").read_text().startswith("| policy |")


def test_cli_bench_batch_refuses_bad_values(small_traces, tmp_path):
    res = CliRunner().invoke(app, ["bench", str(small_traces), "--batch", "0", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2
    res = CliRunner().invoke(
        app, ["bench", str(small_traces), "--batch", "2", "--kmax", "99", "--out", str(tmp_path / "x")]
    )
    assert res.exit_code == 2 and "kmax" in res.output
    assert not (tmp_path / "x" / "bench-batch2.json").exists()


def test_learned_batch_controllers_train_and_stay_below_the_bound():
    """Imitation of the bound (exported numpy MLP, per request) and a short PPO run, on live-vllm B = 2."""
    from oracle.batch import batch_bound
    from policies.batch.controllers import PerRequest
    from policies.batch.learn import train_batch_imitation, train_batch_ppo
    from policies.bench.batch import _episodes
    from specenv.envs.batch import MoESpecBatchEnv
    from specenv.policy.mlp import MLPPolicy
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    imit = train_batch_imitation("live-vllm", 2, iterations=2, episodes=2, epochs=10, expert="fair")
    assert isinstance(imit.policy, MLPPolicy) and imit.policy.meta["algo"] == "batch-imitation"
    ppo = train_batch_ppo("live-vllm", 2, timesteps=2048)
    env = MoESpecBatchEnv("live-vllm", batch_size=2, split="test", cost_model="fit-train")
    arrays = select_positions(load_dataset("live-vllm"), env.kmax, "test")
    for pol in (PerRequest(env.spec_batch, imit.policy), ppo):
        res = _episodes(env, pol, [0, 1])
        bb = batch_bound(arrays, env.data.L0, env.batch_cost, 2, res["seeds"])
        assert np.all(res["ar"] / res["cost"] <= bb.speedup_pathwise * (1 + 1e-12))
        assert np.all(res["ar"] / res["cost"] > 0.5)
