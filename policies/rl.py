"""Stable-Baselines3 learners (PPO, DQN) on the native vector environment through the SB3 adapter.

Training runs on the train split; the result is exported to the numpy form of
:mod:`policies.mlp` (what the benchmark and vLLM load). The SB3 model itself (``model.zip``) and
TensorBoard logs are written to the run folder for inspection; they are not the deployment format.

Discounting: the task is a stochastic shortest path (minimise total cost), so ``gamma`` is close to
1 (0.999): with a small gamma the agent would undervalue the future rounds that committing more
tokens saves, and drift towards myopically cheap rounds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.mlp import MLPPolicy

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
    log: Callable[[str], None] | None = None,
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
        log: Progress lines.

    Raises:
        ValueError: For an unknown algorithm or bad environment arguments.
    """
    if algo not in ALGOS:
        raise ValueError(f"algo={algo!r}: expected one of {', '.join(ALGOS)}")
    import torch
    from stable_baselines3 import DQN, PPO
    from stable_baselines3.common.vec_env import VecMonitor

    from policies.export import from_sb3
    from specenv.sb3 import SB3VecEnv
    from specenv.vector_env import MoESpecVectorEnv

    torch.set_num_threads(1)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    venv = MoESpecVectorEnv(num_envs=n_envs, dataset=dataset, kmax=kmax, split="train",
                            cost_model=cost_model, lookahead=lookahead)
    env = VecMonitor(SB3VecEnv(venv))
    env.seed(seed)
    tb = str(run_dir / "tb") if tensorboard else None
    if algo == "ppo":
        model = PPO("MlpPolicy", env, n_steps=256, batch_size=min(2048, 256 * n_envs), n_epochs=10, gamma=0.999, gae_lambda=0.95,
                    learning_rate=3e-4, ent_coef=0.003, policy_kwargs={"net_arch": [64, 64]}, seed=seed,
                    tensorboard_log=tb, verbose=0, device="cpu")
    else:
        model = DQN("MlpPolicy", env, learning_rate=5e-4, buffer_size=200_000, learning_starts=5_000,
                    batch_size=256, gamma=0.999, train_freq=4, gradient_steps=4, target_update_interval=2_000,
                    exploration_fraction=0.3, exploration_final_eps=0.02, policy_kwargs={"net_arch": [64, 64]},
                    seed=seed, tensorboard_log=tb, verbose=0, device="cpu")
    model.learn(total_timesteps=timesteps, tb_log_name=algo, progress_bar=False)
    model.save(run_dir / "model.zip")
    spec = venv.data.spec
    policy = from_sb3(model, spec, name=algo, meta={"algo": algo, "dataset": dataset, "seed": seed,
                                                    "timesteps": timesteps, "n_envs": n_envs,
                                                    "cost_model": cost_model, "lookahead": lookahead})
    policy.save(run_dir / "policy")
    (run_dir / "train.json").write_text(json.dumps(policy.meta, indent=2) + "\n")
    if log:
        log(f"{algo}: trained {timesteps} steps, exported to {run_dir / 'policy'}")
    env.close()
    return TrainResult(policy, run_dir, model)
