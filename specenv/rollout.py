"""The rollout loop: play an online policy through an environment, episode by episode.

:func:`rollout` is the one loop that plays a policy (``reset()`` / ``act(obs)``) through an
environment with the replay env's API for a list of ``(generation_id, seed)`` episodes and returns
per-episode arrays; the benchmark (:func:`policies.benchmark.run_policy`, seeds ``seed + r``) and
:func:`evaluate_in_env` both use it. The exact oracle (:mod:`oracle`) never builds environments.

:func:`evaluate_in_env` is the Monte-Carlo evaluation of any online policy: every generation of
the chosen split is replayed ``episodes`` times (``reset(seed=..., options={"generation_id": gid})``);
the per-episode seeds come from one ``numpy`` generator seeded with ``seed``, so a run is reproducible.
Estimates come with 95% normal confidence half-widths over episodes: plain means for per-episode
quantities, the delta method for ratio estimators (pooled speedup = sum AR / sum cost, mean k and
mean accepted per round).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from specenv.stats import mean_ci, ratio_ci

__all__ = ["EnvEvaluation", "OnlinePolicy", "Rollouts", "evaluate_in_env", "rollout"]

ENV_ID = "specenv/MoESpec-v0"


@runtime_checkable
class OnlinePolicy(Protocol):
    """The policy protocol the environment evaluation needs (see :mod:`specenv.policy.base`)."""

    def reset(self) -> None:
        """Forget the current generation."""

    def act(self, obs: np.ndarray) -> int:
        """Budget k of the next round given the observation vector."""


@dataclass
class Rollouts:
    """Per-episode results of :func:`rollout` (arrays of length E, in the order of the episodes).

    Attributes:
        generation_ids: (E,) int64 generation replayed by each episode.
        seeds: (E,) int64 reset seed of each episode.
        categories: (E,) object array, the category the reset reported.
        cost: (E,) episode cost in ms (sum of ``info["cost_ms"]`` in round order).
        ar: (E,) AR cost of the episode's generation in ms (``info["ar_cost_ms"]`` of the last round).
        rounds: (E,) rounds.
        k_sum: (E,) sum of the budgets run (``info["k"]``).
        accepted_sum: (E,) sum of ``info["accepted"]``.
        returns: (E,) episode returns (sum of rewards).
    """

    generation_ids: np.ndarray
    seeds: np.ndarray
    categories: np.ndarray
    cost: np.ndarray
    ar: np.ndarray
    rounds: np.ndarray
    k_sum: np.ndarray
    accepted_sum: np.ndarray
    returns: np.ndarray


def rollout(env: Any, policy: OnlinePolicy, episodes: Sequence[tuple[int, int]]) -> Rollouts:
    """Play ``policy`` through ``env`` once per ``(generation_id, seed)`` episode.

    Each episode is ``env.reset(seed=seed, options={"generation_id": gid})``, ``policy.reset()``,
    then ``env.step(policy.act(obs))`` until terminated or truncated.

    Args:
        env: An environment with the replay env's API (``info`` carries ``k``, ``accepted``,
            ``cost_ms``, and ``ar_cost_ms`` at the end of an episode); it is neither made nor closed here.
        policy: Object with ``reset()`` and ``act(obs) -> int``.
        episodes: ``(generation_id, seed)`` pairs, played in this order.

    Returns:
        The per-episode :class:`Rollouts`.
    """
    E = len(episodes)
    out = Rollouts(
        generation_ids=np.array([int(g) for g, _ in episodes], dtype=np.int64),
        seeds=np.array([int(s) for _, s in episodes], dtype=np.int64),
        categories=np.empty(E, dtype=object),
        cost=np.zeros(E),
        ar=np.zeros(E),
        rounds=np.zeros(E, dtype=np.int64),
        k_sum=np.zeros(E, dtype=np.int64),
        accepted_sum=np.zeros(E, dtype=np.int64),
        returns=np.zeros(E),
    )
    for e in range(E):
        obs, info = env.reset(seed=int(out.seeds[e]), options={"generation_id": int(out.generation_ids[e])})
        out.categories[e] = info.get("category")
        policy.reset()
        cost, ret, n, k_sum, a_sum = 0.0, 0.0, 0, 0, 0
        done = False
        while not done:
            obs, reward, terminated, truncated, info = env.step(policy.act(obs))
            cost += float(info["cost_ms"])
            ret += float(reward)
            k_sum += int(info["k"])
            a_sum += int(info["accepted"])
            n += 1
            done = bool(terminated or truncated)
        out.cost[e], out.returns[e], out.rounds[e], out.k_sum[e], out.accepted_sum[e] = cost, ret, n, k_sum, a_sum
        out.ar[e] = float(info.get("ar_cost_ms", np.nan))  # absent only if an env truncates
    return out


@dataclass
class EnvEvaluation(Rollouts):
    """Episodes of a policy in the replay environment: :class:`Rollouts` plus the policy's name.

    Attributes:
        policy: The policy's ``name`` (or class name).
    """

    policy: str = ""

    @property
    def speedup(self) -> np.ndarray:
        """(E,) per-episode speedup AR / cost."""
        return self.ar / self.cost

    def summary(self) -> dict[str, Any]:
        """Estimates with 95% confidence half-widths (``{"value": ..., "ci95": ...}``)."""
        return {
            "policy": self.policy,
            "episodes": int(len(self.cost)),
            "generations": int(len(np.unique(self.generation_ids))),
            "speedup_pooled": ratio_ci(self.ar, self.cost),
            "speedup_mean": mean_ci(self.speedup),
            "cost_ms_mean": mean_ci(self.cost),
            "return_mean": mean_ci(self.returns),
            "mean_k": ratio_ci(self.k_sum, self.rounds),
            "mean_accepted": ratio_ci(self.accepted_sum, self.rounds),
        }


def evaluate_in_env(
    policy: OnlinePolicy,
    dataset: str = "paper-default",
    split: str = "test",
    cost_model: str = "fit",
    kmax: int | None = None,
    lookahead: int = 0,
    episodes: int = 1,
    seed: int = 0,
    generation_ids: list[int] | np.ndarray | None = None,
    env: Any = None,
) -> EnvEvaluation:
    """Replay every generation of a split ``episodes`` times under ``policy``.

    Args:
        policy: Object with ``reset()`` and ``act(obs) -> int``.
        dataset: Trace set name or folder (ignored when ``env`` is given).
        split: ``"train"``, ``"test"`` or ``"all"`` (ignored when ``env`` is given).
        cost_model: ``"fit"``, ``"profile"`` or a cost-model JSON (ignored when ``env`` is given).
        kmax: Largest budget (default the trace set's).
        lookahead: Draft confidences in the observation (charged as in the oracle).
        episodes: Episodes per generation (stochastic traces need several for tight intervals).
        seed: Seed of the per-episode reset seeds.
        generation_ids: Replay only these generations (default: every generation of the split, in
            the environment's order; the environment must expose ``unwrapped.data.generation_ids``).
        env: An already built environment with the same API (then nothing is made or closed here).

    Returns:
        The :class:`EnvEvaluation`.

    Raises:
        ValueError: If ``episodes < 1`` or the list of generations is empty.
    """
    if episodes < 1:
        raise ValueError("episodes must be >= 1")
    own = env is None
    if own:
        import gymnasium as gym

        import specenv  # noqa: F401  (registers the environment)

        kwargs: dict[str, Any] = {"dataset": dataset, "split": split, "cost_model": cost_model, "lookahead": lookahead}
        if kmax is not None:
            kwargs["kmax"] = kmax
        env = gym.make(ENV_ID, **kwargs)
    try:
        if generation_ids is None:
            gids = np.asarray(env.unwrapped.data.generation_ids, dtype=np.int64)
        else:
            gids = np.asarray(generation_ids, dtype=np.int64)
        if not len(gids):
            raise ValueError("no generation to evaluate")
        ep_gid = np.repeat(gids, episodes)
        seeds = np.random.default_rng(seed).integers(0, 2**31 - 1, size=len(ep_gid))
        res = rollout(env, policy, list(zip(ep_gid.tolist(), seeds.tolist(), strict=True)))
    finally:
        if own:
            env.close()
    name = getattr(policy, "name", type(policy).__name__)
    return EnvEvaluation(**vars(res), policy=str(name))
