"""Behaviour cloning from a Minari dataset: a small torch MLP fitted to the recorded (observation, budget) pairs.

Stable-Baselines3 has no behaviour cloning, so this is the plain supervised form: the network of
:mod:`policies.learn.dagger` (:func:`policies.learn.dagger.make_net`, tanh hidden layers, one logit per
budget) is fitted by cross-entropy to the actions of every step of the dataset
(:func:`policies.learn.offline.open_dataset`), with Adam, and exported with the same machinery
(:func:`policies.learn.dagger.export_net`) to the numpy form of :mod:`specenv.policy.mlp` (policy.json +
weights.npz; no pickle), which ``specenv bench`` and the vLLM controller run.

Unlike DAgger (:mod:`policies.learn.imitation`), BC sees only the states the recorded policy visited and
imitates its actions, not their costs: with the oracle's k*(t) as the expert, it learns the budget
the oracle plays most often in states that *look* alike (the observation hides the rho and U of
the round), where DAgger's expected-regret loss learns the one that costs least on average.

The policy's drafting mode follows its lookahead (``"block"`` for h > 0, else ``"none"``): an MLP that
reads h confidences is not a stop rule, so a dataset recorded in mode ``"sequential"`` (h = kmax)
gives a ``"block"`` policy, charged T_D(max(k, h)) by the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specenv.policy.mlp import MLPPolicy


@dataclass
class BCResult:
    """Outcome of :func:`train_bc`."""

    policy: MLPPolicy
    history: list[dict[str, float]]


def train_bc(
    data: Any,
    hidden: tuple[int, ...] = (64, 64),
    epochs: int = 30,
    lr: float = 3e-3,
    batch_size: int = 1024,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> BCResult:
    """Fit an MLP to a Minari dataset's actions by cross-entropy and export it.

    Args:
        data: The checked dataset (:class:`policies.learn.offline.OfflineData`): its observations, actions
            and the observation contract of its environment.
        hidden: Hidden layer sizes.
        epochs: Passes over the transitions.
        lr: Adam learning rate.
        batch_size: Minibatch size.
        seed: Seed of torch (initialisation, minibatch order).
        log: Called with one line per epoch.

    Returns:
        The exported numpy policy (name ``bc``) and per-epoch statistics (loss, accuracy on the
        dataset's actions).

    Raises:
        ValueError: For an empty dataset or actions outside 0..kmax.
    """
    import torch

    from policies.learn.dagger import export_net, make_net
    from specenv.cost.model import drafting_mode

    spec = data.spec
    n = len(data.actions)
    if n == 0:
        raise ValueError(f"--dataset: {data.dataset_id} holds no steps")
    if data.actions.min() < 0 or data.actions.max() > spec.kmax:
        raise ValueError(f"--dataset: {data.dataset_id}: actions outside 0..kmax={spec.kmax}")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    net = make_net(spec, hidden)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    xs = torch.from_numpy(np.ascontiguousarray(data.observations, dtype=np.float32))
    ys = torch.from_numpy(np.ascontiguousarray(data.actions, dtype=np.int64))
    history: list[dict[str, float]] = []
    for epoch in range(epochs):
        perm = torch.randperm(n)
        total = 0.0
        for s in range(0, n, batch_size):
            idx = perm[s : s + batch_size]
            loss = torch.nn.functional.cross_entropy(net(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        with torch.no_grad():
            acc = float((net(xs).argmax(dim=1) == ys).float().mean())
        history.append({"epoch": epoch, "loss": total / n, "accuracy": acc})
        if log:
            log(f"bc epoch={epoch} loss={total / n:.4f} accuracy={acc:.3f} on {n} steps")
    meta = {
        "algo": "bc",
        "drafting": drafting_mode(spec.lookahead),
        "lookahead": int(spec.lookahead),
        "hyperparameters": {
            "epochs": epochs,
            "hidden": list(hidden),
            "activation": "tanh",
            "optimizer": "adam",
            "learning_rate": lr,
            "batch_size": batch_size,
            "loss": "cross-entropy to the dataset's actions",
            "seed": seed,
        },
        "minari": {
            "dataset_id": data.dataset_id,
            "steps": int(n),
            "episodes": int(data.dataset.total_episodes),
            "recorded_policy": data.meta.get("policy"),
            "split": data.meta.get("split"),
            "trace_set": data.meta.get("trace_set"),
            "drafting": data.meta.get("drafting"),
        },
        "history": history,
    }
    return BCResult(export_net(net, spec, name="bc", meta=meta), history)
