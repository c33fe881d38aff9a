"""SB3 VecEnv adapter over the native vector env: same-step autoreset, DummyVecEnv equivalence, PPO smoke."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

from stable_baselines3.common.vec_env import DummyVecEnv, VecCheckNan, VecEnv, VecMonitor  # noqa: E402

from specenv.envs.replay import MoESpecEnv  # noqa: E402
from specenv.envs.sb3 import SB3VecEnv, make_sb3_vec_env  # noqa: E402
from specenv.envs.vector import MoESpecVectorEnv  # noqa: E402


def assert_infos_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys(), (g.keys(), w.keys())
        for key, val in w.items():
            if key == "terminal_observation":
                assert np.array_equal(g[key], val)
            else:
                assert g[key] == val and type(g[key]) is type(val), (key, g[key], val)


@pytest.mark.parametrize("kwargs", [{"split": "all", "lookahead": 2}, {"split": "all", "kmax": 3}])
def test_adapter_equals_dummy_vec_env(small_traces, kwargs):
    kwargs = {"dataset": str(small_traces), "cost_model": "profile", **kwargs}
    n = 3
    ours = make_sb3_vec_env(n, seed=21, **kwargs)
    ref = DummyVecEnv([lambda: MoESpecEnv(**kwargs) for _ in range(n)])
    ref.seed(21)
    assert isinstance(ours, VecEnv) and ours.num_envs == n
    assert ours.observation_space == ref.observation_space and ours.action_space == ref.action_space
    obs = ours.reset()
    assert isinstance(obs, np.ndarray)  # reset returns observations only
    assert np.array_equal(obs, ref.reset())
    rng = np.random.default_rng(0)
    dones = 0
    for _ in range(700):
        actions = rng.integers(0, ours.action_space.n, n)
        o1, r1, d1, i1 = ours.step(actions)
        o2, r2, d2, i2 = ref.step(actions)
        assert np.array_equal(o1, o2) and np.array_equal(r1, r2) and np.array_equal(d1, d2)
        assert r1.dtype == r2.dtype and d1.dtype == d2.dtype
        assert_infos_equal(i1, i2)
        for i in np.flatnonzero(d1):
            assert "terminal_observation" in i1[i] and i1[i]["TimeLimit.truncated"] is False
            assert "speedup" in i1[i]
        dones += int(d1.sum())
    assert dones >= 3


def test_adapter_set_options_and_seed(small_traces):
    venv = SB3VecEnv(MoESpecVectorEnv(num_envs=2, dataset=str(small_traces), split="all"))
    gids = venv.venv.data.generation_ids.tolist()
    venv.seed(4)
    venv.set_options([{"generation_id": gids[1]}, {"generation_id": gids[3]}])
    venv.reset()
    assert venv.venv.data.generation_ids[venv.venv._gen].tolist() == [gids[1], gids[3]]
    single = MoESpecEnv(dataset=str(small_traces), split="all")
    o, _ = single.reset(seed=5, options={"generation_id": gids[3]})
    venv.seed(4)
    venv.set_options([{"generation_id": gids[1]}, {"generation_id": gids[3]}])
    assert np.array_equal(venv.reset()[1], o)
    assert venv.get_attr("kmax") == [6, 6] and venv.env_is_wrapped(object) == [False, False]


@pytest.mark.slow
def test_ppo_smoke(small_traces):
    from stable_baselines3 import PPO

    env = VecCheckNan(
        VecMonitor(make_sb3_vec_env(4, seed=0, dataset=str(small_traces), split="all")), raise_exception=True
    )
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=64, n_epochs=1, seed=0, device="cpu")
    model.learn(128)
    obs = env.reset()
    actions, _ = model.predict(obs, deterministic=True)
    assert actions.shape == (4,)
