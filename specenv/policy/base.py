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

from specenv.observation import ObservationSpec


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
    :class:`ObsView`. ``act_batch`` keeps one copy of the policy per stream.

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
        if obs[9] >= 0.5:  # first_round
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


class ObsView:
    """Decodes the observation vector back into physical units (see :mod:`specenv.observation`)."""

    def __init__(self, spec: ObservationSpec):
        from specenv.observation import CONTEXT_SCALE

        self.spec = spec
        self.scale = CONTEXT_SCALE
        self.conf_slice = slice(10 + spec.kmax, 10 + spec.kmax + spec.lookahead)
        self.depth_slice = slice(10, 10 + spec.kmax)

    def L(self, obs: np.ndarray) -> float:
        """Context length."""
        return float(obs[0]) * self.scale

    def prev_k(self, obs: np.ndarray) -> int:
        """Previous round's budget."""
        return int(round(float(obs[2]) * self.spec.kmax))

    def prev_accepted(self, obs: np.ndarray) -> int:
        """Previous round's accepted drafts."""
        return int(round(float(obs[3]) * self.spec.kmax))

    def prev_U(self, obs: np.ndarray) -> float:
        """Previous round's unique experts."""
        return float(obs[4]) * self.spec.n_experts

    def prev_cost(self, obs: np.ndarray) -> float:
        """Previous round's cost in mean-AR-step units."""
        return float(obs[5]) * (self.spec.kmax + 1)

    def acc_rate(self, obs: np.ndarray) -> float:
        """Running per-draft acceptance rate."""
        return float(obs[6])

    def first_round(self, obs: np.ndarray) -> bool:
        """True on a generation's first round."""
        return bool(obs[9] >= 0.5)

    def acc_depth(self, obs: np.ndarray) -> np.ndarray:
        """Running conditional acceptance per draft depth (kmax,)."""
        return np.asarray(obs[self.depth_slice], dtype=np.float64)

    def conf(self, obs: np.ndarray) -> np.ndarray:
        """Draft confidences of the next ``lookahead`` drafts (empty without lookahead)."""
        return np.asarray(obs[self.conf_slice], dtype=np.float64)
