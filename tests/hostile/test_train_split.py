"""`specenv train` refuses, before any training, a set whose splits cannot support a run, and a bad cost model.

A 2-generation set splits into 1 train and 1 test generation: before, ``train`` trained on the one
train generation and exited 0 (a policy the fit-train cost model of its benchmark cannot price: its
standard errors are clustered by generation). A 1-generation set has no test generation. A cost
model that cannot be built (degenerate rounds) was refused inside the first run, after its progress
line and run folder; now it is one line first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specenv.generator import generate_paper
from tests.hostile.harness import reject_cleanly
from tests.hostile.test_degenerate_fits import _set, _with_rounds


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("sets")
    out = {}
    for n in (1, 2):
        out[n] = base / f"g{n}"
        generate_paper(n, kmax=4, seed=3, name=f"g{n}").save(out[n])
    return out


@pytest.mark.parametrize("algo", ["imitation", "ppo", "dqn"])
def test_train_refuses_a_two_generation_set(tmp_path, sets, algo):
    args = ["train", "--traces", sets[2], "--algo", algo, "--out", tmp_path / "runs"]
    reject_cleanly(args, ["--traces", str(sets[2]), "1 train and 1 test", "2 in all", "at least 2"], [tmp_path])


@pytest.mark.parametrize("cost_model", ["fit", "fit-train", "profile"])
def test_train_refuses_a_two_generation_set_whatever_the_cost_model(tmp_path, sets, cost_model):
    args = ["train", "--traces", sets[2], "--algo", "imitation", "--cost-model", cost_model, "--out", tmp_path / "r"]
    reject_cleanly(args, ["--traces", "1 train"], [tmp_path])


def test_train_refuses_a_one_generation_set(tmp_path, sets):
    args = ["train", "--traces", sets[1], "--algo", "imitation", "--drafting", "sequential", "--out", tmp_path / "r"]
    reject_cleanly(args, ["--traces", "1 train and 0 test", "1 in all"], [tmp_path])


def test_train_refuses_a_cost_model_it_cannot_fit_before_training(tmp_path, small_traces):
    traces = _with_rounds(small_traces, tmp_path / "set", _set("T_T_ms", 5.0))
    args = ["train", "--traces", traces, "--algo", "imitation", "--out", tmp_path / "runs"]
    reject_cleanly(args, ["--cost-model", "rounds table", "'T_T_ms'", "constant"], [tmp_path])
