"""Time the exact oracle DP on a pool of the paper's size (641 generations, Kmax = 10).

The pool is generated once with ``generate_paper(641, 10, seed, with_rounds=False)`` (3-4 minutes)
and cached as a trace set under ``~/.cache/specenv/bench-pool-641-seed<seed>`` (override with
``--cache-dir``); later runs load it in about a second. The cost model is the paper profile (the
pool has no rounds table to fit on).

Usage::

    python scripts/bench_oracle.py [--seed 0] [--repeats 5] [--generations 641] [--json] [--fresh-compile]

Prints the best and median wall time (and the best CPU time of the process) of: the cost table +
layout, the backward sweep (the DP proper), the forward occupancy sweep, the whole ``oracle.solve``
with its tables cached (every solve after the first on a positions table and cost model:
:func:`oracle.dp.step_tables`) and building them (the first), plus exact policy evaluation of a
fixed k (tables cached). The target (< 0.1 s) is the cached solve's.

The sweeps are numba's compiled kernels (:mod:`oracle.kernels`) where numba is installed, else the
numpy forms (``SPECENV_NUMBA=0`` forces those); the report says which. The first solve of the process
is timed apart: it pays numba's import and the kernels' compilation, or their load from numba's
on-disk cache once compiled. ``--fresh-compile`` points numba at an empty cache folder, so that this
first solve compiles (what a fresh clone pays once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from oracle import dp
from oracle.dp import _backward, _forward, _Layout, _step_tables, evaluate_policy, solve
from specenv.cost.model import CostModel
from specenv.generator import generate_paper
from specenv.traces.traceset import TraceSet

TARGET_S = 0.1


def load_pool(n: int, kmax: int, seed: int, cache_dir: Path) -> TraceSet:
    path = cache_dir / f"bench-pool-{n}-seed{seed}" if kmax == 10 else cache_dir / f"bench-pool-{n}-k{kmax}-seed{seed}"
    if (path / "manifest.json").is_file():
        return TraceSet.load(path, verify_hashes=False)
    print(f"generating the pool ({n} generations, Kmax={kmax}, seed={seed}) into {path} ...", file=sys.stderr)
    t0 = time.perf_counter()
    ts = generate_paper(n, kmax, seed=seed, with_rounds=False, name=f"bench-pool-{n}")
    path.parent.mkdir(parents=True, exist_ok=True)
    ts.save(path, overwrite=True)
    print(f"generated in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return TraceSet.load(path, verify_hashes=False)


def timed(fn, repeats: int) -> tuple[float, float, object, float]:
    """Best and median wall time, the result, and the best CPU time of the process (robust to a loaded machine)."""
    times, cpu, out = [], [], None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return float(np.min(times)), float(np.median(times)), out, float(np.min(cpu))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generations", type=int, default=641)
    ap.add_argument("--kmax", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "specenv")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fresh-compile", action="store_true", help="numba compiles anew (an empty cache folder)")
    args = ap.parse_args()
    if args.fresh_compile:
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-oracle-numba-")

    ts = load_pool(args.generations, args.kmax, args.seed, args.cache_dir)
    arrays = ts.arrays()
    model = CostModel.paper_profile(arrays.kmax)
    t0 = time.perf_counter()
    solve(arrays, model)  # warm-up: numba's import and the kernels' compilation or cache load
    first_call = time.perf_counter() - t0
    sweeps = "numba" if dp._kernels() is not None else "numpy"

    def prepare() -> tuple[np.ndarray, np.ndarray, _Layout]:
        lay = _Layout.of(arrays)
        return (*_step_tables(arrays, model, 0, lay), lay)

    prep = timed(prepare, args.repeats)
    Ct, St, lay = prep[2]  # type: ignore[misc]
    back = timed(lambda: _backward(Ct, St, lay, None), args.repeats)
    _, kp = back[2]  # type: ignore[misc]
    fwd = timed(lambda: _forward(St, kp, lay), args.repeats)
    full = timed(lambda: solve(arrays, model), args.repeats)

    def cold() -> object:
        dp._TABLES.clear()
        return solve(arrays, model)

    first = timed(cold, args.repeats)
    ev = timed(lambda: evaluate_policy(arrays, model, 4), args.repeats)
    res = full[2]
    report = {
        "generations": arrays.n_generations,
        "positions": int(len(arrays.L)),
        "max_N": int(arrays.lengths.max()),
        "kmax": arrays.kmax,
        "repeats": args.repeats,
        "sweeps": sweeps,
        "first_solve_s": first_call,
        "fresh_compile": bool(args.fresh_compile),
        "prepare_s": {"min": prep[0], "median": prep[1], "cpu_min": prep[3]},
        "dp_backward_s": {"min": back[0], "median": back[1], "cpu_min": back[3]},
        "occupancy_forward_s": {"min": fwd[0], "median": fwd[1], "cpu_min": fwd[3]},
        "solve_total_s": {"min": full[0], "median": full[1], "cpu_min": full[3]},
        "solve_building_tables_s": {"min": first[0], "median": first[1], "cpu_min": first[3]},
        "evaluate_fixed_k4_s": {"min": ev[0], "median": ev[1], "cpu_min": ev[3]},
        "s_max_pooled": res.speedup_pooled,  # type: ignore[attr-defined]
        "target_s": TARGET_S,
        "dp_within_target": back[0] < TARGET_S,
        "solve_within_target": full[0] < TARGET_S,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"pool: {report['generations']} generations, {report['positions']} positions, max N "
        f"{report['max_N']}, Kmax {report['kmax']} (best / median of {args.repeats}; sweeps: {sweeps})"
    )
    what = "compiling" if args.fresh_compile else "compiled or loaded from numba's cache"
    extra = f" (numba imported, kernels {what})" if sweeps == "numba" else ""
    print(f"  first solve of the process{extra}: {first_call:.3f} s")
    for key, label in (
        ("prepare_s", "cost/survival tables + layout"),
        ("dp_backward_s", "DP backward sweep"),
        ("occupancy_forward_s", "occupancy forward sweep"),
        ("solve_total_s", "oracle.solve (tables cached)"),
        ("solve_building_tables_s", "oracle.solve (building tables)"),
        ("evaluate_fixed_k4_s", "evaluate_policy(k=4) (cached)"),
    ):
        r = report[key]
        print(f"  {label:32s} {r['min']:.3f} s / {r['median']:.3f} s   (CPU best {r['cpu_min']:.3f} s)")
    print(f"  S_max (pooled, paper profile)    {report['s_max_pooled']:.4f}")
    print(
        f"target < {TARGET_S} s: DP {'met' if report['dp_within_target'] else 'MISSED'}, "
        f"whole solve (tables cached) {'met' if report['solve_within_target'] else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
