"""The batch benchmark (``specenv bench --batch B``): batch controllers beside the batch bound.

Every row runs the same held-out episodes of ``specenv/MoESpecBatch-v0`` (test split, episode e
reset with ``seed + e``, so every row serves the same requests with the same acceptance draws), in
the drafting mode it really uses (:attr:`policies.batch.controllers.BatchPolicy.drafting`: ``none`` when k is
chosen before drafting and each request drafts its k; ``block`` with h = kmax when the rule reads
the confidences of drafts already proposed, which vLLM's drafter produces for the whole batch). The
speedup of a row is pooled over the episodes (sum AR / sum cost, AR = the same requests decoded
without speculation under the same schedule) with a percentile bootstrap 95% interval over episodes
(:func:`specenv.stats.bootstrap_ratio_ci`, the same resamples for every row). The bound
(:mod:`oracle.batch`) is computed for the same episodes: its expected form bounds the pooled
speedup, its pathwise form every episode of every row (checked: ``bound_violations`` counts the
episodes where a row beat it, which must stay 0).

Fitted quantities come from the train split only: the single-request cost model (``fit-train``),
the U and acceptance priors, the delta rule's lambda (:func:`policies.bench.context.build_context`), the
dynamic-SD table (best fixed k per batch size on train episodes) and the learners.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from oracle.batch import batch_bound, check_enumerable
from policies.batch.controllers import (
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
from policies.batch.goodput import BatchGoodput
from policies.bench.context import Context, build_context
from policies.bench.result import BenchResult
from policies.bench.runner import Progress, run_family
from policies.bench.stats import pooled_ci
from policies.delta import DeltaSpaceRule
from specenv.envs.batch import MoESpecBatchEnv
from specenv.replay.batch import FixedBudgetEpisodes
from specenv.stats import bootstrap_indices

__all__ = ["LEARNERS", "VLLM_RULES", "BatchFamily", "check_enumerable", "run_batch_benchmark"]

#: Rows that are vLLM's own batch rules; the last two are fitted on train (the reference of the learners' gain).
VLLM_RULES = ("fixed", "vllm-dsd-table", "vllm-adaptive-verification")
#: The learned batch controllers ``learners=True`` trains (:mod:`policies.batch.learn`).
LEARNERS = ("imitation", "ppo", "survival")

#: A row of the batch roster: the controller and the drafting mode it runs in.
BatchRow = tuple[BatchPolicy, str]


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


@dataclass
class BatchFamily:
    """The batch family: the batch controllers (fitted and trained on train), ``MoESpecBatch-v0``, the batch bound.

    The environment factory is :meth:`env_for` (the test split's env of a drafting mode, or a train
    env of another batch size or lookahead for the fits); every row plays the same held-out episodes
    (episode e reset with ``seed + e``).
    """

    ctx: Context
    batch_size: int
    n_requests: int | None
    episodes: int
    seed: int
    batch_cost: str
    learners: bool
    ppo_timesteps: int
    learner_rows: tuple[str, ...]
    t0: float
    closing: str | None = "bound"
    notes: list[str] = field(default_factory=list)
    block_envs: dict[int, MoESpecBatchEnv] = field(default_factory=dict)
    #: ``fit_progress(done, total, what)`` as each fit on train ends: ``what`` is ``DSD table n=N`` or ``block
    #: rule h=H``, each part counted from 0 to its own total.
    fit_progress: Progress | None = None
    #: ``bound_progress(done, total, what)`` as each Lagrangian split and each request's pathwise bound ends
    #: (:func:`oracle.batch.batch_bound`).
    bound_progress: Progress | None = None

    def __post_init__(self) -> None:
        self.env_none = self.env_for("none")
        self.bcm = self.env_none.batch_cost

    def env_for(
        self, drafting: str, split: str = "test", B: int | None = None, h: int | None = None
    ) -> MoESpecBatchEnv:
        """The batch env of the run's set, in ``drafting`` mode (``B`` requests at once, ``h`` drafted lookahead)."""
        kw: dict[str, Any] = dict(
            dataset=self.ctx.source,
            batch_size=self.batch_size,
            n_requests=self.n_requests,
            kmax=self.ctx.kmax,
            cost_model=self.ctx.cost_model_arg,
            batch_cost=self.batch_cost,
            split=split,
            drafting=drafting,
            lookahead=h,
        )
        if B is not None:
            kw["batch_size"] = B
            kw["n_requests"] = 4 * B if self.n_requests is None else max(B, self.n_requests * B // self.batch_size)
        return MoESpecBatchEnv(**kw)

    def roster(self) -> list[BatchRow]:
        """The rows: vLLM's rules (DSD table and block rules' h fitted on train), the heuristics, the learners."""
        ctx, K, bcm, spec_none = self.ctx, self.ctx.kmax, self.bcm, self.env_none.spec_batch
        rng = np.random.default_rng(self.seed)
        train_seeds = [int(s) for s in rng.integers(0, 2**31, size=3)]

        # the block rules: vLLM drafts num_speculative_tokens = h for the whole batch; h is tuned on train
        grid = sorted({h for h in (1, 2, 3, 4, 6, K) if 1 <= h <= K})
        # done, total of the fits on train below, by part (each its own count and ETA: their items differ)
        fits = {"DSD table": [0, self.batch_size * (K + 1)], "block rule": [0, 2 * len(grid)]}

        def fitted(what: str) -> None:
            count = fits[what.split(" ")[0] + " " + what.split(" ")[1]]
            count[0] += 1
            if self.fit_progress is not None:
                self.fit_progress(count[0], count[1], what)

        # the dynamic-SD table: best fixed k per batch size on train episodes, the episodes of every fixed k
        # computed without stepping (FixedBudgetEpisodes: the environment's figures, B (K+1) episodes each)
        dsd_score = self._dsd_scores(train_seeds, fitted)
        self.schedule = fit_dsd_table(dsd_score, self.batch_size, K)
        up, rp = ctx.u_prior, ctx.rho_prior

        def tuned(make: Callable[[Any], BatchPolicy]) -> tuple[BatchPolicy, int]:
            scores = []
            for h in grid:
                env = self.env_for("block", "train", h=h)
                res = _episodes(env, make(env.spec_batch), train_seeds)
                scores.append(float(res["ar"].sum() / res["cost"].sum()))
                fitted(f"block rule h={h}")
            h = grid[int(np.argmax(scores))]
            self.block_envs.setdefault(h, self.env_for("block", h=h))
            pol = make(self.block_envs[h].spec_batch)
            pol.name += f" (h={h})"
            return pol, h

        av, h_av = tuned(lambda sp: AdaptiveVerificationBatch(sp, bcm, up))
        tetris, h_tetris = tuned(lambda sp: TetrisBatch(sp, bcm, up))
        rows: list[BatchRow] = [
            (FixedBatch(spec_none, 0), "none"),
            (FixedBatch(spec_none, 1), "none"),
            (FixedBatch(spec_none, min(4, K)), "none"),
            (FixedBatch(spec_none, K), "none"),
            (DSDBatch(spec_none, self.schedule), "none"),
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
        self.notes += [
            f"dynamic-SD table fitted on {len(train_seeds)} train episodes per batch size: "
            + ";".join(f"{lo}-{hi}:{k}" for lo, hi, k in self.schedule),
            f"batch cost model: {bcm.source.get('kind', '?')} ({self.batch_cost})",
            f"block rules draft h tokens for every request (vLLM's num_speculative_tokens), h tuned on train over "
            f"{grid}: adaptive verification h={h_av}, tetris h={h_tetris}",
        ]
        unknown = set(self.learner_rows) - set(LEARNERS)
        if unknown:
            raise ValueError(f"learner_rows: unknown {sorted(unknown)} (expected some of {LEARNERS})")
        if self.learners:
            rows += self._learned_rows(spec_none, h_tetris)
        return rows

    def _dsd_scores(self, train_seeds: list[int], fitted: Callable[[str], None]) -> Callable[[int, int], float]:
        """``score(n, k)`` of :func:`fit_dsd_table`: pooled train speedup of fixed k at batch size n.

        The episodes are the train environment's of batch size n (reset with ``train_seeds``), as
        stepping it with :class:`FixedBatch` gives them (:class:`FixedBudgetEpisodes`).
        """
        K = self.ctx.kmax
        setting: dict[int, tuple[Any, int, str | None, list[list[int]]]] = {}
        fixed: FixedBudgetEpisodes | None = None
        for n in range(1, self.batch_size + 1):
            env = self.env_for("none", "train", n)
            seeds = [env.reset(seed=s)[1]["seeds"] for s in train_seeds]
            setting[n] = (env.batch_cost, env.lookahead, env.drafting, seeds)
            fixed = fixed or FixedBudgetEpisodes(env.data)
        assert fixed is not None
        every = [s for *_, seeds in setting.values() for episode in seeds for s in episode]
        for k in range(K + 1):  # the requests' rounds at k, all at once
            fixed.prepare(every, k)
        ar: dict[int, np.ndarray] = {}  # the AR reference of the episodes of batch size n (any k)

        def score(n: int, k: int) -> float:
            model, h, mode, seeds = setting[n]
            cost = np.array([fixed.episode(model, n, sd, k, h, mode)[0] for sd in seeds])
            if n not in ar:
                ar[n] = np.array([fixed.ar_ms(model, n, sd) for sd in seeds])
            fitted(f"DSD table n={n}")
            return float(ar[n].sum() / cost.sum())

        return score

    def _learned_rows(self, spec_none: Any, h_tetris: int) -> list[BatchRow]:
        """The learned batch controllers of ``learner_rows``, trained on the train split."""
        src, K, cm, bc = self.ctx.source, self.ctx.kmax, self.ctx.cost_model_arg, self.batch_cost
        B, R, seed = self.batch_size, self.n_requests, self.seed
        rows: list[BatchRow] = []
        if "survival" in self.learner_rows:
            from policies.batch.learn import train_batch_survival

            # mode none, and mode block with the h tuned on train for the TETRIS rule (no search of its own)
            for h in (0, h_tetris):
                t = time.perf_counter()
                surv = train_batch_survival(src, B, R, K, cm, bc, seed=seed, lookahead=h)
                surv.policy.name += " (learned)"
                rows.append((surv.policy, surv.policy.drafting))
                self.notes.append(
                    f"{surv.policy.name}: survival MLP fitted on {surv.history[-1]['states']} train states "
                    f"({len(surv.history)} DAgger rounds), trained in {time.perf_counter() - t:.0f} s"
                )
        if "imitation" in self.learner_rows:
            from policies.batch.learn import train_batch_imitation

            for label, expert, reference in (
                ("imitation of the bound (learned)", "bound", "oracle"),
                ("imitation, fair-share policy iteration (learned)", "fair", "learner"),
            ):
                t = time.perf_counter()
                imit = train_batch_imitation(
                    src, B, R, K, cm, bc, seed=seed, iterations=5, episodes=4, expert=expert, reference=reference
                )
                rows.append((PerRequest(spec_none, imit.policy, name=label), "none"))
                self.notes.append(
                    f"{label}: expert {expert}, reference {reference}, trained in {time.perf_counter() - t:.0f} s"
                )
        if "ppo" in self.learner_rows:
            from policies.batch.learn import train_batch_ppo

            t = time.perf_counter()
            ppo = train_batch_ppo(src, B, R, K, cm, bc, self.ppo_timesteps, seed)
            ppo.name = "ppo MultiDiscrete (learned)"
            rows.append((ppo, "none"))
            self.notes.append(
                f"ppo trained in {time.perf_counter() - t:.0f} s, {self.ppo_timesteps} steps (train split)"
            )
        return rows

    def row_name(self, row: BatchRow) -> str:
        """The controller's name."""
        return row[0].name

    def remote(self, rows: list[BatchRow]) -> None:
        """Every batch row runs here."""
        return None

    def evaluate(self, row: BatchRow) -> dict[str, np.ndarray]:
        """The row's held-out episodes in the env of its drafting mode (:func:`_episodes`)."""
        pol, mode = row
        env = self.block_envs[pol.spec.request.lookahead] if mode == "block" else self.env_none
        return _episodes(env, pol, [self.seed + e for e in range(self.episodes)])

    def result(self, rows: list[BatchRow], runs: list[dict[str, np.ndarray]]) -> BenchResult:
        """Pooled speedups with paired bootstrap CIs, the batch bound on the same requests, the vLLM reference."""
        idx = bootstrap_indices(self.episodes, 2000, self.seed)
        out: list[dict[str, Any]] = []
        for (pol, mode), res in zip(rows, runs, strict=True):
            ci = pooled_ci(res["ar"], res["cost"], idx)
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
        arrays = self.ctx.test
        request_seeds = runs[0]["seeds"]
        for r in runs[1:]:
            if not np.array_equal(r["seeds"], request_seeds):  # pragma: no cover - common random numbers
                raise RuntimeError("batch bench: rows served different requests")
        bb = batch_bound(
            arrays,
            self.env_none.data.L0,
            self.bcm,
            self.batch_size,
            request_seeds,
            pathwise=True,
            progress=self.bound_progress,
        )
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
        self.notes.append(
            f"vs best vLLM rule: against {best_vllm['policy']} (the best of vLLM's rules fitted on train); the best "
            f"vLLM row in hindsight on these test episodes is {hindsight['policy']} "
            f"({hindsight['speedup_pooled']:.3f})"
        )
        bound = bb.summary() | {
            "split": list(bb.split) if bb.split is not None else "min rule",
            "ci95_expected": pooled_ci(bb.ar, bb.expected, idx),
            # the split rule alone (the bound before the Lagrangian splits), so the gain is visible in the same run
            "linear": bb.linear_summary(),
        }
        context = {
            "dataset": self.ctx.dataset,
            "batch_size": int(self.batch_size),
            "n_requests": int(self.env_none.R),
            "episodes": int(self.episodes),
            "seed": int(self.seed),
            "kmax": int(self.ctx.kmax),
            "cost_model": self.ctx.cost_model_arg,
            "batch_cost": str(self.batch_cost),
            "batch_cost_kind": self.bcm.source.get("kind"),
            "test_generations": int(arrays.n_generations),
            "best_vllm_rule": best_vllm["policy"],
            "best_vllm_rule_hindsight": hindsight["policy"],
            "dsd_schedule": [list(e) for e in self.schedule],
            "best_fixed_k_full_batch": int(self.schedule[-1][2]),
            "seconds": time.perf_counter() - self.t0,
        }
        return BenchResult("batch", pd.DataFrame(out), context, self.notes, bound=bound)


def run_batch_benchmark(
    dataset: Any = "paper-default",
    batch_size: int = 4,
    n_requests: int | None = None,
    episodes: int = 8,
    seed: int = 0,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    batch_cost: str = "auto",
    learners: bool = True,
    ppo_timesteps: int = 50_000,
    learner_rows: tuple[str, ...] = LEARNERS,
    progress: Progress | None = None,
    fit_progress: Progress | None = None,
    bound_progress: Progress | None = None,
) -> BenchResult:
    """Run every batch controller on ``episodes`` held-out episodes beside the bound (module docstring).

    Args:
        dataset: Registry name or folder, or a loaded :class:`~specenv.traces.traceset.TraceSet`.
        batch_size: B.
        n_requests: R per episode (default 4 B).
        episodes: Held-out episodes.
        seed: Episode e is reset with ``seed + e``; also the seed of the learners and the bootstrap.
        kmax: Largest budget.
        cost_model: Single-request cost model (default fitted on the train split's rounds).
        batch_cost: Batch cost model (``"auto"``, ``"scaled"``, a JSON path).
        learners: Train and run the learned controllers (imitation of the bound, PPO).
        ppo_timesteps: PPO's training budget.
        learner_rows: Which learned controllers to train with ``learners`` (:data:`LEARNERS`).
        progress: Called with ``(done, total, row name)``.
        fit_progress: Called with ``(done, total, what)`` as each fit on train (before the rows) ends.
        bound_progress: Called with ``(done, total, what)`` as each Lagrangian split (``what`` starts with
            ``lagrangian:``) and each request's pathwise bound (after the rows) ends.

    Returns:
        The :class:`~policies.bench.result.BenchResult` of family ``"batch"`` (``rows``: one dict per policy).

    Raises:
        ValueError: One line naming a bad argument (a batch size too large for the bound: ``check_enumerable``).
    """
    t0 = time.perf_counter()
    ctx = build_context(dataset, kmax, cost_model, None)
    check_enumerable(batch_size, ctx.kmax)  # the bound's enumeration, refused before the fits on train
    family = BatchFamily(
        ctx, batch_size, n_requests, episodes, seed, batch_cost, learners, ppo_timesteps, tuple(learner_rows), t0
    )
    family.fit_progress = fit_progress
    family.bound_progress = bound_progress
    return run_family(family, progress)
