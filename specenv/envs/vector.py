"""Native vector form of the replay environment: many generations stepped at once in numpy.

``gymnasium.make_vec("specenv/MoESpec-v0", num_envs=256, ...)`` returns :class:`MoESpecVectorEnv`
(registered as the id's ``vector_entry_point``). Sub-environment i behaves exactly like a
:class:`specenv.envs.replay.MoESpecEnv` reset with ``seed + i``: each sub-environment owns a
``numpy.random.Generator`` created the way ``gymnasium.Env.reset(seed=seed + i)`` creates one, and
draws from it in the same order (the generation with ``integers(G)``, then the episode's ``N``
acceptance uniforms with ``random(N)``), so trajectories match the single environment bit for bit
for the same seeds and actions, across autoresets too. Random draws happen only at (auto)reset; the
step itself is pure array arithmetic on the shared :class:`specenv.replay.ReplayData` tables.

Autoreset follows gymnasium's ``AutoresetMode.NEXT_STEP``: the step after a sub-environment
terminates resets it (its action is ignored, reward 0, terminated False) and returns the first
observation of the new episode. ``reset(options={"reset_mask": mask})`` resets only the masked
sub-environments now (used by the SB3 adapter for same-step autoreset).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import logger, spaces
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from specenv.datasets import DEFAULT_DATASET
from specenv.envs.replay import ENV_ID, RENDER_MODES
from specenv.observation import CONTEXT_SCALE, EMA, PRIOR_RATE, ObservationSpec, ObservationState
from specenv.replay import replay_data

_STEP_KEYS = ("k", "accepted", "committed", "cost_ms", "U_r", "L", "t")
_END_KEYS = ("speedup", "episode_cost_ms", "ar_cost_ms", "rounds")


class _BatchObservationState(ObservationState):
    """:class:`ObservationState` laid out for speed; same features, same arithmetic.

    The statistics live in three blocks whose columns are views exposed under the base class's
    attribute names: ``P = [prev_k, prev_acc, prev_U, prev_cost]``, ``E = [acc_rate, acc_len,
    acc_depth_1..kmax]`` and the vectors ``cost_per_token`` and ``first``. Every statistic in ``E``
    is an EMA gated by the round's (k, accepted) only, so one update is ``E = E * M[k, a] + A[k, a]``
    with tables precomputed per (k, a): ``M = EMA, A = (1 - EMA) * x`` where the base class updates
    (x = a/k, a/kmax or the depth's 0/1 success, computed by the same float operations) and
    ``M = 1, A = 0`` where it does not (``x * 1.0 + 0.0 == x`` exactly). Observations are therefore
    bit identical to the base class's (tests compare the two on random rounds, with and without
    masks), at a fraction of the numpy calls. Rounds must satisfy 0 <= accepted <= k <= kmax.
    """

    def __init__(self, spec: ObservationSpec, n: int = 1):
        super().__init__(spec, n)
        km = spec.kmax
        self._P = np.zeros((n, 4))
        self._E = np.empty((n, 2 + km))
        self._E_init = np.array([PRIOR_RATE, 0.0] + [PRIOR_RATE] * km)
        self._E[:] = self._E_init
        self.prev_k, self.prev_acc, self.prev_U, self.prev_cost = (self._P[:, i] for i in range(4))
        self.acc_rate = self._E[:, 0]
        self.acc_len = self._E[:, 1]
        self.acc_depth = self._E[:, 2:]
        self._scale = np.array([km, km, spec.n_experts, km + 1], dtype=np.float64)
        self._hi_row = self._hi[None, :]
        self._K = km + 1
        w = 1 - EMA
        M = np.ones((self._K * self._K, 2 + km))
        A = np.zeros((self._K * self._K, 2 + km))
        for k in range(self._K):
            for a in range(k + 1):
                row = k * self._K + a
                if k >= 1:
                    M[row, 0:2] = EMA
                    A[row, 0] = w * (float(a) / float(k))
                    A[row, 1] = w * (float(a) / km)
                for j in range(1, km + 1):
                    if k >= j and a >= j - 1:
                        M[row, 1 + j] = EMA
                        A[row, 1 + j] = w * (1.0 if a >= j else 0.0)
        self._M, self._A = M, A

    def reset(self, mask: np.ndarray | None = None) -> None:  # noqa: D102
        m = slice(None) if mask is None else np.asarray(mask, dtype=bool)
        self._P[m] = 0.0
        self._E[m] = self._E_init
        self.cost_per_token[m] = 1.0
        self.first[m] = 1.0

    def update(self, k, accepted, U_r, cost_units, committed, mask=None) -> None:  # noqa: ANN001, D102
        if mask is not None:  # update everything, then restore the streams not selected
            keep = ~np.asarray(mask, dtype=bool)
            saved = (self._P[keep], self._E[keep], self.cost_per_token[keep], self.first[keep])
            self.update(k, accepted, U_r, cost_units, committed)
            self._P[keep], self._E[keep], self.cost_per_token[keep], self.first[keep] = saved
            return
        k = np.asarray(k)
        accepted = np.asarray(accepted)
        idx = k.astype(np.intp) * self._K + accepted.astype(np.intp)
        E = self._E
        E *= self._M.take(idx, axis=0)
        E += self._A.take(idx, axis=0)
        cost_units = np.asarray(cost_units, dtype=np.float64)
        cpt = cost_units / np.maximum(np.asarray(committed, dtype=np.float64), 1.0)
        self.cost_per_token *= EMA
        self.cost_per_token += (1 - EMA) * cpt
        P = self._P
        P[:, 0] = k
        P[:, 1] = accepted
        P[:, 2] = U_r
        P[:, 3] = cost_units
        self.first[:] = 0.0

    def build(self, L: np.ndarray, t: np.ndarray, conf: np.ndarray | None = None) -> np.ndarray:  # noqa: D102
        s = self.spec
        km = s.kmax
        E = self._E
        obs = np.empty((self.n, s.dim), dtype=np.float32)
        obs[:, 0] = np.asarray(L, dtype=np.float64) / CONTEXT_SCALE
        obs[:, 1] = np.minimum(np.asarray(t, dtype=np.float64) / s.max_new_tokens, 1.0)
        obs[:, 2:6] = self._P / self._scale
        obs[:, 6:8] = E[:, :2]
        obs[:, 8] = self.cost_per_token
        obs[:, 9] = self.first
        obs[:, 10 : 10 + km] = E[:, 2:]
        if s.lookahead:
            if conf is None:
                raise ValueError("conf is required when lookahead > 0")
            obs[:, 10 + km :] = conf
        np.minimum(obs, self._hi_row, out=obs)  # == np.clip(obs, 0, hi): no NaN can occur
        np.maximum(obs, 0.0, out=obs)
        return obs


class MoESpecVectorEnv(VectorEnv):
    """``num_envs`` independent replays of :class:`specenv.envs.replay.MoESpecEnv`, vectorised in numpy.

    Dynamics, reward, observation and split are those of :class:`specenv.envs.replay.MoESpecEnv` (see its
    docstring); the observation is built by a subclass of :class:`specenv.observation.ObservationState`
    that lays the statistics out in blocks (bit-identical output, fewer numpy calls per step).

    ``info`` follows gymnasium's vector convention (an array per key plus a boolean ``"_key"``
    mask): every step carries ``k``, ``accepted``, ``committed``, ``cost_ms``, ``U_r``, ``L``, ``t``
    (masked off, and meaningless, for sub-environments being autoreset), ``generation_id`` and ``category`` (of the
    episode in progress, or of the new one after an autoreset); ``speedup``, ``episode_cost_ms``,
    ``ar_cost_ms`` and ``rounds`` are set where ``terminated``.

    Args:
        num_envs: Number of sub-environments.
        dataset, kmax, split, cost_model, lookahead, render_mode: As for
            :class:`specenv.envs.replay.MoESpecEnv`. ``render_mode="ansi"`` makes :meth:`render` return one
            line per sub-environment (its last round).

    Raises:
        ValueError: Naming the argument, as for the single environment, or ``num_envs`` < 1.
    """

    metadata = {"render_modes": list(RENDER_MODES), "render_fps": 4, "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int = 1,
        dataset: str = DEFAULT_DATASET,
        kmax: int | None = None,
        split: str = "train",
        cost_model: str = "fit",
        lookahead: int = 0,
        render_mode: str | None = None,
    ):
        if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
            raise ValueError(f"num_envs={num_envs!r}: must be an integer >= 1")
        if render_mode is not None and render_mode not in RENDER_MODES:
            raise ValueError(f"render_mode={render_mode!r}: expected None or one of {RENDER_MODES}")
        self.num_envs = n = int(num_envs)
        self.render_mode = render_mode
        self.data = d = replay_data(dataset, kmax, split, cost_model, lookahead)
        self.kmax = d.kmax
        self.lookahead = d.lookahead
        self.ar_unit_ms = d.ar_unit_ms
        self.single_action_space = spaces.Discrete(d.kmax + 1)
        self.action_space = batch_space(self.single_action_space, n)
        self.single_observation_space = d.spec.space()
        self.observation_space = batch_space(self.single_observation_space, n)

        self._rngs: list[np.random.Generator] | None = None
        self._obs_state = _BatchObservationState(d.spec, n)
        self._ar = np.arange(n)
        self._width = d.kmax + 1
        self._offsets = d.offsets.tolist()
        self._lengths = d.lengths.tolist()
        self._L0s = d.L0.tolist()
        self._cost_flat = d.cost.ravel()
        self._U_flat = d.U.ravel()
        self._gen = np.zeros(n, dtype=np.int64)
        self._row0 = np.zeros(n, dtype=np.int64)
        self._N = np.ones(n, dtype=np.int64)
        self._L0 = np.zeros(n, dtype=np.int64)
        self._t = np.zeros(n, dtype=np.int64)
        self._round = np.zeros(n, dtype=np.int64)
        self._ep_cost = np.zeros(n, dtype=np.float64)
        self._u = np.zeros((n, d.max_len + 1), dtype=np.float64)
        self._u_flat = self._u.reshape(-1)
        self._u_stride = d.max_len + 1
        self._u_base = self._ar * self._u_stride
        self._prev_done = np.zeros(n, dtype=bool)
        self._started = False
        self._lines = [""] * n
        self._all = np.ones(n, dtype=bool)
        self._all.flags.writeable = False

    # ------------------------------------------------------------------ helpers
    def _start(self, i: int, gid: Any = None) -> None:
        """Begin a new episode in sub-environment i, drawing from its generator like Env.reset."""
        d = self.data
        rng = self._rngs[i]
        g = int(rng.integers(d.n_generations)) if gid is None else d.index_of(gid)
        n = self._lengths[g]
        self._gen[i] = g
        self._row0[i] = self._offsets[g]
        self._N[i] = n
        self._L0[i] = self._L0s[g]
        self._t[i] = 0
        self._round[i] = 0
        self._ep_cost[i] = 0.0
        rng.random(out=self._u[i, :n])  # the same numbers as Env.reset's rng.random(n)
        if self.render_mode == "ansi":
            self._lines[i] = f"gen {int(d.generation_ids[g])} [{d.categories[g]}] t=0"

    def _conf(self) -> np.ndarray | None:
        """Draft confidences q_{t,1..h} at every sub-environment's current position (0 when done)."""
        if not self.lookahead:
            return None
        t = self._t
        live = t < self._N
        rows = self._row0 + np.minimum(t, self._N - 1)
        conf = self.data.conf.take(rows, axis=0)
        if not live.all():
            conf[~live] = 0.0
        return conf

    def _reset_info(self, mask: np.ndarray) -> dict[str, Any]:
        d = self.data
        return {
            "generation_id": d.generation_ids[self._gen],
            "_generation_id": mask.copy(),
            "category": d.categories[self._gen],
            "_category": mask.copy(),
        }

    # ------------------------------------------------------------------ API
    def reset(
        self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset all sub-environments (or those in ``options["reset_mask"]``).

        Args:
            seed: An int (sub-environment i gets ``seed + i``), a sequence of ``num_envs`` ints or
                Nones, or None (keep each sub-environment's generator; fresh entropy on first use).
            options: ``"generation_id"``: an id, or a sequence of ``num_envs`` ids (None = random),
                to replay; ``"reset_mask"``: boolean array of the sub-environments to reset.

        Raises:
            ValueError: For a bad seed sequence, mask, unknown option key or generation id.
        """
        int_seed = seed if seed is None or isinstance(seed, (int, np.integer)) else None
        super().reset(seed=int_seed)
        n = self.num_envs
        options = dict(options or {})
        unknown = set(options) - {"generation_id", "reset_mask"}
        if unknown:
            raise ValueError(f"options: unknown key(s) {sorted(unknown)} (supported: 'generation_id', 'reset_mask')")
        mask = options.get("reset_mask")
        if mask is None:
            mask = np.ones(n, dtype=bool)
        else:
            mask = np.asarray(mask)
            if mask.shape != (n,) or mask.dtype != np.bool_:
                raise ValueError(f"options['reset_mask']: expected a boolean array of shape ({n},)")
        if seed is None:
            seeds: list[int | None] = [None] * n
        elif isinstance(seed, (int, np.integer)):
            seeds = [int(seed) + i for i in range(n)]
        else:
            seeds = list(seed)
            if len(seeds) != n:
                raise ValueError(f"seed: a sequence needs num_envs={n} entries, got {len(seeds)}")
        if self._rngs is None:
            self._rngs = [seeding.np_random(s)[0] for s in seeds]
        else:
            for i in np.flatnonzero(mask):
                if seeds[i] is not None:
                    self._rngs[i] = seeding.np_random(seeds[i])[0]
        gids = options.get("generation_id")
        if gids is None or isinstance(gids, (int, np.integer)):
            gids = [gids] * n
        elif len(gids) != n:
            raise ValueError(f"options['generation_id']: a sequence needs num_envs={n} entries")
        if not self._started and not mask.all():
            raise ValueError("options['reset_mask']: the first reset must reset every sub-environment")
        for i in np.flatnonzero(mask):
            self._start(int(i), gids[i])
        self._started = True
        self._obs_state.reset(mask)
        self._prev_done[mask] = False
        obs = self._obs_state.build(self._L0 + self._t, self._t, self._conf())
        return obs, self._reset_info(mask)

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Execute one round in every sub-environment (autoresetting those that ended last step).

        Args:
            actions: (num_envs,) integer budgets in 0..kmax.

        Raises:
            ValueError: If ``actions`` has the wrong shape, is not integer, or is out of range.
            RuntimeError: If called before :meth:`reset`.
        """
        if not self._started:
            raise RuntimeError("step() called before reset()")
        k = np.asarray(actions)
        n = self.num_envs
        if k.shape != (n,) or k.dtype.kind not in "iu":
            raise ValueError(f"actions: expected an integer array of shape ({n},), got {k.dtype} {k.shape}")
        k = k.astype(np.int64)  # a copy: info["k"] is returned
        if k.view(np.uint64).max() > self.kmax:  # negative values wrap to huge unsigned ones
            raise ValueError(f"actions: out of range 0..{self.kmax} ({k.min()}..{k.max()})")
        d = self.data
        done_prev = self._prev_done
        any_reset = bool(done_prev.any())
        N = self._N
        t = np.minimum(self._t, N - 1) if any_reset else self._t
        rows = self._row0 + t
        u = self._u_flat.take(self._u_base + self._round)
        # a = number of leading j with u < P(a >= j); the survival table ends with a 0 column
        a = (d.survival.take(rows, axis=0) > u[:, None]).argmin(axis=1)
        np.minimum(a, k, out=a)
        committed = np.minimum(a + 1, N - t)
        a = committed - 1
        idx = rows * self._width + k
        cost = self._cost_flat.take(idx)
        U_r = self._U_flat.take(idx)
        units = cost / self.ar_unit_ms
        t_new = t + committed
        terminated = t_new >= N
        self._t = t_new
        self._round += 1
        self._ep_cost += cost
        self._obs_state.update(k, a, U_r, units, committed)
        reward = -units
        L = self._L0 + t
        info: dict[str, Any] = {
            "k": k,
            "accepted": a,
            "committed": committed,
            "cost_ms": cost,
            "U_r": U_r,
            "L": L,
            "t": t_new,
        }
        step_mask = self._all
        if any_reset:
            step_mask = ~done_prev
            for i in np.flatnonzero(done_prev).tolist():
                self._start(i)
            self._obs_state.reset(done_prev)
            reward[done_prev] = 0.0
            terminated[done_prev] = False
        for key in _STEP_KEYS:
            info["_" + key] = step_mask
        gen = self._gen
        info["generation_id"] = d.generation_ids.take(gen)
        info["_generation_id"] = self._all
        info["category"] = d.categories.take(gen)
        info["_category"] = self._all
        if terminated.any():
            ep = self._ep_cost
            ar = d.ar_total_ms.take(gen)
            info["speedup"] = np.divide(ar, ep, out=np.zeros(n), where=terminated)
            info["episode_cost_ms"] = np.where(terminated, ep, 0.0)
            info["ar_cost_ms"] = np.where(terminated, ar, 0.0)
            info["rounds"] = np.where(terminated, self._round, 0)
            for key in _END_KEYS:
                info["_" + key] = terminated
        if self.render_mode == "ansi":
            self._render_lines(k, a, committed, cost, U_r, t, terminated, step_mask)
        self._prev_done = terminated
        obs = self._obs_state.build(self._L0 + self._t, self._t, self._conf())
        return obs, reward, terminated, np.zeros(n, dtype=bool), info

    def _render_lines(self, k, a, committed, cost, U_r, t, terminated, step_mask) -> None:  # noqa: ANN001
        d = self.data
        for i in np.flatnonzero(step_mask):
            self._lines[i] = (
                f"gen {int(d.generation_ids[self._gen[i]])} [{d.categories[self._gen[i]]}] round "
                f"{int(self._round[i]) - 1}: t={int(t[i])} k={int(k[i])} accepted={int(a[i])} +{int(committed[i])} "
                f"cost={float(cost[i]):.3f}ms U_r={float(U_r[i]):.2f}" + (" (done)" if terminated[i] else "")
            )

    def render(self) -> tuple[str, ...] | None:
        """The last round of every sub-environment as one line of text each (``render_mode="ansi"``)."""
        if self.render_mode is None:
            logger.warn(f'render_mode is None; create with gym.make_vec("{ENV_ID}", render_mode="ansi")')
            return None
        return tuple(self._lines)
