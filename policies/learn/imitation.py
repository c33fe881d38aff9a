"""Imitation of the oracle: DAgger with the oracle's action values as cost-sensitive labels.

The oracle knows the answer at every state: V(t) and, for every budget, the action value
``Q(t, k) = C(t, k) + sum_a P(a | t, k) V(min(t + a + 1, N))``. SB3's reward only hints at it.
At each DAgger iteration the mixture policy (oracle with probability beta, learner otherwise) is
rolled out in the replay environment on the train split; every visited observation is stored with
the Q-values of its state; the learner (a small MLP) is refit on the aggregate by minimising the
expected regret ``sum_k softmax(logits)_k * (Q(t, k) - V(t)) / ar_unit`` plus a small cross-entropy
term towards k*(t). The expected-regret loss, unlike plain behaviour cloning, lets a policy that
cannot see rho learn the budget that is best *on average* for what it can see. The loop, the
learner and the rollouts are those of :mod:`policies.learn.dagger`; this module supplies the environment
and the oracle's labels.

Source: Ross, Gordon & Bagnell, "A Reduction of Imitation Learning and Structured Prediction to
No-Regret Online Learning" (AISTATS 2011); cost-sensitive labels as in AggreVaTe (Ross & Bagnell 2014).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from policies.learn.aggrevate import RolloutExpert
from policies.learn.dagger import (
    DaggerResult,
    ObservationBelief,
    RegretMLP,
    ReplayEpisodes,
    TableExpert,
    Visits,
    dagger_meta,
    expert_arrays,
    fit_observation_belief,
    run_dagger,
)
from specenv.cost.model import CostModel
from specenv.observation.single import ObservationSpec
from specenv.traces.traceset import PositionArrays

__all__ = ["DaggerResult", "split_arrays", "train_dagger"]


def train_dagger(
    dataset: str,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    lookahead: int = 0,
    iterations: int = 6,
    hidden: tuple[int, ...] = (64, 64),
    epochs: int = 30,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    lr: float = 3e-3,
    signals: Any = ("q",),
    split: str = "train",
    expert: str = "oracle",
    horizon: int | None = None,
    max_states: int | None = None,
    relabel: bool = False,
) -> DaggerResult:
    """Train an MLP policy by DAgger on the train split of ``dataset``.

    Args:
        dataset: Registry name or folder.
        kmax: Largest budget (default: the trace set's Kmax).
        cost_model: ``"fit-train"`` (the train split's fit, the default), ``"fit"``, ``"profile"`` or a JSON
            path (as for the environment).
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
            validation carve of :mod:`specenv.traces.splits`, for a hyper-parameter search).
        expert: ``"oracle"`` (the clairvoyant oracle's action values) or ``"belief"`` (the belief
            oracle's: the SSP on the acceptances a train-split calibration predicts having seen the
            confidences of the ``lookahead`` drafts, the depth alone in mode none; :func:`expert_arrays`).
            In mode none the current round's acceptances in the labels are believed from the
            controller's observation (:func:`fit_observation_belief`, fitted on one roll-in of the
            belief oracle on the split), the later rounds' from the depth alone. ``"rollout"``:
            AggreVaTe with the learner's own cost-to-go (:class:`policies.learn.aggrevate.RolloutExpert`):
            the belief oracle's budgets roll in; every visited state is labelled, for every budget,
            with the cost of that round on the split's true acceptances plus the current learner's
            own rounds after it to the generation's end (the belief's budgets before the first fit),
            the observation rebuilt round by round. No label assumes anything resumes drafting
            after a k = 0 the learner would not leave: the cure of mode none's k = 0 trap.
        horizon: ``"rollout"``: rounds of the learner's continuation before the belief oracle's
            cost-to-go closes a branch (None: to the generation's end).
        max_states: ``"rollout"``: visited states labelled per iteration (a uniform subsample; None: all).
        relabel: ``"rollout"``: after each fit, relabel every state of the aggregate with the new
            learner's continuation (approximate policy iteration) instead of keeping each iteration's labels.

    Returns:
        The exported numpy policy, per-iteration statistics and the training time in seconds.
    """
    import gymnasium as gym

    from oracle.dp import action_values, solve
    from specenv.envs.replay import ENV_ID

    t0 = time.perf_counter()
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
    arrays, expert_meta, _ = expert_arrays(split_arrays(dataset, data.kmax, split), expert, spec.lookahead)
    model: CostModel = data.cost_model
    sol = solve(arrays, model, lookahead=spec.lookahead)
    unit = env.unwrapped.ar_unit_ms
    learner = RegretMLP(spec, hidden, lr=lr, epochs=epochs, seed=seed)

    source = ReplayEpisodes(env, arrays)
    seen: ObservationBelief | None = None

    def label(roll: Visits) -> tuple[np.ndarray, np.ndarray]:
        rho = None if seen is None else seen.predict(roll.obs)
        Q = action_values(arrays, model, sol.value, roll.rows, lookahead=spec.lookahead, rho=rho)
        return roll.obs, ((Q - Q.min(axis=1, keepdims=True)) / unit).astype(np.float32)

    table_expert: TableExpert | RolloutExpert = TableExpert(sol.k, label)
    if expert == "rollout":
        source = ReplayEpisodes(env, arrays, record_state=True)
        table_expert = RolloutExpert(
            data,
            sol.k,
            learner,
            np.random.default_rng([seed, 2]),
            horizon=horizon,
            tail=sol.value if horizon is not None else None,
            max_states=max_states,
            relabel=relabel,
        )
        expert_meta["labels"] = (
            "AggreVaTe with the learner's own cost-to-go: each budget's round on the true acceptances, then the "
            "current learner's rounds (the belief oracle's budgets before its first fit)"
            + (" to the generation's end" if horizon is None else f" for {horizon} rounds, then the belief's value")
        )
        expert_meta["rollout_horizon"] = horizon
        expert_meta["rollout_max_states"] = max_states
        expert_meta["rollout_relabel"] = relabel
    elif expert == "belief" and spec.lookahead == 0:  # one roll-in of the belief oracle: the states the belief sees
        first = source.rollout(table_expert, learner, 1.0, np.random.default_rng([seed, 1]), 0)
        seen = fit_observation_belief(first.obs, split_arrays(dataset, data.kmax, split).rho[first.rows])
        expert_meta["labels"] = "this round's acceptances believed from the observation (logistic, per depth)"
    history = run_dagger(source, table_expert, learner, iterations, rng, log=log)
    env.close()
    meta = dagger_meta(
        "dagger",
        learner,
        history,
        "expected regret + 0.05 cross-entropy to the oracle's k*"
        if expert == "oracle"
        else f"expected regret + 0.05 cross-entropy to the {expert}'s k",
        seed,
        drafting="block" if lookahead else "none",
        lookahead=lookahead,
        **expert_meta,
    )
    return DaggerResult(learner.snapshot(name="imitation", meta=meta), history, time.perf_counter() - t0)


def split_arrays(dataset: str, kmax: int | None, split: str) -> PositionArrays:
    """The positions of a split in the environment's order (row = offsets[g] + t)."""
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    return select_positions(load_dataset(dataset), kmax, split)
