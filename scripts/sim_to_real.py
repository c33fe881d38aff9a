"""Sim-to-real: speedup predicted by the replay environment vs measured on the live CPU engine.

For each policy (plain AR, the best fixed k on the train split, the delta-space rule with the oracle's
lambda and with adaptive lambda) and the held-out generations of ``live-cpu``:

* **replay**: ``specenv/MoESpec-v0`` on ``live-cpu`` (fitted cost model): predicted speedup =
  sum of model AR cost / sum of model episode cost;
* **live**: ``specenv/MoESpecLive-v0`` (real rounds on the engine, measured thread CPU time):
  measured speedup = measured time of the plain AR run / measured time of the policy's run, on the
  same prompts.

Usage: ``python scripts/sim_to_real.py [--split test] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json

import gymnasium as gym

import specenv  # noqa: F401
from policies.bench.context import build_context
from policies.bench.single import default_entries
from specenv.progress import Progress


def run(env: gym.Env, policy, gids, on_generation=None) -> tuple[float, float, float]:
    cost = ar = rounds = 0.0
    for g in gids:
        obs, _ = env.reset(seed=0, options={"generation_id": int(g)})
        policy.reset()
        done = False
        while not done:
            obs, _, done, _, info = env.step(policy.act(obs))
            cost += info["cost_ms"]
            rounds += 1
        ar += info["ar_cost_ms"]
        if on_generation:
            on_generation()
    return cost, ar, rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", default="test")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    # minutes of work (the live runs are real rounds on the CPU engine): a bar in a terminal, else a line every 5 s
    with Progress("sim_to_real", unit="live generations") as prog:
        prog.update(what="setting up: cost model, live engine")
        ctx = build_context("live-cpu", None, "fit", None)
        wanted = ("autoregressive", "best fixed", "delta-space (oracle", "delta-space (adaptive")
        entries = [e for e in default_entries(ctx) if e.name.startswith(wanted)]
        replay = gym.make("specenv/MoESpec-v0", dataset="live-cpu", split=a.split)
        live = gym.make(
            "specenv/MoESpecLive-v0", dataset="live-cpu", split=a.split, cost_source="measured", clock="cpu"
        )
        gids = replay.unwrapped.data.generation_ids
        prog.update(total=len(entries) * len(gids))
        rows = []
        for e in entries:
            prog.update(what=e.name)
            pol = e.make(replay.unwrapped.data.spec)
            r_cost, r_ar, _ = run(replay, pol, gids)
            l_cost, _, _ = run(live, pol, gids, on_generation=prog.advance)
            rows.append({"policy": e.name, "replay_cost_ms": r_cost, "replay_ar_ms": r_ar, "live_cost_ms": l_cost})
    live_ar = rows[0]["live_cost_ms"]
    print(f"live-cpu, {a.split} split, {len(gids)} generations (live: measured thread CPU time)")
    print("| policy | replay speedup | live speedup | live / replay |")
    print("|---|---|---|---|")
    for r in rows:
        r["replay_speedup"] = r["replay_ar_ms"] / r["replay_cost_ms"]
        r["live_speedup"] = live_ar / r["live_cost_ms"]
        print(
            f"| {r['policy']} | {r['replay_speedup']:.3f} | {r['live_speedup']:.3f} | "
            f"{r['live_speedup'] / r['replay_speedup']:.3f} |"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
