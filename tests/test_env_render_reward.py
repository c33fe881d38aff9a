"""The reward option (cost | savings), render_mode="rgb_array", and the engine backends by name."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

import specenv  # noqa: F401  (registers the ids)
from specenv.envs.common import DEFAULT_REWARD
from specenv.envs.live import MoESpecLiveEnv
from specenv.envs.registration import LIVE_ID, LIVE_V0_ID, REPLAY_ID, REPLAY_V0_ID
from specenv.envs.render import FRAME_ROUNDS, FRAME_SHAPE, RoundStrip
from specenv.envs.replay import ENV_ID, MoESpecEnv
from specenv.envs.vector import MoESpecVectorEnv

pytest.importorskip("stable_baselines3")


# ------------------------------------------------------------------------------------------ SB3 quickstart
def test_sb3_make_vec_env_works_unchanged():
    """SB3's make_vec_env passes render_mode="rgb_array" by default; it must build and step."""
    from stable_baselines3.common.env_util import make_vec_env

    venv = make_vec_env("specenv/MoESpec-v1", n_envs=4, seed=0)
    obs = venv.reset()
    assert obs.shape == (4, *venv.observation_space.shape)
    for _ in range(10):
        obs, rewards, dones, infos = venv.step(np.full(4, 3))
    assert rewards.shape == (4,) and len(infos) == 4
    # the v1 default: the savings reward, committed tokens minus the cost in AR units
    units = np.array([i["cost_ms"] for i in infos]) / np.array(venv.get_attr("ar_unit_ms"))
    committed = np.array([i["committed"] for i in infos])
    np.testing.assert_allclose(rewards[~dones], (committed - units)[~dones], rtol=1e-6)
    assert venv.get_attr("render_mode") == ["rgb_array"] * 4
    frames = venv.get_images()
    assert len(frames) == 4
    for f in frames:
        assert isinstance(f, np.ndarray) and f.dtype == np.uint8 and f.shape == FRAME_SHAPE
        assert (f != 255).any()  # ten rounds were drawn
    venv.close()


# ------------------------------------------------------------------------------------------ rgb_array
def test_single_env_rgb_array_frame_shows_k_and_accepted(small_greedy_traces):
    env = gym.make(ENV_ID, dataset=str(small_greedy_traces), split="all", render_mode="rgb_array")
    kmax = env.unwrapped.kmax
    env.reset(seed=0)
    frame = env.render()
    assert frame.dtype == np.uint8 and frame.shape == FRAME_SHAPE
    assert (frame == 255).all()  # no round yet: background only
    ks, accs = [], []
    for i in range(FRAME_ROUNDS + 5):
        k = [kmax, 0, 2, 5][i % 4]
        _, _, term, _, info = env.step(k)
        ks.append(k)
        accs.append(info["accepted"])
        if term:
            break
    frame = env.render()
    assert frame.dtype == np.uint8 and frame.shape == FRAME_SHAPE
    height = FRAME_SHAPE[0]
    shown = list(zip(ks, accs, strict=True))[-FRAME_ROUNDS:]
    first = FRAME_ROUNDS - len(shown)  # columns left of the first shown round stay empty
    for j, (k, a) in enumerate(shown):
        col = frame[:, 4 * (first + j)]
        grey = int((col == (176, 176, 176)).all(axis=1).sum())
        green = int((col == (46, 139, 87)).all(axis=1).sum())
        assert (col[-1] == (48, 48, 48)).all()  # baseline pixel of a round that happened
        assert green == (a * (height - 1)) // kmax  # accepted bar
        assert grey + green == (k * (height - 1)) // kmax  # budget bar (under the accepted one)
        assert (frame[:, 4 * (first + j) + 3] == 255).all()  # gap column
    # a new episode starts with an empty strip
    env.reset(seed=1)
    assert (env.render() == 255).all()


def test_vector_env_rgb_array_frames_match_single_envs(small_traces):
    n, seed = 3, 11
    venv = MoESpecVectorEnv(num_envs=n, dataset=str(small_traces), split="all", render_mode="rgb_array")
    envs = [MoESpecEnv(dataset=str(small_traces), split="all", render_mode="rgb_array") for _ in range(n)]
    venv.reset(seed=seed)
    for i, e in enumerate(envs):
        e.reset(seed=seed + i)
    rng = np.random.default_rng(0)
    ended = np.zeros(n, dtype=bool)
    for _ in range(60):  # long enough for some sub-environments to finish and autoreset
        ks = rng.integers(0, venv.kmax + 1, size=n)
        _, _, term, _, _ = venv.step(ks)
        for i, e in enumerate(envs):
            if ended[i]:  # NEXT_STEP autoreset: this step reset the sub-environment
                e.reset()
            else:
                e.step(int(ks[i]))
        frames = venv.render()
        assert isinstance(frames, tuple) and len(frames) == n
        for i, e in enumerate(envs):
            assert frames[i].dtype == np.uint8 and frames[i].shape == FRAME_SHAPE
            np.testing.assert_array_equal(frames[i], e.render())
        ended = term
    assert venv.render_mode == "rgb_array"


def test_round_strip_keeps_the_last_rounds():
    strip = RoundStrip(kmax=4, n=2)
    for r in range(FRAME_ROUNDS + 3):
        strip.push(np.array([r % 5, 4]), np.array([0, r % 5]))
    assert strip.k[0, -1] == (FRAME_ROUNDS + 2) % 5 and strip.k[0, 0] == 3 % 5
    strip.clear(np.array([True, False]))
    assert (strip.k[0] == -1).all() and (strip.k[1] == 4).all()
    frames = strip.frames()
    assert frames.shape == (2, *FRAME_SHAPE) and frames.dtype == np.uint8
    assert (frames[0] == 255).all() and not (frames[1] == 255).all()


@pytest.mark.parametrize("kwargs", [{"render_mode": "rgb_array"}, {"render_mode": "rgb_array", "reward": "savings"}])
def test_checkers_no_warnings_rgb_array(small_traces, kwargs):
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(ENV_ID, dataset=str(small_traces), split="all", **kwargs)
        gym_check_env(env.unwrapped)
        sb3_check_env(env)
        env.close()
    assert [str(w.message) for w in caught] == []


def test_human_mode_is_gymnasiums_human_rendering(small_traces):
    from gymnasium.wrappers import HumanRendering

    with pytest.raises(ValueError, match="render_mode"):
        MoESpecEnv(dataset=str(small_traces), render_mode="human")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gymnasium says it wraps rgb_array in HumanRendering
        env = gym.make(ENV_ID, dataset=str(small_traces), render_mode="human")
    assert isinstance(env, HumanRendering) and env.unwrapped.render_mode == "rgb_array"


def test_render_none_warns_and_returns_none(small_traces):
    env = MoESpecEnv(dataset=str(small_traces))
    env.reset(seed=0)
    with pytest.warns(UserWarning, match="rgb_array"):
        assert env.render() is None


# ------------------------------------------------------------------------------------------ reward option
def _episode(env, seed, ks):
    env.reset(seed=seed)
    rewards, committed, infos = [], [], []
    for i in range(10_000):
        _, r, term, _, info = env.step(ks[i % len(ks)])
        rewards.append(r)
        committed.append(info["committed"])
        infos.append(info)
        if term:
            return rewards, committed, infos
    raise AssertionError("episode did not end")


def test_savings_reward_is_cost_reward_plus_committed(small_traces):
    cost = MoESpecEnv(dataset=str(small_traces), split="all", reward="cost")
    sav = MoESpecEnv(dataset=str(small_traces), split="all")  # the default
    assert cost.reward == "cost" and sav.reward == "savings"
    ks = [3, 0, 5, 1, 2]
    for seed in range(4):
        rc, cc, ic = _episode(cost, seed, ks)
        rs, cs, is_ = _episode(sav, seed, ks)
        assert cc == cs and ic == is_  # same dynamics, same info
        assert all(isinstance(r, float) for r in rs)
        # exactly -cost / ar_unit_ms + committed, bit for bit
        assert rs == [-info["cost_ms"] / sav.ar_unit_ms + info["committed"] for info in is_]
        assert rs == [r + c for r, c in zip(rc, cc, strict=True)]
        # over an episode the added terms sum to N: the savings return is N minus the cost in AR units
        n = is_[-1]["t"]
        assert sum(cs) == n
        assert sum(rs) == pytest.approx(n + sum(rc), rel=1e-12)
    # the cost reward: every reward is negative
    assert all(r < 0 for r in _episode(cost, 0, ks)[0])


def test_vector_savings_reward_matches_single(small_traces):
    n, seed = 4, 5
    venv = MoESpecVectorEnv(num_envs=n, dataset=str(small_traces), split="all", reward="savings")
    vcost = MoESpecVectorEnv(num_envs=n, dataset=str(small_traces), split="all", reward="cost")
    envs = [MoESpecEnv(dataset=str(small_traces), split="all", reward="savings") for _ in range(n)]
    venv.reset(seed=seed)
    vcost.reset(seed=seed)
    for i, e in enumerate(envs):
        e.reset(seed=seed + i)
    rng = np.random.default_rng(1)
    ended = np.zeros(n, dtype=bool)
    for _ in range(80):
        ks = rng.integers(0, venv.kmax + 1, size=n)
        _, rew, term, _, info = venv.step(ks)
        _, rew_c, term_c, _, _ = vcost.step(ks)
        np.testing.assert_array_equal(term, term_c)
        live = ~ended
        np.testing.assert_array_equal(rew[live], rew_c[live] + info["committed"][live])
        np.testing.assert_array_equal(rew[ended], 0.0)  # autoreset steps carry no reward
        for i, e in enumerate(envs):
            if ended[i]:
                e.reset()
            else:
                _, r, _, _, _ = e.step(int(ks[i]))
                assert r == rew[i]  # bit-identical to the single env
        ended = term


@pytest.mark.parametrize("cls", [MoESpecEnv, MoESpecVectorEnv, MoESpecLiveEnv])
def test_default_reward_is_savings(cls):
    import inspect

    assert DEFAULT_REWARD == "savings"
    assert inspect.signature(cls).parameters["reward"].default == "savings"


def _make_quietly(env_id, **kwargs):
    """gym.make of an id; the v0 ids give Gymnasium's one "out of date" notice, checked here."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(env_id, **kwargs)
    notices = [str(w.message) for w in caught if "is out of date" in str(w.message)]
    assert len(notices) == (1 if env_id.endswith("-v0") else 0), notices
    return env


def test_v1_ids_default_to_savings_and_v0_ids_keep_the_cost_reward(small_traces):
    assert (REPLAY_ID, LIVE_ID) == ("specenv/MoESpec-v1", "specenv/MoESpecLive-v1")
    assert ENV_ID == REPLAY_ID
    # same classes; only the v0 ids pass the old default
    for new, old in ((REPLAY_ID, REPLAY_V0_ID), (LIVE_ID, LIVE_V0_ID)):
        assert gym.spec(new).entry_point == gym.spec(old).entry_point
        assert gym.spec(new).vector_entry_point == gym.spec(old).vector_entry_point
        assert gym.spec(new).kwargs == {} and gym.spec(old).kwargs == {"reward": "cost"}
    kw = {"dataset": str(small_traces), "split": "all"}
    v1, v0 = _make_quietly(REPLAY_ID, **kw), _make_quietly(REPLAY_V0_ID, **kw)
    assert v1.unwrapped.reward == "savings" and v0.unwrapped.reward == "cost"
    assert _make_quietly(REPLAY_V0_ID, reward="savings", **kw).unwrapped.reward == "savings"  # an argument wins
    ks = [4, 1, 0, 6, 2]
    for seed in range(3):
        r1, c1, i1 = _episode(v1, seed, ks)
        r0, c0, i0 = _episode(v0, seed, ks)
        assert i1 == i0  # same episode, same info
        n = i1[-1]["t"]
        # the returns differ by N, whatever the policy: the same optimum
        assert sum(r1) == pytest.approx(sum(r0) + n, rel=1e-12)
        assert sum(r0) == pytest.approx(-i0[-1]["episode_cost_ms"] / v0.unwrapped.ar_unit_ms, rel=1e-12)
    # make_vec passes the id's kwargs to the native vector env too
    for env_id, reward in ((REPLAY_ID, "savings"), (REPLAY_V0_ID, "cost")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            venv = gym.make_vec(env_id, num_envs=2, vectorization_mode="vector_entry_point", **kw)
        assert isinstance(venv, MoESpecVectorEnv) and venv.reward == reward
        venv.close()


@pytest.mark.parametrize("cls", [MoESpecEnv, MoESpecVectorEnv])
def test_bad_reward_names_the_argument(small_traces, cls):
    with pytest.raises(ValueError, match="reward='profit'"):
        cls(dataset=str(small_traces), reward="profit")


def test_sb3_adapter_passes_reward(small_traces):
    from specenv.envs.sb3 import make_sb3_vec_env

    venv = make_sb3_vec_env(num_envs=2, seed=0, dataset=str(small_traces), split="all", reward="savings")
    venv.reset()
    _, rewards, _, infos = venv.step(np.array([2, 2]))
    units = np.array([i["cost_ms"] for i in infos]) / venv.venv.ar_unit_ms
    committed = np.array([i["committed"] for i in infos])
    np.testing.assert_allclose(rewards, committed - units, rtol=1e-6)
    with pytest.raises(ValueError, match="rgb_array"):
        venv.get_images()


# ------------------------------------------------------------------------------------------ live env arguments
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"reward": "measured"}, "reward"),  # the old meaning moved to cost_source
        ({"cost_source": "wall"}, "cost_source"),
        ({"backend": "sglang"}, "backend"),
        ({"render_mode": "human"}, "render_mode"),
    ],
)
def test_live_env_rejects_bad_arguments_before_loading_anything(kwargs, name):
    from specenv.envs.live import MoESpecLiveEnv

    with pytest.raises(ValueError, match=name):
        MoESpecLiveEnv(**kwargs)


def test_backends_by_name():
    import importlib.util

    from specenv.engines import BACKENDS, BackendConfig, make_backend

    assert set(BACKENDS) >= {"hf", "vllm"}
    for target in BACKENDS.values():
        module, _, func = target.partition(":")
        assert importlib.util.find_spec(module) is not None and func == "make"
    with pytest.raises(ValueError, match="backend='sglang'"):
        make_backend("sglang", "small-moe-v1", BackendConfig(kmax=4, max_new_tokens=8))
