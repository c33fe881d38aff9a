"""The deployable policy form: a numpy-only MLP, stored as ``policy.json`` + ``weights.npz``.

No torch, no SB3, no pickle: ``weights.npz`` holds float32 arrays ``W0, b0, W1, b1, ...`` (read
with ``allow_pickle=False``) and ``policy.json`` the architecture, the full observation contract it
was trained on (:meth:`specenv.observation.single.ObservationSpec.to_json`: version, feature names, sizes
and every scaling constant) and provenance. This is what runs inside vLLM's scheduler.

A ``policy.json`` written before the contract was versioned records only kmax, lookahead,
max_new_tokens and n_experts; it is read as observation version 1 with the constants of that
release (:func:`specenv.observation.single.upgrade_contract`) and, like every version-1 policy, refused
with one line: version 2 changed what ``prev_cost`` means (retrain it).

The network maps an observation to one score per budget k = 0..kmax (PPO: action logits; DQN:
Q-values; imitation: logits); the policy plays ``argmax`` (deterministic). A policy of the per-token
environment ``specenv/MoESpecSeq-v0`` (a contract with ``per_token``) is a stop rule: two scores,
0 = stop and verify, 1 = draft one more token (:func:`n_actions`); :mod:`policies.learn.stopping` runs it
in the round-level environments.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from specenv.io import atomic_file, atomic_write_json
from specenv.observation.single import ObservationSpec, mismatch_json, upgrade_contract
from specenv.policy.base import Policy

FORMAT = "specenv.policy/1"
ACTIVATIONS = {
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0.0),
}


def n_actions(spec: ObservationSpec) -> int:
    """Scores of a policy for this contract.

    ``kmax + 1`` budgets, 2 (stop, draft) for a per-token contract, ``(cap_levels + 1) * (kmax + 1)``
    joint (k, cap) actions for a contract with cap levels.
    """
    return 2 if spec.per_token else (spec.cap_levels + 1) * (spec.kmax + 1)


class MLPPolicy(Policy):
    """Deterministic argmax over the scores of a small MLP (stateless, batched natively).

    Args:
        spec: Observation layout (must match the one it was trained on).
        weights: ``[(W0, b0), (W1, b1), ...]`` with ``W`` of shape (in, out).
        activation: Hidden activation, ``"tanh"`` or ``"relu"`` (none after the last layer).
        name: Display name.
        meta: Provenance kept with the policy.
    """

    stateless = True

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
        for i, (W, b) in enumerate(weights):
            _check_layer(i, np.asarray(W), np.asarray(b))
        if weights[0][0].shape[0] != spec.dim:
            raise ValueError(f"weights: first layer takes {weights[0][0].shape[0]} inputs, observation has {spec.dim}")
        if weights[-1][0].shape[1] != n_actions(spec):
            raise ValueError(f"weights: last layer gives {weights[-1][0].shape[1]} scores, need {_need(spec)}")
        for i in range(1, len(weights)):
            if weights[i][0].shape[0] != weights[i - 1][0].shape[1]:
                raise ValueError(f"weights: layer {i} input size does not match layer {i - 1} output size")
        self.weights = [(np.asarray(W, np.float32), np.asarray(b, np.float32)) for W, b in weights]
        self.activation = activation
        self.name = name
        self.meta = dict(meta or {})
        super().__init__(spec)

    def scores(self, obs: np.ndarray) -> np.ndarray:
        """(n, kmax+1) scores of a batch of observations ((n, 2) for a per-token stop rule)."""
        if type(obs) is np.ndarray and obs.dtype == np.float32 and obs.ndim == 2:
            x = obs  # (the served rows: no conversion call)
        else:
            x = np.atleast_2d(np.asarray(obs, dtype=np.float32))
        act = ACTIVATIONS[self.activation]
        last = len(self.weights) - 1
        for i, (W, b) in enumerate(self.weights):
            x = np.matmul(x, W)
            x += b  # (in place: the same sums as x @ W + b)
            if i < last:
                x = act(x)
        return x

    def _act_rows(self, obs: np.ndarray) -> np.ndarray:
        """Budgets for (n, dim) rows (stateless, one matrix product per layer).

        A row whose scores are not all finite gets ``-1``, an invalid budget: ``argmax`` of NaN
        scores would be 0, a valid k that silently turns speculation off. Callers that validate k
        (the vLLM controller's fail-safe, the environments' action check) refuse it.
        """
        scores = self.scores(obs)
        ks = scores.argmax(axis=1)
        if ks.dtype != np.int64:
            ks = ks.astype(np.int64)
        if not math.isfinite(scores.sum()):  # (a finite sum: every score finite) the rows with a non-finite score
            ks[~np.isfinite(scores).all(axis=1)] = -1
        return ks

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
        from specenv.validation import check, read_json

        folder = Path(folder)
        pj, pw = folder / "policy.json", folder / "weights.npz"
        meta = read_json(pj, what="policy")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("kind") != "mlp":
            raise ValueError(f"{pj}: not a specenv MLP policy (format must be '{FORMAT}', kind 'mlp')")
        doc = check("PolicyJSON", meta, str(pj))
        stored = upgrade_contract(doc.observation)
        if expect is not None:
            bad = mismatch_json(stored, expect.to_json())
            if bad is not None:
                if stored.get("version") == 1:
                    bad += " (version 1 divided prev_cost by the split's mean AR step; retrain the policy)"
                raise ValueError(f"{pj}: observation contract differs: {bad}")
        try:
            spec = ObservationSpec.from_json(stored)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{pj}: observation contract: {exc}") from None
        weights = _load_weights(pw, doc.layers, spec)
        return cls(spec, weights, doc.activation, doc.name if "name" in meta else folder.name, dict(doc.meta))


def _need(spec: ObservationSpec) -> str:
    if spec.cap_levels:
        return f"(cap_levels+1)*(kmax+1)={n_actions(spec)} joint (k, cap) actions"
    return "2 (stop, draft) for a per-token contract" if spec.per_token else f"kmax+1={spec.kmax + 1}"


def _check_layer(i: int, W: np.ndarray, b: np.ndarray, file: str = "weights") -> None:
    """Layer i: W 2-D, b 1-D of W's output size, floating point, finite."""
    if W.ndim != 2:
        raise ValueError(f"{file}: W{i} must be 2-D (in, out), has shape {W.shape}")
    if b.ndim != 1 or b.shape[0] != W.shape[1]:
        raise ValueError(f"{file}: b{i} must have shape ({W.shape[1]},) to match W{i} {W.shape}, has {b.shape}")
    for name, arr in ((f"W{i}", W), (f"b{i}", b)):
        if arr.dtype.kind != "f":
            raise ValueError(f"{file}: {name} must be floating point, has dtype {arr.dtype}")
        if not np.isfinite(arr).all():
            raise ValueError(f"{file}: {name} holds NaN or infinite values")


def _load_weights(pw: Path, layers: int, spec: ObservationSpec) -> list[tuple[np.ndarray, np.ndarray]]:
    """The arrays of ``weights.npz``, their shapes checked from the .npy headers before anything is read.

    Raises:
        ValueError: One line naming ``weights.npz`` and the array: not a zip, missing or unexpected
            array, a shape that does not chain from the observation (``spec.dim`` inputs) to
            ``kmax + 1`` scores, a non-float dtype, too many elements, NaN or infinite values.
    """
    import zipfile
    import zlib

    from specenv.validation import POLICY_ELEMENTS_MAX, npz_headers

    heads = npz_headers(pw)
    want = [f"{p}{i}" for i in range(layers) for p in ("W", "b")]
    for name in want:
        if name not in heads:
            raise ValueError(f"{pw}: array '{name}' missing (policy.json declares {layers} layers)")
    extra = sorted(set(heads) - set(want))
    if extra:
        raise ValueError(f"{pw}: unexpected array '{extra[0]}' (policy.json declares {layers} layers)")
    total = 0
    width = spec.dim
    for i in range(layers):
        (ws, wd), (bs, bd) = heads[f"W{i}"], heads[f"b{i}"]
        for name, dt in ((f"W{i}", wd), (f"b{i}", bd)):
            if dt.kind != "f":
                raise ValueError(f"{pw}: {name} must be floating point, has dtype {dt}")
        if len(ws) != 2:
            raise ValueError(f"{pw}: W{i} must be 2-D (in, out), has shape {ws}")
        if ws[0] != width:
            what = "the observation has" if i == 0 else f"layer {i - 1} gives"
            raise ValueError(f"{pw}: W{i} takes {ws[0]} inputs, {what} {width}")
        if bs != (ws[1],):
            raise ValueError(f"{pw}: b{i} must have shape ({ws[1]},) to match W{i} {ws}, has {bs}")
        total += ws[0] * ws[1] + ws[1]
        if total > POLICY_ELEMENTS_MAX:
            raise ValueError(f"{pw}: arrays declare more than {POLICY_ELEMENTS_MAX} elements (W{i} {ws})")
        width = ws[1]
    if width != n_actions(spec):
        raise ValueError(f"{pw}: last layer gives {width} scores, need {_need(spec)}")
    try:
        with np.load(pw, allow_pickle=False) as z:
            weights = [(z[f"W{i}"], z[f"b{i}"]) for i in range(layers)]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as exc:
        msg = str(exc).splitlines()[0][:200] if str(exc) else exc.__class__.__name__
        raise ValueError(f"{pw}: bad policy weights ({exc.__class__.__name__}: {msg})") from None
    for i, (W, b) in enumerate(weights):
        _check_layer(i, W, b, str(pw))
    return weights
