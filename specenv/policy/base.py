"""The policy protocol used everywhere: environments, benchmark, oracle evaluation, vLLM controller.

A policy sees only observation vectors (:mod:`specenv.observation`) and what it remembers of earlier
rounds, never the trace. ``reset()`` starts a new generation; ``act(obs) -> k`` picks the budget of
the next round; ``act_batch(obs) -> ks`` does the same for a batch of independent streams (the
vector environment or many vLLM requests). A stream whose observation has ``first_round == 1``
starts a new generation, so batched use needs no separate reset signal.

**Batch policies** (:class:`BatchPolicyProtocol`, issue 15 item 5) decide one batched verification step
jointly: ``act_step(obs, streams) -> ks`` gets the stacked observations (B, dim) of every request of the
step, one row per request in the server's order, and ``streams``, one stable id per row (an id not seen
before is a new request; its row has ``first_round == 1``); it returns all B budgets at once. The
optional ``release(streams)`` is called when requests finish, so a stateful batch policy can forget
them. A batch policy sets ``batch_policy = True`` (:func:`is_batch_policy`); with ``stateless = True``
it promises that ``act_step`` depends on its arguments only, so the vLLM controller may also ask it
what it would do (the draft horizon). The vLLM controller (``specenv.engines.vllm.controller``) calls
``act_step`` once per engine step; ``act``/``act_batch`` keep it usable wherever a plain policy is.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from specenv.observation import ObservationSpec, ObsView

__all__ = [
    "BatchPolicyProtocol",
    "ObsView",
    "Policy",
    "PolicyProtocol",
    "is_batch_policy",
    "policy_drafting",
    "policy_signals",
]


@runtime_checkable
class PolicyProtocol(Protocol):
    """What every policy provides."""

    name: str

    def reset(self) -> None:
        """Forget the current generation."""

    def act(self, obs: np.ndarray) -> int:
        """Budget k for the next round given one observation vector."""

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        """Budgets for a (n, dim) batch of observations of independent streams."""


@runtime_checkable
class BatchPolicyProtocol(Protocol):
    """A policy that decides every request of a batched step at once (module docstring)."""

    name: str
    batch_policy: bool

    def reset(self) -> None:
        """Forget every request."""

    def act_step(self, obs: np.ndarray, streams: Sequence[Hashable]) -> np.ndarray:
        """Budgets (B,) for the stacked observations (B, dim) of one step's requests, ids ``streams``."""


def is_batch_policy(policy: object) -> bool:
    """Whether ``policy`` declares ``batch_policy = True`` and has an ``act_step`` method."""
    return bool(getattr(policy, "batch_policy", False)) and callable(getattr(policy, "act_step", None))


class Policy:
    """Base class: per-stream state for stateful policies, automatic reset on ``first_round``.

    Subclasses implement :meth:`_reset_state` and :meth:`_act`; they read features through
    :class:`specenv.observation.ObsView` (``self.view``). ``act_batch`` keeps one copy of the policy per stream.

    Args:
        spec: Observation layout the policy reads.
    """

    name = "policy"

    def __init__(self, spec: ObservationSpec):
        self.spec = spec
        self.view = ObsView(spec)
        self._streams: list[Policy] = []
        self._reset_state()

    # -- to implement
    def _reset_state(self) -> None:
        """Clear per-generation memory."""

    def _act(self, obs: np.ndarray) -> int:
        raise NotImplementedError

    # -- protocol
    def reset(self) -> None:
        """Forget the current generation."""
        self._reset_state()

    def act(self, obs: np.ndarray) -> int:
        """Budget for the next round (resets itself on a generation's first round)."""
        obs = np.asarray(obs, dtype=np.float32)
        if self.view.first_round(obs):
            self._reset_state()
        k = int(self._act(obs))
        return min(max(k, 0), self.spec.kmax)

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        """Budgets for a batch; stream i keeps its own memory across calls."""
        obs = np.atleast_2d(np.asarray(obs, dtype=np.float32))
        while len(self._streams) < len(obs):
            clone = copy.copy(self)
            clone._streams = []
            clone._reset_state()
            self._streams.append(clone)
        return np.array([s.act(o) for s, o in zip(self._streams, obs, strict=False)], dtype=np.int64)


def policy_signals(policy: object) -> tuple[str, ...]:
    """The draft signals a policy's lookahead block reads, in layout order (``()`` without lookahead).

    From its spec's ``signals`` (observation contract version 2); a spec without that field reads
    the confidences q only.
    """
    spec = getattr(policy, "spec", None)
    if not isinstance(spec, ObservationSpec) or not spec.lookahead:
        return ()
    return tuple(getattr(spec, "signals", ("q",)))


def policy_drafting(policy: object) -> str:
    """The drafting mode a policy uses (:data:`specenv.costmodel.DRAFTING_MODES`).

    A ``drafting`` attribute of the policy wins, then ``meta["drafting"]`` of an exported policy
    (``policy.json``); otherwise the lookahead decides as everywhere else: ``"block"`` for h > 0,
    ``"none"`` for h = 0 (:func:`specenv.costmodel.drafting_mode`).

    Raises:
        ValueError: If the declared mode is not a drafting mode.
    """
    from specenv.costmodel import DRAFTING_MODES, drafting_mode

    mode = getattr(policy, "drafting", None)
    if mode is None:
        meta = getattr(policy, "meta", None)
        mode = meta.get("drafting") if isinstance(meta, dict) else None
    if mode is None:
        spec = getattr(policy, "spec", None)
        return drafting_mode(spec.lookahead if isinstance(spec, ObservationSpec) else 0)
    if mode not in DRAFTING_MODES:
        raise ValueError(f"drafting mode {mode!r}: expected one of {', '.join(DRAFTING_MODES)}")
    return str(mode)
