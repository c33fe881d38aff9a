"""The shipped trained policies load without torch, fit the default environment, and do their job."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest

import specenv  # noqa: F401
from policies.benchmark import build_context, default_entries, run_policy, shipped_policy_dir
from specenv.envs.replay import ENV_ID
from specenv.policy.mlp import MLPPolicy

NAMES = ["imitation", "imitation-h3", "ppo", "dqn"]


@pytest.mark.parametrize("name", NAMES)
def test_shipped_policy_loads_and_acts_in_default_env(name: str) -> None:
    folder = shipped_policy_dir() / name
    pol = MLPPolicy.load(folder)
    meta = json.loads((folder / "policy.json").read_text())["meta"]
    assert meta["dataset"] == "paper-default"
    env = gym.make(ENV_ID, split="test", lookahead=pol.spec.lookahead)
    assert env.unwrapped.data.spec == pol.spec
    obs, _ = env.reset(seed=0)
    ks = []
    done = False
    while not done:
        k = pol.act(obs)
        assert env.action_space.contains(np.int64(k))
        ks.append(k)
        obs, _, done, _, _ = env.step(k)
    assert len(ks) > 1


def test_shipped_policies_are_what_the_benchmark_runs() -> None:
    ctx = build_context("paper-default", None, "fit", shipped_policy_dir())
    names = [e.name for e in default_entries(ctx)]
    for n in NAMES:
        assert f"{n} (learned)" in names
    assert not [note for note in ctx.notes if "skipped" in note]


@pytest.mark.slow
def test_imitation_with_confidences_beats_best_fixed_k_on_held_out() -> None:
    """Regression guard for the headline result (same seeds as `specenv bench`)."""
    ctx = build_context("paper-default", None, "fit", shipped_policy_dir())
    entries = {e.name: e for e in default_entries(ctx)}
    learned, _ = run_policy(entries["imitation-h3 (learned)"], ctx, episodes=2, seed=0)
    fixed, _ = run_policy(entries[f"best fixed k={ctx.best_fixed_k} (train)"], ctx, episodes=2, seed=0)
    s_learned = learned["ar_ms"].sum() / learned["cost_ms"].sum()
    s_fixed = fixed["ar_ms"].sum() / fixed["cost_ms"].sum()
    assert s_learned > s_fixed * 1.02
