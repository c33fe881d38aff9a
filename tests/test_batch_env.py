"""The batch environments specenv/MoESpecBatch-v0 and MoESpecBatchBudget-v0 (issue 15 item 2)."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

import specenv  # noqa: F401  (registers the ids)
from specenv.envs.batch import BATCH_ID, BUDGET_ID, MoESpecBatchEnv
from specenv.replay.batch import allocate_budget, ar_schedule_ms, request_draws

REPLAY_ID = "specenv/MoESpec-v1"


def _run(env, policy, seed):
    obs, info = env.reset(seed=seed)
    infos = [info]
    done = False
    while not done:
        obs, reward, done, truncated, info = env.step(policy(env, obs))
        assert truncated is False and isinstance(reward, float)
        infos.append(info)
    return infos


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [
        (BATCH_ID, {"dataset": "live-vllm", "batch_size": 8, "drafting": "block", "lookahead": 3}),
        (BATCH_ID, {"dataset": "live-cpu", "batch_size": 2, "reward": "cost", "render_mode": "ansi"}),
        (BUDGET_ID, {"dataset": "live-vllm", "batch_size": 4, "lookahead": 2}),
    ],
)
def test_checkers_no_warnings_variants(env_id, kwargs):
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(env_id, **kwargs)
        gym_check_env(env.unwrapped)
        sb3_check_env(env)
    assert [str(w.message) for w in caught] == []


def test_batch_of_one_is_the_single_environment():
    """B = 1 with the scaled batch model: every request replays the single env's episode of its seed exactly."""
    benv = MoESpecBatchEnv("paper-default", batch_size=1, n_requests=3, split="test")
    single = gym.make(REPLAY_ID, dataset="paper-default", split="test").unwrapped
    ks = [3, 0, 5, 2, 7]
    obs, info = benv.reset(seed=11)
    seeds = info["seeds"]
    for r, s in enumerate(seeds):
        sobs, sinfo = single.reset(seed=s)
        _, block = benv.spec_batch.slots(obs)
        np.testing.assert_array_equal(block[0], sobs)
        i, done = 0, False
        while not done:
            k = ks[i % len(ks)]
            sobs, srew, done, _, sinfo = single.step(k)
            obs, brew, bdone, _, binfo = benv.step(np.array([k]))
            assert binfo["accepted"][0] == sinfo["accepted"] and binfo["committed"][0] == sinfo["committed"]
            assert binfo["step_ms"] == pytest.approx(sinfo["cost_ms"], rel=1e-12)
            if not done:
                np.testing.assert_allclose(benv.spec_batch.slots(obs)[1][0], sobs, rtol=1e-6, atol=1e-7)
            i += 1
        assert binfo["served"] == r + 1
    assert bdone


def test_request_draws_match_the_single_environment():
    single = gym.make(REPLAY_ID, dataset="live-vllm", split="train").unwrapped
    for s in (0, 5, 2**40):
        _, info = single.reset(seed=s)
        g, u = request_draws(s, single.data.lengths)
        assert int(single.data.generation_ids[g]) == info["generation_id"]
        assert len(u) == single.data.lengths[g]


def test_ar_reference_and_k0_speedup_one():
    env = MoESpecBatchEnv("live-cpu", batch_size=3, n_requests=5, split="test")
    infos = _run(env, lambda e, o: np.zeros(e.B, dtype=np.int64), seed=3)
    end = infos[-1]
    assert end["speedup"] == pytest.approx(1.0, rel=1e-12)
    # the vectorised AR schedule equals stepping the batch AR cost one step at a time
    d = env.data
    gens = [int(np.flatnonzero(d.generation_ids == gid)[0]) for gid in end["generation_ids"]]
    slots: list[list[int]] = []  # [request, t]
    nxt, total = 0, 0.0
    while True:
        slots = [s for s in slots if s[1] < d.lengths[gens[s[0]]]]
        while len(slots) < env.B and nxt < len(gens):
            slots.append([nxt, 0])
            nxt += 1
        if not slots:
            break
        total += env.batch_cost.ar_ms(np.array([d.L0[gens[r]] + t for r, t in slots], dtype=float))
        for s in slots:
            s[1] += 1
    assert ar_schedule_ms(env.batch_cost, np.array(gens), d.lengths, d.L0, env.B) == pytest.approx(total, rel=1e-12)
    assert end["ar_cost_ms"] == pytest.approx(total, rel=1e-12)


def test_idle_slots_are_ignored_and_episodes_are_deterministic():
    env = MoESpecBatchEnv("live-vllm", batch_size=4, n_requests=5, split="test")

    def policy(fill):
        def act(e, obs):
            active, _ = e.spec_batch.slots(obs)
            return np.where(active, 3, fill).astype(np.int64)

        return act

    a = _run(env, policy(0), seed=7)
    b = _run(env, policy(8), seed=7)
    assert len(a) == len(b)
    assert any(i.get("active", 4) < 4 for i in a[1:])  # the tail had idle slots
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x["step_ms"] == y["step_ms"] and x["accepted"] == y["accepted"]
    assert a[-1]["served"] == 5 and a[-1]["speedup"] > 1.0


def test_bad_arguments_and_actions():
    with pytest.raises(ValueError, match="batch_size"):
        MoESpecBatchEnv("live-vllm", batch_size=0)
    with pytest.raises(ValueError, match="n_requests"):
        MoESpecBatchEnv("live-vllm", batch_size=2, n_requests=True)
    env = MoESpecBatchEnv("live-vllm", batch_size=2)
    with pytest.raises(RuntimeError):
        env.step(np.array([1, 1]))
    env.reset(seed=0)
    with pytest.raises(ValueError, match="one per slot"):
        env.step(np.array([1, 1, 1]))
    with pytest.raises(ValueError, match="0..8"):
        env.step(np.array([1, 9]))
    with pytest.raises(ValueError, match="seeds"):
        env.reset(options={"seeds": [1]})
    with pytest.raises(ValueError, match="drafting"):
        gym.make(BUDGET_ID, dataset="live-vllm", drafting="none")


def test_allocate_budget_ranks_and_keeps_prefixes():
    scores = np.array([[0.9, 0.5, 0.1], [0.8, 0.7, 0.6], [-np.inf] * 3])
    assert allocate_budget(scores, 0).tolist() == [0, 0, 0]
    assert allocate_budget(scores, 3).tolist() == [1, 2, 0]
    assert allocate_budget(scores, 4).tolist() == [1, 3, 0]
    assert allocate_budget(scores, 100).tolist() == [3, 3, 0]  # capped at the verifiable tokens
    rising = np.array([[0.1, 0.9]])  # scores that rise with depth are read as their running minimum
    assert allocate_budget(rising, 1).tolist() == [1]


def test_budget_env_spends_the_budget():
    env = gym.make(BUDGET_ID, dataset="live-vllm", batch_size=3, lookahead=2).unwrapped
    env.reset(seed=1)
    assert env.action_space.n == 3 * 2 + 1
    _, _, _, _, info = env.step(0)
    assert info["k"] == [0, 0, 0] and info["budget"] == 0
    _, _, _, _, info = env.step(6)
    assert info["k"] == [2, 2, 2]
    _, _, _, _, info = env.step(3)
    assert sum(info["k"]) == 3 and max(info["k"]) <= 2
