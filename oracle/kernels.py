"""Compiled (numba) forms of the exact DP's two sweeps, the same arithmetic as :mod:`oracle.dp`'s numpy.

:func:`oracle.dp._backward` and :func:`oracle.dp._forward` run these when numba imports (and the
environment variable ``SPECENV_NUMBA`` is not ``0``); their numpy forms stay the reference and the
fallback. Each kernel is one loop over the sweep's steps and, inside, over the active generations
and the budgets: the floating-point operations of the numpy form, element by element and in the
same order (no fast-math, so no reassociation and no fused multiply-add), so the results are
identical bit for bit (``tests/test_oracle_kernels.py``).

The tables are the step-ordered ``(K+1, n)`` cost and ``(K, n)`` survival tables of
:func:`oracle.dp.step_tables`; the value function is kept generation-major here (``W[g, nmax - x]``,
the numpy form's buffer transposed), so the values a state reads are adjacent in memory.

Compiled on first use with ``cache=True`` (numba's on-disk cache, next to this file or under
``NUMBA_CACHE_DIR``); a fresh checkout pays the compilation once.
"""

from __future__ import annotations

import numba
import numpy as np

from specenv.numba_support import guard_llvmlite

guard_llvmlite()  # vLLM in the same process scans llvmlite's ffi wrapper (specenv.numba_support)

__all__ = ["backward", "forward", "take_columns"]


@numba.njit(cache=True, nogil=True)
def backward(
    Ct: np.ndarray, St: np.ndarray, n_active: np.ndarray, start: np.ndarray, G: int, policy: np.ndarray, optimal: bool
) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled (its numpy twin is oracle.dp._backward_numpy)
    """Value and budget of every state in step order: the least-value budget (``optimal``) or ``policy``'s.

    ``q_0 = C_0``, ``q_k = (d_1 + ... + d_k) + C_k`` with ``d_i = (V_i - V_{i-1}) * S_i`` summed left
    to right (the numpy form's cumulative sum), ``V = q_k + V_0``; ties go to the smallest k. The
    loops run budget by budget over the step's generations (contiguous, vectorisable inner loops).
    """
    K1, n = Ct.shape
    nm = n_active.shape[0] - 1
    W = np.zeros((nm + K1, G))  # W[nm - x, g] = V at distance x of slot g (zero for x <= 0)
    Vp = np.empty(n)
    kp = np.empty(n, dtype=np.int64)
    acc = np.empty(G)
    for s in range(1, nm + 1):
        na = n_active[s]
        p = start[s]
        b = nm - s
        best = Vp[p : p + na]
        kb = kp[p : p + na]
        for j in range(na):
            best[j] = Ct[0, p + j]
            kb[j] = 0
        for i in range(1, K1):
            hi = W[b + 1 + i]
            lo = W[b + i]
            S = St[i - 1, p : p + na]
            C = Ct[i, p : p + na]
            if optimal:
                for j in range(na):
                    d = (hi[j] - lo[j]) * S[j]
                    a = d if i == 1 else acc[j] + d
                    acc[j] = a
                    q = a + C[j]
                    if q < best[j]:
                        best[j] = q
                        kb[j] = i
            else:
                pol = policy[p : p + na]
                for j in range(na):
                    if i <= pol[j]:
                        d = (hi[j] - lo[j]) * S[j]
                        a = d if i == 1 else acc[j] + d
                        acc[j] = a
                        if i == pol[j]:
                            best[j] = a + C[j]
                            kb[j] = i
        v0 = W[b + 1]
        out = W[b]
        for j in range(na):
            v = best[j] + v0[j]
            best[j] = v
            out[j] = v
    return Vp, kp


@numba.njit(cache=True, nogil=True)
def forward(
    St: np.ndarray, kp: np.ndarray, n_active: np.ndarray, start: np.ndarray, lengths: np.ndarray
) -> np.ndarray:  # pragma: no cover - compiled (its numpy twin is oracle.dp._forward_numpy)
    """Occupancy in step order: the probability that each state is visited under the budgets ``kp``.

    A step whose occupancies are all zero is skipped (as in the numpy form); otherwise each state adds
    ``f_a - f_{a+1}`` to the state ``a + 1`` tokens on, ``f_0 = o``, ``f_i = (S_i * [i <= k]) * o``
    (``f_{K+1} = 0``).
    """
    K, n = St.shape
    G = lengths.shape[0]
    nm = n_active.shape[0] - 1
    occ = np.zeros((nm + K + 1, G))  # occ[nm - x, g]: occupancy of slot g at distance x
    for g in range(G):
        occ[nm - lengths[g], g] = 1.0
    occp = np.empty(n)
    f = np.empty(G)
    for s in range(nm, 0, -1):
        na = n_active[s]
        p = start[s]
        b = nm - s
        o = occ[b, :na]
        live = False
        for j in range(na):
            occp[p + j] = o[j]
            live |= o[j] != 0.0
        if not live:
            continue
        k = kp[p : p + na]
        for j in range(na):
            f[j] = o[j]
        for a in range(K + 1):
            tgt = occ[b + 1 + a]
            if a < K:
                S = St[a, p : p + na]
                for j in range(na):
                    nxt = (S[j] * (1.0 if a + 1 <= k[j] else 0.0)) * o[j]
                    tgt[j] = (tgt[j] + f[j]) - nxt
                    f[j] = nxt
            else:
                for j in range(na):
                    tgt[j] = (tgt[j] + f[j]) - 0.0
    return occp


@numba.njit(cache=True, nogil=True)
def take_columns(xt: np.ndarray, perm: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[j] = xt[j, perm]`` for every row j: a per-row table, column-major, gathered into step order."""
    for j in range(xt.shape[0]):
        src = xt[j]
        dst = out[j]
        for c in range(perm.shape[0]):
            dst[c] = src[perm[c]]
