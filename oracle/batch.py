"""An exact upper bound on the speedup of any batch controller, and the brute-force joint optimum.

The batch episode (DESIGN.md section 3, "batch environment"; :mod:`specenv.batchreplay`): R requests
served through B slots, one verification step for all active requests at a time, priced by a
:class:`specenv.batchcost.BatchCostModel`::

    T_step = beta0(P) + alpha(P) * U_batch + c(P) * sum_i L_i + b_req * (n - 1)
             + [any drafted] * (d0 + d_step * max_i d_i + d_tok * sum_i d_i)

with n <= B active requests, P = sum_i (k_i + 1) and d_i the tokens request i drafted (d_i >= k_i in
every drafting mode). The exact joint optimum is an SSP over the joint state of B requests
(:func:`joint_optimum` solves it by brute force on tiny cases only).

**The split rule** (:func:`share_model`). Each request i is charged

    l(k_i, U_i, L_i) = h(m_i) + a(m_i) * U_i + g(m_i) * L_i + D(k_i),      m_i = k_i + 1,

and for every step the sum of the charges of its requests is at most the step's cost:

* intercept: ``h(m) = min { beta0(P) + b_req * (n-1) : P >= m, 1 <= n <= B, n <= P <= n (kmax+1) } / B``
  (>= 0 terms only; a negative minimum is kept undivided). Each request of the step has m_i <= P,
  so h(m_i) <= (beta0(P) + b_req (n-1)) / B and the n <= B requests sum to at most the step's term;
* experts: ``a(m) = min_{P >= m} alpha(P) / B`` when that minimum is >= 0. Then
  ``sum_i a(m_i) U_i <= alpha(P) * sum_i U_i / B <= alpha(P) * max_i U_i <= alpha(P) * U_batch``,
  because the batch union is at least every request's own set (``U_batch >= max_i U_i``, which every
  predictor of :mod:`specenv.batchcost` satisfies) and n <= B. A negative minimum is charged in full
  (``U_batch <= sum_i U_i``);
* context: ``g(m) = min_{P >= m} c(P)``: ``sum_i g(m_i) L_i <= c(P) * sum_i L_i`` (L_i >= 0);
* draft, with d_i = k_i (the least any mode drafts): ``D(k) = (d0 + d_step * k) / B + d_tok * k`` for
  k >= 1 and D(0) = 0, since ``max_i d_i >= sum_i d_i / B`` and at most B requests share the d0 of
  the step (a negative coefficient is charged in full instead of divided).

**Full steps and the tail.** Every step before an episode's tail holds exactly B requests (a finished
request's slot is refilled at the next step while requests wait), so in such a step each request's
m_i satisfies ``m_i + B - 1 <= P <= m_i + (B-1)(kmax+1)``: the full-batch charges (``full=True``)
take every minimum over that range only and divide by exactly B, which is much tighter. At most B-1
requests are still running when the tail (steps of fewer than B requests) begins; they are charged
the coefficient-wise minimum of both charges (:func:`tail_model`) for their whole life. Which
requests those are depends on the policy, so the bound subtracts the B-1 largest differences
between a request's full-batch and tail optima (:func:`expected_costs`).

So the cost of every step is at least the sum of its requests' charges, and the cost of the whole
episode is at least the sum over requests of the charges of that request's own rounds. Those
rounds form a single-request policy (one that may look at the other requests, i.e. a randomised
history-dependent policy of the single-request SSP), whose expected cost is at least the optimum
V_r(0) of the single-request SSP with round cost l: the exact oracle of :mod:`oracle.dp` run with
``share_model`` (a :class:`specenv.costmodel.CostModel` whose ``charged_table`` is l). Hence

* **expected bound**: ``E[episode cost] >= sum_r V_{g_r}(0)`` for every policy, and the speedup
  AR / E[cost] is at most ``AR / sum_r V_{g_r}(0)`` (AR, the same requests decoded without
  speculation under the same schedule, depends on the requests only:
  :func:`specenv.batchreplay.ar_schedule_ms`);
* **pathwise bound** (:func:`pathwise_costs`): with the request's acceptance uniforms fixed (round
  j of request r uses its j-th uniform, :func:`specenv.batchreplay.request_draws`), the least total
  charge over all budget sequences is a deterministic shortest path over (position, round); every
  policy's realised cost of that episode is at least the sum of these, so the bound holds episode by
  episode, for stochastic traces too. For greedy traces (rho in {0, 1}) the two coincide.

Both bound every drafting mode (a mode that drafts more pays more). The bound is loose where the
split is: the intercept and the expert cost are shared by n <= B requests but charged as if every
step were full, and the batch union is charged as the mean of the requests' own sets. The tests
measure the gap to :func:`joint_optimum` on small cases.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from oracle.dp import solve
from specenv.batchcost import BatchCostModel
from specenv.batchreplay import ar_schedule_ms, request_draws
from specenv.costmodel import CostModel
from specenv.traceset import PositionArrays

__all__ = [
    "BatchBound",
    "FairShare",
    "batch_bound",
    "expected_costs",
    "intercept_splits",
    "joint_optimum",
    "pathwise_costs",
    "share_model",
    "tail_model",
]


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
        A :class:`specenv.costmodel.CostModel` with ``charged_ms(k, U, L) = l(k, U, L)`` (no draft
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
    :mod:`specenv.batchcost`). The ``"independent"`` predictor is the union of independent draws from
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


class FairShare:
    """The cost a request induces in a full batch of B requests like it (an expert's cost, not a bound).

    ``l(k, U, L) = T_step(B copies of (k, U, L)) / B``: the batch cost model's step of B identical
    requests (their union predicted from B copies of U) divided by B, draft included (k drafted each).
    It quacks like a :class:`specenv.costmodel.CostModel` for :func:`oracle.dp.solve` and
    :func:`oracle.dp.action_values` (``kmax``, ``charged_by_budget``, ``charged_table``, ``ar_ms``),
    so the single-request oracle under this charge is the
    per-request optimum of a request in a full batch of its like (the imitation expert of
    :mod:`policies.batchlearn`).

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

    def charged_table(
        self, U: np.ndarray, L: np.ndarray, kmax: int | None = None, lookahead: int = 0, drafting: Any = None
    ) -> np.ndarray:
        """(n, kmax+1) charges, as :meth:`specenv.costmodel.CostModel.charged_table`."""
        K = U.shape[1] - 1 if kmax is None else int(kmax)
        return np.ascontiguousarray(self.charged_by_budget(np.array(U[:, : K + 1].T, dtype=np.float64), L).T)

    def ar_ms(self, L: np.ndarray) -> np.ndarray:
        """Plain AR step of a full batch, per request."""
        L = np.asarray(L, dtype=np.float64)
        ub = self.model.predict_u_batch(np.full(self.B, float(self.top_k)))
        return self.model.verify_from_totals(self.B, self.B, ub, self.B * L) / self.B


def pathwise_costs(arrays: PositionArrays, share: CostModel, g: int, uniforms: np.ndarray) -> float:
    """Least total charge of generation ``g`` given its acceptance uniforms (the pathwise bound of one request).

    Round j of the request (j = 0, 1, ...) accepts ``#{i <= k : u_j < P(a >= i | t)}`` drafts, capped at
    the end, as :func:`specenv.envs.replay.play_round` does. Solved by backward induction over the
    position t and the round index j <= t.

    Args:
        arrays: Positions table (budgets 0..arrays.kmax).
        share: The charges (:func:`share_model`).
        g: Generation index in ``arrays``.
        uniforms: (N,) the request's uniforms (:func:`specenv.batchreplay.request_draws`).

    Returns:
        The least total charge in ms.
    """
    lo, hi = int(arrays.offsets[g]), int(arrays.offsets[g + 1])
    N = hi - lo
    K = arrays.kmax
    S = arrays.survival()[lo:hi]  # (N, K)
    C = share.charged_table(arrays.U[lo:hi], arrays.L[lo:hi], K)  # (N, K+1)
    u = np.asarray(uniforms, dtype=np.float64)[:N]
    # V[t, j]: least charge from position t at round j (j <= t); V[N, :] = 0
    V = np.zeros((N + 1, N + 1))
    for t in range(N - 1, -1, -1):
        j = np.arange(t + 1)
        # accepted drafts for each k and each round j: count of leading u_j < S[t, i]
        passes = u[j][:, None] < S[t][None, :]  # (t+1, K)
        lead = np.cumprod(passes, axis=1).sum(axis=1)  # leading run length (0..K)
        best = np.full(t + 1, np.inf)
        for k in range(K + 1):
            a = np.minimum(np.minimum(lead, k), N - t - 1)
            val = C[t, k] + V[t + a + 1, j + 1]
            np.minimum(best, val, out=best)
        V[t, : t + 1] = best
    return float(V[0, 0])


@dataclass
class BatchBound:
    """The bound of a set of batch episodes (module docstring).

    Attributes:
        batch_size: B.
        seeds: (E, R) request seeds of each episode.
        generations: (E, R) generation index of each request.
        ar: (E,) AR cost of each episode (ms).
        expected: (E,) lower bound on the expected cost (sum of single-request SSP optima).
        pathwise: (E,) lower bound on the realised cost of that episode (None when not computed).
        split: The full-batch intercept split that gave the largest bound (None: the min rule).
    """

    batch_size: int
    seeds: np.ndarray
    generations: np.ndarray
    ar: np.ndarray
    expected: np.ndarray
    pathwise: np.ndarray | None
    split: tuple[float, float] | None = None

    @property
    def speedup_expected(self) -> np.ndarray:
        """(E,) upper bound on AR / E[cost] per episode."""
        return self.ar / self.expected

    @property
    def speedup_pathwise(self) -> np.ndarray | None:
        """(E,) upper bound on the realised AR / cost of each episode."""
        return None if self.pathwise is None else self.ar / self.pathwise

    def summary(self) -> dict[str, Any]:
        """Plain-JSON headline numbers (pooled: sum AR / sum bound cost)."""
        out = {
            "batch_size": self.batch_size,
            "episodes": int(len(self.ar)),
            "speedup_pooled_expected": float(self.ar.sum() / self.expected.sum()),
        }
        if self.pathwise is not None:
            out["speedup_pooled_pathwise"] = float(self.ar.sum() / self.pathwise.sum())
        return out


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


def batch_bound(
    arrays: PositionArrays,
    L0: np.ndarray,
    model: BatchCostModel,
    batch_size: int,
    seeds: np.ndarray,
    pathwise: bool = True,
) -> BatchBound:
    """The expected and pathwise bounds of the episodes with these request seeds.

    Every step before an episode's tail holds exactly B requests (a finished request's slot is refilled
    at the next step while requests are waiting), so those rounds are charged by the full-batch share
    (:func:`share_model` with ``full=True``); the at most B-1 requests running when the tail begins
    are charged by :func:`tail_model` for their whole life (it is below both charges). Every intercept
    split of :func:`intercept_splits` gives a valid bound; the largest total over these episodes is kept.

    Args:
        arrays: The split's positions table (the environment's: ``select_positions``).
        L0: (G,) prompt lengths of its generations.
        model: The batch cost model.
        batch_size: B.
        seeds: (E, R) request seeds of each episode (the environment's ``info["seeds"]``).
        pathwise: Also compute the pathwise bound (one shortest path per request and charge).

    Returns:
        The :class:`BatchBound`.
    """
    B = int(batch_size)
    seeds = np.atleast_2d(np.asarray(seeds, dtype=np.int64))
    E, R = seeds.shape
    lengths = arrays.lengths
    gens = np.array([[request_draws(int(s), lengths)[0] for s in row] for row in seeds], dtype=np.int64)
    expected, full, tail, chosen = expected_costs(arrays, model, B, gens)
    paths = None
    if pathwise:
        if arrays.greedy:
            paths = expected.copy()
        else:
            pf = np.empty((E, R))
            pt = np.empty((E, R))
            cache: dict[int, tuple[float, float]] = {}
            for e in range(E):
                for r in range(R):
                    key = int(seeds[e, r])
                    if key not in cache:
                        g, u = request_draws(key, lengths)
                        cache[key] = (pathwise_costs(arrays, full, g, u), pathwise_costs(arrays, tail, g, u))
                    pf[e, r], pt[e, r] = cache[key]
            paths = _episode_costs(pf, pt, B)
    ar = np.array([ar_schedule_ms(model, gens[e], lengths, L0, B) for e in range(E)])
    return BatchBound(B, seeds, gens, ar, expected, paths, chosen)


def joint_optimum(
    arrays: PositionArrays,
    L0: np.ndarray,
    model: BatchCostModel,
    batch_size: int,
    generations: list[int],
    drafting: str = "none",
) -> float:
    """The exact optimal expected cost of a tiny batch episode, by brute force (expectimax).

    The joint state is the (request, position) of every slot and the next request to admit; each
    step enumerates every joint budget vector and every joint acceptance outcome. Exponential in B:
    for tests on a few short generations only.

    Args:
        arrays: Positions table.
        L0: (G,) prompt lengths (context = L0 + t, as the environment).
        model: The batch cost model (U_batch predicted from the requests' own U).
        batch_size: B.
        generations: The requests' generation indices in arrival order.
        drafting: ``"none"`` (request i drafts k_i) or ``"sequential"`` (the same charge).

    Returns:
        The optimal expected episode cost in ms.
    """
    if drafting not in ("none", "sequential"):
        raise ValueError(f"drafting={drafting!r}: the brute force charges modes none and sequential")
    K = arrays.kmax
    S = arrays.survival()
    lengths = arrays.lengths
    gens = list(generations)
    R = len(gens)

    def outcomes(g: int, t: int, k: int) -> list[tuple[float, int]]:
        """(probability, committed) of a round with budget k at position t of generation g."""
        row = int(arrays.offsets[g]) + t
        surv = [1.0] + [float(S[row, i]) for i in range(k)] + [0.0]
        n_left = int(lengths[g]) - t
        out: dict[int, float] = {}
        for a in range(k + 1):
            p = surv[a] - surv[a + 1]
            if p > 0:
                c = min(a + 1, n_left)
                out[c] = out.get(c, 0.0) + p
        return [(p, c) for c, p in out.items()]

    @cache
    def V(slots: tuple[tuple[int, int], ...], nxt: int) -> float:
        # admit requests into free slots (lowest first), as the environment does
        sl = list(slots)
        for s in range(batch_size):
            if sl[s][0] < 0 and nxt < R:
                sl[s] = (nxt, 0)
                nxt += 1
        active = [s for s in range(batch_size) if sl[s][0] >= 0]
        if not active:
            return 0.0
        best = np.inf
        for ks in itertools.product(range(K + 1), repeat=len(active)):
            k = np.array(ks, dtype=np.int64)
            rows = [int(arrays.offsets[gens[sl[s][0]]]) + sl[s][1] for s in active]
            u = np.array([arrays.U[r, kk] for r, kk in zip(rows, ks, strict=True)])
            ctx = np.array([L0[gens[sl[s][0]]] + sl[s][1] for s in active], dtype=np.float64)
            cost = model.step_ms(k, k, u, ctx)
            per = [outcomes(gens[sl[s][0]], sl[s][1], kk) for s, kk in zip(active, ks, strict=True)]
            exp = 0.0
            for combo in itertools.product(*per):
                p = 1.0
                new = list(sl)
                for s, (pi, c) in zip(active, combo, strict=True):
                    p *= pi
                    req, t = new[s]
                    t += c
                    new[s] = (-1, 0) if t >= lengths[gens[req]] else (req, t)
                exp += p * V(tuple(new), nxt)
            best = min(best, cost + exp)
            if best == -np.inf:  # pragma: no cover
                break
        return float(best)

    return V(tuple((-1, 0) for _ in range(batch_size)), 0)
