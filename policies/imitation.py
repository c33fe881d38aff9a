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
    lr: float = 3e-3,
    signals: Any = ("q",),
    split: str = "train",
) -> DaggerResult:
    """Train an MLP policy by DAgger on the train split of ``dataset``.

    Args:
        dataset: Registry name or folder.
        kmax: Largest budget (default: the trace set's Kmax).
        cost_model: ``"fit"``, ``"profile"`` or a JSON path (as for the environment).
        lookahead: Draft confidences in the observation: 0 trains for drafting mode ``"none"``, h > 0
            for ``"block"`` (the oracle is solved with the same charge, T_D(max(k, h))).
        iterations: DAgger iterations (beta = 1 at the first, then 0.5**i).
        hidden: Hidden layer sizes.
        epochs: Passes over the aggregate per iteration.
        seed: Seed of torch, the rollouts and the mixture.
        log: Called with one line per iteration.
        lr: Adam learning rate.
        signals: Draft signals of the lookahead block (``("q",)``; add ``"ent"``, ``"margin"``).
        split: The generations trained on: ``"train"`` (default) or ``"train-fit"`` (train minus the
            validation carve of :mod:`specenv.splits`, for a hyper-parameter search).

    Returns:
        The exported numpy policy and per-iteration statistics.
    """
    import gymnasium as gym
    import torch

    from oracle.dp import action_values, solve
    from specenv.envs.replay import ENV_ID

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    env = gym.make(
        ENV_ID,
        dataset=dataset,
        kmax=kmax,
        split=split,
        cost_model=cost_model,
        lookahead=lookahead,
        signals=signals if lookahead else ("q",),
    )
    data = env.unwrapped.data
    spec: ObservationSpec = data.spec
    arrays = split_arrays(dataset, data.kmax, split)
    model: CostModel = data.cost_model
    sol = solve(arrays, model, lookahead=spec.lookahead)
    unit = env.unwrapped.ar_unit_ms
    net = _make_net(spec, hidden)
    opt = torch.optim.Adam(net.parameters(), lr=lr)

    X: list[np.ndarray] = []
    R: list[np.ndarray] = []
    history: list[dict[str, float]] = []
    for it in range(iterations):
        beta = 1.0 if it == 0 else 0.5**it
        roll = _mixture_rollouts(env, arrays, sol.k, _to_numpy(net, spec), beta, rng)
        Q = action_values(arrays, model, sol.value, roll.rows, lookahead=spec.lookahead)
        X.append(roll.obs)
        R.append(((Q - Q.min(axis=1, keepdims=True)) / unit).astype(np.float32))
        xs = torch.from_numpy(np.concatenate(X))
        rs = torch.from_numpy(np.concatenate(R))
        regret = _fit_regret(net, opt, xs, rs, epochs)
        stats = {
            "iteration": it,
            "beta": beta,
            "states": len(xs),
            "rollout_speedup": roll.ar / roll.cost,
            "train_regret_ar_units": regret,
        }
        history.append(stats)
        if log:
            log(
                f"dagger it={it} beta={beta:.3f} states={len(xs)} rollout speedup={roll.ar / roll.cost:.3f} "
                f"regret/step={regret:.4f} AR units"
            )
    env.close()
    meta = {
        "algo": "dagger",
        "drafting": "block" if lookahead else "none",
        "lookahead": lookahead,
        "hyperparameters": {
            "iterations": iterations,
            "epochs": epochs,
            "hidden": list(hidden),
            "activation": "tanh",
            "optimizer": "adam",
            "learning_rate": lr,
            "batch_size": 1024,
            "beta_schedule": "1 then 0.5**i",
            "loss": "expected regret + 0.05 cross-entropy to the oracle's k*",
            "seed": seed,
        },
        "history": history,
    }
    return DaggerResult(_to_numpy(net, spec, name="imitation", meta=meta), history)


@dataclass
class _Visits:
    """States visited by one DAgger iteration's rollouts (one episode per train generation)."""

    obs: np.ndarray  # (n, dim) float32 observations
    rows: np.ndarray  # (n,) position rows of the visited states
    cost: float  # total cost of the episodes in ms
    ar: float  # their total AR cost in ms
    k: np.ndarray  # (n,) budget the mixture played in each visited state


def _mixture_rollouts(
    env: Any,
    arrays: PositionArrays,
    k_star: np.ndarray,
    learner: Any,
    beta: float,
    rng: np.random.Generator,
    record_k: bool = False,
    to_action: Callable[[int], Any] | None = None,
) -> _Visits:
    """Roll out the mixture policy (oracle's k*(t) with probability beta, else the learner) once per generation.

    :attr:`_Visits.k` records the budget played, or with ``record_k`` the learner's own budget in
    every visited state (the learner is then asked also where the oracle acts). ``to_action`` maps a
    chosen index to the environment's action (the joint (k, cap) learner of :mod:`policies.caps`
    plays joint indices); None steps with the index itself.
    """
    obs_buf, row_buf, k_buf, ep_cost, ep_ar = [], [], [], 0.0, 0.0
    for g, gid in enumerate(env.unwrapped.data.generation_ids):
        obs, _ = env.reset(seed=int(rng.integers(2**31)), options={"generation_id": int(gid)})
        t, done = 0, False
        lo = int(arrays.offsets[g])
        while not done:
            row = lo + t
            obs_buf.append(obs)
            row_buf.append(row)
            if record_k:
                k_own = int(learner.act(obs))
                k = int(k_star[row]) if rng.random() < beta else k_own
                k_buf.append(k_own)
            else:
                k = int(k_star[row]) if rng.random() < beta else learner.act(obs)
                k_buf.append(k)
            obs, _, done, _, info = env.step(k if to_action is None else to_action(k))
            t = info["t"]
        ep_cost += info["episode_cost_ms"]
        ep_ar += info["ar_cost_ms"]
    return _Visits(
        np.asarray(obs_buf, dtype=np.float32), np.asarray(row_buf), ep_cost, ep_ar, np.asarray(k_buf, dtype=np.int64)
    )


def _make_net(spec: ObservationSpec, hidden: tuple[int, ...], n_out: int | None = None) -> Any:
    """The torch MLP: observation -> one logit per budget (or ``n_out`` logits), tanh hidden layers."""
    import torch

    layers: list[Any] = []
    sizes = (spec.dim, *hidden)
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(sizes[-1], spec.kmax + 1 if n_out is None else n_out))
    return torch.nn.Sequential(*layers)


def _fit_regret(net: Any, opt: Any, xs: Any, rs: Any, epochs: int, batch_size: int = 1024) -> float:
    """Refit ``net`` on the aggregate: expected regret plus 0.05 x cross-entropy towards k*.

    Args:
        net: The torch MLP.
        opt: Its optimiser.
        xs: (n, dim) observations.
        rs: (n, kmax+1) regrets ``(Q - min Q) / ar_unit`` per budget.
        epochs: Passes over the aggregate.
        batch_size: Minibatch size.

    Returns:
        The train regret per step of the near-greedy policy (softmax of 50 x logits), AR units.
    """
    import torch

    target = rs.argmin(dim=1)
    n = len(xs)
    for _ in range(epochs):
        perm = torch.randperm(n)
        for s in range(0, n, batch_size):
            idx = perm[s : s + batch_size]
            logits = net(xs[idx])
            p = torch.softmax(logits, dim=1)
            loss = (p * rs[idx]).sum(dim=1).mean() + 0.05 * torch.nn.functional.cross_entropy(logits, target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        return float((torch.softmax(net(xs) * 50.0, 1) * rs).sum(1).mean())


def split_arrays(dataset: str, kmax: int | None, split: str) -> PositionArrays:
    """The positions of a split in the environment's order (row = offsets[g] + t)."""
    from specenv.datasets import load_dataset
    from specenv.replay import select_positions

    return select_positions(load_dataset(dataset), kmax, split)


def _to_numpy(
    net: Any, spec: ObservationSpec, name: str = "imitation", meta: dict[str, Any] | None = None
) -> MLPPolicy:
    from policies.export import from_torch_sequential

    return from_torch_sequential(net, spec, name, meta)
