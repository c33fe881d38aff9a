"""Policies of the joint (k, expert cap) action: a fixed cap under any k-policy, and the joint learner.

* :class:`FixedCap` -- MoE-Spec's fixed expert budget: any k-policy (a fixed k, a heuristic, a peer,
  a shipped learned policy) picks k, the cap level stays fixed (level 0 = uncapped: the k-policy
  itself);
* :class:`JointMLP` -- a numpy MLP over the joint actions (:class:`specenv.policy.mlp.MLPPolicy` with
  ``cap_levels``: it scores ``(C+1)(kmax+1)`` actions ``c * (kmax+1) + k``), acting ``(k, c)``;
* :func:`train_joint_dagger` -- imitation of the joint oracle (:func:`oracle.caps.solve_joint`) at a
  chosen quality weight, by DAgger with the oracle's joint action values as cost-sensitive labels
  (the loop and learner of :mod:`policies.learn.dagger`, over the larger action set), exported to the numpy form.

Every one of them acts in ``specenv/MoESpecCap-v0`` (:mod:`specenv.envs.caps`) through the one policy
protocol (:mod:`specenv.policy.base`) with a joint action: ``act(obs (n, dim), ids, step)`` returns
``(n, 2)`` rows ``(k, c)``, and one 1-D observation the pair ``np.array([k, c])``. ``joint_action =
True`` marks them (the vLLM controller refuses them: vLLM has no per-request expert cap).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from policies.learn.dagger import DaggerResult, RegretMLP, ReplayEpisodes, TableExpert, Visits, dagger_meta, run_dagger
from specenv.policy.base import BatchStep
from specenv.policy.mlp import MLPPolicy, n_actions

__all__ = ["FixedCap", "JointMLP", "train_joint_dagger"]

#: Regret (AR steps) that stands in for an action the joint set does not offer (a capped k = 0, or a
#: token-changing cap at an infinite quality weight) in the learner's labels.
UNAVAILABLE_REGRET = 100.0

#: Why the vLLM controller refuses a joint (k, cap) policy (``unservable``, one line).
UNSERVABLE = "it picks an expert cap with every k (a joint (k, cap) action); vLLM 0.32 has no per-request expert cap"


class FixedCap:
    """A k-policy run with a fixed cap level: ``act(obs, ids) = (policy.act(obs, ids), level)`` per row.

    Args:
        policy: Any k-policy (``reset()``, ``act(obs) -> k``); it sees the joint environment's
            observation, which is the k-only contract.
        level: The cap level, 0 (uncapped) .. C.
        name: Display name (default ``"<policy name> @ cap level <level>"``).
    """

    joint_action = True
    unservable = UNSERVABLE

    def __init__(self, policy: Any, level: int, name: str | None = None):
        self.policy = policy
        self.level = int(level)
        self.name = name or f"{getattr(policy, 'name', type(policy).__name__)} @ cap level {self.level}"

    def reset(self) -> None:
        """Forget the current generation."""
        self.policy.reset()

    def act(self, obs: np.ndarray, ids: Sequence[Hashable] | None = None, step: BatchStep | None = None) -> np.ndarray:
        """(n, 2) rows ``(k, level)`` with k from the wrapped policy; a 1-D observation: one pair."""
        x = np.asarray(obs)
        if x.ndim == 1:  # alias: a batch of one
            return self.act(x[None, :], ids, step)[0]
        k = np.asarray(self.policy.act(x, ids, step), dtype=np.int64)
        return np.stack([k, np.full(len(k), self.level, dtype=np.int64)], axis=1)


class JointMLP:
    """A joint (k, cap) numpy MLP policy: the argmax joint index, decoded to ``(k, c)``.

    Args:
        mlp: An :class:`~specenv.policy.mlp.MLPPolicy` whose contract has ``cap_levels > 0``.

    Raises:
        ValueError: If the policy's contract has no cap levels.
    """

    joint_action = True
    unservable = UNSERVABLE
    stateless = True

    def __init__(self, mlp: MLPPolicy):
        if not mlp.spec.cap_levels:
            raise ValueError(f"policy '{mlp.name}': not a joint (k, cap) policy (its contract has no cap_levels)")
        self.mlp = mlp
        self.name = mlp.name
        self.spec = mlp.spec
        self._k1 = mlp.spec.kmax + 1

    @classmethod
    def load(cls, folder: Any, expect: Any = None) -> JointMLP:
        """Read a joint policy folder (``policy.json`` + ``weights.npz``); see :meth:`MLPPolicy.load`."""
        return cls(MLPPolicy.load(folder, expect))

    def reset(self) -> None:
        """Stateless."""

    def decode(self, index: int) -> np.ndarray:
        """Joint index ``c * (kmax+1) + k`` -> ``(k, c)``."""
        return np.array([index % self._k1, index // self._k1], dtype=np.int64)

    def act(self, obs: np.ndarray, ids: Sequence[Hashable] | None = None, step: BatchStep | None = None) -> np.ndarray:
        """(n, 2) rows ``(k, c)`` for (n, dim) observations; a 1-D observation: one pair.

        Raises:
            ValueError: When a row's scores are not finite.
        """
        x = np.asarray(obs)
        if x.ndim == 1:  # alias: a batch of one
            return self.act(x[None, :], ids, step)[0]
        j = np.asarray(self.mlp.act(x), dtype=np.int64)
        if (j < 0).any():
            raise ValueError(f"policy '{self.name}': non-finite scores")
        return np.stack([j % self._k1, j // self._k1], axis=1)


def train_joint_dagger(
    dataset: str,
    quality_weight: float,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    iterations: int = 4,
    hidden: tuple[int, ...] = (64, 64),
    epochs: int = 30,
    seed: int = 0,
    lr: float = 3e-3,
    log: Callable[[str], None] | None = None,
    lookahead: int = 0,
    signals: Any = ("q",),
) -> DaggerResult:
    """Imitate the joint oracle at ``quality_weight`` by DAgger on the train split of a caps set.

    The oracle is :func:`oracle.caps.solve_joint` on the train generations (the same weight, the same
    cost model as the environment); the labels are its joint action values
    (:func:`oracle.caps.joint_action_values`) as regrets in AR steps; the learner is the DAgger
    learner (:class:`policies.learn.dagger.RegretMLP`) with ``(C+1)(kmax+1)`` outputs and its expected-regret loss.
    Rollouts play the mixture policy in ``specenv/MoESpecCap-v0`` with the same ``quality_weight``.

    Args:
        dataset: Registry name or folder of a set with the ``caps-v1`` extension.
        quality_weight: AR steps per mismatched token (finite, >= 0).
        kmax: Largest budget (default the set's).
        cost_model: As for the environment (default ``"fit-train"``: fitted on the train split).
        iterations: DAgger iterations (beta = 1, then 0.5**i).
        hidden: Hidden layer sizes.
        epochs: Passes over the aggregate per iteration.
        seed: Seed of torch, the rollouts and the mixture.
        lr: Adam learning rate.
        log: Called with one line per iteration.
        lookahead: Draft signals of the next h drafts in the observation: 0 trains for drafting mode
            ``"none"``, h > 0 for ``"block"`` (every round drafts max(k, h) tokens, in the oracle too).
        signals: Draft signals of that block (``("q",)``; add ``"ent"``, ``"margin"``).

    Returns:
        The exported numpy policy (contract with ``cap_levels``), per-iteration statistics and the
        training time in seconds.
    """
    import gymnasium as gym

    from oracle.caps import joint_action_values, solve_joint
    from policies.learn.imitation import split_arrays
    from specenv.envs.caps import CAP_ID

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    drafting = "block" if lookahead else "none"
    env = gym.make(
        CAP_ID,
        dataset=dataset,
        kmax=kmax,
        split="train",
        cost_model=cost_model,
        quality_weight=quality_weight,
        lookahead=lookahead,
        drafting=drafting,
        signals=signals if lookahead else ("q",),
    )
    u = env.unwrapped
    spec = u.obs_spec
    arrays = split_arrays(dataset, u.kmax, "train")
    model = u.data.cost_model
    sol = solve_joint(arrays, model, quality_weight, lookahead, drafting, tables=u.tables)
    k1 = u.kmax + 1
    learner = RegretMLP(spec, hidden, n_out=n_actions(spec), lr=lr, epochs=epochs, seed=seed)

    def decode(j: int) -> np.ndarray:
        return np.array([j % k1, j // k1], dtype=np.int64)

    def label(roll: Visits) -> tuple[np.ndarray, np.ndarray]:
        Q = joint_action_values(arrays, u.tables, model, sol.value, roll.rows, quality_weight, lookahead, drafting)
        reg = (Q - Q.min(axis=1, keepdims=True)) / u.ar_unit_ms
        return roll.obs, np.minimum(np.nan_to_num(reg, posinf=UNAVAILABLE_REGRET), UNAVAILABLE_REGRET).astype(
            np.float32
        )

    expert = TableExpert(sol.cap * k1 + sol.k, label)
    source = ReplayEpisodes(env, arrays, to_action=decode)
    history = run_dagger(source, expert, learner, iterations, rng, log=log, label=f"joint dagger w={quality_weight:g}")
    env.close()
    meta = dagger_meta(
        "joint-dagger",
        learner,
        history,
        "expected regret + 0.05 cross-entropy to the joint oracle's action",
        seed,
        action="joint (k, expert cap): index c * (kmax+1) + k",
        caps=list(u.caps),
        quality_weight=float(quality_weight),
        dataset=str(dataset),
        cost_model=cost_model,
        drafting=drafting,
        lookahead=lookahead,
    )
    name = f"joint-imitation-w{quality_weight:g}" + (f"-h{lookahead}" if lookahead else "")
    return DaggerResult(learner.snapshot(name=name, meta=meta), history, time.perf_counter() - t0)
