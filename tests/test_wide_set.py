"""The shipped live-vllm-wide set (vLLM on wide-moe-v1): it validates and backs every env, the oracle and the bench.

Expectations come from the set's own recorded numbers (the plain engine's steps, the rounds), not from
the code under test.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import oracle
import specenv  # noqa: F401  (registers the environments)
from specenv.cost.source import cost_model_for
from specenv.envs.registration import BATCH_ID, REPLAY_ID, SEQ_ID
from specenv.traces.datasets import load_dataset
from specenv.traces.splits import select_split

NAME = "live-vllm-wide"


@pytest.fixture(scope="module")
def ts():
    return load_dataset(NAME)


def test_the_set_is_big_enough_to_judge_and_in_the_regime(ts) -> None:
    ids = np.unique(ts.rounds["generation_id"])
    assert len(ids) >= 48 and len(select_split(ts.arrays(), "test").generation_ids) >= 10
    assert sorted(np.unique(ts.rounds["K"])) == list(range(ts.kmax + 1))
    ref = ts.manifest.extra["ar_reference"]
    assert ref["mismatches"] == 0 and ref["steps"] >= 48 * 100
    # a verification pass touching more experts costs more: the rounds' forward time rises with U_r at
    # every budget (rank correlation on the recorded rounds)
    from scipy.stats import spearmanr

    for k in range(1, ts.kmax + 1):
        sel = ts.rounds[ts.rounds["K"] == k]
        assert spearmanr(sel["U_r"], sel["T_T_wall_ms"]).statistic > 0.2, k


def test_step_time_model_prices_the_set(ts) -> None:
    cm = cost_model_for(ts, "fit-train")
    assert cm.source["kind"] == "fit-step" and cm.ar_step is not None
    ref = ts.manifest.extra["ar_reference"]
    assert cm.ar_step == (ref["a_ms"], ref["c_ms_per_token"])
    assert np.all(cm.c >= 0) and np.all(cm.overhead > 0)
    # the mean predicted step of each budget is close to the mean recorded step of the train rounds
    train = select_split(ts.arrays(), "train").generation_ids
    r = ts.rounds[ts.rounds["generation_id"].isin(train)]
    for k in range(ts.kmax + 1):
        sel = r[r["K"] == k]
        pred = cm.charged_ms(k, sel["U_r"].to_numpy(np.float64), sel["L"].to_numpy(np.float64))
        assert float(np.mean(pred)) == pytest.approx(float(sel["T_step_ms"].mean()), rel=0.05), k


@pytest.mark.parametrize(
    "env_id, kwargs",
    [
        (REPLAY_ID, {}),
        (REPLAY_ID, {"lookahead": 3}),
        (SEQ_ID, {}),
        (BATCH_ID, {"batch_size": 4}),
    ],
)
def test_every_env_runs_on_the_set(env_id: str, kwargs: dict) -> None:
    env = gym.make(env_id, dataset=NAME, split="test", **kwargs)
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    done, steps = False, 0
    while not done and steps < 10_000:
        obs, reward, term, trunc, info = env.step(env.action_space.sample())
        assert np.isfinite(reward)
        done, steps = term or trunc, steps + 1
    assert done
    env.close()


def test_vector_env_and_oracle(ts) -> None:
    envs = gym.make_vec(REPLAY_ID, num_envs=4, vectorization_mode="vector_entry_point", dataset=NAME, split="test")
    envs.reset(seed=0)
    for _ in range(20):
        _, r, *_ = envs.step(np.full(4, 3))
        assert np.all(np.isfinite(r))
    envs.close()
    arr = select_split(ts.arrays(), "test")
    cm = cost_model_for(ts, "fit-train")
    best = oracle.solve(arr, cm)
    fixed = [oracle.evaluate_policy(arr, cm, k) for k in range(ts.kmax + 1)]
    assert np.all(best.cost <= np.min([f.cost for f in fixed], axis=0) * (1 + 1e-12))  # per generation
    assert best.cost.sum() <= min(f.cost.sum() for f in fixed) * (1 + 1e-12)
    # the plain engine is the reference: k = 0 in the speculating engine is slower than it
    assert fixed[0].cost.sum() > fixed[0].ar.sum()
