"""``specenv abtest``: a live A/B of speculation-length controllers through vLLM against what users run today.

A command module (the top layer, like :mod:`specenv.cli`: it may import the oracle and the policies).
The engines are measured with :mod:`specenv.engines.vllm.bench`: every engine is started once in its
own process (:class:`~specenv.engines.vllm.bench.EngineProcess`) and kept alive, so the arms can be
run interleaved (every repeat runs every arm once, the order rotated per repeat) at every batch size.
A timed run on an engine other than the last run's is preceded by an untimed request of
``--warmup-tokens`` tokens on it (not on a recording engine): in a 16-arm run (2026-12-07) the first
groups after a switch of process prefilled 15-35% slower (plain and stock engines' TTFT 330-410 ms
against 270-300 on the controller engine that ran most arms, for the same prompts), which a server
that keeps serving never pays.

Arms (``--arms``; one engine each unless said otherwise):

* ``plain``: no speculation (stock scheduler);
* ``fixed``: stock vLLM with ``num_speculative_tokens = k`` for every k in 1..kmax;
* ``best``: the best static choice on the *train* prompts, per batch size (``--fit measured``:
  ``--fit-repeats`` passes of the train prompts through every fixed-k engine, each run beside a plain run of the
  same batch size (:func:`fit_order`), :func:`best_static_from_ratios`: the k of the best median ratio to plain
  among those that beat plain in every repeat, else k = 0, no speculation; ``--fit replay``: the replay
  oracle's best fixed k,
  the same for every batch size). Its row is the matching engine's measurement (k = 0: plain's own);
* ``dynamic``: vLLM's dynamic speculative decoding (``speculative_config.num_speculative_tokens_per_batch_size``,
  one k per step for the whole batch, looked up by batch size), the table fitted on train like ``best``;
* ``table``: the same table served by specenv's controller (:class:`policies.batch.controllers.DSDBatch`,
  ``draft_horizon="policy"``): a batch size whose k is 0 runs plain steps (no draft forward, no speculative
  path: :mod:`specenv.engines.vllm.lazydraft`), where vLLM's own table still runs its drafter;
* ``adaptive``: vLLM's adaptive verification (``enable_adaptive_verification``): not run where it cannot
  (the row says why);
* ``heuristic``, ``delta`` (oracle lambda and adaptive lambda), ``learned`` (every policy folder under
  ``policies/shipped`` and ``--policy-dir`` that the served model's contract accepts; the others are listed
  with the one-line refusal; ``--learned`` picks some of them by name): through specenv's controller, all on
  one engine with ``num_speculative_tokens = kmax`` and ``draft_horizon="policy"``;
* ``gated``: each of those learned policies gated by the batch size (:class:`policies.batch.controllers.TableGated`:
  k = 0 for a step of n requests where the train-fitted table of ``table`` says 0 at n, the policy's budgets
  elsewhere), so a policy trained at batch 1 does not draft like at batch 1 in a batch where nothing pays;
* ``outcome``: each of those learned policies without a lookahead block served with
  ``draft_horizon="outcome"``: the step's drafts set once the target has verified (the round's outcome
  known) instead of by the horizon asked before it (``"policy"``, every other controller arm);
* ``batch``: the expert-aware batch policy :class:`policies.batch.goodput.BatchGoodput` (a batch policy:
  one ``act_step`` per engine step for all requests, priced by the shipped vLLM batch cost model
  ``live-vllm-batch-v1``, fitted on the same small models; other models: not run) through the
  controller engine, ``draft_horizon="policy"``;
* ``survival``: the learned-survival batch controller (:class:`policies.batch.learn.SurvivalGoodputBatch`),
  trained here on the trace set's train split for the largest batch size (the models' recorded batch
  step-time model where there is one), exported in its numpy form (:mod:`policies.batch.export`,
  ``<out>/survival``: no scikit-learn object at serving time) and served from that folder through the
  controller engine like ``batch``;
* ``fixedctl`` (only when named; not in ``all``): every fixed k in 1..kmax served by specenv's controller
  (:class:`policies.heuristics.FixedK`, ``draft_horizon="policy"``: the drafter asked for exactly k) on the
  one controller engine the learned arms run on: the fixed-k ladder without the placement of eight engines
  between its rungs (identical engines differ by up to ~4.5% a step on this CPU, a bias no repeat averages
  out), for the sim-to-real ordering of fixed k against the learned arms;
* ``overhead``: the specenv path (controller + routing tap + recorder, a numpy MLP policy that always
  answers the best fixed k) against stock vLLM with the same speculative config (the ``best`` k engine):
  throughput ratio per repeat, stock's own run-to-run spread, and the controller's CPU time per step as a
  fraction of the step time with a 95% bootstrap interval over the steps.

Columns: tokens/s (median over repeats), live speedup over plain at the same batch size, the replay
environment's predicted speedup on the same prompts (``specenv/MoESpec-v1`` on the trace set, the
policy run as the controller runs it; the models' recorded batch step-time model, :func:`predict_batch`,
at every batch size when it was recorded with the groups' prefill phases (then the prediction holds the
prefill, as tokens/s does); otherwise the set's cost model at batch 1 and the batch step-time model above
it, or no prediction where none is recorded), live / predicted, the decode phase alone (plain's mean time
per output token over the arm's, and the prediction of the decoding steps),
whether every repeat's outputs equal plain greedy's at the same batch size, and the controller's CPU
per step (% of step time).

Sim-to-real: per batch size the mean and max of ``|live/pred - 1|`` and Spearman's rank correlation over
the predicted arms, for the full model, each ablation of a step-time model (without ``U_r``, without the
per-step overhead) and, when the fit was measured in the run, the full model **calibrated on train**: a
step model is a recording of one machine, and a shared host runs the speculating and the plain steps at
other relative speeds an hour later; the train fit already runs every fixed k beside plain on the train
prompts, so those passes first put the model on this machine's clock (both engines' prefill phases and
the plain step, measured over modelled: :func:`train_clock`), then one factor per batch size on the
speculating engine's decoding is fitted to them (:func:`calibrate_decode`); both apply to every arm's
prediction. No held-out pass is read: it stays a prediction, made with what a user measures before
deploying.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Arm groups of ``--arms`` (all by default).
ARM_GROUPS = (
    "plain", "fixed", "best", "dynamic", "table", "adaptive", "heuristic", "delta", "learned", "gated", "outcome",
    "overhead", "batch", "survival", "fixedctl",
)  # fmt: skip
#: Groups run only when named (``--arms all`` is every other group).
OPT_IN_GROUPS = ("fixedctl",)
#: What ``--arms all`` runs.
ALL_GROUPS = tuple(g for g in ARM_GROUPS if g not in OPT_IN_GROUPS)
FIT_MODES = ("measured", "replay")
#: Why vLLM's adaptive verification does not run on a CPU build of vLLM 0.32.
ADAPTIVE_WHY = (
    "not run: vLLM 0.32 implements enable_adaptive_verification only in the GPU (V2) model runner with "
    "full CUDA graphs and CUDA attention backends (vllm/v1/worker/gpu/model_runner.py); the CPU build runs "
    "the V1 CPU runner (the GPU script covers it)"
)


@dataclass
class AbtestOptions:
    """What ``specenv abtest`` runs (see the module docstring)."""

    models: str = "small-moe-v1"
    dataset: str = "live-cpu"
    prompts: int = 8
    train_prompts: int = 8
    cycle_prompts: bool = False  # more prompts than the test split: the held-out prompts served in turn
    fit_repeats: int = 1  # interleaved passes of the train prompts per (k, batch size) in the measured fit
    fit_kmax: int | None = None  # the measured fit tries k = 1..fit_kmax (None: kmax)
    fit_from: str | None = None  # an earlier abtest.json whose train fit (best k per batch size) is reused
    step_model: str | None = None  # the batch step-time model (name or path; None: the newest shipped for models)
    max_tokens: int = 64
    repeats: int = 3
    batches: list[int] = field(default_factory=lambda: [1, 8])
    arms: list[str] = field(default_factory=lambda: list(ALL_GROUPS))
    kmax: int | None = None
    fit: str = "measured"
    cost_model: str = "fit-train"
    policy_dirs: list[str] = field(default_factory=list)
    learned: list[str] | None = None  # the learned policies to run, by name (None: every accepted one)
    out: str | None = None
    ignore_eos: bool = False
    max_engines: int | None = None  # most engines alive at once (None: as many as memory allows)
    interleave: str = "group"  # the unit the arms alternate in: "group" (of batch requests) or "pass"
    warmup_tokens: int = 16  # an untimed request of this many tokens on an engine another engine ran before (0: off)


#: The units the A/B's arms alternate in when every engine stays up (:func:`interleave_cells`).
INTERLEAVE = ("group", "pass")


# ---------------------------------------------------------------------------------------------- policies
def held_out_prompts(ids: list[int], n: int, cycle: bool = False) -> list[int]:
    """The first ``n`` held-out generation ids; with ``cycle``, the held-out ids served in turn (id ``i mod len``).

    Cycling fills a batch larger than the test split (16 concurrent requests from 10 held-out prompts)
    without touching a train prompt; a repeated prompt is generated anew each time (outputs are still
    compared with plain greedy prompt by prompt). Without ``cycle`` asking for more than there are fails.
    """
    if not ids:
        raise ValueError("no held-out prompts")
    if n < 1:
        raise ValueError(f"prompts: {n} < 1")
    if n > len(ids) and not cycle:
        raise ValueError(f"prompts: {n} exceeds the {len(ids)} held-out prompts (cycle them to serve more)")
    return [int(ids[i % len(ids)]) for i in range(n)]


def learned_policies(dataset: str, policy_dirs: list[str] | None = None) -> dict[str, Path]:
    """The learned arms' candidates by name: the shipped policies of ``dataset`` and of ``live-vllm``, then the user's.

    Shipped ones are named ``<set folder>/<policy>`` (``live-vllm-wide-v1/ppo``): the policies trained on this
    set's train split and on the vLLM-collected set of the same small models ("train on what you serve");
    a ``--policy-dir`` folder's policies by their folder names. Whether the served model accepts each one is
    checked when the A/B runs (a refusal is one line of the table).
    """
    from policies import shipped_policy_dir
    from policies.bench.single import find_policies

    folders: dict[str, Path] = {}
    for ds in dict.fromkeys([dataset, "live-vllm"]):
        set_dir = shipped_policy_dir(ds)
        if set_dir.is_dir():
            folders.update({f"{set_dir.name}/{n}": f for n, f in find_policies(set_dir).items()})
    for d in policy_dirs or []:
        folders.update(find_policies(Path(d)))
    return folders


def fit_order(kmax: int, batches: list[int], repeats: int) -> list[tuple[int, int, tuple[int, int]]]:
    """The measured fit's runs, in order: ``(k, batch size, the two runs (k and 0 = plain) in the order they run)``.

    Every batch size on one k engine before the next k (each k engine starts once a repeat: the pool holds
    fewer engines than there are k, and plain, used beside every k, stays up); each run of k is paired with
    a plain run of the same batch size right beside it, which of the two goes first alternating from one
    pair to the next. The machine's speed drifts by tens of per cent over minutes, so a k is never compared
    with a plain run made minutes before it, and a drift within a pair favours neither side on average.
    """
    out: list[tuple[int, int, tuple[int, int]]] = []
    for _ in range(repeats):
        for k in range(1, kmax + 1):
            for b in batches:
                out.append((k, b, (0, k) if len(out) % 2 == 0 else (k, 0)))
    return out


def repeat_cells(arms: list[Any], batches: list[int], by_batch: bool) -> list[tuple[Any, int]]:
    """One repeat's runs in order, ``(arm, batch size)``: batch size outermost (``by_batch``) or arm by arm.

    Batch size outermost puts the arms compared at one batch size one right after the other (what the paired
    ratios compare); arm by arm needs each engine once a repeat (when the pool cannot keep every engine up).
    """
    if by_batch:
        return [(arm, b) for b in batches for arm in arms]
    return [(arm, b) for arm in arms for b in batches]


def _groups_of(ids: list[int], b: int) -> list[list[int]]:
    """The groups of ``b`` requests a pass over ``ids`` runs one after the other (the last may be shorter)."""
    return [ids[i : i + b] for i in range(0, len(ids), b)]


def timed_run(
    eng: Any, last: Any, ids: list[int], batch: int, max_tokens: int, ignore_eos: bool, warmup_tokens: int
) -> dict[str, Any]:
    """One timed pass of ``ids`` on the engine process ``eng`` (its ``run`` command's answer).

    When ``last`` (the engine of the last timed pass) is another engine, ``eng`` first serves its first
    prompt for ``warmup_tokens`` tokens, untimed (module docstring: a process that has just been switched
    to prefills slower); not when ``warmup_tokens`` is 0, nor on an engine that records (its recording
    keeps the timed requests only).
    """
    if warmup_tokens and last is not None and eng is not last and not eng.cfg.get("settings", {}).get("record"):
        eng.call(op="run", prompt_ids=ids[:1], max_tokens=warmup_tokens, batch=1, ignore_eos=True)
    return eng.call(op="run", prompt_ids=ids, max_tokens=max_tokens, batch=batch, ignore_eos=ignore_eos)


def interleave_cells(arms: list[Any], n_groups: int, rep: int) -> list[tuple[int, Any]]:
    """One batch size's runs in one repeat when the arms alternate group by group: ``(group, arm)`` in order.

    Every group of the pass is run by every arm, one right after the other (this VM's speed drifts by tens of
    per cent over minutes; the paired ratios compare the same group, now seconds apart, not a pass apart),
    the arms' order rotated from group to group and from repeat to repeat, so that no arm always runs first
    (or always right after the same other arm).
    """
    n = len(arms)
    out = []
    for g in range(n_groups):
        r = (g + rep) % n if n else 0
        out += [(g, a) for a in arms[r:] + arms[:r]]
    return out


def lazy_cost_model(path: str) -> str:
    """The cost model of ``path`` as a controller engine pays it: no draft floor at k = 0 (the lazy drafter).

    A set recorded on stock vLLM charges its k = 0 rounds the draft forward vLLM runs in every step
    (``CostModel.d_floor``); the controller engine's lazy drafter (:mod:`specenv.engines.vllm.lazydraft`)
    skips it. Returns ``path`` itself when the model has no floor, else a sibling ``<stem>-lazy-draft.json``
    with ``d_floor = 0`` (a named cost model such as ``fit-train`` is returned as it is).
    """
    from specenv.cost.model import CostModel

    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return path
    cm = CostModel.load(p)
    if cm.d_floor == 0:
        return path
    lazy = p.with_name(f"{p.stem}-lazy-draft.json")
    dataclasses.replace(cm, d_floor=0.0).save(lazy)
    return str(lazy)


def best_static_k(tok_per_s: dict[int, Any]) -> int:
    """The best static choice on train at one batch size, k = 0 (no speculation) included.

    ``tok_per_s[k]``: the train tokens/s of fixed k (k = 0: the plain engine), one value or one per repeat
    (the repeats of every k paired by position: repeat r of k against repeat r of plain). A k > 0 is
    eligible only where it beat plain in **every** repeat; the choice is the eligible k of the largest
    median ratio to plain (ties: the smaller k), else k = 0. With one repeat that is the fastest k.

    What a user who measured their workload would deploy: speculation off where no k wins reliably.

    Raises:
        ValueError: No plain (k = 0) measurement, repeat counts that differ, or a rate that is not finite
            and positive.
    """
    runs = {k: np.atleast_1d(np.asarray(v, dtype=np.float64)) for k, v in tok_per_s.items()}
    if 0 not in runs:
        raise ValueError("best_static_k: no plain (k = 0) measurement")
    n = {len(v) for v in runs.values()}
    if len(n) != 1 or 0 in n:
        raise ValueError(f"best_static_k: every k needs the same number of repeats (got {sorted(n)})")
    bad = {k: v.tolist() for k, v in runs.items() if not (np.all(np.isfinite(v)) and np.all(v > 0))}
    if bad:
        raise ValueError(f"best_static_k: tokens/s must be finite and > 0 (got {bad})")
    return best_static_from_ratios({k: v / runs[0] for k, v in runs.items() if k != 0})


def best_static_from_ratios(ratios: dict[int, Any]) -> int:
    """:func:`best_static_k`'s rule on the per-repeat ratios of every k > 0 to plain decoding (k = 0 if none wins).

    ``ratios[k]``: k's tokens/s over plain's, one per repeat (``--fit measured`` pairs each run of k with a
    plain run right beside it in time, so the machine's drift between runs minutes apart does not enter).
    A k is eligible only where every ratio is above 1; the choice is the eligible k of the largest median
    ratio (ties: the smaller k).

    Raises:
        ValueError: A k of no ratio, or a ratio that is not finite and positive.
    """
    r = {int(k): np.atleast_1d(np.asarray(v, dtype=np.float64)) for k, v in ratios.items()}
    bad = {k: v.tolist() for k, v in r.items() if k < 1 or not len(v) or not np.all(np.isfinite(v) & (v > 0))}
    if bad:
        raise ValueError(f"best_static_k: every k >= 1 needs finite ratios > 0 to plain (got {bad})")
    wins = {k: float(np.median(v)) for k, v in r.items() if np.all(v > 1.0)}
    return min(wins, key=lambda k: (-wins[k], k)) if wins else 0


def step_model_for(models: str, given: str | None, kmax: int, batches: list[int]) -> tuple[str | None, Any]:
    """The batch step-time model the A/B predicts with: ``(name or path, model)``, or ``(None, None)``.

    ``given`` (``--step-model``): a shipped recording's name, a recording folder (its ``batchcost.json``,
    e.g. one just made on this machine by ``scripts/collect_vllm_batch.py --plain`` and ``specenv batch fit
    --timing step``) or a batch-cost JSON; None: the newest shipped recording of ``models``
    (:func:`specenv.replay.batch.step_time_recording`). A given model must be a step-time model (the plain
    engine's step fitted), cover ``kmax`` and the largest batch size, and, where its folder's manifest names
    the models it was recorded on, name ``models``.

    Raises:
        ValueError: One line naming ``given`` and what is wrong.
    """
    from specenv.cost.batch import load_batch_cost_model
    from specenv.replay.batch import recording_manifest, step_time_recording

    if given is None:
        name = step_time_recording(models)
        return name, (None if name is None else load_batch_cost_model(name))
    model = load_batch_cost_model(given)
    if model.ar_step is None:
        raise ValueError(
            f"{given}: not a step-time model (no plain engine step; record with scripts/collect_vllm_batch.py "
            "--plain and fit with `specenv batch fit --timing step`)"
        )
    if model.kmax < kmax:
        raise ValueError(f"{given}: kmax {model.kmax} < the served kmax {kmax}")
    if model.max_batch < max(batches):
        raise ValueError(f"{given}: recorded up to batch {model.max_batch}, not {max(batches)}")
    info = recording_manifest(given)  # (one line naming it when unreadable)
    recorded = None if info is None else (info.get("extra") or {}).get("models")
    if recorded is not None and recorded != models:
        raise ValueError(f"{given}: recorded on {recorded!r}, not {models!r}")
    return str(given), model


def fit_from_file(
    path: str | os.PathLike[str],
    models: str,
    dataset: str,
    kmax: int,
    batches: list[int],
    max_tokens: int | None = None,
) -> dict:
    """The train fit of an earlier ``abtest.json`` (``--fit-from``): its ``fit`` section, checked for this run.

    The fit is a measurement on the *train* prompts, so a later run on the held-out prompts may reuse it (as a
    user deploys what they measured earlier) instead of measuring it again. It must be of the same models,
    trace set and kmax, and cover every batch size of this run; and, when ``max_tokens`` is given, measured
    at the same generation length (the prefill's share of a pass, and so the best k, changes with it).

    Raises:
        ValueError: One line naming the file: unreadable, no fit, or a fit of other models / set / kmax /
            batch sizes.
    """
    try:
        doc = json.loads(Path(path).read_text())
        fit, o = doc["fit"], doc["options"]
        best = {int(b): int(k) for b, k in fit["best_k"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not an abtest.json with a train fit ({type(exc).__name__}: {exc})") from None
    theirs = {"models": o.get("models"), "traces": o.get("dataset"), "kmax": doc.get("kmax")}
    ours: dict[str, Any] = {"models": models, "traces": dataset, "kmax": kmax}
    if max_tokens is not None:
        theirs["max_tokens"], ours["max_tokens"] = o.get("max_tokens"), int(max_tokens)
    for key, val in ours.items():
        if theirs[key] != val:
            raise ValueError(f"{path}: fitted for {key} {theirs[key]!r}, this run has {val!r}")
    if any(k < 0 or k > kmax for k in best.values()):
        raise ValueError(f"{path}: best k {best} outside 0..{kmax}")
    missing = sorted(set(batches) - set(best))
    if missing:
        raise ValueError(f"{path}: no fit for batch sizes {missing} (fitted: {sorted(best)})")
    return {**fit, "best_k": best, "from": str(path)}


def dsd_table(best_k: dict[int, int], max_batch: int) -> list[tuple[int, int, int]]:
    """The dynamic-SD table of vLLM (``num_speculative_tokens_per_batch_size``) from the best k per batch size.

    Ranges ``(lo, hi, k)`` cover 1..``max_batch``: each measured batch size owns the sizes up to halfway to the
    next one, the last one the rest. k = 0 entries are kept (vLLM 0.32 accepts values >= 0,
    ``validate_and_normalize_dynamic_sd_schedule``).
    """
    lo_hi = sorted(best_k.items())
    table: list[tuple[int, int, int]] = []
    for i, (b, k) in enumerate(lo_hi):
        lo = 1 if i == 0 else table[-1][1] + 1
        hi = max_batch if i == len(lo_hi) - 1 else (b + lo_hi[i + 1][0]) // 2
        table.append((lo, hi, int(k)))
    return table


def make_policy(desc: dict[str, Any], ctl: Any) -> Any:
    """A policy object from its JSON description, for a controller (runs in the engine process)."""
    from specenv.observation.single import ObservationSpec

    kind = desc["kind"]
    if kind == "mlp":  # carries its own contract (checked by the controller against the served model)
        from specenv.policy.mlp import MLPPolicy

        return MLPPolicy.load(desc["folder"])
    spec = ObservationSpec(int(desc["kmax"]), 0, int(desc["max_new_tokens"]), int(ctl.n_experts or 128))
    if kind == "fixed":
        from policies.heuristics import FixedK

        return FixedK(spec, int(desc["k"]))
    if kind == "heuristic":
        from policies.heuristics import TransformersHeuristic

        return TransformersHeuristic(spec)
    if kind == "delta":
        from policies.delta import DeltaSpaceRule
        from specenv.cost.model import CostModel

        return DeltaSpaceRule(
            spec,
            CostModel.load(desc["cost_model"]),
            lam_ms=desc.get("lam_ms"),
            adaptive=bool(desc.get("adaptive", False)),
            u_prior=np.asarray(desc["u_prior"]),
            rho_prior=np.asarray(desc["rho_prior"]),
        )
    if kind == "batch-goodput":
        from policies.batch.goodput import BatchGoodput
        from specenv.cost.batch import load_batch_cost_model

        u_prior = desc.get("u_prior")
        bm = load_batch_cost_model(desc.get("batch_cost_model", "live-vllm-batch-v1"))
        return BatchGoodput(
            spec,
            bm,
            u_prior=None if u_prior is None else np.asarray(u_prior),
            # the recording's median wall time per step outside the forwards (0 when it has none, and for a
            # step-time model, whose verification already carries the overhead by batch size)
            step_overhead_ms=0.0
            if bm.overhead is not None and bm.overhead.any()
            else float(bm.diagnostics.get("summary", {}).get("overhead_ms", 0.0)),
        )
    if kind == "batch-survival":  # the exported controller (numpy forward pass), checked against the served spec
        from policies.batch.export import make_batch_survival

        return make_batch_survival(spec, desc["folder"])
    if kind == "table-gated":  # a learned MLP switched off where the train-fitted table says k = 0 (the step's n)
        from policies.batch.controllers import TableGated
        from specenv.observation.batch import BatchObservationSpec
        from specenv.policy.mlp import MLPPolicy

        inner = MLPPolicy.load(desc["folder"])
        return TableGated(BatchObservationSpec(inner.spec, int(desc["batch_size"])), inner, desc["schedule"])
    if kind == "dsd-table":  # vLLM's dynamic-SD table served by the controller: one k per step by batch size
        from policies.batch.controllers import DSDBatch
        from specenv.observation.batch import BatchObservationSpec

        return DSDBatch(BatchObservationSpec(spec, int(desc["batch_size"])), desc["schedule"])
    if kind == "constant-mlp":  # a real MLP call (obs build + 3 layers) whose answer is always k
        from specenv.policy.mlp import MLPPolicy

        k, kmax = int(desc["k"]), int(desc["kmax"])
        rng = np.random.default_rng(0)
        b = np.full(kmax + 1, -10.0)
        b[k] = 10.0
        layers = [
            (rng.normal(size=(spec.dim, 64)) * 0.01, np.zeros(64)),
            (rng.normal(size=(64, 64)) * 0.01, np.zeros(64)),
            (rng.normal(size=(64, kmax + 1)) * 0.01, b),
        ]
        return MLPPolicy(spec, layers, name=f"constant-mlp-k{k}")
    raise ValueError(f"unknown policy kind {kind!r}")


def replay_policy(desc: dict[str, Any], spec: Any) -> Any:
    """The same policy as :func:`make_policy`, built for the replay environment's observation spec."""

    class _Ctl:
        n_experts = spec.n_experts

    return make_policy({**desc, "kmax": spec.kmax, "max_new_tokens": spec.max_new_tokens}, _Ctl())


# ---------------------------------------------------------------------------------------------- replay
def _replay_env_args(
    policy: Any, dataset: str, kmax: int, cost_model: str, split: str = "test"
) -> tuple[dict[str, Any], int]:
    """``specenv/MoESpec-v1``'s arguments to replay a policy on a split (the test split), and its lookahead h.

    A block policy reads h draft signals and pays T_D(max(k, h)): the environment drafts in block mode.
    """
    from specenv.policy.base import policy_spec

    spec = policy_spec(policy)  # a batch row's (TableGated) per-request contract
    h = int(getattr(spec, "lookahead", 0))
    kw = dict(
        dataset=dataset,
        kmax=kmax,
        split=split,
        cost_model=cost_model,
        lookahead=h or None,
        drafting="block" if h else None,
        signals=tuple(getattr(spec, "signals", ("q",))),
    )
    return kw, h


def predicted_speedup(
    dataset: str,
    cost_model: str,
    kmax: int,
    gids: list[int],
    policy: Any,
    max_tokens: int | None = None,
    split: str = "test",
    draft_horizon: str | None = "policy",
) -> float:
    """Replay-predicted speedup (model AR cost / model cost) of a policy on some generations (of ``split``).

    The policy is replayed as the controller serves it (:class:`specenv.envs.served.ServedGroup` of one
    request, ``draft_horizon`` its setting): each round verifies the policy's k capped at the drafts proposed
    for it (``"policy"``: the horizon asked before the previous round's outcome; ``"outcome"``: asked after
    it) and pays the draft time of those drafts, ``T_D(h)``, in place of the environment's ``T_D(k)``; None:
    the environment's own rounds (k as asked, ``T_D(k)``).

    ``max_tokens``: replay only each generation's first ``max_tokens`` tokens, as the live run
    generates them (the round that reaches it is charged in full, its AR cost counts the tokens up to
    ``max_tokens``); None: the whole recorded generation.
    """
    import gymnasium as gym

    import specenv  # noqa: F401  (registers the environments)
    from specenv.cost.model import drafted_tokens
    from specenv.envs.served import ServedGroup

    kw, _ = _replay_env_args(policy, dataset, kmax, cost_model, split)
    env = gym.make("specenv/MoESpec-v1", **kw)
    data = env.unwrapped.data
    cm = data.cost_model
    group = ServedGroup([env], lambda: policy, top_k=_top_k(dataset) or 1, draft_horizon=draft_horizon)
    row_of = {int(g): i for i, g in enumerate(data.generation_ids)}
    cost = ar = 0.0
    for g in gids:
        group.reset([int(g)], max_tokens)
        while group.running:
            st = group.step()
            info = st.infos[0]
            # the environment charged T_D of its own drafting; the served round pays T_D of what was drafted
            cost += info["cost_ms"]
            if draft_horizon is not None:
                charged = drafted_tokens(int(info["k"]), data.lookahead, data.drafting)
                cost += float(cm.draft_ms(st.drafted)) - float(cm.draft_ms(charged))
        i = row_of[int(g)]
        n = int(data.lengths[i]) if max_tokens is None else min(int(max_tokens), int(data.lengths[i]))
        ar += float(np.sum(data.ar_ms[data.offsets[i] : data.offsets[i] + n]))
    env.close()
    return ar / cost


@dataclass(frozen=True)
class BatchPrediction:
    """A lockstep replay's prediction of one arm at one batch size (:func:`predict_batch`).

    Attributes:
        speedup: What the live tokens/s ratio measures: plain's (prefill + decoding) time over the arm's.
        decode_speedup: The decoding steps alone: plain's decoding time over the arm's, each group's
            decoding lasting until its last request ends (the decoding phase's share of the tokens/s).
        decode_ms: The arm's decoding steps, summed over the groups.
        ar_decode_ms: The plain engine's decoding steps, summed.
        prefill_ms: The arm's engine's prefill phases (the engine with the drafter), summed; 0.0 when
            the batch model has no prefill term.
        ar_prefill_ms: The plain engine's prefill phases, summed.
        ar_steps: The plain engine's decoding steps, summed over the groups (each group's longest request).
        groups: The request groups replayed.
        tpot_speedup: What the live time per output token measures: the mean over requests of plain's
            time per output token over the mean of the arm's, each request's time counted from its first
            decoding step to its own last (a request that finishes early in a speculating group stops
            its clock; on the plain engine every request of a group ends with it). Above
            ``decode_speedup`` at B > 1 when the requests' acceptances differ; equal to it at B = 1.
            None: not computed.
    """

    speedup: float
    decode_speedup: float
    decode_ms: float
    ar_decode_ms: float
    prefill_ms: float
    ar_prefill_ms: float
    ar_steps: int = 0
    groups: int = 0
    tpot_speedup: float | None = None

    def with_decode(self, decode_speedup: float) -> BatchPrediction:
        """The same prefill phases and plain decoding, the arm's decoding priced by another model's ratio.

        The arm's decoding time becomes ``ar_decode_ms / decode_speedup`` (e.g. the ratio of a trace
        set's own B = 1 cost model, fitted on many more single-request rounds than a batch recording
        holds), and the tokens/s speedup is recomputed with this prediction's prefill phases and clock.
        The time per output token ratio becomes the same ratio (one request per group, as at B = 1).
        """
        if not (np.isfinite(decode_speedup) and decode_speedup > 0):
            raise ValueError(f"decode_speedup={decode_speedup!r}: must be finite and > 0")
        decode_ms = self.ar_decode_ms / float(decode_speedup)
        return dataclasses.replace(
            self,
            speedup=(self.ar_prefill_ms + self.ar_decode_ms) / (self.prefill_ms + decode_ms),
            decode_speedup=float(decode_speedup),
            decode_ms=decode_ms,
            tpot_speedup=float(decode_speedup),
        )

    def calibrated(self, r: float, clock: ClockFactors | None = None) -> BatchPrediction:
        """The same prediction with the arm's decoding steps ``r`` times as long (:func:`calibrate_decode`).

        ``r`` is the speculating engine's step against the plain engine's, as measured on this machine
        now over what the model prices it at. ``clock`` (:func:`train_clock`), when given, first puts
        the model on this machine's clock: both engines' prefill phases and the plain engine's decoding
        steps scaled by their measured factors, the arm's decoding steps by the plain one's (``r``
        stays the relative factor). Without it the plain steps and both prefill phases are kept.
        """
        if not (np.isfinite(r) and r > 0):
            raise ValueError(f"r={r!r}: must be finite and > 0")
        c = clock or ClockFactors()
        ar_decode_ms = self.ar_decode_ms * c.step_plain
        decode_ms = self.decode_ms * float(r) * c.step_plain
        prefill_ms = self.prefill_ms * c.prefill_spec
        ar_prefill_ms = self.ar_prefill_ms * c.prefill_plain
        return dataclasses.replace(
            self,
            speedup=(ar_prefill_ms + ar_decode_ms) / (prefill_ms + decode_ms),
            decode_speedup=self.decode_speedup / float(r),
            decode_ms=decode_ms,
            ar_decode_ms=ar_decode_ms,
            prefill_ms=prefill_ms,
            ar_prefill_ms=ar_prefill_ms,
            tpot_speedup=None if self.tpot_speedup is None else self.tpot_speedup / float(r),
        )


@dataclass(frozen=True)
class ClockFactors:
    """This machine's clock over a step model's, measured on the train fit's passes (:func:`train_clock`).

    Attributes:
        prefill_spec: The engine with the drafter: its measured prefill phase per group over the model's.
        prefill_plain: The plain engine's prefill phase per group, measured over modelled.
        step_plain: The plain engine's decoding step (mean time per output token), measured over modelled.
    """

    prefill_spec: float = 1.0
    prefill_plain: float = 1.0
    step_plain: float = 1.0

    def __post_init__(self) -> None:
        for name, v in dataclasses.asdict(self).items():
            if not (np.isfinite(v) and v > 0):
                raise ValueError(f"clock {name}={v!r}: must be finite and > 0")


#: One arm's prediction at one batch size: (tokens/s speedup, decode-phase speedup), None: not predicted.
Pred = tuple[float, float] | None

#: The bounds of the calibration factor :func:`calibrate_decode` searches.
CALIBRATION_BOUNDS = (0.25, 4.0)


def calibrate_decode(
    measured: dict[int, list[float]], predicted: dict[int, BatchPrediction], clock: ClockFactors | None = None
) -> float:
    """The factor ``r`` on the speculating engine's decoding steps that fits the train fit's measured ratios.

    A step-time model is one recording of a shared machine: an hour later the same host may run the
    speculating steps and the plain step at other speeds, and not in proportion (measured here: 15-25%
    faster ten minutes after a recording, the k-step / plain-step ratio off by up to 11%). The A/B's
    measured train fit runs every fixed k beside plain on the *train* prompts in the same run; this
    finds the one ``r`` (per batch size) that makes the model's predictions of those runs
    (:meth:`BatchPrediction.calibrated`) closest to them: least squares of ``log(measured) -
    log(predicted(r))`` over every k and pass, bounded to :data:`CALIBRATION_BOUNDS`
    (``scipy.optimize.minimize_scalar``), on this machine's clock when ``clock`` is given (measured on
    the same train passes, :func:`train_clock`). No held-out pass is read.

    Args:
        measured: Per k, the train passes' tokens/s ratios (k over the plain run beside it).
        predicted: Per k, the model's prediction of the same train prompts at that k.
        clock: The prefill and plain-step factors applied first (None: the model's clock).

    Raises:
        ValueError: No k with both a measurement and a prediction, or a ratio that is not positive.
    """
    from scipy.optimize import minimize_scalar

    pairs = [(predicted[k], float(m)) for k, ms in measured.items() if k in predicted for m in ms]
    if not pairs:
        raise ValueError("calibration: no fixed k with both a measured train ratio and a prediction")
    if any(not (np.isfinite(m) and m > 0) for _, m in pairs):
        raise ValueError("calibration: measured ratios must be finite and > 0")

    def loss(log_r: float) -> float:
        r = float(np.exp(log_r))
        return float(sum((np.log(m) - np.log(p.calibrated(r, clock).speedup)) ** 2 for p, m in pairs))

    lo, hi = (float(np.log(x)) for x in CALIBRATION_BOUNDS)
    res = minimize_scalar(loss, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
    return float(np.exp(res.x))


def predict_batch(
    dataset: str,
    cost_model: str,
    kmax: int,
    gids: list[int],
    make_policy: Callable[[], Any],
    max_tokens: int | None,
    batch: int,
    batch_cost: Any,
    joint: bool = False,
    split: str = "test",
    draft_horizon: str | None = "policy",
) -> BatchPrediction:
    """Replay-predicted speedup of a per-request policy served ``batch`` requests at a time, as the A/B serves them.

    The live pass (:func:`specenv.engines.vllm.bench.timed_pass`) submits the prompts in groups of
    ``batch`` and runs each group to its end. Here every request of a group replays its generation in
    its own ``specenv/MoESpec-v1`` episode (its own policy from ``make_policy``, the same acceptances
    as at batch 1), the requests move in lockstep (one round each per engine step, a finished request
    leaves the step), and each step is priced by the batch step-time model ``batch_cost``
    (:class:`specenv.cost.batch.BatchCostModel`: the verification of every request's ``k_i + 1``
    positions over the predicted expert union, the engine's per-step overhead at that many requests,
    and the drafting. The requests are served as the controller serves them
    (:class:`specenv.envs.served.ServedGroup`): vLLM's drafter runs one draft length for the whole batch,
    fixed when the step is scheduled -- the largest horizon of the step's requests (the policy's k after
    the round now verifying if all of its drafts were accepted; a step whose horizon is 0 drafts nothing:
    the lazy drafter) -- and each request verifies its k capped at it; a policy with a lookahead h drafts
    its block in the steps it reads (a policy whose ``observes_at(n)`` is False for the step's n requests,
    a gated policy's shut gate, drafts nothing there). ``draft_horizon="outcome"``: the controller's setting
    of that name, the step's drafts asked once the previous round's outcome is known. None: every step
    drafts its largest k and every request verifies the k it asked for (the replay environment's drafting).
    The reference is the plain engine serving the same groups: one token per running request per
    step, :meth:`~specenv.cost.batch.BatchCostModel.ar_ms` of their contexts. When the model has a
    prefill term (:meth:`~specenv.cost.batch.BatchCostModel.prefill_ms`), every group first pays its
    prefill phase, on the engine with the drafter for the arm and on the plain engine for the
    reference, from the group's prompt tokens (the recorded contexts ``L0``); the first token, which
    the prefill step samples, is also counted among the decoding steps on both sides (one step in
    ``max_tokens``, the same on both).

    Args:
        dataset: The trace set (its test split holds the generations).
        cost_model: The set's cost model (the episodes' rounds; their times are not used).
        kmax: Largest budget.
        gids: Generation ids, in the order the live pass serves them.
        max_tokens: Tokens each request generates (None: its whole recorded generation).
        make_policy: Builds one fresh policy (one per request: per-request policies hold state).
        batch: Requests per group.
        batch_cost: The batch step-time model.
        joint: A batch policy (e.g. :class:`policies.batch.goodput.BatchGoodput`): one policy per group,
            asked once per step with the stacked observations of the step's requests (``ids``: their
            places in the group), as the controller serves it; False: one policy per request.
        split: The split holding ``gids`` (``"train"``: the calibration on the train fit's passes).
        draft_horizon: The controller's setting (``"policy"`` or ``"outcome"``), None: the replay environment's
            drafting (see above), for comparison.
    """
    import gymnasium as gym

    import specenv  # noqa: F401  (registers the environments)
    from specenv.envs.served import ServedGroup

    kw, _ = _replay_env_args(make_policy(), dataset, kmax, cost_model, split)
    b = max(int(batch), 1)
    envs = [gym.make("specenv/MoESpec-v1", **kw) for _ in range(min(b, len(gids)))]
    data = envs[0].unwrapped.data
    row_of = {int(g): i for i, g in enumerate(data.generation_ids)}
    group = ServedGroup(envs, make_policy, joint=joint, top_k=_top_k(dataset) or 1, draft_horizon=draft_horizon)
    cost = ar = pre = ar_pre = 0.0
    ar_steps = n_groups = 0
    tpot: list[float] = []  # per request: its decoding time over its tokens, the arm's
    ar_tpot: list[float] = []  # and the plain engine's
    for g0 in range(0, len(gids), b):
        members = [int(g) for g in gids[g0 : g0 + b]]
        group.reset(members, max_tokens)
        n_tok = group.n_tok
        clock = np.zeros(len(members))  # each request's decoding time so far (the steps it was in)
        while group.running:
            st = group.step()
            us = np.array([float(info["U_r"]) for info in st.infos])
            Ls = np.array([float(info["L"]) for info in st.infos])
            ks = np.array([int(info["k"]) for info in st.infos], dtype=np.int64)
            # every request of the step drafted the step's horizon (or the policy's block)
            step = batch_cost.step_ms(ks, np.full(len(ks), st.drafted, dtype=np.int64), us, Ls)
            cost += step
            clock[st.rows] += step
        L0 = np.array([float(data.L0[row_of[g]]) for g in members])
        pre += batch_cost.prefill_ms(float(L0.sum()), "spec")
        ar_pre += batch_cost.prefill_ms(float(L0.sum()), "plain")
        n = np.array(n_tok)
        ar_clock = np.zeros(len(members))
        for s in range(int(n.max())):  # the plain engine: one token per running request per step
            on = n > s
            step = batch_cost.ar_ms(L0[on] + s)
            ar += step
            ar_clock[on] += step
        tpot.extend(clock / n)
        ar_tpot.extend(ar_clock / n)
        ar_steps += int(n.max())
        n_groups += 1
    for env in envs:
        env.close()
    return BatchPrediction(
        speedup=(ar_pre + ar) / (pre + cost),
        decode_speedup=ar / cost,
        decode_ms=cost,
        ar_decode_ms=ar,
        prefill_ms=pre,
        ar_prefill_ms=ar_pre,
        ar_steps=ar_steps,
        groups=n_groups,
        tpot_speedup=float(np.mean(ar_tpot) / np.mean(tpot)),
    )


#: The reference arm's name: the plain engine, no speculation.
PLAIN_ARM = "plain (no speculation)"

#: How far the live plain engine's clock may sit from the batch step model's before the A/B warns.
CLOCK_TOLERANCE = 0.10


def clock_check(pred: BatchPrediction, plain: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The live plain engine's clock against the batch step model's plain engine, on the same groups.

    A step-time model is a recording of one machine: the ratios it predicts (a verification of P
    positions against a plain step) hold on another machine only when that machine's plain step costs
    what the recording's did. This compares the plain arm's measured decode step (mean time per output
    token over every request and repeat) with the model's mean plain step over the same groups
    (``ar_decode_ms / ar_steps``), and its prefill phase (per group, the last first token: the mean over
    groups and repeats of the group's largest time to first token) with the model's (``ar_prefill_ms /
    groups``).

    Args:
        pred: Any arm's :func:`predict_batch` result at this batch size (its plain side is the reference).
        plain: The plain arm's passes at this batch size (each with ``requests``: ``group``, ``ttft_ms``,
            ``tpot_ms``).

    Returns:
        ``{"live_step_ms", "model_step_ms", "step_ratio", "live_prefill_ms", "model_prefill_ms",
        "prefill_ratio", "off"}`` (ratios live / model; ``off``: either ratio outside ``1 +-
        CLOCK_TOLERANCE``), or None without request timings or a prediction of the plain engine's steps.
    """
    if pred.ar_steps <= 0 or pred.groups <= 0:
        return None
    tpot = _mean_tpot(plain)
    live_pre = _prefill_per_group(plain)
    if tpot is None or live_pre is None:
        return None
    model_step = pred.ar_decode_ms / pred.ar_steps
    model_pre = pred.ar_prefill_ms / pred.groups
    step_ratio = tpot / model_step
    pre_ratio = live_pre / model_pre if model_pre > 0 else None
    ratios = [x for x in (step_ratio, pre_ratio) if x is not None]
    return {
        "live_step_ms": tpot,
        "model_step_ms": model_step,
        "step_ratio": step_ratio,
        "live_prefill_ms": live_pre,
        "model_prefill_ms": model_pre if model_pre > 0 else None,
        "prefill_ratio": pre_ratio,
        "off": any(abs(x - 1.0) > CLOCK_TOLERANCE for x in ratios),
    }


def _prefill_per_group(passes: list[dict[str, Any]]) -> float | None:
    """A group's prefill phase as a pass shows it, the mean over every group of every pass (ms).

    A group's is its last first token (the largest time to first token of its requests); None without
    request timings.
    """
    firsts: dict[tuple[int, int], float] = {}
    for i, r in enumerate(passes):
        for q in r.get("requests", []):
            if q and q.get("ttft_ms") is not None:
                key = (i, int(q.get("group", 0)))
                firsts[key] = max(firsts.get(key, 0.0), float(q["ttft_ms"]))
    return float(np.mean(list(firsts.values()))) if firsts else None


def train_clock(pred: BatchPrediction, plain: list[dict[str, Any]], spec: list[dict[str, Any]]) -> ClockFactors | None:
    """This machine's clock over the step model's, from the train fit's passes of one batch size.

    The A/B's measured fit runs every fixed k beside plain on the train prompts; the same comparison
    as :func:`clock_check` on those passes (the plain engine's decoding step and prefill phase per
    group, measured over modelled) gives the plain engine's factors, and the speculating engines'
    passes (every fixed k) give the drafter engine's prefill factor (its prefill phase does not
    depend on k). A step model recorded on another machine, or on this one at another load, is
    put on this machine's clock by them before the decoding factor ``r`` is fitted
    (:func:`calibrate_decode`). No held-out pass is read.

    Args:
        pred: A prediction of the train prompts at this batch size (any k: its plain side and its
            prefill phases are the same for every k).
        plain: The plain engine's train passes (each with ``requests``: ``group``, ``ttft_ms``, ``tpot_ms``).
        spec: The speculating engines' train passes.

    Returns:
        The factors, or None when a side lacks request timings or the model lacks a prefill term or
        the plain steps.
    """
    checked = clock_check(pred, plain)
    live_spec = _prefill_per_group(spec)
    if checked is None or checked["prefill_ratio"] is None or live_spec is None or pred.prefill_ms <= 0:
        return None
    return ClockFactors(
        prefill_spec=live_spec / (pred.prefill_ms / pred.groups),
        prefill_plain=float(checked["prefill_ratio"]),
        step_plain=float(checked["step_ratio"]),
    )


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class _Arm:
    name: str
    engine: str
    group: str
    policy: dict[str, Any] | None = None  # controller engines: the policy description
    predict: dict[str, Any] | None = None  # what the replay runs (a policy description), None: 1.0
    k_by_batch: dict[int, int] | None = None  # fixed-k-per-batch arms (best, dynamic)
    draft_horizon: str = "policy"  # controller engines: how the step's drafts are set (SpecenvSettings)


class EnginePool:
    """The A/B's engines, at most ``max_alive`` alive at once: memory stays bounded, the arms interleaved.

    An engine is started on first use from the configuration it was defined with; when the pool is
    full, the engine used least recently is closed first and started again when an arm needs it
    (each start is warmed up before anything is measured). ``max_alive=None`` decides from the first
    engine's resident memory: as many as fit in 70% of the memory available then (at least 2).

    Args:
        launch: Starts (and warms up) one engine: ``launch(name, cfg) -> EngineProcess``.
        max_alive: Most engines alive at once (None: from memory, see above).
    """

    def __init__(self, launch: Any, max_alive: int | None = None):
        self._launch = launch
        self.max_alive = max_alive
        self._cfg: dict[str, dict[str, Any]] = {}
        self._alive: dict[str, Any] = {}  # in use order, least recent first
        self.infos: dict[str, Any] = {}
        self.restarts = 0

    def get(self, name: str, cfg: dict[str, Any] | None = None) -> Any:
        """The engine ``name`` (defined by ``cfg`` on first use), started if needed."""
        if cfg is not None:
            self._cfg.setdefault(name, cfg)
        if name in self._alive:
            self._alive[name] = self._alive.pop(name)  # most recent
            return self._alive[name]
        if name not in self._cfg:
            raise KeyError(f"engine {name!r} was never defined")
        while self._alive and self.max_alive is not None and len(self._alive) >= self.max_alive:
            old = next(iter(self._alive))
            self._alive.pop(old).close()
        if name in self.infos:
            self.restarts += 1
        eng = self._launch(name, self._cfg[name])
        self._alive[name] = eng
        self.infos[name] = eng.info
        if self.max_alive is None:
            self.max_alive = _engines_that_fit(float((eng.info or {}).get("rss_mb", 0.0)))
        return eng

    def close(self) -> None:
        """Close every engine still alive."""
        while self._alive:
            self._alive.pop(next(iter(self._alive))).close()


def _engines_that_fit(rss_mb: float) -> int:
    """How many engines of ``rss_mb`` fit in 70% of the memory available now (at least 2)."""
    from specenv.engines.vllm.settings import available_memory_bytes

    avail = available_memory_bytes()
    if not avail or rss_mb <= 0:
        return 2
    return max(2, int(0.7 * avail / (rss_mb * 2**20)))


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        import sys

        print(f"[abtest {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_abtest(
    opts: AbtestOptions, quiet: bool = False, progress: Callable[[str, int, int], None] | None = None
) -> dict[str, Any]:
    """Run the A/B (see the module docstring); returns the JSON document behind the table.

    ``progress(phase, done, total)`` is called as each measured run ends: phase ``train fit`` (the
    train prompts through every fixed-k engine, ``--fit measured``), then ``repeats`` (every arm at
    every batch size, ``--repeats`` times).
    """
    from policies.bench.context import build_context
    from specenv.engines.vllm.bench import EngineProcess, join_passes
    from specenv.engines.vllm.settings import policy_refusal
    from specenv.policy.mlp import MLPPolicy

    t_start = time.time()
    out = Path(opts.out) if opts.out else Path(tempfile.mkdtemp(prefix="specenv-abtest-"))
    out.mkdir(parents=True, exist_ok=True)
    if opts.cost_model == "vllm":  # the cost model fitted on vLLM's own rounds (train split of live-vllm)
        from specenv.cost.source import cost_model_for
        from specenv.traces.datasets import load_dataset

        if opts.models != "small-moe-v1":
            raise ValueError(
                f"--cost-model vllm: the vLLM-fitted model is for the shipped small-moe-v1 models, not "
                f"{opts.models!r}; pass fit-train or a cost-model JSON"
            )
        vllm_cm = out / "cost-model-vllm.json"
        cost_model_for(load_dataset("live-vllm"), "fit-train").save(vllm_cm)
        opts = dataclasses.replace(opts, cost_model=str(vllm_cm))
    ctx = build_context(opts.dataset, opts.kmax, opts.cost_model, None)
    kmax = ctx.kmax
    # the prefill and batch steps of these models (--step-model, else the newest shipped recording), if any
    batch_model_name, batch_model = step_model_for(opts.models, opts.step_model, kmax, opts.batches)
    test_ids = held_out_prompts([int(g) for g in ctx.test.generation_ids], opts.prompts, opts.cycle_prompts)
    train_ids = [int(g) for g in ctx.train.generation_ids][: opts.train_prompts]
    cm_path = out / "cost-model.json"
    ctx.cost_model.save(cm_path)
    mnt = int(ctx.spec.max_new_tokens)
    max_b = max(opts.batches)
    groups = set(opts.arms)
    base = {"models": opts.models, "max_num_seqs": max_b, "max_model_len": 1024}
    notes: list[str] = []
    pdesc = {"kmax": kmax, "max_new_tokens": mnt}
    cur_policy: dict[str, Any] = {}

    def launch(name: str, cfg: dict[str, Any]) -> EngineProcess:
        _log(f"starting engine {name}", quiet)
        eng = EngineProcess("specenv.abtest", {**base, **cfg}, out / f"engine-{name}.log")
        info = eng.ready()
        _log(f"  {name} up in {info['startup_s']:.0f} s (rss {info['rss_mb']:.0f} MB)", quiet)
        eng.call(op="run", prompt_ids=test_ids[:1], max_tokens=8, batch=1)  # warm-up
        cur_policy.pop(name, None)  # a fresh engine serves no policy yet
        return eng

    engines = EnginePool(launch, opts.max_engines)

    def start(name: str, cfg: dict[str, Any]) -> EngineProcess:
        return engines.get(name, cfg)

    loads: list[float] = []  # the machine's 1-minute load average after every pass

    last: list[EngineProcess | None] = [None]  # the engine of the last timed run

    def run(eng: EngineProcess, ids: list[int], batch: int, max_tokens: int) -> dict[str, Any]:
        res = timed_run(eng, last[0], ids, batch, max_tokens, opts.ignore_eos, opts.warmup_tokens)
        last[0] = eng
        loads.append(os.getloadavg()[0])
        return res

    try:
        # ---- engines that need no fit
        reused = (
            None
            if opts.fit_from is None
            else fit_from_file(opts.fit_from, opts.models, opts.dataset, kmax, opts.batches, opts.max_tokens)
        )
        need_fixed = "fixed" in groups or (
            opts.fit == "measured" and reused is None and groups & {"best", "dynamic", "table", "gated", "overhead"}
        )
        fit_kmax = kmax if opts.fit_kmax is None else min(int(opts.fit_kmax), kmax)
        start("plain", {"k": 0, "controller": False})
        if need_fixed:
            for k in range(1, (kmax if "fixed" in groups else fit_kmax) + 1):
                start(f"k={k}", {"k": k, "controller": False})
        # ---- fit on train: best fixed k and the dynamic-SD table per batch size
        best_k: dict[int, int] = {}
        fit_detail: dict[str, Any] = {"mode": opts.fit, "replay_best_k": ctx.best_fixed_k}
        table_k: dict[int, int] = {}  # what the dynamic-SD table is built from (every fitted batch size <= max)
        if groups & {"best", "dynamic", "table", "gated", "overhead"}:
            if reused is not None:  # the earlier run's train fit; the table from every batch size it fitted
                fit_detail.update({k: v for k, v in reused.items() if k != "best_k"}, mode="from")
                table_k = {b: k for b, k in reused["best_k"].items() if b <= max_b}
                best_k = {b: reused["best_k"][b] for b in opts.batches}
                _log(f"train fit from {opts.fit_from}: best k per batch {table_k}", quiet)
            elif opts.fit == "measured":
                tps: dict[int, dict[int, list[float]]] = {b: {k: [] for k in range(fit_kmax + 1)} for b in opts.batches}
                # plain's run beside each k's run (same batch size, one right after the other), and the ratio
                ref: dict[int, dict[int, list[float]]] = {
                    b: {k: [] for k in range(1, fit_kmax + 1)} for b in opts.batches
                }
                ratios: dict[int, dict[int, list[float]]] = {
                    b: {k: [] for k in range(1, fit_kmax + 1)} for b in opts.batches
                }
                reqs: dict[int, dict[int, list[list[dict[str, Any]]]]] = {b: {} for b in opts.batches}
                n_fit, done_fit = opts.fit_repeats * len(opts.batches) * fit_kmax * 2, 0
                # each run of k beside a plain run of the same batch size (fit_order)
                # with --interleave group, group by group (the pair's order alternating from group to group),
                # each pass joined from its groups, as the repeats do
                for k, b, pair in fit_order(fit_kmax, opts.batches, opts.fit_repeats):
                    chunks = _groups_of(train_ids, b) if opts.interleave == "group" else [train_ids]
                    parts: dict[int, list[dict[str, Any]]] = {kk: [] for kk in pair}
                    for g, kk in interleave_cells(list(pair), len(chunks), 0):  # the pair's order alternating
                        eng = engines.get("plain" if kk == 0 else f"k={kk}")
                        parts[kk].append(run(eng, chunks[g], b, opts.max_tokens))
                    joined = {kk: join_passes(ps) for kk, ps in parts.items()}
                    got = {kk: j["tok_per_s"] for kk, j in joined.items()}
                    for kk, j in joined.items():  # the request timings, for the clock of the calibration
                        reqs[b].setdefault(kk, []).append(
                            [{f: q.get(f) for f in TRAIN_REQUEST_FIELDS} for q in j["requests"] if q]
                        )
                    done_fit += 2
                    if progress is not None:
                        progress("train fit", done_fit, n_fit)
                    tps[b][k].append(got[k])
                    tps[b][0].append(got[0])
                    ref[b][k].append(got[0])
                    ratios[b][k].append(got[k] / got[0])
                for b in opts.batches:
                    best_k[b] = best_static_from_ratios(ratios[b])
                    _log(f"train fit, batch {b}: best fixed k={best_k[b]} (0: no speculation)", quiet)
                fit_detail["fit_repeats"] = opts.fit_repeats
                fit_detail["fit_kmax"] = fit_kmax
                fit_detail["fit_pairing"] = "each k run beside a plain run of the same batch size" + (
                    ", group by group" if opts.interleave == "group" else ""
                )
                fit_detail["train_tok_per_s"] = {
                    str(b): {str(k): float(np.median(v)) for k, v in d.items()} for b, d in tps.items()
                }
                fit_detail["train_tok_per_s_all"] = {str(b): {str(k): v for k, v in d.items()} for b, d in tps.items()}
                fit_detail["train_plain_beside"] = {str(b): {str(k): v for k, v in d.items()} for b, d in ref.items()}
                fit_detail["train_ratio_all"] = {str(b): {str(k): v for k, v in d.items()} for b, d in ratios.items()}
                fit_detail["train_requests"] = {str(b): {str(k): v for k, v in d.items()} for b, d in reqs.items()}
            else:
                best_k = {b: max(ctx.best_fixed_k, 1) for b in opts.batches}
            fit_detail["best_k"] = {str(b): k for b, k in (table_k or best_k).items()}
        arms: list[_Arm] = []
        arms.append(_Arm(PLAIN_ARM, "plain", "plain"))  # the reference: always run
        if "fixed" in groups:
            for k in range(1, kmax + 1):
                arms.append(_Arm(f"fixed k={k}", f"k={k}", "fixed", predict={"kind": "fixed", "k": k}))
        if "best" in groups:
            for k in sorted(set(best_k.values()) - {0}):  # k = 0: the plain engine
                start(f"k={k}", {"k": k, "controller": False})
                if "fixed" not in groups:  # the best k's row is its fixed-k engine's: measure that one
                    arms.append(_Arm(f"fixed k={k}", f"k={k}", "fixed", predict={"kind": "fixed", "k": k}))
            arms.append(_Arm("best fixed k (train)", "", "best", k_by_batch=dict(best_k)))
        table = dsd_table(table_k or best_k, max_b) if best_k else []
        if table and groups & {"dynamic", "table"}:
            fit_detail["dynamic_sd_table"] = table
        if "dynamic" in groups:
            start("dynamic", {"k": max(max(best_k.values()), 1), "controller": False, "dynamic_sd": table})
            arms.append(_Arm(f"vLLM dynamic SD {table}", "dynamic", "dynamic", k_by_batch=dict(best_k)))
        ctl_cfg = {
            "k": kmax,
            "settings": {"draft_horizon": "policy", "cost_model": str(cm_path)},
        }
        if "table" in groups and table:
            desc = {"kind": "dsd-table", "schedule": table, "batch_size": max_b, **pdesc}
            arms.append(_Arm(f"k by batch size {table} (specenv)", "ctl", "table", desc, k_by_batch=dict(best_k)))
        if "heuristic" in groups:
            arms.append(_Arm("transformers heuristic", "ctl", "heuristic", {"kind": "heuristic", **pdesc}))
        if "delta" in groups:
            d = {
                "kind": "delta",
                "cost_model": str(cm_path),
                "u_prior": ctx.u_prior.tolist(),
                "rho_prior": ctx.rho_prior.tolist(),
                **pdesc,
            }
            arms.append(_Arm("delta rule (oracle lambda)", "ctl", "delta", {**d, "lam_ms": float(ctx.lam_ms)}))
            arms.append(_Arm("delta rule (adaptive lambda)", "ctl", "delta", {**d, "adaptive": True}))
        if "batch" in groups:
            if opts.models == "small-moe-v1" or batch_model is not None:
                bdesc = {"kind": "batch-goodput", "u_prior": ctx.u_prior.tolist(), **pdesc}
                if opts.models != "small-moe-v1":
                    bdesc["batch_cost_model"] = batch_model_name
                arms.append(_Arm("batch goodput (expert-aware, batch policy)", "ctl", "batch", bdesc))
            else:
                notes.append(f"batch arm not run: no batch cost model is recorded for {opts.models}")
        if "survival" in groups:
            fit_detail["survival"] = _train_survival(opts, kmax, max_b, batch_model_name, out / "survival", quiet)
            sdesc = {"kind": "batch-survival", "folder": str(out / "survival"), **pdesc}
            arms.append(_Arm("learned-survival batch controller (numpy export)", "ctl", "survival", sdesc))
        refused: list[dict[str, str]] = []
        if groups & {"learned", "gated"}:
            folders = learned_policies(opts.dataset, opts.policy_dirs)
            if opts.learned is not None:
                unknown = [n for n in opts.learned if n not in folders]
                if unknown:
                    raise ValueError(f"learned policy {unknown[0]!r} not found (known: {', '.join(sorted(folders))})")
                folders = {n: folders[n] for n in opts.learned}
            if "gated" in groups and not table:
                notes.append("gated arms not run: no train-fitted table")
            # the served model's routing facts: the trace set's (collected on the same models)
            n_exp, top_k = int(ctx.spec.n_experts), _top_k(opts.dataset)
            for name, folder in folders.items():
                try:
                    pol = MLPPolicy.load(folder)
                    why = policy_refusal(pol, num_spec_tokens=kmax, n_experts=n_exp, top_k=top_k)
                    if why is None and pol.spec.kmax != kmax:
                        why = f"policy '{name}': kmax {pol.spec.kmax} != the served kmax {kmax}"
                except ValueError as exc:
                    why = str(exc)
                if why is not None:
                    refused.append({"policy": name, "folder": str(folder), "reason": why})
                    continue
                if "learned" in groups:
                    arms.append(_Arm(f"{name} (learned)", "ctl", "learned", {"kind": "mlp", "folder": str(folder)}))
                if "gated" in groups and table:
                    gdesc = {"kind": "table-gated", "folder": str(folder), "schedule": table, "batch_size": max_b}
                    arms.append(_Arm(f"{name} gated by {table} (learned)", "ctl", "gated", {**gdesc, **pdesc}))
                if "outcome" in groups and not pol.spec.lookahead:  # (a block policy drafts its block either way)
                    arms.append(
                        _Arm(
                            f"{name} drafting after the outcome (learned)",
                            "ctl",
                            "outcome",
                            {"kind": "mlp", "folder": str(folder)},
                            draft_horizon="outcome",
                        )
                    )
        if "fixedctl" in groups:
            for k in range(1, kmax + 1):
                arms.append(
                    _Arm(
                        f"fixed k={k} (specenv)",
                        "ctl",
                        "fixedctl",
                        {"kind": "fixed", "k": k, **pdesc},
                        predict={"kind": "fixed", "k": k},
                    )
                )
        if any(a.engine == "ctl" for a in arms):
            start("ctl", ctl_cfg)
        if "overhead" in groups:
            kb = max(best_k[min(opts.batches)], 1)  # the same k on both paths (k = 0 compares nothing)
            start(f"k={kb}", {"k": kb, "controller": False})
            rec = out / "overhead-recording"
            start(
                "specenv",
                {"k": kb, "settings": {"record": str(rec), "run": "abtest-overhead", "max_new_tokens": mnt}},
            )
            arms.append(_Arm(f"stock vLLM k={kb} (overhead reference)", f"k={kb}", "overhead-stock"))
            arms.append(
                _Arm(
                    f"specenv path k={kb} (controller+tap+recorder)",
                    "specenv",
                    "overhead",
                    policy={"kind": "constant-mlp", "k": kb, **pdesc},
                    predict={"kind": "fixed", "k": kb},
                )
            )
        # ---- interleaved repeats on the test prompts
        runs = [a for a in arms if a.engine]  # best: measured by its fixed-k engine
        results: dict[tuple[str, int], list[dict[str, Any]]] = {}
        n_runs, done = opts.repeats * len(runs) * len(opts.batches), 0
        # batch size outermost when every engine stays up: the arms compared at one batch size run one right
        # after the other (the machine's speed drifts by tens of per cent over minutes); else arm by arm, so
        # that an engine restarts at most once a repeat
        by_batch = engines.max_alive is None or engines.max_alive >= len({a.engine for a in runs})
        by_group = by_batch and opts.interleave == "group"
        order_note = "batch size outermost" if by_batch else "arm by arm (engines restart)"
        if by_group:
            order_note += ", the arms alternating group by group (each pass joined from its groups)"
        notes.append(f"repeats: {order_note}, the arms' order rotated each repeat")

        def serve(arm: _Arm, eng: EngineProcess) -> bool:
            """Install the arm's policy on its engine (when another arm's is there); False: refused."""
            if arm.engine == "specenv" and cur_policy.get("specenv") != arm.name:
                eng.call(op="policy", policy=arm.policy)  # (again after a restart)
                cur_policy["specenv"] = arm.name
            if arm.engine == "ctl" and cur_policy.get("ctl") != arm.name:
                ans = eng.call(op="policy", policy=arm.policy, draft_horizon=arm.draft_horizon)
                if "refused" in ans:
                    refused.append({"policy": arm.name, "folder": "", "reason": ans["refused"]})
                    return False
                cur_policy["ctl"] = arm.name
            return True

        def refuse(arm: _Arm, rep: int, later_here: int) -> None:
            """The arm refused at its install: its runs that will not come leave the progress count."""
            nonlocal n_runs
            arm.engine = ""
            n_runs -= later_here + (opts.repeats - rep - 1) * len(opts.batches)

        if progress is not None:  # the phase starts now (its ETA from its own clock), not at its first run
            progress("repeats", 0, n_runs)
        for rep in range(opts.repeats):
            order = runs[rep % len(runs) :] + runs[: rep % len(runs)]
            _log(f"repeat {rep + 1}/{opts.repeats}: {len(order)} arms x batches {opts.batches}", quiet)
            if by_group:
                for bi, b in enumerate(opts.batches):
                    groups_b = _groups_of(test_ids, b)
                    parts: dict[str, list[dict[str, Any]]] = {a.name: [] for a in order}
                    for g, arm in interleave_cells(order, len(groups_b), rep):
                        if not arm.engine:  # refused earlier
                            continue
                        eng = engines.get(arm.engine)
                        if not serve(arm, eng):
                            refuse(arm, rep, len(opts.batches) - bi)
                            continue
                        parts[arm.name].append(run(eng, groups_b[g], b, opts.max_tokens))
                    for arm in order:
                        if arm.engine and len(parts[arm.name]) == len(groups_b):
                            results.setdefault((arm.name, b), []).append(join_passes(parts[arm.name]))
                            done += 1
                            if progress is not None:
                                progress("repeats", done, n_runs)
                continue
            cells = repeat_cells(order, opts.batches, by_batch)
            for i, (arm, b) in enumerate(cells):
                if not arm.engine:  # refused earlier
                    continue
                eng = engines.get(arm.engine)
                if not serve(arm, eng):
                    # this arm's runs that will not come: the rest of this repeat's and every later repeat's
                    refuse(arm, rep, sum(a is arm for a, _ in cells[i:]))
                    continue
                results.setdefault((arm.name, b), []).append(run(eng, test_ids, b, opts.max_tokens))
                done += 1
                if progress is not None:
                    progress("repeats", done, n_runs)

        # ---- predictions: per arm and batch size, (tokens/s, decode phase). With a batch step model that has
        # a prefill term: B > 1 the lockstep replay priced by it; batch 1 the set's cost model for the decoding
        # ratio, composed with the recording's prefill phases and plain B = 1 step (BatchPrediction.with_decode).
        # Otherwise batch 1 is the set's cost model (decoding rounds only) and B > 1 the batch model
        lazy_cms: dict[str, str] = {}

        def predict_raw(
            desc: dict[str, Any],
            b: int,
            cm: str,
            bm: Any,
            lazy: bool,
            ids: list[int],
            split: str,
            draft_horizon: str = "policy",
        ) -> BatchPrediction | float | None:
            """``lazy``: an arm of a controller engine, whose lazy drafter skips the draft forward at k = 0.

            A float: batch 1 priced by the set's cost model alone (decoding rounds, no prefill term).
            ``draft_horizon``: the controller's setting the arm is served with.
            """
            hz = {"draft_horizon": draft_horizon}

            def make() -> Any:
                return MLPPolicy.load(desc["folder"]) if desc.get("kind") == "mlp" else replay_policy(desc, ctx.spec)

            if lazy:
                cm = lazy_cms.setdefault(cm, lazy_cost_model(cm))

            if b == 1 and (bm is None or bm.prefill is None):
                return predicted_speedup(opts.dataset, cm, kmax, ids, make(), opts.max_tokens, split, **hz)
            if bm is None:
                return None
            # a batch policy: one call per step, every request
            joint = desc.get("kind") in ("batch-goodput", "batch-survival", "table-gated")
            res = predict_batch(
                opts.dataset, cm, kmax, ids, make, opts.max_tokens, b, bm, joint=joint, split=split, **hz
            )
            if b == 1:  # the decoding ratio from the set's own B = 1 model; prefill and clock from the recording
                res = res.with_decode(
                    predicted_speedup(opts.dataset, cm, kmax, ids, make(), opts.max_tokens, split, **hz)
                )
            return res

        def predict(
            desc: dict[str, Any],
            b: int,
            cm: str,
            bm: Any,
            lazy: bool = False,
            scale: tuple[float, ClockFactors | None] | None = None,
            draft_horizon: str = "policy",
        ) -> Pred:
            """An arm's prediction on the held-out prompts; ``scale``: ``(r, clock)`` of the calibration on train."""
            res = predict_raw(desc, b, cm, bm, lazy, test_ids, "test", draft_horizon)
            if res is None:
                return None
            if isinstance(res, float):  # decoding rounds alone: no clock to put them on
                p = res / (scale[0] if scale is not None else 1.0)
                return p, p
            if scale is not None:
                res = res.calibrated(*scale)
            return res.speedup, res.tpot_speedup if res.tpot_speedup is not None else res.decode_speedup

        def predict_all(
            cm: str, bm: Any, scales: dict[int, tuple[float, ClockFactors | None]] | None = None
        ) -> tuple[dict[tuple[str, int], Pred], dict[tuple[int, int], Pred]]:
            sc = scales or {}
            by_arm: dict[tuple[str, int], Pred] = {}
            for arm in arms:
                desc = arm.predict or arm.policy
                if arm.group in ("plain", "overhead-stock", "table") or desc is None:  # table: by_k below
                    continue
                for b in opts.batches:
                    if scales is not None and b not in sc:
                        continue
                    lazy = arm.engine in ("ctl", "specenv")
                    by_arm[(arm.name, b)] = predict(
                        desc, b, cm, bm, lazy=lazy, scale=sc.get(b), draft_horizon=arm.draft_horizon
                    )
            by_k = {
                (k, b): predict({"kind": "fixed", "k": k}, b, cm, bm, scale=sc.get(b))
                for b in opts.batches
                for k in set(best_k.values()) | ({dyn_k[b]} if b in dyn_k else set())
                if scales is None or b in sc
            }
            return by_arm, by_k

        dyn_k = next((a.k_by_batch for a in arms if a.group == "dynamic" and a.k_by_batch), None) or {}
        preds, kpred = predict_all(str(cm_path), batch_model)  # the set's cost model, as saved beside the run
        ablated = _ablations(ctx, out, opts, batch_model, predict_all)
        # the same predictions with the speculating engine's decoding calibrated on this run's train fit
        calibration = _calibration(fit_detail, opts, train_ids, str(cm_path), batch_model, predict_raw)
        if calibration:
            scales = {
                int(b): (c["r"], ClockFactors(**c["clock"]) if c.get("clock") else None) for b, c in calibration.items()
            }
            ablated[CALIBRATED] = predict_all(str(cm_path), batch_model, scales)
        fit_detail["calibration"] = calibration or None
        clock = {}  # the live plain engine's clock against the step model's (a recording of another machine?)
        if batch_model is not None and batch_model.ar_step is not None:
            for b in opts.batches:
                plain_rs = results.get((PLAIN_ARM, b))
                if plain_rs:
                    ref = predict_batch(
                        opts.dataset,
                        str(cm_path),
                        kmax,
                        test_ids,
                        lambda: replay_policy({"kind": "fixed", "k": 0}, ctx.spec),
                        opts.max_tokens,
                        b,
                        batch_model,
                    )
                    checked = clock_check(ref, plain_rs)
                    if checked is not None:
                        clock[str(b)] = checked
    finally:
        engines.close()
    if engines.restarts:
        notes.append(
            f"engines: at most {engines.max_alive} alive at once (memory); {engines.restarts} restarts to keep "
            "the arms interleaved (each restart warmed up before it was measured)"
        )
    rows = _rows(arms, results, preds, kpred, opts.batches)
    for r in rows:  # the same prediction without one term of the step-time model (None: not such a model)
        if "live_speedup" in r and ablated:
            r["ablations"] = {}
            for name, (pa, pk) in ablated.items():
                both = _variant_pred(r, pa, pk)
                pred = None if both is None else both[0]
                r["ablations"][name] = {
                    "predicted": pred,
                    "predicted_decode": None if both is None else both[1],
                    "live_over_pred": None if pred is None else r["live_speedup"] / pred,
                }
    fidelity = _fidelity(rows)
    off = {b: c for b, c in clock.items() if c["off"]}
    if off:
        ratios = ", ".join(f"{c['step_ratio']:.2f}x" for c in off.values())
        notes.append(
            f"clock: the live plain engine's step is {ratios} the "
            f"step model's ({batch_model_name}) at batch {', '.join(off)}: the recording is of another machine or "
            "load, and its ratios (a verification against a plain step) may not hold on this one; re-record it "
            "here (scripts/collect_vllm_batch.py --plain, then specenv batch fit --timing step) and pass it with "
            "--step-model"
        )
    doc = {
        "fidelity": fidelity,
        "options": asdict(opts),
        "out": str(out),
        "test_prompts": test_ids,
        "train_prompts": train_ids,
        "kmax": kmax,
        "fit": fit_detail,
        "rows": rows,
        "adaptive_verification": ADAPTIVE_WHY if "adaptive" in groups else None,
        "refused": refused,
        "overhead": _overhead(arms, results, opts.batches) if "overhead" in groups else None,
        "cost_model": opts.cost_model,
        "notes": notes
        + [
            f"predicted: replay env on the first {opts.max_tokens} recorded tokens of the same prompts, each "
            "policy served as the controller serves it (the drafts of a step fixed before the previous round's "
            "outcome: the horizon; k capped at them; specenv.envs.served); "
            + (
                f"every batch size with every group's prefill phase from the batch step-time model "
                f"{batch_model_name} (the engine with the drafter for the arm, the plain engine for the reference); "
                f"batch 1: the decoding ratio from the set's cost model ({opts.cost_model} of {opts.dataset}) on "
                "that recording's plain B = 1 clock; 'decode' columns: the decoding steps alone, as the mean time "
                "per output token over requests (each request's clock stopping at its own last token); "
                if batch_model is not None and batch_model.prefill is not None
                else f"batch 1: the set's cost model ({opts.cost_model} of {opts.dataset}), decoding rounds only; "
            )
            + (
                f"batch > 1: the groups replayed in lockstep, every step priced by the batch step-time model "
                f"{batch_model_name} (plain engine's batch step as the reference)"
                if batch_model is not None
                else f"batch > 1: no batch step-time model recorded for {opts.models}: not predicted"
            ),
        ],
        "batch_step_model": batch_model_name,
        "clock": clock or None,
        "engines": engines.infos,
        "duration_s": time.time() - t_start,
        # the 1-minute load average after every pass (this machine's other work shows here)
        "load": {"passes": len(loads), "min": min(loads), "median": statistics.median(loads), "max": max(loads)}
        if loads
        else None,
    }
    (out / "abtest.json").write_text(json.dumps(doc, indent=2, default=float))
    (out / "passes.json").write_text(json.dumps(pass_records(results, plain_outputs(results)), default=float))
    return doc


#: What the measured fit keeps of each train pass's requests (``fit.train_requests``): the timings
#: :func:`train_clock` reads.
TRAIN_REQUEST_FIELDS = ("group", "ttft_ms", "tpot_ms")


#: What a pass record keeps of an engine's answer (:func:`specenv.engines.vllm.bench.timed_pass`): every
#: timing, no token ids (those are checked against plain's in the record's ``identical``).
PASS_FIELDS = ("wall_s", "tokens", "tok_per_s", "steps", "groups", "requests", "decisions", "fallbacks", "capped")


def plain_outputs(results: dict[tuple[str, int], list[dict[str, Any]]]) -> dict[int, Any]:
    """Plain decoding's token ids per batch size (its first repeat): the reference of every arm's outputs."""
    return {b: rs[0]["outputs"] for (name, b), rs in results.items() if name == PLAIN_ARM and rs}


def pass_records(results: dict[tuple[str, int], list[dict[str, Any]]], plain: dict[int, Any]) -> list[dict[str, Any]]:
    """Every measured pass as a JSON record (``passes.json`` beside ``abtest.json``).

    A record: arm, batch size, repeat, :data:`PASS_FIELDS`, and whether its outputs equal plain's. The paired
    statistics (:func:`_paired`) can be recomputed from these records alone (a later analysis, another
    pairing, without running engines again).
    """
    out = []
    for (name, b), rs in results.items():
        for rep, r in enumerate(rs):
            rec = {"arm": name, "batch": b, "repeat": rep, **{f: r[f] for f in PASS_FIELDS if f in r}}
            rec["identical"] = None if b not in plain else r.get("outputs") == plain[b]
            out.append(rec)
    return out


def _train_survival(
    opts: AbtestOptions, kmax: int, batch_size: int, batch_cost: str | None, folder: Path, quiet: bool
) -> dict[str, Any]:
    """Train the learned-survival batch controller on the train split and export it to ``folder``; returns the fit."""
    from policies.batch.export import export_survival
    from policies.batch.learn import train_batch_survival

    t0 = time.perf_counter()
    res = train_batch_survival(
        opts.dataset,
        batch_size,
        kmax=kmax,
        cost_model=opts.cost_model,
        batch_cost=batch_cost or "auto",
        seed=0,
        log=None if quiet else lambda line: _log(f"  survival: {line}", quiet),
    )
    export_survival(res.policy, folder)
    train_s = time.perf_counter() - t0
    _log(f"learned-survival controller for batch {batch_size} trained in {train_s:.0f} s", quiet)
    return {
        "folder": str(folder),
        "batch_size": int(batch_size),
        "batch_cost": batch_cost or "auto",
        "train_s": train_s,
        "history": res.history,
    }


def _ablations(
    ctx: Any, out: Path, opts: AbtestOptions, batch_model: Any, predict_all: Callable[[str, Any], Any]
) -> dict[str, tuple[dict[tuple[str, int], Pred], dict[tuple[int, int], Pred]]]:
    """Predictions of every arm with one term of a step-time cost model removed (empty for other models).

    The set's B = 1 step-time model loses the term (:func:`specenv.cost.steptime.ablate`) and so does
    the batch step model (:func:`specenv.cost.batch.ablate_batch`) when batches above 1 are predicted.

    Returns:
        ``{"without U_r": (per (arm, batch), per (k, batch)), "without overhead": (...)}``.
    """
    from specenv.cost.batch import ablate_batch
    from specenv.cost.source import split_rounds
    from specenv.cost.steptime import ablate

    cm = ctx.cost_model
    if cm.ar_step is None:
        return {}
    rounds = split_rounds(ctx.traces, "train") if opts.cost_model == "fit-train" else ctx.traces.rounds
    found = {}
    for term in ("U_r", "overhead"):
        path = out / f"cost-model-without-{term}.json"
        ablate(cm, rounds, term).save(path)
        bm = None if batch_model is None else ablate_batch(batch_model, term)
        found[f"without {term}"] = predict_all(str(path), bm)
    return found


#: The predictions calibrated on the run's train fit (:func:`calibrate_decode`), beside the ablations.
CALIBRATED = "calibrated on train"


def _calibration(
    fit: dict[str, Any],
    opts: AbtestOptions,
    train_ids: list[int],
    cm: str,
    batch_model: Any,
    predict_raw: Callable[..., Any],
) -> dict[str, dict[str, Any]]:
    """Per batch size, this machine's clock and the decoding factor ``r``, from this run's measured train fit.

    Only a fit measured in this run has the train passes (``train_ratio_all``: every fixed k beside
    plain); a reused fit (``--fit-from``) or a replay fit has none. Each fixed k is predicted on the
    same train prompts in the same order (``predict_raw`` on the train split); when the fit kept its
    passes' request timings (``train_requests``) and the model prices prefill phases,
    :func:`train_clock` puts the model on this machine's clock first; :func:`calibrate_decode` then
    finds ``r``. The train errors before (the model as recorded), with the clock alone, and after
    (clock and ``r``) are kept.
    """
    ratios = fit.get("train_ratio_all")
    if not ratios or fit.get("mode") != "measured":
        return {}
    timings = fit.get("train_requests") or {}
    out: dict[str, dict[str, Any]] = {}
    for b_key, by_k in ratios.items():
        b = int(b_key)
        measured = {int(k): [float(x) for x in v] for k, v in by_k.items() if v}
        preds: dict[int, BatchPrediction] = {}
        for k in measured:
            res = predict_raw({"kind": "fixed", "k": k}, b, cm, batch_model, False, train_ids, "train")
            if isinstance(res, float):  # batch 1 without a prefill term: a decoding ratio alone
                res = BatchPrediction(res, res, 1.0 / res, 1.0, 0.0, 0.0)
            if res is not None:
                preds[k] = res
        if not preds:
            continue
        clock = None
        passes = {int(k): [{"requests": q} for q in v] for k, v in timings.get(b_key, {}).items()}
        if passes.get(0):
            spec = [r for k, rs in passes.items() if k > 0 and k in preds for r in rs]
            clock = train_clock(next(iter(preds.values())), passes[0], spec)
        r = calibrate_decode(measured, preds, clock)
        out[b_key] = {
            "r": r,
            "clock": None if clock is None else dataclasses.asdict(clock),
            "train_mean_abs_err_before": _calibration_error(measured, preds, 1.0),
            "train_mean_abs_err_clock": None if clock is None else _calibration_error(measured, preds, 1.0, clock),
            "train_mean_abs_err_after": _calibration_error(measured, preds, r, clock),
            "ks": sorted(preds),
            "passes": int(sum(len(v) for v in measured.values())),
        }
    return out


def _variant_pred(row: dict[str, Any], pa: dict[tuple[str, int], Pred], pk: dict[tuple[int, int], Pred]) -> Pred:
    """A row's prediction under another cost model (an ablation, the calibration), as :func:`_rows` picks the full one.

    The best static choice and specenv's table at k = 0 run the plain engine (1.0); the best k, vLLM's
    table and specenv's table otherwise are their k's fixed-k prediction; every other arm its own.
    """
    k, b = row.get("k"), row["batch"]
    if k is not None and row["group"] in ("best", "table") and k == 0:
        return (1.0, 1.0)
    if k is not None and row["group"] in ("best", "dynamic", "table"):
        return pk.get((k, b))
    return pa.get((row["arm"], b))


def _calibration_error(
    measured: dict[int, list[float]], preds: dict[int, BatchPrediction], r: float, clock: ClockFactors | None = None
) -> float:
    """Mean ``|measured / predicted - 1|`` over the train passes with a prediction, at factor ``r`` and ``clock``."""
    e = [abs(m / preds[k].calibrated(r, clock).speedup - 1.0) for k, ms in measured.items() if k in preds for m in ms]
    return float(np.mean(e))


def _top_k(dataset: str) -> int | None:
    from specenv.traces.datasets import load_dataset

    return int(load_dataset(dataset).facts.top_k)


def _rows(
    arms: list[_Arm],
    results: dict[tuple[str, int], list[dict[str, Any]]],
    preds: dict[tuple[str, int], Pred],
    kpred: dict[tuple[int, int], Pred],
    batches: list[int],
) -> list[dict[str, Any]]:
    fixed_of = {a.engine: a.name for a in arms if a.group == "fixed"}  # (an overhead reference shares the engine)
    fixed_of["k=0"] = PLAIN_ARM  # the best static choice may be no speculation: the plain engine
    best_arm = next((a for a in arms if a.group == "best" and a.k_by_batch), None)
    dyn_arm = next((a for a in arms if a.group == "dynamic"), None)
    rows = []
    for b in batches:
        plain = results.get((PLAIN_ARM, b), [])
        plain_tps = statistics.median(r["tok_per_s"] for r in plain) if plain else float("nan")
        ref = plain[0]["outputs"] if plain else None
        refs = {
            "best fixed k (train)": results.get((fixed_of.get(f"k={best_arm.k_by_batch[b]}", ""), b))
            if best_arm
            else None,
            "vLLM dynamic SD (train)": results.get((dyn_arm.name, b)) if dyn_arm else None,
        }
        for arm in arms:
            rs = results.get((arm.name, b))
            both = preds.get((arm.name, b), (1.0, 1.0) if arm.group == "plain" else None)
            # k = 0: the best static choice is the plain engine itself, and specenv's table runs plain idle
            # steps (plain's prediction, 1.0); vLLM's table at k = 0 still drafts: the replay's k = 0
            at_zero = arm.k_by_batch is not None and arm.k_by_batch.get(b) == 0
            if arm.k_by_batch is not None and arm.group == "best":
                src = fixed_of.get(f"k={arm.k_by_batch[b]}")
                rs = results.get((src, b)) if src else None
                both = (1.0, 1.0) if at_zero else kpred.get((arm.k_by_batch[b], b))
            elif arm.group == "table" and at_zero:
                both = (1.0, 1.0)
            elif arm.group in ("dynamic", "table"):
                both = kpred.get((arm.k_by_batch[b], b)) if arm.k_by_batch else None
            if arm.group == "overhead-stock":
                both = None
            pred = None if both is None else both[0]
            row: dict[str, Any] = {"arm": arm.name, "batch": b, "group": arm.group}
            if arm.k_by_batch is not None:
                row["k"] = arm.k_by_batch[b]
            if not rs:
                row["status"] = "not run"
                rows.append(row)
                continue
            tps = statistics.median(r["tok_per_s"] for r in rs)
            live = tps / plain_tps
            row["live_ci95"] = _repeat_ci(rs, plain)
            row.update(
                tok_per_s=tps,
                tok_per_s_all=[r["tok_per_s"] for r in rs],
                live_speedup=live,
                predicted=pred,
                predicted_decode=None if both is None else both[1],
                live_over_pred=None if pred is None else live / pred,
                identical=None if ref is None else all(r["outputs"] == ref for r in rs),
            )
            row["latency"] = _latency(rs)
            # the decode phase alone (what the replay models): plain's mean time per output token over the arm's
            tp, ta = _mean_tpot(plain), _mean_tpot(rs)
            row["decode_speedup"] = None if tp is None or ta is None else tp / ta
            row["paired"] = {name: _paired(rs, ref_rs) for name, ref_rs in refs.items() if ref_rs}
            row["paired_decode"] = {name: _paired(rs, ref_rs, "decode") for name, ref_rs in refs.items() if ref_rs}
            ovh = _pooled([r for r in rs if r.get("overhead", {}).get("steps")])
            if ovh:
                row["ctl_cpu_frac"] = ovh
            row["fallbacks"] = sum(r.get("fallbacks", 0) for r in rs)
            rows.append(row)
    return rows


#: The smallest throughput difference the A/B is sized to resolve (``repeats_for_5pct``).
RESOLVE = 0.05


def _group_cells(res: dict[str, Any], phase: str) -> list[tuple[float, int]] | None:
    """A pass's (seconds, tokens) per request group, or None when the pass holds no such timings.

    ``phase="pass"``: the group's wall time and tokens. ``"decode"``: the time its requests spent after their
    first token (time per output token x the tokens after the first) and those tokens, summed over them.
    """
    if phase == "pass":
        g = res.get("groups")
        return [(x["wall_s"], x["tokens"]) for x in g] if g else None
    reqs = res.get("requests")
    if not reqs or not all(q and q.get("tokens") for q in reqs):
        return None
    cells: dict[int, list[float]] = {}
    for q in reqs:
        n = int(q["tokens"]) - 1
        c = cells.setdefault(int(q["group"]), [0.0, 0])
        c[0] += 0.0 if q.get("tpot_ms") is None else q["tpot_ms"] * n / 1e3
        c[1] += n
    return [(t, n) for t, n in (cells[g] for g in sorted(cells))]


def _paired(rs: list[dict[str, Any]], ref: list[dict[str, Any]], phase: str = "pass") -> dict[str, Any] | None:
    """An arm's throughput over a reference arm's, paired by (repeat, request group), with a 95% bootstrap CI.

    Repeat r of both arms ran in the same interleaved round, on the same prompts in the same groups
    of ``batch`` requests, so each (repeat, group) cell is a pair: its unit has numerator the
    reference's time (scaled by the arm's tokens over the reference's, 1 when both are lossless)
    and denominator the arm's; :func:`specenv.stats.bootstrap_ratio_ci` resamples the cells.
    ``phase="pass"`` times the whole group (prefill included, what a user waits for), ``"decode"``
    only the time after each request's first token (what the replay's decoding rounds model; the
    prefill's own spread left out, so a per-step difference shows with fewer repeats).
    ``repeats_for_5pct`` is how many repeats the spread of the per-repeat ratios needs for a 95%
    interval of half-width :data:`RESOLVE` (normal approximation on the log ratio).
    None when the passes hold no group timings (an older engine) or fewer than two cells.
    """
    from specenv.stats import bootstrap_ratio_ci

    n = min(len(rs), len(ref))
    num, den, per_rep = [], [], []
    for a, r in zip(rs[:n], ref[:n], strict=True):
        ga, gr = _group_cells(a, phase), _group_cells(r, phase)
        if not ga or not gr or len(ga) != len(gr):
            return None
        nn = [tr * na / max(nr, 1) for (tr, nr), (_, na) in zip(gr, ga, strict=True)]
        dd = [ta for ta, _ in ga]
        num += nn
        den += dd
        if sum(dd) <= 0:
            return None
        per_rep.append(sum(nn) / sum(dd))
    if len(num) < 2 or min(den) <= 0:
        return None
    ci = bootstrap_ratio_ci(np.asarray(num), np.asarray(den))["pooled"]
    logs = np.log(per_rep)
    need = None
    if len(logs) >= 2:
        sd = float(np.std(logs, ddof=1))
        need = max(2, int(np.ceil((1.96 * sd / np.log1p(RESOLVE)) ** 2)))
    return {
        "ratio": ci["value"],
        "ci95": [ci["low"], ci["high"]],
        "per_repeat": per_rep,
        "cells": len(num),
        "repeats_for_5pct": need,
        "excludes_1": bool(ci["low"] > 1.0 or ci["high"] < 1.0),
    }


def _latency(rs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """TTFT p50 and TPOT p50/p99 (ms) over every request of every repeat (None without request timings)."""
    reqs = [q for r in rs for q in r.get("requests", []) if q]
    if not reqs:
        return None
    ttft = np.asarray([q["ttft_ms"] for q in reqs], dtype=np.float64)
    tpot = np.asarray([q["tpot_ms"] for q in reqs if q.get("tpot_ms") is not None], dtype=np.float64)
    return {
        "ttft_ms_p50": float(np.median(ttft)),
        "tpot_ms_p50": float(np.median(tpot)) if len(tpot) else None,
        "tpot_ms_p99": float(np.quantile(tpot, 0.99)) if len(tpot) else None,
        "requests": len(reqs),
    }


def _mean_tpot(rs: list[dict[str, Any]]) -> float | None:
    """Mean time per output token after the first (ms) over every request of every repeat, or None."""
    t = [q["tpot_ms"] for r in rs for q in r.get("requests", []) if q and q.get("tpot_ms") is not None]
    return float(np.mean(t)) if t else None


def _fidelity(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per batch size and cost model (full, each ablation): the sim-to-real errors and rank correlation.

    Over the rows with a live speedup and a prediction (plain, whose prediction is 1 by definition,
    excluded): mean and max of ``|live/pred - 1|`` and Spearman's rank correlation of predicted and
    live speedups (``scipy.stats.spearmanr``; None below three arms). ``"full model, decode phase"``
    compares the prediction of the decoding steps alone (``predicted_decode``) with the live *decode*
    speedup (plain's mean time per output token over the arm's); the tokens/s views hold the prefill
    (time to first token) where the batch model has a prefill term (:class:`BatchPrediction`).
    """
    from scipy.stats import spearmanr

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for b in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == b and r.get("live_speedup") is not None and r["group"] != "plain"]
        models = {"full model": {r["arm"]: r.get("predicted") for r in rs}}
        for name in {n for r in rs for n in r.get("ablations", {})}:
            models[name] = {r["arm"]: r["ablations"][name]["predicted"] for r in rs}
        views = [(m, pred, "live_speedup") for m, pred in models.items()]
        decode = {r["arm"]: r.get("predicted_decode", r.get("predicted")) for r in rs}
        views.append(("full model, decode phase", decode, "decode_speedup"))
        for model, pred, key in views:
            pairs = [(r["arm"], r[key], pred[r["arm"]]) for r in rs if pred.get(r["arm"]) and r.get(key)]
            if not pairs:
                continue
            err = [abs(live / p - 1.0) for _, live, p in pairs]
            rho = None
            if len(pairs) >= 3:
                rho = float(spearmanr([p for *_, p in pairs], [live for _, live, _ in pairs]).statistic)
            out.setdefault(str(b), {})[model] = {
                "mean_abs_err": float(np.mean(err)),
                "max_abs_err": float(np.max(err)),
                "worst": pairs[int(np.argmax(err))][0],
                "spearman": rho,
                "arms": len(pairs),
            }
    return out


def _repeat_ci(rs: list[dict[str, Any]], plain: list[dict[str, Any]]) -> list[float] | None:
    """95% percentile-bootstrap interval of the live speedup over the repeats (each paired with plain's).

    None below two repeats.
    """
    from specenv.stats import bootstrap_ratio_ci

    n = min(len(rs), len(plain))
    if n < 2:
        return None
    ci = bootstrap_ratio_ci([r["tok_per_s"] for r in rs[:n]], [p["tok_per_s"] for p in plain[:n]])["pooled"]
    return [ci["low"], ci["high"]]


def _pooled(rs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Controller CPU / step time pooled over passes, with a 95% bootstrap interval over the steps."""
    rows = [np.asarray(r["overhead"]["rows"]) for r in rs if r["overhead"].get("rows")]
    if not rows:
        return None
    log = np.concatenate(rows)
    cpu, wall, over = log[:, 1], log[:, 2], log[:, 0]
    idx = np.random.default_rng(0).integers(0, len(log), size=(1000, len(log)))
    boot = cpu[idx].sum(axis=1) / wall[idx].sum(axis=1)
    return {
        "value": float(cpu.sum() / wall.sum()),
        "ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))],
        "wall_frac": float(over.sum() / wall.sum()),
        "cpu_ms_per_step": float(cpu.mean()),
        "step_ms": float(wall.mean()),
        "steps": len(log),
    }


def _overhead(arms: list[_Arm], results: dict[tuple[str, int], list[dict[str, Any]]], batches: list[int]) -> dict:
    """The specenv path vs stock with the same speculative config: paired ratios per repeat, stock's own spread."""
    stock = next(a for a in arms if a.group == "overhead-stock").name
    spec = next(a for a in arms if a.group == "overhead").name
    out = {}
    for b in batches:
        s = [r["tok_per_s"] for r in results.get((stock, b), [])]
        p = [r["tok_per_s"] for r in results.get((spec, b), [])]
        if not s or not p:
            continue
        med = statistics.median(s)
        out[str(b)] = {
            "stock_tok_per_s": s,
            "specenv_tok_per_s": p,
            "ratio_median": statistics.median(p) / med,
            "ratio_per_repeat": [x / y for x, y in zip(p, s, strict=False)],
            "stock_spread": (max(s) - min(s)) / med,
            # paired by (repeat, request group): the whole pass, and the decode phase alone
            "paired": _paired(results[(spec, b)], results[(stock, b)]),
            "paired_decode": _paired(results[(spec, b)], results[(stock, b)], "decode"),
            "ctl_cpu_frac": _pooled([r for r in results[(spec, b)] if r.get("overhead", {}).get("steps")]),
        }
    return out


# ---------------------------------------------------------------------------------------------- output
def _f(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, fmt)


def _pages_line(engines: Any) -> str:
    """One line on the engines' memory pages (huge pages make engine instances time alike)."""
    infos = list(engines.values()) if isinstance(engines, dict) else list(engines or [])
    pages = [i["pages"] for i in infos if isinstance(i, dict) and isinstance(i.get("pages"), dict)]
    if not pages:
        return "Engine pages: not recorded."
    kb = [p.get("this_process_anon_hugepages_kb") for p in pages]
    kb = [x for x in kb if isinstance(x, int)]
    span = f"{min(kb) / 1024:.0f}-{max(kb) / 1024:.0f} MB on huge pages per engine" if kb else "huge pages unknown"
    return f"Engine pages: transparent huge pages '{pages[0].get('thp_mode')}', {span} ({len(pages)} engines)."


def _paired_table(rows: list[dict[str, Any]]) -> list[str]:
    """Latency and the paired throughput ratios to the best fixed k and to vLLM's dynamic SD (both fitted on train)."""
    have = [r for r in rows if r.get("latency") or r.get("paired")]
    if not have:
        return []

    def cell(p: dict[str, Any] | None, d: dict[str, Any] | None = None) -> str:
        if not p:
            return "-"
        star = " *" if p["excludes_1"] else ""
        out = f"{p['ratio']:.3f} [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]{star} (n={p['repeats_for_5pct']})"
        if d:
            out += f"; decode {_ci_text(d)}"
        return out

    out = [
        "",
        "Latency and paired ratios (95% bootstrap CI over repeat x request-group cells; * = excludes 1; "
        f"n = repeats the per-repeat spread needs for a +-{RESOLVE:.0%} interval; decode: the same pairs timed "
        "after each request's first token):",
        "",
        "| arm | batch | TTFT p50 ms | TPOT p50 / p99 ms | / best fixed k (train) | / vLLM dynamic SD (train) |",
        "|---|---|---|---|---|---|",
    ]
    for r in have:
        lat = r.get("latency") or {}
        pr = r.get("paired") or {}
        pd = r.get("paired_decode") or {}
        out.append(
            f"| {r['arm']} | {r['batch']} | {_f(lat.get('ttft_ms_p50'), '.1f')} | "
            f"{_f(lat.get('tpot_ms_p50'), '.1f')} / {_f(lat.get('tpot_ms_p99'), '.1f')} | "
            f"{cell(pr.get('best fixed k (train)'), pd.get('best fixed k (train)'))} | "
            f"{cell(pr.get('vLLM dynamic SD (train)'), pd.get('vLLM dynamic SD (train)'))} |"
        )
    return out


def _ci_text(p: dict[str, Any] | None) -> str:
    """A paired ratio as ``r [lo, hi]`` (``*`` when the interval excludes 1), or ``-``."""
    if not p:
        return "-"
    return f"{p['ratio']:.3f} [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]" + (" *" if p["excludes_1"] else "")


def _load_line(load: dict[str, Any] | None) -> str:
    if not load:
        return "Machine load: not recorded."
    return (
        f"Machine load (1-minute average after each of {load['passes']} passes): median {load['median']:.2f}, "
        f"range {load['min']:.2f}-{load['max']:.2f}."
    )


def _from(fit: dict[str, Any]) -> str:
    return f" {fit['from']}" if fit.get("from") else ""


def _distinct(ids: list[int]) -> str:
    n = len(set(ids))
    return "" if n == len(ids) else f" ({n} distinct held-out prompts served in turn)"


def markdown(doc: dict[str, Any]) -> str:
    """The A/B table (and its notes) as Markdown."""
    lines = [
        f"specenv abtest: {len(doc['test_prompts'])} test prompts{_distinct(doc['test_prompts'])} x "
        f"{doc['options']['max_tokens']} tokens, "
        f"{doc['options']['repeats']} repeats (median), kmax {doc['kmax']}, models {doc['options']['models']}, "
        f"{doc['duration_s']:.0f} s",
        "",
        _pages_line(doc.get("engines")),
        _load_line(doc.get("load")),
        "",
        "| arm | batch | tokens/s | live speedup [95% CI, repeats] | predicted | live/pred | decode: live / predicted "
        "| identical to plain | controller CPU/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        name = r["arm"] + (f" (k={r['k']})" if "k" in r and r["group"] == "best" else "")
        if r.get("status"):
            lines.append(f"| {name} | {r['batch']} | {r['status']} | | | | | | |")
            continue
        c = r.get("ctl_cpu_frac")
        cpu = f"{c['value']:.2%} [{c['ci95'][0]:.2%}, {c['ci95'][1]:.2%}]" if c else "-"
        ident = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        ci = r.get("live_ci95")
        live = f"{r['live_speedup']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        dec = f"{_f(r.get('decode_speedup'), '.3f')} / {_f(r.get('predicted_decode'), '.3f')}"
        lines.append(
            f"| {name} | {r['batch']} | {r['tok_per_s']:.1f} | {live} | {_f(r['predicted'], '.3f')} | "
            f"{_f(r['live_over_pred'], '.3f')} | {dec} | {ident} | {cpu} |"
        )
    if doc.get("adaptive_verification"):
        lines.append(f"| vLLM adaptive verification | - | {doc['adaptive_verification']} | | | | | | |")
    lines += _paired_table(doc["rows"])
    for r in doc["refused"]:
        lines.append(f"| {r['policy']} (learned) | - | refused: {r['reason']} | | | | | | |")
    ov = doc.get("overhead") or {}
    if ov:
        lines += [
            "",
            "Overhead (specenv path vs stock vLLM, same speculative config; medians' ratio, per repeat, and paired "
            "over repeat x request-group cells with 95% bootstrap CIs):",
        ]
        for b, o in ov.items():
            c = o.get("ctl_cpu_frac") or {}
            lines.append(
                f"- batch {b}: specenv/stock throughput {o['ratio_median']:.3f} (per repeat "
                f"{', '.join(f'{x:.3f}' for x in o['ratio_per_repeat'])}; paired {_ci_text(o.get('paired'))}, "
                f"decode phase {_ci_text(o.get('paired_decode'))}); stock's own spread "
                f"{o['stock_spread']:.1%}; controller CPU {c.get('value', float('nan')):.2%} of step time "
                f"(95% CI {c.get('ci95', [float('nan')] * 2)[0]:.2%}..{c.get('ci95', [float('nan')] * 2)[1]:.2%}, "
                f"{c.get('cpu_ms_per_step', float('nan')):.3f} ms of {c.get('step_ms', float('nan')):.1f} ms per step)"
            )
    fid = doc.get("fidelity") or {}
    if fid:
        lines += ["", "Sim-to-real (arms with a prediction; |live/pred - 1| mean and max, Spearman rank correlation):"]
        for b, models in fid.items():
            for model, f in models.items():
                lines.append(
                    f"- batch {b}, {model}: mean {f['mean_abs_err']:.1%}, max {f['max_abs_err']:.1%} "
                    f"({f['worst']}), Spearman {_f(f['spearman'], '.3f')} over {f['arms']} arms"
                )
    clock = doc.get("clock") or {}
    if clock:
        lines += ["", f"Clock (live plain engine / the step model {doc.get('batch_step_model')}'s, same groups):"]
        for b, c in clock.items():
            lines.append(
                f"- batch {b}: decode step {c['live_step_ms']:.1f} / {c['model_step_ms']:.1f} ms = "
                f"{c['step_ratio']:.2f}; prefill per group {_f(c['live_prefill_ms'], '.0f')} / "
                f"{_f(c['model_prefill_ms'], '.0f')} ms = {_f(c['prefill_ratio'], '.2f')}"
                + (" (off)" if c["off"] else "")
            )
    fit = doc["fit"]
    if fit.get("best_k"):
        lines.append("")
        lines.append(
            f"Fit on train ({fit['mode']}{_from(fit)}): best fixed k per batch {fit['best_k']}; replay's best fixed k "
            f"{fit['replay_best_k']}"
            + (f"; dynamic SD table {fit['dynamic_sd_table']}" if "dynamic_sd_table" in fit else "")
        )
    cal = fit.get("calibration") or {}
    if cal:
        lines.append(
            f"Calibration on train ('{CALIBRATED}' above: the model put on this machine's clock (prefill phases, "
            "plain step: measured / modelled on the train passes), then the speculating engine's decoding x r, fitted "
            "on the train fit's passes; no held-out pass read): "
            + "; ".join(
                f"batch {b}: "
                + (
                    f"clock prefill {c['clock']['prefill_spec']:.2f} (drafter engine) / "
                    f"{c['clock']['prefill_plain']:.2f} (plain), plain step {c['clock']['step_plain']:.2f}; "
                    if c.get("clock")
                    else ""
                )
                + f"r = {c['r']:.3f} (train |meas/pred - 1| {c['train_mean_abs_err_before']:.1%}"
                + (
                    f" -> {c['train_mean_abs_err_clock']:.1%} (clock)"
                    if c.get("train_mean_abs_err_clock") is not None
                    else ""
                )
                + f" -> {c['train_mean_abs_err_after']:.1%} over {c['passes']} passes)"
                for b, c in cal.items()
            )
        )
    lines += [f"Note: {n}" for n in doc["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m specenv.abtest _engine CFG``: an engine process (:func:`specenv.engines.vllm.bench.worker_main`)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "_engine":
        from specenv.engines.vllm.bench import worker_main

        worker_main(args[1], make_policy)
        return
    raise SystemExit("usage: specenv abtest (this module's entry is for its engine processes)")


if __name__ == "__main__":
    main()
