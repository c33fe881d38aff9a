"""TETRIS's greedy draft-token selection: a compiled approximate search whose every decision is checked exactly.

The rule (:class:`policies.batch.controllers.TetrisBatch`): starting from no draft, repeatedly add
the drafted token (request i's next position) of the largest ``(tokens + S_i) / cost_i``, with
``cost_i`` the batch cost model's price of the step with that token added, while that raises the
step's goodput ``tokens / cost``. :func:`reference` is that loop as written: every candidate step
priced by ``step_ms_many`` (the batch model's U_batch predictor reduces each candidate's n
requests), O(n) per candidate, O(n^2) per pick, O(n^3 h) per step: about 0.1 s per step at
B = 64, h = 10, where ``specenv bench --batch 64`` spent minutes.

:func:`select` gives the same budgets, bit for bit, in a small share of that:

1. :func:`_search` (compiled with numba) runs the same loop with every candidate priced in O(1)
   from the step's two reductions (the largest request's U and the sum of ``log1p(-U_i / n)``,
   updated for the one request that changes), and records, for every pick and for the final
   stop, the candidates whose approximate score is within :data:`NEAR` of the best;
2. those candidates are priced exactly, all in one ``step_ms_many`` call (the reference's own
   function on the same rows, so the same bits);
3. every decision is checked against those exact figures: the pick is the first exact maximum
   (np.argmax's tie rule), it raises the goodput, and the final stop does not. The updated sum
   differs from a fresh one by rounding (~1e-15 relative) and :data:`NEAR` is 1e-9, so the
   reference's choice is always among the recorded candidates; if any check fails anyway (or a
   count covers every expert, or numba is off) the step runs :func:`reference`.

Same kernel conventions as :mod:`specenv.envs.vector_kernel`: numba imported on first use through
:mod:`specenv.numba_support` (``SPECENV_NUMBA=0`` runs :func:`reference` everywhere), ``cache=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from specenv import numba_support
from specenv.cost.batch import BatchCostModel

__all__ = ["NEAR", "reference", "select"]

#: Relative gap below which an approximate score may hide the exact best (the update's rounding is ~1e-15).
NEAR = 1e-9

#: ``step_ms_many(k (candidates, n), drafted (n,), ctx (n,)) -> (candidates,)``: the exact price of candidate steps.
Pricer = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]

_KERNEL: Any = None


def _kernel() -> Any:
    """The compiled :func:`_search`, or None without numba (or with ``SPECENV_NUMBA=0``)."""
    global _KERNEL
    if not numba_support.enabled():
        return None
    if _KERNEL is None:
        numba = numba_support.numba_module()
        _KERNEL = False if numba is None else numba.njit(cache=True, nogil=True)(_search)
    return _KERNEL or None


def reference(surv: np.ndarray, h: int, drafted: np.ndarray, ctx: np.ndarray, price: Pricer) -> np.ndarray:
    """The greedy loop as the rule states it (module docstring): every candidate priced exactly at every pick."""
    n = len(surv)
    k = np.zeros(n, dtype=np.int64)
    tokens = float(n)
    cost = float(price(k[None, :], drafted, ctx)[0])
    eye = np.eye(n, dtype=np.int64)
    while True:
        cand = np.flatnonzero(k < h)
        if not len(cand):
            break
        c = price(k[None, :] + eye[cand], drafted, ctx)
        val = (tokens + surv[cand, k[cand]]) / c
        j = int(np.argmax(val))
        if val[j] <= tokens / cost:
            break
        pick = int(cand[j])
        tokens += surv[pick, k[pick]]
        k[pick] += 1
        cost = float(c[j])
    return k


def select(
    surv: np.ndarray,
    h: int,
    drafted: np.ndarray,
    ctx: np.ndarray,
    price: Pricer,
    model: BatchCostModel,
    u_prior: np.ndarray,
) -> np.ndarray:
    """The budgets of :func:`reference`, from the compiled search checked exactly (module docstring).

    Args:
        surv: (n, h) the requests' draft survival estimates ``prod_{i<=j} q_i``.
        h: Drafted tokens per request (the lookahead).
        drafted: (n,) tokens each request drafted (the draft term of every candidate).
        ctx: (n,) context lengths.
        price: The exact price of candidate steps (``_CostBatch.step_ms_many``).
        model: The batch cost model ``price`` uses.
        u_prior: The U(k) ``price`` uses, k = 0..h at least.
    """
    kernel = _kernel()
    if model.predictor == "pooled" or model.b_odd_query:  # terms the compiled stepper does not price
        kernel = None
    surv = np.ascontiguousarray(surv, dtype=np.float64)
    n = len(surv)
    if kernel is None or n == 0:
        return reference(surv, h, drafted, ctx, price)
    n_exp = float(model.n_experts)
    u = np.where(np.isnan(u_prior), 0.0, np.clip(np.asarray(u_prior, dtype=np.float64), 0.0, n_exp))
    with np.errstate(divide="ignore"):
        logs = np.log1p(-u / n_exp)
    if not np.all(np.isfinite(logs[: h + 1])):  # a count covering every expert: no O(1) update
        return reference(surv, h, drafted, ctx, price)
    theta = 1.0 if model.predictor == "independent" else float(model.u_theta)
    draft = float(model.draft_ms(np.asarray(drafted, dtype=np.int64)))
    coef = (u, logs, n_exp, theta, model.beta0, model.alpha, model.c, float(model.b_req), float(np.sum(ctx)), draft)
    k = np.zeros(n, dtype=np.int64)
    tokens = float(n)
    cost = float(price(k[None, :], drafted, ctx)[0])
    while True:  # one compiled run per segment; a segment ends at the first decision the exact figures overturn
        picks, near, starts, stopped = kernel(surv, int(h), k.copy(), tokens, cost, *coef, NEAR)
        if stopped < 0:
            return reference(surv, h, drafted, ctx, price)
        ok, pick, tokens, cost = _check(surv, k, tokens, cost, picks, near, starts, bool(stopped), drafted, ctx, price)
        if ok < 0:
            return reference(surv, h, drafted, ctx, price)
        np.add.at(k, picks[:ok], 1)
        if pick < 0:  # the reference stops here (or every candidate is spent)
            return k
        k[pick] += 1  # the exact decision where the search's was overturned (a near-tie): go on from there


def _check(
    surv: np.ndarray,
    k: np.ndarray,
    tokens: float,
    cost: float,
    picks: np.ndarray,
    near: np.ndarray,
    starts: np.ndarray,
    stopped: bool,
    drafted: np.ndarray,
    ctx: np.ndarray,
    price: Pricer,
) -> tuple[int, int, float, float]:
    """The search's decisions from budgets ``k`` checked on the exact figures (module docstring, steps 2-3).

    Returns:
        ``(ok, pick, tokens, cost)``: the first ``ok`` picks are the reference's; then the
        reference's next decision, ``pick`` (-1: it stops, or no candidate is left), and the
        running ``tokens`` and exact ``cost`` of the step once it is taken (the reference's floats).
    """
    n, L = len(surv), len(picks)
    T = len(starts) - 1  # decisions: one per pick, plus the stop when the search stopped with candidates left
    if T == 0:  # no candidate left
        return 0, -1, tokens, cost
    steps = np.zeros((L + 1, n), dtype=np.int64)
    steps[0] = k
    steps[np.arange(1, L + 1), picks] = 1
    states = np.cumsum(steps, axis=0)  # the budgets before decision t
    gains = surv[picks, states[np.arange(L), picks]]
    run = np.cumsum(np.concatenate([[tokens], gains]))  # the reference's running sum, in its order
    group = np.repeat(np.arange(T), np.diff(starts))
    rows = states[group].copy()
    rows[np.arange(len(near)), near] += 1
    c = price(rows, drafted, ctx)
    val = (run[group] + surv[near, states[group, near]]) / c
    best = np.maximum.reduceat(val, starts[:-1])
    top = np.flatnonzero(val == best[group])
    first = top[np.unique(group[top], return_index=True)[1]]  # each decision's first exact maximum
    if len(first) != T:  # a NaN price: the caller runs the reference
        return -1, -1, tokens, cost
    costs = np.concatenate([[cost], c[first]])  # the step's exact cost before decision t
    goes = best > run[:T] / costs[:T]  # the reference takes its best candidate at decision t
    agree = goes[:L] & (near[first[:L]] == picks)
    ok = L if agree.all() else int(np.argmin(agree))
    if ok == L and (not stopped or not goes[T - 1]):
        return L, -1, float(run[L]), float(costs[L])
    if not goes[ok]:
        return ok, -1, float(run[ok]), float(costs[ok])
    pick = int(near[first[ok]])
    return ok, pick, float(run[ok] + surv[pick, states[ok, pick]]), float(c[first[ok]])


def _search(
    surv: np.ndarray,
    h: int,
    k: np.ndarray,
    tokens: float,
    cost: float,
    u: np.ndarray,
    logs: np.ndarray,
    n_exp: float,
    theta: float,
    beta0: np.ndarray,
    alpha: np.ndarray,
    cc: np.ndarray,
    b_req: float,
    ctx_sum: float,
    draft: float,
    near: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:  # pragma: no cover - compiled (checked by _check)
    """The greedy search from budgets ``k`` (changed in place) with O(1) candidate prices (module docstring, step 1).

    Returns:
        ``(picks, near, starts, stopped)``: the request of each pick; the candidates within ``near``
        of the best at each decision, decision t's at ``near[starts[t]:starts[t+1]]``; 1 when the
        last decision is a stop, 0 when no candidate was left, -1 when a price is not finite.
    """
    n, _ = surv.shape
    picks = np.empty(n * h, dtype=np.int64)
    out = np.empty(n * (n * h + 1), dtype=np.int64)
    starts = np.zeros(n * h + 2, dtype=np.int64)
    val = np.empty(n)
    T = 0
    P = n
    for i in range(n):
        P += k[i]
    stopped = 0
    while True:
        s = 0.0
        i1 = 0
        for i in range(n):
            s += logs[k[i]]
            if u[k[i]] > u[k[i1]]:
                i1 = i
        top1 = u[k[i1]]
        top2 = 0.0
        for i in range(n):
            if i != i1 and u[k[i]] > top2:
                top2 = u[k[i]]
        P += 1  # every candidate verifies one more position
        fixed = beta0[P - 1] + cc[P - 1] * ctx_sum + b_req * (n - 1.0) + draft
        best = -np.inf
        j = -1
        for i in range(n):
            if k[i] >= h:
                continue
            other = top2 if i == i1 else top1
            un = u[k[i] + 1]
            top = un if un > other else other
            rest = s - logs[k[i]] + logs[k[i] + 1] - np.log1p(-top / n_exp)
            ub = n_exp * (1.0 - (1.0 - top / n_exp) * np.exp(theta * rest))
            val[i] = (tokens + surv[i, k[i]]) / (fixed + alpha[P - 1] * ub)
            if not np.isfinite(val[i]):
                return picks[:0], out[:0], starts[:1], -1
            if val[i] > best:
                best = val[i]
                j = i
        if j < 0:
            break
        m = starts[T]
        for i in range(n):
            if k[i] < h and val[i] >= best - near * abs(best):
                out[m] = i
                m += 1
        T += 1
        starts[T] = m
        gain = tokens + surv[j, k[j]]
        if best <= tokens / cost:
            stopped = 1
            break
        cost = gain / best
        tokens = gain
        picks[T - 1] = j
        k[j] += 1
    return picks[: T - stopped], out[: starts[T]], starts[: T + 1], stopped
