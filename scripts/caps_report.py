"""The figures of a trace set collected with expert caps (issue 17 items 2 and 3), as JSON.

Usage:
    python scripts/caps_report.py [TRACES]          # default: the shipped live-cpu-caps set

Prints: the cap grid and how it was chosen (the per-layer union quantiles it came from); on the
*test* split (:mod:`specenv.traces.splits`), per cap level and budget k, the token mismatch rate
(mismatched / committed tokens, :meth:`specenv.traces.traceset.PositionArrays.cap_quality`), the mean
log-prob gap and the mean and range of the capped U; how often the executed capped fixed-K runs left
the reference text; the cost-model transfer (:func:`specenv.cost.fit.capped_transfer`: fitted on the
train split, scored on the test split's rounds); and the collection time from the manifest.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from specenv.cost.fit import capped_transfer
from specenv.traces.datasets import load_dataset
from specenv.traces.splits import select_split, split_ids


def main() -> None:
    """Print the report of the set named on the command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="?", default="live-cpu-caps")
    args = ap.parse_args()
    ts = load_dataset(args.traces)
    arrays = ts.arrays()
    ca = arrays.cap_arrays("scripts/caps_report.py")
    test = select_split(arrays, "test")
    tq = test.cap_quality()
    tca = test.cap_arrays()
    ids = arrays.generation_ids
    quality = {}
    for c, B in enumerate(ca.caps.tolist()):
        quality[str(B)] = {
            "mismatch_rate_by_k": [round(float(x), 5) for x in tq["mismatch_rate"][c]],
            "lpgap_by_k": [round(float(x), 5) for x in tq["lpgap"][c]],
            "U_mean_by_k": [round(float(x), 3) for x in tq["U"][c]],
            "U_range_k_ge_1": [float(tca.U[c, 1:].min()), float(tca.U[c, 1:].max())],
        }
    uncapped_U = [round(float(x), 3) for x in test.U.mean(axis=0)]
    report = {
        "set": ts.manifest.name,
        "generations": {"all": int(len(ids)), "test": int(test.n_generations)},
        "positions_test": int(len(test.L)),
        "caps": ca.caps.tolist(),
        "cap_rule": ts.manifest.extra.get("caps", {}).get("rule"),
        "layer_union_quantiles_train_Kmax": ts.manifest.extra.get("caps", {}).get("layer_union_quantiles"),
        "test_uncapped_U_mean_by_k": uncapped_U,
        "test_quality_by_cap": quality,
        "capped_runs": ts.manifest.extra.get("caps", {}).get("capped_runs"),
        "cost_transfer": capped_transfer(
            ts.rounds, ts.kmax, ts.facts.top_k, split_ids(ids, "train"), split_ids(ids, "test")
        ),
        "collection_wall_seconds": ts.manifest.extra.get("wall_seconds"),
        "machine_loadavg": ts.manifest.extra.get("machine"),
    }
    print(json.dumps(report, indent=1, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o)))


if __name__ == "__main__":
    main()
