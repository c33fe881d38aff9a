"""The one DAgger loop (policies.learn.dagger): schedule, aggregation, relabelling, roll-in and metadata."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from policies.learn.dagger import RegretMLP, ReplayEpisodes, Schedule, TableExpert, Visits, dagger_meta, run_dagger
from specenv.observation.single import ObservationSpec


def test_schedule_is_one_then_halving() -> None:
    s = Schedule()
    assert [s.beta(i) for i in range(4)] == [1.0, 0.5, 0.25, 0.125]
    assert s.describe() == "1 then 0.5**i"


class _Source:
    """Three states per iteration with rows 3i, 3i+1, 3i+2; records the betas it was asked for."""

    def __init__(self) -> None:
        self.betas: list[float] = []

    def rollout(self, expert, learner, beta, rng, iteration):  # noqa: ANN001, ANN201
        self.betas.append(beta)
        rows = np.arange(3 * iteration, 3 * iteration + 3)
        obs = rows[:, None].astype(np.float32)
        return Visits(obs, rows, cost=2.0, ar=3.0)


class _Learner:
    """Records the aggregates it is fitted on."""

    def __init__(self) -> None:
        self.fits: list[tuple[np.ndarray, np.ndarray]] = []

    def fit(self, xs, rs) -> float:  # noqa: ANN001
        self.fits.append((xs.numpy().copy(), rs.numpy().copy()))
        return 0.25


class _RelabellingExpert:
    """Labels a state with (row, version); the version grows after every fit (as policy iteration does)."""

    def __init__(self) -> None:
        self.version = 0

    def act(self, rows):  # noqa: ANN001, ANN201
        return rows

    def examples(self, visits: Visits) -> tuple[np.ndarray, np.ndarray]:
        r = np.stack([visits.rows, np.full(len(visits.rows), self.version)], axis=1).astype(np.float32)
        return visits.obs, r

    def update(self, learner, visits) -> bool:  # noqa: ANN001
        self.version += 1
        return True


def test_loop_aggregates_and_records_each_iteration() -> None:
    src, lrn = _Source(), _Learner()
    expert = TableExpert(np.zeros(9, dtype=np.int64), lambda v: (v.obs, np.zeros((len(v.rows), 2), np.float32)))
    lines: list[str] = []
    hist = run_dagger(src, expert, lrn, 3, np.random.default_rng(0), log=lines.append, label="toy")  # type: ignore[arg-type]
    assert src.betas == [1.0, 0.5, 0.25]
    assert [len(x) for x, _ in lrn.fits] == [3, 6, 9]
    np.testing.assert_array_equal(lrn.fits[-1][0][:, 0], np.arange(9))  # every visit kept, in order
    assert [h["states"] for h in hist] == [3, 6, 9]
    assert hist[1] == {
        "iteration": 1,
        "beta": 0.5,
        "states": 6,
        "rollout_speedup": 1.5,
        "train_regret_ar_units": 0.25,
    }
    assert len(lines) == 3 and lines[0].startswith("toy it=0 beta=1.000 states=3")


def test_an_expert_that_changes_relabels_the_whole_aggregate() -> None:
    src, lrn, expert = _Source(), _Learner(), _RelabellingExpert()
    run_dagger(src, expert, lrn, 3, np.random.default_rng(0))  # type: ignore[arg-type]
    # fit i sees every state labelled by the expert's version i (i updates before it), not its version at the visit
    for i, (_, r) in enumerate(lrn.fits):
        np.testing.assert_array_equal(r[:, 0], np.arange(3 * (i + 1)))
        assert set(r[:, 1].tolist()) == {float(i)}


def test_dagger_meta_block_order() -> None:
    learner = RegretMLP(ObservationSpec(kmax=4, lookahead=0), hidden=(8,), lr=0.01, epochs=3, batch_size=16, seed=2)
    hist = [{"iteration": 0}, {"iteration": 1}]
    meta = dagger_meta("dagger", learner, hist, "some loss", 2, drafting="none", lookahead=0)
    assert list(meta) == ["algo", "drafting", "lookahead", "hyperparameters", "history"]
    assert meta["hyperparameters"] == {
        "iterations": 2,
        "epochs": 3,
        "hidden": [8],
        "activation": "tanh",
        "optimizer": "adam",
        "learning_rate": 0.01,
        "batch_size": 16,
        "beta_schedule": "1 then 0.5**i",
        "loss": "some loss",
        "seed": 2,
    }
    assert meta["history"] is hist


def test_replay_roll_in_plays_the_expert_at_beta_one_and_the_learner_at_zero(small_greedy_traces: Path) -> None:
    from policies.learn.imitation import split_arrays
    from specenv.envs.replay import ENV_ID

    env = gym.make(ENV_ID, dataset=str(small_greedy_traces), split="train")
    arrays = split_arrays(str(small_greedy_traces), 6, "train")
    n_rows = len(arrays.L)
    table = np.arange(n_rows) % 7  # budgets 0..6 by row: not a policy of the observation
    expert = TableExpert(table, lambda v: (v.obs, np.zeros((len(v.rows), 7), np.float32)))

    class Three:
        def act(self, obs):  # noqa: ANN001, ANN201
            return 3

    src = ReplayEpisodes(env, arrays, policy_of=lambda _: Three())
    v = src.rollout(expert, None, 1.0, np.random.default_rng(0), 0)  # type: ignore[arg-type]
    np.testing.assert_array_equal(v.k, table[v.rows])
    # one episode per generation, in order: each starts at its first row and moves forward
    n_gen = len(env.unwrapped.data.generation_ids)
    assert set(np.asarray(arrays.offsets)[:n_gen].tolist()) <= set(v.rows.tolist())
    assert np.all(np.diff(v.rows) > 0)
    v0 = src.rollout(expert, None, 0.0, np.random.default_rng(0), 0)  # type: ignore[arg-type]
    assert set(v0.k.tolist()) == {3}
    assert v0.obs.dtype == np.float32 and v0.obs.shape[0] == len(v0.rows) == len(v0.k)
    assert v0.ar / v0.cost > 0
    env.close()


@pytest.mark.parametrize("n_out", [None, 5])
def test_regret_mlp_is_seeded_and_greedy_matches_its_snapshot(n_out: int | None) -> None:
    spec = ObservationSpec(kmax=4, lookahead=0)
    a, b = RegretMLP(spec, (8,), n_out=n_out, seed=7), RegretMLP(spec, (8,), n_out=n_out, seed=7)
    x = np.random.default_rng(1).normal(size=(20, spec.dim)).astype(np.float32)
    for (Wa, ba), (Wb, bb) in zip(a.snapshot().weights, b.snapshot().weights, strict=True):
        np.testing.assert_array_equal(Wa, Wb)
        np.testing.assert_array_equal(ba, bb)
    assert a.snapshot().scores(x).shape == (20, n_out or spec.kmax + 1)
    np.testing.assert_array_equal(a.greedy(x), a.snapshot().act_batch(x))
