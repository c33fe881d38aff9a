"""The joint (k, expert cap) replay environment: choose the budget and the verification-time expert cap.

``gymnasium.make("specenv/MoESpecCap-v0", dataset=..., quality_weight=...)`` replays a trace set with
the ``caps-v1`` extension (:class:`specenv.traces.traceset.CapArrays`). Each step is one round with the
action ``(k, c)``: the budget k and the cap level c (0 = uncapped, 1..C = the set's caps B_1..B_C
experts per MoE layer). The round model (:class:`MoESpecCapEnv`'s Description): an uncapped round
is :class:`specenv.envs.replay.MoESpecEnv`'s round; a capped one accepts the capped target's drafts
deterministically, commits that many tokens plus one *of the reference text*, costs
the cost model at the capped unique experts and reports the committed tokens that differ from the
uncapped reference as quality loss. Both are rounds of the one replayed episode,
:meth:`specenv.replay.episode.Episode.play`, a capped one on the capped tables of
:func:`specenv.replay.caps.joint_tables` (:func:`capped_round_tables`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import numpy as np
from gymnasium import spaces

from specenv.envs.common import DEFAULT_REWARD
from specenv.envs.registration import CAP_ID
from specenv.envs.replay import MoESpecEnv
from specenv.replay.caps import JointTables, joint_tables
from specenv.replay.episode import RoundTables
from specenv.replay.tables import ReplayData, select_positions
from specenv.traces.datasets import load_dataset

__all__ = ["CAP_ID", "DEFAULT_CAPS_DATASET", "MoESpecCapEnv", "cap_tables"]

#: The shipped trace set with the ``caps-v1`` extension (the live CPU engine, greedy).
DEFAULT_CAPS_DATASET = "live-cpu-caps"

_TABLES: weakref.WeakKeyDictionary[ReplayData, JointTables] = weakref.WeakKeyDictionary()


def cap_tables(data: ReplayData) -> JointTables:
    """The capped round tables of a replay's split (cached with the replay tables, read-only).

    Raises:
        ValueError: Naming ``dataset`` when the set has no caps columns.
    """
    hit = _TABLES.get(data)
    if hit is None:
        arr = select_positions(load_dataset(data.dataset), data.kmax, data.split)
        try:
            hit = joint_tables(arr, data.cost_model, data.lookahead, data.drafting)
        except ValueError as exc:
            raise ValueError(f"dataset={data.dataset!r}: {exc}") from None
        for name in ("acc", "committed", "cost", "U", "mis", "lpgap"):
            getattr(hit, name).flags.writeable = False
        _TABLES[data] = hit
    return hit


def capped_round_tables(tables: JointTables, data: ReplayData) -> list[RoundTables]:
    """The round tables of each cap level c = 1..C (index c-1): the capped verdict, cost and U in row order.

    A capped round accepts the capped target's recorded drafts (deterministic: the caps columns are
    recorded greedily) and is charged at the capped unique experts; the AR step at the context is the
    replay's (the observation's unit does not depend on the cap).
    """
    return [
        RoundTables(
            cost=np.ascontiguousarray(tables.cost[c].T),
            U=np.ascontiguousarray(tables.U[c].T),
            ar_ctx=data.ar_ctx_ms,
            accepted=np.ascontiguousarray(tables.acc[c].T),
        )
        for c in range(tables.n_levels)
    ]


class MoESpecCapEnv(MoESpecEnv):
    """Replay of recorded generations; the agent picks the budget k and the expert cap of every round.

    ## Description

    MoE-Spec's lever next to the draft length: a verification pass may load only the ``B`` experts
    per MoE layer that carry the most routing weight over the verified positions, dropping the long
    tail. A cap makes the pass cheaper (fewer unique experts U) but the capped target is a different
    model: it may accept fewer drafts and its tokens may differ from the uncapped target's. One
    episode is one generation of the split, as in :class:`~specenv.envs.replay.MoESpecEnv`; a round
    at position t with action ``(k, c)``:

    * ``c = 0`` (or ``k = 0``: plain decoding is never capped): the uncapped round of
      :class:`~specenv.envs.replay.MoESpecEnv`, the same draw, commit and charge;
    * ``c >= 1, k >= 1``: the capped target accepts ``a = acc_c(t, k)`` drafts (the caps columns are
      recorded greedily: deterministic), the round commits ``min(a + 1, N - t)`` tokens and costs
      ``C = T_D(k) + T_T(k, U_c(t, k), L_t)`` (the same cost model, at the capped unique experts). The
      replay keeps the *reference* text (the uncapped target's): the committed tokens that differ from
      it, ``mis_c(t, k)`` (clipped to the tokens committed), are reported as quality loss, and the
      episode continues on the reference. This is the offline approximation for a lossy arm; the
      capped arms are never lossless.

    ## Action Space

    ``MultiDiscrete([kmax + 1, C + 1])``: ``action = (k, c)``. ``(0, c)`` is played as ``(0, 0)``
    and reported with ``cap = 0``.

    ## Observation Space

    The replay environment's observation contract (:mod:`specenv.observation.single`), unchanged: the
    previous round's ``prev_U`` and ``prev_cost`` are the capped round's when it ran capped. The
    environment's :attr:`obs_spec` carries ``cap_levels = C`` (the joint policies' contract; the vector is
    the same).

    ## Rewards

    The replay environment's reward (``"savings"`` or ``"cost"``, AR-step units) minus
    ``quality_weight * mismatches``: each mismatched token costs ``quality_weight`` AR steps (default
    0: speed only). The joint oracle's Lagrangian weight (:func:`oracle.caps.solve_joint`) is in the
    same unit, so its optimum is the optimum of this reward.

    ## Starting State

    As in :class:`~specenv.envs.replay.MoESpecEnv`: a generation of the split picked with
    ``np_random`` (or ``options["generation_id"]``), t = 0, no round played yet; the episode's quality
    totals start at 0.

    ## Episode End

    As in :class:`~specenv.envs.replay.MoESpecEnv`: termination when the N reference tokens are
    committed, never truncated.

    ``info`` of :meth:`step`: the replay environment's keys (``cost_ms``, ``U_r`` and ``accepted`` of
    the capped round when capped) plus ``cap`` (level played), ``cap_experts`` (B, 0 when uncapped),
    ``mismatches`` (mismatched committed tokens of the round) and ``lpgap`` (the round's mean log-prob
    gap, 0 uncapped); on the terminating step also ``episode_mismatches``, ``mismatch_rate``
    (mismatches / N), ``episode_lpgap`` (sum of lpgap x committed tokens over the capped rounds) and
    ``capped_rounds``.

    ## Arguments

    ```python
    gymnasium.make("specenv/MoESpecCap-v0", dataset="live-cpu-caps", kmax=None, split="train",
                   cost_model="fit", lookahead=None, render_mode=None, reward="savings", drafting=None,
                   signals=("q",), quality_weight=0.0)
    ```

    Args:
        dataset: Registry name or folder of a trace set with the ``caps-v1`` extension.
        kmax, split, cost_model, lookahead, render_mode, reward, drafting, signals: As for
            :class:`~specenv.envs.replay.MoESpecEnv`.
        quality_weight: AR steps subtracted from the reward per mismatched token (>= 0, finite).

    Raises:
        ValueError: Naming the argument (the replay environment's, a set without caps columns
            under ``dataset``, a negative or non-finite ``quality_weight``).

    ## Version History

    * v0: initial version.

    Examples:
        >>> import gymnasium as gym
        >>> import specenv
        >>> env = gym.make("specenv/MoESpecCap-v0")
        >>> env.action_space.nvec.tolist() == [env.unwrapped.kmax + 1, len(env.unwrapped.caps) + 1]
        True
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step((3, 1))
        >>> info["cap"], info["cap_experts"] == env.unwrapped.caps[0], info["U_r"] <= info["cap_experts"]
        (1, True, True)
    """

    env_id = CAP_ID

    def __init__(
        self,
        dataset: str = DEFAULT_CAPS_DATASET,
        kmax: int | None = None,
        split: str = "train",
        cost_model: str = "fit",
        lookahead: int | None = None,
        render_mode: str | None = None,
        reward: str = DEFAULT_REWARD,
        drafting: str | None = None,
        signals: Any = ("q",),
        quality_weight: float = 0.0,
    ):
        if (
            isinstance(quality_weight, bool)
            or not isinstance(quality_weight, (int, float, np.integer, np.floating))
            or not np.isfinite(quality_weight)
            or quality_weight < 0
        ):
            raise ValueError(f"quality_weight={quality_weight!r}: must be a finite number >= 0")
        super().__init__(dataset, kmax, split, cost_model, lookahead, render_mode, reward, drafting, signals)
        self.quality_weight = float(quality_weight)
        self.tables = cap_tables(self.data)
        self.caps = self.tables.levels
        self.obs_spec = dataclasses.replace(self.data.spec, cap_levels=len(self.caps))
        self.action_space = spaces.MultiDiscrete([self.kmax + 1, len(self.caps) + 1])
        self._capped = capped_round_tables(self.tables, self.data)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start a generation (as :meth:`specenv.envs.replay.MoESpecEnv.reset`)."""
        out = super().reset(seed=seed, options=options)
        self._ep_mis = 0.0
        self._ep_lp = 0.0
        self._ep_capped = 0
        return out

    def _joint_action(self, action: Any) -> tuple[int, int]:
        try:
            a = np.asarray(action)
            ok = a.shape == (2,) and np.issubdtype(a.dtype, np.integer)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"action={action!r}: must be a pair of integers (k, cap level)")
        k, c = int(a[0]), int(a[1])
        if not 0 <= c <= len(self.caps):
            raise ValueError(f"action={action!r}: cap level {c} outside 0..{len(self.caps)}")
        return k, c

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Execute one round with ``action = (k, cap level)`` (see the class docstring).

        Raises:
            ValueError: If ``action`` is not a pair of integers in range.
            RuntimeError: If called before :meth:`reset` or after the episode ended.
        """
        k, c = self._joint_action(action)
        self._check_action(k)
        c = c if k else 0
        if c:
            t = self.tables
            row = self._episode.row
            mis, lp = float(t.mis[c - 1, k, row]), float(t.lpgap[c - 1, k, row])
        else:
            mis = lp = 0.0
        # the capped round: the same episode's round on the capped tables (the recorded verdict, cost and U)
        obs, reward, terminated, truncated, info = self._play(k, self._capped[c - 1] if c else None)
        self._ep_mis += mis
        self._ep_lp += lp * info["committed"]
        self._ep_capped += bool(c)
        info |= {"cap": c, "cap_experts": self.caps[c - 1] if c else 0, "mismatches": mis, "lpgap": lp}
        if terminated:
            info |= {
                "episode_mismatches": self._ep_mis,
                "mismatch_rate": self._ep_mis / self._episode.N,
                "episode_lpgap": self._ep_lp,
                "capped_rounds": self._ep_capped,
            }
        return obs, reward - self.quality_weight * mis, terminated, truncated, info
