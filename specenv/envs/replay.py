"""The replay environment: choose the speculation length k of every round of one generation.

``gymnasium.make("specenv/MoESpec-v0", dataset=..., kmax=..., split=..., cost_model=..., lookahead=...)``
replays recorded generations (the positions table of a trace set, DESIGN section 2) under the round
model of DESIGN section 1. :class:`MoESpecEnv` steps one generation; :mod:`specenv.envs.vector` steps
many at once in numpy and produces exactly the same trajectories for the same seeds and actions.

Both are built on :class:`specenv.replay.ReplayData`: the per-trace-set tables (survival probabilities, charged
round costs, unique experts, draft confidences) computed once and shared, read-only, between every
environment built with the same arguments in a process.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from specenv.datasets import DEFAULT_DATASET
from specenv.observation import CONTEXT_SCALE, EMA, PRIOR_RATE, ObservationSpec
from specenv.replay import ReplayData, replay_data

__all__ = ["ENV_ID", "RENDER_MODES", "MoESpecEnv", "ReplayData", "replay_data"]

ENV_ID = "specenv/MoESpec-v0"
RENDER_MODES = ("ansi",)


# --------------------------------------------------------------------------------------------------
# Scalar mirror of ObservationState (batch 1, Python floats)
# --------------------------------------------------------------------------------------------------
class _ScalarObservation:
    """:class:`specenv.observation.ObservationState` for one stream, in Python floats.

    Same features, same arithmetic in the same order, hence bit-identical float32 vectors (the tests
    compare it with ``ObservationState`` and the single env with the vector env); it exists only
    because per-step numpy calls on length-1 arrays would dominate the single env's step time.
    """

    __slots__ = (
        "spec",
        "hi",
        "kmax",
        "prev_k",
        "prev_acc",
        "prev_U",
        "prev_cost",
        "acc_rate",
        "acc_len",
        "cost_per_token",
        "first",
        "acc_depth",
    )

    def __init__(self, spec: ObservationSpec):
        self.spec = spec
        self.hi = [float(x) for x in spec.high()]
        self.kmax = spec.kmax
        self.reset()

    def reset(self) -> None:
        self.prev_k = 0.0
        self.prev_acc = 0.0
        self.prev_U = 0.0
        self.prev_cost = 0.0
        self.acc_rate = PRIOR_RATE
        self.acc_len = 0.0
        self.cost_per_token = 1.0
        self.first = 1.0
        self.acc_depth = [PRIOR_RATE] * self.kmax

    def update(self, k: int, a: int, U_r: float, cost_units: float, committed: int) -> None:
        kf = float(k)
        af = float(a)
        self.prev_k = kf
        self.prev_acc = af
        self.prev_U = U_r
        self.prev_cost = cost_units
        self.first = 0.0
        w = 1 - EMA
        if k >= 1:
            self.acc_rate = EMA * self.acc_rate + w * (af / kf)
            self.acc_len = EMA * self.acc_len + w * (af / self.kmax)
        self.cost_per_token = EMA * self.cost_per_token + w * (cost_units / max(float(committed), 1.0))
        depth = self.acc_depth
        for j in range(min(k, a + 1)):  # depth j+1 reached: k >= j+1 and a >= j; success: a >= j+1
            depth[j] = EMA * depth[j] + w * (1.0 if a > j else 0.0)

    def build(self, L: float, t: int, conf: list[float] | None) -> np.ndarray:
        s = self.spec
        kmax = self.kmax
        hi = self.hi
        # Clipping to the Box in float64 before the float32 cast equals ObservationState's cast-then-clip
        # (the bounds 0, 1, 16, 64 are exact in float32 and rounding is monotone). Only these four
        # features can leave their range; the others stay in [0, 1] by construction.
        vals = [
            min(max(L / CONTEXT_SCALE, 0.0), hi[0]),
            min(t / s.max_new_tokens, 1.0),
            self.prev_k / kmax,
            self.prev_acc / kmax,
            min(max(self.prev_U / s.n_experts, 0.0), 1.0),
            min(max(self.prev_cost / (kmax + 1), 0.0), hi[5]),
            self.acc_rate,
            self.acc_len,
            min(max(self.cost_per_token, 0.0), hi[8]),
            self.first,
            *self.acc_depth,
        ]
        if conf is not None:
            vals.extend(conf)
        return np.array(vals, dtype=np.float32)


# --------------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------------
class MoESpecEnv(gym.Env[np.ndarray, np.int64]):
    """Replay of recorded generations; the agent picks the draft budget k of every round.

    One episode is one generation of the chosen split. At position t (tokens committed so far) the
    agent picks ``k`` in ``Discrete(kmax + 1)`` (0 = plain autoregressive step). The round then
    follows DESIGN section 1 exactly:

    * accepted drafts ``a`` are drawn with ``P(a >= i) = prod_{j<=i} rho_{t,j}`` by inverse
      transform of one uniform per round (``a = #{i <= k : u < P(a >= i)}``); the uniforms of an
      episode are drawn at reset as ``np_random.random(N)``, after the generation is picked with
      ``np_random.integers(G)``. Greedy traces (rho in {0, 1}) are deterministic;
    * the round commits ``a + 1`` tokens, ``t' = min(t + a + 1, N)``; at the very end the reported
      ``accepted`` is capped to ``t' - t - 1`` (nothing is accepted past the generation's end);
    * cost charged: ``C(t, k) = T_D(k) + T_T(k, U_{t,k}, L_t)`` from the cost model
      (:meth:`specenv.costmodel.CostModel.charged_table`). With ``lookahead = h > 0`` the draft
      proposes ``max(k, h)`` tokens (so the observation can show h confidences), and the draft term
      becomes ``T_D(max(k, h))``, also for k = 0; the target term is unchanged;
    * reward ``= -cost / ar_unit_ms``, where ``ar_unit_ms`` (attribute ``ar_unit_ms``) is the mean
      of the plain AR step cost ``C(t, 0)`` over all positions of the loaded split: a constant per
      environment, so the episode return is minus the episode's cost in AR-token equivalents;
    * ``terminated`` when t reaches N; ``truncated`` is always False (no time limit is registered;
      every round commits at least one token, so an episode has at most N rounds).

    Observation: the float32 vector of :mod:`specenv.observation` (layout and scaling documented
    there, built by the same arithmetic as :class:`specenv.observation.ObservationState`):
    ``prev_U`` is ``U_{t,k}`` of the executed round and ``prev_cost`` its cost in AR units; with
    lookahead the last h entries are the draft confidences ``q_{t,1..h}`` of the coming round.
    Nothing of the current round's rho or U, nor N, nor any later position reaches it.

    ``info`` of :meth:`reset`: ``generation_id``, ``category``. ``info`` of :meth:`step`:
    ``k``, ``accepted``, ``committed``, ``cost_ms`` (charged cost of the round), ``U_r`` (U_{t,k}),
    ``L`` (context length L_t the round verified at), ``t`` (tokens committed after the round),
    ``generation_id``, ``category``; on the terminating step also ``speedup`` (episode AR cost /
    episode cost), ``episode_cost_ms``, ``ar_cost_ms`` (sum_t C(t, 0)) and ``rounds``. No wall-clock
    time appears anywhere (the replay is deterministic given the seed).

    Split: generation ids are split 80/20 into train/test by :mod:`specenv.splits` (sha256 rank of
    the id; the same rule the oracle and the benchmark use).

    Args:
        dataset: Registry name (``"paper-default"``) or path of a trace-set folder.
        kmax: Largest budget; default the trace set's Kmax. Must be in 1..Kmax.
        split: ``"train"`` (default), ``"test"`` or ``"all"``.
        cost_model: ``"fit"`` (per-K fit on the set's rounds table, the default), ``"profile"``
            (the paper's coefficients) or a path to a cost-model JSON; see
            :func:`specenv.fit.cost_model_for`.
        lookahead: Number h of draft confidences in the observation (0..kmax, default 0).
        render_mode: None or ``"ansi"`` (:meth:`render` returns one line per round).

    Raises:
        ValueError: Naming the argument, for an unknown dataset or split, kmax outside 1..Kmax,
            lookahead outside 0..kmax, a bad cost model or render mode.
    """

    metadata = {"render_modes": list(RENDER_MODES), "render_fps": 4}

    def __init__(
        self,
        dataset: str = DEFAULT_DATASET,
        kmax: int | None = None,
        split: str = "train",
        cost_model: str = "fit",
        lookahead: int = 0,
        render_mode: str | None = None,
    ):
        if render_mode is not None and render_mode not in RENDER_MODES:
            raise ValueError(f"render_mode={render_mode!r}: expected None or one of {RENDER_MODES}")
        self.render_mode = render_mode
        self.data = replay_data(dataset, kmax, split, cost_model, lookahead)
        self.kmax = self.data.kmax
        self.lookahead = self.data.lookahead
        self.ar_unit_ms = self.data.ar_unit_ms
        self.action_space = spaces.Discrete(self.kmax + 1)
        self.observation_space = self.data.spec.space()
        self._obs = _ScalarObservation(self.data.spec)
        # scalar accessors into the shared tables (flat index; .item returns Python floats)
        self._width = self.kmax + 1
        self._surv = self.data.survival.item
        self._cost = self.data.cost.item
        self._Ur = self.data.U.item
        self._gen = -1
        self._t = 0
        self._N = 0
        self._done = True
        self._line = ""

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
        d = self.data
        gid = None
        if options:
            unknown = set(options) - {"generation_id"}
            if unknown:
                raise ValueError(f"options: unknown key(s) {sorted(unknown)} (supported: 'generation_id')")
            gid = options.get("generation_id")
        rng = self.np_random
        g = int(rng.integers(d.n_generations)) if gid is None else d.index_of(gid)
        self._gen = g
        self._gid = int(d.generation_ids[g])
        self._cat = str(d.categories[g])
        self._row0 = int(d.offsets[g])
        self._N = n = int(d.lengths[g])
        self._t = 0
        self._round = 0
        self._ep_cost = 0.0
        self._L0 = int(d.L0[g])
        self._u = rng.random(n).item  # the episode's acceptance uniforms, one per round
        self._done = False
        self._obs.reset()
        self._line = f"gen {self._gid} [{self._cat}] t=0"
        conf = d.conf[self._row0].tolist() if self.lookahead else None
        return self._obs.build(self._L0, 0, conf), {"generation_id": self._gid, "category": self._cat}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Execute one verification round with budget ``action`` (see the class docstring).

        Raises:
            ValueError: If ``action`` is not an integer in 0..kmax.
            RuntimeError: If called before :meth:`reset` or after the episode ended.
        """
        try:
            k = action.__index__()
        except (AttributeError, TypeError):
            raise ValueError(f"action={action!r}: must be an integer in 0..{self.kmax}") from None
        if not 0 <= k <= self.kmax:
            raise ValueError(f"action={k}: outside 0..{self.kmax}")
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset()")
        t = self._t
        row = self._row0 + t
        u = self._u(self._round)
        surv = self._surv
        j = row * self._width
        a = 0
        while a < k and u < surv(j + a):
            a += 1
        n_left = self._N - t
        committed = a + 1 if a < n_left else n_left
        a = committed - 1
        j = row * self._width + k
        cost = self._cost(j)
        U_r = self._Ur(j)
        units = cost / self.ar_unit_ms
        t_new = t + committed
        self._t = t_new
        self._round += 1
        self._ep_cost += cost
        obs_state = self._obs
        obs_state.update(k, a, U_r, units, committed)
        terminated = t_new >= self._N
        info = {
            "k": k,
            "accepted": a,
            "committed": committed,
            "cost_ms": cost,
            "U_r": U_r,
            "L": self._L0 + t,
            "t": t_new,
            "generation_id": self._gid,
            "category": self._cat,
        }
        if terminated:
            self._done = True
            ar = float(self.data.ar_total_ms[self._gen])
            info["speedup"] = ar / self._ep_cost
            info["episode_cost_ms"] = self._ep_cost
            info["ar_cost_ms"] = ar
            info["rounds"] = self._round
            conf = [0.0] * self.lookahead if self.lookahead else None
        else:
            conf = self.data.conf[row + committed].tolist() if self.lookahead else None
        if self.render_mode == "ansi":
            self._line = (
                f"gen {self._gid} [{self._cat}] round {self._round - 1}: t={t} k={k} accepted={a} "
                f"+{committed} cost={cost:.3f}ms U_r={U_r:.2f}" + (" (done)" if terminated else "")
            )
        return obs_state.build(self._L0 + t_new, t_new, conf), -units, terminated, False, info

    def render(self) -> str | None:
        """The last round as one line of text (``render_mode="ansi"``); None otherwise."""
        if self.render_mode is None:
            gym.logger.warn(
                "You are calling render method without specifying any render mode. "
                f'Create the environment with render_mode="ansi", e.g. gym.make("{ENV_ID}", render_mode="ansi")'
            )
            return None
        return self._line
