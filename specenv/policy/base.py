"""The policy protocol used everywhere: environments, benchmark, oracle evaluation, vLLM controller.

A policy sees only observation vectors (:mod:`specenv.observation`) and what it remembers of earlier
rounds, never the trace. ``reset()`` starts a new generation; ``act(obs) -> k`` picks the budget of
the next round; ``act_batch(obs) -> ks`` does the same for a batch of independent streams (the
vector environment or many vLLM requests). A stream whose observation has ``first_round == 1``
starts a new generation, so batched use needs no separate reset signal.
"""

from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import numpy as np

from specenv.observation import ObservationSpec, ObsView

__all__ = ["ObsView", "Policy", "PolicyProtocol", "policy_drafting", "policy_signals"]


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
