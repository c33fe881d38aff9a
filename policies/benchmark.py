"""The benchmark: every policy on the held-out split, side by side with the oracle bound.

For each policy, every test generation is replayed ``episodes`` times through the replay
environment (``specenv/MoESpec-v0``, seeds ``seed + r``); a generation's speedup is its AR cost over
the policy's mean episode cost. Reported per policy: mean speedup over generations with a 95%
t-interval, pooled speedup (sum AR / sum cost), % of the oracle bound (pooled speedup / pooled
S_max), mean k and mean accepted per round, and the pooled speedup per category. The bound is the
exact SSP oracle on the same generations (lookahead 0, the true optimum). Policies that need the
draft's confidences run in an environment with a lookahead h (``kmax`` for the confidence
thresholds, the training lookahead for learned policies), which charges drafting max(k, h) tokens
every round.

Everything that needs fitting uses the **train** split only: the best fixed k (exact evaluation),
the delta-space lambda (oracle boundary slope), the U(k) prior (train means) and the learned
policies (shipped, trained on the train split by ``specenv train``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from policies.delta import DeltaSpaceRule
from policies.heuristics import (
    CascadeUtility,
    ConfidenceThreshold,
    FixedK,
    GoodputRule,
    TransformersHeuristic,
    UCBBandit,
)
from specenv.costmodel import CostModel
from specenv.observation import ObservationSpec
from specenv.policy.base import Policy
from specenv.policy.mlp import MLPPolicy
from specenv.traceset import PositionArrays

LEARNED = ("ppo", "dqn", "imitation")
ORACLE_ROW = "oracle bound (SSP)"


@dataclass
class Entry:
    """A policy in the benchmark: how to build it and which environment it needs."""

    name: str
    make: Callable[[ObservationSpec], Policy]
    lookahead: int = 0
    note: str = ""


@dataclass
class Context:
    """What the policies are fitted with (train split only)."""

    dataset: str
    kmax: int
    cost_model: CostModel
    cost_model_arg: str
    train: PositionArrays
    test: PositionArrays
    best_fixed_k: int
    lam_ms: float
    lam_ms_h3: float
    u_prior: np.ndarray
    rho_prior: np.ndarray
    spec: ObservationSpec
    policy_dir: Path | None
    notes: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # policy folders not run, with the reason


def shipped_policy_dir() -> Path:
    """Folder of the policies shipped with the package (``policies/shipped``)."""
    trav = resources.files("policies").joinpath("shipped")
    return Path(str(trav))


def train_priors(train: PositionArrays) -> tuple[np.ndarray, np.ndarray]:
    """Priors the online rules start from, fitted on the train positions.

    Returns:
        ``u_prior`` (kmax+1,): mean unique experts U_{t,k} per budget; ``rho_prior`` (kmax,): mean
        conditional acceptance per depth over the states where that depth is reached (weights
        ``P(a >= j-1)`` from :meth:`~specenv.traceset.PositionArrays.survival`).
    """
    surv = train.survival()
    reach = np.concatenate([np.ones((len(surv), 1)), surv[:, :-1]], axis=1)
    rho_prior = (reach * train.rho).sum(axis=0) / np.maximum(reach.sum(axis=0), 1e-12)
    return train.U.mean(axis=0), rho_prior


def build_context(dataset: str, kmax: int | None, cost_model: str, policy_dir: Path | None) -> Context:
    """Fit everything policies need on the train split."""
    from oracle.delta import boundary_slope
    from oracle.dp import evaluate_policy
    from specenv.costsource import cost_model_for
    from specenv.datasets import load_dataset
    from specenv.replay import select_positions

    ts = load_dataset(dataset)
    train = select_positions(ts, kmax, "train")
    test = select_positions(ts, kmax, "test")
    kmax = train.kmax
    model = cost_model_for(ts, cost_model)
    speed = [evaluate_policy(train, model, k).speedup_pooled for k in range(kmax + 1)]
    best = int(np.argmax(speed))
    lam = boundary_slope(train, model)
    lam_h3 = boundary_slope(train, model, lookahead=min(3, kmax))
    u_prior, rho_prior = train_priors(train)
    spec = ObservationSpec(kmax, 0, int(ts.manifest.max_new_tokens), int(ts.facts.n_experts))
    return Context(
        dataset, kmax, model, cost_model, train, test, best, lam, lam_h3, u_prior, rho_prior, spec, policy_dir
    )


def default_entries(ctx: Context) -> list[Entry]:
    """Every policy of the benchmark, in display order."""
    m, up, rp = ctx.cost_model, ctx.u_prior, ctx.rho_prior
    entries = [
        Entry("autoregressive (k=0)", lambda s: FixedK(s, 0)),
        Entry("fixed k=1", lambda s: FixedK(s, 1)),
        Entry(f"fixed k={min(4, ctx.kmax)}", lambda s: FixedK(s, min(4, ctx.kmax))),
        Entry(f"fixed k={ctx.kmax}", lambda s: FixedK(s, ctx.kmax)),
        Entry(f"best fixed k={ctx.best_fixed_k} (train)", lambda s: FixedK(s, ctx.best_fixed_k)),
        Entry("transformers heuristic", lambda s: TransformersHeuristic(s)),
        Entry("confidence 0.4", lambda s: ConfidenceThreshold(s, 0.4), lookahead=ctx.kmax),
        Entry("confidence ROC", lambda s: ConfidenceThreshold(s, 0.4, adaptive=True), lookahead=ctx.kmax),
        Entry("goodput (SmartSpec)", lambda s: GoodputRule(s, m, up)),
        Entry("cascade utility", lambda s: CascadeUtility(s)),
        Entry("UCB bandit", lambda s: UCBBandit(s)),
        Entry(
            "delta-space (oracle lambda)", lambda s: DeltaSpaceRule(s, m, lam_ms=ctx.lam_ms, u_prior=up, rho_prior=rp)
        ),
        Entry("delta-space (adaptive lambda)", lambda s: DeltaSpaceRule(s, m, adaptive=True, u_prior=up, rho_prior=rp)),
        Entry(
            f"delta-space + confidences (h={min(3, ctx.kmax)})",
            lambda s: DeltaSpaceRule(s, m, lam_ms=ctx.lam_ms_h3, u_prior=up, rho_prior=rp),
            lookahead=min(3, ctx.kmax),
        ),
    ]
    if ctx.policy_dir is not None and ctx.policy_dir.is_dir():
        found = sorted(p.parent for p in ctx.policy_dir.glob("*/policy.json"))
        for name in LEARNED:
            if not any(f.name == name or f.name.startswith(name + "-") for f in found):
                ctx.notes.append(f"no trained '{name}' policy in {ctx.policy_dir} (run `specenv train --algo {name}`)")
        for folder in found:
            try:  # the benchmark's contract, with the lookahead the policy reads
                lookahead = MLPPolicy.load(folder).spec.lookahead
                pol = MLPPolicy.load(folder, expect=replace(ctx.spec, lookahead=lookahead))
            except ValueError as exc:  # listed with the reason, never dropped silently
                ctx.skipped.append({"policy": folder.name, "folder": str(folder), "reason": str(exc)})
                ctx.notes.append(f"skipped '{folder.name}' in {ctx.policy_dir}: {exc}")
                continue
            entries.append(Entry(f"{folder.name} (learned)", _learned(pol), lookahead=pol.spec.lookahead))
    return entries


def _learned(pol: MLPPolicy) -> Callable[[ObservationSpec], Policy]:
    def make(spec: ObservationSpec) -> Policy:
        bad = pol.spec.mismatch(spec)
        if bad is not None:
            raise ValueError(f"policy '{pol.name}': observation contract differs: {bad} (policy != environment)")
        return pol

    return make


def run_policy(entry: Entry, ctx: Context, episodes: int, seed: int) -> tuple[pd.DataFrame, Policy]:
    """Replay every test generation ``episodes`` times with one policy; one row per episode.

    Episode r of a generation is reset with seed ``seed + r``; the episodes are played by
    :func:`specenv.rollout.rollout`.
    """
    import gymnasium as gym

    from specenv.envs.replay import ENV_ID
    from specenv.rollout import rollout

    env = gym.make(
        ENV_ID,
        dataset=ctx.dataset,
        kmax=ctx.kmax,
        split="test",
        cost_model=ctx.cost_model_arg,
        lookahead=entry.lookahead,
    )
    try:
        policy = entry.make(env.unwrapped.data.spec)
        gids = np.asarray(env.unwrapped.data.generation_ids, dtype=np.int64)
        ep_gid = np.repeat(gids, episodes)
        ep_r = np.tile(np.arange(episodes, dtype=np.int64), len(gids))
        res = rollout(env, policy, list(zip(ep_gid.tolist(), (seed + ep_r).tolist(), strict=True)))
    finally:
        env.close()
    df = pd.DataFrame(
        {
            "policy": entry.name,
            "generation_id": ep_gid,
            "category": res.categories,
            "episode": ep_r,
            "cost_ms": res.cost,
            "ar_ms": res.ar,
            "rounds": res.rounds,
            "k_sum": res.k_sum,
            "accepted_sum": res.accepted_sum,
        }
    )
    return df, policy


def _t95(n: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.975, max(n - 1, 1)))


def summarise(episodes: pd.DataFrame, oracle: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-policy summary and per-policy-per-category pooled speedups."""
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
        )
        .reset_index()
    )
    g = g.merge(oracle[["generation_id", "v0_ms"]], on="generation_id")
    g["speedup"] = g["ar_ms"] / g["cost_ms"]
    se = (g["cost_sd"].fillna(0.0) / np.sqrt(g["n"])).to_numpy()
    # a policy "beats the bound" only if its mean cost is below V(0) by more than 4 MC standard errors
    g["beats_bound"] = g["cost_ms"] < g["v0_ms"] - 4.0 * se - 1e-9 * g["v0_ms"]
    s_max = float(oracle["ar_ms"].sum() / oracle["v0_ms"].sum())
    rows = []
    for name, d in g.groupby("policy", sort=False):
        sp = d["speedup"].to_numpy()
        half = _t95(len(sp)) * sp.std(ddof=1) / math.sqrt(len(sp)) if len(sp) > 1 else float("nan")
        pooled = float(d["ar_ms"].sum() / d["cost_ms"].sum())
        rows.append(
            {
                "policy": name,
                "speedup_mean": float(sp.mean()),
                "ci95_low": float(sp.mean() - half),
                "ci95_high": float(sp.mean() + half),
                "speedup_pooled": pooled,
                "oracle_pct": 100.0 * pooled / s_max,
                "mean_k": float(d["k_sum"].sum() / d["rounds"].sum()),
                "mean_accepted": float(d["accepted_sum"].sum() / d["rounds"].sum()),
                "generations": int(len(d)),
                "beats_bound": int(d["beats_bound"].sum()),
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


@dataclass
class BenchResult:
    """Tables of one benchmark run."""

    summary: pd.DataFrame
    categories: pd.DataFrame
    episodes: pd.DataFrame
    oracle: dict[str, Any]
    context: dict[str, Any]
    notes: list[str]
    skipped: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (strict JSON: the exact oracle row has no confidence interval, ``null``)."""
        policies = [
            {k: (None if k.startswith("ci95_") and isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in self.summary.to_dict(orient="records")
        ]
        return {
            "context": self.context,
            "oracle": self.oracle,
            "policies": policies,
            "categories": self.categories.pivot(index="policy", columns="category", values="speedup_pooled")
            .reset_index()
            .to_dict(orient="records"),
            "notes": self.notes,
            "skipped": self.skipped,
        }


def run_benchmark(
    dataset: str = "paper-default",
    kmax: int | None = None,
    cost_model: str = "fit",
    episodes: int = 4,
    seed: int = 0,
    policy_dir: Path | None = None,
    only: list[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Run the benchmark on the test split of ``dataset``.

    Args:
        dataset: Registry name or trace-set folder.
        kmax: Largest budget (default: the trace set's Kmax).
        cost_model: ``"fit"``, ``"profile"`` or a JSON path.
        episodes: Monte-Carlo episodes per test generation and policy.
        seed: Base seed (episode r uses ``seed + r``).
        policy_dir: Folder with trained policies (``ppo/``, ``dqn/``, ``imitation/``); default the shipped ones.
        only: Run only policies whose name contains one of these strings (the oracle always runs).
        progress: Called with the name of each policy as it starts.
    """
    from oracle.dp import solve

    if episodes < 1:
        raise ValueError(f"episodes={episodes}: must be >= 1")
    ctx = build_context(dataset, kmax, cost_model, policy_dir if policy_dir is not None else shipped_policy_dir())
    sol = solve(ctx.test, ctx.cost_model)
    oracle_df = pd.DataFrame(
        {"generation_id": ctx.test.generation_ids, "category": ctx.test.categories, "v0_ms": sol.cost, "ar_ms": sol.ar}
    )
    frames = []
    for entry in default_entries(ctx):
        if only and not any(o in entry.name for o in only):
            continue
        if progress:
            progress(entry.name)
        df, _ = run_policy(entry, ctx, episodes, seed)
        frames.append(df)
    if not frames:
        raise ValueError(f"only={only}: no policy matches")
    episodes_df = pd.concat(frames, ignore_index=True)
    summary, cats = summarise(episodes_df, oracle_df)
    oracle_row = {
        "policy": ORACLE_ROW,
        "speedup_mean": float(sol.speedup.mean()),
        "ci95_low": float("nan"),
        "ci95_high": float("nan"),
        "speedup_pooled": sol.speedup_pooled,
        "oracle_pct": 100.0,
        "mean_k": sol.mean_k,
        "mean_accepted": sol.mean_accepted,
        "generations": int(len(sol.cost)),
        "beats_bound": 0,
    }
    summary = pd.concat([summary, pd.DataFrame([oracle_row])], ignore_index=True)
    ocat = (
        oracle_df.groupby("category")
        .apply(lambda d: d["ar_ms"].sum() / d["v0_ms"].sum(), include_groups=False)
        .rename("speedup_pooled")
        .reset_index()
    )
    ocat.insert(0, "policy", ORACLE_ROW)
    cats = pd.concat([cats, ocat], ignore_index=True)
    context = {
        "dataset": dataset,
        "kmax": ctx.kmax,
        "cost_model": cost_model,
        "episodes": episodes,
        "seed": seed,
        "test_generations": int(ctx.test.n_generations),
        "train_generations": int(ctx.train.n_generations),
        "best_fixed_k_train": ctx.best_fixed_k,
        "delta_lambda_ms": ctx.lam_ms,
        "delta_lambda_ms_h3": ctx.lam_ms_h3,
        "ar_cost_model_extrapolated": bool(ctx.cost_model.ar_extrapolated),
    }
    return BenchResult(summary, cats, episodes_df, sol.summary(), context, ctx.notes, ctx.skipped)


def markdown_table(res: BenchResult) -> str:
    """The summary as a Markdown table."""
    lines = [
        "| policy | speedup (mean, 95% CI) | pooled | % of oracle | mean k | mean accepted |",
        "|---|---|---|---|---|---|",
    ]
    for r in res.summary.itertuples():
        ci = "" if math.isnan(r.ci95_low) else f" [{r.ci95_low:.3f}, {r.ci95_high:.3f}]"
        lines.append(
            f"| {r.policy} | {r.speedup_mean:.3f}{ci} | {r.speedup_pooled:.3f} | {r.oracle_pct:.1f}% | "
            f"{r.mean_k:.2f} | {r.mean_accepted:.2f} |"
        )
    for sk in res.skipped:
        lines.append(f"| {sk['policy']} (not run: {sk['reason'].replace('|', '/')}) | | | | | |")
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


def write_outputs(res: BenchResult, out: Path) -> list[Path]:
    """CSV, JSON, Markdown and a matplotlib figure into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = [
        out / "summary.csv",
        out / "categories.csv",
        out / "episodes.csv",
        out / "bench.json",
        out / "bench.md",
        out / "speedup.png",
    ]
    res.summary.to_csv(paths[0], index=False)
    res.categories.to_csv(paths[1], index=False)
    res.episodes.to_csv(paths[2], index=False)
    paths[3].write_text(json.dumps(res.to_json(), indent=2, default=float) + "\n")
    paths[4].write_text(markdown_table(res) + "\n\n" + category_table(res) + "\n")
    s = res.summary
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(s) + 1.5))
    y = np.arange(len(s))[::-1]
    err = np.vstack([s["speedup_mean"] - s["ci95_low"], s["ci95_high"] - s["speedup_mean"]]).clip(min=0)
    err = np.nan_to_num(err)
    colors = [
        "tab:red"
        if p == ORACLE_ROW
        else ("tab:green" if "learned" in p else ("tab:purple" if "delta" in p else "tab:blue"))
        for p in s["policy"]
    ]
    ax.barh(y, s["speedup_mean"], xerr=err, color=colors, alpha=0.8)
    ax.set_yticks(y, s["policy"])
    ax.axvline(1.0, color="k", lw=0.8)
    bound = float(s.loc[s["policy"] == ORACLE_ROW, "speedup_mean"].iloc[0])
    ax.axvline(bound, color="tab:red", ls="--", lw=1)
    ax.set_xlabel("speedup over autoregressive decoding (mean over held-out generations, 95% CI)")
    ax.set_title(f"{res.context['dataset']}: policies vs the SSP oracle bound (Kmax={res.context['kmax']})")
    fig.tight_layout()
    fig.savefig(paths[5], dpi=120)
    plt.close(fig)
    return paths
