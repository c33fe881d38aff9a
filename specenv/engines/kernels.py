"""Compiled (numba) kernels of a live engine's per-step bookkeeping: the numpy forms' floats, one call each.

A serving engine's controller runs its bookkeeping between two forwards of the target, and a forward
that reads hundreds of MB of expert weights leaves every cache cold: each numpy call then costs 5-10
microseconds of fixed cost instead of one (measured on this project's CPU testbed, ``wide-moe-v1`` at
batch 1: a what-if row of :meth:`specenv.engines.vllm.bookkeeping.ObsSlots.what_if`, some twenty numpy
calls, 24 us warm and 96 us after a 64 MB sweep). These kernels do the hot parts in one compiled call
each:

* :func:`expert_counts`: the unique experts ``U_r`` and the per-layer busiest expert ``E_max`` of every
  verification pass of one forward, and the forward's expert union
  (:meth:`specenv.engines.base.StepExperts.step`'s bincount, its ``count_nonzero`` and ``max``);
* :func:`what_if`: the observation rows of slots folded with one hypothetical round each
  (:meth:`ObsSlots.what_if`: the gather, :meth:`specenv.observation.single.ObservationState.update`
  and ``build``);
* :func:`commit`: the scatter of those folded rows into the live statistics when the round that
  really ran is the one folded (:meth:`ObsSlots.update`'s reuse of a what-if fold).

Every value is computed with the same IEEE operations in the same order as the numpy forms (no
fast-math, no fused multiply-add; integer counts divided by the number of layers as numpy's mean
does), so the two give the same bits: ``tests/vllm/test_controller_kernels.py`` and
``tests/test_engine_kernels.py`` run both on the same inputs and compare them. The numpy forms stay
the reference and the fallback (numba missing, ``SPECENV_NUMBA=0``, or an input a kernel does not
take: a budget above the statistics' table, a lookahead or per-token observation).

Compilation: explicit signatures (arrays of any layout) and ``cache=True`` (numba's on-disk cache):
:func:`kernels` compiles or loads them on first use, and the controller asks for them when it is
built, so no served step pays for it; the callers pass exactly those types (else the numpy form).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from specenv import numba_support

__all__ = ["Kernels", "commit", "expert_counts", "kernels", "what_if"]


class Kernels(NamedTuple):
    """The compiled kernels (:func:`kernels`)."""

    expert_counts: Any
    what_if: Any
    commit: Any


_KERNELS: Any = None


def kernels() -> Kernels | None:
    """The compiled kernels, or None without numba (or with ``SPECENV_NUMBA=0``): the numpy forms run then."""
    global _KERNELS
    if not numba_support.enabled():
        return None
    if _KERNELS is None:
        numba = numba_support.numba_module()
        if numba is None:
            _KERNELS = False
        else:
            # explicit signatures (any memory layout): compiled (or loaded from the cache) here, once, and
            # an argument of another type is refused by numba, never compiled mid-step; callers check types
            t = numba.types

            def arr(dtype: Any, ndim: int, readonly: bool = False) -> Any:
                return t.Array(dtype, ndim, "A", readonly=readonly)

            f1, f2, i1, i3 = arr(t.float64, 1), arr(t.float64, 2), arr(t.int64, 1), arr(t.int32, 3)
            ro2 = arr(t.float64, 2, readonly=True)  # the statistics' EMA tables (cached, read-only)
            b, i, f = t.boolean, t.int64, t.float64
            sig_wi = b(f2, f2, i1, f1, f1, f1, f1, b, f1, f1, ro2, ro2, i, f, f1, f, f, i1, b,
                       arr(t.float32, 1), f2, f2, arr(t.float32, 2))  # fmt: skip
            _KERNELS = Kernels(
                numba.njit(f(i3, i1, i1, i, i1, f2), cache=True, nogil=True)(expert_counts),
                numba.njit(sig_wi, cache=True, nogil=True)(what_if),
                numba.njit(b(f2, i1, i1, f1, f1, f2, f2, i1, f2, f2, f2, f2), cache=True, nogil=True)(commit),
            )
    return _KERNELS or None


def expert_counts(
    routing: np.ndarray, offsets: np.ndarray, lens: np.ndarray, n_experts: int, counts: np.ndarray, out: np.ndarray
) -> float:
    """``U_r`` and ``E_max`` of each pass (into ``out``) and the forward's expert union (returned).

    Args:
        routing: ``(n_layers, tokens, top_k)`` int32 expert ids of every token of the forward.
        offsets: (n,) int64 each pass's first token.
        lens: (n,) int64 each pass's number of verified positions.
        n_experts: Experts per layer (every id below it).
        counts: int64 scratch of at least ``(n + 1) * n_layers * n_experts`` (overwritten).
        out: (2, n) float64 out: row 0 ``U_r`` (unique experts per layer, mean over layers), row 1 ``E_max``
            (tokens of the pass routed to its busiest expert, mean over layers).

    Returns:
        The mean over layers of the experts any token of the forward was routed to (tokens of no pass
        included); -1 for an id outside 0..n_experts - 1 (``out`` not meaningful: the numpy form raises).
    """
    L, T, k = routing.shape
    E = n_experts
    n = offsets.shape[0]
    LE = L * E
    for j in range((n + 1) * LE):
        counts[j] = 0
    # tokens of no pass count in the union only (bucket n); a token in two spans counts in the later
    owner = np.full(T, n, dtype=np.int64)
    for i in range(n):
        for t in range(offsets[i], offsets[i] + lens[i]):
            owner[t] = i
    for layer in range(L):
        for t in range(T):
            base = owner[t] * LE + layer * E
            for j in range(k):
                e = routing[layer, t, j]
                if e < 0 or e >= E:  # not an expert id: the numpy form's error
                    return -1.0
                counts[base + e] += 1
    union = 0
    for layer in range(L):
        for e in range(E):
            for i in range(n + 1):
                if counts[i * LE + layer * E + e] > 0:
                    union += 1
                    break
    for i in range(n):
        u = 0
        m = 0
        for layer in range(L):
            top = 0
            for e in range(E):
                c = counts[i * LE + layer * E + e]
                if c > 0:
                    u += 1
                if c > top:
                    top = c
            m += top
        out[0, i] = u / L
        out[1, i] = m / L
    return union / L


def what_if(
    stP: np.ndarray,
    stE: np.ndarray,
    slots: np.ndarray,
    k: np.ndarray,
    a: np.ndarray,
    U: np.ndarray,
    cost: np.ndarray,
    has_cost: bool,
    L: np.ndarray,
    t: np.ndarray,
    M: np.ndarray,
    A: np.ndarray,
    K: int,
    w: float,
    scale: np.ndarray,
    ctx_scale: float,
    mnt: float,
    cols: np.ndarray,
    clip: bool,
    hi: np.ndarray,
    hypP: np.ndarray,
    hypE: np.ndarray,
    obs: np.ndarray,
) -> bool:
    """Rows of slots folded with one hypothetical round each, built (``ObsSlots.what_if``'s floats).

    Nothing of the live statistics (``stP``, ``stE``) is written: the folded rows go to ``hypP`` / ``hypE``
    and the observations to ``obs``. Returns False, with nothing meaningful written, when a round is
    outside the statistics' table (``k * K + a`` beyond it, a negative budget): the numpy form extends
    the table then.

    Args:
        stP: The live statistics' previous-round block (n_slots, 4).
        stE: Their statistics block (n_slots, 4 + kmax).
        slots: (rows,) int64 slot of each row (a slot may repeat).
        k: (rows,) float64 budgets (integers).
        a: (rows,) float64 accepted drafts (integers).
        U: (rows,) float64 unique experts of the round.
        cost: (rows,) float64 the round's cost (read when ``has_cost``).
        has_cost: False: each row takes its slot's last cost (1 before one) instead of ``cost``.
        L: (rows,) float64 context to build at.
        t: (rows,) float64 generated tokens to build at.
        M: The statistics' EMA multipliers per (k, a) row ``k * K + a``.
        A: The addends, likewise.
        K: Rows per budget in ``M`` and ``A``.
        w: ``1 - ema``.
        scale: (4,) divisors of the previous-round block.
        ctx_scale: Divisor of the context.
        mnt: Divisor of the progress.
        cols: int64 [context, progress, first prev column, first statistics column].
        clip: Clip to [0, hi] (in float32, as ``build``).
        hi: (dim,) float32 upper bounds.
        hypP: (rows, 4) float64 out: the folded previous-round block.
        hypE: (rows, 4 + kmax) float64 out: the folded statistics.
        obs: (rows, dim) float32 out.
    """
    n = slots.shape[0]
    nE = stE.shape[1]
    for r in range(n):
        kr = k[r]
        ar = a[r]
        if kr < 0 or ar < 0 or int(kr) * K + int(ar) >= M.shape[0]:
            return False
    c_ctx, c_prog, c_prev, c_stats = cols[0], cols[1], cols[2], cols[3]
    for r in range(n):
        s = slots[r]
        idx = int(k[r]) * K + int(a[r])
        c = cost[r]
        if not has_cost:
            c = stP[s, 3] if stP[s, 3] > 0 else 1.0
        # ObservationState.update: E = E * M[k, a] + A[k, a], then the cost-per-token term
        for j in range(nE):
            hypE[r, j] = stE[s, j] * M[idx, j]
        for j in range(nE):
            hypE[r, j] += A[idx, j]
        committed = a[r] + 1.0
        cpt = committed if committed > 1.0 else 1.0
        cpt = c / cpt
        cpt *= w
        hypE[r, 2] += cpt
        hypP[r, 0] = k[r]
        hypP[r, 1] = a[r]
        hypP[r, 2] = U[r]
        hypP[r, 3] = c
        # ObservationState.build: each feature in float64, rounded once to float32
        obs[r, c_ctx] = np.float32(L[r] / ctx_scale)
        obs[r, c_prog] = np.float32(t[r] / mnt)
        for j in range(4):
            obs[r, c_prev + j] = np.float32(hypP[r, j] / scale[j])
        for j in range(nE):
            obs[r, c_stats + j] = np.float32(hypE[r, j])
        if clip:
            for j in range(obs.shape[1]):
                x = obs[r, j]
                if x > hi[j]:  # np.minimum(obs, hi) then np.maximum(obs, 0.0): NaN stays NaN
                    x = hi[j]
                if x < 0.0:
                    x = np.float32(0.0)
                obs[r, j] = x
    return True


def commit(
    ins: np.ndarray,
    k: np.ndarray,
    acc: np.ndarray,
    U: np.ndarray,
    cost: np.ndarray,
    hypP: np.ndarray,
    hypE: np.ndarray,
    slots: np.ndarray,
    stP: np.ndarray,
    stE: np.ndarray,
    subP: np.ndarray,
    subE: np.ndarray,
) -> bool:
    """Scatter a what-if fold into the live statistics when its inputs are the rounds that ran; False: they differ.

    ``ins``: (4, rows) float64 the fold's ``k, accepted, U, cost``; ``k``, ``acc``, ``U``, ``cost``: the rounds
    that ran (compared as float64, NaN never equal). When equal, ``hypP`` / ``hypE`` (the folded rows) are
    written to the rows ``slots`` of ``stP`` / ``stE`` and copied to ``subP`` / ``subE`` (the subset that
    ``ObsSlots.subset(reuse=True)`` returns); nothing is written otherwise.
    """
    n = slots.shape[0]
    for r in range(n):
        if not (
            ins[0, r] == np.float64(k[r])
            and ins[1, r] == np.float64(acc[r])
            and ins[2, r] == np.float64(U[r])
            and ins[3, r] == np.float64(cost[r])
        ):
            return False
    for r in range(n):
        s = slots[r]
        for j in range(hypP.shape[1]):
            stP[s, j] = hypP[r, j]
            subP[r, j] = hypP[r, j]
        for j in range(hypE.shape[1]):
            stE[s, j] = hypE[r, j]
            subE[r, j] = hypE[r, j]
    return True
