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

from specenv.policy.mlp import MLPPolicy

ALGOS = ("ppo", "dqn")


@dataclass
class TrainResult:
    """Outcome of :func:`train_sb3`."""

    policy: MLPPolicy
    run_dir: Path
    model: Any


def train_sb3(
    algo: str,
    dataset: str,
    run_dir: str | Path,
    timesteps: int = 300_000,
    seed: int = 0,
    n_envs: int = 32,
    kmax: int | None = None,
    cost_model: str = "fit",
    lookahead: int = 0,
    tensorboard: bool = True,
    reward: str = "savings",
    gamma: float = 0.99,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """Train PPO or DQN on the train split and export it.

    Args:
        algo: ``"ppo"`` or ``"dqn"``.
        dataset: Registry name or trace-set folder.
        run_dir: Folder for ``model.zip``, TensorBoard logs and the exported policy.
        timesteps: Environment steps.
        seed: Seed of SB3, torch and the environments.
        n_envs: Parallel streams of the native vector environment.
        kmax: Largest budget (default: the trace set's Kmax).
        cost_model: ``"fit"``, ``"profile"`` or a JSON path.
        lookahead: Draft confidences in the observation.
        tensorboard: Write TensorBoard logs under ``run_dir/tb``.
        reward: The environment's reward option used for training: ``"savings"`` (default; see
            the module docstring) or ``"cost"``. VecMonitor logs the return of this reward.
        gamma: Discount factor.
        log: Progress lines.
        progress: Called as ``progress(steps_done, timesteps)`` after every step of the vector env.

    Raises:
        ValueError: For an unknown algorithm or bad environment arguments.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo={algo!r}: expected one of {', '.join(ALGOS)}")
    import torch

    from specenv.envs.vector import MoESpecVectorEnv

    torch.set_num_threads(1)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    venv = MoESpecVectorEnv(
        num_envs=n_envs,
        dataset=dataset,
        kmax=kmax,
        split="train",
        cost_model=cost_model,
        lookahead=lookahead,
        reward=reward,
    )
    env = _sb3_env(venv, gamma, seed)
    model = _make_model(algo, env, n_envs, gamma, seed, str(run_dir / "tb") if tensorboard else None)
    callback = None if progress is None else _progress_callback(progress, timesteps)
    model.learn(total_timesteps=timesteps, tb_log_name=algo, progress_bar=False, callback=callback)
    model.save(run_dir / "model.zip")
    meta = {
        "algo": algo,
        "dataset": dataset,
        "seed": seed,
        "timesteps": timesteps,
        "n_envs": n_envs,
        "cost_model": cost_model,
        "lookahead": lookahead,
        "reward": reward,
        "gamma": gamma,
    }
    policy = _export(model, venv, run_dir, algo, meta)
    if log:
        log(f"{algo}: trained {timesteps} steps, exported to {run_dir / 'policy'}")
    env.close()
    return TrainResult(policy, run_dir, model)


def _progress_callback(progress: Callable[[int, int], None], total: int) -> Any:
    """An SB3 callback reporting ``progress(steps_done, total)`` after every step."""
    from stable_baselines3.common.callbacks import BaseCallback

    class _Report(BaseCallback):
        def _on_step(self) -> bool:
            progress(min(self.num_timesteps, total), total)
            return True

    return _Report()


def _sb3_env(venv: Any, gamma: float, seed: int) -> Any:
    """The SB3 view of the vector env: episode statistics and reward scaling for the value function."""
    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize

    from specenv.envs.sb3 import SB3VecEnv

    env = VecMonitor(SB3VecEnv(venv))
    # returns are O(N) (hundreds of AR units): scale rewards for the value function (observations are
    # already scaled by the observation contract and must stay raw for the exported policy)
    env = VecNormalize(env, norm_obs=False, norm_reward=True, gamma=gamma)
    env.seed(seed)
    return env


def _make_model(algo: str, env: Any, n_envs: int, gamma: float, seed: int, tensorboard_log: str | None) -> Any:
    """PPO or DQN with the hyperparameters used for the shipped policies (a 64x64 MLP, CPU)."""
    from stable_baselines3 import DQN, PPO

    common = {
        "gamma": gamma,
        "policy_kwargs": {"net_arch": [64, 64]},
        "seed": seed,
        "tensorboard_log": tensorboard_log,
        "verbose": 0,
        "device": "cpu",
    }
    if algo == "ppo":
        return PPO(
            "MlpPolicy",
            env,
            n_steps=256,
            batch_size=min(2048, 256 * n_envs),
            n_epochs=10,
            gae_lambda=0.95,
            learning_rate=3e-4,
            ent_coef=0.003,
            **common,
        )
    return DQN(
        "MlpPolicy",
        env,
        learning_rate=5e-4,
        buffer_size=200_000,
        learning_starts=5_000,
        batch_size=256,
        train_freq=4,
        gradient_steps=4,
        target_update_interval=2_000,
        exploration_fraction=0.3,
        exploration_final_eps=0.02,
        **common,
    )


def _export(model: Any, venv: Any, run_dir: Path, algo: str, meta: dict[str, Any]) -> MLPPolicy:
    """Export the trained network to the numpy policy format (``run_dir/policy``) and write ``train.json``."""
    from policies.export import from_sb3

    policy = from_sb3(model, venv.data.spec, name=algo, meta=meta)
    policy.save(run_dir / "policy")
    (run_dir / "train.json").write_text(json.dumps(policy.meta, indent=2) + "\n")
    return policy
