"""Steps per second of the replay environment against Gymnasium's CartPole, in one run.

Prints four throughputs and two ratios:

* single env: ``gymnasium.make("specenv/MoESpec-v1")`` vs ``gymnasium.make("CartPole-v1")``
  (both with gymnasium's default wrappers), measured with
  :func:`gymnasium.utils.performance.benchmark_step` (random actions, resets included);
  aim: ratio >= 2.0 (the action sampling and the wrappers, about a quarter of CartPole's step, are
  the same on both sides);
* vector env: ``MoESpecVectorEnv(num_envs=N)`` vs ``CartPoleVectorEnv(num_envs=N)`` (N = 256 by
  default), measured with :func:`gymnasium.utils.performance.benchmark_vector_step`
  (sub-environment steps per second); aim: ratio >= 1.0.

Each pair is measured in alternation, ``--repeats`` times, and the best of each is kept, so that a
busy machine penalises both sides alike.

Usage::

    python scripts/bench_env_speed.py [--seconds 2] [--repeats 3] [--num-envs 256] [--dataset paper-default]
"""

from __future__ import annotations

import argparse
import json

import gymnasium as gym
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv
from gymnasium.utils.performance import benchmark_step, benchmark_vector_step

import specenv  # noqa: F401  (registers specenv/MoESpec-v1)
from specenv.envs.vector import MoESpecVectorEnv

SINGLE_AIM = 2.0
VECTOR_AIM = 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="duration of each measurement")
    ap.add_argument("--repeats", type=int, default=3, help="alternating measurements per env (best kept)")
    ap.add_argument("--num-envs", type=int, default=256)
    ap.add_argument("--dataset", default="paper-default")
    ap.add_argument("--cost-model", default="fit")
    ap.add_argument("--lookahead", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args()
    kw = {"dataset": args.dataset, "cost_model": args.cost_model, "lookahead": args.lookahead}

    ours = gym.make("specenv/MoESpec-v1", **kw)
    cart = gym.make("CartPole-v1")
    vours = MoESpecVectorEnv(num_envs=args.num_envs, **kw)
    vcart = CartPoleVectorEnv(num_envs=args.num_envs)

    best = {"single": 0.0, "cartpole": 0.0, "vector": 0.0, "cartpole_vector": 0.0}
    for r in range(args.repeats):
        best["single"] = max(best["single"], benchmark_step(ours, args.seconds, seed=r))
        best["cartpole"] = max(best["cartpole"], benchmark_step(cart, args.seconds, seed=r))
        best["vector"] = max(best["vector"], benchmark_vector_step(vours, args.seconds, seed=r))
        best["cartpole_vector"] = max(best["cartpole_vector"], benchmark_vector_step(vcart, args.seconds, seed=r))
    res = {
        **{f"{k}_steps_per_s": round(v) for k, v in best.items()},
        "single_ratio": best["single"] / best["cartpole"],
        "vector_ratio": best["vector"] / best["cartpole_vector"],
        "num_envs": args.num_envs,
        "single_target": SINGLE_AIM,
        "vector_target": VECTOR_AIM,
    }
    if args.json:
        print(json.dumps(res))
        return
    print(f"single  specenv/MoESpec-v1   {best['single']:>12,.0f} steps/s")
    print(f"single  CartPole-v1          {best['cartpole']:>12,.0f} steps/s")
    print(f"        ratio                {res['single_ratio']:>12.2f}x   (aim >= {SINGLE_AIM}x)")
    print(f"vector  MoESpecVectorEnv     {best['vector']:>12,.0f} steps/s  (N={args.num_envs})")
    print(f"vector  CartPoleVectorEnv    {best['cartpole_vector']:>12,.0f} steps/s  (N={args.num_envs})")
    print(f"        ratio                {res['vector_ratio']:>12.2f}x   (aim >= {VECTOR_AIM}x)")


if __name__ == "__main__":
    main()
