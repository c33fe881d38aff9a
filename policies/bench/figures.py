"""The figures of a benchmark run (matplotlib, imported only when a figure is drawn).

Single-request family: :func:`plot_speedup` (every policy beside the oracle bound) and
:func:`plot_categories` (the best policy of each policy family per prompt category), coloured by the
policy families of :data:`FAMILIES` (:func:`policy_family`). Caps family: :func:`plot_frontier`
(speed against quality, the joint oracle's frontier as a line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from policies.bench.caps import K_ORACLE
from policies.bench.result import BenchResult
from policies.bench.single import ORACLE_ROW

__all__ = [
    "FAMILIES",
    "family_representatives",
    "plot_categories",
    "plot_frontier",
    "plot_speedup",
    "policy_family",
]


#: Policy families of the figures, in legend order: (label, colour, hatch).
FAMILIES: dict[str, tuple[str, str, str]] = {
    "exact": ("fixed k (exact evaluation, no sampling noise)", "0.55", ""),
    "heuristic": ("published heuristic (Monte Carlo)", "tab:blue", ""),
    "delta": ("delta-space rule (Monte Carlo)", "tab:purple", ""),
    "learned": ("learned policy (Monte Carlo)", "tab:green", ""),
    "constant": ("learned, but chose one k everywhere", "tab:green", "//"),
    "oracle": ("oracle bound (exact SSP optimum)", "tab:red", ""),
}


def policy_family(row: Any) -> str:
    """The family of a summary row (a key of :data:`FAMILIES`): oracle, exact, learned, constant, delta, heuristic."""
    name = str(row["policy"])
    if name == ORACLE_ROW:
        return "oracle"
    if row["evaluation"] == "exact":
        return "exact"
    if bool(row.get("learned", False)):
        return "constant" if bool(row.get("constant", False)) else "learned"
    return "delta" if name.startswith("delta-space") else "heuristic"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend_handles(families: list[str]) -> list[Any]:
    from matplotlib.patches import Patch

    return [
        Patch(facecolor=FAMILIES[f][1], hatch=FAMILIES[f][2], edgecolor="white", alpha=0.85, label=FAMILIES[f][0])
        for f in FAMILIES
        if f in families
    ]


def plot_speedup(res: BenchResult, path: Path) -> Path:
    """Every policy's mean speedup over autoregressive decoding, beside the oracle bound; writes ``path``.

    One horizontal bar per policy, coloured by family (legend), with its percentile-bootstrap 95%
    interval over the held-out generations as a whisker (Monte-Carlo rows; exact rows have none),
    its value and its share of the bound. The x axis is zoomed to the data (it starts at
    ``min(0.9, lowest whisker)``, not at 0). A dashed line marks the bound, labelled with its value.
    """
    plt = _pyplot()
    from matplotlib.transforms import blended_transform_factory

    s = res.summary.reset_index(drop=True)
    fam = [policy_family(r) for _, r in s.iterrows()]
    mean = s["speedup_mean"].to_numpy(dtype=float)
    lo = np.where(s["ci95_low"].isna(), mean, s["ci95_low"]).astype(float)
    hi = np.where(s["ci95_high"].isna(), mean, s["ci95_high"]).astype(float)
    mc = np.array([f not in ("exact", "oracle") for f in fam])
    bound = float(s.loc[s["policy"] == ORACLE_ROW, "speedup_mean"].iloc[0])
    x0 = min(0.9, float(np.nanmin(lo)) - 0.05)
    x1 = max(bound, float(np.nanmax(hi))) + 0.04 * (max(bound, float(np.nanmax(hi))) - x0)
    fig, ax = plt.subplots(figsize=(11, 0.36 * len(s) + 3.4))
    y = np.arange(len(s))[::-1]
    ax.barh(
        y,
        mean,
        color=[FAMILIES[f][1] for f in fam],
        hatch=[FAMILIES[f][2] for f in fam],
        edgecolor="white",
        alpha=0.85,
    )
    whisk = ax.errorbar(
        mean[mc],
        y[mc],
        xerr=np.vstack([mean[mc] - lo[mc], hi[mc] - mean[mc]]).clip(min=0),
        fmt="none",
        ecolor="black",
        capsize=3,
        lw=1.2,
        label="95% bootstrap interval (Monte-Carlo rows)",
    )
    # the value column, right of the axes: the mean speedup, and the pooled speedup's share of the pooled bound
    tr = blended_transform_factory(ax.transAxes, ax.transData)
    ax.text(
        1.02, y[0] + 0.9, "mean speedup\n(pooled % of bound)", transform=tr, fontsize=8, fontweight="bold", va="center"
    )
    for yi, m, pct in zip(y, mean, s["oracle_pct"], strict=True):
        ax.text(1.02, yi, f"{m:.3f}  ({pct:.0f}%)", transform=tr, va="center", fontsize=8)
    ax.set_yticks(y, s["policy"])
    ax.set_ylim(-0.7, len(s) - 0.3)
    ax.set_xlim(x0, x1)
    ax.axvline(1.0, color="k", lw=0.8)
    line = ax.axvline(bound, color="tab:red", ls="--", lw=1.2, label=f"oracle bound (SSP) = {bound:.3f}")
    fig.legend(
        handles=[*_legend_handles(fam), whisk, line],
        loc="lower center",
        ncol=3,
        fontsize=8,
        framealpha=0.95,
        title="bar colour = policy family",
        title_fontsize=8,
    )
    ctx = res.context
    ax.set_xlabel(
        "speedup over autoregressive decoding (AR cost / policy cost; 1.0 = no gain; x axis zoomed, not from 0)\n"
        f"bar: mean over the {ctx.get('test_generations', '?')} held-out generations; whisker: its 95% "
        "percentile-bootstrap interval over generations (Monte-Carlo rows; exact rows have no noise)",
        fontsize=9,
    )
    ax.set_title(
        f"{ctx['dataset']}: every policy against the exact oracle bound (Kmax={ctx['kmax']}, "
        f"cost model {ctx.get('cost_model', '?')})",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 1.15 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def family_representatives(res: BenchResult) -> list[tuple[str, str]]:
    """(family, policy) pairs for the category figure: the best policy (pooled speedup) of every family.

    A learned policy that chose one k everywhere represents the learned family only when no adaptive
    learned policy ran.
    """
    s = res.summary.reset_index(drop=True)
    fam = pd.Series([policy_family(r) for _, r in s.iterrows()])
    out = []
    for f in FAMILIES:
        members = s[fam == f]
        if f == "constant" and (fam == "learned").any():
            continue
        if len(members):
            out.append((f, str(members.loc[members["speedup_pooled"].idxmax(), "policy"])))
    return out


def plot_categories(res: BenchResult, path: Path) -> Path:
    """Pooled speedup per category: the best policy of each family side by side; writes ``path``.

    Best is the family member with the highest pooled speedup over all held-out generations (so a
    family is shown by one bar per category). The y axis is zoomed to the data.
    """
    plt = _pyplot()
    reps = family_representatives(res)
    piv = res.categories.pivot(index="policy", columns="category", values="speedup_pooled")
    cats = [str(c) for c in piv.columns]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(cats) + 3), 5.2))
    width = 0.8 / max(len(reps), 1)
    x = np.arange(len(cats))
    vals = []
    for i, (f, name) in enumerate(reps):
        v = piv.loc[name, cats].to_numpy(dtype=float) if name in piv.index else np.full(len(cats), np.nan)
        vals.append(v)
        label = "oracle bound (SSP)" if f == "oracle" else f"{FAMILIES[f][0].split(' (')[0]}: {name}"
        ax.bar(
            x - 0.4 + width * (i + 0.5),
            v,
            width,
            color=FAMILIES[f][1],
            hatch=FAMILIES[f][2],
            edgecolor="white",
            alpha=0.85,
            label=label,
        )
    allv = np.concatenate(vals) if vals else np.array([1.0])
    lo, hi = float(np.nanmin(allv)), float(np.nanmax(allv))
    ax.set_ylim(min(0.9, lo - 0.05), hi + 0.08 * (hi - min(0.9, lo)) + 0.02)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x, cats, rotation=20, ha="right")
    ax.set_xlabel("prompt category of the held-out generations")
    ax.set_ylabel("pooled speedup over autoregressive decoding\n(sum of AR cost / sum of policy cost)")
    ax.set_title(
        f"{res.context['dataset']}: pooled speedup per prompt category, the best policy of each family\n"
        "(best = highest pooled speedup over all held-out generations; y axis zoomed, not from 0)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper right", framealpha=0.95, ncol=1)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


#: Families of the frontier plot: marker, colour.
_STYLE = {
    "fixed cap, fixed k": ("s", "0.6"),
    "fixed cap + k-policy": ("^", "tab:blue"),
    "k-only": ("o", "tab:purple"),
    "joint learned": ("*", "tab:green"),
}


def plot_frontier(res: BenchResult, path: Path) -> Path:
    """Speedup against the mismatched-token rate: every row, the joint oracle's frontier as a line."""
    from specenv.io import atomic_file

    plt = _pyplot()

    s = res.summary
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for fam, (marker, colour) in _STYLE.items():
        rows = s[s["family"] == fam]
        if len(rows):
            ax.scatter(100 * rows["mismatch_rate"], rows["speedup"], marker=marker, color=colour, s=70 if marker == "*"
                       else 22, alpha=0.8, label=fam, zorder=3)  # fmt: skip
    fr = res.frontier.sort_values("mismatch_rate")
    ax.plot(100 * fr["mismatch_rate"], fr["speedup"], "-o", color="tab:red", label="joint oracle (weight sweep)",
            zorder=4)  # fmt: skip
    ko = s[s["policy"] == K_ORACLE]
    if len(ko):
        ax.axhline(float(ko["speedup"].iloc[0]), color="tab:red", ls="--", lw=1, label="k-only oracle")
    ax.axvline(100 * res.comparison["max_mismatch_rate"], color="0.3", ls=":", lw=1)
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlim(left=0.0)
    ax.set_xlabel("mismatched tokens (% of tokens, symlog)")
    ax.set_ylabel("speedup over autoregressive (pooled)")
    ax.set_title(f"speed / quality: {res.context['dataset']}, caps {res.context['caps']}, held-out split")
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return path
