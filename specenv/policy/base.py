"""The one policy protocol used everywhere: environments, benchmark, oracle evaluation, vLLM controller.

A policy sees only observation vectors (:mod:`specenv.observation.single`) and what it remembers of earlier
rounds, never the trace. It acts on a **batch**::

    act(obs: (n, dim) stacked per-request observations,
        ids: Sequence[Hashable] | None = None,   # one stable stream id per row (default: the positions)
        step: BatchStep | None = None,           # batch-level facts of the step (batch controllers)
        ) -> (n,) int64 budgets

* one row per stream (a generation of the replay environment, a request of the vLLM server, a slot
  of the batch environment), in the caller's order; a stateful policy keys its memory by the id: an
  id not seen before is a new stream, and a row with ``first_round == 1`` starts a new generation
  whatever its id, so no separate per-stream reset signal is needed;
* ``step`` (:class:`BatchStep`) carries the batch features of :mod:`specenv.observation.batch` (``n_active``,
  ``queue``, ``prev_U_batch``, ``prev_step_cost``) as named fields; per-request policies ignore it,
  a batch controller that decides all rows of a step jointly may read it (never by unpacking a flat
  vector);
* ``reset()`` forgets every stream; ``release(ids)`` (optional) forgets finished ones;
* ``stateless = True`` promises that ``act`` depends on its arguments only (no memory), so a server
  may ask it what it *would* do (the vLLM draft horizon) without a copy;
* ``observes = False`` (optional, default True) promises that ``act`` reads neither the rows' values
  nor ``step``, only how many rows there are (a fixed k, vLLM's batch-size table): a server may then
  hand it rows of zeros and skip building observations (the vLLM controller's blind path,
  :mod:`specenv.engines.vllm.controller`);
* ``observes_at(n) -> bool`` (optional) narrows that per step: False promises that a step deciding ``n``
  requests reads no row and answers k = 0 for each (a policy gated by the batch size,
  :class:`policies.batch.controllers.TableGated`, where its table says 0); the server may then run that
  step blind, and answers k = 0 itself for a step it ran blind whose ``n`` turned out to read rows (the
  policy is never asked about rows of zeros it would read).

Single-request use is a batch of one: ``act(obs)`` with a 1-D observation is the cheap alias
``int(act(obs[None], ids, step)[0])`` (the Gymnasium loop ``env.step(policy.act(obs))``), and
``act_batch(obs)`` the alias ``act(obs)`` on rows; both are one line and delegate. The flat
observation of ``specenv/MoESpecBatch-v0`` (B slot blocks plus the batch features) is turned into
``(rows of the active slots, slot ids, BatchStep)`` in one place, :func:`act_batch_obs`.

:class:`Policy` is the base class of the per-request policies: it keeps one private copy of the
policy's per-generation memory per stream id (``_streams``, written only by this class) and resets a
stream on its first round; the stream of id ``None`` (single-request use) is the object itself. A
policy with a joint action (the expert-cap policies of
``specenv/MoESpecCap-v0``) returns ``(n, 2)`` ``(k, cap level)`` rows instead of ``(n,)``; a
privileged policy (the oracle expert) reads the replay state ``(generation_id, t)`` from its ids.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from specenv.observation.single import ObservationSpec, ObsView

__all__ = [
    "BatchStep",
    "ObsView",
    "Policy",
    "PolicyProtocol",
    "act_batch_obs",
    "policy_drafting",
    "policy_signals",
    "policy_spec",
]


@dataclass(frozen=True)
class BatchStep:
    """Batch-level facts of one decision step (the batch features of :mod:`specenv.observation.batch`, by name).

    Attributes:
        n_active: Active requests / B (the batch size the policy decides for).
        queue: Requests not yet started / requests of the episode (a server: waiting / known requests).
        prev_U_batch: The previous step's expert union (mean over layers) / n_experts (0 before one).
        prev_step_cost: The previous step's cost / (batch AR step) / (kmax+1) (0 before one).
    """

    n_active: float = 0.0
    queue: float = 0.0
    prev_U_batch: float = 0.0
    prev_step_cost: float = 0.0

    @classmethod
    def from_features(cls, features: Mapping[str, float]) -> BatchStep:
        """From :meth:`specenv.observation.batch.BatchObservationSpec.batch_features` (names as fields)."""
        return cls(**{k: float(v) for k, v in features.items()})


@runtime_checkable
class PolicyProtocol(Protocol):
    """What every policy provides (module docstring)."""

    name: str

    def reset(self) -> None:
        """Forget every stream."""

    def act(self, obs: np.ndarray, ids: Sequence[Hashable] | None = None, step: BatchStep | None = None) -> Any:
        """(n,) budgets for (n, dim) stacked observations of streams ``ids`` (a 1-D observation: one int)."""


def act_batch_obs(policy: Any, spec: Any, obs: np.ndarray) -> np.ndarray:
    """(B,) budgets of a policy for the flat batch observation ``obs``: the one adapter of the batch env.

    The active slots' rows (:meth:`specenv.observation.batch.BatchObservationSpec.slots`), their slot numbers
    as ids and the batch features as a :class:`BatchStep` go to ``policy.act``; idle slots get 0.

    Args:
        policy: Any policy of the protocol.
        spec: The :class:`specenv.observation.batch.BatchObservationSpec` of ``obs``.
        obs: The flat batch observation.
    """
    active, rows = spec.slots(obs)
    idx = np.flatnonzero(active)
    k = np.zeros(spec.batch_size, dtype=np.int64)
    if len(idx):
        k[idx] = policy.act(rows[idx], idx.tolist(), BatchStep.from_features(spec.batch_features(obs)))
    return k


def policy_spec(policy: object) -> ObservationSpec | None:
    """The per-request observation contract a policy reads (a batch controller's ``spec.request``), or None."""
    spec = getattr(policy, "spec", None)
    spec = getattr(spec, "request", spec)
    return spec if isinstance(spec, ObservationSpec) else None


class Policy:
    """Base class of the per-request policies: per-stream memory keyed by id, reset on ``first_round``.

    Subclasses implement :meth:`_reset_state` (the per-generation memory) and :meth:`_act` (one
    observation of one stream), or, when ``stateless``, :meth:`_act_rows` (all rows at once); they
    read features through :class:`specenv.observation.single.ObsView` (``self.view``). Every stream id gets
    its own shallow copy of the policy with fresh memory; only this class writes ``_streams``.

    Args:
        spec: Observation layout the policy reads.
    """

    name = "policy"
    #: True: budgets depend on the observation rows only; :meth:`_act_rows` answers all rows at once.
    stateless = False

    def __init__(self, spec: ObservationSpec):
        self.spec = spec
        self.view = ObsView(spec)
        self._streams: dict[Hashable, Policy] = {}
        self._reset_state()

    # -- to implement
    def _reset_state(self) -> None:
        """Clear per-generation memory."""

    def _act(self, obs: np.ndarray) -> int:
        raise NotImplementedError

    def _act_rows(self, obs: np.ndarray) -> np.ndarray:
        """(n,) budgets of a stateless policy for (n, dim) rows (default: :meth:`_act` row by row)."""
        return np.array([self._act(o) for o in obs], dtype=np.int64)

    # -- protocol
    def reset(self) -> None:
        """Forget every stream."""
        self._streams = {}
        self._reset_state()

    def release(self, ids: Sequence[Hashable]) -> None:
        """Forget finished streams."""
        for i in ids:
            if i is None:
                self._reset_state()
            self._streams.pop(i, None)

    def act(self, obs: np.ndarray, ids: Sequence[Hashable] | None = None, step: BatchStep | None = None) -> Any:
        """(n,) budgets for (n, dim) rows of streams ``ids`` (default 0..n-1); each stream keeps its own memory.

        A 1-D observation is the alias for a batch of one (returns an int) whose stream is the id None:
        the policy object's own memory, so single-request use reads its state on the object.
        """
        x = np.asarray(obs, dtype=np.float32)
        if x.ndim == 1:  # alias: single-request use is a batch of one, stream None (the object itself)
            return int(self.act(x[None, :], [None] if ids is None else ids, step)[0])
        if self.stateless:
            return np.asarray(self._act_rows(x), dtype=np.int64)
        keys = range(len(x)) if ids is None else ids
        return np.array([self._stream(i)._step(o) for i, o in zip(keys, x, strict=True)], dtype=np.int64)

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        """Alias: ``act`` on (n, dim) rows, streams by position."""
        return self.act(np.atleast_2d(np.asarray(obs, dtype=np.float32)))

    # -- per-stream memory
    def _stream(self, i: Hashable) -> Policy:
        if i is None:  # the single-request stream: the policy's own attributes
            return self
        s = self._streams.get(i)
        if s is None:
            s = copy.copy(self)
            s._streams = {}
            s._reset_state()
            self._streams[i] = s
        return s

    def _step(self, obs: np.ndarray) -> int:
        """One round of this stream (a generation's first round resets its memory), k clipped to 0..kmax."""
        if self.view.first_round(obs):
            self._reset_state()
        k = int(self._act(obs))
        return min(max(k, 0), self.spec.kmax)


def policy_signals(policy: object) -> tuple[str, ...]:
    """The draft signals a policy's lookahead block reads, in layout order (``()`` without lookahead).

    From its spec's ``signals`` (observation contract version 2); a spec without that field reads
    the confidences q only.
    """
    spec = policy_spec(policy)
    if spec is None or not spec.lookahead:
        return ()
    return tuple(getattr(spec, "signals", ("q",)))


def policy_drafting(policy: object) -> str:
    """The drafting mode a policy uses (:data:`specenv.cost.model.DRAFTING_MODES`).

    A ``drafting`` attribute of the policy wins, then ``meta["drafting"]`` of an exported policy
    (``policy.json``); otherwise the lookahead decides as everywhere else: ``"block"`` for h > 0,
    ``"none"`` for h = 0 (:func:`specenv.cost.model.drafting_mode`).

    Raises:
        ValueError: If the declared mode is not a drafting mode.
    """
    from specenv.cost.model import DRAFTING_MODES, drafting_mode

    mode = getattr(policy, "drafting", None)
    if mode is None:
        meta = getattr(policy, "meta", None)
        mode = meta.get("drafting") if isinstance(meta, dict) else None
    if mode is None:
        spec = policy_spec(policy)
        return drafting_mode(spec.lookahead if spec is not None else 0)
    if mode not in DRAFTING_MODES:
        raise ValueError(f"drafting mode {mode!r}: expected one of {', '.join(DRAFTING_MODES)}")
    return str(mode)
