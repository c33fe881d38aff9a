"""Measure fixed-k speedups of the live CPU engine and compare them with the replay prediction.

For the first N prompts of the live prompt set (= generation ids of ``live-cpu``) and every budget
k = 0..Kmax this script reports:

* **measured live**: wall-clock time of whole generations (``time.perf_counter`` around the round
  loop, prefill excluded) with the real engine, and the thread CPU time of the same loop; runs of one
  prompt are interleaved over k (order rotated per prompt) so every k sees the same machine load;
  speedup = AR time / time at k;
* **rounds table**: the same ratio from the measured ``T_T + T_D`` of the ``live-cpu`` rounds table
  (recorded by ``specenv collect``; thread CPU time), on the same generations;
* **replay prediction**: the replay environment (``specenv/MoESpec-v0`` on ``live-cpu``, fitted cost
  model) run with fixed k on the same generations: predicted speedup = model AR cost / model cost.

Usage: ``python scripts/live_speedup.py [--prompts 16] [--repeats 1] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import time

import gymnasium as gym
import numpy as np

import specenv  # noqa: F401  (registers the environments)
from specenv.engines.hf import LiveEngine, load_models, load_prompts
from specenv.progress import Progress
from specenv.traces.datasets import load_dataset


def replay_speedups(gids: list[int], kmax: int) -> dict[int, float]:
    env = gym.make("specenv/MoESpec-v0", dataset="live-cpu", split="all")
    out = {}
    for k in range(kmax + 1):
        cost = ar = 0.0
        for g in gids:
            env.reset(seed=0, options={"generation_id": g})
            while True:
                _, _, term, _, info = env.step(k)
                if term:
                    break
            cost += info["episode_cost_ms"]
            ar += info["ar_cost_ms"]
        out[k] = ar / cost
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ts = load_dataset("live-cpu")
    kmax, max_new = ts.kmax, ts.manifest.max_new_tokens
    models = load_models()
    eng = LiveEngine(models, kmax=kmax, max_new_tokens=max_new, threads=a.threads)
    prompts = [p for p in load_prompts() if p.id in set(ts.positions["generation_id"].unique().tolist())][: a.prompts]
    gids = [p.id for p in prompts]
    load0 = os.getloadavg()
    wall = np.zeros(kmax + 1)
    cpu = np.zeros(kmax + 1)
    toks = np.zeros(kmax + 1)
    warm = models.encode(prompts[0].text)
    for k in range(kmax + 1):  # warm-up
        eng.start(warm)
        for _ in range(3):
            if not eng.done:
                eng.step(k)
    runs = a.repeats * len(prompts) * (kmax + 1)
    with Progress("live_speedup", total=runs, unit="generations (prompt x k)") as prog:
        for rep in range(a.repeats):
            for i, p in enumerate(prompts):
                ids = models.encode(p.text)
                order = np.roll(np.arange(kmax + 1), i + rep)
                for k in order:
                    eng.start(ids)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    while not eng.done:
                        eng.step(int(k))
                    wall[k] += time.perf_counter() - t0
                    cpu[k] += time.thread_time() - c0
                    toks[k] += len(eng.generated)
                    prog.advance()
    live = {k: float(wall[0] / wall[k]) for k in range(kmax + 1)}
    live_cpu = {k: float(cpu[0] / cpu[k]) for k in range(kmax + 1)}
    r = ts.rounds[ts.rounds["generation_id"].isin(gids)]
    tot = (r["T_T_ms"] + r["T_D_ms"]).groupby(r["K"]).sum()
    table = {int(k): float(tot[0] / tot[k]) for k in tot.index}
    pred = replay_speedups(gids, kmax)
    res = {
        "prompts": len(prompts),
        "repeats": a.repeats,
        "threads": a.threads,
        "max_new_tokens": max_new,
        "ar_tokens_per_s": float(toks[0] / wall[0]),
        "tokens_per_s": {k: float(toks[k] / wall[k]) for k in range(kmax + 1)},
        "speedup_live_measured": live,
        "speedup_live_cpu_time": live_cpu,
        "speedup_rounds_table": table,
        "speedup_replay_predicted": pred,
        "best_k_live": int(max(live, key=live.get)),
        "best_k_replay": int(max(pred, key=pred.get)),
        "loadavg_before": list(load0),
        "loadavg_after": list(os.getloadavg()),
    }
    print(f"{'k':>3} {'live wall':>10} {'live cpu':>9} {'rounds tbl':>10} {'replay':>8} {'tok/s':>7}")
    for k in range(kmax + 1):
        print(
            f"{k:>3} {live[k]:>10.3f} {live_cpu[k]:>9.3f} {table.get(k, float('nan')):>10.3f} {pred[k]:>8.3f} "
            f"{res['tokens_per_s'][k]:>7.1f}"
        )
    print(f"best k: live {res['best_k_live']}, replay {res['best_k_replay']}; load {load0} -> {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
