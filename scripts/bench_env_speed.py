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
    python scripts/bench_env_speed.py --profile     # + where the single env's step time goes

``--profile`` adds a subtractive breakdown of one step of the single env, in microseconds (each stage
timed as a loop over the same pre-drawn actions, best of ``--repeats``; a stage's cost is the
difference to the stage above it): gymnasium's wrappers, the action check, the episode's round
(``Episode.play``: tables, acceptance, cost), the observation's update (running statistics), the info
dict, the observation vector -- beside CartPole-v1's step with and without its wrappers.
"""

from __future__ import annotations

import argparse
import json
import time

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
    ap.add_argument("--profile", action="store_true", help="also print where the single env's step time goes")
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
    if args.profile:
        res["profile_us"] = profile_single(kw, args.seconds / 2, args.repeats)
    if args.json:
        print(json.dumps(res))
        return
    print(f"single  specenv/MoESpec-v1   {best['single']:>12,.0f} steps/s")
    print(f"single  CartPole-v1          {best['cartpole']:>12,.0f} steps/s")
    print(f"        ratio                {res['single_ratio']:>12.2f}x   (aim >= {SINGLE_AIM}x)")
    print(f"vector  MoESpecVectorEnv     {best['vector']:>12,.0f} steps/s  (N={args.num_envs})")
    print(f"vector  CartPoleVectorEnv    {best['cartpole_vector']:>12,.0f} steps/s  (N={args.num_envs})")
    print(f"        ratio                {res['vector_ratio']:>12.2f}x   (aim >= {VECTOR_AIM}x)")
    if args.profile:
        prof = res["profile_us"]
        print("\nwhere a single step goes (us per step; a stage = its loop minus the loop above it)")
        for name, us in prof["stages"].items():
            print(f"  {name:<48} {us:>7.2f}")
        print(f"  {'= specenv/MoESpec-v1 step (gym.make)':<48} {prof['total']:>7.2f}")
        print(f"  {'CartPole-v1 step (gym.make)':<48} {prof['cartpole']:>7.2f}")
        print(f"  {'CartPole-v1 step (unwrapped)':<48} {prof['cartpole_unwrapped']:>7.2f}")
        print(f"  {'benchmark_step own cost (sample + clock)':<48} {prof['harness']:>7.2f}  (added to both sides)")
        print(
            f"  {'aim: specenv step <= CartPole step / ' + str(SINGLE_AIM):<48} {prof['cartpole'] / SINGLE_AIM:>7.2f}"
        )


def _loop_us(step, reset, actions, seconds: float, repeats: int) -> float:
    """Best-of-``repeats`` microseconds per call of ``step(a)`` over ``actions`` (``reset()`` when it returns True)."""

    best = float("inf")
    n_act = len(actions)
    for _ in range(repeats):
        reset()
        n, i, t0 = 0, 0, time.perf_counter()
        deadline = t0 + seconds
        while True:
            for _ in range(1000):
                if step(actions[i]):
                    reset()
                i = (i + 1) % n_act
            n += 1000
            t = time.perf_counter()
            if t >= deadline:
                break
        best = min(best, (t - t0) / n * 1e6)
    return best


def profile_single(kw: dict, seconds: float, repeats: int) -> dict:
    """The subtractive per-stage breakdown of the single env's step (module docstring), in microseconds."""
    import numpy as np

    rng = np.random.default_rng(0)
    env = gym.make("specenv/MoESpec-v1", **kw)
    raw = env.unwrapped
    actions = [int(a) for a in rng.integers(0, raw.action_space.n, size=4096)]
    cart = gym.make("CartPole-v1")
    cart_actions = [int(a) for a in rng.integers(0, 2, size=4096)]

    def reset_env() -> None:
        env.reset(seed=0)

    def wrapped(a: int) -> bool:
        _, _, term, trunc, _ = env.step(a)
        return term or trunc

    def unwrapped(a: int) -> bool:
        return raw.step(a)[2]

    def play(a: int) -> bool:
        return raw._play(a)[2]

    def stages(upto: int):
        def f(a: int) -> bool:  # Episode.play, then (upto >= 2) obs.update, (upto >= 3) info
            ep = raw._episode
            r = ep.play(a)
            if upto >= 2:
                raw._obs.update(a, r[2], r[6], r[8], r[3])
            if upto >= 3:
                ep.info(r)
            if r[9]:
                return True
            return False

        return f

    cart.reset(seed=0)
    craw = cart.unwrapped

    def cart_wrapped(a: int) -> bool:
        _, _, term, trunc, _ = cart.step(a)
        return term or trunc

    def cart_raw(a: int) -> bool:
        return craw.step(a)[2]

    space = env.action_space

    def harness(a: int) -> bool:  # what benchmark_step adds to every step of both envs: a sample and the clock
        space.sample()
        time.time()
        return False

    loops = {  # name: (step, reset, actions)
        "wrapped": (wrapped, reset_env, actions),
        "unwrapped": (unwrapped, reset_env, actions),
        "play": (play, reset_env, actions),
        "round": (stages(1), reset_env, actions),
        "update": (stages(2), reset_env, actions),
        "info": (stages(3), reset_env, actions),
        "cart": (cart_wrapped, lambda: cart.reset(seed=0), cart_actions),
        "cart_raw": (cart_raw, lambda: craw.reset(seed=0), cart_actions),
        "harness": (harness, lambda: None, actions),
    }
    t = dict.fromkeys(loops, float("inf"))
    for _ in range(max(repeats, 5)):  # round robin: a slow spell of the machine hits every loop alike
        for name, (step, reset, acts) in loops.items():
            t[name] = min(t[name], _loop_us(step, reset, acts, seconds / 5, 1))
    c_w, c_u = t["cart"], t["cart_raw"]
    st = {
        "gymnasium wrappers (order, env checker)": t["wrapped"] - t["unwrapped"],
        "action check": t["unwrapped"] - t["play"],
        "Episode.play (round: tables, acceptance, cost)": t["round"],
        "observation update (running statistics)": t["update"] - t["round"],
        "info dict": t["info"] - t["update"],
        "observation vector, render, reward (rest)": t["play"] - t["info"],
    }
    return {
        "stages": {k: round(v, 3) for k, v in st.items()},
        "total": t["wrapped"],
        "harness": t["harness"],
        "cartpole": c_w,
        "cartpole_unwrapped": c_u,
    }


if __name__ == "__main__":
    main()
