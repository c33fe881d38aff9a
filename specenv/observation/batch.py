"""The batch observation contract: B stacked per-request observations plus batch features.

The observation of ``specenv/MoESpecBatch-v0`` (:mod:`specenv.envs.batch`) and of every batch
policy (:mod:`policies.batch.controllers`) is one flat float32 vector (DESIGN.md section 3, "batch
environment")::

    [slot 0: active, <per-request observation>] ... [slot B-1: active, <per-request observation>]
    [n_active, queue, prev_U_batch, prev_step_cost]

* ``active`` is 1 for a slot that serves a request, 0 for an idle slot (the tail of an episode,
  when fewer than B requests remain); an idle slot's block is all zeros;
* the per-request observation is the single-stream contract of :mod:`specenv.observation.single`
  (:class:`specenv.observation.single.ObservationSpec`, its version included) with one batch meaning:
  ``prev_cost`` and ``cost_per_token`` are the previous *step's* cost divided by the plain
  autoregressive step of the same batch at the same contexts
  (:meth:`specenv.cost.batch.BatchCostModel.ar_ms`), what a server running the batch knows; at
  B = 1 that is the single environment's ``C / C_AR(L)``;
* ``n_active``: active slots / B; ``queue``: requests not yet started / R;
  ``prev_U_batch``: the previous step's expert union (mean over layers) / n_experts;
  ``prev_step_cost``: the previous step's cost / (batch AR step) / (kmax+1), clipped at
  ``cost_high`` like ``prev_cost``. All four are 0 before the first step (``queue`` excepted).

:data:`BATCH_OBSERVATION_VERSION` versions this layout (on top of the per-request contract's own
version); :meth:`BatchObservationSpec.to_json` records both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from specenv.observation.single import ObservationSpec

__all__ = ["BATCH_FEATURES", "BATCH_OBSERVATION_VERSION", "BatchObservationSpec"]

BATCH_OBSERVATION_VERSION = 1
"""Version of the batch layout (slot blocks + batch features); bumped on any change."""

#: Features after the B slot blocks.
BATCH_FEATURES = ("n_active", "queue", "prev_U_batch", "prev_step_cost")


@dataclass(frozen=True)
class BatchObservationSpec:
    """Layout of the batch observation (module docstring).

    Attributes:
        request: The per-request observation contract.
        batch_size: B, the number of slots.
        version: :data:`BATCH_OBSERVATION_VERSION`.
    """

    request: ObservationSpec
    batch_size: int
    version: int = BATCH_OBSERVATION_VERSION

    def __post_init__(self) -> None:
        if self.version != BATCH_OBSERVATION_VERSION:
            raise ValueError(f"batch observation version {self.version} != {BATCH_OBSERVATION_VERSION}")
        if (
            isinstance(self.batch_size, bool)
            or not isinstance(self.batch_size, (int, np.integer))
            or self.batch_size < 1
        ):
            raise ValueError(f"batch_size={self.batch_size!r}: must be an integer >= 1")

    @property
    def slot_dim(self) -> int:
        """Length of one slot block (``active`` + the per-request vector)."""
        return 1 + self.request.dim

    @property
    def dim(self) -> int:
        """Length of the whole vector."""
        return self.batch_size * self.slot_dim + len(BATCH_FEATURES)

    @property
    def names(self) -> list[str]:
        """Feature names in vector order (``s{i}.active``, ``s{i}.<name>``, then the batch features)."""
        out: list[str] = []
        for i in range(self.batch_size):
            out += [f"s{i}.active"] + [f"s{i}.{n}" for n in self.request.names]
        return out + list(BATCH_FEATURES)

    def high(self) -> np.ndarray:
        """Upper bounds of the Box (the lower bounds are 0); a fresh copy."""
        return self._high.copy()

    @functools.cached_property
    def _high(self) -> np.ndarray:
        slot = np.concatenate([[1.0], self.request.high()]).astype(np.float32)
        tail = np.array([1.0, 1.0, 1.0, self.request.cost_high], dtype=np.float32)
        return np.concatenate([np.tile(slot, self.batch_size), tail]).astype(np.float32)

    def space(self) -> spaces.Box:
        """The batch observation space (1-D float32)."""
        return spaces.Box(low=np.zeros(self.dim, dtype=np.float32), high=self.high(), dtype=np.float32)

    def slots(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Split a batch vector into ``(active (B,) bool, per-request observations (B, dim))``."""
        obs = np.asarray(obs, dtype=np.float32)
        blocks = obs[: self.batch_size * self.slot_dim].reshape(self.batch_size, self.slot_dim)
        return blocks[:, 0] >= 0.5, blocks[:, 1:]

    def batch_features(self, obs: np.ndarray) -> dict[str, float]:
        """The batch features of a vector, by name."""
        tail = np.asarray(obs, dtype=np.float64)[self.batch_size * self.slot_dim :]
        return dict(zip(BATCH_FEATURES, (float(x) for x in tail), strict=True))

    def assemble(self, active: np.ndarray, requests: np.ndarray, features: np.ndarray) -> np.ndarray:
        """The vector from ``active`` (B,), per-request observations (B, dim) and the batch features (4,).

        Idle slots are written as zeros whatever ``requests`` holds; the result is clipped to the Box.
        """
        act = np.asarray(active, dtype=bool)
        blocks = np.zeros((self.batch_size, self.slot_dim), dtype=np.float32)
        blocks[:, 0] = act
        blocks[act, 1:] = np.asarray(requests, dtype=np.float32)[act]
        vec = np.concatenate([blocks.ravel(), np.asarray(features, dtype=np.float32)])
        return np.clip(vec, 0.0, self._high).astype(np.float32)

    def to_json(self) -> dict[str, Any]:
        """The contract as plain JSON (the per-request contract under ``"request"``)."""
        return {
            "batch_version": self.version,
            "batch_size": self.batch_size,
            "dim": self.dim,
            "batch_features": list(BATCH_FEATURES),
            "request": self.request.to_json(),
        }
