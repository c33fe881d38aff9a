"""The replay environment: choose the speculation length k of every round of one generation.

``gymnasium.make("specenv/MoESpec-v1", dataset=..., kmax=..., split=..., cost_model=..., lookahead=...)``
replays recorded generations (the positions table of a trace set) under the round model described
in :class:`MoESpecEnv`. :class:`MoESpecEnv` steps one generation; :mod:`specenv.envs.vector` steps
many at once in numpy and produces exactly the same trajectories for the same seeds and actions.

Both are built on :class:`specenv.replay.tables.ReplayData`: the per-trace-set tables (survival probabilities, charged
round costs, unique experts, draft confidences) computed once and shared, read-only, between every
environment built with the same arguments in a process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from specenv.envs.common import DEFAULT_REWARD, RoundEnv, check_reward, reset_generation_id
from specenv.envs.registration import REPLAY_ID
from specenv.envs.render import RENDER_MODES, RoundStrip, check_render_mode
from specenv.observation.single import ScalarObservation
from specenv.replay.episode import Episode, Round, RoundTables
from specenv.replay.tables import ReplayData, replay_data
from specenv.traces.datasets import DEFAULT_DATASET

__all__ = ["ENV_ID", "RENDER_MODES", "MoESpecEnv", "ReplayData", "replay_data"]

ENV_ID = REPLAY_ID


# --------------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------------
class MoESpecEnv(RoundEnv):
    """Replay of recorded generations; the agent picks the draft budget k of every round.

    ## Description

    Speculative decoding on a Mixture-of-Experts target: each round a small draft model proposes
    ``k`` tokens, the target verifies them in one forward pass and commits the accepted prefix plus
    one token of its own. Verifying more drafts may commit more tokens per pass, but on an MoE
    target every extra verified position can route to more distinct experts, so the pass costs
    more. The agent chooses ``k`` for every round of one generation, to minimise the generation's
    total cost. One episode is one recorded generation (a row block of the trace set's positions
    table) of the chosen split; the round model is:

    * accepted drafts ``a`` are drawn with ``P(a >= i) = prod_{j<=i} rho_{t,j}`` by inverse
      transform of one uniform per round (``a = #{i <= k : u < P(a >= i)}``); the uniforms of an
      episode are drawn at reset as ``np_random.random(N)``, after the generation is picked with
      ``np_random.integers(G)``. Greedy traces (rho in {0, 1}) are deterministic;
    * the round commits ``a + 1`` tokens, ``t' = min(t + a + 1, N)``; at the very end the reported
      ``accepted`` is capped to ``t' - t - 1`` (nothing is accepted past the generation's end);
    * the round costs ``C(t, k) = T_D(k) + T_T(k, U_{t,k}, L_t)`` ms from the cost model
      (:meth:`specenv.cost.model.CostModel.charged_table`): draft time plus the target's verification
      time at ``U_{t,k}`` unique experts and context length ``L_t``. The draft term follows the
      drafting mode (:mod:`specenv.cost.model`): ``drafting="none"`` (k chosen before drafting, no
      confidence shown) pays ``T_D(k)``; ``"block"`` (the draft proposes h tokens at once, the
      observation shows their h confidences and the agent trims to k) pays ``T_D(max(k, h))``, also
      for k = 0; ``"sequential"`` (the drafter produces one token at a time and the agent stops after
      any of them) shows the confidences q_{t,1..h} and pays ``T_D(k)``: the agent is a stopping rule
      that verifies every token it drafted, so its choice of k may depend on q_{t,1..k} only (a rule
      that reads q_{t,k+1} to stop at k drafted k+1 tokens: use ``specenv/MoESpecSeq-v0``, where
      each step is one draft decision and nothing beyond the drafted tokens is shown). The target
      term is the same in every mode.

    Generation ids are split 80/20 into train/test by :mod:`specenv.traces.splits` (sha256 rank of the
    id; the same rule the oracle and the benchmark use). :mod:`specenv.envs.vector` steps many
    generations at once in numpy with bit-identical trajectories.

    ## Action Space

    ``Discrete(kmax + 1)``: the budget ``k`` of the round, 0 = a plain autoregressive step (no
    drafts verified), up to ``kmax`` (by default the trace set's Kmax).

    ## Observation Space

    ``Box(0, high, (10 + kmax + lookahead,), float32)``: what a real server knows before it
    verifies (the contract of :mod:`specenv.observation.single`). Nothing of the current round's rho or
    U, nor the generation's length N, nor any later position enters it.

    | Name | Meaning | Range |
    |---|---|---|
    | context | context length L_t / 4096 | [0, 64] |
    | progress | tokens generated so far t / max_new_tokens, clipped | [0, 1] |
    | prev_k | previous round's budget k / kmax (0 before the first round) | [0, 1] |
    | prev_accepted | previous round's accepted drafts / kmax | [0, 1] |
    | prev_U | previous round's unique experts U_{t,k} / n_experts | [0, 1] |
    | prev_cost | previous round's cost in AR steps at its context, cost / C_AR(L_t), / (kmax + 1) | [0, 16] |
    | acc_rate | EMA (0.8) of accepted / k over rounds with k >= 1; prior 0.5 | [0, 1] |
    | acc_len | EMA of accepted / kmax over rounds with k >= 1; prior 0 | [0, 1] |
    | cost_per_token | EMA of the round cost / C_AR(L_t) per committed token; prior 1 | [0, 16] |
    | first_round | 1 before a generation's first round, else 0 | [0, 1] |
    | acc_depth_j | j = 1..kmax: EMA of the acceptance at draft depth j over rounds reaching it; prior 0.5 | [0, 1] |
    | conf_j | j = 1..lookahead: the draft's confidence q_{t,j} in its j-th next token | [0, 1] |
    | ent_j | j = 1..lookahead, only with signal ``"ent"``: the draft's entropy (nats) at its j-th token | [0, 16] |
    | margin_j | j = 1..lookahead, only with signal ``"margin"``: its top-1 minus top-2 probability there | [0, 1] |

    ## Rewards

    ``reward="savings"`` (default): ``committed - cost / ar_unit_ms``, the tokens the round
    committed minus the round's cost in AR-step units: the AR-equivalent cost the round saved (a
    plain AR step earns about 0, a good speculative round a few tokens). ``ar_unit_ms``
    (attribute) is the mean plain AR step cost ``C(t, 0)`` over all positions of the loaded
    split, a constant per environment. The episode return is ``N - episode cost / ar_unit_ms``.

    ``reward="cost"`` (the default of ``specenv/MoESpec-v0``): ``-cost / ar_unit_ms``, minus the
    round's cost in AR-step units; the episode return is minus the episode's cost in AR-token
    equivalents.

    The two are equivalent for the objective: over an episode the committed tokens sum to the
    generation's length N whatever the policy does, so the two (undiscounted) returns differ by
    that constant and have the same optimal policy and the same ranking of policies. The savings
    reward is the default because each round's reward measures its own progress: with the cost
    reward a plain AR step (-1) looks better than a good speculative round (about -1.9 for 3.8
    tokens) until the credit for the shorter episode propagates, and standard learners with their
    default settings then settle on k = 0.

    ## Starting State

    :meth:`reset` picks a generation of the split with ``np_random`` (or
    ``options["generation_id"]``) and draws the episode's acceptance uniforms; t = 0, no round
    played yet (``first_round`` = 1, running statistics at their priors).

    ## Episode End

    * Termination: the generation's N tokens are committed (every round commits at least one
      token, so an episode has at most N rounds).
    * Truncation: never (no time limit is registered).

    ``info`` of :meth:`reset`: ``generation_id``, ``category``. ``info`` of :meth:`step`: ``k``,
    ``accepted``, ``committed``, ``cost_ms`` (charged cost of the round), ``U_r`` (U_{t,k}),
    ``L`` (context length L_t the round verified at), ``t`` (tokens committed after the round),
    ``generation_id``, ``category``; on the terminating step also ``speedup`` (episode AR cost /
    episode cost), ``episode_cost_ms``, ``ar_cost_ms`` (sum_t C(t, 0)) and ``rounds``. No
    wall-clock time appears anywhere (the replay is deterministic given the seed).

    ## Arguments

    ```python
    gymnasium.make("specenv/MoESpec-v0", dataset="paper-default", kmax=None, split="train",
                   cost_model="fit", lookahead=None, render_mode=None, reward="savings", drafting=None,
                   signals=("q",))
    ```

    Args:
        dataset: Registry name (``"paper-default"``) or path of a trace-set folder.
        kmax: Largest budget; default the trace set's Kmax. Must be in 1..Kmax.
        split: ``"train"`` (default), ``"test"`` or ``"all"``.
        cost_model: ``"fit"`` (per-K fit on the set's rounds table, the default), ``"profile"``
            (the paper's coefficients) or a path to a cost-model JSON; see
            :func:`specenv.cost.source.cost_model_for`.
        lookahead: Number h of draft confidences in the observation (0..kmax). Default: 0 without a
            drafting mode or with ``"none"``, kmax with ``"block"`` or ``"sequential"``.
        render_mode: None, ``"ansi"`` (:meth:`render` returns the last round as one line) or
            ``"rgb_array"`` (a ``(64, 128, 3)`` uint8 bar strip of the last 32 rounds' k and
            accepted, :mod:`specenv.envs.render`). ``gymnasium.make(..., render_mode="human")``
            shows that image through gymnasium's ``HumanRendering`` (needs pygame).
        reward: ``"savings"`` (default) or ``"cost"`` (see Rewards).
        drafting: ``"none"``, ``"block"`` or ``"sequential"`` (:data:`specenv.cost.model.DRAFTING_MODES`;
            see Description). Default None: ``"block"`` when ``lookahead > 0``, else ``"none"``.
        signals: Draft signals of the lookahead block, an ordered subset of ``("q", "ent", "margin")``
            with ``"q"`` (:data:`specenv.observation.single.SIGNALS`); ``"ent"``/``"margin"`` need a schema-v2 set.

    Raises:
        ValueError: Naming the argument, for an unknown dataset or split, kmax outside 1..Kmax,
            lookahead outside 0..kmax (or given with ``drafting="none"``, or 0 with another mode),
            a bad cost model, reward, render mode or drafting mode.

    ## Version History

    * observation contract 2 (both ids): ``prev_cost`` and ``cost_per_token`` are divided by the AR
      step at the round's own context, ``C_AR(L_t)`` (contract 1: the split's mean AR step, which a
      server cannot know); ``signals`` adds the draft's entropy/margin. The contract carries its own
      version (:data:`specenv.observation.single.OBSERVATION_VERSION`), recorded in every exported policy
      and checked when it loads, so a policy trained on contract 1 is refused with one line.
    * v1: the default reward is ``"savings"`` (was ``"cost"``; the optimum is unchanged, see
      Rewards). Spaces, dynamics, ``info`` and the other arguments are those of v0.
      ``specenv/MoESpec-v0`` stays registered: the same class with ``reward="cost"``.
    * v0: initial version (replay of schema-v1 trace sets; observation contract of
      :mod:`specenv.observation.single`; ``reward``, ``render_mode="rgb_array"`` and ``drafting`` added
      without a version bump: the defaults behave as before).

    Examples:
        >>> import gymnasium as gym
        >>> import specenv
        >>> env = gym.make("specenv/MoESpec-v1", dataset="paper-default", split="test")
        >>> env.action_space
        Discrete(11)
        >>> obs, info = env.reset(seed=0)
        >>> obs.shape, obs.dtype
        ((20,), dtype('float32'))
        >>> sorted(info)
        ['category', 'generation_id']
        >>> obs, reward, terminated, truncated, info = env.step(4)
        >>> reward == info["committed"] - info["cost_ms"] / env.unwrapped.ar_unit_ms, truncated
        (True, False)
        >>> info["committed"] == info["accepted"] + 1
        True
        >>> while not terminated:
        ...     obs, reward, terminated, truncated, info = env.step(4)
        >>> info["speedup"] > 1
        True

        The cost reward (v0's default, or ``reward="cost"``) and an image of the recent rounds:

        >>> env = gym.make("specenv/MoESpec-v0", render_mode="rgb_array")
        >>> env.unwrapped.reward
        'cost'
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step(0)
        >>> reward == -info["cost_ms"] / env.unwrapped.ar_unit_ms
        True
        >>> frame = env.render()
        >>> frame.shape, frame.dtype
        ((64, 128, 3), dtype('uint8'))
    """

    metadata = {"render_modes": list(RENDER_MODES), "render_fps": 4}
    env_id = ENV_ID

    def __init__(
        self,
        dataset: str = DEFAULT_DATASET,
        kmax: int | None = None,
        split: str = "train",
        cost_model: str = "fit",
        lookahead: int | None = None,
        render_mode: str | None = None,
        reward: str = DEFAULT_REWARD,
        drafting: str | None = None,
        signals: Any = ("q",),
    ):
        self.render_mode = check_render_mode(render_mode)
        self._savings = check_reward(reward)
        self.reward = reward
        self.data = replay_data(dataset, kmax, split, cost_model, lookahead, drafting, signals)
        self.kmax = self.data.kmax
        self.lookahead = self.data.lookahead
        self.drafting = self.data.drafting
        self.ar_unit_ms = self.data.ar_unit_ms
        self.action_space = spaces.Discrete(self.kmax + 1)
        self.observation_space = self.data.spec.space()
        self._obs = ScalarObservation(self.data.spec)
        self._obs.clip = not self.data.within_box  # the same vectors, without the clip when in range
        self._tables = RoundTables.of(self.data)
        self._episode: Episode | None = None
        self._done = True
        self._line = ""
        self._strip = RoundStrip(self.kmax) if render_mode == "rgb_array" else None

    @property
    def episode(self) -> Episode | None:
        """The episode in progress (:class:`specenv.replay.episode.Episode`; None before the first :meth:`reset`)."""
        return self._episode

    @property
    def observation_statistics(self) -> np.ndarray:
        """A copy of the running statistics behind the current observation (float64).

        :attr:`specenv.observation.single.ScalarObservation.values`: ``[prev_k / kmax, prev_accepted /
        kmax, prev_U / n_experts, prev_cost / (kmax + 1), acc_rate, acc_len, cost_per_token,
        first_round, acc_depth_1..kmax]``, unclipped: what a learner needs to restart the
        observation of this state elsewhere (the branch rollouts of :mod:`policies.learn.aggrevate`).
        """
        return np.array(self._obs.values, dtype=np.float64)

    # ------------------------------------------------------------------ episode
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start a generation: picked with ``np_random`` or given as ``options["generation_id"]``.

        Args:
            seed: Seeds ``np_random`` (gymnasium semantics: only when not None).
            options: ``{"generation_id": gid}`` to replay a given generation of the split.

        Raises:
            ValueError: If ``options`` has an unknown key or names a generation not in the split.
        """
        super().reset(seed=seed)
        ep = self._begin(Episode.start(self.data, self.np_random, reset_generation_id(options), self._tables))
        conf = self.data.conf[ep.row0].tolist() if self.lookahead else None
        return self._obs.build(ep.L0, 0, conf), {"generation_id": ep.generation_id, "category": ep.category}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Execute one verification round with budget ``action`` (see the class docstring).

        Raises:
            ValueError: If ``action`` is not an integer in 0..kmax.
            RuntimeError: If called before :meth:`reset` or after the episode ended.
        """
        return self._play(self._check_action(action))

    def _play(self, k: int, tables: RoundTables | None = None) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One round of budget ``k`` through the episode (on ``tables`` when given): observation, reward, info."""
        ep = self._episode
        r = ep.play(k, tables)
        _, _, a, committed, t_new, _, U_r, units, ctx_units, terminated = r
        self._obs.update(k, a, U_r, ctx_units, committed)
        info = ep.info(r)
        if terminated:
            self._done = True
            conf = [0.0] * self.data.conf.shape[1] if self.lookahead else None
        else:
            conf = self.data.conf[ep.row0 + t_new].tolist() if self.lookahead else None
        if self.render_mode is not None:
            self._record(r)
        reward = committed - units if self._savings else -units
        return self._obs.build(ep.L0 + t_new, t_new, conf), reward, terminated, False, info

    def _record(self, r: Round) -> None:
        """Keep what :meth:`render` shows of the round just executed."""
        if self._strip is not None:
            self._strip.push(r.k, r.accepted)
            return
        self._line = round_line(self._episode, r)


def round_line(ep: Episode, r: Round) -> str:
    """The ``ansi`` render line of round ``r`` just played in episode ``ep``."""
    return (
        f"gen {ep.generation_id} [{ep.category}] round {ep.rounds - 1}: t={r.t} k={r.k} accepted={r.accepted} "
        f"+{r.committed} cost={r.cost_ms:.3f}ms U_r={r.U_r:.2f}" + (" (done)" if r.terminated else "")
    )
