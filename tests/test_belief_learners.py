"""Learners that imitate the belief oracle (``specenv train --algo imitation --expert belief``).

The expert's table (:func:`policies.learn.dagger.expert_arrays`) is the split with its acceptances
replaced by what a train-split calibration believes having seen the drafts a controller of the mode
sees; the run records the expert, and the CLI refuses an expert for a learner that imitates none.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from policies.learn.dagger import expert_arrays
from specenv.cli import app
from specenv.traces.traceset import PositionArrays


def _arrays(rho: np.ndarray, q: np.ndarray) -> PositionArrays:
    n, K = rho.shape
    return PositionArrays(
        generation_ids=np.zeros(1, dtype=np.int64),
        categories=np.array(["c"], dtype=object),
        offsets=np.array([0, n], dtype=np.int64),
        L=np.arange(n, dtype=np.float64) + 10.0,
        rho=rho,
        q=q,
        U=np.full((n, K + 1), 8.0),
        greedy=bool(np.all((rho == 0) | (rho == 1))),
    )


def test_oracle_expert_is_the_table_itself() -> None:
    a = _arrays(np.array([[1.0, 0.0], [0.0, 1.0]]), np.full((2, 2), 0.5))
    table, meta, belief = expert_arrays(a, "oracle", 0)
    assert table is a and meta == {"expert": "oracle"} and belief is None


def test_belief_expert_sees_only_its_modes_drafts() -> None:
    # half the rows easy (accepted, confidence 0.9), half hard (rejected, 0.1): K = 2
    easy = np.arange(200) % 2 == 0
    rho = np.where(easy[:, None], 1.0, 0.0) * np.ones((200, 2))
    q = np.where(easy[:, None], 0.9, 0.1) * np.ones((200, 2))
    a = _arrays(rho, q)
    none, meta, _ = expert_arrays(a, "belief", 0)  # mode none: the depth rates only
    assert meta["expert"] == "belief" and meta["belief_seen_drafts"] == 0
    np.testing.assert_allclose(none.rho, [[0.5, 1.0]] * 200)
    seq, _, _ = expert_arrays(a, "belief", 2)  # every confidence seen: the round is known
    np.testing.assert_allclose(np.cumprod(seq.rho, axis=1), rho)
    assert not none.greedy and seq.offsets is a.offsets
    with pytest.raises(ValueError, match="unknown expert"):
        expert_arrays(a, "clairvoyant", 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--algo", "ppo", "--expert", "belief"), "only --algo imitation"),
        (("--algo", "imitation", "--expert", "nobody"), "unknown expert 'nobody'"),
    ],
)
def test_train_refuses_an_expert_it_cannot_imitate(
    args: tuple[str, ...], message: str, small_traces: Path, tmp_path: Path
) -> None:
    res = CliRunner().invoke(app, ["train", "--traces", str(small_traces), *args, "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "r").exists()


def test_belief_run_is_named_and_recorded(small_traces: Path, tmp_path: Path) -> None:
    args = ["--algo", "imitation", "--expert", "belief", "--drafting", "sequential", "--iterations", "1"]
    res = CliRunner().invoke(
        app, ["train", "--traces", str(small_traces), *args, "--epochs", "1", "--out", str(tmp_path), "--json"]
    )
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "imitation-belief-seq-seed0" / "policy" / "policy.json").read_text())["meta"]
    assert meta["algo"] == "stop-dagger" and meta["expert"] == "belief" and meta["belief_seen_drafts"] >= 1
    assert "belief" in meta["hyperparameters"]["loss"]


def test_observation_belief_is_the_conditional_acceptance_given_the_observation() -> None:
    """Hand-built: one observed feature x; draft 1 accepted w.p. 0.8 if x = 1 else 0.3; draft 2, among the
    rounds that reach it, w.p. 0.9 whatever x (0.1 where draft 1 was rejected: those rows never reach it)."""
    from policies.learn.dagger import fit_observation_belief

    n = 4000
    x = (np.arange(n) % 2).astype(np.float32)[:, None]
    rho1 = np.where(x[:, 0] == 1, 0.8, 0.3)
    rho = np.stack([rho1, np.full(n, 0.9)], axis=1)
    b = fit_observation_belief(x, rho)
    np.testing.assert_allclose(
        b.predict(np.array([[1.0], [0.0]], dtype=np.float32)), [[0.8, 0.9], [0.3, 0.9]], atol=0.02
    )
    # a constant observation: depth 2's rate counts only the rounds that reach it (0.9, not the plain mean)
    one = np.ones((n, 1), dtype=np.float32)
    greedy = np.zeros((n, 2))
    greedy[: n // 2, 0] = 1.0  # half the rounds accept draft 1
    greedy[: int(0.45 * n), 1] = 1.0  # 90% of those accept draft 2
    greedy[n // 2 :, 1] = 1.0  # never reached: must not count
    np.testing.assert_allclose(fit_observation_belief(one, greedy).predict(one[:1]), [[0.5, 0.9]], atol=1e-3)
    never = greedy.copy()
    never[:, 1] = 0.0  # draft 2 rejected in every round that reaches it: nothing to fit
    with pytest.raises(ValueError, match="depth 2"):
        fit_observation_belief(one, never)
