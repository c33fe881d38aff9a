"""The joint (k, expert cap) benchmark: speed and quality side by side, and the joint oracle's frontier.

On a trace set with the ``caps-v1`` extension (held-out split, cost model fitted on the train split by
default, the capped rounds included), every row reports the pooled speedup (sum AR / sum cost) with
a 95% percentile-bootstrap interval over the held-out generations, the token mismatch rate
(mismatched committed tokens / tokens) and the mean log-prob gap per token (each capped round's mean
gap weighted by its committed tokens; uncapped rounds count 0). Rows:

* the k-only oracle (:func:`oracle.dp.solve`) and the joint oracle at every quality weight of the
  sweep (:func:`oracle.caps.frontier`): the speed / quality frontier;
* MoE-Spec's fixed budget with fixed k: every (k >= 1, cap level >= 1), exactly
  (:func:`oracle.caps.evaluate_joint`);
* every k-policy of the k-only benchmark (:func:`policies.benchmark.default_entries`: the fixed
  budgets, the heuristics, the peers and the learned policies found for the set) at every cap level
  0..C (:class:`policies.caps.FixedCap`): fixed budgets exactly, the others by rollouts in
  ``specenv/MoESpecCap-v0`` (each charged by its drafting mode, as in the k-only benchmark);
* joint learned controllers: trained here by imitation of the joint oracle at the given weights
  (:func:`policies.caps.train_joint_dagger`, on the train split) or loaded from folders; rollouts.
  With training, the k-only imitation learner of the same recipe (:func:`policies.imitation.train_dagger`,
  same cost model, lookahead, iterations, epochs and seed) is trained too and runs as a k-policy.

Rollouts: ``episodes`` per held-out generation with the seeds of :func:`specenv.rollout.episode_seeds`;
on a greedy set every episode is the same (the capped rounds are deterministic too), so one suffices.

The headline comparison (``comparison``): the best joint learned controller whose mismatch rate is
at most ``max_mismatch`` (1% by default) against the best k-only controller (cap level 0, every
non-oracle row), and the joint oracle's best point under the same quality constraint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from oracle.caps import DEFAULT_WEIGHTS, JointEvaluation, evaluate_joint, frontier
from policies.benchmark import Entry, _learned, build_context, default_entries, shipped_policy_dir
from policies.caps import FixedCap, JointMLP, train_joint_dagger
from specenv.stats import bootstrap_indices, bootstrap_ratio_ci

__all__ = [
    "DEFAULT_WEIGHTS",
    "CapBenchResult",
    "frontier_table",
    "markdown_table",
    "plot_frontier",
    "run_cap_bench",
    "write_outputs",
]

K_ORACLE = "k-only oracle (SSP)"


@dataclass
class CapBenchResult:
    """Outcome of :func:`run_cap_bench`.

    Attributes:
        summary: One row per policy: policy, family, cap, k, evaluation, speedup and its CI,
            mismatch_rate, lpgap, capped_share.
        frontier: One row per quality weight: the joint oracle's speedup, mismatch rate, lpgap.
        generations: Per (policy, generation) cost, AR cost, mismatches, lpgap, tokens.
        comparison: The headline comparison under the quality constraint.
        context: Set, split sizes, caps, cost model, settings.
        joint_policies: The joint learned policies trained here (exported numpy form), by row name.
        notes: Skipped policies and other remarks.
    """

    summary: pd.DataFrame
    frontier: pd.DataFrame
    generations: pd.DataFrame
    comparison: dict[str, Any]
    context: dict[str, Any]
    joint_policies: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (summary, frontier, comparison, context, notes); an infinite weight is ``"inf"``."""
        return _clean(
            {
                "context": self.context,
                "summary": self.summary.to_dict(orient="records"),
                "frontier": self.frontier.to_dict(orient="records"),
                "comparison": self.comparison,
                "notes": self.notes,
            }
        )


def _per_gen(name: str, family: str, ev_cost, ar, mis, lp, lengths, gids) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "policy": name,
            "family": family,
            "generation_id": np.asarray(gids, dtype=np.int64),
            "cost_ms": np.asarray(ev_cost, dtype=np.float64),
            "ar_ms": np.asarray(ar, dtype=np.float64),
            "mismatches": np.asarray(mis, dtype=np.float64),
            "lpgap": np.asarray(lp, dtype=np.float64),
            "tokens": np.asarray(lengths, dtype=np.int64),
        }
    )


def _exact(name: str, family: str, ev: JointEvaluation) -> pd.DataFrame:
    return _per_gen(name, family, ev.cost, ev.ar, ev.mismatches, ev.lpgap, ev.lengths, ev.generation_ids)


def _env_kwargs(entry: Entry | None, policy: Any) -> dict[str, Any]:
    """The drafting mode, lookahead and signals of a row: the entry's, or a joint policy's contract."""
    if entry is not None:
        return {"lookahead": entry.lookahead, "drafting": entry.mode, "signals": entry.signals}
    h = policy.spec.lookahead
    return {"lookahead": h, "drafting": "block" if h else "none", "signals": policy.spec.signals if h else ("q",)}


def _rollouts(
    ctx: Any, entry: Entry | None, policy: Any, episodes: int, seed: int, name: str, family: str
) -> tuple[pd.DataFrame, float]:
    """Roll ``policy`` out in the joint env on the test split: per-generation means over the episodes, capped share."""
    import gymnasium as gym

    from specenv.envs.caps import CAP_ID
    from specenv.rollout import episode_seeds, rollout

    kw = _env_kwargs(entry, policy)
    env = gym.make(CAP_ID, dataset=ctx.dataset, kmax=ctx.kmax, split="test", cost_model=ctx.cost_model_arg, **kw)
    gids = np.asarray(env.unwrapped.data.generation_ids, dtype=np.int64)
    ep_gid = np.repeat(gids, episodes)
    ep_r = np.tile(np.arange(episodes, dtype=np.int64), len(gids))
    seeds = episode_seeds(seed, ep_gid, ep_r)
    try:
        res = rollout(env, policy, list(zip(ep_gid.tolist(), seeds.tolist(), strict=True)))
    finally:
        env.close()

    def mean(x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float64).reshape(len(gids), episodes).mean(axis=1)

    lengths = np.asarray(env.unwrapped.data.lengths)
    share = float(res.quality["capped_rounds"].sum() / res.rounds.sum())
    return _per_gen(
        name,
        family,
        mean(res.cost),
        mean(res.ar),
        mean(res.quality["mismatches"]),
        mean(res.quality["lpgap"]),
        lengths,
        gids,
    ), share


def _summarise(gen: pd.DataFrame, meta: dict[str, dict[str, Any]], n_boot: int, seed: int) -> pd.DataFrame:
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


def run_cap_bench(
    dataset: str,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    policy_dir: Path | None = None,
    weights: Sequence[float] = DEFAULT_WEIGHTS,
    train_weights: Sequence[float] = (),
    joint_policies: Sequence[Path] = (),
    episodes: int = 1,
    seed: int = 0,
    n_boot: int = 2000,
    max_mismatch: float = 0.01,
    train_kwargs: dict[str, Any] | None = None,
    only: Sequence[str] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> CapBenchResult:
    """Every joint baseline, the joint learners and the frontier on the held-out split of a caps set.

    Args:
        dataset: Registry name or folder of a set with the ``caps-v1`` extension.
        kmax: Largest budget (default the set's).
        cost_model: ``"fit-train"`` (default), ``"fit"``, ``"profile"`` or a cost-model JSON.
        policy_dir: Folder of trained k-policies (default: those shipped for the set, if any).
        weights: Quality weights of the joint oracle's frontier (AR steps per mismatched token).
        train_weights: Weights at which to train a joint learned controller here (train split).
        joint_policies: Folders of trained joint policies to evaluate.
        episodes: Rollout episodes per held-out generation.
        seed: Seed of the episodes and the bootstrap.
        n_boot: Bootstrap resamples.
        max_mismatch: The quality constraint of the headline comparison (mismatched-token rate).
        train_kwargs: Extra arguments of :func:`policies.caps.train_joint_dagger`.
        only: Keep only the k-policies whose name contains one of these (the oracles and the fixed
            cap x fixed k grid always run); a filter that keeps no k-policy is refused.
        progress: Called with (done, total, row name).

    Raises:
        ValueError: One line naming the argument (a set without caps columns names ``dataset``).
    """
    from oracle.dp import solve
    from specenv.capreplay import joint_tables

    pdir = policy_dir if policy_dir is not None else shipped_policy_dir(dataset)
    ctx = build_context(dataset, kmax, cost_model, pdir)
    test = ctx.test
    try:
        tab = joint_tables(test, ctx.cost_model)
    except ValueError as exc:
        raise ValueError(f"dataset={dataset!r}: {exc}") from None
    C = tab.n_levels
    entries = default_entries(ctx)
    if only:
        entries = [e for e in entries if any(o in e.name for o in only)]
        if not entries:  # as the k-only benchmark: a filter that keeps nothing is a typo, not a request
            raise ValueError(f"--only: {list(only)} matches no k-policy")
    if train_weights:  # the k-only learner of the same recipe, for an apples-to-apples learned row
        from policies.imitation import train_dagger

        kw = dict(train_kwargs or {})
        h = int(kw.get("lookahead", 0))
        kpol = train_dagger(
            dataset,
            ctx.kmax,
            cost_model,
            lookahead=h,
            iterations=int(kw.get("iterations", 4)),
            epochs=int(kw.get("epochs", 30)),
            seed=seed,
        ).policy
        entries.append(
            Entry(
                "k-only imitation (trained here)",
                _learned(kpol),
                lookahead=h,
                learned=True,
                drafting="block" if h else "none",
            )
        )
    n_rows = sum(1 if e.exact_k == 0 else C + 1 for e in entries)
    total = 1 + len(weights) + ctx.kmax * C + n_rows + len(train_weights) + len(joint_policies)
    done = 0
    parts: list[pd.DataFrame] = []
    meta: dict[str, dict[str, Any]] = {}

    def add(df: pd.DataFrame, name: str, **m: Any) -> None:
        nonlocal done
        parts.append(df)
        meta[name] = m
        done += 1
        if progress:
            progress(done, total, name)

    def cap_name(c: int) -> str:
        return "none" if c == 0 else str(tab.levels[c - 1])

    ko = solve(test, ctx.cost_model)
    add(
        _per_gen(K_ORACLE, "oracle", ko.cost, ko.ar, np.zeros(len(ko.cost)), np.zeros(len(ko.cost)), ko.lengths,
                 ko.generation_ids),
        K_ORACLE, family="oracle", cap="none", evaluation="exact", capped_share=0.0,
    )  # fmt: skip
    fr_rows = []
    for w, ev in zip(weights, frontier(test, ctx.cost_model, weights, tables=tab), strict=True):
        name = f"joint oracle (w={w:g})"
        add(_exact(name, "joint oracle", ev), name, family="joint oracle", cap="joint", evaluation="exact",
            capped_share=ev.capped_share)  # fmt: skip
        fr_rows.append(
            {
                "quality_weight": w,
                "speedup": ev.speedup_pooled,
                "mismatch_rate": ev.mismatch_rate,
                "lpgap": ev.lpgap_mean,
                "capped_share": ev.capped_share,
            }
        )
    for c in range(1, C + 1):
        for k in range(1, ctx.kmax + 1):
            name = f"MoE-Spec fixed cap B={cap_name(c)}, k={k}"
            ev = evaluate_joint(test, ctx.cost_model, (k, c), tables=tab)
            add(_exact(name, "fixed cap, fixed k", ev), name, family="fixed cap, fixed k", cap=cap_name(c),
                evaluation="exact", capped_share=ev.capped_share)  # fmt: skip
    for entry in entries:
        for c in range(C + 1 if entry.exact_k != 0 else 1):  # k = 0 is never capped: no capped copies
            name = entry.name if c == 0 else f"{entry.name} @ cap B={cap_name(c)}"
            family = "k-only" if c == 0 else "fixed cap + k-policy"
            if entry.exact_k is not None:
                etab = tab if entry.lookahead == 0 and entry.mode == "none" else None
                ev = evaluate_joint(
                    test, ctx.cost_model, (int(entry.exact_k), c), name, entry.lookahead, entry.mode, tables=etab
                )
                add(_exact(name, family, ev), name, family=family, cap=cap_name(c), evaluation="exact",
                    capped_share=ev.capped_share)  # fmt: skip
                continue
            try:
                from specenv.replay import replay_data

                data = replay_data(
                    ctx.dataset, ctx.kmax, "test", ctx.cost_model_arg, entry.lookahead, entry.mode, entry.signals
                )
                pol = FixedCap(entry.make(data.spec), c)
            except ValueError as exc:
                ctx.notes.append(f"skipped '{name}': {exc}")
                done += 1
                continue
            df, share = _rollouts(ctx, entry, pol, episodes, seed, name, family)
            add(df, name, family=family, cap=cap_name(c), evaluation="rollout", capped_share=share)
    trained: dict[str, Any] = {}
    for w in train_weights:
        r = train_joint_dagger(dataset, w, ctx.kmax, cost_model, seed=seed, **(train_kwargs or {}))
        name = f"{r.policy.name} (joint learned)"
        trained[name] = r.policy
        ctx.notes.append(f"'{name}' trained on the train split in {r.seconds:.1f} s")
        df, share = _rollouts(ctx, None, JointMLP(r.policy), episodes, seed, name, "joint learned")
        add(df, name, family="joint learned", cap="joint", evaluation="rollout", capped_share=share)
    for folder in joint_policies:
        try:
            stored = JointMLP.load(folder).spec
            h = stored.lookahead
            sig = stored.signals if h else ("q",)
            expect = dataclasses.replace(ctx.spec, lookahead=h, signals=sig, cap_levels=C)
            pol = JointMLP.load(folder, expect=expect)
        except ValueError as exc:
            raise ValueError(f"--joint-policy: {exc}") from None
        name = f"{pol.name} (joint, loaded)"
        df, share = _rollouts(ctx, None, pol, episodes, seed, name, "joint learned")
        add(df, name, family="joint learned", cap="joint", evaluation="rollout", capped_share=share)
    gen = pd.concat(parts, ignore_index=True)
    summary = _summarise(gen, meta, n_boot, seed)
    return CapBenchResult(
        summary=summary,
        frontier=pd.DataFrame(fr_rows),
        generations=gen,
        comparison=_compare(summary, max_mismatch),
        context={
            "dataset": str(dataset),
            "split": "test",
            "test_generations": int(test.n_generations),
            "test_tokens": int(test.lengths.sum()),
            "kmax": int(ctx.kmax),
            "caps": list(tab.levels),
            "cost_model": cost_model,
            "episodes": episodes,
            "seed": seed,
            "n_boot": n_boot,
            "unit_ms": tab.unit_ms,
        },
        joint_policies=trained,
        notes=list(ctx.notes),
    )


def _best(rows: pd.DataFrame) -> dict[str, Any] | None:
    if rows.empty:
        return None
    r = rows.loc[rows["speedup"].idxmax()]
    return {k: r[k] for k in ("policy", "speedup", "speedup_lo", "speedup_hi", "mismatch_rate", "lpgap")}


def _compare(s: pd.DataFrame, max_mismatch: float) -> dict[str, Any]:
    ok = s["mismatch_rate"] <= max_mismatch + 1e-12
    k_only = _best(s[(s["family"] == "k-only")])
    joint = _best(s[(s["family"] == "joint learned") & ok])
    capped = _best(s[s["family"].isin(["fixed cap, fixed k", "fixed cap + k-policy"]) & ok])
    oracle = _best(s[(s["family"] == "joint oracle") & ok])
    out: dict[str, Any] = {
        "max_mismatch_rate": max_mismatch,
        "best_k_only_controller": k_only,
        "best_joint_learned_within_constraint": joint,
        "best_fixed_cap_controller_within_constraint": capped,
        "joint_oracle_within_constraint": oracle,
        "k_only_oracle": _best(s[s["policy"] == K_ORACLE]),
    }
    if k_only and joint:
        out["joint_learned_gain_over_best_k_only"] = joint["speedup"] / k_only["speedup"] - 1
        out["goal_10pct_met"] = bool(out["joint_learned_gain_over_best_k_only"] >= 0.10)
    if k_only and oracle:
        out["joint_oracle_gain_over_best_k_only"] = oracle["speedup"] / k_only["speedup"] - 1
    return out


def _fmt_ci(r: Any) -> str:
    return f"{r['speedup']:.3f} [{r['speedup_lo']:.3f}, {r['speedup_hi']:.3f}]"


def markdown_table(res: CapBenchResult) -> str:
    """Every row: speedup [95% CI] beside mismatch rate and mean log-prob gap."""
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


def frontier_table(res: CapBenchResult) -> str:
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


#: Families of the frontier plot: marker, colour.
_STYLE = {
    "fixed cap, fixed k": ("s", "0.6"),
    "fixed cap + k-policy": ("^", "tab:blue"),
    "k-only": ("o", "tab:purple"),
    "joint learned": ("*", "tab:green"),
}


def plot_frontier(res: CapBenchResult, path: Path) -> Path:
    """Speedup against the mismatched-token rate: every row, the joint oracle's frontier as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specenv.io import atomic_file

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


def write_outputs(res: CapBenchResult, out: Path) -> list[Path]:
    """``bench_caps.json``, ``bench_caps.md``, ``generations_caps.csv``, ``frontier.png`` and the joint policies."""
    from specenv.io import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench_caps.json", out / "bench_caps.md", out / "generations_caps.csv", out / "frontier.png"]
    atomic_write_json(paths[0], res.to_json())
    atomic_write_text(paths[1], markdown_table(res) + "\n\n" + frontier_table(res) + "\n")
    atomic_write_text(paths[2], res.generations.to_csv(index=False))
    plot_frontier(res, paths[3])
    for pol in res.joint_policies.values():
        folder = out / pol.name
        pol.save(folder)
        paths.append(folder)
    return paths


def _clean(obj: Any) -> Any:
    """Plain-JSON values: numpy scalars to Python, non-finite floats to strings ("inf")."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.bool_ | bool):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating | float):
        x = float(obj)
        return x if math.isfinite(x) else str(x)
    return obj
