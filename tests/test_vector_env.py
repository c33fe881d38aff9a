"""The native vector environment: equivalence with the single env, autoreset, masks, bad arguments."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from specenv.envs.registration import REPLAY_ID
from specenv.envs.replay import MoESpecEnv
from specenv.envs.vector import _END_KEYS as END_KEYS
from specenv.envs.vector import _STEP_KEYS as STEP_KEYS
from specenv.envs.vector import MoESpecVectorEnv


def compare_with_single(dataset, n_envs, n_steps, seed, kwargs, action_seed=0):
    """Step a vector env and n single envs (reset with seed + i) side by side; assert equality."""
    venv = MoESpecVectorEnv(num_envs=n_envs, dataset=dataset, **kwargs)
    envs = [MoESpecEnv(dataset=dataset, **kwargs) for _ in range(n_envs)]
    vobs, vinfo = venv.reset(seed=seed)
    for i, env in enumerate(envs):
        obs, info = env.reset(seed=seed + i)
        assert np.array_equal(obs, vobs[i])
        assert info["generation_id"] == vinfo["generation_id"][i] and info["category"] == vinfo["category"][i]
    rng = np.random.default_rng(action_seed)
    done = np.zeros(n_envs, dtype=bool)
    autoresets = 0
    for step in range(n_steps):
        actions = rng.integers(0, venv.kmax + 1, n_envs)
        vobs, vrew, vterm, vtrunc, vinfo = venv.step(actions)
        assert vobs.dtype == np.float32 and vobs in venv.observation_space
        assert not vtrunc.any()
        for i, env in enumerate(envs):
            if done[i]:  # NEXT_STEP autoreset: the vector env resets, the action is ignored
                obs, info = env.reset()
                reward, terminated = 0.0, False
                autoresets += 1
                assert not any(vinfo["_" + key][i] for key in STEP_KEYS)
            else:
                obs, reward, terminated, _, info = env.step(int(actions[i]))
                for key in STEP_KEYS:
                    assert vinfo["_" + key][i] and info[key] == vinfo[key][i], (step, i, key)
                if terminated:
                    for key in END_KEYS:
                        assert vinfo["_" + key][i] and info[key] == vinfo[key][i], (step, i, key)
                elif "_speedup" in vinfo:
                    assert not vinfo["_speedup"][i]
            assert info["generation_id"] == vinfo["generation_id"][i]
            assert info["category"] == vinfo["category"][i]
            assert np.array_equal(obs, vobs[i]), (step, i)
            assert reward == vrew[i] and terminated == vterm[i], (step, i)
            done[i] = terminated
    return autoresets


@pytest.mark.parametrize(
    "fixture, kwargs",
    [
        ("small_traces", {"split": "all", "lookahead": 2}),
        ("small_traces", {"split": "all", "kmax": 4, "cost_model": "profile"}),
        ("small_greedy_traces", {"split": "all"}),
    ],
)
def test_vector_equals_single_across_autoreset(request, fixture, kwargs):
    dataset = str(request.getfixturevalue(fixture))
    autoresets = compare_with_single(dataset, n_envs=3, n_steps=900, seed=11, kwargs=kwargs)
    assert autoresets >= 3


def test_make_vec_uses_native_vector_env(small_traces):
    venv = gym.make_vec(REPLAY_ID, num_envs=4, dataset=str(small_traces), split="all")
    assert isinstance(venv, MoESpecVectorEnv)
    assert venv.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    assert venv.single_action_space == gym.spaces.Discrete(7)
    assert venv.action_space.shape == (4,) and venv.observation_space.shape == (4, venv.data.spec.dim)
    obs, info = venv.reset(seed=0)
    assert obs.shape == (4, venv.data.spec.dim) and info["_generation_id"].all()


def test_reset_mask_resets_only_masked(small_traces):
    venv = MoESpecVectorEnv(num_envs=3, dataset=str(small_traces), split="all")
    venv.reset(seed=1)
    for _ in range(3):
        obs, *_ = venv.step(np.array([2, 2, 2]))
    t_before = venv._t.copy()
    mask = np.array([False, True, False])
    obs2, info = venv.reset(options={"reset_mask": mask})
    assert info["_generation_id"].tolist() == mask.tolist()
    assert np.array_equal(obs2[~mask], obs[~mask]) and venv._t[1] == 0
    assert venv._t[0] == t_before[0] and venv._t[2] == t_before[2]


def test_seed_sequence_and_generation_option(small_traces):
    venv = MoESpecVectorEnv(num_envs=2, dataset=str(small_traces), split="all")
    gids = venv.data.generation_ids.tolist()
    _, info = venv.reset(seed=[5, 9], options={"generation_id": [gids[2], gids[4]]})
    assert info["generation_id"].tolist() == [gids[2], gids[4]]
    single = MoESpecEnv(dataset=str(small_traces), split="all")
    o, _ = single.reset(seed=9, options={"generation_id": gids[4]})
    vo, _ = venv.reset(seed=[5, 9], options={"generation_id": [gids[2], gids[4]]})
    assert np.array_equal(o, vo[1])
    with pytest.raises(ValueError, match="generation_id"):
        venv.reset(options={"generation_id": 10**9})


@pytest.mark.parametrize(
    "actions",
    [np.array([0, 7]), np.array([-1, 0]), np.array([1.0, 2.0]), np.array([1, 2, 3]), np.array([[1, 2]])],
)
def test_bad_actions(small_traces, actions):
    venv = MoESpecVectorEnv(num_envs=2, dataset=str(small_traces), split="all")
    venv.reset(seed=0)
    with pytest.raises(ValueError, match="actions"):
        venv.step(actions)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_envs": 0}, "num_envs"),
        ({"kmax": 99}, "kmax"),
        ({"split": "dev"}, "split"),
        ({"lookahead": 9, "kmax": 2}, "lookahead"),
        ({"dataset": "nope"}, "dataset"),
    ],
)
def test_bad_constructor_arguments(small_traces, kwargs, name):
    kwargs = {"dataset": str(small_traces), **kwargs}
    with pytest.raises(ValueError, match=name):
        MoESpecVectorEnv(**kwargs)


def test_render_ansi(small_traces):
    venv = MoESpecVectorEnv(num_envs=2, dataset=str(small_traces), split="all", render_mode="ansi")
    venv.reset(seed=0)
    venv.step(np.array([1, 3]))
    lines = venv.render()
    assert len(lines) == 2 and "k=1" in lines[0] and "k=3" in lines[1]


def test_episode_returns_match_costs(small_greedy_traces):
    """Return of each finished episode = -episode_cost_ms / ar_unit_ms."""
    venv = MoESpecVectorEnv(
        num_envs=4, dataset=str(small_greedy_traces), split="all", cost_model="profile", reward="cost"
    )
    venv.reset(seed=3)
    ret = np.zeros(4)
    finished = 0
    for _ in range(400):
        _, rew, term, _, info = venv.step(np.full(4, 3))
        ret += rew
        for i in np.flatnonzero(term):
            assert -ret[i] == pytest.approx(info["episode_cost_ms"][i] / venv.ar_unit_ms, rel=1e-9)
            ret[i] = 0.0
            finished += 1
    assert finished >= 4


def test_native_equals_gymnasium_sync_vector_env(small_traces):
    """gymnasium's own SyncVectorEnv over the single env (NEXT_STEP autoreset) gives the same batches."""
    kw = {"dataset": str(small_traces), "split": "all", "lookahead": 1}
    sync = gym.make_vec(REPLAY_ID, num_envs=3, vectorization_mode="sync", **kw)
    native = gym.make_vec(REPLAY_ID, num_envs=3, **kw)
    a, _ = sync.reset(seed=8)
    b, _ = native.reset(seed=8)
    assert np.array_equal(a, b)
    rng = np.random.default_rng(2)
    for _ in range(600):
        actions = rng.integers(0, 7, 3)
        x, y = sync.step(actions), native.step(actions)
        for u, v in zip(x[:4], y[:4], strict=True):
            assert np.array_equal(u, v)
        for key in ("cost_ms", "accepted", "generation_id"):
            mask = x[4]["_" + key]
            assert np.array_equal(mask, y[4]["_" + key])
            assert np.array_equal(x[4][key][mask], y[4][key][mask])
