"""A trace set the shipped generator did not make trains and benches with the same commands.

The set is built here: its positions follow another acceptance process (a sticky two-state regime
per generation, easy or hard, that a controller can only infer from the acceptances it has seen and
from the draft's confidence) and another routing law (unique experts saturating exponentially in the
chain length, at a rate drawn per generation), on the positions layout of the schema. Its rounds
table (the engine's timings the cost model is fitted on) is the generator's, so ``fit-train``, the
default of ``train`` and ``bench``, applies unchanged. A learned policy trained on its train split
beats the best fixed k chosen on its test split itself.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specenv.cli import app
from specenv.generator import generate_paper
from specenv.traces.schema import q_columns, rho_columns, u_columns
from specenv.traces.traceset import TraceSet

P_EASY, P_HARD, P_SWITCH = 0.9, 0.15, 0.04


def foreign_set(n_generations: int = 40, kmax: int = 6, seed: int = 11) -> TraceSet:
    """The foreign set: the generator's layout and timings, another acceptance process and routing law."""
    base = generate_paper(n_generations, kmax=kmax, seed=seed, name="foreign-regime")
    pos = base.positions.copy()
    top_k, n_exp = base.manifest.model.top_k, base.manifest.model.n_experts
    rng = np.random.default_rng(seed)
    rho, q, U = np.empty((len(pos), kmax)), np.empty((len(pos), kmax)), np.empty((len(pos), kmax + 1))
    for _, idx in pos.groupby("generation_id").indices.items():
        n = len(idx)
        flips = rng.random(n) < P_SWITCH
        hard = (np.cumsum(flips) + rng.integers(2)) % 2 == 1  # the regime, sticky along the generation
        p = np.where(hard, P_HARD, P_EASY)
        rho[idx] = p[:, None]
        q[idx] = np.clip(p[:, None] + rng.normal(0.0, 0.2, size=(n, kmax)), 0.0, 1.0)
        rate = rng.uniform(0.3, 0.9)  # this generation's routing overlap
        k = np.arange(kmax + 1)
        U[idx] = top_k + (n_exp - top_k) * (1.0 - np.exp(-k * top_k * rate / n_exp))[None, :]
    for j, c in enumerate(rho_columns(kmax)):
        pos[c] = rho[:, j].astype(np.float32)
    for j, c in enumerate(q_columns(kmax)):
        pos[c] = q[:, j].astype(np.float32)
    for j, c in enumerate(u_columns(kmax)):
        pos[c] = U[:, j].astype(np.float32)
    manifest = dataclasses.replace(
        base.manifest,
        profile="foreign-regime",
        description="Test-only set: sticky easy/hard acceptance regime, exponential expert saturation.",
        extra={"generator": "tests/test_foreign_traces.py", "seed": seed},
    )
    return TraceSet(manifest, pos, base.rounds)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("foreign") / "foreign-regime"
    foreign_set().save(path)
    return path


def test_foreign_set_is_not_the_generators(foreign: Path) -> None:
    ts = TraceSet.load(foreign)
    rho = ts.arrays().rho
    assert set(np.unique(np.round(rho, 5))) == {np.float32(P_HARD).round(5), np.float32(P_EASY).round(5)}


@pytest.mark.slow
def test_learned_policy_trained_on_its_train_split_beats_the_best_fixed_k(foreign: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    runs = tmp_path / "runs"
    res = runner.invoke(
        app,
        ["train", "--traces", str(foreign), "--algo", "imitation", "--iterations", "3", "--out", str(runs), "--json"],
    )
    assert res.exit_code == 0, res.output
    meta = json.loads((runs / "imitation-seed0" / "policy" / "policy.json").read_text())["meta"]
    assert meta["cost_model"] == "fit-train" and meta["trace_set"]["name"] == "foreign-regime"
    out = tmp_path / "bench"
    only = ["--only", "imitation", "--only", "fixed k="]
    res = runner.invoke(app, ["bench", str(foreign), "--policies", str(runs), *only, "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    row = next(r for r in doc["policies"] if r["policy"].startswith("imitation"))
    assert row["learned"] and not row["constant"], row["policy"]
    # the best fixed k in hindsight is chosen on the test generations themselves; the learned one beats it
    assert row["speedup_pooled"] > doc["context"]["best_fixed_k_test_pooled"]
    assert row["vs_best_fixed_ci95_low"] > 0.0, (row["vs_best_fixed"], row["vs_best_fixed_ci95_low"])
