"""Confidence intervals of Monte-Carlo estimates, shared by the oracle's simulation and the rollouts.

Both take i.i.d. samples (episodes) and return ``{"value": ..., "ci95": ...}`` with a normal 95%
half-width; ratio estimators (pooled speedup = sum AR / sum cost, mean k per round) use the delta
method.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mean_ci", "ratio_ci"]


def mean_ci(x: np.ndarray) -> dict[str, float]:
    """Mean with a 95% normal half-width over i.i.d. samples (``nan`` below two samples)."""
    x = np.asarray(x, dtype=np.float64)
    half = 1.96 * x.std(ddof=1) / np.sqrt(len(x)) if len(x) > 1 else float("nan")
    return {"value": float(x.mean()), "ci95": float(half)}


def ratio_ci(num: np.ndarray, den: np.ndarray) -> dict[str, float]:
    """sum(num)/sum(den) with a delta-method 95% half-width over i.i.d. episodes."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    r = num.sum() / den.sum()
    n = len(num)
    if n < 2:
        return {"value": float(r), "ci95": float("nan")}
    resid = num - r * den
    half = 1.96 * resid.std(ddof=1) / (np.sqrt(n) * den.mean())
    return {"value": float(r), "ci95": float(half)}
