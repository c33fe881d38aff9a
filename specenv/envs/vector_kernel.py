"""Compiled (numba) form of the vector environment's step: the same floats as its numpy path, in two calls.

:class:`specenv.envs.vector.MoESpecVectorEnv` steps its sub-environments with whole-array numpy
operations (:func:`specenv.replay.episode.settle` on arrays, then
:meth:`specenv.observation.single.ObservationState.update` and ``build``): some forty numpy calls
per step, each a few microseconds of fixed cost, which is most of the step at the sizes learners
use. When numba is importable, the environment runs the same arithmetic as two compiled loops over
the sub-environments instead:

* :func:`round_and_update`: each sub-environment's round (the leading run of ``u < P(a >= j)``,
  capped at k, then the charge/commit rule of :func:`~specenv.replay.episode.settle`) and the fold
  of that round into its observation statistics (:meth:`ObservationState.update`'s ``E * M[k, a] +
  A[k, a]``, the cost-per-token term, the previous-round block);
* :func:`build`: the float32 observations (:meth:`ObservationState.build`: each feature in float64,
  rounded once to float32, the draft confidences, the clip when asked).

Every value is computed with the same IEEE operations in the same order as the numpy path (no
fast-math, no fused multiply-add), so the two give the same bits; ``tests/test_vector_kernel.py``
runs both on the same rollouts and compares them, and ``tests/test_env_rollouts.py`` checks both
against recorded rollouts. The numpy path stays the reference and the fallback: it is used when
numba is missing or ``SPECENV_NUMBA=0`` is set.

Compilation: ``cache=True`` (numba's on-disk cache, next to this file or in ``NUMBA_CACHE_DIR``); the
environment compiles (or loads) both functions when it is built, on empty slices of its own arrays,
so no step pays for it. :func:`kernels` imports numba on first use only: ``import specenv`` and
``gymnasium.make`` never load it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from specenv import numba_support

__all__ = ["build", "charge_table", "kernels", "round_and_update"]


def kernels() -> tuple[Any, Any] | None:
    """The compiled ``(round_and_update, build)``, or None without numba (or with ``SPECENV_NUMBA=0``)."""
    return numba_support.compile_once(__name__, _compile)


def _compile(numba: Any) -> tuple[Any, Any]:
    jit = numba.njit(cache=True, nogil=True)
    return jit(round_and_update), jit(build)


@functools.lru_cache(maxsize=4)
def charge_table(data: Any) -> np.ndarray:
    """(rows, kmax+1, 3) float64 ``[C(t, k), U_{t,k}, C(t, k) / C_AR(L_t)]`` of a replay (read-only, cached).

    What a round reads at its (row, k), side by side (one cache line instead of three tables); the
    last column is the division :func:`specenv.replay.episode.settle` does (``cost / ctx_at(row)``),
    the same IEEE operation on the same two numbers, so the same bits.
    """
    table = np.stack((data.cost, data.U, data.cost / data.ar_ctx_ms[:, None]), axis=-1)
    table.flags.writeable = False
    return table


def round_and_update(
    k: np.ndarray,
    t: np.ndarray,
    row0: np.ndarray,
    N: np.ndarray,
    L0: np.ndarray,
    u_flat: np.ndarray,
    u_pos: np.ndarray,
    u_base: np.ndarray,
    ep_cost: np.ndarray,
    gen: np.ndarray,
    prev_done: np.ndarray,
    surv: np.ndarray,
    charge: np.ndarray,
    ar_total: np.ndarray,
    unit_ms: float,
    savings: bool,
    P: np.ndarray,
    E: np.ndarray,
    M: np.ndarray,
    A: np.ndarray,
    K: int,
    w: float,
    ints: np.ndarray,
    floats: np.ndarray,
    flags: np.ndarray,
) -> int:
    """One round in every sub-environment, folded into its statistics (in place), as the numpy step computes it.

    Nothing is written when a budget is outside 0..kmax (the return value is then -1).

    Args:
        k: (n,) budgets.
        t: (n,) positions (clamped to N - 1 as the numpy path does on an autoreset step; not written).
        row0: (n,) first table row of each episode.
        N: (n,) episode lengths.
        L0: (n,) prompt lengths.
        u_flat: The acceptance uniforms, flat.
        u_pos: (n,) index in ``u_flat`` of each sub-environment's next uniform (incremented).
        u_base: (n,) index of its first one.
        ep_cost: (n,) episode cost so far (the round's cost is added).
        gen: (n,) generation index of each episode.
        prev_done: (n,) sub-environments autoreset by this step (reward 0, not terminated).
        surv: (rows, kmax+1) survival ``P(a >= j)`` (last column 0).
        charge: (rows, kmax+1, 3) :func:`charge_table`.
        ar_total: (G,) AR cost of each generation.
        unit_ms: The reward unit.
        savings: Reward ``committed - units`` (else ``-units``).
        P: (n, 4) previous-round block of the observation state (written).
        E: (n, 4 + kmax) statistics block (written).
        M: Multipliers per (k, a) row ``k * K + a``.
        A: Addends per (k, a).
        K: Rows per budget in M and A.
        w: ``1 - ema``.
        ints: (5, n) int64 out: accepted, committed, t after the round, context L verified at, rounds
            (where terminated, else 0).
        floats: (6, n) float64 out: cost_ms, U_r, reward, then where terminated (else 0) speedup,
            episode_cost_ms, ar_cost_ms.
        flags: (2, n) bool out: terminated, played (not autoreset).

    Returns:
        The number of sub-environments that terminated, or -1 for a budget out of range.
    """
    n = k.shape[0]
    W = surv.shape[1]
    for i in range(n):
        if k[i] < 0 or k[i] > W - 1:
            return -1
    # three passes, so that the table reads of different sub-environments overlap (no branch on a
    # read value between them): the draw, then the charge, then the statistics
    for i in range(n):
        ti = t[i]
        if ti > N[i] - 1:  # np.minimum(t, N - 1)
            ti = N[i] - 1
        row = row0[i] + ti
        u = u_flat[u_pos[i]]
        # the first j with not (u < P(a >= j)): lead.argmin(axis=1) (0 if every entry were True)
        a = W
        for j in range(W - 1, -1, -1):
            a = j if not surv[row, j] > u else a
        a = 0 if a == W else a
        ints[0, i] = min(a, k[i])
        ints[3, i] = ti
    for i in range(n):
        ki = k[i]
        Ni = N[i]
        ti = ints[3, i]
        row = row0[i] + ti
        # settle: committed = min(a + 1, N - t), charged C(t, k)
        committed = min(ints[0, i] + 1, Ni - ti)
        c = charge[row, ki, 0]
        t_next = ti + committed
        ints[0, i] = committed - 1
        ints[1, i] = committed
        ints[2, i] = t_next
        ints[3, i] = L0[i] + ti
        floats[0, i] = c
        floats[1, i] = charge[row, ki, 1]
        floats[3, i] = charge[row, ki, 2]  # ctx_units (overwritten below)
    done = 0
    for i in range(n):
        ki = k[i]
        accepted = ints[0, i]
        committed = ints[1, i]
        c = floats[0, i]
        U_r = floats[1, i]
        ctx_units = floats[3, i]
        units = c / unit_ms
        u_pos[i] += 1
        ep_cost[i] += c
        if prev_done[i]:  # autoreset: the round is discarded
            floats[2, i] = 0.0
            term = False
        else:
            floats[2, i] = (committed - units) if savings else -units
            term = ints[2, i] >= N[i]
        flags[0, i] = term
        flags[1, i] = not prev_done[i]
        if term:
            done += 1
            ar = ar_total[gen[i]]
            floats[3, i] = ar / ep_cost[i]
            floats[4, i] = ep_cost[i]
            floats[5, i] = ar
            ints[4, i] = u_pos[i] - u_base[i]
        else:
            floats[3, i] = 0.0
            floats[4, i] = 0.0
            floats[5, i] = 0.0
            ints[4, i] = 0
        # ObservationState.update: E = E * M[k, a] + A[k, a], then the cost-per-token term
        idx = ki * K + accepted
        for col in range(E.shape[1]):
            E[i, col] *= M[idx, col]
        for col in range(E.shape[1]):
            E[i, col] += A[idx, col]
        cpt = float(committed)
        if cpt < 1.0:
            cpt = 1.0
        cpt = ctx_units / cpt
        cpt *= w
        E[i, 2] += cpt
        P[i, 0] = ki
        P[i, 1] = accepted
        P[i, 2] = U_r
        P[i, 3] = ctx_units
    return done


def build(
    obs: np.ndarray,
    L0: np.ndarray,
    t: np.ndarray,
    row0: np.ndarray,
    N: np.ndarray,
    P: np.ndarray,
    E: np.ndarray,
    E_init: np.ndarray,
    reset: np.ndarray,
    scale: np.ndarray,
    ctx_scale: float,
    mnt: float,
    cols: np.ndarray,
    conf: np.ndarray,
    clip: bool,
    hi: np.ndarray,
) -> None:
    """The (n, dim) float32 observations into ``obs`` (:meth:`ObservationState.build`, column for column).

    Args:
        obs: (n, dim) float32 out.
        L0: (n,) prompt lengths (context L = L0 + t).
        t: (n,) positions.
        row0: (n,) first table row of each episode.
        N: (n,) episode lengths.
        P: (n, 4) previous-round block (divided by ``scale``).
        E: (n, 4 + kmax) statistics block.
        E_init: The statistics of a fresh stream.
        reset: (n,) streams that first forget their history (:meth:`ObservationState.reset`: P = 0,
            E = E_init).
        scale: (4,) divisors of the previous-round block.
        ctx_scale: Divisor of the context.
        mnt: Divisor of the progress.
        cols: int64 [context, progress, first prev column, first statistics column, first conf column].
        conf: (rows, h) draft signals (h may be 0): row ``row0 + t`` where ``t < N``, else 0.
        clip: Clip to [0, hi] (in float32, as the numpy path).
        hi: (dim,) float32 upper bounds.
    """
    c_ctx, c_prog, c_prev, c_stats, c_conf = cols[0], cols[1], cols[2], cols[3], cols[4]
    h = conf.shape[1]
    for i in range(obs.shape[0]):
        if reset[i]:
            for j in range(P.shape[1]):
                P[i, j] = 0.0
            for j in range(E.shape[1]):
                E[i, j] = E_init[j]
        ti = t[i]
        obs[i, c_ctx] = np.float32((L0[i] + ti) / ctx_scale)
        obs[i, c_prog] = np.float32(ti / mnt)
        for j in range(P.shape[1]):
            obs[i, c_prev + j] = np.float32(P[i, j] / scale[j])
        for j in range(E.shape[1]):
            obs[i, c_stats + j] = np.float32(E[i, j])
        if h:
            if ti < N[i]:
                row = row0[i] + ti
                for j in range(h):
                    obs[i, c_conf + j] = np.float32(conf[row, j])
            else:
                for j in range(h):
                    obs[i, c_conf + j] = np.float32(0.0)
        if clip:
            for j in range(obs.shape[1]):
                x = obs[i, j]
                if x > hi[j]:  # np.minimum(obs, hi) then np.maximum(obs, 0.0): NaN stays NaN
                    x = hi[j]
                if x < 0.0:
                    x = np.float32(0.0)
                obs[i, j] = x
