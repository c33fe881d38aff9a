"""The split rule of the batch bound: per-request charges whose sum never exceeds a step's cost."""

from __future__ import annotations

from typing import Any

import numpy as np

from oracle.dp import solve
from specenv.cost.batch import BatchCostModel
from specenv.cost.model import Charge, CostModel
from specenv.traces.traceset import PositionArrays


def _share(x: float, B: int) -> float:
    """A coefficient's per-request share: divided by B when >= 0, in full when negative."""
    return x / B if x >= 0 else x


def _step_intercepts(model: BatchCostModel, B: int, K: int, full: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every feasible (n, P) of a step and its ``beta0(P) + b_req (n-1)``.

    ``full``: steps of exactly n = B requests (every step before an episode's tail); else n in 1..B.
    Each request verifies 1..K+1 positions, so n <= P <= n (K+1).
    """
    K1 = K + 1
    n, P = np.meshgrid(np.arange(1, B + 1), np.arange(1, B * K1 + 1), indexing="ij")
    ok = (P >= n) & (P <= n * K1) & ((n == B) if full else True)
    n, P = n[ok].astype(np.float64), P[ok].astype(np.int64)
    return n, P.astype(np.float64), model.beta0[P - 1] + model.b_req * (n - 1)


def _near_lower_hull(x: np.ndarray, y: np.ndarray, tol: float) -> np.ndarray:
    """Indices (increasing) of the points (x, y) within ``tol`` (+ rounding) of their lower convex hull.

    A step's constraint ``n a + P b <= g`` reads ``a + b (P/n) <= g/n``: a feasible line through two
    points lies below every point, so both lie on the lower hull of the points (P/n, g/n) (within the
    feasibility tolerance). Only their pairs can be vertices; the rest are skipped, which keeps
    :func:`intercept_splits` fast at large batches (B = 64: 385 of 12544 points).
    """
    order = np.lexsort((y, x))
    hull: list[int] = []
    for idx in order:
        if hull and x[hull[-1]] == x[idx]:
            continue  # the same x with a larger y: above the lowest point
        while len(hull) >= 2:
            o, m = hull[-2], hull[-1]
            if (x[m] - x[o]) * (y[idx] - y[o]) - (y[m] - y[o]) * (x[idx] - x[o]) <= 0:
                hull.pop()
            else:
                break
        hull.append(int(idx))
    above = y - np.interp(x, x[hull], y[hull])
    return np.flatnonzero(above <= tol + 1e-9 * np.abs(y))


def intercept_splits(
    model: BatchCostModel, batch_size: int, kmax: int | None = None, full: bool = False
) -> list[tuple[float, float]]:
    """Linear intercept splits ``(a, b)``: a request verifying m positions pays ``a + b m``.

    Valid when ``n a + P b <= beta0(P) + b_req (n-1)`` for every feasible step (n <= B requests, or
    n = B with ``full``; P positions, n <= P <= n (kmax+1)): then the n requests of any such step pay
    at most its intercept. The feasible (a, b) form a polygon; its vertices that maximise ``a + b m``
    for some m in 1..kmax+1 are returned (each one gives a valid bound; :func:`batch_bound` keeps the
    best). Exact: the vertices are intersections of constraint pairs, kept when they satisfy every
    constraint (``a`` is lowered by any rounding excess, so the constraints hold exactly; n >= 1).
    """
    B = int(batch_size)
    K = model.kmax if kmax is None else int(kmax)
    n, P, g = _step_intercepts(model, B, K, full)
    scale = 1e-9 * (1.0 + np.abs(g).max())
    near = _near_lower_hull(P / n, g / n, 10.0 * scale)
    i, j = np.triu_indices(len(near), k=1)
    i, j = near[i], near[j]  # increasing indices: the pairs in the order of all pairs (same argmax below)
    det = n[i] * P[j] - n[j] * P[i]
    keep = det != 0
    i, j, det = i[keep], j[keep], det[keep]
    a = (g[i] * P[j] - g[j] * P[i]) / det
    b = (n[i] * g[j] - n[j] * g[i]) / det
    if not len(a):
        return []
    # the largest violation of each candidate over every step, in chunks (B = 64: 1e9 pairs x steps)
    rows = max(1, (1 << 22) // len(n))
    slack = np.concatenate(
        [
            np.max(n[None, :] * a[s : s + rows, None] + P[None, :] * b[s : s + rows, None] - g[None, :], axis=1)
            for s in range(0, len(a), rows)
        ]
    )
    feas = slack <= scale
    a, b, slack = a[feas], b[feas], slack[feas]
    if not len(a):
        return []
    a = a - np.maximum(slack, 0.0)  # n >= 1: lowering a by the excess restores every constraint
    out: list[tuple[float, float]] = []
    for m in np.linspace(1.0, K + 1.0, 4 * (K + 1) + 1):
        best = int(np.argmax(a + b * m))
        cand = (float(a[best]), float(b[best]))
        if cand not in out:
            out.append(cand)
    return out


def share_model(
    model: BatchCostModel,
    batch_size: int,
    kmax: int | None = None,
    split: tuple[float, float] | None = None,
    full: bool = False,
) -> CostModel:
    """The per-request charges l(k, U, L) of the split rule (module docstring) as a single-request cost model.

    Args:
        model: The batch cost model.
        batch_size: B, the most requests a step holds.
        kmax: Largest budget a request uses (default the model's).
        split: An intercept split ``(a, b)`` of :func:`intercept_splits` (request pays ``a + b m``);
            None: the rule ``h(m) = min (beta0(P) + b_req (n-1)) / B`` over the steps a request of m
            positions can be part of.
        full: Charges valid for steps of exactly B requests (every step before the episode's tail):
            such a step has ``m + B - 1 <= P <= m + (B-1)(kmax+1)`` for each of its requests, so every
            per-P minimum runs over that range only (much tighter than P >= m).

    Returns:
        A :class:`specenv.cost.model.CostModel` with ``charged_ms(k, U, L) = l(k, U, L)`` (no draft
        term of its own: D(k) is folded into ``beta0``), usable by :func:`oracle.dp.solve`.
    """
    B = int(batch_size)
    K = model.kmax if kmax is None else int(kmax)
    if B > model.max_batch:
        raise ValueError(f"batch_size={B}: the batch cost model covers at most {model.max_batch} requests")
    if K > model.kmax:
        raise ValueError(f"kmax={K}: the batch cost model covers k <= {model.kmax}")
    Pmax = B * (K + 1)
    n, P, g = _step_intercepts(model, B, K, full)
    g_of_P = np.full(Pmax, np.inf)
    np.minimum.at(g_of_P, P.astype(np.int64) - 1, g)
    theta = _union_share(model, B)
    beta0 = np.empty(K + 1)
    alpha = np.empty(K + 1)
    c = np.empty(K + 1)
    for k in range(K + 1):
        m = k + 1
        # the steps a request of m positions can be part of: P >= m (any n), or P in [m+B-1, m+(B-1)(K+1)]
        rng = slice(m + B - 2, m + (B - 1) * (K + 1)) if full else slice(m - 1, Pmax)
        if split is None:
            h = float(g_of_P[rng].min())
            h = h / B if (full or h >= 0) else h
        else:
            h = split[0] + split[1] * m
        draft = 0.0 if k == 0 else _share(model.d0, B) + _share(model.d_step, B) * k + model.d_tok * k
        beta0[k] = h + draft
        lo = float(model.alpha[rng].min())
        alpha[k] = lo * theta if lo >= 0 else lo
        c[k] = float(model.c[rng].min())
    return CostModel(
        beta0=beta0,
        alpha=alpha,
        c=c,
        d1=0.0,
        d0=0.0,
        top_k=model.top_k,
        n_experts=model.n_experts,
        n_layers=model.n_layers,
        source={"kind": "batch-share", "batch_size": B, "split": split, "full": full},
    )


def tail_model(general: CostModel, full: CostModel) -> CostModel:
    """Charges valid for every step: the coefficient-wise minimum of a general and a full-batch share.

    With U, L >= 0, ``min(beta0) + min(alpha) U + min(c) L`` is at most both charges.
    """
    return CostModel(
        beta0=np.minimum(general.beta0, full.beta0),
        alpha=np.minimum(general.alpha, full.alpha),
        c=np.minimum(general.c, full.c),
        d1=0.0,
        d0=0.0,
        top_k=general.top_k,
        n_experts=general.n_experts,
        n_layers=general.n_layers,
        source={"kind": "batch-share-tail"},
    )


def _union_share(model: BatchCostModel, B: int) -> float:
    """The share theta of a request's own U_i charged against the batch union (``sum_i theta U_i <= U_batch``).

    ``1/B`` always works (``U_batch >= max_i U_i >= sum_i U_i / B``, a property of every predictor of
    :mod:`specenv.cost.batch`). The ``"independent"`` predictor is the union of independent draws from
    n experts, ``U_batch = n (1 - prod_i (1 - U_i / n))``, which telescopes to
    ``sum_i U_i prod_{j<i} (1 - U_j / n) >= sum_i U_i (1 - U_hi / n)^(B-1)`` with ``U_hi`` the largest
    U a request can have (``(kmax+1) top_k``, at most n); for it the larger of the two shares is used.
    Other predictors get 1/B.
    """
    if model.predictor != "independent":
        return 1.0 / B
    n = float(model.n_experts)
    u_hi = min(float((model.kmax + 1) * model.top_k), n)
    return max(1.0 / B, (1.0 - u_hi / n) ** (B - 1))


class FairShare(Charge):
    """The cost a request induces in a full batch of B requests like it (an expert's cost, not a bound).

    ``l(k, U, L) = T_step(B copies of (k, U, L)) / B``: the batch cost model's step of B identical
    requests (their union predicted from B copies of U) divided by B, draft included (k drafted each).
    A :class:`specenv.cost.model.Charge` (``kmax``, ``charged_by_budget``, ``charged_table``, ``ar_ms``)
    for :func:`oracle.dp.solve` and :func:`oracle.dp.action_values`, so the single-request oracle under
    this charge is the
    per-request optimum of a request in a full batch of its like (the imitation expert of
    :mod:`policies.batch.learn`).

    Args:
        model: The batch cost model.
        batch_size: B.
    """

    def __init__(self, model: BatchCostModel, batch_size: int):
        self.model = model
        self.B = int(batch_size)
        self.top_k = model.top_k

    @property
    def kmax(self) -> int:
        """Largest budget covered."""
        return self.model.kmax

    def charged_by_budget(
        self, U: np.ndarray, L: np.ndarray, lookahead: int = 0, out: np.ndarray | None = None, drafting: Any = None
    ) -> np.ndarray:
        """(kmax+1, n) charges, row k = budget k (``lookahead``/``drafting`` ignored: k drafted)."""
        B, m = self.B, self.model
        res = np.empty(U.shape) if out is None else out
        L = np.asarray(L, dtype=np.float64)
        for k in range(U.shape[0]):
            ub = m.predict_u_batch_many(np.repeat(np.asarray(U[k], dtype=np.float64)[:, None], B, axis=1))
            draft = m.draft_ms(np.full(B, k, dtype=np.int64))
            res[k] = (m.verify_from_totals(B * (k + 1), B, ub, B * L) + draft) / B
        return res

    def ar_ms(self, L: np.ndarray) -> np.ndarray:
        """Plain AR step of a full batch, per request."""
        L = np.asarray(L, dtype=np.float64)
        ub = self.model.predict_u_batch(np.full(self.B, float(self.top_k)))
        return self.model.verify_from_totals(self.B, self.B, ub, self.B * L) / self.B


def _episode_costs(full: np.ndarray, tail: np.ndarray, B: int) -> np.ndarray:
    """Lower bound per episode from per-request costs under the full-batch and the tail charges.

    ``full``, ``tail``: (E, R). At most B-1 requests are still running when an episode's tail (the
    steps with fewer than B requests) begins; their rounds are charged ``tail``, every other round
    ``full``. The set is not known in advance, so the bound subtracts the B-1 largest differences.
    """
    diff = np.sort(full - tail, axis=1)[:, ::-1]
    return full.sum(axis=1) - diff[:, : max(B - 1, 0)].sum(axis=1)


def expected_costs(
    arrays: PositionArrays, model: BatchCostModel, batch_size: int, generations: np.ndarray
) -> tuple[np.ndarray, CostModel, CostModel, tuple[float, float] | None]:
    """Lower bounds on the expected cost of episodes whose requests serve these generations.

    Args:
        arrays: Positions table.
        model: The batch cost model.
        batch_size: B.
        generations: (E, R) generation index of every request, in arrival order.

    Returns:
        ``(costs (E,), full-batch charges, tail charges, the full-batch split kept)`` (see :func:`batch_bound`).
    """
    B = int(batch_size)
    K = arrays.kmax
    gens = np.atleast_2d(np.asarray(generations, dtype=np.int64))
    general, gen_total = None, -np.inf
    for split in [None, *intercept_splits(model, B, K)]:
        cand = share_model(model, B, K, split)
        total = float(solve(arrays, cand).cost[gens].sum())
        if total > gen_total:
            general, gen_total = cand, total
    assert general is not None
    best = None
    for split in [None, *intercept_splits(model, B, K, full=True)]:
        full = share_model(model, B, K, split, full=True)
        tail = tail_model(general, full)
        costs = _episode_costs(solve(arrays, full).cost[gens], solve(arrays, tail).cost[gens], B)
        if best is None or costs.sum() > best[0].sum():
            best = (costs, full, tail, split)
    assert best is not None
    return best
