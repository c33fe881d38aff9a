"""The replay tables of a trace set, and the kmax/split selection every consumer uses.

* :func:`select_positions` -- the positions of one split restricted to budgets 0..kmax (the one
  place that checks ``kmax`` against the trace set and ``split`` against :mod:`specenv.traces.splits`);
  the environments, the oracle command, the benchmark and the imitation learner all call it;
* :class:`ReplayData` / :func:`replay_data` -- the per-trace-set tables an environment replays
  (survival probabilities, charged round costs, unique experts, draft confidences), computed once
  per process for a set of arguments and shared, read-only, between every environment built with
  them (:mod:`specenv.envs.replay`, :mod:`specenv.envs.vector`, :mod:`specenv.envs.live`).

The charged cost comes from :meth:`specenv.cost.model.CostModel.charged_table` and the survival
table from :meth:`specenv.traces.traceset.PositionArrays.survival`.
"""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from specenv.cost.model import CostModel, charged_lookahead, check_drafting
from specenv.cost.source import cost_model_for
from specenv.io import json_digest, sha256_file
from specenv.observation.single import ObservationSpec, check_signals
from specenv.traces.datasets import DEFAULT_DATASET, load_dataset
from specenv.traces.splits import check_split, select_split
from specenv.traces.traceset import PositionArrays, TraceSet

__all__ = ["ReplayData", "SelectionError", "check_kmax", "replay_data", "select_positions"]


# --------------------------------------------------------------------------------------------------
# kmax / split selection
# --------------------------------------------------------------------------------------------------
class SelectionError(ValueError):
    """A bad ``kmax`` or ``split`` argument; ``argument`` names it (the CLI maps it to its option).

    Attributes:
        argument: ``"kmax"`` or ``"split"``.
    """

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SelectionError(name, f"{name}={value!r}: must be an integer")
    return int(value)


def check_kmax(kmax: Any, trace_kmax: int) -> int:
    """``kmax`` as an int in 1..``trace_kmax`` (None means ``trace_kmax``).

    Raises:
        SelectionError: Naming ``kmax`` when it is not an integer in range.
    """
    if kmax is None:
        return int(trace_kmax)
    kmax = _check_int("kmax", kmax)
    if not 1 <= kmax <= trace_kmax:
        raise SelectionError("kmax", f"kmax={kmax}: must be in 1..{trace_kmax} (the trace set's Kmax)")
    return kmax


def select_positions(traceset: TraceSet, kmax: int | None, split: str) -> PositionArrays:
    """The positions of ``split`` with budgets 0..kmax, rows in the environment's order.

    Args:
        traceset: A trace set with a positions table.
        kmax: Largest budget, 1..the trace set's Kmax (None: the trace set's Kmax).
        split: ``"train"``, ``"test"`` or ``"all"`` (:mod:`specenv.traces.splits`).

    Returns:
        The selected :class:`~specenv.traces.traceset.PositionArrays` (row ``offsets[g] + t``).

    Raises:
        SelectionError: (a ValueError) naming ``kmax`` or ``split`` when one is invalid or the split
            holds no generation.
    """
    try:
        check_split(split)
    except ValueError as exc:
        raise SelectionError("split", str(exc)) from None
    kmax = check_kmax(kmax, traceset.kmax)
    everything = traceset.arrays()
    arr = everything.with_kmax(kmax) if kmax < traceset.kmax else everything
    arr = select_split(arr, split)
    if arr.n_generations == 0:
        raise SelectionError(
            "split",
            f"split={split!r}: dataset '{traceset.manifest.name}' has no generations in this split "
            f"({everything.n_generations} in all; use split='all')",
        )
    return arr


# --------------------------------------------------------------------------------------------------
# Shared, precomputed replay tables
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ReplayData:
    """Everything an environment needs from one trace set, precomputed once (read-only arrays).

    Row ``offsets[g] + t`` is position t of the g-th generation of the split.

    Attributes:
        dataset: The ``dataset`` argument as given (registry name or folder path).
        name: The trace set's manifest name.
        split: ``"train"``, ``"test"`` or ``"all"``.
        kmax: Largest budget (actions are 0..kmax).
        lookahead: Draft confidences exposed per observation (h).
        drafting: The drafting mode that charges the rounds (``"none"``, ``"block"`` or ``"sequential"``;
            :data:`specenv.cost.model.DRAFTING_MODES`).
        spec: Observation layout.
        cost_model: The cost model C(t, k).
        generation_ids: (G,) ids of the split's generations.
        categories: (G,) their categories.
        offsets: (G+1,) row offsets.
        lengths: (G,) number of positions N of each generation.
        L0: (G,) context length at t = 0 (prompt length P), int64.
        survival: (n, kmax+1) float64; column j-1 holds P(a >= j | t) = prod_{i<=j} rho_{t,i} for
            j = 1..kmax (:meth:`~specenv.traces.traceset.PositionArrays.survival`), and column kmax holds
            P(a >= kmax+1) = 0 (a sentinel that ends every count of the leading ``u < P(a >= j)``).
        cost: (n, kmax+1) charged round cost in ms, ``CostModel.charged_table(U, L, kmax, h, drafting)``:
            C(t, k) with the draft term T_D(max(k, h)) in mode ``"block"``, T_D(k) in modes ``"none"``
            and ``"sequential"``.
        U: (n, kmax+1) unique experts U_{t,k}.
        conf: (n, h * len(signals)) draft signals of the next h drafts, one block of h columns per
            signal in ``signals`` order (q_{t,1..h}, then entropy, then margin).
        ar_ms: (n,) plain autoregressive step cost C(t, 0) (no lookahead charge).
        ar_unit_ms: Mean of ``ar_ms`` over the split: the reward unit.
        ar_ctx_ms: (n,) ``CostModel.ar_ms(L_t)``, the AR step at the position's context with U = top_k:
            the unit of the observation's ``prev_cost`` (what a server can compute at that moment).
        ar_total_ms: (G,) AR cost of each generation, sum_t C(t, 0).
        max_len: Longest generation of the split.
    """

    dataset: str
    name: str
    split: str
    kmax: int
    lookahead: int
    spec: ObservationSpec
    cost_model: CostModel
    generation_ids: np.ndarray
    categories: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    L0: np.ndarray
    survival: np.ndarray
    cost: np.ndarray
    U: np.ndarray
    conf: np.ndarray
    ar_ms: np.ndarray
    ar_unit_ms: float
    ar_ctx_ms: np.ndarray
    ar_total_ms: np.ndarray
    max_len: int
    drafting: str = "none"
    signals: tuple[str, ...] = ("q",)

    @property
    def n_generations(self) -> int:
        """Number of generations G in the split."""
        return int(len(self.generation_ids))

    @functools.cached_property
    def within_box(self) -> bool:
        """True when every observation an episode of the split can show lies in the Box unclipped.

        Then clipping to the Box changes no observation, and the environments skip it (the vectors
        are bit-identical either way). The bounds come from the tables: the largest context ``L0 + N``
        and length N (``context``, ``progress``), the unique experts U (``prev_U``), the round cost in
        AR steps at its context, ``cost / ar_ctx`` (``prev_cost``; and ``cost_per_token``, an EMA of
        it per committed token from the prior 1, kept 0.1% below the bound so that no rounding of
        the EMA can reach it) and the draft signals (``conf_j``, ``ent_j``, ``margin_j``). The other
        features lie in [0, 1] by construction for budgets 0..kmax.
        """
        s = self.spec
        ctx = self.cost / self.ar_ctx_ms[:, None]
        conf_ok = True
        if self.conf.shape[1]:
            first = s.index("conf_1")  # the signal blocks follow each other
            conf_hi = s.high()[first : first + self.conf.shape[1]].astype(np.float64)
            conf_ok = bool(self.conf.min() >= 0.0) and bool((self.conf <= conf_hi).all())
        return bool(
            int((self.L0 + self.lengths).max()) / s.context_scale <= s.context_high
            and self.max_len <= s.max_new_tokens
            and self.U.min() >= 0.0
            and self.U.max() <= s.n_experts
            and ctx.min(initial=0.0) >= 0.0
            and max(float(ctx.max(initial=0.0)), 1.0) <= 0.999 * s.cost_high  # prev_cost <= this / (kmax + 1)
            and conf_ok
        )

    def index_of(self, generation_id: Any) -> int:
        """Index in the split of a generation id.

        Raises:
            ValueError: Naming the id when it is not in the split.
        """
        try:
            gid = int(generation_id)
            if gid != generation_id:
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"options['generation_id']={generation_id!r}: not an integer id") from None
        hit = np.flatnonzero(self.generation_ids == gid)
        if not len(hit):
            raise ValueError(
                f"options['generation_id']={gid}: not in the '{self.split}' split of dataset "
                f"'{self.name}' ({self.n_generations} generations)"
            )
        return int(hit[0])


_REPLAY_CACHE: OrderedDict[tuple[Any, ...], ReplayData] = OrderedDict()
_REPLAY_CACHE_SIZE = 8
_READ_ONLY = (
    "generation_ids",
    "categories",
    "offsets",
    "lengths",
    "L0",
    "survival",
    "cost",
    "U",
    "conf",
    "ar_ms",
    "ar_ctx_ms",
    "ar_total_ms",
)


def replay_data(
    dataset: str | os.PathLike[str] = DEFAULT_DATASET,
    kmax: int | None = None,
    split: str = "train",
    cost_model: str = "fit",
    lookahead: int | None = None,
    drafting: str | None = None,
    signals: Any = ("q",),
) -> ReplayData:
    """Build (or fetch from the per-process cache) the replay tables for these arguments.

    Args: see :class:`specenv.envs.replay.MoESpecEnv` (``lookahead`` and ``drafting`` are checked by
    :func:`specenv.cost.model.check_drafting`: None and None is mode ``"none"``, h = 0).

    Raises:
        ValueError: Naming the bad argument (``dataset``, ``kmax``, ``split``, ``cost_model``,
            ``lookahead``, ``drafting``, ``signals``).
    """
    checked = _checked_arguments(dataset, kmax, split, cost_model, lookahead, drafting)
    ts, kmax, cost_model, lookahead, drafting = checked
    signals = check_signals(signals)
    key = _cache_key(ts, kmax, split, cost_model, lookahead, drafting) + (signals,)
    hit = _REPLAY_CACHE.get(key)
    if hit is not None:
        _REPLAY_CACHE.move_to_end(key)
        return hit
    data = _build(ts, os.fspath(dataset), kmax, split, cost_model, lookahead, drafting, signals)
    for name in _READ_ONLY:
        getattr(data, name).flags.writeable = False
    _REPLAY_CACHE[key] = data
    while len(_REPLAY_CACHE) > _REPLAY_CACHE_SIZE:
        _REPLAY_CACHE.popitem(last=False)
    return data


def _checked_arguments(
    dataset: Any, kmax: Any, split: Any, cost_model: Any, lookahead: Any, drafting: Any = None
) -> tuple[TraceSet, int, str, int, str]:
    """Validate the arguments of :func:`replay_data`; returns the trace set, kmax, cost model, h and mode."""
    check_split(split)
    if not isinstance(dataset, (str, os.PathLike)):
        raise ValueError(f"dataset={dataset!r}: expected a registry name or a folder path")
    if not isinstance(cost_model, (str, os.PathLike)):
        raise ValueError(f"cost_model={cost_model!r}: expected 'fit', 'profile' or a JSON path")
    ts = load_dataset(dataset)
    if not ts.has_positions:
        raise ValueError(f"dataset={os.fspath(dataset)!r}: trace set '{ts.manifest.name}' has no positions table")
    kmax = check_kmax(kmax, ts.kmax)
    if lookahead is not None:
        lookahead = _check_int("lookahead", lookahead)
    if drafting is not None and not isinstance(drafting, str):
        raise ValueError(f"drafting={drafting!r}: expected 'none', 'block' or 'sequential'")
    drafting, lookahead = check_drafting(drafting, lookahead, kmax)
    return ts, kmax, os.fspath(cost_model), lookahead, drafting


def _cache_key(
    ts: TraceSet, kmax: int, split: str, cost_model: str, lookahead: int, drafting: str = "none"
) -> tuple[Any, ...]:
    """Cache key of the tables; a cost-model JSON file is keyed by its content."""
    cm_key: tuple[str, str] = (cost_model, "")
    if cost_model not in ("fit", "profile") and os.path.isfile(cost_model):
        cm_key = (os.path.abspath(cost_model), sha256_file(cost_model))
    return (str(ts.root), ts.manifest.name, json_digest(ts.manifest.files), kmax, split, cm_key, lookahead, drafting)


def _charged_tables(
    model: CostModel, arr: PositionArrays, kmax: int, lookahead: int, cost_model: str, drafting: str = "none"
) -> tuple[np.ndarray, np.ndarray, float]:
    """Charged cost table (n, kmax+1), AR step cost (n,) and its mean (the reward unit)."""
    try:
        cost = model.charged_table(arr.U, arr.L, kmax, lookahead, drafting)
    except ValueError as exc:
        raise ValueError(f"cost_model={cost_model!r}: {exc}") from None
    # column 0 is the plain AR step itself unless the round drafts at k = 0 (block mode, or an engine's floor)
    uncharged = charged_lookahead(lookahead, drafting) == 0 and model.plain_is_k0
    ar_ms = cost[:, 0].copy() if uncharged else np.asarray(model.ar_table(arr.U[:, 0], arr.L), dtype=np.float64)
    ar_unit = float(np.mean(ar_ms))
    if not np.isfinite(ar_unit) or ar_unit <= 0:
        raise ValueError(f"cost_model={cost_model!r}: mean AR step cost {ar_unit} ms is not positive")
    return cost, ar_ms, ar_unit


def _build(
    ts: TraceSet,
    dataset: str,
    kmax: int,
    split: str,
    cost_model: str,
    lookahead: int,
    drafting: str = "none",
    signals: tuple[str, ...] = ("q",),
) -> ReplayData:
    """Compute the tables of :class:`ReplayData` (no caching)."""
    model = cost_model_for(ts, cost_model)
    arr = select_positions(ts, kmax, split)
    blocks = [arr.q[:, :lookahead]]
    if signals != ("q",):
        try:
            ent, margin = arr.signals(f"signals={list(signals)!r}")
        except ValueError as exc:
            raise ValueError(f"dataset={dataset!r}: {exc}") from None
        blocks += [x[:, :lookahead] for sig, x in (("ent", ent), ("margin", margin)) if sig in signals]
    cost, ar_ms, ar_unit = _charged_tables(model, arr, kmax, lookahead, cost_model, drafting)
    offsets = arr.offsets.astype(np.int64)
    spec = ObservationSpec(
        kmax=kmax,
        lookahead=lookahead,
        max_new_tokens=int(ts.manifest.max_new_tokens),
        n_experts=int(ts.facts.n_experts),
        signals=signals,
    )
    return ReplayData(
        dataset=dataset,
        name=ts.manifest.name,
        split=split,
        kmax=kmax,
        lookahead=lookahead,
        spec=spec,
        cost_model=model,
        generation_ids=arr.generation_ids.astype(np.int64),
        categories=arr.categories.astype(object),
        offsets=offsets,
        lengths=np.diff(offsets),
        L0=np.rint(arr.L[offsets[:-1]]).astype(np.int64),
        survival=np.concatenate([arr.survival(), np.zeros((len(arr.L), 1))], axis=1),
        cost=np.ascontiguousarray(cost),
        U=np.ascontiguousarray(arr.U),
        conf=np.ascontiguousarray(np.concatenate(blocks, axis=1)),
        ar_ms=ar_ms,
        ar_unit_ms=ar_unit,
        ar_ctx_ms=np.ascontiguousarray(np.asarray(model.ar_ms(arr.L), dtype=np.float64)),
        ar_total_ms=np.add.reduceat(ar_ms, offsets[:-1]),
        max_len=int(np.diff(offsets).max()),
        drafting=drafting,
        signals=signals,
    )
