"""Learners and the deployable numpy form: SB3 export fidelity, save/load, imitation of the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import specenv  # noqa: F401  (registers the environments)
from specenv.envs.replay import ENV_ID
from specenv.policy.mlp import MLPPolicy


def _observations(traces: Path, n: int = 1000, seed: int = 0) -> np.ndarray:
    """Real observations from random-action rollouts, topped up with uniform samples of the Box."""
    env = gym.make(ENV_ID, dataset=str(traces), split="all")
    rng = np.random.default_rng(seed)
    obs_list = []
    obs, _ = env.reset(seed=seed)
    while len(obs_list) < n // 2:
        obs_list.append(obs)
        obs, _, done, _, _ = env.step(int(rng.integers(env.action_space.n)))
        if done:
            obs, _ = env.reset()
    box = env.observation_space
    uniform = rng.random((n - len(obs_list), box.shape[0])).astype(np.float32) * np.minimum(box.high, 2.0)
    return np.concatenate([np.asarray(obs_list, dtype=np.float32), uniform])


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "dqn"])
def test_exported_numpy_policy_matches_sb3_on_1000_observations(algo: str, small_traces: Path, tmp_path: Path) -> None:
    from policies.learn.rl import train_sb3

    res = train_sb3(algo, str(small_traces), tmp_path / algo, timesteps=1500, n_envs=4, seed=1, tensorboard=False)
    obs = _observations(small_traces)
    assert obs.shape[0] == 1000
    # SB3 reads standardised observations; the export folded the statistics into its first layer
    sb3_actions, _ = res.model.predict(res.normalize.normalize_obs(obs), deterministic=True)
    ours = res.policy.act_batch(obs)
    np.testing.assert_array_equal(ours, sb3_actions)
    # and the copy on disk (policy.json + weights.npz, no pickle) gives the same actions
    loaded = MLPPolicy.load(tmp_path / algo / "policy")
    np.testing.assert_array_equal(loaded.act_batch(obs), sb3_actions)
    assert json.loads((tmp_path / algo / "policy" / "policy.json").read_text())["meta"]["algo"] == algo


def test_mlp_policy_roundtrip_and_single_vs_batch(tmp_path: Path) -> None:
    from specenv.observation.single import ObservationSpec

    spec = ObservationSpec(kmax=4)
    rng = np.random.default_rng(0)
    w = [(rng.normal(size=(spec.dim, 8)), rng.normal(size=8)), (rng.normal(size=(8, 5)), rng.normal(size=5))]
    pol = MLPPolicy(spec, w, "relu", "t")
    pol.save(tmp_path / "p")
    back = MLPPolicy.load(tmp_path / "p")
    x = rng.random((50, spec.dim)).astype(np.float32)
    np.testing.assert_array_equal(back.act_batch(x), pol.act_batch(x))
    assert [back.act(o) for o in x] == list(pol.act_batch(x))
    with np.load(tmp_path / "p" / "weights.npz", allow_pickle=False) as z:
        assert sorted(z.files) == ["W0", "W1", "b0", "b1"]


def test_mlp_policy_rejects_bad_files_with_one_line(tmp_path: Path) -> None:
    from specenv.observation.single import ObservationSpec

    (tmp_path / "policy.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="policy.json"):
        MLPPolicy.load(tmp_path)
    (tmp_path / "policy.json").write_text(
        json.dumps(
            {
                "format": "specenv.policy/1",
                "kind": "mlp",
                "layers": 1,
                "observation": ObservationSpec(kmax=4).to_json(),
            }
        )
    )
    with pytest.raises(ValueError, match="weights.npz"):
        MLPPolicy.load(tmp_path)


def test_mlp_policy_checks_shapes() -> None:
    from specenv.observation.single import ObservationSpec

    spec = ObservationSpec(kmax=4)
    with pytest.raises(ValueError, match="inputs"):
        MLPPolicy(spec, [(np.zeros((3, 5)), np.zeros(5))])
    with pytest.raises(ValueError, match="scores"):
        MLPPolicy(spec, [(np.zeros((spec.dim, 3)), np.zeros(3))])


@pytest.mark.slow
def test_dagger_learns_from_oracle_labels(small_greedy_traces: Path) -> None:
    """One cheap DAgger run: the imitation policy beats always-AR and is exported in numpy form."""
    from oracle.dp import evaluate_policy, solve
    from policies.learn.imitation import split_arrays, train_dagger
    from specenv.cost.source import cost_model_for
    from specenv.traces.datasets import load_dataset

    res = train_dagger(str(small_greedy_traces), iterations=2, epochs=20, seed=0)
    assert len(res.history) == 2
    assert res.history[0]["beta"] == 1.0
    # the expert's rollouts (beta = 1) reproduce the oracle's bound on a greedy trace exactly
    arrays = split_arrays(str(small_greedy_traces), 6, "train")
    model = cost_model_for(load_dataset(str(small_greedy_traces)), "fit-train")  # the learners' default
    bound = solve(arrays, model)
    assert res.history[0]["rollout_speedup"] == pytest.approx(bound.speedup_pooled, rel=1e-9)
    ar = evaluate_policy(arrays, model, 0).speedup_pooled
    assert ar == pytest.approx(1.0)
    # the learned policy runs in the environment and is better than plain decoding
    env = gym.make(ENV_ID, dataset=str(small_greedy_traces), split="train")
    cost = ar_cost = 0.0
    for gid in env.unwrapped.data.generation_ids:
        obs, _ = env.reset(seed=0, options={"generation_id": int(gid)})
        done = False
        while not done:
            obs, _, done, _, info = env.step(res.policy.act(obs))
        cost += info["episode_cost_ms"]
        ar_cost += info["ar_cost_ms"]
    assert ar_cost / cost > 1.05
