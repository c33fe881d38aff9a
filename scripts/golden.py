"""Regenerate (or check) every golden figure the tests pin: one file, tests/golden.json.

Golden figures are results of deterministic computations on the shipped default set that the tests
compare against (tests/test_oracle_default.py, tests/test_oracle_cli.py). Each figure lives only in
tests/golden.json; this script is the only thing that writes it.

    python scripts/golden.py           # recompute and write tests/golden.json
    python scripts/golden.py --check   # recompute and compare, write nothing; exit 1 on a difference

A change that moves a figure on purpose (a new cost model, a new generator) reruns this script and
commits the new file together with the change, saying why the figures moved.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden.json"
# Relative tolerance of every float comparison (the tests read it from the file too): the figures are
# deterministic; the tolerance only absorbs last-bit differences of BLAS/numpy builds.
REL = 1e-6

# The setting of every figure below (the defaults of `specenv oracle paper-default`).
DATASET, COST_MODEL = "paper-default", "fit"
MC_EPISODES, MC_SEED = 4, 0


def compute() -> dict[str, Any]:
    """Recompute every golden figure from the package (no file is read but the shipped set)."""
    import oracle
    from specenv.cost.source import cost_model_for
    from specenv.traces.datasets import load_dataset
    from specenv.traces.splits import select_split

    ts = load_dataset(DATASET)
    arrays = ts.arrays()
    model = cost_model_for(ts, COST_MODEL)
    res = oracle.solve(arrays, model, mc_episodes=MC_EPISODES, seed=MC_SEED)
    mc = res.extra["mc"]
    an = oracle.delta_analysis(arrays, model, result=res)
    train = select_split(arrays, "train")
    return {
        "about": "Golden figures pinned by the tests. Written by scripts/golden.py only; do not edit by hand.",
        "rel_tolerance": REL,
        "oracle": {
            "setting": {
                "dataset": DATASET,
                "cost_model": COST_MODEL,
                "kmax": int(arrays.kmax),
                "split": "all",
                "lookahead": 0,
            },
            "s_max_pooled": float(res.speedup_pooled),
            "s_max_mean": float(res.speedup_mean),
            "mean_k": float(res.mean_k),
            "mean_accepted": float(res.mean_accepted),
            "expected_rounds": float(res.rounds.sum()),
        },
        "oracle_mc": {
            "setting": {"episodes_per_generation": MC_EPISODES, "seed": MC_SEED},
            "speedup_pooled": float(mc["speedup_pooled"]["value"]),
            "mean_k": float(mc["mean_k"]["value"]),
            "mean_accepted": float(mc["mean_accepted"]["value"]),
        },
        "delta": {
            "setting": {"states": "occupancy-weighted optimal path"},
            "quadrants": {key: int(val) for key, val in an.quadrants.items()},
            "lambda_sep": float(an.lambda_sep),
            "lambda_ls": float(an.lambda_ls),
            "r2_origin": float(an.r2_origin),
        },
        "boundary_slope_train": {
            "setting": {"split": "train", "method": "sep"},
            "lambda": float(oracle.boundary_slope(train, model)),
        },
    }


def differences(old: Any, new: Any, rel: float, where: str = "") -> list[str]:
    """Every leaf where ``new`` differs from ``old`` (floats within ``rel`` count as equal)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{where}.{k}: only in {GOLDEN.name}" for k in old.keys() - new.keys()]
        out += [f"{where}.{k}: new figure" for k in new.keys() - old.keys()]
        for key in old.keys() & new.keys():
            out += differences(old[key], new[key], rel, f"{where}.{key}")
        return sorted(out)
    if isinstance(old, float) and isinstance(new, float):
        return [] if math.isclose(old, new, rel_tol=rel, abs_tol=0.0) else [f"{where}: {old!r} -> {new!r}"]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def main(argv: list[str] | None = None) -> int:
    """Write tests/golden.json, or with ``--check`` compare against it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Compare with tests/golden.json; write nothing.")
    args = parser.parse_args(argv)
    new = compute()
    if args.check:
        if not GOLDEN.exists():
            print(f"golden: {GOLDEN} does not exist (run without --check)", file=sys.stderr)
            return 1
        diff = differences(json.loads(GOLDEN.read_text()), new, REL)
        for line in diff:
            print(f"golden: {line}", file=sys.stderr)
        print(f"golden: {'DIFFERS' if diff else 'identical'} ({GOLDEN})")
        return 1 if diff else 0
    tmp = GOLDEN.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(new, indent=2) + "\n")
    os.replace(tmp, GOLDEN)
    print(f"golden: wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
