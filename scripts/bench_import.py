"""Import cost of specenv: ``import specenv, gymnasium; gymnasium.make(...)`` against ``import gymnasium``.

Runs both commands in fresh interpreters, interleaved (A, B, A, B, ...) so that machine noise hits
both alike, after one warm-up of each (the fitted cost model is then in the disk cache, as for a user
who has made the environment before). Prints the median and minimum wall time of each, the difference
of the medians (the target: at most 0.5 s) and their ratio. ``--importtime`` adds the slowest imports
of the specenv command (``python -X importtime``, cumulative microseconds).

Usage::

    python scripts/bench_import.py [--repeats 15] [--importtime 15] [--json] [--root OTHER_CHECKOUT]

``--root`` measures another source tree (for example an older checkout) with this script.

Run it from the repository root (or with specenv installed). Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "import gymnasium"
SPECENV = "import specenv, gymnasium; gymnasium.make('specenv/MoESpec-v0')"
BUDGET_S = 0.5


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env["SPECENV_BENCH_ROOT"] = str(root)
    return env


def _run(code: str, env: dict[str, str]) -> float:
    """Wall time in seconds of a fresh interpreter running ``code`` (in the measured tree: ``-c`` puts it first)."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=env["SPECENV_BENCH_ROOT"], check=True, stdout=subprocess.DEVNULL
    )
    return time.perf_counter() - t0


def importtime(code: str, env: dict[str, str], top: int) -> list[tuple[int, str]]:
    """The ``top`` imports with the largest cumulative time (microseconds, module) when running ``code``."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        env=env,
        cwd=env["SPECENV_BENCH_ROOT"],
        check=True,
        capture_output=True,
        text=True,
    )
    rows = []
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = (part.strip() for part in line[len("import time:") :].split("|"))
        rows.append((int(cumulative), name))
    return sorted(rows, reverse=True)[:top]


def measure(repeats: int, env: dict[str, str]) -> dict[str, list[float]]:
    """Interleaved wall times of the baseline and the specenv command (after one warm-up of each)."""
    _run(BASELINE, env)
    _run(SPECENV, env)  # warms the disk cache of the fitted cost model and the OS file cache
    times: dict[str, list[float]] = {"baseline": [], "specenv": []}
    for _ in range(repeats):
        times["baseline"].append(_run(BASELINE, env))
        times["specenv"].append(_run(SPECENV, env))
    return times


def main(argv: list[str] | None = None) -> int:
    """Measure and print; exit status 1 with ``--check`` when the median difference exceeds the budget."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15, help="runs of each command (interleaved)")
    ap.add_argument("--importtime", type=int, default=0, metavar="N", help="also list the N slowest imports")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--root", type=Path, default=ROOT, help="source tree to measure (default: this repository)")
    ap.add_argument("--check", action="store_true", help=f"exit 1 if the median difference exceeds {BUDGET_S} s")
    args = ap.parse_args(argv)
    env = _env(args.root.resolve())
    times = measure(args.repeats, env)
    base, spec = statistics.median(times["baseline"]), statistics.median(times["specenv"])
    result = {
        "repeats": args.repeats,
        "baseline_cmd": BASELINE,
        "specenv_cmd": SPECENV,
        "baseline_median_s": base,
        "baseline_min_s": min(times["baseline"]),
        "specenv_median_s": spec,
        "specenv_min_s": min(times["specenv"]),
        "difference_median_s": spec - base,
        "difference_min_s": min(times["specenv"]) - min(times["baseline"]),
        "ratio_median": spec / base,
        "budget_s": BUDGET_S,
        "within_budget": spec - base <= BUDGET_S,
    }
    if args.importtime:
        result["importtime_top_us"] = importtime(SPECENV, env, args.importtime)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'command':<72} {'median s':>9} {'min s':>7}")
        print(f"{BASELINE:<72} {base:9.3f} {result['baseline_min_s']:7.3f}")
        print(f"{SPECENV:<72} {spec:9.3f} {result['specenv_min_s']:7.3f}")
        print(
            f"difference {spec - base:.3f} s (min {result['difference_min_s']:.3f} s), ratio {spec / base:.2f}x, "
            f"budget {BUDGET_S} s: {'ok' if result['within_budget'] else 'OVER'}"
        )
        for us, name in result.get("importtime_top_us", []):
            print(f"  {us / 1e6:7.3f} s  {name}")
    return 1 if args.check and not result["within_budget"] else 0


if __name__ == "__main__":
    sys.exit(main())
