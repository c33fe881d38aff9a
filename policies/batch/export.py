"""The learned-survival batch controller in the deployable numpy form: ``policy.json`` + ``weights.npz``.

:class:`policies.batch.learn.SurvivalGoodputBatch` is trained with a scikit-learn ``MLPRegressor``;
what it needs at serving time is the regressor's forward pass (``relu`` hidden layers, identity
output), the batch cost model, the train-mean ``U(k)`` and the planner's settings. :func:`export_survival`
writes exactly that -- the layers as float64 arrays ``W0, b0, W1, b1, ...`` in ``weights.npz`` (read with
``allow_pickle=False``), the rest as JSON -- and :func:`load_survival` builds the same controller with a
:class:`NumpyRegressor` in place of the scikit-learn object: no pickle, no scikit-learn at serving time,
the same budgets (the same float64 operations as scikit-learn's ``predict``).

Served like every other policy (:mod:`specenv.engines.vllm.served`: ``act(obs, ids, step)`` once per
step on the stacked per-request rows): ``specenv serve --policy batch-survival:folder=DIR
--max-num-seqs B`` (the registered name ``batch-survival`` of the ``specenv.policies`` entry points,
:func:`make_batch_survival`; B = the batch size it was trained for, the controller refuses more).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from policies.batch.learn import SurvivalGoodputBatch
from specenv.cost.batch import BatchCostModel
from specenv.io import atomic_file, atomic_write_json
from specenv.observation.batch import BatchObservationSpec
from specenv.observation.single import ObservationSpec, mismatch_json

__all__ = ["KIND", "NumpyRegressor", "export_survival", "load_survival", "make_batch_survival"]

FORMAT = "specenv.policy/1"
#: ``kind`` of the controller's ``policy.json``.
KIND = "batch-survival"
_ACTIVATIONS = {"relu": lambda x: np.maximum(x, 0.0), "tanh": np.tanh, "identity": lambda x: x}


class NumpyRegressor:
    """The forward pass of a fitted multi-layer perceptron: ``predict((n, in)) -> (n, out)`` in float64.

    Args:
        weights: ``[(W0, b0), (W1, b1), ...]``, ``W`` of shape (in, out).
        activation: Hidden activation (``relu``, ``tanh`` or ``identity``); the output is linear.
    """

    def __init__(self, weights: list[tuple[np.ndarray, np.ndarray]], activation: str = "relu"):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {sorted(_ACTIVATIONS)}")
        self.weights = [(np.asarray(W, dtype=np.float64), np.asarray(b, dtype=np.float64)) for W, b in weights]
        self.activation = activation

    @classmethod
    def from_sklearn(cls, reg: Any) -> NumpyRegressor:
        """The layers of a fitted scikit-learn ``MLPRegressor`` (identity output)."""
        out = getattr(reg, "out_activation_", None)
        if out != "identity":
            raise ValueError(f"regressor output activation {out!r}: only an MLPRegressor (identity) is exported")
        return cls(list(zip(reg.coefs_, reg.intercepts_, strict=True)), str(reg.activation))

    def predict(self, X: np.ndarray) -> np.ndarray:
        """(n, out) outputs of the rows ``X`` (n, in): scikit-learn's forward pass, in float64."""
        x = np.asarray(X, dtype=np.float64)
        act = _ACTIVATIONS[self.activation]
        for i, (W, b) in enumerate(self.weights):
            x = x @ W + b
            if i < len(self.weights) - 1:
                x = act(x)
        return x


def export_survival(policy: SurvivalGoodputBatch, folder: str | os.PathLike[str]) -> Path:
    """Write the controller as ``policy.json`` + ``weights.npz`` (atomically) into ``folder``.

    Raises:
        ValueError: When its survival model is neither a scikit-learn ``MLPRegressor`` nor a
            :class:`NumpyRegressor`.
    """
    model = policy.model
    reg = model if isinstance(model, NumpyRegressor) else NumpyRegressor.from_sklearn(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for i, (W, b) in enumerate(reg.weights):
        arrays[f"W{i}"], arrays[f"b{i}"] = W, b
    meta = {
        "format": FORMAT,
        "kind": KIND,
        "name": policy.name,
        "activation": reg.activation,
        "layers": len(reg.weights),
        "batch_size": int(policy.spec.batch_size),
        "observation": policy.spec.request.to_json(),
        "batch_cost": policy.batch_cost.to_json(),
        "u_prior": [float(x) for x in policy.u_prior],
        "sweeps": int(policy.sweeps),
    }
    with atomic_file(folder / "weights.npz") as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    atomic_write_json(folder / "policy.json", meta)
    return folder


def load_survival(folder: str | os.PathLike[str], expect: ObservationSpec | None = None) -> SurvivalGoodputBatch:
    """Read a controller written by :func:`export_survival` (numpy only).

    Args:
        folder: The folder with ``policy.json`` and ``weights.npz``.
        expect: The per-request observation contract of the server or environment; None accepts any.

    Raises:
        ValueError: One line naming the file and the problem.
    """
    from specenv.validation import read_json

    folder = Path(folder)
    pj, pw = folder / "policy.json", folder / "weights.npz"
    meta = read_json(pj, what="policy")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("kind") != KIND:
        raise ValueError(f"{pj}: not a specenv batch-survival controller (format '{FORMAT}', kind '{KIND}')")
    try:
        request = ObservationSpec.from_json(meta["observation"])
        spec = BatchObservationSpec(request, int(meta["batch_size"]))
        layers, activation = int(meta["layers"]), str(meta["activation"])
        u_prior, sweeps, name = np.asarray(meta["u_prior"], dtype=np.float64), int(meta["sweeps"]), str(meta["name"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{pj}: {type(exc).__name__}: {exc}") from None
    if expect is not None:
        bad = mismatch_json(request.to_json(), expect.to_json())
        if bad is not None:
            raise ValueError(f"{pj}: observation contract differs: {bad}")
    batch_cost = BatchCostModel.from_json(meta.get("batch_cost"), f"{pj}: batch_cost")
    weights = _weights(pw, layers)
    width = request.dim
    for i, (W, b) in enumerate(weights):
        if W.ndim != 2 or W.shape[0] != width or b.shape != (W.shape[1],) or not np.isfinite(W).all():
            raise ValueError(f"{pw}: layer {i}: W {W.shape}, b {b.shape} do not chain from {width} inputs")
        width = W.shape[1]
    if width != request.kmax:
        raise ValueError(f"{pw}: the last layer gives {width} survival values, kmax is {request.kmax}")
    try:
        return SurvivalGoodputBatch(spec, batch_cost, u_prior, NumpyRegressor(weights, activation), sweeps, name)
    except ValueError as exc:
        raise ValueError(f"{pj}: {exc}") from None


def _weights(pw: Path, layers: int) -> list[tuple[np.ndarray, np.ndarray]]:
    import zipfile

    want = {f"{p}{i}" for i in range(layers) for p in ("W", "b")}
    try:
        with np.load(pw, allow_pickle=False) as z:
            names = set(z.files)
            if names != want:
                raise ValueError(f"{pw}: arrays {sorted(names)} != {sorted(want)} (policy.json: {layers} layers)")
            return [(z[f"W{i}"], z[f"b{i}"]) for i in range(layers)]
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{pw}: bad weights ({type(exc).__name__}: {exc})") from None


def make_batch_survival(spec: ObservationSpec, folder: str) -> SurvivalGoodputBatch:
    """Factory of the registered name ``batch-survival:folder=DIR``: the exported controller.

    The controller keeps the observation contract it was trained on (the vLLM controller builds its
    rows from it); the caller's ``spec`` (the server's or the environment's) must agree on what the
    served model fixes: ``kmax`` and the number of experts.

    Raises:
        ValueError: A bad folder, or a controller trained for another kmax or expert count.
    """
    pol = load_survival(folder)
    got = pol.spec.request
    for field in ("kmax", "n_experts"):
        if getattr(got, field) != getattr(spec, field):
            raise ValueError(
                f"{folder}: trained for {field} {getattr(got, field)}, the caller has {getattr(spec, field)}"
            )
    return pol
