"""PPO's learning throughput on the replay environment against CartPole, in one run.

Stable-Baselines3 PPO with the same settings on both sides (the shipped recipe's PPO
hyper-parameters, :func:`policies.learn.rl.hyperparameters`: ``n_steps`` 64, ``batch_size`` 512,
10 epochs, a 64x64 tanh MLP, CPU), ``--n-envs`` environments (8 by default):

* ``specenv/MoESpec-v1``: the native vector environment behind SB3's ``VecEnv`` interface
  (:class:`specenv.envs.sb3.SB3VecEnv` over :class:`specenv.envs.vector.MoESpecVectorEnv`, as
  ``specenv train --algo ppo`` runs it) and, for comparison, SB3's ``DummyVecEnv`` over
  ``gymnasium.make("specenv/MoESpec-v1")`` copies;
* ``CartPole-v1``: SB3's ``DummyVecEnv`` over ``gymnasium.make("CartPole-v1")`` copies (what
  ``make_vec_env("CartPole-v1", n_envs=8)`` builds).

Each learner runs ``--timesteps`` environment steps (``model.learn``; collection and the gradient
updates both count) after a short warm-up; the three are measured in alternation, ``--repeats``
times, and the best throughput of each is kept. Prints the steps per second and the ratios to
CartPole (aim: within 10%, ratio >= 0.9).

Usage::

    python scripts/bench_learning.py [--timesteps 8192] [--repeats 2] [--n-envs 8] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv

import specenv  # noqa: F401  (registers specenv/MoESpec-v1)
from policies.learn.rl import hyperparameters
from specenv.envs.sb3 import SB3VecEnv
from specenv.envs.vector import MoESpecVectorEnv

AIM = 0.9


def ppo(env: Any, seed: int) -> PPO:
    """PPO with the recipe's hyper-parameters (the same for every environment)."""
    hp = hyperparameters("ppo", env.num_envs, gamma=0.99)
    skip = {"net_arch", "activation", "norm_obs", "norm_reward", "clip_obs"}
    kw = {k: v for k, v in hp.items() if k not in skip}
    policy_kwargs = {"net_arch": list(hp["net_arch"]), "activation_fn": torch.nn.Tanh}
    return PPO("MlpPolicy", env, **kw, policy_kwargs=policy_kwargs, seed=seed, device="cpu", verbose=0)


def steps_per_s(make_env: Callable[[], Any], timesteps: int, seed: int) -> float:
    """Environment steps per second of ``model.learn(timesteps)`` (after a warm-up rollout)."""
    model = ppo(make_env(), seed)
    model.learn(model.n_steps * model.n_envs)  # warm-up: one rollout and its update
    t0 = time.perf_counter()
    model.learn(timesteps, reset_num_timesteps=False)
    return timesteps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timesteps", type=int, default=8192, help="environment steps per measurement")
    ap.add_argument("--repeats", type=int, default=2, help="alternating measurements per learner (best kept)")
    ap.add_argument("--n-envs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the same for every learner)")
    ap.add_argument("--dataset", default="paper-default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.n_envs
    envs: dict[str, Callable[[], Any]] = {
        "specenv_native": lambda: SB3VecEnv(MoESpecVectorEnv(num_envs=n, dataset=args.dataset)),
        "specenv_dummy": lambda: DummyVecEnv([lambda: gym.make("specenv/MoESpec-v1", dataset=args.dataset)] * n),
        "cartpole": lambda: DummyVecEnv([lambda: gym.make("CartPole-v1")] * n),
    }
    best = dict.fromkeys(envs, 0.0)
    for r in range(args.repeats):
        for name, make in envs.items():
            best[name] = max(best[name], steps_per_s(make, args.timesteps, args.seed + r))
    res = {
        **{f"{k}_steps_per_s": round(v) for k, v in best.items()},
        "native_ratio": best["specenv_native"] / best["cartpole"],
        "dummy_ratio": best["specenv_dummy"] / best["cartpole"],
        "n_envs": n,
        "timesteps": args.timesteps,
        "threads": args.threads,
        "aim": AIM,
    }
    if args.json:
        print(json.dumps(res))
        return
    print(f"PPO, n_envs={n}, {args.timesteps} steps per measurement, torch threads {args.threads}")
    print(f"  specenv/MoESpec-v1  native VecEnv  {best['specenv_native']:>9,.0f} steps/s")
    print(f"  specenv/MoESpec-v1  DummyVecEnv    {best['specenv_dummy']:>9,.0f} steps/s")
    print(f"  CartPole-v1         DummyVecEnv    {best['cartpole']:>9,.0f} steps/s")
    print(f"  ratio native / CartPole   {res['native_ratio']:.2f}x   (aim >= {AIM}x)")
    print(f"  ratio dummy / CartPole    {res['dummy_ratio']:.2f}x")


if __name__ == "__main__":
    main()
