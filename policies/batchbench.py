"""The batch benchmark (``specenv bench --batch B``): batch controllers beside the batch bound.

Every row runs the same held-out episodes of ``specenv/MoESpecBatch-v0`` (test split, episode e
reset with ``seed + e``, so every row serves the same requests with the same acceptance draws), in
the drafting mode it really uses (:attr:`policies.batch.BatchPolicy.drafting`: ``none`` when k is
chosen before drafting and each request drafts its k; ``block`` with h = kmax when the rule reads
the confidences of drafts already proposed, which vLLM's drafter produces for the whole batch). The
speedup of a row is pooled over the episodes (sum AR / sum cost, AR = the same requests decoded
without speculation under the same schedule) with a percentile bootstrap 95% interval over episodes
(:func:`specenv.stats.bootstrap_ratio_ci`, the same resamples for every row). The bound
(:mod:`oracle.batch`) is computed for the same episodes: its expected form bounds the pooled
speedup, its pathwise form every episode of every row (checked: ``bound_violations`` counts the
episodes where a row beat it, which must stay 0).

Fitted quantities come from the train split only: the single-request cost model (``fit-train``),
the U and acceptance priors, the delta rule's lambda (:func:`policies.benchmark.build_context`), the
dynamic-SD table (best fixed k per batch size on train episodes) and the learners.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from oracle.batch import batch_bound
from policies.batch import (
    AdaptiveVerificationBatch,
    BatchPolicy,
    DSDBatch,
    FixedBatch,
    GoodputBatch,
    PerRequest,
    StepPolicy,
    TetrisBatch,
    fit_dsd_table,
)
from policies.batch_goodput import BatchGoodput
from policies.delta import DeltaSpaceRule
from specenv.envs.batch import MoESpecBatchEnv
from specenv.io import atomic_write_json, atomic_write_text
from specenv.stats import bootstrap_indices, bootstrap_ratio_ci

__all__ = ["BatchBenchResult", "batch_markdown", "run_batch_benchmark", "write_batch_outputs"]

#: Rows that are vLLM's own batch rules; the last two are fitted on train (the reference of the learners' gain).
VLLM_RULES = ("fixed", "vllm-dsd-table", "vllm-adaptive-verification")


@dataclass
class BatchBenchResult:
    """Rows of one batch benchmark run (``rows``: one dict per policy, then the bound)."""

    rows: list[dict[str, Any]]
    bound: dict[str, Any]
    context: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain strict JSON (NaN written as null)."""

        def clean(v: Any) -> Any:
            if isinstance(v, float) and math.isnan(v):
                return None
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v

        return clean({"context": self.context, "bound": self.bound, "policies": self.rows, "notes": self.notes})


def _episodes(env: MoESpecBatchEnv, policy: BatchPolicy, seeds: list[int]) -> dict[str, np.ndarray]:
    """Run ``policy`` on the episodes reset with ``seeds``; per-episode cost, AR, steps and request seeds."""
    cost, ar, steps, req = [], [], [], []
    for s in seeds:
        obs, _ = env.reset(seed=s)
        policy.reset()
        done = False
        while not done:
            obs, _, done, _, info = env.step(policy.act(obs))
        cost.append(info["episode_cost_ms"])
        ar.append(info["ar_cost_ms"])
        steps.append(info["steps"])
        req.append(info["seeds"])
    return {"cost": np.array(cost), "ar": np.array(ar), "steps": np.array(steps), "seeds": np.array(req)}


def run_batch_benchmark(
    dataset: str = "paper-default",
    batch_size: int = 4,
    n_requests: int | None = None,
    episodes: int = 8,
    seed: int = 0,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    batch_cost: str = "auto",
    learners: bool = True,
    ppo_timesteps: int = 50_000,
    progress: Callable[[int, int, str], None] | None = None,
) -> BatchBenchResult:
    """Run every batch controller on ``episodes`` held-out episodes beside the bound (module docstring).

    Args:
        dataset: Registry name or folder.
        batch_size: B.
        n_requests: R per episode (default 4 B).
        episodes: Held-out episodes.
        seed: Episode e is reset with ``seed + e``; also the seed of the learners and the bootstrap.
        kmax: Largest budget.
        cost_model: Single-request cost model (default fitted on the train split's rounds).
        batch_cost: Batch cost model (``"auto"``, ``"scaled"``, a JSON path).
        learners: Train and run the learned controllers (imitation of the bound, PPO).
        ppo_timesteps: PPO's training budget.
        progress: Called with ``(done, total, row name)``.

    Returns:
        The :class:`BatchBenchResult`.

    Raises:
        ValueError: One line naming a bad argument.
    """
    from policies.benchmark import build_context

    t0 = time.perf_counter()
    ctx = build_context(dataset, kmax, cost_model, None)
    K = ctx.kmax
    common = dict(dataset=dataset, batch_size=batch_size, n_requests=n_requests, kmax=K, cost_model=cost_model)
    common["batch_cost"] = batch_cost

    def env_for(drafting: str, split: str = "test", B: int | None = None, h: int | None = None) -> MoESpecBatchEnv:
        kw = dict(common, split=split, drafting=drafting, lookahead=h)
        if B is not None:
            kw["batch_size"] = B
            kw["n_requests"] = 4 * B if n_requests is None else max(B, n_requests * B // batch_size)
        return MoESpecBatchEnv(**kw)  # type: ignore[arg-type]

    env_none = env_for("none")
    bcm = env_none.batch_cost
    spec_none = env_none.spec_batch
    rng = np.random.default_rng(seed)
    train_seeds = [int(s) for s in rng.integers(0, 2**31, size=3)]

    # the dynamic-SD table: best fixed k per batch size on train episodes
    def dsd_score(n: int, k: int) -> float:
        env = env_for("none", "train", n)
        res = _episodes(env, FixedBatch(env.spec_batch, k), train_seeds)
        return float(res["ar"].sum() / res["cost"].sum())

    schedule = fit_dsd_table(dsd_score, batch_size, K)
    best_fixed = schedule[-1][2]
    up, rp = ctx.u_prior, ctx.rho_prior
    # the block rules: vLLM drafts num_speculative_tokens = h for the whole batch; h is tuned on train
    grid = sorted({h for h in (1, 2, 3, 4, 6, K) if 1 <= h <= K})
    block_envs: dict[int, MoESpecBatchEnv] = {}

    def tuned(make: Callable[[Any], BatchPolicy]) -> tuple[BatchPolicy, int]:
        scores = []
        for h in grid:
            env = env_for("block", "train", h=h)
            res = _episodes(env, make(env.spec_batch), train_seeds)
            scores.append(float(res["ar"].sum() / res["cost"].sum()))
        h = grid[int(np.argmax(scores))]
        block_envs.setdefault(h, env_for("block", h=h))
        pol = make(block_envs[h].spec_batch)
        pol.name += f" (h={h})"
        return pol, h

    av, h_av = tuned(lambda sp: AdaptiveVerificationBatch(sp, bcm, up))
    tetris, h_tetris = tuned(lambda sp: TetrisBatch(sp, bcm, up))
    rows: list[tuple[BatchPolicy, str]] = [
        (FixedBatch(spec_none, 0), "none"),
        (FixedBatch(spec_none, 1), "none"),
        (FixedBatch(spec_none, min(4, K)), "none"),
        (FixedBatch(spec_none, K), "none"),
        (DSDBatch(spec_none, schedule), "none"),
        (av, "block"),
        (tetris, "block"),
        (GoodputBatch(spec_none, bcm, up, rp), "none"),
        (
            PerRequest(
                spec_none,
                DeltaSpaceRule(spec_none.request, ctx.cost_model, lam_ms=ctx.lam_ms, u_prior=up, rho_prior=rp),
                name="delta-space per request (oracle lambda)",
            ),
            "none",
        ),
        (
            StepPolicy(
                spec_none,
                BatchGoodput(spec_none.request, bcm, u_prior=up),
                name="batch-goodput (joint k, expert-aware)",
            ),
            "none",
        ),
    ]
    notes = [
        f"dynamic-SD table fitted on {len(train_seeds)} train episodes per batch size: "
        + ";".join(f"{lo}-{hi}:{k}" for lo, hi, k in schedule),
        f"batch cost model: {bcm.source.get('kind', '?')} ({batch_cost})",
        f"block rules draft h tokens for every request (vLLM's num_speculative_tokens), h tuned on train over {grid}: "
        f"adaptive verification h={h_av}, tetris h={h_tetris}",
    ]
    if learners:
        from policies.batchlearn import train_batch_imitation, train_batch_ppo

        for label, expert, reference in (
            ("imitation of the bound (learned)", "bound", "oracle"),
            ("imitation, fair-share policy iteration (learned)", "fair", "learner"),
        ):
            t = time.perf_counter()
            imit = train_batch_imitation(
                dataset,
                batch_size,
                n_requests,
                K,
                cost_model,
                batch_cost,
                seed=seed,
                iterations=5,
                episodes=4,
                expert=expert,
                reference=reference,
            )
            rows.append((PerRequest(spec_none, imit.policy, name=label), "none"))
            notes.append(f"{label}: expert {expert}, reference {reference}, trained in {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        ppo = train_batch_ppo(dataset, batch_size, n_requests, K, cost_model, batch_cost, ppo_timesteps, seed)
        ppo.name = "ppo MultiDiscrete (learned)"
        rows.append((ppo, "none"))
        notes.append(f"ppo trained in {time.perf_counter() - t:.0f} s, {ppo_timesteps} steps (train split)")
    seeds = [seed + e for e in range(episodes)]
    idx = bootstrap_indices(episodes, 2000, seed)
    out: list[dict[str, Any]] = []
    runs: list[dict[str, np.ndarray]] = []
    total = len(rows)
    for i, (pol, mode) in enumerate(rows):
        if progress is not None:
            progress(i, total, pol.name)
        env = block_envs[pol.spec.request.lookahead] if mode == "block" else env_none
        res = _episodes(env, pol, seeds)
        runs.append(res)
        ci = bootstrap_ratio_ci(res["ar"], res["cost"], indices=idx)["pooled"]
        out.append(
            {
                "policy": pol.name,
                "drafting": mode,
                "speedup_pooled": ci["value"],
                "ci95_low": ci["low"],
                "ci95_high": ci["high"],
                "mean_steps": float(res["steps"].mean()),
                "learned": "(learned)" in pol.name,
                "vllm_rule": pol.name.startswith(VLLM_RULES),
            }
        )
    if progress is not None:
        progress(total, total, "bound")
    arrays = ctx.test
    request_seeds = runs[0]["seeds"]
    for r in runs[1:]:
        if not np.array_equal(r["seeds"], request_seeds):  # pragma: no cover - common random numbers
            raise RuntimeError("batch bench: rows served different requests")
    bb = batch_bound(arrays, env_none.data.L0, bcm, batch_size, request_seeds, pathwise=True)
    path_speedup = bb.speedup_pathwise
    for row, res in zip(out, runs, strict=True):
        row["bound_violations"] = int(np.sum(res["ar"] / res["cost"] > path_speedup * (1 + 1e-9)))
    # vLLM's own rules as a user would configure them from the train split (the DSD table and adaptive
    # verification's h are fitted there); the fixed-k rows picked on the test episodes are hindsight
    fitted = [r for r in out if r["policy"].startswith(VLLM_RULES[1:])]
    best_vllm = max(fitted, key=lambda r: r["speedup_pooled"])
    hindsight = max((r for r in out if r["vllm_rule"]), key=lambda r: r["speedup_pooled"])
    for r in out:
        r["vs_best_vllm"] = r["speedup_pooled"] / best_vllm["speedup_pooled"] - 1.0
        r["vs_best_vllm_hindsight"] = r["speedup_pooled"] / hindsight["speedup_pooled"] - 1.0
    notes.append(
        f"vs best vLLM rule: against {best_vllm['policy']} (the best of vLLM's rules fitted on train); the best "
        f"vLLM row in hindsight on these test episodes is {hindsight['policy']} ({hindsight['speedup_pooled']:.3f})"
    )
    bound = bb.summary() | {
        "split": list(bb.split) if bb.split is not None else "min rule",
        "ci95_expected": bootstrap_ratio_ci(bb.ar, bb.expected, indices=idx)["pooled"],
    }
    context = {
        "dataset": str(dataset),
        "batch_size": int(batch_size),
        "n_requests": int(env_none.R),
        "episodes": int(episodes),
        "seed": int(seed),
        "kmax": int(K),
        "cost_model": cost_model,
        "batch_cost": str(batch_cost),
        "batch_cost_kind": bcm.source.get("kind"),
        "test_generations": int(arrays.n_generations),
        "best_vllm_rule": best_vllm["policy"],
        "best_vllm_rule_hindsight": hindsight["policy"],
        "dsd_schedule": [list(e) for e in schedule],
        "best_fixed_k_full_batch": int(best_fixed),
        "seconds": time.perf_counter() - t0,
    }
    return BatchBenchResult(out, bound, context, notes)


def batch_markdown(res: BatchBenchResult) -> str:
    """The table: one row per policy, then the bound."""
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
    return "\n".join(lines)


def write_batch_outputs(res: BatchBenchResult, out: Path) -> list[Path]:
    """Write ``bench-batch<B>.json`` and ``bench-batch<B>.md`` into ``out`` (atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    B = res.context["batch_size"]
    paths = [out / f"bench-batch{B}.json", out / f"bench-batch{B}.md"]
    atomic_write_json(paths[0], res.to_json())
    atomic_write_text(paths[1], batch_markdown(res) + "\n")
    return paths
