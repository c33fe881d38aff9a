"""The per-token environment of the sequential drafting mode: each step is one draft decision.

``gymnasium.make("specenv/MoESpecSeq-v0", dataset=..., kmax=..., split=..., cost_model=...)`` replays
the same generations, acceptance draws and round costs as the replay environment with
``drafting="sequential"`` (:class:`specenv.envs.replay.MoESpecEnv`), but the agent decides token by
token: draft one more, or stop and verify the drafts so far. It is the natural form of stopping
controllers (transformers' confidence stop, SpecDec++, AdaEDL, DISCO) and of RL on stopping: the
observation shows the confidence of the draft just drafted and nothing of the drafts not yet drafted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from gymnasium import spaces

from specenv.envs.common import DEFAULT_REWARD, RoundEnv, check_reward, reset_generation_id
from specenv.envs.render import RENDER_MODES, RoundStrip, check_render_mode
from specenv.envs.replay import round_line
from specenv.observation.single import ScalarObservation
from specenv.replay.episode import Episode, RoundTables
from specenv.replay.tables import replay_data
from specenv.traces.datasets import DEFAULT_DATASET

__all__ = ["SEQ_ID", "STOP", "DRAFT", "MoESpecSeqEnv"]

SEQ_ID = "specenv/MoESpecSeq-v0"
#: Actions: stop and verify the drafts so far; draft one more token.
STOP, DRAFT = 0, 1


class MoESpecSeqEnv(RoundEnv):
    """Sequential drafting, one draft decision per step: continue (draft one more token) or stop (verify).

    ## Description

    The round model of :class:`specenv.envs.replay.MoESpecEnv` in drafting mode ``"sequential"``: the
    drafter produces one token at a time and the controller may stop after any of them. At the start
    of a round nothing is drafted. Action 1 drafts the next token and shows its confidence
    ``q_{t,n}`` (n = drafts so far); action 0 stops and verifies the n drafts: the round has budget
    ``k = n`` and is charged ``C(t, k) = T_D(k) + T_T(k, U_{t,k}, L_t)`` (the tokens it drafted,
    every one of them verified). After the kmax-th draft the round is verified at once (the
    drafting step is also the verification step). Stopping at n = 0 is a plain autoregressive step.

    Everything else is the replay environment's: the accepted drafts ``a`` of a round come from one
    uniform per round, drawn at reset as ``np_random.random(N)`` after the generation is picked with
    ``np_random.integers(G)``; the round commits ``a + 1`` tokens. So for the same seed a stopping
    rule that drafts k tokens every round reproduces the replay environment's episode at fixed k
    exactly (costs, rewards, acceptance), and the best stopping rule reaches the oracle's bound of
    the sequential mode (the bound of ``"none"``: :func:`oracle.dp.solve`).

    ## Action Space

    ``Discrete(2)``: 0 = stop and verify the drafts so far, 1 = draft one more token.

    ## Observation Space

    ``Box(0, high, (13 + kmax,), float32)``: the replay environment's observation without lookahead
    (its table in :class:`specenv.envs.replay.MoESpecEnv`, contract :class:`specenv.observation.single.ObservationSpec`
    with ``per_token=True``; names in order: :attr:`specenv.observation.single.ObservationSpec.names`), then:

    | Name | Meaning | Range |
    |---|---|---|
    | draft_conf | confidence q_{t,n} of the draft just drafted (0 before the round's first draft) | [0, 1] |
    | drafted | drafts n drafted so far in this round / kmax | [0, 1] |
    | draft_conf_prod | q_{t,1} * ... * q_{t,n} (1 before the first draft) | [0, 1] |

    The round-level features (context, previous round, running statistics) change only when a
    round is verified. No confidence of a draft not yet drafted, nor any rho or U, enters.

    ## Rewards

    Paid on the verification step, as in the replay environment: ``reward="savings"`` (default, as
    in ``specenv/MoESpec-v1``) gives ``committed - cost / ar_unit_ms``, ``reward="cost"`` gives
    ``-cost / ar_unit_ms``; a drafting step that does not verify gives 0. The episode return is the replay
    environment's.

    ## Starting State

    :meth:`reset` picks a generation (``np_random`` or ``options["generation_id"]``) and draws the
    episode's acceptance uniforms, as the replay environment does; t = 0, nothing drafted.

    ## Episode End

    * Termination: the generation's N tokens are committed (on a verification step).
    * Truncation: never (an episode has at most N rounds of at most kmax + 1 steps).

    ``info`` of a drafting step: ``drafted``, ``conf``, ``verified`` (False), ``generation_id``,
    ``category``. ``info`` of a verification step: the replay environment's round keys (``k``,
    ``accepted``, ``committed``, ``cost_ms``, ``U_r``, ``L``, ``t``, ``generation_id``,
    ``category`` and, at the end, ``speedup``, ``episode_cost_ms``, ``ar_cost_ms``, ``rounds``),
    ``drafted`` (= k) and ``verified`` (True).

    ## Arguments

    ```python
    gymnasium.make("specenv/MoESpecSeq-v0", dataset="paper-default", kmax=None, split="train",
                   cost_model="fit", render_mode=None, reward="savings")
    ```

    Args:
        dataset: Registry name or trace-set folder.
        kmax: Largest budget (1..the trace set's Kmax; default its Kmax): the most drafts per round.
        split: ``"train"`` (default), ``"test"`` or ``"all"``.
        cost_model: ``"fit"``, ``"profile"`` or a cost-model JSON path.
        render_mode: None, ``"ansi"`` (the last step as one line) or ``"rgb_array"`` (a bar strip of
            the recent rounds' k and accepted).
        reward: ``"savings"`` (default) or ``"cost"``.
        signals: Draft signals shown per drafted token (``("q",)`` default; ``"ent"``/``"margin"`` add
            ``draft_ent``/``draft_margin``, from a schema-v2 set).

    Raises:
        ValueError: Naming the argument, as for the replay environment.

    ## Version History

    * v0: initial version.

    The observation contract is the attribute ``obs_spec`` (``spec`` is Gymnasium's ``EnvSpec``).

    Examples:
        >>> import gymnasium as gym
        >>> import specenv
        >>> env = gym.make("specenv/MoESpecSeq-v0", split="test", reward="cost")
        >>> env.action_space
        Discrete(2)
        >>> obs, info = env.reset(seed=0)
        >>> obs.shape
        (23,)
        >>> obs, reward, terminated, truncated, info = env.step(1)  # draft the first token
        >>> reward, info["drafted"], info["verified"]
        (0.0, 1, False)
        >>> obs, reward, terminated, truncated, info = env.step(0)  # stop: verify it
        >>> info["k"], info["verified"], reward < 0
        (1, True, True)
    """

    metadata = {"render_modes": list(RENDER_MODES), "render_fps": 4}
    env_id = SEQ_ID

    def __init__(
        self,
        dataset: str = DEFAULT_DATASET,
        kmax: int | None = None,
        split: str = "train",
        cost_model: str = "fit",
        render_mode: str | None = None,
        reward: str = DEFAULT_REWARD,
        signals: Any = ("q",),
    ):
        self.render_mode = check_render_mode(render_mode)
        self._savings = check_reward(reward)
        self.reward = reward
        # the replay environment's sequential tables: T_D(k) charged, the confidences of kmax drafts
        self.data = d = replay_data(dataset, kmax, split, cost_model, None, "sequential", signals)
        self.kmax = d.kmax
        self.drafting = d.drafting
        self.ar_unit_ms = d.ar_unit_ms
        self.obs_spec = replace(d.spec, lookahead=0, per_token=True)
        self.action_space = spaces.Discrete(2)
        self.observation_space = self.obs_spec.space()
        self._obs = ScalarObservation(self.obs_spec)
        self._tables = RoundTables.of(d)
        self._episode: Episode | None = None
        self._conf = d.conf.item
        self._conf_width = d.conf.shape[1]
        self._extra = len(d.signals) - 1  # entropy / margin columns after q's block
        self._done = True
        self._line = ""
        self._strip = RoundStrip(self.kmax) if render_mode == "rgb_array" else None
        self._n = 0
        self._q = 0.0
        self._prod = 1.0
        self._sig: tuple[float, ...] = (0.0,) * self._extra

    # ------------------------------------------------------------------ episode
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start a generation, as :meth:`specenv.envs.replay.MoESpecEnv.reset` does (same draws).

        Raises:
            ValueError: If ``options`` has an unknown key or names a generation not in the split.
        """
        super().reset(seed=seed)
        ep = self._begin(Episode.start(self.data, self.np_random, reset_generation_id(options), self._tables))
        self._new_round()
        return self._build(), {"generation_id": ep.generation_id, "category": ep.category}

    @property
    def episode(self) -> Episode | None:
        """The episode in progress (:class:`specenv.replay.episode.Episode`; None before the first :meth:`reset`)."""
        return self._episode

    def _new_round(self) -> None:
        self._n = 0
        self._q = 0.0
        self._prod = 1.0
        self._sig = (0.0,) * self._extra

    def _build(self) -> np.ndarray:
        ep = self._episode
        t = ep.t
        return self._obs.build(ep.L0 + t, t, None, (self._q, self._n, self._prod, *self._sig))

    def _check_action(self, action: Any) -> int:
        """The action as 0 or 1.

        Raises:
            ValueError: If ``action`` is not the integer 0 or 1.
            RuntimeError: If called before :meth:`reset` or after the episode ended.
        """
        try:
            a = action.__index__()
        except (AttributeError, TypeError):
            raise ValueError(f"action={action!r}: must be 0 (stop and verify) or 1 (draft one more)") from None
        if a not in (STOP, DRAFT):
            raise ValueError(f"action={a}: must be 0 (stop and verify) or 1 (draft one more)")
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset()")
        return a

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Draft one more token (1) or stop and verify the drafts so far (0).

        Raises:
            ValueError: If ``action`` is not 0 or 1.
            RuntimeError: If called before :meth:`reset` or after the episode ended.
        """
        if self._check_action(action) == DRAFT:
            ep = self._episode
            n = self._n + 1
            base = ep.row * self._conf_width + n - 1
            # as float32, the precision every policy sees it with (the round-level observation's conf_n):
            # the product below is then the one a round-level stop rule recomputes (policies.learn.stopping)
            q = float(np.float32(self._conf(base)))
            self._n, self._q = n, q
            if self._extra:
                self._sig = tuple(self._conf(base + self.kmax * (i + 1)) for i in range(self._extra))
            self._prod *= q
            if n < self.kmax:
                gid, cat = ep.generation_id, ep.category
                if self.render_mode == "ansi":
                    self._line = f"gen {gid} [{cat}] round {ep.rounds}: t={ep.t} drafted {n} q={q:.3f}"
                info = {"drafted": n, "conf": q, "verified": False, "generation_id": gid, "category": cat}
                return self._build(), 0.0, False, False, info
        return self._verify(self._n)

    def _verify(self, k: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Verify k drafts: :meth:`specenv.envs.replay.MoESpecEnv.step`'s round, through the same episode."""
        ep = self._episode
        r = ep.play(k)
        self._obs.update(k, r.accepted, r.U_r, r.ctx_units, r.committed)
        info = ep.info(r)
        info["drafted"] = k
        info["verified"] = True
        if r.terminated:
            self._done = True
        if self._strip is not None:
            self._strip.push(k, r.accepted)
        elif self.render_mode == "ansi":
            self._line = round_line(ep, r)
        self._new_round()
        reward = r.committed - r.units if self._savings else -r.units
        return self._build(), reward, r.terminated, False, info
