"""The shipped trained policies (policies/shipped/<set id>/<name>/) load without torch, fit their set's
environment, are not constant, and the benchmark runs every one of them."""

from __future__ import annotations

import json

import numpy as np
import pytest

import specenv  # noqa: F401
from policies import shipped_policy_dir
from policies.bench.context import build_context
from policies.bench.single import default_entries, run_policy
from policies.learn.stopping import load_stop_rule
from specenv.policy.mlp import MLPPolicy

SETS = ["paper-default", "live-cpu"]
#: name -> (drafting mode, lookahead of the round-level observation; None = kmax)
NAMES = {
    "imitation": ("none", 0),
    "imitation-h3": ("block", 3),
    "imitation-seq": ("sequential", None),
    "ppo": ("none", 0),
    "dqn": ("none", 0),
    "ppo-h3": ("block", 3),
    "ppo-seq": ("sequential", None),
    "bc-h3": ("block", 3),
    "imitation-belief": ("none", 0),
    "imitation-belief-seq": ("sequential", None),
}
#: Not shipped (scripts/ship_policies.py NOT_SHIPPED): constant k=0 on live-cpu, so not a learned row; BC of the
#: greedy oracle there is slower than AR; the belief-oracle learners are trained for paper-default only so far.
MISSING = {("live-cpu", "imitation"), ("live-cpu", "bc-h3"), ("live-cpu", "imitation-belief")}
MISSING |= {("live-cpu", "imitation-belief-seq")}
CASES = [(s, n) for s in SETS for n in NAMES if (s, n) not in MISSING]


def _load(dataset: str, name: str):
    folder = shipped_policy_dir(dataset) / name
    stored = MLPPolicy.load(folder)
    return (load_stop_rule(folder) if stored.spec.per_token else stored), folder


@pytest.mark.parametrize(("dataset", "name"), CASES)
def test_shipped_policy_provenance_and_contract(dataset: str, name: str) -> None:
    pol, folder = _load(dataset, name)
    meta = json.loads((folder / "policy.json").read_text())["meta"]
    mode, h = NAMES[name]
    assert meta["dataset"] == dataset
    assert meta["trace_set"]["id"] == shipped_policy_dir(dataset).name
    assert meta["trace_set"]["split"] == "train" and meta["cost_model"] == "fit-train"
    assert meta["drafting"] == mode and meta["hyperparameters"]
    assert meta["observation_version"] == pol.spec.version and meta["train_seconds"] > 0
    assert pol.spec.lookahead == (pol.spec.kmax if h is None else h)


@pytest.mark.parametrize(("dataset", "name"), CASES)
def test_shipped_policy_is_not_constant_on_test_states(dataset: str, name: str) -> None:
    """A learned row must earn its name: more than one budget over the held-out states it visits."""
    ctx = build_context(dataset, None, "fit-train", shipped_policy_dir(dataset))
    entry = {e.name: e for e in default_entries(ctx)}[f"{name} (learned)"]
    df, _ = run_policy(entry, ctx, episodes=1, seed=0)
    assert df["k_min"].min() < df["k_max"].max(), f"{name} on {dataset}: one budget everywhere"


@pytest.mark.parametrize("dataset", SETS)
def test_shipped_policies_are_what_the_benchmark_runs(dataset: str) -> None:
    ctx = build_context(dataset, None, "fit-train", shipped_policy_dir(dataset))
    names = [e.name for e in default_entries(ctx)]
    for n in NAMES:
        assert (f"{n} (learned)" in names) == ((dataset, n) not in MISSING)
    assert not ctx.skipped, ctx.skipped


def test_shipped_policies_are_numpy_only() -> None:
    for dataset, name in CASES:
        if True:
            folder = shipped_policy_dir(dataset) / name
            assert sorted(p.name for p in folder.iterdir()) == ["policy.json", "weights.npz"]
            with np.load(folder / "weights.npz", allow_pickle=False) as z:
                assert all(z[k].dtype == np.float32 for k in z.files)
