"""Compiled (numba) kernels of a live engine's per-step bookkeeping: one call each instead of a dozen numpy calls.

A serving engine's controller runs its bookkeeping between two forwards of the target, and a forward
that reads hundreds of MB of expert weights leaves every cache cold: each numpy call then costs 5-10
microseconds of fixed cost instead of one (measured on this project's CPU testbed, ``wide-moe-v1`` at
batch 1: a what-if row of :meth:`specenv.engines.vllm.bookkeeping.ObsSlots.what_if`, some twenty numpy
calls, 24 us warm and 96 us after a 64 MB sweep). These kernels do the hot parts in one compiled call
each:

* :func:`expert_counts`: the unique experts ``U_r`` and the per-layer busiest expert ``E_max`` of every
  verification pass of one forward, and the forward's expert union
  (:meth:`specenv.engines.base.StepExperts.step`'s bincount, its ``count_nonzero`` and ``max``);
* :func:`rows`: observation rows of slots, folded with one round each or not, built or written back
  (:class:`ObsSlots`' ``what_if``, ``stacked`` and ``update``: the gather,
  :meth:`specenv.observation.single.ObservationState.update` and ``build``, the scatter);
* :func:`commit`: the scatter of a what-if fold into the live statistics when the round that really
  ran is the one folded (:meth:`ObsSlots.update`'s reuse of a what-if fold);
* :func:`mlp3`: the budgets of a three-layer MLP policy (the exported policies' shape), served by
  :class:`specenv.engines.vllm.served.ServedPolicy`.

The first three compute every value with the same IEEE operations in the same order as the numpy
forms (no fast-math, no fused multiply-add; integer counts divided by the number of layers as numpy's
mean does), so the two give the same bits; :func:`mlp3` sums its dot products in float64 where numpy's
float32 matmul sums in BLAS's order, so its scores agree to float32 rounding and a budget may differ
only on a near-tie of two scores. ``tests/test_engine_kernels.py`` runs each kernel and its numpy form on
the same inputs and compares them. The numpy forms stay the reference and the fallback (numba missing,
``SPECENV_NUMBA=0``, or an input a kernel does not take: a budget above the statistics' table, a
lookahead or per-token observation, another MLP shape).

Compilation: explicit signatures (arrays of any layout) and ``cache=True`` (numba's on-disk cache):
:func:`kernels` compiles or loads them on first use, and the controller asks for them when it is
built, so no served step pays for it; the callers pass exactly those types (else the numpy form).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from specenv import numba_support

__all__ = ["Kernels", "commit", "expert_counts", "kernels", "mlp3", "rows"]


class Kernels(NamedTuple):
    """The compiled kernels (:func:`kernels`)."""

    expert_counts: Any
    rows: Any
    commit: Any
    mlp3: Any


def kernels() -> Kernels | None:
    """The compiled kernels, or None without numba (or with ``SPECENV_NUMBA=0``): the numpy forms run then."""
    return numba_support.compile_once(__name__, _compile)


def _compile(numba: Any) -> Kernels:
    # explicit signatures (any memory layout): compiled (or loaded from the cache) here, once, and an
    # argument of another type is refused by numba, never compiled mid-step; callers check types
    t = numba.types

    def arr(dtype: Any, ndim: int, readonly: bool = False) -> Any:
        return t.Array(dtype, ndim, "A", readonly=readonly)

    f1, f2, i1, i3 = arr(t.float64, 1), arr(t.float64, 2), arr(t.int64, 1), arr(t.int32, 3)
    b, i, f = t.boolean, t.int64, t.float64
    ro2 = arr(t.float64, 2, readonly=True)  # the statistics' EMA tables (cached, read-only)
    f32_1, f32_2 = arr(t.float32, 1), arr(t.float32, 2)

    def sig_rows(ka: Any) -> Any:  # budgets and accepted drafts as float64 or int64
        return b(f2, f2, i1, i, ka, ka, f1, f1, b, f1, f1, ro2, ro2, i, f, f1, f, f, i1, b, f32_1, f2, f2, f32_2, b)

    def jit(sig: Any, fn: Any) -> Any:
        return numba.njit(sig, cache=True, nogil=True)(fn)

    return Kernels(
        jit(f(i3, i1, i1, i, i1, f2), expert_counts),
        jit([sig_rows(f1), sig_rows(i1)], rows),
        jit(b(f2, i1, i1, f1, f1, f2, f2, i1, f2, f2, f2, f2), commit),
        jit(t.none(f32_2, f32_2, f32_1, f32_2, f32_1, f32_2, f32_1, b, i1), mlp3),
    )


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


def rows(
    stP: np.ndarray,
    stE: np.ndarray,
    slots: np.ndarray,
    first: int,
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
    scatter: bool,
) -> bool:
    """Rows of slots, each folded with one round (rows from ``first`` on), built, or written back.

    Row r takes slot ``slots[r]``'s statistics; rows ``r >= first`` fold round ``r - first`` of ``k``, ``a``,
    ``U``, ``cost`` into them (:meth:`ObservationState.update`'s floats) -- into ``hypP`` / ``hypE``, the live
    blocks unchanged. With ``obs`` of one row per slot, every row is built at ``L[r]``, ``t[r]``
    (``build``'s floats); with ``scatter`` the rows are then written back to their slots (the fold of
    ``ObsSlots.update``: every row folded from the statistics as they were, a repeated slot keeping its
    last row). One kernel for :meth:`ObsSlots.what_if` (``first`` 0, built), ``ObsSlots.stacked``
    (``first`` = the step's rows, built) and ``ObsSlots.update`` (``first`` 0, not built, scattered).
    Returns False, with nothing written to the live blocks, when a round is outside the statistics'
    table (``k * K + a`` beyond it, a negative budget): the numpy form extends the table then.

    Args:
        stP: The live statistics' previous-round block (n_slots, 4).
        stE: Their statistics block (n_slots, 4 + kmax).
        slots: (rows,) int64 slot of each row (a slot may repeat).
        first: Rows before it are not folded.
        k: (rows - first,) budgets (integers; float64 or int64).
        a: (rows - first,) accepted drafts, likewise.
        U: (rows - first,) float64 unique experts of the round.
        cost: (rows - first,) float64 the round's cost (read when ``has_cost``).
        has_cost: False: each folded row takes its slot's last cost (1 before one) instead of ``cost``.
        L: (rows,) float64 context to build at (read when building).
        t: (rows,) float64 generated tokens to build at (likewise).
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
        hypP: (rows, 4) float64 out: the rows' previous-round block.
        hypE: (rows, 4 + kmax) float64 out: their statistics.
        obs: (rows, dim) float32 out, or (0, dim): not built.
        scatter: Write the rows back to their slots of the live blocks.
    """
    n = slots.shape[0]
    nE = stE.shape[1]
    for r in range(n - first):
        if k[r] < 0 or a[r] < 0 or int(k[r]) * K + int(a[r]) >= M.shape[0]:
            return False
    for r in range(n):
        s = slots[r]
        for j in range(4):
            hypP[r, j] = stP[s, j]
        if r < first:
            for j in range(nE):
                hypE[r, j] = stE[s, j]
            continue
        q = r - first
        idx = int(k[q]) * K + int(a[q])
        c = cost[q] if has_cost else (stP[s, 3] if stP[s, 3] > 0 else 1.0)
        # ObservationState.update: E = E * M[k, a] + A[k, a], then the cost-per-token term
        for j in range(nE):
            hypE[r, j] = stE[s, j] * M[idx, j]
        for j in range(nE):
            hypE[r, j] += A[idx, j]
        committed = a[q] + 1.0
        cpt = committed if committed > 1.0 else 1.0
        cpt = c / cpt
        cpt *= w
        hypE[r, 2] += cpt
        hypP[r, 0] = k[q]
        hypP[r, 1] = a[q]
        hypP[r, 2] = U[q]
        hypP[r, 3] = c
    if obs.shape[0]:
        c_ctx, c_prog, c_prev, c_stats = cols[0], cols[1], cols[2], cols[3]
        for r in range(n):
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
    if scatter:
        for r in range(n):
            s = slots[r]
            for j in range(4):
                stP[s, j] = hypP[r, j]
            for j in range(nE):
                stE[s, j] = hypE[r, j]
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


def mlp3(
    x: np.ndarray,
    W0: np.ndarray,
    b0: np.ndarray,
    W1: np.ndarray,
    b1: np.ndarray,
    W2: np.ndarray,
    b2: np.ndarray,
    relu: bool,
    out: np.ndarray,
) -> None:
    """The budgets of a three-layer MLP policy for each row of ``x`` (``MLPPolicy._act_rows``, one call).

    **Not bit for bit** with the numpy form: each dot product is summed in float64, in the order of the
    inputs, and rounded once to float32 (numpy's float32 matmul sums in BLAS's order in float32), and
    ``tanh`` is taken in float64 and rounded; the scores differ from numpy's by float32 rounding (about
    1e-6 relative), so an argmax may differ only where two scores tie to that precision
    (``tests/test_engine_kernels.py`` bounds both). A row with a non-finite score gets -1 (an invalid
    budget), as in the numpy form; ties go to the first maximum, as ``argmax``.

    Args:
        x: (n, dim) float32 observations.
        W0: First layer's float32 weights (in, out).
        b0: Its bias.
        W1: Second layer's weights.
        b1: Its bias.
        W2: Output layer's weights.
        b2: Its bias.
        relu: ReLU hidden activations (else tanh).
        out: (n,) int64 out: the budgets.
    """
    n = x.shape[0]
    h0 = np.empty(W0.shape[1], dtype=np.float32)
    h1 = np.empty(W1.shape[1], dtype=np.float32)
    sc = np.empty(W2.shape[1], dtype=np.float32)
    for r in range(n):
        for j in range(W0.shape[1]):
            acc = 0.0
            for i in range(W0.shape[0]):
                acc += np.float64(x[r, i]) * np.float64(W0[i, j])
            v = np.float32(np.float32(acc) + b0[j])
            if relu:
                h0[j] = v if (v > 0 or v != v) else np.float32(0.0)  # np.maximum(x, 0): NaN stays NaN
            else:
                h0[j] = np.float32(np.tanh(np.float64(v)))
        for j in range(W1.shape[1]):
            acc = 0.0
            for i in range(W1.shape[0]):
                acc += np.float64(h0[i]) * np.float64(W1[i, j])
            v = np.float32(np.float32(acc) + b1[j])
            if relu:
                h1[j] = v if (v > 0 or v != v) else np.float32(0.0)  # np.maximum(x, 0): NaN stays NaN
            else:
                h1[j] = np.float32(np.tanh(np.float64(v)))
        best = 0
        finite = True
        for j in range(W2.shape[1]):
            acc = 0.0
            for i in range(W2.shape[0]):
                acc += np.float64(h1[i]) * np.float64(W2[i, j])
            v = np.float32(np.float32(acc) + b2[j])
            sc[j] = v
            if not np.isfinite(v):
                finite = False
            elif v > sc[best]:
                best = j
        out[r] = best if finite else -1
