"""specenv/MoESpecCap-v0: checkers, uncapped rounds = the k-only env, capped rounds = the joint oracle's evaluation."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

import specenv  # noqa: F401  (registers the ids)
from oracle.caps import evaluate_joint, solve_joint
from specenv.envs.caps import MoESpecCapEnv
from specenv.envs.registration import CAP_ID
from specenv.envs.replay import MoESpecEnv
from specenv.replay.tables import select_positions
from specenv.traces.datasets import load_dataset
from tests.rows import SYNTHETIC_CAPS, cap_trace_set


@pytest.fixture(scope="module")
def cap_set(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("capenv") / "caps-syn"
    cap_trace_set(n_generations=10, kmax=5, seed=3).save(path)
    return str(path)


def test_checkers_no_warnings(cap_set):
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(CAP_ID, dataset=cap_set, split="all", quality_weight=0.5)
        gym_check_env(env.unwrapped)
        sb3_check_env(env)
    assert [str(w.message) for w in caught] == []
    assert env.action_space == gym.spaces.MultiDiscrete([6, len(SYNTHETIC_CAPS) + 1])
    assert env.unwrapped.obs_spec.cap_levels == len(SYNTHETIC_CAPS)
    assert env.observation_space == env.unwrapped.obs_spec.space()  # the k-only vector, unchanged


def _episode(env, gid, act):
    obs, _ = env.reset(seed=1, options={"generation_id": gid})
    infos, rewards, done = [], [], False
    while not done:
        obs, r, done, _, info = env.step(act(infos[-1]["t"] if infos else 0))
        infos.append(info)
        rewards.append(r)
    return infos, rewards


def test_uncapped_actions_replay_the_k_only_env_exactly(cap_set):
    joint = MoESpecCapEnv(dataset=cap_set, split="all")
    single = MoESpecEnv(dataset=cap_set, split="all")
    for gid in joint.data.generation_ids[:4]:
        for k in (0, 2, 5):
            a, ra = _episode(joint, int(gid), lambda t, k=k: np.array([k, 0]))
            b, rb = _episode(single, int(gid), lambda t, k=k: k)
            assert ra == rb
            assert [(i["cost_ms"], i["accepted"], i["U_r"]) for i in a] == [
                (i["cost_ms"], i["accepted"], i["U_r"]) for i in b
            ]
            assert all(i["mismatches"] == 0 and i["cap"] == 0 for i in a)


@pytest.mark.parametrize("k, c", [(3, 1), (5, 3), (1, 2)])
def test_fixed_cap_episode_equals_the_exact_evaluation(cap_set, k, c):
    env = MoESpecCapEnv(dataset=cap_set, split="all", quality_weight=0.25)
    arr = select_positions(load_dataset(cap_set), None, "all")
    ev = evaluate_joint(arr, env.data.cost_model, (k, c))
    for g, gid in enumerate(env.data.generation_ids):
        infos, rewards = _episode(env, int(gid), lambda t: np.array([k, c]))
        last = infos[-1]
        assert last["episode_cost_ms"] == pytest.approx(ev.cost[g], rel=1e-9)
        assert last["episode_mismatches"] == pytest.approx(ev.mismatches[g], abs=1e-9)
        assert last["capped_rounds"] == len(infos)
        assert all(i["U_r"] <= SYNTHETIC_CAPS[c - 1] for i in infos)
        # reward = savings - weight x mismatches, in AR steps
        want = [i["committed"] - i["cost_ms"] / env.ar_unit_ms - 0.25 * i["mismatches"] for i in infos]
        np.testing.assert_allclose(rewards, want, rtol=1e-12)
    if c == 1:
        assert ev.mismatch_rate > 0  # the tightest synthetic cap does change tokens


def test_joint_oracle_policy_played_in_the_env_reaches_its_bound(cap_set):
    env = MoESpecCapEnv(dataset=cap_set, split="all")
    arr = select_positions(load_dataset(cap_set), None, "all")
    res = solve_joint(arr, env.data.cost_model, quality_weight=1.0)
    for g, gid in enumerate(env.data.generation_ids):
        lo = int(arr.offsets[g])
        infos, _ = _episode(env, int(gid), lambda t, lo=lo: np.array([res.k[lo + t], res.cap[lo + t]]))
        assert infos[-1]["episode_cost_ms"] == pytest.approx(res.cost[g], rel=1e-9)
        assert infos[-1]["episode_mismatches"] == pytest.approx(res.mismatches[g], abs=1e-9)


def test_k_zero_is_never_capped_and_bad_input_is_refused(cap_set, small_greedy_traces):
    env = MoESpecCapEnv(dataset=cap_set, split="all")
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([0, 2]))
    assert info["cap"] == 0 and info["cap_experts"] == 0 and info["mismatches"] == 0
    for bad in ([1, 4], [6, 0], 3, np.array([1.0, 1.0])):
        with pytest.raises(ValueError, match="action="):
            env.step(bad)
    for w in (-1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="quality_weight="):
            MoESpecCapEnv(dataset=cap_set, quality_weight=w)
    with pytest.raises(ValueError, match=r"dataset=.*expert-cap columns"):
        MoESpecCapEnv(dataset=str(small_greedy_traces))
