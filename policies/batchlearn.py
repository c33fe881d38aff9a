"""Learned batch controllers: imitation of per-request oracles of the batch, and PPO.

* :func:`train_batch_imitation`: DAgger (as :mod:`policies.imitation`) in ``specenv/MoESpecBatch-v0``
  on the train split, with cost-sensitive labels from a per-request problem (``expert``): the batch
  bound's full-batch charges (:func:`oracle.batch.share_model` with ``full=True``: "imitation of the
  bound's per-request decisions") or the cost a request induces in a full batch of its like
  (:class:`oracle.batch.FairShare`). ``reference`` says what follows a labelled state: the expert's
  clairvoyant optimum (AggreVaTe) or the learner's own budgets (approximate policy iteration, each
  iteration evaluated exactly by :func:`oracle.dp.evaluate_policy`). On greedy traces the first
  collapses to k = 0 (the oracle speculates only where the drafts will be accepted, so per state k = 0
  has the smallest regret), which is why the second exists. The learner is a per-request MLP (the
  per-request observation of each active slot in, a budget out), exported to the numpy format
  (:class:`specenv.policy.mlp.MLPPolicy`), so it runs per request anywhere a single-request policy
  runs (:class:`policies.batch.PerRequest`, the vLLM controller).
* :func:`train_batch_ppo`: SB3 PPO with a ``MultiDiscrete`` action (all B budgets at once) on the
  batch observation, a small budget of steps; kept in memory as an SB3 model (:class:`SB3Batch`),
  not exported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from oracle.batch import FairShare, expected_costs
from oracle.dp import action_values, evaluate_policy, solve
from policies.batch import BatchPolicy
from policies.imitation import _fit_regret, _make_net, _to_numpy
from specenv.batchobs import BatchObservationSpec
from specenv.batchreplay import request_draws
from specenv.datasets import load_dataset
from specenv.envs.batch import MoESpecBatchEnv
from specenv.policy.mlp import MLPPolicy
from specenv.replay import select_positions

__all__ = ["SB3Batch", "BatchImitation", "train_batch_imitation", "train_batch_ppo"]


@dataclass
class BatchImitation:
    """Outcome of :func:`train_batch_imitation`."""

    policy: MLPPolicy
    history: list[dict[str, float]]


def train_batch_imitation(
    dataset: str,
    batch_size: int,
    n_requests: int | None = None,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    batch_cost: str = "auto",
    iterations: int = 4,
    episodes: int = 4,
    hidden: tuple[int, ...] = (64, 64),
    epochs: int = 20,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    expert: str = "bound",
    reference: str = "learner",
) -> BatchImitation:
    """DAgger towards the batch bound's per-request decisions (module docstring), train split only.

    Args:
        dataset: Registry name or folder.
        batch_size: B.
        n_requests: R per episode (default the environment's, 4 B).
        kmax: Largest budget.
        cost_model: The single-request cost model argument (``"fit-train"``: fitted on train rounds).
        batch_cost: The batch cost model argument of the environment.
        iterations: DAgger iterations (beta = 1, then 0.5**i).
        episodes: Train episodes per iteration.
        hidden: Hidden layer sizes.
        epochs: Passes over the aggregate per iteration.
        seed: Seed of the episodes, the mixture and torch.
        log: Called with one line per iteration.
        expert: ``"bound"``: the bound's full-batch charges (:func:`oracle.batch.share_model` with
            ``full=True``, the split the bound keeps on the first train episodes); ``"fair"``: the
            cost a request induces in a full batch of its like (:class:`oracle.batch.FairShare`).
        reference: What follows a labelled state: ``"oracle"``, the expert's clairvoyant optimum
            (AggreVaTe; on greedy traces its labels favour k = 0, which no observation-based policy can
            follow up as the oracle does), or ``"learner"`` (default), approximate policy iteration: the
            action values of the current learner's budgets (exact, :func:`oracle.dp.evaluate_policy`,
            the learner's budget at every row it visited, the previous reference elsewhere), starting
            from the best fixed k under the charges.

    Returns:
        The exported per-request policy (drafting mode ``none``) and the per-iteration history.
    """
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # small nets: threads only contend on a shared CPU
    env = MoESpecBatchEnv(
        dataset, batch_size, n_requests, kmax, split="train", cost_model=cost_model, batch_cost=batch_cost
    )
    arrays = select_positions(load_dataset(dataset), env.kmax, "train")
    rng = np.random.default_rng(seed)
    seeds = [int(s) for s in rng.integers(0, 2**31, size=iterations * episodes)]
    if expert not in ("bound", "fair"):
        raise ValueError(f"expert={expert!r}: expected 'bound' or 'fair'")
    if reference not in ("oracle", "learner"):
        raise ValueError(f"reference={reference!r}: expected 'oracle' or 'learner'")
    probe = np.array([env.reset(seed=s)[1]["seeds"] for s in seeds[:episodes]])
    gens = np.vectorize(lambda s: request_draws(int(s), arrays.lengths)[0])(probe)
    _, full, _, split = expected_costs(arrays, env.batch_cost, batch_size, gens)
    charges: Any = full if expert == "bound" else FairShare(env.batch_cost, batch_size)
    sol = solve(arrays, charges)
    n_rows = len(arrays.L)
    if reference == "oracle":
        k_ref = sol.k  # AggreVaTe: the (clairvoyant) per-request optimum continues after every state
    else:  # approximate policy iteration: start from the best fixed k under the charges, continue with the learner
        fixed = [float(evaluate_policy(arrays, charges, k).cost.sum()) for k in range(env.kmax + 1)]
        k_ref = np.full(n_rows, int(np.argmin(fixed)), dtype=np.int64)

    def regrets(k_ref: np.ndarray) -> np.ndarray:
        value = sol.value if reference == "oracle" else evaluate_policy(arrays, charges, k_ref).value
        Q = action_values(arrays, charges, value)
        return (Q - Q.min(axis=1, keepdims=True)) / env.ar_unit_ms

    regret = regrets(k_ref)
    if log is not None:
        log(f"batch imitation: expert {expert}, reference {reference}, mean k* {sol.k.mean():.2f}")
    spec: BatchObservationSpec = env.spec_batch
    net = _make_net(spec.request, hidden)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    xs_all: list[np.ndarray] = []
    rows_all: list[np.ndarray] = []
    history: list[dict[str, float]] = []
    for it in range(iterations):
        beta = 1.0 if it == 0 else 0.5**it
        cost = ar = 0.0
        played = np.full(n_rows, -1, dtype=np.int64)
        for e in range(episodes):
            obs, _ = env.reset(seed=seeds[it * episodes + e])
            done = False
            while not done:
                rows = env.rows()
                active, req = spec.slots(obs)
                with torch.no_grad():
                    own = net(torch.as_tensor(req)).argmax(dim=1).numpy()
                k_exp = k_ref[np.maximum(rows, 0)]
                k = np.where(rng.random(batch_size) < beta, k_exp, own)
                k = np.where(active, k, 0).astype(np.int64)
                xs_all.append(req[active])
                rows_all.append(rows[active])
                played[rows[active]] = own[active]
                obs, _, done, _, info = env.step(k)
            cost += info["episode_cost_ms"]
            ar += info["ar_cost_ms"]
        all_rows = np.concatenate(rows_all)
        xs = torch.as_tensor(np.concatenate(xs_all))
        rs = torch.as_tensor(regret[all_rows], dtype=torch.float32)
        train_regret = _fit_regret(net, opt, xs, rs, epochs)
        if reference == "learner":  # the learner's own budgets where it went; the reference elsewhere
            with torch.no_grad():
                mine = net(xs).argmax(dim=1).numpy()
            k_ref = k_ref.copy()
            k_ref[all_rows] = mine
            regret = regrets(k_ref)
        rec = {"iteration": it, "beta": beta, "states": len(xs), "mixture_speedup": ar / cost, "regret": train_regret}
        history.append(rec)
        if log is not None:
            log(f"batch imitation {it}: beta={beta:.3f} states={len(xs)} mixture speedup={ar / cost:.3f}")
    meta = {
        "kind": "batch-imitation",
        "dataset": str(dataset),
        "batch_size": int(batch_size),
        "drafting": "none",
        "expert": expert,
        "reference": reference,
        "split": list(split) if split is not None and expert == "bound" else None,
        "batch_observation": spec.to_json(),
    }
    return BatchImitation(_to_numpy(net, spec.request, name="batch-imitation", meta=meta), history)


class SB3Batch(BatchPolicy):
    """A trained SB3 model as a batch policy (deterministic actions)."""

    def __init__(self, spec: BatchObservationSpec, model: Any, name: str = "ppo (batch)"):
        super().__init__(spec)
        self.model = model
        self.name = name

    def act(self, obs: np.ndarray) -> np.ndarray:
        """All B budgets from the model (idle slots ignored by the environment, reported as 0)."""
        active, _ = self.spec.slots(obs)
        k, _ = self.model.predict(np.asarray(obs, dtype=np.float32), deterministic=True)
        return np.where(active, np.asarray(k, dtype=np.int64), 0)


def train_batch_ppo(
    dataset: str,
    batch_size: int,
    n_requests: int | None = None,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    batch_cost: str = "auto",
    timesteps: int = 20_000,
    seed: int = 0,
) -> SB3Batch:
    """SB3 PPO on ``specenv/MoESpecBatch-v0`` (train split, ``MultiDiscrete``), a small budget.

    Args:
        dataset: Registry name or folder.
        batch_size: B.
        n_requests: R per episode.
        kmax: Largest budget.
        cost_model: Single-request cost model argument.
        batch_cost: Batch cost model argument.
        timesteps: Environment steps of training.
        seed: Seed of PPO and the environment.

    Returns:
        The trained model as a :class:`SB3Batch` (drafting mode ``none``).
    """
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)  # small nets: threads only contend on a shared CPU

    kw = dict(
        dataset=dataset,
        batch_size=batch_size,
        n_requests=n_requests,
        kmax=kmax,
        split="train",
        cost_model=cost_model,
        batch_cost=batch_cost,
    )
    venv = make_vec_env(MoESpecBatchEnv, n_envs=4, seed=seed, env_kwargs=kw)
    model = PPO(
        "MlpPolicy",
        venv,
        n_steps=256,
        batch_size=256,
        learning_rate=3e-4,
        gamma=0.99,
        ent_coef=0.01,
        policy_kwargs={"net_arch": [64, 64]},
        seed=seed,
        device="cpu",
        verbose=0,
    )
    model.learn(total_timesteps=int(timesteps))
    spec = venv.get_attr("spec_batch")[0]
    return SB3Batch(spec, model)
