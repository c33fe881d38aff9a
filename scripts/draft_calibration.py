"""How well the draft's online signals predict acceptance: the generator against the live engine.

For depth j = 1..4 it prints the ROC AUC of three signals of the j-th drafted token, q_j (the draft's
probability of it), -ent_j (minus the entropy of the draft's distribution) and margin_j (top-1 minus
top-2 probability), predicting that the target accepts it, on each trace set named:

    python scripts/draft_calibration.py [paper-default live-cpu ...] [--depths 4] [--json]

Two views of "accepted at depth j":

* ``all``: every position t, label rho_{t,j} (the conditional acceptance of draft j: a 0/1 label on
  greedy sets, a probability on stochastic ones, counted as a positive with weight rho and a
  negative with weight 1 - rho);
* ``reached``: the same, each position weighted by P(drafts 1..j-1 accepted) = S_{t,j-1}: the
  decisions a sequential controller makes at depth j after the earlier drafts survived.

It also prints the calibration in the large: mean q_j against the mean acceptance of the view.
Schema-v1 sets (no entropy or margin) get q only. The figures are documented in traces/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from sklearn.metrics import roc_auc_score

from specenv.traces.datasets import load_dataset


def weighted_auc(score: np.ndarray, p: np.ndarray, w: np.ndarray) -> float:
    """AUC of ``score`` for labels that are positive with probability ``p``, rows weighted by ``w``."""
    s = np.concatenate([score, score])
    y = np.concatenate([np.ones_like(p), np.zeros_like(p)])
    sw = np.concatenate([w * p, w * (1.0 - p)])
    keep = sw > 0
    if np.unique(y[keep]).size < 2:
        return float("nan")
    return float(roc_auc_score(y[keep], s[keep], sample_weight=sw[keep]))


def calibration(name: str, depths: int) -> dict:
    """The table of one set: per view and depth, AUCs of each signal, mean q and mean acceptance."""
    ts = load_dataset(name)
    arr = ts.arrays()
    depths = min(depths, arr.kmax)
    surv = arr.survival()
    signals = {"q": arr.q}
    if arr.has_signals:
        ent, margin = arr.signals()
        signals |= {"-entropy": -ent, "margin": margin}
    out: dict = {"set": name, "greedy": arr.greedy, "positions": int(len(arr.L)), "views": {}}
    for view in ("all", "reached"):
        rows = []
        for j in range(depths):
            p = arr.rho[:, j]
            w = np.ones_like(p) if view == "all" or j == 0 else surv[:, j - 1]
            row = {"depth": j + 1, "weight": float(w.sum())}
            for sig, x in signals.items():
                row[f"auc_{sig}"] = weighted_auc(x[:, j], p, w)
            row["mean_q"] = float(np.average(arr.q[:, j], weights=w))
            row["acceptance"] = float(np.average(p, weights=w))
            if arr.has_signals:
                row["mean_entropy"] = float(np.average(ent[:, j], weights=w))
            rows.append(row)
        out["views"][view] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sets", nargs="*", default=["paper-default", "live-cpu"])
    ap.add_argument("--depths", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tables = [calibration(s, args.depths) for s in args.sets]
    if args.json:
        print(json.dumps(tables, indent=2))
        return 0
    for tab in tables:
        for view, rows in tab["views"].items():
            print(f"\n{tab['set']} ({'greedy' if tab['greedy'] else 'stochastic rho'}), view: {view}")
            sigs = [k for k in rows[0] if k.startswith("auc_")]
            head = ["j", *[s[4:] for s in sigs], "mean q", "accept", *(["mean H"] if "mean_entropy" in rows[0] else [])]
            print(" | ".join(f"{h:>9}" for h in head))
            for r in rows:
                vals = [r["depth"], *[r[s] for s in sigs], r["mean_q"], r["acceptance"]]
                if "mean_entropy" in r:
                    vals.append(r["mean_entropy"])
                print(" | ".join(f"{v:>9}" if isinstance(v, int) else f"{v:>9.3f}" for v in vals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
