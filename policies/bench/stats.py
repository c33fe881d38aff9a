"""The statistics of a benchmark's rows: per-generation tables, pooled and mean speedups, paired bootstrap CIs.

Every row of a run is resampled with the same bootstrap indices (:func:`specenv.stats.bootstrap_indices`,
one draw per run), so two rows' intervals are paired over the same units (generations, or episodes in
the batch family); the intervals themselves are :func:`specenv.stats.bootstrap_ratio_ci`'s, and each row's difference
to a reference row (:func:`paired_differences`) is :func:`specenv.stats.paired_difference_ci`'s on the
same resamples: the rows are paired twice, by common random numbers within a generation and by the
shared resamples of the generations.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from policies.bench.context import N_BOOT
from specenv.stats import bootstrap_indices, bootstrap_ratio_ci, paired_difference_ci

__all__ = ["generation_table", "paired_differences", "pooled_ci", "summarise", "summarise_pooled"]


def generation_table(episodes: pd.DataFrame) -> pd.DataFrame:
    """Monte-Carlo episodes -> one row per (policy, generation): mean cost, its SD, the summed counts."""
    g = (
        episodes.groupby(["policy", "generation_id", "category"], sort=False)
        .agg(
            cost_ms=("cost_ms", "mean"),
            cost_sd=("cost_ms", "std"),
            n=("cost_ms", "size"),
            ar_ms=("ar_ms", "first"),
            rounds=("rounds", "sum"),
            k_sum=("k_sum", "sum"),
            accepted_sum=("accepted_sum", "sum"),
            k_min=("k_min", "min"),
            k_max=("k_max", "max"),
        )
        .reset_index()
    )
    g["cost_sd"] = g["cost_sd"].fillna(0.0)
    g["rounds"] = g["rounds"].astype(np.float64)
    g["k_sum"] = g["k_sum"].astype(np.float64)
    g["accepted_sum"] = g["accepted_sum"].astype(np.float64)
    g["exact"] = False
    return g


def summarise(
    generations: pd.DataFrame, oracle: pd.DataFrame, n_boot: int = N_BOOT, seed: int = 0
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-policy summary and per-policy-per-category pooled speedups.

    Args:
        generations: One row per (policy, generation) (:func:`generation_table`, :func:`exact_generations`).
        oracle: Per generation: ``generation_id``, ``v0_ms`` (the bound's cost), ``ar_ms``.
        n_boot: Bootstrap resamples of the generations (shared by every policy: paired).
        seed: Seed of the resamples.
    """
    g = generations.merge(oracle[["generation_id", "v0_ms"]], on="generation_id")
    g["speedup"] = g["ar_ms"] / g["cost_ms"]
    se = (g["cost_sd"] / np.sqrt(g["n"].clip(lower=1))).to_numpy()
    # a policy "beats the bound" only if its mean cost is below V(0) by more than 4 MC standard errors
    g["beats_bound"] = g["cost_ms"] < g["v0_ms"] - 4.0 * se - 1e-9 * g["v0_ms"]
    s_max = float(oracle["ar_ms"].sum() / oracle["v0_ms"].sum())
    order = {gid: i for i, gid in enumerate(oracle["generation_id"])}
    idx = bootstrap_indices(len(order), n_boot, seed)
    rows = []
    for name, d in g.groupby("policy", sort=False):
        d = d.sort_values("generation_id", key=lambda c: c.map(order))
        exact = bool(d["exact"].all())
        ar, cost = d["ar_ms"].to_numpy(), d["cost_ms"].to_numpy()
        pooled = float(ar.sum() / cost.sum())
        mean = float((ar / cost).mean())
        if exact:  # no sampling noise
            ci = {"pooled": {"low": pooled, "high": pooled}, "mean": {"low": mean, "high": mean}}
        else:
            ci = bootstrap_ratio_ci(ar, cost, indices=idx if len(d) == len(order) else None, n_boot=n_boot, seed=seed)
        k_lo, k_hi = int(d["k_min"].min()), int(d["k_max"].max())
        rows.append(
            {
                "policy": name,
                "evaluation": "exact" if exact else "monte-carlo",
                "speedup_mean": mean,
                "ci95_low": ci["mean"]["low"],
                "ci95_high": ci["mean"]["high"],
                "speedup_pooled": pooled,
                "pooled_ci95_low": ci["pooled"]["low"],
                "pooled_ci95_high": ci["pooled"]["high"],
                "oracle_pct": 100.0 * pooled / s_max,
                "mean_k": float(d["k_sum"].sum() / d["rounds"].sum()),
                "mean_accepted": float(d["accepted_sum"].sum() / d["rounds"].sum()),
                "generations": int(len(d)),
                "beats_bound": int(d["beats_bound"].sum()),
                "constant": k_lo == k_hi,
                "constant_k": k_lo if k_lo == k_hi else None,
            }
        )
    summary = pd.DataFrame(rows)
    cat = (
        g.groupby(["policy", "category"], sort=False)
        .apply(lambda d: d["ar_ms"].sum() / d["cost_ms"].sum(), include_groups=False)
        .rename("speedup_pooled")
        .reset_index()
    )
    return summary, cat


def summarise_pooled(gen: pd.DataFrame, meta: dict[str, dict[str, Any]], n_boot: int, seed: int) -> pd.DataFrame:
    """Per-policy pooled speedup with its paired bootstrap 95% CI, mismatch rate and log-prob gap (caps family).

    Args:
        gen: One row per (policy, generation): ``cost_ms``, ``ar_ms``, ``mismatches``, ``lpgap``, ``tokens``.
        meta: Per policy, the columns written before the statistics (family, cap, evaluation, ...).
        n_boot: Bootstrap resamples of the generations (shared by every policy: paired).
        seed: Seed of the resamples.
    """
    rows = []
    order = list(dict.fromkeys(gen["policy"]))
    n = gen.groupby("policy", sort=False).size().iloc[0]
    idx = bootstrap_indices(int(n), n_boot, seed)
    for name in order:
        g = gen[gen["policy"] == name].sort_values("generation_id")
        ci = bootstrap_ratio_ci(g["ar_ms"].to_numpy(), g["cost_ms"].to_numpy(), indices=idx)["pooled"]
        tokens = float(g["tokens"].sum())
        rows.append(
            {
                "policy": name,
                **meta[name],
                "speedup": float(g["ar_ms"].sum() / g["cost_ms"].sum()),
                "speedup_lo": ci["low"],
                "speedup_hi": ci["high"],
                "mismatch_rate": float(g["mismatches"].sum() / tokens),
                "lpgap": float(g["lpgap"].sum() / tokens),
            }
        )
    return pd.DataFrame(rows)


def pooled_ci(num: np.ndarray, den: np.ndarray, indices: np.ndarray) -> dict[str, float]:
    """``{"value", "low", "high"}``: the pooled ratio sum(num) / sum(den) and its bootstrap 95% interval.

    ``indices`` are the run's shared resamples of the units (:func:`specenv.stats.bootstrap_indices`).
    """
    return bootstrap_ratio_ci(num, den, indices=indices)["pooled"]


def paired_differences(
    costs: dict[str, np.ndarray], ar: np.ndarray, reference: np.ndarray, n_boot: int = N_BOOT, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Each row's pooled speedup minus a reference's, with its paired bootstrap 95% interval.

    Args:
        costs: Per row, its (G,) cost per generation, in the order of ``ar``.
        ar: (G,) AR cost per generation (the same for every row: the speedup's reference).
        reference: (G,) the reference row's cost per generation.
        n_boot: Bootstrap resamples of the generations (the ones :func:`summarise` uses with the same
            ``n_boot`` and ``seed``).
        seed: Seed of the resamples.

    Returns:
        Per row ``{"value", "low", "high"}`` (:func:`specenv.stats.paired_difference_ci`).
    """
    idx = bootstrap_indices(len(ar), n_boot, seed)
    return {name: paired_difference_ci(ar, c, ar, reference, indices=idx) for name, c in costs.items()}
