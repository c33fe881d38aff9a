"""Native vector form of the replay environment: many generations stepped at once in numpy.

``gymnasium.make_vec("specenv/MoESpec-v1", num_envs=256, ...)`` returns :class:`MoESpecVectorEnv`
(registered as the id's ``vector_entry_point``). Sub-environment i behaves exactly like a
:class:`specenv.envs.replay.MoESpecEnv` reset with ``seed + i``: each sub-environment owns a
``numpy.random.Generator`` created the way ``gymnasium.Env.reset(seed=seed + i)`` creates one, and
draws from it in the same order (the generation with ``integers(G)``, then the episode's ``N``
acceptance uniforms with ``random(N)``), so trajectories match the single environment bit for bit
for the same seeds and actions, across autoresets too. Random draws happen only at (auto)reset; the
step itself is pure array arithmetic on the shared :class:`specenv.replay.tables.ReplayData` tables:
a fixed sequence of whole-array numpy operations (no loop over sub-environments but the per-episode
draws of those being reset), into preallocated work buffers where numpy allows it; the arrays a step
returns are new ones. With numba installed (a dependency) the env runs the same arithmetic as two
compiled loops over the sub-environments instead (:mod:`specenv.envs.vector_kernel`: the rounds with
their statistics, then the observations; compiled or loaded from numba's disk cache when the env is
built): the same bits, tested against the numpy path, which stays the reference and the fallback
(``SPECENV_NUMBA=0``). Where the tables keep every feature in range
(:attr:`specenv.replay.tables.ReplayData.within_box`) the observation is not clipped (the same vectors).

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

from specenv.envs.common import DEFAULT_REWARD, check_reward
from specenv.envs.render import RENDER_MODES, RoundStrip, check_render_mode
from specenv.envs.replay import ENV_ID
from specenv.envs.vector_kernel import charge_table, kernels
from specenv.observation.single import ObservationState
from specenv.replay.episode import draw, settle
from specenv.replay.tables import replay_data
from specenv.traces.datasets import DEFAULT_DATASET

_STEP_KEYS = ("k", "accepted", "committed", "cost_ms", "U_r", "L", "t")
_END_KEYS = ("speedup", "episode_cost_ms", "ar_cost_ms", "rounds")
_STEP_MASKS = tuple("_" + key for key in _STEP_KEYS)
_END_MASKS = tuple("_" + key for key in _END_KEYS)


#: Most sub-environments of one vector env: checked before anything is allocated (each costs a few
#: hundred bytes of buffers per step; 2**20 of them is ~0.5 GB, far beyond what a learner batches).
NUM_ENVS_MAX = 1 << 20


class MoESpecVectorEnv(VectorEnv):
    """``num_envs`` independent replays of :class:`specenv.envs.replay.MoESpecEnv`, vectorised in numpy.

    ## Description

    The replay environment's rounds (:class:`specenv.envs.replay.MoESpecEnv`: draft budget k,
    accepted drafts drawn from the recorded acceptance, cost from the cost model) for
    ``num_envs`` generations at once, as array arithmetic on the shared replay tables.
    Sub-environment i behaves exactly like a single environment reset with ``seed + i``: same
    generations, same acceptance draws, same floats, across autoresets too (the module docstring
    says how). The observation is built by :class:`specenv.observation.single.ObservationState` (one stream per
    sub-environment; bit-identical to the single environment's scalar path).

    ## Action Space

    ``MultiDiscrete([kmax + 1] * num_envs)``: one budget k per sub-environment
    (``single_action_space`` is the single environment's ``Discrete(kmax + 1)``).

    ## Observation Space

    ``Box(0, high, (num_envs, 10 + kmax + lookahead), float32)``: row i is sub-environment i's
    observation, with the features, meanings and ranges of the table in
    :class:`specenv.envs.replay.MoESpecEnv` (``single_observation_space``; names in order:
    :attr:`specenv.observation.single.ObservationSpec.names`).

    ## Rewards

    ``(num_envs,)`` float64, per sub-environment as in the single environment:
    ``reward="savings"`` (default) gives ``committed - cost / ar_unit_ms``, ``reward="cost"`` (the
    default of ``specenv/MoESpec-v0``) gives ``-cost / ar_unit_ms``. The two episode returns differ
    by the generation's length N, a constant, so they have the same optimal policy (see Rewards in
    :class:`specenv.envs.replay.MoESpecEnv`). A step that autoresets a sub-environment gives it 0.

    ## Starting State

    :meth:`reset` starts every sub-environment (or those in ``options["reset_mask"]``) on a
    generation picked by its own generator (or ``options["generation_id"]``), t = 0.

    ## Episode End

    * Termination: a sub-environment's generation is fully committed (``terminated[i]``).
    * Truncation: never.

    Autoreset follows gymnasium's ``AutoresetMode.NEXT_STEP``: the step after a sub-environment
    terminates resets it (its action is ignored, reward 0, terminated False) and returns the first
    observation of the new episode.

    ``info`` follows gymnasium's vector convention (an array per key plus a boolean ``"_key"``
    mask): every step carries ``k``, ``accepted``, ``committed``, ``cost_ms``, ``U_r``, ``L``, ``t``
    (masked off, and meaningless, for sub-environments being autoreset), ``generation_id`` and
    ``category`` (of the episode in progress, or of the new one after an autoreset); ``speedup``,
    ``episode_cost_ms``, ``ar_cost_ms`` and ``rounds`` are set where ``terminated``.

    ## Arguments

    ```python
    gymnasium.make_vec("specenv/MoESpec-v1", num_envs=256, dataset="paper-default", kmax=None,
                       split="train", cost_model="fit", lookahead=None, render_mode=None, reward="savings",
                       drafting=None, signals=("q",))
    ```

    Args:
        num_envs: Number of sub-environments.
        dataset: As for :class:`specenv.envs.replay.MoESpecEnv`.
        kmax: As for the single environment.
        split: As for the single environment.
        cost_model: As for the single environment.
        lookahead: As for the single environment.
        render_mode: None, ``"ansi"`` (:meth:`render` returns one line per sub-environment, its
            last round) or ``"rgb_array"`` (one ``(64, 128, 3)`` uint8 image per sub-environment).
        reward: ``"savings"`` (default) or ``"cost"``.
        drafting: As for the single environment (``"none"``, ``"block"`` or ``"sequential"``).
        signals: As for the single environment.

    Raises:
        ValueError: Naming the argument, as for the single environment, or ``num_envs`` outside
            1..:data:`NUM_ENVS_MAX`.

    ## Version History

    * observation contract 2 (both ids; :data:`specenv.observation.single.OBSERVATION_VERSION`): ``prev_cost``
      and ``cost_per_token`` in AR steps at the round's own context; optional ``signals``. The contract
      has its own version, recorded in every exported policy and checked when it loads.
    * v1: the default reward is ``"savings"`` (was ``"cost"``; same optimum). ``specenv/MoESpec-v0``
      stays registered with ``reward="cost"``, for ``make_vec`` too.
    * v0: initial version (bit-identical to ``num_envs`` single environments; ``reward`` and
      ``render_mode="rgb_array"`` and ``drafting`` added with unchanged defaults).

    Examples:
        >>> import gymnasium as gym
        >>> import numpy as np
        >>> import specenv
        >>> envs = gym.make_vec("specenv/MoESpec-v1", num_envs=8, dataset="paper-default", split="test")
        >>> envs.single_action_space, envs.observation_space.shape
        (Discrete(11), (8, 20))
        >>> obs, info = envs.reset(seed=0)
        >>> obs, rewards, terminated, truncated, info = envs.step(np.full(8, 4))
        >>> units = info["cost_ms"] / envs.unwrapped.ar_unit_ms
        >>> rewards.shape, bool((rewards == info["committed"] - units).all()), bool(truncated.any())
        ((8,), True, False)
        >>> sorted(k for k in info if not k.startswith("_"))
        ['L', 'U_r', 'accepted', 'category', 'committed', 'cost_ms', 'generation_id', 'k', 't']
        >>> envs.close()
    """

    metadata = {"render_modes": list(RENDER_MODES), "render_fps": 4, "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int = 1,
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
        if (
            isinstance(num_envs, bool)
            or not isinstance(num_envs, (int, np.integer))
            or not 1 <= num_envs <= NUM_ENVS_MAX
        ):
            raise ValueError(f"num_envs={num_envs!r}: must be an integer in 1..{NUM_ENVS_MAX}")
        self.render_mode = check_render_mode(render_mode)
        self._savings = check_reward(reward)
        self.reward = reward
        self.num_envs = n = int(num_envs)
        self.data = d = replay_data(dataset, kmax, split, cost_model, lookahead, drafting, signals)
        self.kmax = d.kmax
        self.lookahead = d.lookahead
        self.drafting = d.drafting
        self.ar_unit_ms = d.ar_unit_ms
        self.single_action_space = spaces.Discrete(d.kmax + 1)
        self.action_space = batch_space(self.single_action_space, n)
        self.single_observation_space = d.spec.space()
        self.observation_space = batch_space(self.single_observation_space, n)

        self._rngs: list[np.random.Generator] | None = None
        self._obs_state = ObservationState(d.spec, n)
        self._obs_state.clip = not d.within_box  # the same vectors, without the clip when in range
        self._ar = np.arange(n)
        self._width = d.kmax + 1
        self._offsets = d.offsets.tolist()
        self._lengths = d.lengths.tolist()
        self._L0s = d.L0.tolist()
        # flat (row, k) lookups of the charged cost and U, and the AR step at a row's context
        self._cost_take = d.cost.ravel().take
        self._U_take = d.U.ravel().take
        self._ctx_take = d.ar_ctx_ms.take
        self._gen = np.zeros(n, dtype=np.int64)
        self._row0 = np.zeros(n, dtype=np.int64)
        self._N = np.ones(n, dtype=np.int64)
        self._L0 = np.zeros(n, dtype=np.int64)
        self._t = np.zeros(n, dtype=np.int64)
        self._ep_cost = np.zeros(n, dtype=np.float64)
        self._u = np.zeros((n, d.max_len + 1), dtype=np.float64)
        self._u_flat = self._u.reshape(-1)
        self._u_stride = d.max_len + 1
        self._u_base = self._ar * self._u_stride
        self._u_pos = self._u_base.copy()  # flat index of the next uniform: u_base + rounds played
        self._N1 = self._N - 1
        self._unit = float(d.ar_unit_ms)
        self._surv_take = d.survival.take
        # work buffers of a step (the arrays a step returns are new ones)
        self._rows = np.zeros(n, dtype=np.int64)
        self._ctx = np.zeros(n, dtype=np.int64)
        self._lead = np.empty((n, d.survival.shape[1]), dtype=bool)
        self._prev_done = np.zeros(n, dtype=bool)
        self._any_done = False
        self._started = False
        self._lines = [""] * n
        self._strip = RoundStrip(d.kmax, n) if render_mode == "rgb_array" else None
        self._all = np.ones(n, dtype=bool)
        self._all.flags.writeable = False
        self._none = np.zeros(n, dtype=bool)
        self._none.flags.writeable = False
        # the compiled form of the step (specenv.envs.vector_kernel) when numba is there: the same floats
        self._kernels = kernels()
        if self._kernels is not None:
            self._tables = (
                np.ascontiguousarray(d.survival),
                charge_table(d),
                d.ar_total_ms,
                np.ascontiguousarray(d.conf),
            )
            self._kview = self._obs_state.kernel_view()
            self._compile()

    def _compile(self) -> None:
        """Compile (or load from numba's on-disk cache) both kernels now, on empty slices of this env's arrays."""
        e = slice(0, 0)
        ints, floats, flags = np.empty((5, 0), dtype=np.int64), np.empty((6, 0)), np.empty((2, 0), dtype=bool)
        self._kernels[0](*self._round_args(self._t[e], e), ints, floats, flags)
        self._kernels[1](*self._build_args(np.empty((0, self._obs_state.spec.dim), dtype=np.float32), self._none, e))

    def _round_args(self, k: np.ndarray, e: slice) -> tuple[Any, ...]:
        """The inputs of :func:`specenv.envs.vector_kernel.round_and_update` (the sub-environments ``e``)."""
        v = self._kview
        surv, charge, ar_total, _ = self._tables
        return (
            k, self._t[e], self._row0[e], self._N[e], self._L0[e], self._u_flat, self._u_pos[e], self._u_base[e],
            self._ep_cost[e], self._gen[e], self._prev_done[e], surv, charge, ar_total, self._unit,
            self._savings, v.P[e], v.E[e], v.M, v.A, v.K, v.w,
        )  # fmt: skip

    def _build_args(self, obs: np.ndarray, reset: np.ndarray, e: slice) -> tuple[Any, ...]:
        """The inputs of :func:`specenv.envs.vector_kernel.build` (the sub-environments ``e``)."""
        v = self._kview
        return (
            obs, self._L0[e], self._t[e], self._row0[e], self._N[e], v.P[e], v.E[e], v.E_init, reset[e], v.scale,
            v.ctx_scale, v.mnt, v.cols, self._tables[3], bool(self._obs_state.clip), v.hi,
        )  # fmt: skip

    # ------------------------------------------------------------------ helpers
    def _start(self, i: int, gid: Any = None) -> None:
        """Begin a new episode in sub-environment i, drawing from its generator like Env.reset."""
        d = self.data
        # the episode's uniforms, drawn as the single environment's, straight into its row
        g, _ = draw(self._rngs[i], d.lengths, None if gid is None else d.index_of(gid), out=self._u[i])
        n = self._lengths[g]
        self._gen[i] = g
        self._row0[i] = self._offsets[g]
        self._N[i] = n
        self._L0[i] = self._L0s[g]
        self._t[i] = 0
        self._N1[i] = n - 1
        self._u_pos[i] = self._u_base[i]
        self._ep_cost[i] = 0.0
        if self.render_mode == "ansi":
            self._lines[i] = f"gen {int(d.generation_ids[g])} [{d.categories[g]}] t=0"
        elif self._strip is not None:
            self._strip.k[i] = -1
            self._strip.accepted[i] = -1

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
        mask, gids = self._reset_options(options)
        self._seed_generators(self._seeds(seed), mask)
        for i in np.flatnonzero(mask):
            self._start(int(i), gids[i])
        self._started = True
        self._obs_state.reset(mask)
        self._prev_done[mask] = False
        self._any_done = bool(self._prev_done.any())
        return self._observe(), self._reset_info(mask)

    def _reset_options(self, options: dict[str, Any] | None) -> tuple[np.ndarray, list[Any]]:
        """Validate ``reset``'s options: the (num_envs,) mask to reset and one generation id (or None) each."""
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
        gids = options.get("generation_id")
        if gids is None or isinstance(gids, (int, np.integer)):
            gids = [gids] * n
        elif len(gids) != n:
            raise ValueError(f"options['generation_id']: a sequence needs num_envs={n} entries")
        if not self._started and not mask.all():
            raise ValueError("options['reset_mask']: the first reset must reset every sub-environment")
        return mask, gids

    def _seeds(self, seed: int | Sequence[int | None] | None) -> list[int | None]:
        """One seed (or None) per sub-environment: ``seed + i`` for an int seed."""
        n = self.num_envs
        if seed is None:
            return [None] * n
        if isinstance(seed, (int, np.integer)):
            return [int(seed) + i for i in range(n)]
        seeds = list(seed)
        if len(seeds) != n:
            raise ValueError(f"seed: a sequence needs num_envs={n} entries, got {len(seeds)}")
        return seeds

    def _seed_generators(self, seeds: list[int | None], mask: np.ndarray) -> None:
        """Create every generator on first use; later, reseed the masked ones that got a seed."""
        if self._rngs is None:
            self._rngs = [seeding.np_random(s)[0] for s in seeds]
            return
        for i in np.flatnonzero(mask):
            if seeds[i] is not None:
                self._rngs[i] = seeding.np_random(seeds[i])[0]

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
        if self._kernels is not None:
            return self._step_compiled(actions)
        k = self._check_actions(actions)
        done_prev = self._prev_done
        any_reset = self._any_done
        N = self._N
        t = np.minimum(self._t, self._N1) if any_reset else self._t
        rows = np.add(self._row0, t, out=self._rows)
        u = self._u_flat.take(self._u_pos)
        # a = number of leading j <= k with u < P(a >= j) (the survival table ends with a 0 column)
        np.greater(self._surv_take(rows, axis=0), u[:, None], out=self._lead)
        a = self._lead.argmin(axis=1)
        np.minimum(a, k, out=a)
        # the charge/commit rule of the single environment's rounds, on arrays (specenv.replay.episode.settle)
        r = settle(k, t, a, N, rows, self._width, self._cost_take, self._U_take, self._ctx_take, self._unit, np.minimum)
        a, committed, cost, U_r, t_new, terminated = r.accepted, r.committed, r.cost_ms, r.U_r, r.t_next, r.terminated
        self._t = t_new
        self._u_pos += 1
        self._ep_cost += cost
        self._obs_state.update(k, a, U_r, r.ctx_units, committed)
        # committed - units, as the single environment computes it (== -units + committed exactly)
        reward = np.subtract(committed, r.units) if self._savings else np.negative(r.units)
        info: dict[str, Any] = {
            "k": k,
            "accepted": a,
            "committed": committed,
            "cost_ms": cost,
            "U_r": U_r,
            "L": self._L0 + t,
            "t": t_new,  # self._t: an autoreset below sets its entry to 0
        }
        step_mask = self._all
        if any_reset:  # NEXT_STEP autoreset: these sub-environments start a new episode instead
            step_mask = ~done_prev
            for i in done_prev.nonzero()[0].tolist():
                self._start(i)
            self._obs_state.reset(done_prev)
            reward[done_prev] = 0.0
            terminated[done_prev] = False
        any_done = bool(terminated.any())
        self._complete_info(info, step_mask, terminated, any_done)
        if self.render_mode == "ansi":
            self._render_lines(k, a, committed, cost, U_r, t, terminated, step_mask)
        elif self._strip is not None:
            self._strip.push(k, a)
            if any_reset:
                self._strip.clear(done_prev)
        self._prev_done = terminated
        self._any_done = any_done
        return self._observe(), reward, terminated, np.zeros(self.num_envs, dtype=bool), info

    def _step_compiled(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """:meth:`step` with the rounds and the observations in two compiled loops (:mod:`specenv.envs.vector_kernel`).

        The same results as the numpy path of :meth:`step`, bit for bit (the masked-off entries of
        ``info`` included); the autoresets' draws stay in Python (one generator per sub-environment).
        """
        k = self._check_actions(actions, check_range=False)
        n = self.num_envs
        ints, floats, flags = np.empty((5, n), dtype=np.int64), np.empty((6, n)), np.empty((2, n), dtype=bool)
        done_prev = self._prev_done
        any_reset = self._any_done
        t_old = self._t
        n_done = self._kernels[0](*self._round_args(k, slice(None)), ints, floats, flags)
        if n_done < 0:  # nothing was changed
            raise ValueError(f"actions: out of range 0..{self.kmax} ({k.min()}..{k.max()})")
        a, committed, t_new, L, rounds = ints
        cost, U_r, reward, speedup, episode_cost, ar_cost = floats
        terminated, played = flags
        self._t = t_new
        step_mask = played if any_reset else self._all
        d = self.data
        info: dict[str, Any] = {
            "k": k,
            "accepted": a,
            "committed": committed,
            "cost_ms": cost,
            "U_r": U_r,
            "L": L,
            "t": t_new,  # self._t: an autoreset below sets its entry to 0
        }
        info.update(dict.fromkeys(_STEP_MASKS, step_mask))
        if any_reset:  # NEXT_STEP autoreset: these sub-environments start a new episode instead
            for i in done_prev.nonzero()[0].tolist():
                self._start(i)
        gen = self._gen
        info["generation_id"] = d.generation_ids.take(gen)
        info["_generation_id"] = self._all
        info["category"] = d.categories.take(gen)
        info["_category"] = self._all
        if n_done:
            info.update(zip(_END_KEYS, (speedup, episode_cost, ar_cost, rounds), strict=True))
            info.update(dict.fromkeys(_END_MASKS, terminated))
        if self.render_mode == "ansi":
            t = np.minimum(t_old, self._N1) if any_reset else t_old
            self._render_lines(k, a, committed, cost, U_r, t, terminated, step_mask)
        elif self._strip is not None:
            self._strip.push(k, a)
            if any_reset:
                self._strip.clear(done_prev)
        self._prev_done = terminated
        self._any_done = n_done > 0
        obs = np.empty((n, self._obs_state.spec.dim), dtype=np.float32)
        self._kernels[1](*self._build_args(obs, done_prev if any_reset else self._none, slice(None)))
        return obs, reward, terminated, np.zeros(n, dtype=bool), info

    def _rounds(self) -> np.ndarray:
        """Rounds played in each sub-environment's episode (its uniforms used)."""
        return self._u_pos - self._u_base

    def _observe(self) -> np.ndarray:
        """The observations at every sub-environment's current position (a new array)."""
        t = self._t
        if self._kernels is None:
            return self._obs_state.build(np.add(self._L0, t, out=self._ctx), t, self._conf())
        obs = np.empty((self.num_envs, self._obs_state.spec.dim), dtype=np.float32)
        self._kernels[1](*self._build_args(obs, self._none, slice(None)))
        return obs

    def _check_actions(self, actions: Any, check_range: bool = True) -> np.ndarray:
        """``actions`` as a new (num_envs,) int64 array (``info["k"]`` returns it); the range is checked unless told.

        Raises:
            ValueError: If ``actions`` has the wrong shape, is not integer, or is out of range.
        """
        k = np.asarray(actions)
        n = self.num_envs
        if k.shape != (n,) or k.dtype.kind not in "iu":
            raise ValueError(f"actions: expected an integer array of shape ({n},), got {k.dtype} {k.shape}")
        k = k.astype(np.int64)  # a copy: info["k"] is returned
        if check_range and k.view(np.uint64).max() > self.kmax:  # negative values wrap to huge unsigned ones
            raise ValueError(f"actions: out of range 0..{self.kmax} ({k.min()}..{k.max()})")
        return k

    def _complete_info(
        self, info: dict[str, Any], step_mask: np.ndarray, terminated: np.ndarray, any_done: bool
    ) -> None:
        """Add to a step's ``info`` the masks of the round keys, the generation and category, and the episode's end.

        Args:
            info: The round keys (``_STEP_KEYS``); completed in place.
            step_mask: Sub-environments that played a round (not autoreset) this step.
            terminated: Sub-environments whose episode ended this step (they get ``_END_KEYS``).
            any_done: ``terminated.any()``.
        """
        for key in _STEP_KEYS:
            info["_" + key] = step_mask
        d = self.data
        gen = self._gen
        info["generation_id"] = d.generation_ids.take(gen)
        info["_generation_id"] = self._all
        info["category"] = d.categories.take(gen)
        info["_category"] = self._all
        if any_done:
            ep = self._ep_cost
            ar = d.ar_total_ms.take(gen)
            info["speedup"] = np.divide(ar, ep, out=np.zeros(self.num_envs), where=terminated)
            info["episode_cost_ms"] = np.where(terminated, ep, 0.0)
            info["ar_cost_ms"] = np.where(terminated, ar, 0.0)
            info["rounds"] = np.where(terminated, self._rounds(), 0)
            for key in _END_KEYS:
                info["_" + key] = terminated

    def _render_lines(self, k, a, committed, cost, U_r, t, terminated, step_mask) -> None:  # noqa: ANN001
        d = self.data
        rounds = self._rounds()
        for i in np.flatnonzero(step_mask):
            self._lines[i] = (
                f"gen {int(d.generation_ids[self._gen[i]])} [{d.categories[self._gen[i]]}] round "
                f"{int(rounds[i]) - 1}: t={int(t[i])} k={int(k[i])} accepted={int(a[i])} +{int(committed[i])} "
                f"cost={float(cost[i]):.3f}ms U_r={float(U_r[i]):.2f}" + (" (done)" if terminated[i] else "")
            )

    def render(self) -> tuple[str, ...] | tuple[np.ndarray, ...] | None:
        """One frame per sub-environment, as ``SyncVectorEnv.render`` returns them.

        Its last round as text (``"ansi"``) or its recent rounds as a ``(64, 128, 3)`` uint8 image
        (``"rgb_array"``); None (with a warning) without a render mode.
        """
        if self.render_mode is None:
            logger.warn(f'render_mode is None; create with gym.make_vec("{ENV_ID}", render_mode="rgb_array")')
            return None
        if self._strip is not None:
            return tuple(self._strip.frames())
        return tuple(self._lines)
