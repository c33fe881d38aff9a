"""The deployable policy form: a numpy-only MLP, stored as ``policy.json`` + ``weights.npz``.

No torch, no SB3, no pickle: ``weights.npz`` holds float32 arrays ``W0, b0, W1, b1, ...`` (read
with ``allow_pickle=False``) and ``policy.json`` the architecture, the full observation contract it
was trained on (:meth:`specenv.observation.ObservationSpec.to_json`: version, feature names, sizes
and every scaling constant) and provenance. This is what runs inside vLLM's scheduler.

A ``policy.json`` written before the contract was versioned records only kmax, lookahead,
max_new_tokens and n_experts; it is read as observation version 1 with the constants of that
release (:func:`specenv.observation.upgrade_contract`).

The network maps an observation to one score per budget k = 0..kmax (PPO: action logits; DQN:
Q-values; imitation: logits); the policy plays ``argmax`` (deterministic).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from specenv.io import atomic_file, atomic_write_json
from specenv.observation import ObservationSpec, mismatch_json, upgrade_contract
from specenv.policy.base import Policy

FORMAT = "specenv.policy/1"
ACTIVATIONS = {
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0.0),
}


class MLPPolicy(Policy):
    """Deterministic argmax over the scores of a small MLP (stateless, batched natively).

    Args:
        spec: Observation layout (must match the one it was trained on).
        weights: ``[(W0, b0), (W1, b1), ...]`` with ``W`` of shape (in, out).
        activation: Hidden activation, ``"tanh"`` or ``"relu"`` (none after the last layer).
        name: Display name.
        meta: Provenance kept with the policy.
    """

    def __init__(
        self,
        spec: ObservationSpec,
        weights: list[tuple[np.ndarray, np.ndarray]],
        activation: str = "tanh",
        name: str = "mlp",
        meta: dict[str, Any] | None = None,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: expected one of {sorted(ACTIVATIONS)}")
        if not weights:
            raise ValueError("weights: need at least one layer")
        if weights[0][0].shape[0] != spec.dim:
            raise ValueError(f"weights: first layer takes {weights[0][0].shape[0]} inputs, observation has {spec.dim}")
        if weights[-1][0].shape[1] != spec.kmax + 1:
            raise ValueError(f"weights: last layer gives {weights[-1][0].shape[1]} scores, need kmax+1={spec.kmax + 1}")
        for i in range(1, len(weights)):
            if weights[i][0].shape[0] != weights[i - 1][0].shape[1]:
                raise ValueError(f"weights: layer {i} input size does not match layer {i - 1} output size")
        self.weights = [(np.asarray(W, np.float32), np.asarray(b, np.float32)) for W, b in weights]
        self.activation = activation
        self.name = name
        self.meta = dict(meta or {})
        super().__init__(spec)

    def scores(self, obs: np.ndarray) -> np.ndarray:
        """(n, kmax+1) scores of a batch of observations."""
        x = np.atleast_2d(np.asarray(obs, dtype=np.float32))
        act = ACTIVATIONS[self.activation]
        for i, (W, b) in enumerate(self.weights):
            x = x @ W + b
            if i < len(self.weights) - 1:
                x = act(x)
        return x

    def _act(self, obs: np.ndarray) -> int:
        return int(np.argmax(self.scores(obs)[0]))

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        """Budgets for a batch (stateless, one matrix product per layer)."""
        return np.argmax(self.scores(obs), axis=1).astype(np.int64)

    # ------------------------------------------------------------------ I/O
    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``policy.json`` and ``weights.npz`` atomically into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {}
        for i, (W, b) in enumerate(self.weights):
            arrays[f"W{i}"] = W
            arrays[f"b{i}"] = b
        spec = self.spec
        meta = {
            "format": FORMAT,
            "kind": "mlp",
            "name": self.name,
            "activation": self.activation,
            "layers": len(self.weights),
            "observation": spec.to_json(),
            "meta": self.meta,
        }
        with atomic_file(folder / "weights.npz") as tmp, open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        atomic_write_json(folder / "policy.json", meta)
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike[str], expect: ObservationSpec | None = None) -> MLPPolicy:
        """Read a policy written by :meth:`save`.

        Args:
            folder: The folder with ``policy.json`` and ``weights.npz``.
            expect: The observation contract of the environment or server the policy is for; None
                accepts any contract this code can build.

        Raises:
            ValueError: One line naming the file and the problem; for a contract that differs from
                ``expect``: ``"<folder>/policy.json: observation contract differs: kmax 10 != 8"``
                (the stored value first, then the expected one).
        """
        folder = Path(folder)
        pj, pw = folder / "policy.json", folder / "weights.npz"
        try:
            meta = json.loads(pj.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{pj}: cannot read policy ({exc.__class__.__name__}: {exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("kind") != "mlp":
            raise ValueError(f"{pj}: not a specenv MLP policy (format must be '{FORMAT}', kind 'mlp')")
        stored = meta.get("observation")
        if not isinstance(stored, dict):
            raise ValueError(f"{pj}: no observation contract ('observation' must be an object)")
        stored = upgrade_contract(stored)
        if expect is not None:
            bad = mismatch_json(stored, expect.to_json())
            if bad is not None:
                raise ValueError(f"{pj}: observation contract differs: {bad}")
        try:
            spec = ObservationSpec.from_json(stored)
        except ValueError as exc:
            raise ValueError(f"{pj}: observation contract: {exc}") from None
        try:
            n = int(meta["layers"])
            with np.load(pw, allow_pickle=False) as z:
                weights = [(z[f"W{i}"], z[f"b{i}"]) for i in range(n)]
        except (KeyError, TypeError, ValueError, OSError) as exc:
            raise ValueError(f"{pw}: bad policy weights ({exc.__class__.__name__}: {exc})") from None
        return cls(spec, weights, meta.get("activation", "tanh"), meta.get("name", folder.name), meta.get("meta"))
