"""The benchmark: every policy on the held-out split, side by side with the oracle bound.

Evaluation of a row:

* **exact** rows (every fixed budget, k = 0 included, and the best fixed k): the expected cost on
  every test generation from the oracle's exact policy evaluation
  (:func:`oracle.dp.evaluate_policy`); no Monte Carlo, so no sampling noise (CI of width 0);
* **Monte-Carlo** rows (every adaptive policy): every test generation is replayed ``episodes``
  times, all episodes of a policy at once as the streams of the native vector environment
  (:func:`specenv.rollout.rollout_vector`, the policy's ``act_batch``). Episode r of generation g
  is reset with its own seed :func:`specenv.rollout.episode_seeds` ``(seed, g, r)``: independent
  random streams across generations and episodes, the same ones for every policy (common random
  numbers). A generation's cost is the policy's mean episode cost on it.

Reported per policy: mean speedup over generations and pooled speedup (sum AR / sum cost), each
with a 95% percentile-bootstrap interval over generations (:func:`specenv.stats.bootstrap_ratio_ci`,
``n_boot`` resamples shared by every policy), % of the oracle bound (pooled speedup / pooled
S_max), mean k and mean accepted per round, the pooled speedup per category, and whether the
policy's budgets were constant over every test state it visited (a learned policy that is constant
is named so, not "learned"). The bound is the exact SSP oracle on the same generations
(drafting mode ``"none"``, whose bound is also the bound of ``"sequential"``: the true optimum).

**Each policy is charged by the drafting mode it really uses** (``Entry.drafting``, the table's
``drafting`` column; :data:`specenv.costmodel.DRAFTING_MODES`): the confidence thresholds stop
drafting at the first low-confidence token, verifying what they drafted, so they run in
``"sequential"`` (they see q_{t,1..kmax}, stop at the first j with q_{t,j} below the threshold, and
pay T_D(k) for the k tokens drafted); the delta-space rule with confidences and the learned policies
that read h confidences run in ``"block"`` (the drafter proposes h tokens at once: T_D(max(k, h)),
as they were fitted and trained); every other policy chooses k before drafting (``"none"``, T_D(k)).

Everything that needs fitting uses the **train** split only: the cost model (``cost_model=
"fit-train"``, the default: the per-K fit on the train generations' rounds,
:func:`specenv.costsource.cost_model_for`), the best fixed k (exact evaluation), the delta-space
lambda (oracle boundary slope), the U(k) and acceptance priors (train means), the peers' thresholds
and classifiers (:func:`policies.peers.fit_peers`; their rows: :func:`peer_entries`) and the learned
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
from policies.peers import (
    DISCO,
    SIGNALS,
    SVIP,
    AdaEDL,
    PeerFit,
    SpecDecPP,
    VLLMAdaptiveVerification,
    VLLMDSDTable,
    fit_peers,
)
from policies.stopping import load_stop_rule
from specenv.costmodel import CostModel, drafting_mode
from specenv.observation import ObservationSpec
from specenv.policy.base import Policy
from specenv.policy.mlp import MLPPolicy
from specenv.traceset import PositionArrays

LEARNED = ("ppo", "dqn", "imitation")
ORACLE_ROW = "oracle bound (SSP)"
#: The benchmark's default cost model: fitted on the train split's rounds only.
DEFAULT_COST_MODEL = "fit-train"
#: Bootstrap resamples of the generations behind every Monte-Carlo row's intervals.
N_BOOT = 2000


@dataclass
class Entry:
    """A policy in the benchmark: how to build it and which environment it needs.

    Attributes:
        name: Row name.
        make: Builds the policy for an observation layout.
        lookahead: Draft confidences h the policy reads.
        note: Free text.
        exact_k: A fixed budget: evaluated exactly by the oracle, not by Monte Carlo.
        learned: A trained policy.
        drafting: The drafting mode that charges its rounds (None: ``"block"`` for h > 0, else ``"none"``).
        signals: The draft signals its environment shows for the h lookahead tokens (an ordered subset of
            ``("q", "ent", "margin")``: confidence, entropy, top-1/top-2 margin), so each row's
            environment exposes what its rule reads.
    """

    name: str
    make: Callable[[ObservationSpec], Policy]
    lookahead: int = 0
    note: str = ""
    exact_k: int | None = None
    learned: bool = False
    drafting: str | None = None
    signals: tuple[str, ...] = ("q",)

    @property
    def mode(self) -> str:
        """The drafting mode of the row (``drafting``, or the one the lookahead implies)."""
        return drafting_mode(self.lookahead) if self.drafting is None else self.drafting


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
    _peers: PeerFit | None = None

    @property
    def peers(self) -> PeerFit:
        """The peers' fitted quantities (:func:`policies.peers.fit_peers`, train split only), fitted once."""
        if self._peers is None:
            self._peers = fit_peers(self.train, self.cost_model, best_fixed_k=self.best_fixed_k)
        return self._peers


def shipped_policy_dir(dataset: str | None = None) -> Path:
    """Folder of the policies shipped with the package: ``policies/shipped``, or ``policies/shipped/<set id>``.

    Args:
        dataset: A registered trace set name (``paper-default``, ``live-cpu-v2``): the folder of the
            policies trained on its train split, ``policies/shipped/<name>-v<version>``; None: the root.
            A trace-set folder has no shipped policies (the returned folder does not exist).
    """
    root = Path(str(resources.files("policies").joinpath("shipped")))
    if dataset is None:
        return root
    from specenv.datasets import find_dataset

    ds = find_dataset(str(dataset))
    return root / (ds.id if ds is not None else "(no shipped policies for a trace-set folder)")


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
    lam_h3 = boundary_slope(train, model, lookahead=min(3, kmax), drafting="block")
    u_prior, rho_prior = train_priors(train)
    spec = ObservationSpec(kmax, 0, int(ts.manifest.max_new_tokens), int(ts.facts.n_experts))
    return Context(
        dataset, kmax, model, cost_model, train, test, best, lam, lam_h3, u_prior, rho_prior, spec, policy_dir
    )


def default_entries(ctx: Context) -> list[Entry]:
    """Every policy of the benchmark, in display order."""
    m, up, rp = ctx.cost_model, ctx.u_prior, ctx.rho_prior
    k4, best = min(4, ctx.kmax), ctx.best_fixed_k
    if m.d_floor and not any(n.startswith("draft floor") for n in ctx.notes):
        ctx.notes.append(
            f"draft floor: the engine of this set drafts at every step, so a k=0 round pays {m.d_floor:.3f} ms of "
            "draft on top of the AR step (measured on its K=0 rounds); plain decoding without speculation is "
            "the 1.0 reference of every speedup"
        )
    entries = [
        Entry(
            "autoregressive (k=0)" if ctx.cost_model.d_floor == 0 else "k=0 in the speculating engine (draft floor)",
            lambda s: FixedK(s, 0),
            exact_k=0,
            note=""
            if ctx.cost_model.d_floor == 0
            else (
                f"every k=0 round pays the engine's draft floor ({ctx.cost_model.d_floor:.3f} ms): "
                "plain decoding without speculation is the 1.0 reference"
            ),
        ),
        Entry("fixed k=1", lambda s: FixedK(s, 1), exact_k=1),
        Entry(f"fixed k={k4}", lambda s: FixedK(s, k4), exact_k=k4),
        Entry(f"fixed k={ctx.kmax}", lambda s: FixedK(s, ctx.kmax), exact_k=ctx.kmax),
        Entry(f"best fixed k={best} (train)", lambda s: FixedK(s, best), exact_k=best),
        Entry("transformers heuristic", lambda s: TransformersHeuristic(s)),
        # the confidence rules stop after the first low-confidence draft and verify what they drafted
        Entry("confidence 0.4", lambda s: ConfidenceThreshold(s, 0.4), lookahead=ctx.kmax, drafting="sequential"),
        Entry(
            "confidence ROC",
            lambda s: ConfidenceThreshold(s, 0.4, adaptive=True),
            lookahead=ctx.kmax,
            drafting="sequential",
        ),
        Entry("goodput (SmartSpec)", lambda s: GoodputRule(s, m, up, rp)),
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
            drafting="block",
        ),
    ]
    entries += peer_entries(ctx)
    if ctx.policy_dir is not None and ctx.policy_dir.is_dir():
        found = find_policies(ctx.policy_dir)
        for name in LEARNED:
            if not any(n == name or n.startswith(name + "-") for n in found):
                ctx.notes.append(f"no trained '{name}' policy in {ctx.policy_dir} (run `specenv train --algo {name}`)")
        for name, folder in found.items():
            try:  # the benchmark's contract, with the lookahead the policy reads
                stored = MLPPolicy.load(folder).spec
                sig = {"signals": stored.signals}
                if stored.per_token:  # a stop rule of the per-token env: runs in sequential mode
                    pol: Policy = load_stop_rule(folder, expect=replace(ctx.spec, lookahead=ctx.kmax, **sig))
                else:
                    pol = MLPPolicy.load(folder, expect=replace(ctx.spec, lookahead=stored.lookahead, **sig))
            except ValueError as exc:  # listed with the reason, never dropped silently
                _skip(ctx, name, folder, str(exc))
                continue
            if stored.per_token:
                entries.append(
                    Entry(
                        f"{name} (learned)",
                        _learned(pol),
                        lookahead=ctx.kmax,
                        learned=True,
                        drafting="sequential",
                        signals=stored.signals,
                    )
                )
                continue
            h = pol.spec.lookahead  # trained in the replay env with lookahead h: block drafting
            entries.append(
                Entry(
                    f"{name} (learned)",
                    _learned(pol),
                    lookahead=h,
                    learned=True,
                    drafting=drafting_mode(h),
                    signals=stored.signals if h else ("q",),
                )
            )
    return entries


def peer_entries(ctx: Context) -> list[Entry]:
    """The peers' controllers (:mod:`policies.peers`), each charged by the drafting mode it really uses.

    The stop rules (AdaEDL, SVIP, SpecDec++, DISCO) see the signals of all kmax drafts and stop at the
    first failing token: ``sequential``, T_D(k). vLLM's adaptive verification needs every proposed draft's
    confidence before it trims: ``block`` with h = kmax. vLLM's DSD table is a constant at batch 1, chosen
    before drafting: ``none``, evaluated exactly. Their thresholds and classifiers are fitted on the
    train split (:attr:`Context.peers`), built only when one of these rows runs.
    """
    h = ctx.kmax
    ent = ctx.train.has_signals  # entropy and margin: trace schema v2
    all_sig = SIGNALS if ent else ("q",)
    m, up = ctx.cost_model, ctx.u_prior
    rows = []
    if ent:
        rows += [
            Entry(
                "AdaEDL (entropy bound)",
                lambda s: AdaEDL(s, lam=ctx.peers.adaedl_lam, gamma=ctx.peers.adaedl_gamma),  # type: ignore[arg-type]
                lookahead=h,
                drafting="sequential",
                signals=("q", "ent"),
            ),
            Entry(
                "SVIP (entropy)",
                lambda s: SVIP(s, h=ctx.peers.svip_h),  # type: ignore[arg-type]
                lookahead=h,
                drafting="sequential",
                signals=("q", "ent"),
            ),
        ]
    rows += [
        Entry(
            "SpecDec++ (acceptance head)",
            lambda s: SpecDecPP(s, ctx.peers.specdecpp, ctx.peers.specdecpp_threshold),
            lookahead=h,
            drafting="sequential",
            signals=all_sig,
        ),
        Entry(
            "DISCO (stop classifier)",
            lambda s: DISCO(s, ctx.peers.disco, ctx.peers.disco_threshold),
            lookahead=h,
            drafting="sequential",
            signals=all_sig,
        ),
        Entry(
            "vLLM adaptive verification",
            lambda s: VLLMAdaptiveVerification(s, m, u_prior=up),
            lookahead=h,
            drafting="block",
        ),
        Entry(
            "vLLM DSD table (batch 1)",
            lambda s: VLLMDSDTable(s, k=ctx.best_fixed_k),
            exact_k=ctx.best_fixed_k,
            note="num_speculative_tokens_per_batch_size at batch 1: the best fixed k on train",
        ),
    ]
    return rows


def find_policies(policy_dir: Path) -> dict[str, Path]:
    """Trained policies under ``policy_dir``: name -> folder holding ``policy.json``, sorted by name.

    Both layouts count: ``DIR/<name>/policy.json`` (the shipped policies) and
    ``DIR/<run>/policy/policy.json`` (what ``specenv train --out DIR`` writes; the name is the run's).
    A run with both is listed once, by its ``DIR/<run>/policy.json``.
    """
    found: dict[str, Path] = {}
    for pj in sorted(policy_dir.glob("*/policy/policy.json")):
        found[pj.parent.parent.name] = pj.parent
    for pj in sorted(policy_dir.glob("*/policy.json")):
        found[pj.parent.name] = pj.parent
    return dict(sorted(found.items()))


def _skip(ctx: Context, name: str, folder: Path, reason: str) -> None:
    ctx.skipped.append({"policy": name, "folder": str(folder), "reason": reason})
    ctx.notes.append(f"skipped '{name}' in {ctx.policy_dir}: {reason}")


def _learned(pol: Policy) -> Callable[[ObservationSpec], Policy]:
    def make(spec: ObservationSpec) -> Policy:
        bad = pol.spec.mismatch(spec)
        if bad is not None:
            raise ValueError(f"policy '{pol.name}': observation contract differs: {bad} (policy != environment)")
        return pol

    return make


@dataclass(frozen=True)
class BenchSetup:
    """The arguments that rebuild a benchmark's context and rows anywhere (plain values only).

    A worker of the distributed benchmark (:mod:`policies.distributed`) gets this instead of the
    :class:`Context` (whose rows are closures over fitted objects): :func:`setup_entries` refits the
    same train-split quantities (every fit is deterministic) and lists the same rows in the same order.
    """

    dataset: str
    kmax: int | None
    cost_model: str
    policy_dir: str | None
    only: tuple[str, ...] | list[str] | None
    drafting: str | None


#: ``executor(setup, [(entry index, name)], test generation ids, episodes, seed) -> {index: frame or error}``.
BenchExecutor = Callable[[BenchSetup, list[tuple[int, str]], np.ndarray, int, int], dict[int, "pd.DataFrame | str"]]


def select_entries(ctx: Context, only: Any, drafting: str | None) -> list[Entry]:
    """The rows a run benchmarks, in display order: ``only`` (name substrings) and ``drafting`` applied."""
    entries = [e for e in default_entries(ctx) if not only or any(o in e.name for o in only)]
    if drafting is not None:
        entries = [e for e in entries if e.exact_k is not None or e.mode == drafting]
    return entries


def setup_entries(setup: BenchSetup) -> tuple[Context, list[Entry]]:
    """The context and rows of a run from its :class:`BenchSetup` (what :func:`run_benchmark` builds)."""
    pdir = Path(setup.policy_dir) if setup.policy_dir is not None else shipped_policy_dir(setup.dataset)
    ctx = build_context(setup.dataset, setup.kmax, setup.cost_model, pdir)
    return ctx, select_entries(ctx, setup.only, setup.drafting)


def run_entry(entry: Entry, ctx: Context, episodes: int, seed: int, generation_ids: Any = None) -> pd.DataFrame | str:
    """:func:`run_policy`'s episode frame, or the one-line error of a row that cannot run (a ValueError)."""
    try:
        return run_policy(entry, ctx, episodes, seed, generation_ids)[0]
    except ValueError as exc:
        return str(exc)


def run_unit(
    ctx: Context, entries: list[Entry], index: int, generation_ids: Any, episodes: int, seed: int
) -> pd.DataFrame | str:
    """One unit of the distributed benchmark: row ``index`` on a chunk of test generations.

    Concatenating the units of a row over chunks that partition the test generations, in their
    order, gives :func:`run_entry`'s frame for the whole split (see :func:`run_policy`).
    """
    return run_entry(entries[index], ctx, episodes, seed, generation_ids)


def run_policy(
    entry: Entry, ctx: Context, episodes: int, seed: int, generation_ids: Any = None
) -> tuple[pd.DataFrame, Policy]:
    """Replay every test generation ``episodes`` times with one policy; one row per episode.

    All ``G * episodes`` episodes run at once as the streams of one native vector environment
    (:func:`specenv.rollout.rollout_vector`); episode r of generation g is reset with seed
    :func:`specenv.rollout.episode_seeds` ``(seed, g, r)`` (the same for every policy). A stream's
    episode depends on its own seed and generation only, so running the generations in chunks
    (``generation_ids``, the unit of the distributed benchmark, :mod:`policies.distributed`) and
    concatenating the chunks in order gives exactly the frame of one run over all of them.

    Args:
        entry: The policy's row.
        ctx: The run's context (train-split fits, test positions).
        episodes: Episodes per generation.
        seed: Base seed of :func:`specenv.rollout.episode_seeds`.
        generation_ids: Only these test generations, in this order (default: every test generation,
            in the environment's order).
    """
    from specenv.rollout import rollout_split

    played = rollout_split(
        entry.make,
        ctx.dataset,
        ctx.kmax,
        "test",
        ctx.cost_model_arg,
        entry.lookahead,
        entry.mode,
        entry.signals,
        episodes,
        seed,
        generation_ids,
    )
    res, policy = played.rollouts, played.policy
    ep_gid, ep_r, seeds = played.episode_generation, played.episode_index, played.seeds
    df = pd.DataFrame(
        {
            "policy": entry.name,
            "generation_id": ep_gid,
            "category": res.categories,
            "episode": ep_r,
            "seed": seeds,
            "cost_ms": res.cost,
            "ar_ms": res.ar,
            "rounds": res.rounds,
            "k_sum": res.k_sum,
            "accepted_sum": res.accepted_sum,
            "k_min": res.k_min,
            "k_max": res.k_max,
        }
    )
    return df, policy


def exact_generations(entry: Entry, ctx: Context) -> pd.DataFrame:
    """Per-generation expected cost of a fixed-budget entry, exactly (:func:`oracle.dp.evaluate_policy`).

    The frame has the columns of :func:`generation_table`'s output (``n`` = 0: no episodes,
    ``cost_sd`` = 0).
    """
    from oracle.dp import evaluate_policy

    if entry.exact_k is None:
        raise ValueError(f"policy '{entry.name}': no fixed budget to evaluate exactly")
    ev = evaluate_policy(ctx.test, ctx.cost_model, int(entry.exact_k), lookahead=entry.lookahead, drafting=entry.mode)
    return pd.DataFrame(
        {
            "policy": entry.name,
            "generation_id": ctx.test.generation_ids.astype(np.int64),
            "category": ctx.test.categories,
            "cost_ms": ev.cost,
            "cost_sd": 0.0,
            "n": 0,
            "ar_ms": ev.ar,
            "rounds": ev.rounds.astype(np.float64),
            "k_sum": ev.k_sum.astype(np.float64),
            "accepted_sum": ev.accepted_sum.astype(np.float64),
            "k_min": int(entry.exact_k),
            "k_max": int(entry.exact_k),
            "exact": True,
        }
    )


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
    from specenv.stats import bootstrap_indices, bootstrap_ratio_ci

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


@dataclass
class BenchResult:
    """Tables of one benchmark run.

    Attributes:
        summary: One row per policy (then the oracle's).
        categories: Pooled speedup per policy and category.
        episodes: The Monte-Carlo rows' episodes (one row each).
        oracle: The oracle's summary.
        context: What the run used (data set, cost model and what it was fitted on, seeds, statistics).
        notes: Lines for the reader.
        skipped: Policies that could not run, with the reason.
        generations: One row per (policy, generation): the exact expected cost or the mean episode cost.
    """

    summary: pd.DataFrame
    categories: pd.DataFrame
    episodes: pd.DataFrame
    oracle: dict[str, Any]
    context: dict[str, Any]
    notes: list[str]
    skipped: list[dict[str, str]] = field(default_factory=list)
    generations: pd.DataFrame | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (strict JSON: a missing value, e.g. the exact rows' CI, is ``null``)."""
        policies = [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rec.items()}
            for rec in self.summary.to_dict(orient="records")
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


def _constant_name(name: str, k: int) -> str:
    """A learned policy's row name once its budgets turned out constant: not called learned."""
    base = name[: -len(" (learned)")] if name.endswith(" (learned)") else name
    return f"{base} (constant k={k})"


def run_benchmark(
    dataset: str = "paper-default",
    kmax: int | None = None,
    cost_model: str = DEFAULT_COST_MODEL,
    episodes: int = 4,
    seed: int = 0,
    policy_dir: Path | None = None,
    only: list[str] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    n_boot: int = N_BOOT,
    drafting: str | None = None,
    executor: BenchExecutor | None = None,
) -> BenchResult:
    """Run the benchmark on the test split of ``dataset``.

    Args:
        dataset: Registry name or trace-set folder.
        kmax: Largest budget (default: the trace set's Kmax).
        cost_model: ``"fit-train"`` (default: fitted on the train split's rounds), ``"fit"`` (all
            rounds, test generations included), ``"profile"`` or a JSON path.
        episodes: Monte-Carlo episodes per test generation and adaptive policy.
        seed: Base seed of the episodes (:func:`specenv.rollout.episode_seeds`) and of the bootstrap.
        policy_dir: Folder with trained policies (``<name>/policy.json`` or ``<run>/policy/policy.json``);
            default the ones shipped for this set (:func:`shipped_policy_dir`).
        only: Run only policies whose name contains one of these strings (the oracle always runs).
        progress: Called as ``progress(done, total, name)`` as each policy starts, with the number of
            policies done before it and the number that run.
        n_boot: Bootstrap resamples of the generations.
        drafting: Only the rows of this drafting mode (``"none"``, ``"block"``, ``"sequential"``), and the
            fixed-k rows (exact, mode none: the reference of every mode); None: every row. The bound stays
            none's; with ``"block"`` the exact bound of block drafting with each row's h is added.
        executor: Runs the Monte-Carlo rows elsewhere (:mod:`policies.distributed`, Ray): called once
            as ``executor(setup, [(entry index, name), ...], test generation ids, episodes, seed)``, it
            returns for every entry index the frame of :func:`run_entry` (or its error line), built by
            :func:`run_unit` on chunks of generations from the plain-valued :class:`BenchSetup`. The
            result is the same as the local run's (:func:`run_policy`). ``progress`` is then the
            executor's business. None: every row runs here, one after another.
    """
    from oracle.dp import solve
    from specenv.costmodel import DRAFTING_MODES

    if episodes < 1:
        raise ValueError(f"episodes={episodes}: must be >= 1")
    if seed < 0:
        raise ValueError(f"seed={seed}: must be >= 0")
    if drafting is not None and drafting not in DRAFTING_MODES:
        raise ValueError(f"drafting={drafting!r}: expected one of {DRAFTING_MODES}")
    ctx = build_context(
        dataset, kmax, cost_model, policy_dir if policy_dir is not None else shipped_policy_dir(dataset)
    )
    sol = solve(ctx.test, ctx.cost_model)
    oracle_df = pd.DataFrame(
        {"generation_id": ctx.test.generation_ids, "category": ctx.test.categories, "v0_ms": sol.cost, "ar_ms": sol.ar}
    )
    frames, gens = [], []
    learned_names = set()
    modes: dict[str, str] = {}
    shown: dict[str, int] = {}  # confidences each row reads
    entries = select_entries(ctx, only, drafting)
    ran: dict[int, pd.DataFrame | str] = {}
    if executor is not None:  # every Monte-Carlo row at once, in units of (policy, generation chunk)
        pdir = None if policy_dir is None else str(policy_dir)
        setup = BenchSetup(dataset, kmax, cost_model, pdir, tuple(only) if only else None, drafting)
        mc = [i for i, e in enumerate(entries) if e.exact_k is None]
        ran = executor(setup, [(i, entries[i].name) for i in mc], ctx.test.generation_ids, episodes, seed)
    for i, entry in enumerate(entries):
        if progress and executor is None:
            progress(i, len(entries), entry.name)
        modes[entry.name] = entry.mode
        shown[entry.name] = entry.lookahead
        if entry.exact_k is not None:
            gens.append(exact_generations(entry, ctx))
            continue
        df_or_error = ran[i] if executor is not None else run_entry(entry, ctx, episodes, seed)
        if isinstance(df_or_error, str):
            if not entry.learned:
                raise ValueError(df_or_error)
            _skip(ctx, entry.name.removesuffix(" (learned)"), ctx.policy_dir or Path(), df_or_error)
            continue
        df = df_or_error
        if entry.learned:
            learned_names.add(entry.name)
        frames.append(df)
        gens.append(generation_table(df))
    if not gens:
        raise ValueError(f"only={only}: no policy matches")
    episodes_df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    gen_df = pd.concat(gens, ignore_index=True)
    summary, cats = summarise(gen_df, oracle_df, n_boot=n_boot, seed=seed)
    summary.insert(1, "drafting", summary["policy"].map(modes))
    summary.insert(2, "lookahead", summary["policy"].map(shown).astype(int))
    # a learned policy whose budget never changed over the test states is a constant policy
    rename = {}
    for r in summary.itertuples():
        if r.policy in learned_names and r.constant:
            rename[r.policy] = _constant_name(r.policy, int(r.constant_k))
            ctx.notes.append(
                f"'{r.policy}' chose k={int(r.constant_k)} in every test state: reported as '{rename[r.policy]}'"
            )
    summary["learned"] = summary["policy"].isin(learned_names)
    for table in (summary, cats, gen_df, episodes_df):
        if len(table):
            table["policy"] = table["policy"].replace(rename)
    oracle_row = {
        "policy": ORACLE_ROW,
        "drafting": "none",
        "lookahead": 0,
        "evaluation": "exact",
        "speedup_mean": float(sol.speedup.mean()),
        "ci95_low": float(sol.speedup.mean()),
        "ci95_high": float(sol.speedup.mean()),
        "speedup_pooled": sol.speedup_pooled,
        "pooled_ci95_low": sol.speedup_pooled,
        "pooled_ci95_high": sol.speedup_pooled,
        "oracle_pct": 100.0,
        "mean_k": sol.mean_k,
        "mean_accepted": sol.mean_accepted,
        "generations": int(len(sol.cost)),
        "beats_bound": 0,
        "constant": False,
        "constant_k": None,
        "learned": False,
    }
    extra = [oracle_row]
    bound_cats = []
    if drafting == "block":  # the lower bound of block drafting, for each h a row reads
        for h in sorted({shown[n] for n, md in modes.items() if md == "block"}):
            bsol = solve(ctx.test, ctx.cost_model, lookahead=h, drafting="block")
            per_gen = pd.DataFrame({"category": ctx.test.categories, "v0_ms": bsol.cost, "ar_ms": bsol.ar})
            bcat = (  # its pooled speedup per category, as the bound's below (was NaN in the category table)
                per_gen.groupby("category")
                .apply(lambda d: d["ar_ms"].sum() / d["v0_ms"].sum(), include_groups=False)
                .rename("speedup_pooled")
                .reset_index()
            )
            bcat.insert(0, "policy", f"oracle bound, block h={h} (SSP)")
            bound_cats.append(bcat)
            extra.append(
                oracle_row
                | {
                    "policy": f"oracle bound, block h={h} (SSP)",
                    "drafting": "block",
                    "lookahead": h,
                    "speedup_mean": float(bsol.speedup.mean()),
                    "ci95_low": float(bsol.speedup.mean()),
                    "ci95_high": float(bsol.speedup.mean()),
                    "speedup_pooled": bsol.speedup_pooled,
                    "pooled_ci95_low": bsol.speedup_pooled,
                    "pooled_ci95_high": bsol.speedup_pooled,
                    "oracle_pct": 100.0 * bsol.speedup_pooled / sol.speedup_pooled,
                    "mean_k": bsol.mean_k,
                    "mean_accepted": bsol.mean_accepted,
                }
            )
    summary = pd.concat([summary, pd.DataFrame(extra)], ignore_index=True)
    summary["constant_k"] = pd.Series(
        [int(k) if c else None for k, c in zip(summary["constant_k"], summary["constant"], strict=True)], dtype=object
    )
    ocat = (
        oracle_df.groupby("category")
        .apply(lambda d: d["ar_ms"].sum() / d["v0_ms"].sum(), include_groups=False)
        .rename("speedup_pooled")
        .reset_index()
    )
    ocat.insert(0, "policy", ORACLE_ROW)
    cats = pd.concat([cats, ocat, *bound_cats], ignore_index=True)
    fitted = {"fit-train": "train split", "fit": "all rounds (train and test generations)"}
    context = {
        "dataset": dataset,
        "kmax": ctx.kmax,
        "cost_model": cost_model,
        "cost_model_fitted_on": fitted.get(cost_model, "n/a (not fitted by the benchmark)"),
        "fitted_on": "train split (best fixed k, delta-space lambda, U and acceptance priors, the peers' "
        "thresholds and classifiers, learned policies)",
        "episodes": episodes,
        "seed": seed,
        "drafting_filter": drafting,
        "seeds": "episode_seeds(seed, generation_id, episode): independent per (generation, episode), "
        "common to every policy",
        "statistics": f"fixed-k rows exact (oracle.dp.evaluate_policy); other rows Monte Carlo with 95% "
        f"percentile-bootstrap intervals over test generations (n_boot={n_boot})",
        "n_boot": n_boot,
        "test_generations": int(ctx.test.n_generations),
        "train_generations": int(ctx.train.n_generations),
        "best_fixed_k_train": ctx.best_fixed_k,
        "delta_lambda_ms": ctx.lam_ms,
        "delta_lambda_ms_h3": ctx.lam_ms_h3,
        "ar_cost_model_extrapolated": bool(ctx.cost_model.ar_extrapolated),
        "drafting": "each row is charged by the drafting mode it uses (column 'drafting'): none = k chosen "
        "before drafting, T_D(k); sequential = stops after any draft, T_D(tokens drafted); block = h drafts "
        "proposed at once, T_D(max(k, h)). The oracle bound is the bound of none, equal to the bound of sequential",
    }
    return BenchResult(summary, cats, episodes_df, sol.summary(), context, ctx.notes, ctx.skipped, gen_df)


def markdown_table(res: BenchResult) -> str:
    """The summary as a Markdown table (exact rows marked "exact", the others with bootstrap 95% CIs)."""
    lines = [
        "| policy | drafting | speedup (mean, 95% CI) | pooled (95% CI) | % of oracle | mean k | mean accepted |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res.summary.itertuples():
        if r.evaluation == "exact":
            mean, pooled = f"{r.speedup_mean:.3f} (exact)", f"{r.speedup_pooled:.3f} (exact)"
        else:
            mean = f"{r.speedup_mean:.3f} [{r.ci95_low:.3f}, {r.ci95_high:.3f}]"
            pooled = f"{r.speedup_pooled:.3f} [{r.pooled_ci95_low:.3f}, {r.pooled_ci95_high:.3f}]"
        mode = f"{r.drafting} (h={r.lookahead})" if r.drafting == "block" else r.drafting
        pct = f"{r.oracle_pct:.1f}%"
        lines.append(f"| {r.policy} | {mode} | {mean} | {pooled} | {pct} | {r.mean_k:.2f} | {r.mean_accepted:.2f} |")
    for sk in res.skipped:
        lines.append(f"| {sk['policy']} (not run: {sk['reason'].replace('|', '/')}) | | | | | | |")
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
    """CSV, JSON, Markdown and two matplotlib figures into ``out``.

    The figures: ``speedup.png`` (every policy's mean speedup with its bootstrap 95% interval, one
    colour per policy family, the oracle bound as a labelled line; :func:`plot_speedup`) and
    ``speedup_by_category.png`` (pooled speedup per category of the best policy of each family;
    :func:`plot_categories`).
    """
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        out / "summary.csv",
        out / "categories.csv",
        out / "episodes.csv",
        out / "bench.json",
        out / "bench.md",
        out / "speedup.png",
        out / "speedup_by_category.png",
        out / "generations.csv",
    ]
    res.summary.to_csv(paths[0], index=False)
    res.categories.to_csv(paths[1], index=False)
    res.episodes.to_csv(paths[2], index=False)
    paths[3].write_text(json.dumps(res.to_json(), indent=2, default=_json_default) + "\n")
    paths[4].write_text(markdown_table(res) + "\n\n" + category_table(res) + "\n")
    plot_speedup(res, paths[5])
    plot_categories(res, paths[6])
    if res.generations is not None:
        res.generations.to_csv(paths[7], index=False)
    else:
        paths.pop()
    return paths


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


def _json_default(obj: Any) -> Any:
    """Plain values for the numpy scalars of the JSON output."""
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return float(obj)
