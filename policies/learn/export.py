"""Export trained torch/SB3 networks to the numpy form of :mod:`specenv.policy.mlp`.

PPO: ``policy.mlp_extractor.policy_net`` followed by ``policy.action_net`` (logits; argmax is SB3's
deterministic action). DQN: ``q_net.q_net`` (Q-values; argmax is SB3's ``predict``). Imitation
learners build a plain ``torch.nn.Sequential`` of Linear and activation layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specenv.observation.single import ObservationSpec
from specenv.policy.mlp import MLPPolicy


def _linear_layers(modules: list[Any]) -> tuple[list[tuple[np.ndarray, np.ndarray]], str | None]:
    import torch

    weights: list[tuple[np.ndarray, np.ndarray]] = []
    activation: str | None = None
    for mod in modules:
        if isinstance(mod, torch.nn.Linear):
            W = mod.weight.detach().cpu().numpy().T.astype(np.float32)
            b = mod.bias.detach().cpu().numpy().astype(np.float32)
            weights.append((W, b))
        elif isinstance(mod, torch.nn.Tanh):
            activation = _same(activation, "tanh")
        elif isinstance(mod, torch.nn.ReLU):
            activation = _same(activation, "relu")
        elif isinstance(mod, torch.nn.Sequential):
            inner, act = _linear_layers(list(mod))
            weights.extend(inner)
            activation = _same(activation, act) if act else activation
        elif isinstance(mod, torch.nn.Flatten | torch.nn.Identity):
            continue
        else:
            raise ValueError(f"cannot export layer {type(mod).__name__} (only Linear, Tanh, ReLU)")
    return weights, activation


def _same(old: str | None, new: str | None) -> str | None:
    if old is not None and new is not None and old != new:
        raise ValueError(f"mixed activations {old} and {new} are not supported")
    return new or old


def from_torch_sequential(seq: Any, spec: ObservationSpec, name: str, meta: dict[str, Any] | None = None) -> MLPPolicy:
    """Export a ``torch.nn.Sequential`` of Linear/Tanh/ReLU layers."""
    weights, act = _linear_layers(list(seq))
    return MLPPolicy(spec, weights, act or "tanh", name, meta)


def fold_normalization(
    weights: list[tuple[np.ndarray, np.ndarray]], mean: np.ndarray, var: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fold an input standardisation ``(x - mean) / sqrt(var)`` into the first layer.

    ``((x - m) / s) @ W + b == x @ (W / s[:, None]) + (b - (m / s) @ W)``: the policy then reads the raw
    observation of its contract (SB3's ``VecNormalize`` without clipping; pass ``var + epsilon``).
    """
    W, b = weights[0]
    s = np.sqrt(np.asarray(var, dtype=np.float64))
    m = np.asarray(mean, dtype=np.float64)
    W64 = W.astype(np.float64)
    first = ((W64 / s[:, None]).astype(np.float32), (b.astype(np.float64) - (m / s) @ W64).astype(np.float32))
    return [first, *weights[1:]]


def from_sb3(
    model: Any,
    spec: ObservationSpec,
    name: str,
    meta: dict[str, Any] | None = None,
    obs_mean: np.ndarray | None = None,
    obs_var: np.ndarray | None = None,
) -> MLPPolicy:
    """Export an SB3 PPO (or A2C) or DQN model with an MLP policy and a Discrete action space.

    ``obs_mean``/``obs_var`` (``VecNormalize.obs_rms`` mean and var + epsilon) are folded into the first
    layer (:func:`fold_normalization`), so the exported policy reads raw observations.

    Raises:
        ValueError: If the model's networks are not plain MLPs.
    """
    policy = model.policy
    if hasattr(policy, "q_net"):  # DQN
        modules = [policy.q_net.q_net]
        kind = "dqn"
    elif hasattr(policy, "mlp_extractor") and hasattr(policy, "action_net"):
        modules = [policy.mlp_extractor.policy_net, policy.action_net]
        kind = "ppo"
        if not getattr(policy, "share_features_extractor", True) and not isinstance(
            policy.pi_features_extractor, type(policy.features_extractor)
        ):
            raise ValueError("only the default Flatten features extractor can be exported")
    else:
        raise ValueError(f"cannot export SB3 policy {type(policy).__name__}")
    weights, act = _linear_layers(modules)
    if obs_mean is not None and obs_var is not None:
        weights = fold_normalization(weights, obs_mean, obs_var)
    return MLPPolicy(spec, weights, act or "tanh", name, (meta or {}) | {"algo": kind})


def provenance(
    meta: dict[str, Any], ts: Any, traces: str, cost_model: str, spec: Any, seconds: float, split: str = "train"
) -> dict[str, Any]:
    """A trained policy's meta with where it came from: trace set, cost model, contract version, train time.

    ``split`` is the split trained on (``"train"``; ``"train-fit"`` in a hyper-parameter search).
    """
    from specenv import __version__
    from specenv.io import sha256_file
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import find_dataset, resolve

    ds = find_dataset(traces)
    return dict(meta) | {
        "dataset": traces,
        "trace_set": {
            "name": ts.manifest.name,
            "version": ds.version if ds else None,
            "id": ds.id if ds else None,
            "manifest_sha256": sha256_file(resolve(traces) / "manifest.json"),
            "split": split,
            "train_generations": int(select_positions(ts, None, split).n_generations),
        },
        "cost_model": cost_model,
        "observation_version": spec.version,
        "specenv_version": __version__,
        "train_seconds": round(float(seconds), 1),
    }
