"""Confidence intervals of Monte-Carlo estimates, shared by the oracle's simulation, the rollouts and the benchmark.

:func:`mean_ci` and :func:`ratio_ci` take i.i.d. samples (episodes) and return
``{"value": ..., "ci95": ...}`` with a normal 95% half-width; ratio estimators (pooled speedup =
sum AR / sum cost, mean k per round) use the delta method. :func:`bootstrap_ratio_ci` gives
percentile bootstrap intervals over units (the benchmark resamples generations) of a pooled ratio
and a mean ratio, vectorised and seeded; :func:`paired_difference_ci` the interval of the difference
of two pooled ratios measured on the same units (paired: both resampled with the same indices).
"""

from __future__ import annotations

import numpy as np

__all__ = ["bootstrap_indices", "bootstrap_ratio_ci", "mean_ci", "paired_difference_ci", "ratio_ci"]


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


def bootstrap_indices(n: int, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """(n_boot, n) indices of ``n`` units resampled with replacement, from ``default_rng(seed)``.

    The same ``(n, n_boot, seed)`` gives the same resamples, so estimates of several policies over
    the same units can share them (paired bootstrap).
    """
    if n < 1 or n_boot < 1:
        raise ValueError(f"bootstrap needs n >= 1 and n_boot >= 1 (got n={n}, n_boot={n_boot})")
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def bootstrap_ratio_ci(
    num: np.ndarray,
    den: np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    indices: np.ndarray | None = None,
) -> dict[str, dict[str, float]]:
    """Percentile bootstrap intervals of a pooled ratio and of a mean ratio, resampling units.

    Each unit u (e.g. a generation) has a numerator and a denominator (e.g. its AR cost and the
    policy's mean cost on it). The *pooled* estimate is ``sum(num) / sum(den)``, the *mean* one
    ``mean(num / den)``; both are recomputed on ``n_boot`` resamples of the units with replacement
    (vectorised) and the interval is the ``(1 - level)/2`` and ``(1 + level)/2`` percentiles.

    Args:
        num: (n,) numerators.
        den: (n,) positive denominators.
        n_boot: Number of resamples.
        seed: Seed of the resamples (ignored when ``indices`` is given).
        level: Coverage of the interval.
        indices: (n_boot, n) resample indices (:func:`bootstrap_indices`) to share across estimates.

    Returns:
        ``{"pooled": {"value", "low", "high"}, "mean": {"value", "low", "high"}}``.

    Raises:
        ValueError: If the arrays differ in shape, are empty, or ``indices`` does not fit them.
    """
    num = np.asarray(num, dtype=np.float64).ravel()
    den = np.asarray(den, dtype=np.float64).ravel()
    if num.shape != den.shape or not len(num):
        raise ValueError(f"bootstrap_ratio_ci: num {num.shape} and den {den.shape} must be equal and non-empty")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level}: must be in (0, 1)")
    idx = bootstrap_indices(len(num), n_boot, seed) if indices is None else np.asarray(indices)
    if idx.ndim != 2 or idx.shape[1] != len(num):
        raise ValueError(f"indices: expected shape (n_boot, {len(num)}), got {idx.shape}")
    q = [50.0 * (1.0 - level), 50.0 * (1.0 + level)]
    pooled = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    mean = (num / den)[idx].mean(axis=1)
    out = {}
    for name, value, boot in (("pooled", num.sum() / den.sum(), pooled), ("mean", (num / den).mean(), mean)):
        low, high = np.percentile(boot, q)
        out[name] = {"value": float(value), "low": float(low), "high": float(high)}
    return out


def paired_difference_ci(
    num_a: np.ndarray,
    den_a: np.ndarray,
    num_b: np.ndarray,
    den_b: np.ndarray,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    indices: np.ndarray | None = None,
) -> dict[str, float]:
    """Paired percentile bootstrap interval of ``sum(num_a)/sum(den_a) - sum(num_b)/sum(den_b)``.

    Unit u carries both estimates' numerator and denominator (e.g. a generation's AR cost and two
    policies' costs on it, under common random numbers); each resample draws the units once and
    recomputes *both* pooled ratios on the same draw, so what the units share (a generation's
    difficulty) cancels in the difference. The interval is the ``(1 - level)/2`` and
    ``(1 + level)/2`` percentiles (numpy's linear interpolation) of the resampled differences.

    Args:
        num_a: (n,) numerators of the first estimate.
        den_a: (n,) its positive denominators.
        num_b: (n,) numerators of the second estimate, unit for unit.
        den_b: (n,) its positive denominators.
        n_boot: Number of resamples.
        seed: Seed of the resamples (ignored when ``indices`` is given).
        level: Coverage of the interval.
        indices: (n_boot, n) resample indices (:func:`bootstrap_indices`), e.g. the ones of the run's
            other intervals.

    Returns:
        ``{"value", "low", "high"}``: the difference on the units and its interval.

    Raises:
        ValueError: If the arrays differ in shape, are empty, or ``indices`` does not fit them.
    """
    arrays = [np.asarray(x, dtype=np.float64).ravel() for x in (num_a, den_a, num_b, den_b)]
    if len({x.shape for x in arrays}) != 1 or not len(arrays[0]):
        shapes = ", ".join(str(x.shape) for x in arrays)
        raise ValueError(f"paired_difference_ci: the four arrays must be equal and non-empty (got {shapes})")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level}: must be in (0, 1)")
    na, da, nb, db = arrays
    n = len(na)
    idx = bootstrap_indices(n, n_boot, seed) if indices is None else np.asarray(indices)
    if idx.ndim != 2 or idx.shape[1] != n:
        raise ValueError(f"indices: expected shape (n_boot, {n}), got {idx.shape}")
    boot = na[idx].sum(axis=1) / da[idx].sum(axis=1) - nb[idx].sum(axis=1) / db[idx].sum(axis=1)
    low, high = np.percentile(boot, [50.0 * (1.0 - level), 50.0 * (1.0 + level)])
    return {"value": float(na.sum() / da.sum() - nb.sum() / db.sum()), "low": float(low), "high": float(high)}
