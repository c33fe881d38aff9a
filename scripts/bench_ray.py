"""Overhead of ``specenv bench --ray`` against the local path, and the paper-scale sweep plan.

Usage (from the repository root; needs the ray extra):

    python scripts/bench_ray.py [--cpus 2] [--repeats 2] [--json out.json]

1. **Overhead** (same run, interleaved repeats, medians): the wall time of ``specenv bench paper-default``
   with ``--ray --ray-cpus N`` (a local cluster started and stopped by the command) over the local
   command, both as fresh processes; and, in one process with the cluster already up, ``run_benchmark``
   with the Ray executor over ``run_benchmark`` here. Outputs are checked equal.
2. **Per-unit costs** on this machine (one process, warm caches): the CPU seconds of one Monte-Carlo
   (generation, episode) of every bench row at Kmax = the set's, of one exact fixed-k evaluation per
   generation, and of one oracle solve per (generation, Kmax) for Kmax = 1..10.
3. **Ray Data**: reading the set's Parquet files with pyarrow against ``ray.data.read_parquet``.
4. **Sweep plan**: 641 generations x 10 Kmax x every bench row x 5 seeds (x the bench's 4 episodes per
   generation), from those costs: CPU-hours and the wall time on N = 8, 64, 512 workers, taken as
   max(CPU time / (N x efficiency), the longest unit), with the efficiency measured in step 1. Training
   the learned rows again at every Kmax and seed is a separate line, from the train times the shipped
   policies recorded (policy.json ``train_seconds``).

The per-generation costs of paper-default stand for the paper's 641 generations (the set is generated
to the paper's profile); the Monte-Carlo cost at every Kmax is taken at the set's largest Kmax (10), an
upper bound. Every figure is measured on a shared 2-core machine: ratios within one run hold, absolute
seconds are "measured under load".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PAPER_GENERATIONS, KMAXES, SEEDS, EPISODES = 641, range(1, 11), 5, 4
WORKERS = (8, 64, 512)


def _cli(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "specenv.cli", *args], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0


def overhead(cpus: int, repeats: int) -> dict:
    """Wall-time ratios of the Ray path over the local path (fresh processes, then a warm cluster)."""
    local, on_ray = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):  # interleaved: the machine's load hits both alike
            local.append(_cli(["bench", "paper-default", "--quiet", "--out", f"{tmp}/local{r}"]))
            on_ray.append(
                _cli(["bench", "paper-default", "--quiet", "--out", f"{tmp}/ray{r}", "--ray", "--ray-cpus", str(cpus)])
            )
        same = all(
            (Path(tmp) / "local0" / f).read_bytes() == (Path(tmp) / f"ray{r}" / f).read_bytes()
            for r in range(repeats)
            for f in ("bench.json", "summary.csv", "episodes.csv")
        )
    import ray

    from policies.bench.single import run_benchmark
    from policies.distributed import bench_executor, ray_cluster

    warm_local, warm_ray = [], []
    with ray_cluster("local", cpus):
        run_benchmark("paper-default", executor=bench_executor())  # workers start, contexts are built
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_benchmark("paper-default")
            warm_local.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run_benchmark("paper-default", executor=bench_executor())
            warm_ray.append(time.perf_counter() - t0)
        assert ray.is_initialized()
    med = statistics.median
    return {
        "cpus": cpus,
        "repeats": repeats,
        "outputs_equal": same,
        "cli_local_s": med(local),
        "cli_ray_s": med(on_ray),
        "cli_ratio_ray_over_local": med(on_ray) / med(local),
        "warm_local_s": med(warm_local),
        "warm_ray_s": med(warm_ray),
        "warm_ratio_ray_over_local": med(warm_ray) / med(warm_local),
        # the share of the ideal N-fold speedup the warm cluster reaches (1.0 = perfect)
        "efficiency": min(1.0, med(warm_local) / (cpus * med(warm_ray))),
    }


def ray_data_read(cpus: int, repeats: int) -> dict:
    """Reading paper-default's Parquet files with pyarrow against Ray Data (``read_parquet`` to Arrow), medians."""
    import pyarrow.parquet as pq

    from policies.distributed import ray_cluster
    from specenv.traces.datasets import resolve

    files = sorted(str(f) for f in resolve("paper-default").glob("*.parquet"))
    arrow, data = [], []
    with ray_cluster("local", cpus) as ray:
        import ray.data

        for _ in range(repeats + 1):  # the first Ray Data read starts its executor: dropped
            t0 = time.perf_counter()
            for f in files:
                pq.read_table(f)
            arrow.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ray.get([ref for f in files for ref in ray.data.read_parquet(f).to_arrow_refs()])
            data.append(time.perf_counter() - t0)
    med = statistics.median
    return {"pyarrow_s": med(arrow[1:]), "ray_data_s": med(data[1:]), "ratio": med(data[1:]) / med(arrow[1:])}


def unit_costs() -> dict:
    """CPU seconds per unit on this machine (one process; every row and solve warmed up first)."""
    from oracle.dp import solve
    from policies.bench.single import BenchSetup, exact_generations, run_policy, setup_entries
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    ctx, entries = setup_entries(BenchSetup("paper-default", None, "fit-train", None, None, None))
    gids = np.asarray(ctx.test.generation_ids, dtype=np.int64)
    mc, exact = {}, {}
    for e in entries:
        if e.exact_k is not None:
            exact_generations(e, ctx)
            t0 = time.process_time()
            exact_generations(e, ctx)
            exact[e.name] = (time.process_time() - t0) / len(gids)
            continue
        run_policy(e, ctx, 1, 0, gids[:2])  # builds the replay tables of the row's mode
        t0 = time.process_time()
        run_policy(e, ctx, EPISODES, 0)
        mc[e.name] = (time.process_time() - t0) / (len(gids) * EPISODES)
    ts = load_dataset("paper-default")
    arrays = select_positions(ts, None, "all")
    model = cost_model_for(ts, "fit-train")
    solve_s = {}
    for km in KMAXES:
        sub = arrays.with_kmax(km)
        solve(sub, model)
        t0 = time.process_time()
        solve(sub, model)
        solve_s[km] = (time.process_time() - t0) / arrays.n_generations
    shipped = ROOT / "policies" / "shipped" / "paper-default-v2"
    train = {
        p.parent.name: float(json.loads(p.read_text())["meta"]["train_seconds"])
        for p in sorted(shipped.glob("*/policy.json"))
    }
    return {"mc_per_gen_episode_s": mc, "exact_per_gen_s": exact, "oracle_per_gen_s": solve_s, "train_s": train}


def plan(costs: dict, efficiency: float, startup_s: float) -> dict:
    """CPU-hours and wall time of the paper-scale sweep on N workers (plus the measured startup)."""
    mc = sum(costs["mc_per_gen_episode_s"].values())
    ex = sum(costs["exact_per_gen_s"].values())
    per_kmax_seed = PAPER_GENERATIONS * EPISODES * mc  # every Monte-Carlo row, one seed
    eval_s = len(KMAXES) * (SEEDS * per_kmax_seed + PAPER_GENERATIONS * ex)  # exact rows need no seeds
    oracle_s = PAPER_GENERATIONS * sum(costs["oracle_per_gen_s"][k] for k in KMAXES)
    train_s = len(KMAXES) * SEEDS * sum(costs["train_s"].values())
    # the longest unit: one Monte-Carlo row on one chunk of 641/64 generations (the chunking of 64+ workers)
    longest_eval = max(costs["mc_per_gen_episode_s"].values()) * EPISODES * math.ceil(PAPER_GENERATIONS / 64)
    longest_train = max(costs["train_s"].values())
    rows = []
    for n in WORKERS:
        rows.append(
            {
                "workers": n,
                "eval_wall_h": (startup_s + max((eval_s + oracle_s) / (n * efficiency), longest_eval)) / 3600,
                "with_training_wall_h": (
                    startup_s + max((eval_s + oracle_s + train_s) / (n * efficiency), longest_train)
                )
                / 3600,
            }
        )
    return {
        "rows_monte_carlo": len(costs["mc_per_gen_episode_s"]),
        "rows_exact": len(costs["exact_per_gen_s"]),
        "eval_cpu_h": eval_s / 3600,
        "oracle_cpu_h": oracle_s / 3600,
        "training_cpu_h": train_s / 3600,
        "efficiency": efficiency,
        "startup_s": startup_s,
        "wall": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    ov = overhead(args.cpus, args.repeats)
    print(
        f"bench paper-default, {args.cpus} CPUs, median of {args.repeats} interleaved runs (measured under load): "
        f"CLI local {ov['cli_local_s']:.1f} s, --ray {ov['cli_ray_s']:.1f} s (cluster start included): ratio "
        f"{ov['cli_ratio_ray_over_local']:.2f}; warm cluster: local {ov['warm_local_s']:.1f} s, Ray "
        f"{ov['warm_ray_s']:.1f} s: ratio {ov['warm_ratio_ray_over_local']:.2f} (efficiency {ov['efficiency']:.2f}); "
        f"outputs equal: {ov['outputs_equal']}"
    )
    rd = ray_data_read(args.cpus, args.repeats)
    print(
        f"reading paper-default's Parquet files: pyarrow {rd['pyarrow_s']:.2f} s, Ray Data {rd['ray_data_s']:.2f} s "
        f"(ratio {rd['ratio']:.1f}): Ray Data is not used"
    )
    costs = unit_costs()
    # cluster start, worker processes and their contexts: what the CLI's Ray run spent beyond the warm one
    pl = plan(costs, ov["efficiency"], max(0.0, ov["cli_ray_s"] - ov["warm_ray_s"]))
    print(
        f"\nper unit (CPU s, this machine): Monte Carlo per (generation, episode), all {pl['rows_monte_carlo']} rows: "
        f"{sum(costs['mc_per_gen_episode_s'].values()):.4f}; exact rows per generation, all {pl['rows_exact']}: "
        f"{sum(costs['exact_per_gen_s'].values()):.5f}; oracle per (generation, Kmax=10): "
        f"{costs['oracle_per_gen_s'][10]:.5f}; training (recorded), all shipped learners: "
        f"{sum(costs['train_s'].values()):.0f}"
    )
    print(
        f"\nsweep: {PAPER_GENERATIONS} generations x {len(KMAXES)} Kmax x {pl['rows_monte_carlo'] + pl['rows_exact']} "
        f"rows x {SEEDS} seeds x {EPISODES} episodes: evaluation {pl['eval_cpu_h']:.2f} CPU-h, oracle "
        f"{pl['oracle_cpu_h'] * 3600:.1f} CPU-s; retraining the learners per Kmax and seed "
        f"{pl['training_cpu_h']:.1f} CPU-h"
    )
    print(
        f"\nwall = startup ({pl['startup_s']:.0f} s measured) + max(CPU time / (N x efficiency "
        f"{pl['efficiency']:.2f}), the longest unit)"
    )
    print("\n| workers N | evaluation + oracle, wall | with retraining, wall |\n|---|---|---|")
    for r in pl["wall"]:
        print(f"| {r['workers']} | {r['eval_wall_h'] * 60:.1f} min | {r['with_training_wall_h'] * 60:.1f} min |")
    if args.json:
        args.json.write_text(json.dumps({"overhead": ov, "ray_data": rd, "costs": costs, "plan": pl}, indent=2) + "\n")


if __name__ == "__main__":
    main()
