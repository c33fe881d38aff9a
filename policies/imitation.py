"""Imitation of the oracle: DAgger with the oracle's action values as cost-sensitive labels.

The oracle knows the answer at every state: V(t) and, for every budget, the action value
``Q(t, k) = C(t, k) + sum_a P(a | t, k) V(min(t + a + 1, N))``. SB3's reward only hints at it.
At each DAgger iteration the mixture policy (oracle with probability beta, learner otherwise) is
rolled out in the replay environment on the train split; every visited observation is stored with
the Q-values of its state; the learner (a small MLP) is refit on the aggregate by minimising the
expected regret ``sum_k softmax(logits)_k * (Q(t, k) - V(t)) / ar_unit`` plus a small cross-entropy
term towards k*(t). The expected-regret loss, unlike plain behaviour cloning, lets a policy that
cannot see rho learn the budget that is best *on average* for what it can see.

Source: Ross, Gordon & Bagnell, "A Reduction of Imitation Learning and Structured Prediction to
No-Regret Online Learning" (AISTATS 2011); cost-sensitive labels as in AggreVaTe (Ross & Bagnell 2014).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specenv.costmodel import CostModel
from specenv.observation import ObservationSpec
from specenv.policy.mlp import MLPPolicy
from specenv.traceset import PositionArrays


@dataclass
class DaggerResult:
    """Outcome of :func:`train_dagger`."""

    policy: MLPPolicy
    history: list[dict[str, float]]


def train_dagger(
    dataset: str,
    kmax: int | None = None,
    cost_model: str = "fit",
    lookahead: int = 0,
    iterations: int = 6,
    hidden: tuple[int, ...] = (64, 64),
    epochs: int = 30,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> DaggerResult:
    """Train an MLP policy by DAgger on the train split of ``dataset``.

    Args:
        dataset: Registry name or folder.
        kmax: Largest budget (default: the trace set's Kmax).
        cost_model: ``"fit"``, ``"profile"`` or a JSON path (as for the environment).
        lookahead: Draft confidences in the observation (the oracle is solved with the same charge).
        iterations: DAgger iterations (beta = 1 at the first, then 0.5**i).
        hidden: Hidden layer sizes.
        epochs: Passes over the aggregate per iteration.
        seed: Seed of torch, the rollouts and the mixture.
        log: Called with one line per iteration.

    Returns:
        The exported numpy policy and per-iteration statistics.
    """
    import gymnasium as gym
    import torch

    from oracle.dp import action_values, solve
    from specenv.envs.replay import ENV_ID

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    env = gym.make(ENV_ID, dataset=dataset, kmax=kmax, split="train", cost_model=cost_model, lookahead=lookahead)
    base = env.unwrapped
    data = base.data
    spec: ObservationSpec = data.spec
    arrays = split_arrays(dataset, data.kmax, "train")
    model: CostModel = data.cost_model
    sol = solve(arrays, model, lookahead=spec.lookahead)
    k_star = sol.k
    unit = base.ar_unit_ms

    layers: list[Any] = []
    sizes = (spec.dim, *hidden)
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(sizes[-1], spec.kmax + 1))
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    X: list[np.ndarray] = []
    R: list[np.ndarray] = []
    history: list[dict[str, float]] = []
    gids = data.generation_ids
    for it in range(iterations):
        beta = 1.0 if it == 0 else 0.5**it
        learner = _to_numpy(net, spec)
        obs_buf, row_buf, ep_cost, ep_ar = [], [], 0.0, 0.0
        for g, gid in enumerate(gids):
            obs, _ = env.reset(seed=int(rng.integers(2**31)), options={"generation_id": int(gid)})
            t, done = 0, False
            lo = int(arrays.offsets[g])
            while not done:
                row = lo + t
                obs_buf.append(obs)
                row_buf.append(row)
                k = int(k_star[row]) if rng.random() < beta else learner.act(obs)
                obs, _, done, _, info = env.step(k)
                t = info["t"]
            ep_cost += info["episode_cost_ms"]
            ep_ar += info["ar_cost_ms"]
        rows = np.asarray(row_buf)
        Q = action_values(arrays, model, sol.value, rows, lookahead=spec.lookahead)
        X.append(np.asarray(obs_buf, dtype=np.float32))
        R.append(((Q - Q.min(axis=1, keepdims=True)) / unit).astype(np.float32))
        xs = torch.from_numpy(np.concatenate(X))
        rs = torch.from_numpy(np.concatenate(R))
        target = rs.argmin(dim=1)
        n = len(xs)
        for _ in range(epochs):
            perm = torch.randperm(n)
            for s in range(0, n, 1024):
                idx = perm[s : s + 1024]
                logits = net(xs[idx])
                p = torch.softmax(logits, dim=1)
                loss = (p * rs[idx]).sum(dim=1).mean() + 0.05 * torch.nn.functional.cross_entropy(logits, target[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            regret = float((torch.softmax(net(xs) * 50.0, 1) * rs).sum(1).mean())
        stats = {
            "iteration": it,
            "beta": beta,
            "states": n,
            "rollout_speedup": ep_ar / ep_cost,
            "train_regret_ar_units": regret,
        }
        history.append(stats)
        if log:
            log(
                f"dagger it={it} beta={beta:.3f} states={n} rollout speedup={ep_ar / ep_cost:.3f} "
                f"regret/step={regret:.4f} AR units"
            )
    env.close()
    policy = _to_numpy(
        net,
        spec,
        name="imitation",
        meta={
            "algo": "dagger",
            "dataset": dataset,
            "seed": seed,
            "iterations": iterations,
            "lookahead": lookahead,
            "history": history,
        },
    )
    return DaggerResult(policy, history)


def split_arrays(dataset: str, kmax: int, split: str) -> PositionArrays:
    """The positions of a split in the environment's order (row = offsets[g] + t)."""
    from specenv.datasets import load_dataset
    from specenv.splits import select_split

    arr = load_dataset(dataset).arrays()
    if kmax < arr.kmax:
        arr = arr.with_kmax(kmax)
    return select_split(arr, split)


def _to_numpy(
    net: Any, spec: ObservationSpec, name: str = "imitation", meta: dict[str, Any] | None = None
) -> MLPPolicy:
    from policies.export import from_torch_sequential

    return from_torch_sequential(net, spec, name, meta)
