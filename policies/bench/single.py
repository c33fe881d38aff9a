"""The benchmark: every policy on the held-out split, side by side with the oracle bound.

Evaluation of a row:

* **exact** rows (every fixed budget, k = 0 included, and the best fixed k): the expected cost on
  every test generation from the oracle's exact policy evaluation
  (:func:`oracle.dp.evaluate_policy`); no Monte Carlo, so no sampling noise (CI of width 0);
* **Monte-Carlo** rows (every adaptive policy): every test generation is replayed ``episodes``
  times, all episodes of a policy at once as the streams of the native vector environment
  (:func:`specenv.envs.rollout.rollout_vector`, the policy's ``act_batch``). Episode r of generation g
  is reset with its own seed :func:`specenv.envs.rollout.episode_seeds` ``(seed, g, r)``: independent
  random streams across generations and episodes, the same ones for every policy (common random
  numbers). A generation's cost is the policy's mean episode cost on it.

Reported per policy: mean speedup over generations and pooled speedup (sum AR / sum cost), each
with a 95% percentile-bootstrap interval over generations (:func:`specenv.stats.bootstrap_ratio_ci`,
``n_boot`` resamples shared by every policy), % of the oracle bound (pooled speedup / pooled
S_max), mean k and mean accepted per round, the pooled speedup per category, and whether the
policy's budgets were constant over every test state it visited (a learned policy that is constant
is named so, not "learned"). The bound is the exact SSP oracle on the same generations
(drafting mode ``"none"``, whose bound is also the bound of ``"sequential"``: the true optimum).

**The belief oracle** (:mod:`oracle.belief`, names :data:`BELIEF_NAMES`, in ``bound["belief_oracle"]``
and a note): the SSP solved on the acceptance probabilities a train-split calibration predicts from
the depth alone (mode none's) or from the draft's confidence (sequential's and block's), evaluated
exactly on the true acceptances. It is a *reference*, not a bound (the module says why), so it is
no row; ``belief_pct`` is every row's pooled speedup in % of the belief oracle's (the confidence
one when it runs).

**Paired differences.** Every row also gets its pooled speedup minus that of two references, with a
paired bootstrap 95% interval (:func:`policies.bench.stats.paired_differences`, on the resamples of
the rows' own intervals): the *best fixed k in hindsight* (the fixed budget of the highest exact
pooled speedup on the test generations themselves, :func:`best_fixed_in_hindsight`: a reference no
rule fitted on train can beat by choosing its k better) and a *peer* (``vs``: a row named by the
caller, by default the best adaptive row that is not learned). The pairing is what makes small
differences visible: every row replays the same generations with the same seeds, so a generation's
difficulty cancels in the difference.

**Each policy is charged by the drafting mode it really uses** (``Entry.drafting``, the table's
``drafting`` column; :data:`specenv.cost.model.DRAFTING_MODES`): the confidence thresholds stop
drafting at the first low-confidence token, verifying what they drafted, so they run in
``"sequential"`` (they see q_{t,1..kmax}, stop at the first j with q_{t,j} below the threshold, and
pay T_D(k) for the k tokens drafted); the delta-space rule with confidences and the learned policies
that read h confidences run in ``"block"`` (the drafter proposes h tokens at once: T_D(max(k, h)),
as they were fitted and trained); every other policy chooses k before drafting (``"none"``, T_D(k)).

Everything that needs fitting uses the **train** split only: the cost model (``cost_model=
"fit-train"``, the default: the per-K fit on the train generations' rounds,
:func:`specenv.cost.source.cost_model_for`), the best fixed k (exact evaluation), the delta-space
lambda (oracle boundary slope), the U(k) and acceptance priors (train means), the peers' thresholds
and classifiers (:func:`policies.peers.fit_peers`; their rows: :func:`peer_entries`) and the learned
policies (shipped, trained on the train split by ``specenv train``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from policies import shipped_policy_dir
from policies.bench.context import (
    DEFAULT_COST_MODEL,
    N_BOOT,
    Context,
    build_context,
)
from policies.bench.result import BenchResult
from policies.bench.runner import Progress, run_family
from policies.bench.stats import generation_table, paired_differences, summarise
from policies.delta import DeltaSpaceRule
from policies.heuristics import (
    CascadeUtility,
    ConfidenceThreshold,
    FixedK,
    GoodputRule,
    TransformersHeuristic,
    UCBBandit,
)
from policies.learn.stopping import load_stop_rule
from policies.peers import (
    DISCO,
    SIGNALS,
    SVIP,
    AdaEDL,
    SpecDecPP,
    VLLMAdaptiveVerification,
    VLLMDSDTable,
)
from specenv.cost.model import drafting_mode
from specenv.observation.single import ObservationSpec
from specenv.policy.base import Policy, policy_drafting
from specenv.policy.mlp import MLPPolicy

__all__ = [
    "BELIEF_NAMES",
    "LEARNED",
    "ORACLE_ROW",
    "BenchExecutor",
    "BenchSetup",
    "Entry",
    "SingleFamily",
    "best_fixed_in_hindsight",
    "default_entries",
    "exact_generations",
    "find_policies",
    "peer_entries",
    "run_benchmark",
    "run_entry",
    "run_policy",
    "run_unit",
    "select_entries",
    "setup_entries",
]

LEARNED = ("ppo", "dqn", "imitation")
ORACLE_ROW = "oracle bound (SSP)"
#: The belief oracle's names (:mod:`oracle.belief`): references, not bounds; by the signals the belief reads.
BELIEF_NAMES = {
    (): "belief oracle, depth prior (reference)",
    ("q",): "belief oracle, draft confidence (reference)",
}


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


def default_entries(ctx: Context, only: Sequence[str] | None = None) -> list[Entry]:
    """Every policy of the benchmark, in display order.

    ``only`` (the name substrings of ``--only``) does not select rows here (:func:`select_entries`
    does); it keeps the notes on missing learned policies to the learners a row of ``only`` could be.
    """
    m, up, rp = ctx.cost_model, ctx.u_prior, ctx.rho_prior
    k4, best = min(4, ctx.kmax), ctx.best_fixed_k
    if m.d_floor and not any(n.startswith("draft floor") for n in ctx.notes):
        ctx.notes.append(
            f"draft floor: the engine of this set drafts at every step, so a k=0 round pays {m.d_floor:.3f} ms of "
            "draft on top of the AR step (measured on its K=0 rounds); plain decoding without speculation is "
            "the 1.0 reference of every speedup"
        )
    if m.ar_step is not None and not any(n.startswith("step time") for n in ctx.notes):
        ctx.notes.append(
            "step time: every round is priced at the engine step's wall time (forwards + the engine's own "
            f"per-step overhead, {m.overhead[0]:.3f} ms at k=0); the 1.0 reference is a plain engine with no "
            f"drafter, measured: {m.ar_step[0]:.3f} + {m.ar_step[1] * 1e3:.3f}e-3*L ms per token"
        )
    k0_name, k0_note = "autoregressive (k=0)", ""
    if not m.plain_is_k0:
        k0_name = "k=0 in the speculating engine" + (" (draft floor)" if m.d_floor else "")
        paid = f"the engine's draft floor ({m.d_floor:.3f} ms)"
        if m.ar_step is not None or m.overhead[0]:
            paid = (
                f"what the speculating engine's step pays at k=0 (draft floor {m.d_floor:.3f} ms, "
                f"overhead {m.overhead[0]:.3f} ms)"
            )
        k0_note = f"every k=0 round pays {paid}: plain decoding without speculation is the 1.0 reference"
    entries = [
        Entry(k0_name, lambda s: FixedK(s, 0), exact_k=0, note=k0_note),
        # fixed k = 1, min(4, Kmax) and Kmax, each once (a set with Kmax <= 4 names one of them twice)
        *(Entry(f"fixed k={k}", lambda s, k=k: FixedK(s, k), exact_k=k) for k in dict.fromkeys((1, k4, ctx.kmax))),
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
            wanted = not only or any(o in f"{name} (learned)" for o in only)
            if wanted and not any(n == name or n.startswith(name + "-") for n in found):
                ctx.notes.append(f"no trained '{name}' policy in {ctx.policy_dir} (run `specenv train --algo {name}`)")
        for name, folder in found.items():
            try:  # the benchmark's contract, with the lookahead the policy reads
                raw = MLPPolicy.load(folder)
                stored = raw.spec
                sig = {"signals": stored.signals}
                if stored.per_token:  # a stop rule of the per-token env: runs in sequential mode
                    pol: Policy = load_stop_rule(folder, expect=replace(ctx.spec, lookahead=ctx.kmax, **sig))
                else:
                    pol = MLPPolicy.load(folder, expect=replace(ctx.spec, lookahead=stored.lookahead, **sig))
                # the mode it records (policy_drafting: an unknown one is an error) is the mode it runs in here
                runs = "sequential" if stored.per_token else drafting_mode(stored.lookahead)
                recorded = policy_drafting(raw)
                if recorded != runs:
                    raise ValueError(
                        f"{folder / 'policy.json'}: records drafting mode {recorded!r}, but its observation "
                        f"contract runs in mode {runs} here"
                    )
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
    entries = [e for e in default_entries(ctx, only) if not only or any(o in e.name for o in only)]
    if drafting is not None:
        entries = [e for e in entries if e.exact_k is not None or e.mode == drafting]
    return entries


def skip_reason(ctx: Context, only: Sequence[str]) -> str:
    """`` (skipped 'NAME': REASON)`` for the first skipped policy ``only`` would have kept, else ``""``."""
    hit = [sk for sk in ctx.skipped if any(o in sk["policy"] for o in only)]
    return f" (skipped {hit[0]['policy']!r}: {hit[0]['reason']})" if hit else ""


def _no_match(ctx: Context, only: Sequence[str]) -> str:
    """The refusal of an ``only`` that keeps no row (with the skip reason of a row it would have kept)."""
    only = list(only)
    return f"only={only}: no policy matches{skip_reason(ctx, only)}"


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
    (:func:`specenv.envs.rollout.rollout_vector`); episode r of generation g is reset with seed
    :func:`specenv.envs.rollout.episode_seeds` ``(seed, g, r)`` (the same for every policy). A stream's
    episode depends on its own seed and generation only, so running the generations in chunks
    (``generation_ids``, the unit of the distributed benchmark, :mod:`policies.distributed`) and
    concatenating the chunks in order gives exactly the frame of one run over all of them.

    Args:
        entry: The policy's row.
        ctx: The run's context (train-split fits, test positions).
        episodes: Episodes per generation.
        seed: Base seed of :func:`specenv.envs.rollout.episode_seeds`.
        generation_ids: Only these test generations, in this order (default: every test generation,
            in the environment's order).
    """
    from specenv.envs.rollout import rollout_split

    played = rollout_split(  # the environment factory of the family: the native vector replay env
        entry.make,
        ctx.source,
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


def _constant_name(name: str, k: int) -> str:
    """A learned policy's row name once its budgets turned out constant: not called learned."""
    base = name[: -len(" (learned)")] if name.endswith(" (learned)") else name
    return f"{base} (constant k={k})"


def _pooled_by_category(per_gen: pd.DataFrame, cost: str) -> pd.DataFrame:
    """Pooled speedup (sum AR / sum ``cost``) per category of a per-generation frame."""
    return (
        per_gen.groupby("category")
        .apply(lambda d: d["ar_ms"].sum() / d[cost].sum(), include_groups=False)
        .rename("speedup_pooled")
        .reset_index()
    )


def best_fixed_in_hindsight(ctx: Context) -> tuple[int, np.ndarray]:
    """The fixed budget of the highest exact pooled speedup on the test generations, and its cost per generation.

    Chosen on the generations it is evaluated on (a reference, not a rule: the train split's best
    fixed k is the row a deployment could run); ties go to the smaller k.
    """
    from oracle.dp import evaluate_policy

    best: tuple[float, int, np.ndarray] | None = None
    for k in range(ctx.kmax + 1):
        ev = evaluate_policy(ctx.test, ctx.cost_model, k)
        pooled = float(np.sum(ev.ar) / np.sum(ev.cost))
        if best is None or pooled > best[0]:
            best = (pooled, k, np.asarray(ev.cost, dtype=np.float64))
    assert best is not None
    return best[1], best[2]


def _reference_columns(summary: pd.DataFrame, prefix: str, diffs: dict[str, dict[str, float]]) -> None:
    """``prefix``, ``prefix_ci95_low``, ``prefix_ci95_high`` of every row (NaN where a row has no difference)."""
    for suffix, key in (("", "value"), ("_ci95_low", "low"), ("_ci95_high", "high")):
        summary[prefix + suffix] = [diffs[n][key] if n in diffs else float("nan") for n in summary["policy"]]


@dataclass
class SingleFamily:
    """The single-request family: the roster of :func:`select_entries`, the vector replay env, the SSP bound.

    A fixed-budget row is evaluated exactly (:func:`exact_generations`), any other by Monte Carlo in
    the native vector environment (:func:`run_entry`), here or by the ``executor``
    (:data:`BenchExecutor`, every Monte-Carlo row at once in units of (row, chunk of generations)).
    ``vs`` names the peer of the paired differences (a row name, or a part of exactly one; None: the
    best adaptive row that is not learned).
    """

    ctx: Context
    setup: BenchSetup
    episodes: int
    seed: int
    n_boot: int = N_BOOT
    executor: BenchExecutor | None = None
    closing: str | None = None
    vs: str | None = None
    vs_row: str | None = field(default=None, init=False)
    references: dict[str, Any] = field(default_factory=dict, init=False)

    def roster(self) -> list[Entry]:
        """The rows of :func:`select_entries`; ``vs`` resolved to one of them (a ValueError: none or several)."""
        rows = select_entries(self.ctx, self.setup.only, self.setup.drafting)
        if self.setup.only and not rows:  # refused before the oracle rows run, not after them
            raise ValueError(_no_match(self.ctx, self.setup.only))
        if self.vs is not None:
            names = [e.name for e in rows]
            hit = [n for n in names if n == self.vs] or [n for n in names if self.vs in n]
            if len(hit) != 1:
                what = "no row of this run is" if not hit else f"{len(hit)} rows are ({', '.join(hit)})"
                raise ValueError(f"vs={self.vs!r}: {what} named so (rows: {', '.join(names)})")
            self.vs_row = hit[0]
        return rows

    def row_name(self, row: Entry) -> str:
        """The row's name."""
        return row.name

    def remote(self, rows: list[Entry]) -> dict[int, Any] | None:
        """Every Monte-Carlo row through the executor (None without one)."""
        if self.executor is None:
            return None
        mc = [i for i, e in enumerate(rows) if e.exact_k is None]
        gids = self.ctx.test.generation_ids
        return self.executor(self.setup, [(i, rows[i].name) for i in mc], gids, self.episodes, self.seed)

    def evaluate(self, row: Entry) -> pd.DataFrame | str:
        """An exact row's per-generation frame, or a Monte-Carlo row's episode frame (or its error line)."""
        if row.exact_k is not None:
            return exact_generations(row, self.ctx)
        return run_entry(row, self.ctx, self.episodes, self.seed)

    def result(self, rows: list[Entry], outcomes: list[Any]) -> BenchResult:
        """The rows' statistics beside the SSP bound (and block drafting's bound per h with ``drafting="block"``)."""
        from oracle.dp import solve

        ctx = self.ctx
        sol = solve(ctx.test, ctx.cost_model)
        oracle_df = pd.DataFrame(
            {
                "generation_id": ctx.test.generation_ids,
                "category": ctx.test.categories,
                "v0_ms": sol.cost,
                "ar_ms": sol.ar,
            }
        )
        frames, gens = [], []
        learned_names = set()
        modes: dict[str, str] = {}
        shown: dict[str, int] = {}  # confidences each row reads
        for entry, got in zip(rows, outcomes, strict=True):
            modes[entry.name] = entry.mode
            shown[entry.name] = entry.lookahead
            if entry.exact_k is not None:
                gens.append(got)
                continue
            if isinstance(got, str):
                if not entry.learned:
                    raise ValueError(got)
                _skip(ctx, entry.name.removesuffix(" (learned)"), ctx.policy_dir or Path(), got)
                continue
            if entry.learned:
                learned_names.add(entry.name)
            frames.append(got)
            gens.append(generation_table(got))
        if not gens:
            raise ValueError(_no_match(ctx, self.setup.only or ()))
        episodes_df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        gen_df = pd.concat(gens, ignore_index=True)
        summary, cats = summarise(gen_df, oracle_df, n_boot=self.n_boot, seed=self.seed)
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
        if self.setup.drafting == "block":  # the lower bound of block drafting, for each h a row reads
            for h in sorted({shown[n] for n, md in modes.items() if md == "block"}):
                bsol = solve(ctx.test, ctx.cost_model, lookahead=h, drafting="block")
                per_gen = pd.DataFrame({"category": ctx.test.categories, "v0_ms": bsol.cost, "ar_ms": bsol.ar})
                # its pooled speedup per category, as the bound's below (was NaN in the category table)
                bcat = _pooled_by_category(per_gen, "v0_ms")
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
        beliefs = self._beliefs(sol)
        summary = pd.concat([summary, pd.DataFrame(extra)], ignore_index=True)
        ref = next((n for n in (BELIEF_NAMES[("q",)], BELIEF_NAMES[()]) if n in beliefs), None)
        self.references["belief_reference"] = ref
        ref_pooled = beliefs[ref]["speedup_pooled"] if ref is not None else float("nan")
        at = summary.columns.get_loc("oracle_pct") + 1
        summary.insert(at, "belief_pct", 100.0 * summary["speedup_pooled"] / ref_pooled)
        summary["constant_k"] = pd.Series(
            [int(k) if c else None for k, c in zip(summary["constant_k"], summary["constant"], strict=True)],
            dtype=object,
        )
        self._differences(summary, gen_df, sol, rename)
        ocat = _pooled_by_category(oracle_df, "v0_ms")
        ocat.insert(0, "policy", ORACLE_ROW)
        cats = pd.concat([cats, ocat, *bound_cats], ignore_index=True)
        return BenchResult(
            "single",
            summary,
            self._context(),
            ctx.notes,
            bound=sol.summary() | {"belief_oracle": beliefs},
            generations=gen_df,
            categories=cats,
            episodes=episodes_df,
            skipped=ctx.skipped,
        )

    def _beliefs(self, sol: Any) -> dict[str, dict[str, Any]]:
        """The belief oracle (:mod:`oracle.belief`) of the run's modes, by :data:`BELIEF_NAMES` name.

        Mode none's belief reads the draft depth alone, sequential's and block's the draft's
        confidence; each entry is its plan's exact figures on the true acceptances, the expected
        speedup its belief promised, and its % of the SSP bound ``sol``. A note says what it is.
        """
        from oracle.belief import belief_oracle, fit_belief

        ctx, out = self.ctx, {}
        for signals, modes in (((), ("none",)), (("q",), ("sequential", "block"))):
            if self.setup.drafting is not None and self.setup.drafting not in modes:
                continue
            bo = belief_oracle(ctx.test, ctx.cost_model, fit_belief(ctx.train, signals))
            real = bo.realised
            out[BELIEF_NAMES[signals]] = {
                "modes": list(modes),
                "speedup_pooled": real.speedup_pooled,
                "speedup_mean": float(real.speedup.mean()),
                "oracle_pct": 100.0 * real.speedup_pooled / sol.speedup_pooled,
                "believed_speedup_pooled": bo.planned.speedup_pooled,
                "mean_k": real.mean_k,
                "mean_accepted": real.mean_accepted,
            }
        figures = "; ".join(
            f"{n}: {b['speedup_pooled']:.3f} ({b['oracle_pct']:.1f}% of the bound)" for n, b in out.items()
        )
        ctx.notes.append(
            f"belief oracle, the SSP on a train-split calibration's acceptances, evaluated on the true ones (a "
            f"reference for online controllers, not a bound: oracle/belief.py; column belief_pct): {figures}"
        )
        return out

    def _differences(self, summary: pd.DataFrame, gen_df: pd.DataFrame, sol: Any, rename: dict[str, str]) -> None:
        """The paired-difference columns of ``summary``: to the best fixed k in hindsight and to the peer."""
        gids = np.asarray(self.ctx.test.generation_ids)
        costs = {ORACLE_ROW: np.asarray(sol.cost, dtype=np.float64)}
        for name, d in gen_df.groupby("policy", sort=False):
            c = d.set_index("generation_id")["cost_ms"].reindex(gids).to_numpy(dtype=np.float64)
            if not np.isnan(c).any():  # a row on every test generation
                costs[name] = c
        ar = np.asarray(sol.ar, dtype=np.float64)
        k_best, fixed = best_fixed_in_hindsight(self.ctx)
        _reference_columns(summary, "vs_best_fixed", paired_differences(costs, ar, fixed, self.n_boot, self.seed))
        if self.vs_row is not None:
            peer: str | None = rename.get(self.vs_row, self.vs_row)
        else:
            adaptive = summary[(summary["evaluation"] != "exact") & ~summary["learned"].astype(bool)]
            peer = None if adaptive.empty else str(adaptive.loc[adaptive["speedup_pooled"].idxmax(), "policy"])
        diffs = {} if peer not in costs else paired_differences(costs, ar, costs[peer], self.n_boot, self.seed)
        _reference_columns(summary, "vs_peer", diffs)
        self.references |= {
            "best_fixed_k_test": k_best,
            "best_fixed_k_test_pooled": float(ar.sum() / fixed.sum()),
            "vs": peer,
        }

    def _context(self) -> dict[str, Any]:
        ctx, cost_model = self.ctx, self.ctx.cost_model_arg
        fitted = {"fit-train": "train split", "fit": "all rounds (train and test generations)"}
        return {
            "dataset": ctx.dataset,
            "kmax": ctx.kmax,
            "cost_model": cost_model,
            "cost_model_fitted_on": fitted.get(cost_model, "n/a (not fitted by the benchmark)"),
            "fitted_on": "train split (best fixed k, delta-space lambda, U and acceptance priors, the peers' "
            "thresholds and classifiers, learned policies)",
            "episodes": self.episodes,
            "seed": self.seed,
            "drafting_filter": self.setup.drafting,
            "seeds": "episode_seeds(seed, generation_id, episode): independent per (generation, episode), "
            "common to every policy",
            "statistics": f"fixed-k rows exact (oracle.dp.evaluate_policy); other rows Monte Carlo with 95% "
            f"percentile-bootstrap intervals over test generations (n_boot={self.n_boot})",
            "n_boot": self.n_boot,
            "test_generations": int(ctx.test.n_generations),
            "train_generations": int(ctx.train.n_generations),
            "best_fixed_k_train": ctx.best_fixed_k,
            **self.references,
            "paired_differences": "columns vs_best_fixed and vs_peer: the row's pooled speedup minus the best "
            "fixed k in hindsight's (best_fixed_k_test, exact, chosen on the test generations) and the peer's "
            "(vs), with paired percentile-bootstrap 95% intervals over the same resamples of the test generations",
            "delta_lambda_ms": ctx.lam_ms,
            "delta_lambda_ms_h3": ctx.lam_ms_h3,
            "ar_cost_model_extrapolated": bool(ctx.cost_model.ar_extrapolated),
            "drafting": "each row is charged by the drafting mode it uses (column 'drafting'): none = k chosen "
            "before drafting, T_D(k); sequential = stops after any draft, T_D(tokens drafted); block = h drafts "
            "proposed at once, T_D(max(k, h)). The oracle bound is the bound of none, equal to the bound of "
            "sequential",
        }


def run_benchmark(
    dataset: Any = "paper-default",
    kmax: int | None = None,
    cost_model: str = DEFAULT_COST_MODEL,
    episodes: int = 4,
    seed: int = 0,
    policy_dir: Path | None = None,
    only: list[str] | None = None,
    progress: Progress | None = None,
    n_boot: int = N_BOOT,
    drafting: str | None = None,
    executor: BenchExecutor | None = None,
    vs: str | None = None,
) -> BenchResult:
    """Run the benchmark on the test split of ``dataset``.

    Args:
        dataset: Registry name or trace-set folder, or a loaded :class:`~specenv.traces.traceset.TraceSet`
            (loaded once: the run never loads it again).
        kmax: Largest budget (default: the trace set's Kmax).
        cost_model: ``"fit-train"`` (default: fitted on the train split's rounds), ``"fit"`` (all
            rounds, test generations included), ``"profile"`` or a JSON path.
        episodes: Monte-Carlo episodes per test generation and adaptive policy.
        seed: Base seed of the episodes (:func:`specenv.envs.rollout.episode_seeds`) and of the bootstrap.
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
        vs: The peer of the paired differences: a row's name or a part of exactly one row's name
            (None: the best adaptive row that is not learned).

    Returns:
        The :class:`~policies.bench.result.BenchResult` of family ``"single"``.
    """
    from specenv.cost.model import DRAFTING_MODES

    if episodes < 1:
        raise ValueError(f"episodes={episodes}: must be >= 1")
    if seed < 0:
        raise ValueError(f"seed={seed}: must be >= 0")
    if drafting is not None and drafting not in DRAFTING_MODES:
        raise ValueError(f"drafting={drafting!r}: expected one of {DRAFTING_MODES}")
    pdir = policy_dir if policy_dir is not None else shipped_policy_dir(dataset)
    ctx = build_context(dataset, kmax, cost_model, pdir)
    wanted = tuple(only) if only else None
    setup = BenchSetup(ctx.source, kmax, cost_model, str(pdir), wanted, drafting)
    return run_family(SingleFamily(ctx, setup, episodes, seed, n_boot, executor, vs=vs), progress)
