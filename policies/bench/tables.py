"""The Markdown tables of a benchmark run, of every family (:func:`markdown_table`).

The single-request family also has its pooled speedup per category (:func:`category_table`), the
caps family the joint oracle's frontier (:func:`frontier_table`).
"""

from __future__ import annotations

import math
from typing import Any

from policies.bench.result import BenchResult

__all__ = ["batch_table", "caps_table", "category_table", "frontier_table", "markdown_table", "single_table"]


def markdown_table(res: BenchResult) -> str:
    """The run's table, one row per policy (:func:`single_table`, :func:`batch_table` or :func:`caps_table`)."""
    return {"single": single_table, "batch": batch_table, "caps": caps_table}[res.family](res)


def _diff(value: float, low: float, high: float) -> str:
    """A paired difference with its 95% interval (blank when the row has none)."""
    if value != value:  # NaN
        return ""
    return f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"


def single_table(res: BenchResult) -> str:
    """The single-request summary as a Markdown table (exact rows marked "exact", the others with bootstrap 95% CIs).

    "% of belief" is the row's pooled speedup in % of the belief oracle's (a reference, not a bound:
    :mod:`oracle.belief`). The last two columns are each row's paired difference in pooled speedup
    to the best fixed k in hindsight and to the peer (``context["vs"]``), with paired bootstrap 95%
    intervals.
    """
    k_best, peer = res.context.get("best_fixed_k_test"), res.context.get("vs")
    lines = [
        "| policy | drafting | speedup (mean, 95% CI) | pooled (95% CI) | % of oracle | % of belief | mean k | "
        "mean accepted | "
        f"Δ pooled vs fixed k={k_best} (test, hindsight) [95% CI] | Δ pooled vs {peer or 'peer'} [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res.summary.itertuples():
        if r.evaluation == "exact":
            mean, pooled = f"{r.speedup_mean:.3f} (exact)", f"{r.speedup_pooled:.3f} (exact)"
        else:
            mean = f"{r.speedup_mean:.3f} [{r.ci95_low:.3f}, {r.ci95_high:.3f}]"
            pooled = f"{r.speedup_pooled:.3f} [{r.pooled_ci95_low:.3f}, {r.pooled_ci95_high:.3f}]"
        mode = f"{r.drafting} (h={r.lookahead})" if r.drafting == "block" else r.drafting
        pct = f"{r.oracle_pct:.1f}% | " + ("" if r.belief_pct != r.belief_pct else f"{r.belief_pct:.1f}%")
        d_fixed = _diff(r.vs_best_fixed, r.vs_best_fixed_ci95_low, r.vs_best_fixed_ci95_high)
        d_peer = _diff(r.vs_peer, r.vs_peer_ci95_low, r.vs_peer_ci95_high)
        lines.append(
            f"| {r.policy} | {mode} | {mean} | {pooled} | {pct} | {r.mean_k:.2f} | {r.mean_accepted:.2f} | "
            f"{d_fixed} | {d_peer} |"
        )
    for sk in res.skipped:
        lines.append(f"| {sk['policy']} (not run: {sk['reason'].replace('|', '/')}) | | | | | | | | | |")
    return "\n".join(lines)


def category_table(res: BenchResult) -> str:
    """Pooled speedup per category as a Markdown table."""
    piv = res.categories.pivot(index="policy", columns="category", values="speedup_pooled")
    piv = piv.reindex(res.summary["policy"])
    cols = list(piv.columns)
    lines = ["| policy | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, row in piv.iterrows():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    return "\n".join(lines)


def batch_table(res: BenchResult) -> str:
    """The batch table: one row per policy, then the bound."""
    lines = [
        "| policy | drafting | speedup (pooled) | 95% CI | vs best vLLM rule (train-fitted) | bound violations |",
        "|---|---|---|---|---|---|",
    ]
    for r in res.rows:
        lines.append(
            f"| {r['policy']} | {r['drafting']} | {r['speedup_pooled']:.3f} | "
            f"[{r['ci95_low']:.3f}, {r['ci95_high']:.3f}] | {100 * r['vs_best_vllm']:+.1f}% | {r['bound_violations']} |"
        )
    b = res.bound
    ci = b["ci95_expected"]
    line = (
        f"| **bound** (expected) | any | {b['speedup_pooled_expected']:.3f} | [{ci['low']:.3f}, {ci['high']:.3f}] | | |"
    )
    lines.append(line)
    if "speedup_pooled_pathwise" in b:
        lines.append(f"| **bound** (pathwise) | any | {b['speedup_pooled_pathwise']:.3f} | | | |")
    if "linear" in b:  # the split rule alone, for comparison
        lin = b["linear"]
        lines.append(f"| bound, split rule only (expected) | any | {lin['speedup_pooled_expected']:.3f} | | | |")
        if "speedup_pooled_pathwise" in lin:
            lines.append(f"| bound, split rule only (pathwise) | any | {lin['speedup_pooled_pathwise']:.3f} | | | |")
    return "\n".join(lines)


def _fmt_ci(r: Any) -> str:
    return f"{r['speedup']:.3f} [{r['speedup_lo']:.3f}, {r['speedup_hi']:.3f}]"


def caps_table(res: BenchResult) -> str:
    """The caps table, every row: speedup [95% CI] beside mismatch rate and mean log-prob gap."""
    lines = [
        "| policy | family | cap | evaluation | speedup [95% CI] | mismatched tokens | log-prob gap / token |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, r in res.summary.iterrows():
        lines.append(
            f"| {r['policy']} | {r['family']} | {r['cap']} | {r['evaluation']} | {_fmt_ci(r)} | "
            f"{100 * r['mismatch_rate']:.2f}% | {r['lpgap']:.4f} |"
        )
    return "\n".join(lines)


def frontier_table(res: BenchResult) -> str:
    """The joint oracle's speed / quality frontier, one row per quality weight."""
    lines = [
        "| weight (AR steps / mismatched token) | speedup | mismatched tokens | log-prob gap / token | capped rounds |",
        "|---|---|---|---|---|",
    ]
    for _, r in res.frontier.iterrows():
        w = r["quality_weight"]
        lines.append(
            f"| {'inf' if math.isinf(w) else f'{w:g}'} | {r['speedup']:.3f} | {100 * r['mismatch_rate']:.2f}% | "
            f"{r['lpgap']:.4f} | {100 * r['capped_share']:.1f}% |"
        )
    return "\n".join(lines)
