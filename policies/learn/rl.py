"""Stable-Baselines3 learners (PPO, DQN) on the native vector environment through the SB3 adapter.

Training runs on the train split; the result is exported to the numpy form of
:mod:`specenv.policy.mlp` (what the benchmark and vLLM load). The SB3 model itself (``model.zip``) and
TensorBoard logs are written to the run folder for inspection; they are not the deployment format.

Reward used for training: the environment's ``reward="savings"`` option by default (passed
explicitly; also the environments' own default since ``specenv/MoESpec-v1``, see
:class:`specenv.envs.replay.MoESpecEnv`): minus the round cost in AR-step units **plus the tokens
the round committed**, i.e. the AR-equivalent cost the round saved. Over an episode the added terms
sum to N, the generation's length, whatever the policy does, so the undiscounted optimum is
unchanged; but the per-step signal is now aligned with the goal. With the raw cost reward
(``reward="cost"``) a plain AR step (-1) looks better than a good speculative round (about -1.9 for
3.8 tokens) until the credit for the shorter episode propagates through a value function that
cannot see the remaining length N; in our runs PPO and DQN then collapsed to k = 0.
Observations are standardised for the networks by SB3's ``VecNormalize`` (running mean and variance
of the train rollouts, no clipping); the exported policy stays a function of the raw observation of
the contract, because the final statistics are folded into the first layer
(:func:`policies.learn.export.from_sb3` with ``obs_mean``/``obs_var``). Without it the features that move
least (context, progress) barely reach the network and PPO converged to one budget everywhere.

Drafting modes: ``"none"`` (lookahead 0) and ``"block"`` (lookahead h > 0) train on the native vector
environment; ``"sequential"`` trains a stop rule on the per-token environment
``specenv/MoESpecSeq-v0`` (SB3's ``DummyVecEnv`` over ``n_envs`` copies) and exports it with the
per-token contract (two actions; :mod:`policies.learn.stopping` runs it in the round-level benchmark).

Rate shaping (``rate=S``, the default for the shipped recipe: S = the best fixed k's exact speedup on
the train split): the reward of a round is ``committed - S * cost / ar_unit_ms``. Its episode sum,
``N - S * cost``, is a positive multiple of minus the cost plus the constant N, so the optimum is still
the oracle's; but with S near the attainable speedup a round's own reward measures its tokens per
cost against the going rate (Dinkelbach's form of a ratio objective), so a discounted learner is not
pushed to larger budgets the way the plain savings reward (S = 1) pushes it: there a longer round
always pays more *per round*. Built from the environment's ``reward="cost"`` and ``info["committed"]``.

Discounting: with the savings reward each round's own reward already measures its progress, so a
moderate ``gamma`` (0.99 by default) suffices and lowers the variance of the returns; with the cost
reward, gamma must be close to 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specenv.policy.mlp import MLPPolicy

ALGOS = ("ppo", "dqn")


@dataclass
class TrainResult:
    """Outcome of :func:`train_sb3`."""

    policy: MLPPolicy
    run_dir: Path
    model: Any
    normalize: Any = None  # the VecNormalize wrapper (its obs statistics are folded into the policy)


def hyperparameters(algo: str, n_envs: int, gamma: float, drafting: str = "none", **overrides: Any) -> dict[str, Any]:
    """Every SB3 hyper-parameter of the shipped recipe (CleanRL-style: all recorded in ``policy.json``).

    Args:
        algo: ``"ppo"`` or ``"dqn"``.
        n_envs: Parallel environments.
        gamma: Discount factor.
        drafting: Drafting mode (the per-token env of ``"sequential"`` has ~4x more, shorter steps).
        overrides: Replace any entry (e.g. ``learning_rate``).
    """
    if algo == "ppo":
        n_steps = 128 if drafting == "sequential" else 64
        hp: dict[str, Any] = {
            "learning_rate": 1e-3,
            "n_steps": n_steps,
            "batch_size": min(1024, n_steps * n_envs),
            "n_epochs": 10,
            "gae_lambda": 0.95,
            "clip_range": 0.2,
            "ent_coef": 0.01,
            "vf_coef": 0.5,
            "max_grad_norm": 0.5,
            "normalize_advantage": True,
        }
    else:
        hp = {
            "learning_rate": 5e-4,
            "buffer_size": 200_000,
            "learning_starts": 5_000,
            "batch_size": 256,
            "train_freq": 4,
            "gradient_steps": 4,
            "target_update_interval": 2_000,
            "exploration_fraction": 0.3,
            "exploration_initial_eps": 1.0,
            "exploration_final_eps": 0.02,
            "tau": 1.0,
        }
    hp |= {"gamma": gamma, "net_arch": [64, 64], "activation": "tanh" if algo == "ppo" else "relu"}
    hp |= {"norm_obs": True, "norm_reward": True, "clip_obs": None}
    return hp | overrides


def train_sb3(
    algo: str,
    dataset: str,
    run_dir: str | Path,
    timesteps: int = 300_000,
    seed: int = 0,
    n_envs: int = 32,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    lookahead: int = 0,
    tensorboard: bool = True,
    reward: str = "savings",
    gamma: float = 0.99,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    drafting: str | None = None,
    overrides: dict[str, Any] | None = None,
    rate: float | None = None,
    split: str = "train",
) -> TrainResult:
    """Train PPO or DQN on the train split and export it.

    Args:
        algo: ``"ppo"`` or ``"dqn"``.
        dataset: Registry name or trace-set folder.
        run_dir: Folder for ``model.zip``, TensorBoard logs and the exported policy.
        timesteps: Environment steps.
        seed: Seed of SB3, torch and the environments.
        n_envs: Parallel streams of the native vector environment (copies of the per-token env).
        kmax: Largest budget (default: the trace set's Kmax).
        cost_model: ``"fit-train"`` (the train split's fit, the default), ``"fit"``, ``"profile"`` or a JSON path.
        lookahead: Draft confidences in the observation (block mode; 0 for none and sequential).
        tensorboard: Write TensorBoard logs under ``run_dir/tb``.
        reward: The environment's reward option used for training: ``"savings"`` (default; see
            the module docstring) or ``"cost"``. VecMonitor logs the return of this reward.
        gamma: Discount factor.
        log: Progress lines.
        progress: Called as ``progress(steps_done, timesteps)`` after every step of the vector env.
        drafting: ``"none"``, ``"block"`` or ``"sequential"`` (None: block for lookahead > 0, else none).
        overrides: Hyper-parameters replacing the recipe's (:func:`hyperparameters`).
        rate: Train on the rate-shaped reward ``committed - rate * cost units`` (module docstring);
            None: the environment's ``reward`` as given; a float S > 0: that rate
            (:func:`best_fixed_rate` gives the shipped recipe's).
        split: The generations trained on: ``"train"`` (default), or ``"train-fit"`` (train minus the
            validation carve, :mod:`specenv.traces.splits`) for a hyper-parameter search.

    Raises:
        ValueError: For an unknown algorithm or bad environment arguments.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo={algo!r}: expected one of {', '.join(ALGOS)}")
    import torch

    from specenv.cost.model import check_drafting

    mode = drafting or ("block" if lookahead else "none")
    if mode == "sequential":
        if lookahead:
            raise ValueError(
                f"lookahead={lookahead}: the per-token env of drafting='sequential' shows each draft's own confidence"
            )
    else:
        mode, lookahead = check_drafting(mode, lookahead, 10**6)
    torch.set_num_threads(1)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    hp = hyperparameters(algo, n_envs, gamma, mode, **(overrides or {}))
    if rate is not None and not rate > 0:
        raise ValueError(f"rate={rate!r}: must be > 0")
    env_reward = "cost" if rate is not None else reward
    venv, spec, base = _make_env(mode, dataset, kmax, cost_model, lookahead, env_reward, n_envs, seed, split)
    if rate is not None:
        base = _RateReward(base, float(rate))
    env = _sb3_env(base, hp, seed)
    model = _make_model(algo, env, hp, seed, str(run_dir / "tb") if tensorboard else None)
    callback = None if progress is None else _progress_callback(progress, timesteps)
    model.learn(total_timesteps=timesteps, tb_log_name=algo, progress_bar=False, callback=callback)
    model.save(run_dir / "model.zip")
    meta = {
        "algo": algo,
        "drafting": mode,
        "lookahead": lookahead,
        "reward": reward if rate is None else f"committed - {rate:.6g} * cost (rate-shaped, same optimum)",
        "timesteps": timesteps,
        "n_envs": n_envs,
        **({} if split == "train" else {"split": split}),
        "env": "specenv/MoESpecSeq-v0" if mode == "sequential" else "specenv/MoESpec-v1 (native vector env)",
        "hyperparameters": hp | {"seed": seed, "total_timesteps": timesteps, "n_envs": n_envs},
    }
    policy = _export(model, env, spec, run_dir, algo, meta)
    if log:
        log(f"{algo}: trained {timesteps} steps, exported to {run_dir / 'policy'}")
    env.close()
    return TrainResult(policy, run_dir, model, env)


def _make_env(
    mode: str,
    dataset: str,
    kmax: int | None,
    cost_model: str,
    lookahead: int,
    reward: str,
    n_envs: int,
    seed: int,
    split: str = "train",
) -> tuple[Any, Any, Any]:
    """(vector env or None, the policy's observation contract, the SB3 VecEnv) of a drafting mode."""
    if mode == "sequential":
        import gymnasium as gym
        from stable_baselines3.common.vec_env import DummyVecEnv

        from specenv.envs.sequential import SEQ_ID

        def make() -> Any:
            return gym.make(SEQ_ID, dataset=dataset, kmax=kmax, split=split, cost_model=cost_model, reward=reward)

        base = DummyVecEnv([make] * n_envs)
        return None, base.envs[0].unwrapped.obs_spec, base
    from specenv.envs.sb3 import SB3VecEnv
    from specenv.envs.vector import MoESpecVectorEnv

    venv = MoESpecVectorEnv(
        num_envs=n_envs,
        dataset=dataset,
        kmax=kmax,
        split=split,
        cost_model=cost_model,
        lookahead=lookahead,
        reward=reward,
        drafting=mode,
    )
    return venv, venv.data.spec, SB3VecEnv(venv)


def _rate_wrapper_base() -> Any:
    from stable_baselines3.common.vec_env import VecEnvWrapper

    return VecEnvWrapper


class _RateReward(_rate_wrapper_base()):  # type: ignore[misc]
    """SB3 VecEnv wrapper: ``reward = committed + rate * r_cost`` over an env with ``reward="cost"``."""

    def __init__(self, venv: Any, rate: float):
        super().__init__(venv)
        self.rate = rate

    def reset(self) -> Any:
        return self.venv.reset()

    def step_wait(self) -> Any:
        obs, reward, dones, infos = self.venv.step_wait()
        committed = np.array([float(i.get("committed", 0.0)) for i in infos], dtype=np.float32)
        return obs, committed + self.rate * reward, dones, infos


def best_fixed_rate(dataset: str, kmax: int | None, cost_model: str, split: str = "train") -> float:
    """The best fixed k's exact pooled speedup on the train split (the default rate of the shaping)."""
    from oracle.dp import evaluate_policy
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    ts = load_dataset(dataset)
    arr = select_positions(ts, kmax, split)
    model = cost_model_for(ts, cost_model)
    return max(evaluate_policy(arr, model, k).speedup_pooled for k in range(arr.kmax + 1))


def _progress_callback(progress: Callable[[int, int], None], total: int) -> Any:
    """An SB3 callback reporting ``progress(steps_done, total)`` after every step."""
    from stable_baselines3.common.callbacks import BaseCallback

    class _Report(BaseCallback):
        def _on_step(self) -> bool:
            progress(min(self.num_timesteps, total), total)
            return True

    return _Report()


def _sb3_env(base: Any, hp: dict[str, Any], seed: int) -> Any:
    """The SB3 view: episode statistics, observation standardisation and reward scaling."""
    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize

    env = VecMonitor(base)
    # returns are O(N) (hundreds of AR units): scale rewards for the value function; observations are
    # standardised without clipping, and the statistics are folded into the exported first layer
    env = VecNormalize(
        env, norm_obs=hp["norm_obs"], norm_reward=hp["norm_reward"], gamma=hp["gamma"], clip_obs=1e12, clip_reward=1e12
    )
    env.seed(seed)
    return env


def _make_model(algo: str, env: Any, hp: dict[str, Any], seed: int, tensorboard_log: str | None) -> Any:
    """PPO or DQN with the recipe ``hp`` (:func:`hyperparameters`), CPU."""
    import torch
    from stable_baselines3 import DQN, PPO

    skip = {"net_arch", "activation", "norm_obs", "norm_reward", "clip_obs"}
    kw = {k: v for k, v in hp.items() if k not in skip}
    act = torch.nn.Tanh if hp["activation"] == "tanh" else torch.nn.ReLU
    common = {
        "policy_kwargs": {"net_arch": list(hp["net_arch"]), "activation_fn": act},
        "seed": seed,
        "tensorboard_log": tensorboard_log,
        "verbose": 0,
        "device": "cpu",
    }
    cls = PPO if algo == "ppo" else DQN
    return cls("MlpPolicy", env, **kw, **common)


def _export(model: Any, env: Any, spec: Any, run_dir: Path, algo: str, meta: dict[str, Any]) -> MLPPolicy:
    """Export the trained network to the numpy policy format (``run_dir/policy``) and write ``train.json``."""
    from policies.learn.export import from_sb3

    mean = var = None
    if getattr(env, "norm_obs", False):
        mean, var = env.obs_rms.mean, env.obs_rms.var + env.epsilon
    name = f"{algo}-seq" if spec.per_token else algo
    policy = from_sb3(model, spec, name=name, meta=meta, obs_mean=mean, obs_var=var)
    policy.save(run_dir / "policy")
    (run_dir / "train.json").write_text(json.dumps(policy.meta, indent=2) + "\n")
    return policy
