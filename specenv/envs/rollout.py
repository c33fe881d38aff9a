"""The rollout loops: play an online policy through an environment, one episode after another or all at once.

:func:`rollout` is the one loop that plays a policy (``reset()`` / ``act(obs)``) through an
environment with the replay env's API for a list of ``(generation_id, seed)`` episodes and returns
per-episode arrays; :func:`evaluate_in_env` uses it. :func:`rollout_vector` plays the same episodes
as the streams of one native vector environment (:class:`specenv.envs.vector.MoESpecVectorEnv`)
with the policy's ``act`` on the stacked rows (the one protocol of :mod:`specenv.policy.base`), and
gives the same per-episode results for the same seeds (the
vector environment's sub-environments replay exactly the single environment's trajectories); the
benchmark (:func:`policies.bench.single.run_policy`) uses it. :func:`episode_seeds` gives every
``(seed, generation, episode)`` its own independent reset seed. The exact oracle (:mod:`oracle`)
never builds environments.

:func:`evaluate_in_env` is the Monte-Carlo evaluation of any online policy: every generation of
the chosen split is replayed ``episodes`` times (``reset(seed=..., options={"generation_id": gid})``);
the per-episode seeds come from one ``numpy`` generator seeded with ``seed``, so a run is reproducible.
Estimates come with 95% normal confidence half-widths over episodes: plain means for per-episode
quantities, the delta method for ratio estimators (pooled speedup = sum AR / sum cost, mean k and
mean accepted per round).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specenv.envs.registration import REPLAY_ID
from specenv.policy.base import PolicyProtocol
from specenv.stats import mean_ci, ratio_ci

__all__ = ["EnvEvaluation", "OnlinePolicy", "Rollouts", "episode_seeds", "evaluate_in_env", "rollout", "rollout_vector"]

ENV_ID = REPLAY_ID


#: The policy protocol the rollouts play: the one of :mod:`specenv.policy.base` (an alias of its name).
OnlinePolicy = PolicyProtocol


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
        k_min: (E,) smallest budget the policy chose in the episode.
        k_max: (E,) largest budget the policy chose in the episode.
        quality: Episode totals of the joint (k, expert cap) environment
            (:class:`specenv.envs.caps.MoESpecCapEnv`), filled by :func:`rollout` from the last
            ``info``: ``"mismatches"``, ``"lpgap"`` (sum of lpgap x committed) and ``"capped_rounds"``,
            each (E,); zeros for an environment that reports none.
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
    k_min: np.ndarray
    k_max: np.ndarray
    quality: dict[str, np.ndarray] = field(default_factory=dict)


#: The last ``info``'s episode totals :func:`rollout` keeps in :attr:`Rollouts.quality`.
_QUALITY = {"mismatches": "episode_mismatches", "lpgap": "episode_lpgap", "capped_rounds": "capped_rounds"}


def _empty(episodes: Sequence[tuple[int, int]]) -> Rollouts:
    E = len(episodes)
    return Rollouts(
        generation_ids=np.array([int(g) for g, _ in episodes], dtype=np.int64),
        seeds=np.array([int(s) for _, s in episodes], dtype=np.int64),
        categories=np.empty(E, dtype=object),
        cost=np.zeros(E),
        ar=np.zeros(E),
        rounds=np.zeros(E, dtype=np.int64),
        k_sum=np.zeros(E, dtype=np.int64),
        accepted_sum=np.zeros(E, dtype=np.int64),
        returns=np.zeros(E),
        k_min=np.full(E, np.iinfo(np.int64).max, dtype=np.int64),
        k_max=np.full(E, -1, dtype=np.int64),
        quality={name: np.zeros(E) for name in _QUALITY},
    )


def episode_seeds(
    seed: int, generation_ids: np.ndarray | Sequence[int], episodes: np.ndarray | Sequence[int]
) -> np.ndarray:
    """Independent reset seeds, one per ``(generation_id, episode)`` pair, from a base ``seed``.

    The seed of a pair is the first 32-bit word of ``numpy.random.SeedSequence([seed, gid, r])``
    (non-negative ``seed`` and ids; SeedSequence hashes its entropy, so neighbouring pairs get
    unrelated streams). It depends on nothing else (not on the other pairs, the split or the
    policy), so every policy replayed with the same base seed sees the same random numbers on the
    same ``(generation, episode)`` (common random numbers), while the generations' draws are
    independent of each other.

    Args:
        seed: Base seed (>= 0).
        generation_ids: (E,) generation ids (>= 0).
        episodes: (E,) episode numbers (>= 0).

    Returns:
        (E,) int64 seeds in 0..2**32-1.

    Raises:
        ValueError: If ``seed``, an id or an episode number is negative, or the lengths differ.
    """
    gids = np.asarray(generation_ids, dtype=np.int64).ravel()
    eps = np.asarray(episodes, dtype=np.int64).ravel()
    if len(gids) != len(eps):
        raise ValueError(f"generation_ids ({len(gids)}) and episodes ({len(eps)}) differ in length")
    if int(seed) < 0 or (len(gids) and (gids.min() < 0 or eps.min() < 0)):
        raise ValueError("episode_seeds: seed, generation ids and episode numbers must be >= 0")
    return np.array(
        [
            np.random.SeedSequence([int(seed), int(g), int(r)]).generate_state(1)[0]
            for g, r in zip(gids, eps, strict=True)
        ],
        dtype=np.int64,
    )


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
    out = _empty(episodes)
    for e in range(len(episodes)):
        obs, info = env.reset(seed=int(out.seeds[e]), options={"generation_id": int(out.generation_ids[e])})
        out.categories[e] = info.get("category")
        policy.reset()
        cost, ret, n, k_sum, a_sum, k_lo, k_hi = 0.0, 0.0, 0, 0, 0, out.k_min[e], -1
        done = False
        while not done:
            obs, reward, terminated, truncated, info = env.step(policy.act(obs))
            cost += float(info["cost_ms"])
            ret += float(reward)
            k = int(info["k"])
            k_sum += k
            k_lo, k_hi = min(k_lo, k), max(k_hi, k)
            a_sum += int(info["accepted"])
            n += 1
            done = bool(terminated or truncated)
        out.cost[e], out.returns[e], out.rounds[e], out.k_sum[e], out.accepted_sum[e] = cost, ret, n, k_sum, a_sum
        out.k_min[e], out.k_max[e] = k_lo, k_hi
        out.ar[e] = float(info.get("ar_cost_ms", np.nan))  # absent only if an env truncates
        for name, key in _QUALITY.items():
            out.quality[name][e] = float(info.get(key, 0.0))
    return out


def rollout_vector(envs: Any, policy: Any, episodes: Sequence[tuple[int, int]]) -> Rollouts:
    """Play ``policy`` on every ``(generation_id, seed)`` episode at once, one stream per episode.

    ``envs`` (a :class:`specenv.envs.vector.MoESpecVectorEnv` with ``num_envs == len(episodes)``)
    is reset once with every stream's own seed and generation
    (``reset(seed=[...], options={"generation_id": [...]})``); each step asks the policy for the
    streams at once (``policy.act(obs)`` on the stacked rows; a :class:`specenv.policy.base.Policy`
    keeps one copy of its memory per stream, the default ids being the positions) and the loop ends
    when every stream has terminated. A
    stream's episode is its steps up to its first termination: what the vector environment's
    autoreset plays afterwards is ignored. The per-episode results equal :func:`rollout`'s for the
    same episodes (same sums in the same order), since sub-environment i replays exactly what a
    single environment reset with the same seed and generation would.

    Not to spend the policy's time on finished streams, the streams are ordered by generation
    length, longest first (when the environment exposes its replay tables), the policy is asked
    only for the prefix of streams up to the last one still running (so stream i is always row i of
    ``act``), and a finished stream inside that prefix is shown its first observation again
    (a fresh generation, cheap for every policy) instead of the autoreset episode.

    Args:
        envs: The vector environment (neither made nor closed here); its ``info`` carries ``k``,
            ``accepted``, ``cost_ms``, ``category`` and, where a stream terminates, ``ar_cost_ms``.
        policy: A policy of the protocol (``reset()``, ``act(obs (n, dim)) -> (n,) ks``; streams are independent).
        episodes: ``(generation_id, seed)`` pairs.

    Returns:
        The per-episode :class:`Rollouts`, in the order of ``episodes``.

    Raises:
        ValueError: If ``envs.num_envs`` differs from the number of episodes.
    """
    out = _empty(episodes)
    E = len(episodes)
    if int(envs.num_envs) != E:
        raise ValueError(f"rollout_vector: num_envs={envs.num_envs} but {E} episodes (one stream per episode)")
    order = _longest_first(envs, out.generation_ids)
    res = _empty([episodes[i] for i in order.tolist()])  # stream order
    obs, info = envs.reset(seed=res.seeds.tolist(), options={"generation_id": res.generation_ids.tolist()})
    res.categories[:] = np.asarray(info["category"], dtype=object)
    first = np.array(obs, copy=True)
    policy.reset()
    live = np.ones(E, dtype=bool)
    k = np.zeros(E, dtype=np.int64)  # finished streams past the prefix play k = 0 (ignored)
    while live.any():
        m = int(np.flatnonzero(live)[-1]) + 1
        x = obs[:m]
        dead = ~live[:m]
        if dead.any():
            x = np.array(x, copy=True)
            x[dead] = first[:m][dead]
        k[:] = 0
        k[:m] = np.asarray(policy.act(x), dtype=np.int64)
        obs, reward, terminated, truncated, info = envs.step(k)
        # streams still in their first episode stepped normally this round (none was autoreset)
        k_run = info["k"]
        idx = np.flatnonzero(live)
        res.cost[idx] += info["cost_ms"][idx]
        res.returns[idx] += reward[idx]
        res.k_sum[idx] += k_run[idx]
        res.accepted_sum[idx] += info["accepted"][idx]
        res.rounds[idx] += 1
        res.k_min[idx] = np.minimum(res.k_min[idx], k_run[idx])
        res.k_max[idx] = np.maximum(res.k_max[idx], k_run[idx])
        ended = live & (np.asarray(terminated) | np.asarray(truncated))
        if ended.any():
            if "ar_cost_ms" in info:
                res.ar[ended] = np.where(info["_ar_cost_ms"][ended], info["ar_cost_ms"][ended], np.nan)
            else:  # absent only if an env truncates
                res.ar[ended] = np.nan
            live &= ~ended
    for name in ("categories", "cost", "ar", "rounds", "k_sum", "accepted_sum", "returns", "k_min", "k_max"):
        getattr(out, name)[order] = getattr(res, name)
    return out


def _longest_first(envs: Any, generation_ids: np.ndarray) -> np.ndarray:
    """Stream order: episodes by decreasing generation length (stable), or as given without replay tables."""
    data = getattr(getattr(envs, "unwrapped", envs), "data", None)
    if data is None or not hasattr(data, "lengths") or not hasattr(data, "index_of"):
        return np.arange(len(generation_ids))
    n = np.array([data.lengths[data.index_of(int(g))] for g in generation_ids], dtype=np.int64)
    return np.argsort(-n, kind="stable")


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


@dataclass
class SplitRollouts:
    """What :func:`rollout_split` played: per-episode results and each episode's identity.

    Attributes:
        rollouts: Per-episode sums (:class:`Rollouts`), in the order of the other arrays.
        generation_ids: (G,) the generations played, each ``episodes`` times in a row.
        episode_generation: (G * episodes,) the generation of each episode.
        episode_index: (G * episodes,) r = 0..episodes-1 within its generation.
        seeds: (G * episodes,) the reset seed of each episode (:func:`episode_seeds`).
        policy: The policy that played (built by ``make_policy``).
    """

    rollouts: Rollouts
    generation_ids: np.ndarray
    episode_generation: np.ndarray
    episode_index: np.ndarray
    seeds: np.ndarray
    policy: Any


def rollout_split(
    make_policy: Any,
    dataset: str,
    kmax: int | None,
    split: str,
    cost_model: str,
    lookahead: int | None,
    drafting: str | None,
    signals: Any,
    episodes: int,
    seed: int,
    generation_ids: Sequence[int] | np.ndarray | None = None,
) -> SplitRollouts:
    """Play a policy on every generation of a split ``episodes`` times, in the native vector env.

    Episode r of generation g is reset with ``episode_seeds(seed, g, r)``, so a subset of the
    generations (``generation_ids``) plays exactly the episodes it plays in the full run: the
    benchmark's chunks (local or on Ray) and the tuner's validation score share this one loop.

    Args:
        make_policy: ``make_policy(spec) -> policy`` given the replay tables' observation spec.
        dataset: Trace set name or folder.
        kmax: Largest budget (None: the set's).
        split: Split to replay (``"test"``, ``"train-val"``...).
        cost_model: ``fit``, ``fit-train``, ``profile`` or a cost-model JSON.
        lookahead: Draft confidences in the observation.
        drafting: Drafting mode (None: read from the lookahead).
        signals: Draft signals of the lookahead.
        episodes: Episodes per generation.
        seed: Base seed of :func:`episode_seeds`.
        generation_ids: Only these generations, in this order (default: every generation of the
            split, in the replay tables' order).

    Returns:
        The :class:`SplitRollouts`.
    """
    import gymnasium as gym

    from specenv.envs.replay import ENV_ID
    from specenv.replay.tables import replay_data

    data = replay_data(dataset, kmax, split, cost_model, lookahead, drafting, signals)
    gids = np.asarray(data.generation_ids if generation_ids is None else generation_ids, dtype=np.int64)
    ep_gid = np.repeat(gids, episodes)
    ep_r = np.tile(np.arange(episodes, dtype=np.int64), len(gids))
    seeds = episode_seeds(seed, ep_gid, ep_r)
    envs = gym.make_vec(
        ENV_ID,
        num_envs=len(ep_gid),
        vectorization_mode="vector_entry_point",
        dataset=dataset,
        kmax=kmax,
        split=split,
        cost_model=cost_model,
        lookahead=lookahead,
        drafting=drafting,
        signals=signals,
    )
    try:
        policy = make_policy(data.spec)
        res = rollout_vector(envs, policy, list(zip(ep_gid.tolist(), seeds.tolist(), strict=True)))
    finally:
        envs.close()
    return SplitRollouts(res, gids, ep_gid, ep_r, seeds, policy)
