"""Stop rules of the sequential mode: the round-level wrapper equals the per-token env; the learners run."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import specenv  # noqa: F401  (registers the environments)
from policies.learn.stopping import StopRulePolicy, load_stop_rule, round_spec, token_spec
from specenv.envs.replay import ENV_ID
from specenv.envs.sequential import SEQ_ID
from specenv.policy.mlp import MLPPolicy


def _random_rule(spec, seed: int = 0) -> MLPPolicy:
    """A random two-action MLP whose stop/draft choice depends on the per-token features."""
    rng = np.random.default_rng(seed)
    W0 = rng.normal(size=(spec.dim, 16)) * 2.0
    W1 = rng.normal(size=(16, 2))
    b1 = np.array([0.0, 0.6])  # a mild preference to draft: rounds of several lengths
    return MLPPolicy(spec, [(W0, rng.normal(size=16)), (W1, b1)], "tanh", "random-stop")


@pytest.mark.parametrize("signals", [("q",), ("q", "ent", "margin")])
def test_wrapper_and_per_token_env_give_the_same_k(small_traces: Path, signals: tuple[str, ...]) -> None:
    seq = gym.make(SEQ_ID, dataset=str(small_traces), split="all", signals=signals)
    rule = _random_rule(seq.unwrapped.obs_spec)
    wrapper = StopRulePolicy(rule)
    rnd = gym.make(ENV_ID, dataset=str(small_traces), split="all", drafting="sequential", signals=signals)
    assert rnd.unwrapped.data.spec == wrapper.spec == round_spec(rule.spec)
    ks_all: list[int] = []
    for gid in seq.unwrapped.data.generation_ids[:4]:
        obs, _ = seq.reset(seed=7, options={"generation_id": int(gid)})
        robs, _ = rnd.reset(seed=7, options={"generation_id": int(gid)})
        done = False
        seq_k, seq_cost = [], []
        while not done:
            obs, _, done, _, info = seq.step(int(rule.act(obs)))
            if info["verified"]:
                seq_k.append(info["k"])
                seq_cost.append(info["cost_ms"])
        done = False
        rnd_k, rnd_cost = [], []
        while not done:
            robs, _, done, _, info = rnd.step(wrapper.act(robs))
            rnd_k.append(info["k"])
            rnd_cost.append(info["cost_ms"])
        assert seq_k == rnd_k
        assert seq_cost == rnd_cost
        ks_all += seq_k
    assert len(set(ks_all)) > 1  # the rule is not trivially constant


def test_wrapper_batch_equals_single(small_traces: Path) -> None:
    rnd = gym.make(ENV_ID, dataset=str(small_traces), split="all", drafting="sequential")
    wrapper = StopRulePolicy(_random_rule(token_spec(rnd.unwrapped.data.spec), seed=1))
    obs, _ = rnd.reset(seed=0)
    xs = []
    done = False
    while not done:
        xs.append(obs)
        obs, _, done, _, _ = rnd.step(wrapper.act(obs))
    xs = np.asarray(xs)
    assert list(wrapper.act_batch(xs)) == [wrapper.act(x) for x in xs]


def test_stop_rule_saves_loads_and_refuses_round_policies(small_traces: Path, tmp_path: Path) -> None:
    spec = gym.make(SEQ_ID, dataset=str(small_traces)).unwrapped.obs_spec
    rule = _random_rule(spec)
    rule.save(tmp_path / "rule")
    back = load_stop_rule(tmp_path / "rule", expect=round_spec(spec))
    x = np.random.default_rng(0).random((20, back.spec.dim)).astype(np.float32)
    np.testing.assert_array_equal(back.act_batch(x), StopRulePolicy(rule).act_batch(x))
    with pytest.raises(ValueError, match="not a stop rule"):
        StopRulePolicy(
            MLPPolicy(round_spec(spec), [(np.zeros((round_spec(spec).dim, spec.kmax + 1)), np.zeros(spec.kmax + 1))])
        )


@pytest.mark.slow
def test_stop_dagger_beats_autoregressive(small_greedy_traces: Path) -> None:
    from oracle.dp import solve
    from policies.learn.imitation import split_arrays
    from policies.learn.stopping import train_stop_dagger
    from specenv.cost.source import cost_model_for
    from specenv.traces.datasets import load_dataset

    res = train_stop_dagger(str(small_greedy_traces), iterations=2, epochs=5, seed=0)
    assert res.policy.spec.per_token and res.policy.meta["drafting"] == "sequential"
    # the expert's rollouts (beta = 1) reach the bound of sequential drafting (= none's) on a greedy set
    arrays = split_arrays(str(small_greedy_traces), 6, "train")
    bound = solve(arrays, cost_model_for(load_dataset(str(small_greedy_traces)), "fit-train"))  # the default
    assert res.history[0]["rollout_speedup"] == pytest.approx(bound.speedup_pooled, rel=1e-9)
    env = gym.make(ENV_ID, dataset=str(small_greedy_traces), split="train", drafting="sequential")
    pol = StopRulePolicy(res.policy)
    cost = ar = 0.0
    for gid in env.unwrapped.data.generation_ids:
        obs, _ = env.reset(seed=0, options={"generation_id": int(gid)})
        done = False
        while not done:
            obs, _, done, _, info = env.step(pol.act(obs))
        cost += info["episode_cost_ms"]
        ar += info["ar_cost_ms"]
    assert ar / cost > 1.05


@pytest.mark.slow
def test_ppo_on_the_per_token_env_exports_a_stop_rule(small_traces: Path, tmp_path: Path) -> None:
    from policies.learn.rl import train_sb3

    res = train_sb3(
        "ppo", str(small_traces), tmp_path / "p", timesteps=1024, n_envs=2, drafting="sequential", tensorboard=False
    )
    assert res.policy.spec.per_token
    assert res.policy.weights[-1][0].shape[1] == 2
    back = load_stop_rule(tmp_path / "p" / "policy")
    assert back.spec.lookahead == back.spec.kmax
