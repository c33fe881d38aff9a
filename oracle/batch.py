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

Both bound every drafting mode (a mode that drafts more pays more). The split rule is loose where the
split is: the intercept and the expert cost are shared by n <= B requests but charged as if every
step were full, and the batch union is charged as the mean of the requests' own sets. The tests
measure the gap to :func:`joint_optimum` on small cases.

**The Lagrangian bound** (``method="lagrangian"``, the default of :func:`batch_bound`; the split rule
above is ``method="linear"``). The same argument with three tighter charges (DESIGN.md section 4):

* the step's intercept and draft terms are split as ``x[k_i]``, one number per budget, under the exact
  constraint ``sum_i x[k_i] <= beta0(P) + b_req (n-1) + d0 + d_step max_i k_i + d_tok sum_i k_i`` for
  every budget multiset of a step (:func:`_multisets`); the best x for the episodes' requests
  maximises a concave function (the summed single-request optima) and is found by Kelley's cutting
  planes (:func:`lagrangian_split`); every iterate is a valid split;
* the expert term by the chord of the concave lower bound ``n (1 - exp(-theta sum_i w(U_i)))`` of the
  predicted union (:func:`expert_share`), when it charges more than the split rule's ``U_i / B``;
* the tail split need only hold on steps of 1..B-1 requests, and a request running when the tail
  begins is charged the full-batch split until then (:func:`switch_costs`: the least charge over every
  switching time).

Per episode the larger of the two bounds is kept, so the Lagrangian bound is never looser.
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
from specenv.costmodel import Charge, CostModel
from specenv.traceset import PositionArrays

__all__ = [
    "METHODS",
    "BatchBound",
    "FairShare",
    "SplitCharge",
    "batch_bound",
    "expected_costs",
    "intercept_splits",
    "expert_share",
    "joint_optimum",
    "lagrangian_costs",
    "lagrangian_split",
    "switch_costs",
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


class FairShare(Charge):
    """The cost a request induces in a full batch of B requests like it (an expert's cost, not a bound).

    ``l(k, U, L) = T_step(B copies of (k, U, L)) / B``: the batch cost model's step of B identical
    requests (their union predicted from B copies of U) divided by B, draft included (k drafted each).
    A :class:`specenv.costmodel.Charge` (``kmax``, ``charged_by_budget``, ``charged_table``, ``ar_ms``)
    for :func:`oracle.dp.solve` and :func:`oracle.dp.action_values`, so the single-request oracle under
    this charge is the
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


def pathwise_costs(
    arrays: PositionArrays,
    share: Charge,
    g: int,
    uniforms: np.ndarray,
    exit: np.ndarray | None = None,
    table: bool = False,
) -> Any:
    """Least total charge of generation ``g`` given its acceptance uniforms (the pathwise bound of one request).

    Round j of the request (j = 0, 1, ...) accepts ``#{i <= k : u_j < P(a >= i | t)}`` drafts, capped at
    the end, as :meth:`specenv.episode.Episode.play` does. Solved by backward induction over the
    position t and the round index j <= t.

    Args:
        arrays: Positions table (budgets 0..arrays.kmax).
        share: The charges (:func:`share_model`).
        g: Generation index in ``arrays``.
        uniforms: (N,) the request's uniforms (:func:`specenv.batchreplay.request_draws`).
        exit: Optional (N+1, N+1) table: from (t, j) the request may instead switch to a charge whose
            least total from there is ``exit[t, j]`` (the tail phase of :func:`lagrangian_costs`).
        table: Return the whole (N+1, N+1) table ``V[t, j]`` instead of ``V[0, 0]``.

    Returns:
        The least total charge in ms (or the table).
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
        if exit is not None:
            np.minimum(best, exit[t, : t + 1], out=best)
        V[t, : t + 1] = best
    return V if table else float(V[0, 0])


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
        split: The split rule's full-batch intercept split that gave its largest bound (None: the min rule).
        method: ``"lagrangian"`` or ``"linear"`` (:data:`METHODS`).
        linear_expected: (E,) the split rule's expected bound (equal to ``expected`` for ``"linear"``).
        linear_pathwise: (E,) the split rule's pathwise bound (None when not computed).
    """

    batch_size: int
    seeds: np.ndarray
    generations: np.ndarray
    ar: np.ndarray
    expected: np.ndarray
    pathwise: np.ndarray | None
    split: tuple[float, float] | None = None
    method: str = "linear"
    linear_expected: np.ndarray | None = None
    linear_pathwise: np.ndarray | None = None

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
            "method": self.method,
            "speedup_pooled_expected": float(self.ar.sum() / self.expected.sum()),
        }
        if self.pathwise is not None:
            out["speedup_pooled_pathwise"] = float(self.ar.sum() / self.pathwise.sum())
        return out

    def linear_summary(self) -> dict[str, Any]:
        """The split rule's headline numbers from the same run (:meth:`summary` of ``method="linear"``)."""
        lin = BatchBound(
            self.batch_size,
            self.seeds,
            self.generations,
            self.ar,
            self.expected if self.linear_expected is None else self.linear_expected,
            self.pathwise if self.linear_pathwise is None else self.linear_pathwise,
            self.split,
            "linear",
        )
        return lin.summary()


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
    method: str = "lagrangian",
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
        method: ``"lagrangian"`` (default): per episode the larger of the split rule's bound and the
            Lagrangian splits' (:func:`lagrangian_costs`), so never looser than ``"linear"``, the split
            rule alone (:func:`expected_costs`, the bound before the Lagrangian splits).

    Returns:
        The :class:`BatchBound`.
    """
    B = int(batch_size)
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {', '.join(METHODS)}")
    seeds = np.atleast_2d(np.asarray(seeds, dtype=np.int64))
    E, R = seeds.shape
    lengths = arrays.lengths
    gens = np.array([[request_draws(int(s), lengths)[0] for s in row] for row in seeds], dtype=np.int64)
    expected, full, tail, chosen = expected_costs(arrays, model, B, gens)
    charges = [(full, tail, False)]
    linear_expected = expected.copy()
    if method == "lagrangian":
        lag, lfull, ltail = lagrangian_costs(arrays, model, B, gens, (full, tail))
        if lfull is not None:
            expected = np.maximum(expected, lag)
            charges.append((lfull, ltail, True))
    paths = None
    linear_paths = None
    if pathwise:
        if arrays.greedy:
            paths, linear_paths = expected.copy(), linear_expected.copy()
        else:
            for cf, ct, switch in charges:  # every pair of valid charges bounds every episode: keep the larger
                pf = np.empty((E, R))
                pt = np.empty((E, R))
                memo: dict[int, tuple[float, float]] = {}
                for e in range(E):
                    for r in range(R):
                        key = int(seeds[e, r])
                        if key not in memo:
                            g, u = request_draws(key, lengths)
                            vf = pathwise_costs(arrays, cf, g, u)
                            if switch:  # the tail charge from the step the tail begins (lagrangian_costs)
                                vt = pathwise_costs(arrays, ct, g, u, table=True)
                                memo[key] = (vf, min(vf, pathwise_costs(arrays, cf, g, u, exit=vt)))
                            else:
                                memo[key] = (vf, pathwise_costs(arrays, ct, g, u))
                        pf[e, r], pt[e, r] = memo[key]
                cand = _episode_costs(pf, pt, B)
                paths = cand if paths is None else np.maximum(paths, cand)
                linear_paths = cand if linear_paths is None else linear_paths
    ar = np.array([ar_schedule_ms(model, gens[e], lengths, L0, B) for e in range(E)])
    return BatchBound(B, seeds, gens, ar, expected, paths, chosen, method, linear_expected, linear_paths)


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


# --------------------------------------------------------------------------- the Lagrangian bound
#: Bound methods: ``"linear"`` is the split rule above; ``"lagrangian"`` (the default of
#: :func:`batch_bound`) adds the best per-budget split of the shared step terms and the concave
#: union share, and keeps the larger of the two per episode.
METHODS: tuple[str, ...] = ("lagrangian", "linear")


class SplitCharge(Charge):
    """A per-request charge ``l(k, U, L) = x[k] + e0[k] + eu[k] U + ew[k] w(U) + z[k] L``, ``w(U) = -log(1 - U/n)``.

    ``x`` is the request's share of the step's intercept and draft terms (:func:`lagrangian_split`),
    ``e0 + eu U + ew w(U)`` its share of the expert term (:func:`expert_share`), ``z`` its share of
    the context term. A :class:`specenv.costmodel.Charge` for :func:`oracle.dp.solve` and
    :func:`pathwise_costs` (``kmax``, ``charged_by_budget``, ``charged_table``, ``ar_ms``).

    Args:
        x, e0, eu, ew, z: (kmax+1,) coefficients by budget.
        n_experts: n of ``w(U)`` (U is clipped to n - 1e-9 there; the shares that use w are built
            only when every U of the table is below n).
        top_k: Experts per token (the AR round's U).
        source: What built it.
    """

    def __init__(self, x, e0, eu, ew, z, n_experts: int, top_k: int, source: dict[str, Any] | None = None):
        self.x, self.e0, self.eu, self.ew, self.z = (np.asarray(a, dtype=np.float64) for a in (x, e0, eu, ew, z))
        self.n_experts = int(n_experts)
        self.top_k = int(top_k)
        self.source = dict(source or {})

    @property
    def kmax(self) -> int:
        """Largest budget covered."""
        return len(self.x) - 1

    def charged_by_budget(
        self, U: np.ndarray, L: np.ndarray, lookahead: int = 0, out: np.ndarray | None = None, drafting: Any = None
    ) -> np.ndarray:
        """(kmax+1, n) charges, row k = budget k (``lookahead``/``drafting`` ignored: the charge bounds every mode)."""
        U = np.asarray(U, dtype=np.float64)
        L = np.asarray(L, dtype=np.float64)
        K1 = U.shape[0]
        w = -np.log1p(-np.minimum(U, self.n_experts - 1e-9) / self.n_experts) if np.any(self.ew[:K1]) else 0.0
        res = (self.x + self.e0)[:K1, None] + self.eu[:K1, None] * U + self.ew[:K1, None] * w + self.z[:K1, None] * L
        if out is None:
            return res
        out[...] = res
        return out

    def charged_table(
        self, U: np.ndarray, L: np.ndarray, kmax: int | None = None, lookahead: int = 0, drafting: Any = None
    ) -> np.ndarray:
        """(n, kmax+1) charges, as :meth:`specenv.costmodel.CostModel.charged_table`."""
        K = U.shape[1] - 1 if kmax is None else int(kmax)
        return np.ascontiguousarray(self.charged_by_budget(np.array(U[:, : K + 1].T, dtype=np.float64), L).T)

    def ar_ms(self, L: np.ndarray) -> np.ndarray:
        """The charge of a plain round (k = 0, U = top_k)."""
        L = np.asarray(L, dtype=np.float64)
        U = np.full((1, L.size), float(self.top_k))
        return self.charged_by_budget(U, L)[0]


def _p_range(m: int, B: int, K: int, full: bool) -> slice:
    """Indices P-1 of the steps a request verifying m positions can be part of (module docstring)."""
    return slice(m + B - 2, m + (B - 1) * (K + 1)) if full else slice(m - 1, B * (K + 1))


def _union_bound_rate(model: BatchCostModel) -> float | None:
    """Theta of ``U_batch >= n (1 - exp(-theta sum_i w(U_i)))`` for the model's predictor (None: no such form)."""
    if model.predictor == "independent":
        return 1.0
    if model.predictor == "shared":
        return float(model.u_theta)
    return None


def expert_share(
    model: BatchCostModel, batch_size: int, u_lo: float, u_hi: float, full: bool
) -> tuple[float, float, float] | None:
    """A per-request share ``e(U) = e0 + eu U + ew w(U)`` of the step's union with ``sum_i e(U_i) <= U_batch``.

    Valid for every step of exactly B requests (``full``) or of 1..B requests, whose own counts lie in
    ``[u_lo, u_hi]`` (the range of the positions table's U, so the bound holds for that table), with
    U_batch the model's predictor (the union the replay prices). Both predictors satisfy
    ``U_batch >= phi(s) = n (1 - exp(-theta s))`` with ``s = sum_i w(U_i)``, ``w(U) = -log(1 - U/n)``:
    ``"independent"`` with equality (theta = 1); ``"shared"`` because its largest request's factor
    ``1 - U_1/n`` is at most ``(1 - U_1/n)^theta`` (theta <= 1). phi is concave with phi(0) = 0, so
    it lies above its chord: on a full step s lies in ``[B w(u_lo), B w(u_hi)]`` and the chord
    between those ends, split evenly over the B requests, is the share; on any step s lies in
    ``[0, B w(u_hi)]`` and the chord from 0 (``e0 = 0``) is the share. Every share is >= 0 on
    ``[u_lo, u_hi]``, which the expert coefficient needs (``a(m_i) <= alpha(P)``).

    This uses the predictor's form: it bounds the replay's priced union, not a physical union, for
    which only ``U_batch >= max_i U_i`` follows from the per-request counts (:func:`_union_share`).

    Returns:
        ``(e0, eu, ew)``, or None when the predictor has no such form or some U reaches n.
    """
    theta = _union_bound_rate(model)
    n = float(model.n_experts)
    B = int(batch_size)
    if theta is None or u_hi >= n or theta <= 0:
        return None
    w_lo, w_hi = -np.log1p(-max(u_lo, 0.0) / n), -np.log1p(-u_hi / n)

    def phi(s: float) -> float:
        return n * -np.expm1(-theta * s)

    S = B * w_hi
    if S <= 0:
        return None
    if full:
        s0 = B * w_lo
        if S - s0 <= 1e-12 * S:
            return phi(S) / B, 0.0, 0.0
        slope = (phi(S) - phi(s0)) / (S - s0)
        e0 = (phi(s0) - slope * s0) / B
    else:
        slope, e0 = phi(S) / S, 0.0
    # guard the rounding: the chord must stay below phi at its ends
    return float(e0) * (1 - 1e-12), 0.0, float(slope) * (1 - 1e-12)


def _multisets(model: BatchCostModel, B: int, K: int, full: bool) -> tuple[np.ndarray, np.ndarray]:
    """Every step's budget multiset as counts (rows, K+1 columns) and its intercept + least draft (rhs).

    ``full``: steps of exactly B requests; else the tail's steps, of 1..B-1 requests (1 when B = 1).

    The step's shared terms ``beta0(P) + b_req (n-1) + T_D`` with each request drafting its k (the
    least any mode drafts; T_D is nondecreasing in the drafted tokens when d0, d_step, d_tok >= 0).
    """
    sizes = [B] if full else range(1, max(B, 2))
    rows, rhs = [], []
    for n in sizes:
        for combo in itertools.combinations_with_replacement(range(K + 1), n):
            k = np.array(combo, dtype=np.int64)
            rows.append(np.bincount(k, minlength=K + 1))
            P = int(np.sum(k + 1))
            top = int(k.max())
            draft = 0.0 if top == 0 else model.d0 + model.d_step * top + model.d_tok * int(k.sum())
            rhs.append(model.beta0[P - 1] + model.b_req * (n - 1) + draft)
    return np.array(rows, dtype=np.float64), np.array(rhs, dtype=np.float64)


def _fixed_parts(model: BatchCostModel, B: int, K: int, full: bool, u_lo: float, u_hi: float, expert: str):
    """(e0, eu, ew, z) by budget: the expert and context shares (None when ``expert`` has no valid form here)."""
    e0, eu, ew, z = (np.zeros(K + 1) for _ in range(4))
    nb = B if full else max(B - 1, 1)  # the tail's steps hold at most B-1 requests
    share = expert_share(model, nb, u_lo, u_hi, full) if expert == "chord" else (0.0, _union_share(model, nb), 0.0)
    if share is None:
        return None
    for k in range(K + 1):
        rng = _p_range(k + 1, nb, K, full)
        lo = float(model.alpha[rng].min())
        if lo >= 0:
            e0[k], eu[k], ew[k] = lo * share[0], lo * share[1], lo * share[2]
        else:  # U_batch <= sum_i U_i: a negative slope is charged in full on the request's own U
            eu[k] = lo
        z[k] = float(model.c[rng].min())
    return e0, eu, ew, z


def _pull_back(A: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Lower x evenly until ``A x <= b`` (every row of A counts >= 1 request, so each falls by at least the excess)."""
    over = float(np.max(A @ x - b))
    return x - over / float(A.sum(axis=1).min()) if over > 0 else x


def lagrangian_split(
    arrays: PositionArrays,
    model: BatchCostModel,
    batch_size: int,
    weights: np.ndarray,
    full: bool,
    expert: str = "chord",
    x0: np.ndarray | None = None,
    max_iter: int = 60,
    tol: float = 1e-9,
) -> SplitCharge | None:
    """The best per-budget split of the step's shared terms: the dual of the coupled batch problem.

    The shared intercept and draft terms of a step are split over its requests as ``x[k_i]``, one
    number per budget. A split is valid when no step is charged more than it costs:
    ``sum_k count_k x[k] <= beta0(P) + b_req (n-1) + T_D`` for every budget multiset of a step
    (:func:`_multisets`; n = B when ``full``, else 1..B): a finite set of linear constraints. For a
    valid x, every request's rounds cost at least its single-request SSP optimum ``V_g(x)`` under
    ``x[k] + expert share + context share``, so ``sum_g weights_g V_g(x)`` is a lower bound on the
    episodes' cost. It is concave in x (a minimum over policies of linear functions), with
    supergradient ``weights_g x`` expected rounds at each budget of the optimal policies (the oracle's
    occupancy). Kelley's cutting-plane method maximises it: each iteration solves the small LP
    ``max t s.t. t <= F(x_j) + g_j (x - x_j)`` over the valid x (``scipy.optimize.linprog``, HiGHS)
    and evaluates F at its solution exactly (:func:`oracle.dp.solve`); it stops when the LP's
    value, an upper bound on the best split, is within ``tol`` (relative) of the best F found. Every
    iterate is valid, so the bound is proven whether or not it converged; the returned charge
    carries ``source["gap"]``, the remaining relative gap to the best split of this form.

    Args:
        arrays: Positions table of the episodes' split.
        model: The batch cost model (``d0, d_step, d_tok >= 0``; else None is returned).
        batch_size: B.
        weights: (G,) how many requests of each generation the episodes serve.
        full: Valid on full steps only (n = B) or on every step.
        expert: ``"chord"`` (:func:`expert_share`) or ``"max"`` (the split rule's share).
        x0: A valid start (e.g. the split rule's intercept + draft charges); default the even split.
        max_iter: Cutting-plane iterations.
        tol: Relative stopping gap.

    Returns:
        The :class:`SplitCharge` of the best x found, or None when no valid form exists.
    """
    from scipy.optimize import linprog

    B = int(batch_size)
    K = arrays.kmax
    if min(model.d0, model.d_step, model.d_tok) < 0:
        return None
    Uk = arrays.U[:, : K + 1]
    parts = _fixed_parts(model, B, K, full, float(Uk.min()), float(Uk.max()), expert)
    if parts is None:
        return None
    e0, eu, ew, z = parts
    A, b = _multisets(model, B, K, full)
    scale = float(np.abs(b).max())
    b_safe = b - 1e-12 * scale  # a strict margin for the LP's feasibility tolerance
    w = np.asarray(weights, dtype=np.float64)
    gen_of_row = np.repeat(np.arange(len(arrays.lengths)), arrays.lengths)

    def F(x: np.ndarray) -> tuple[float, np.ndarray, SplitCharge]:
        ch = SplitCharge(x, e0, eu, ew, z, model.n_experts, model.top_k, {"kind": "batch-lagrangian", "full": full})
        ev = solve(arrays, ch)
        g = np.bincount(ev.k, weights=ev.occupancy * w[gen_of_row], minlength=K + 1)
        return float(w @ ev.cost), g, ch

    x = np.zeros(K + 1) if x0 is None else np.asarray(x0, dtype=np.float64).copy()
    x = _pull_back(A, b_safe, x)
    lo = float(x.min()) - 2.0 * scale - 1.0
    best_val, g, best = F(x)
    cuts_g, cuts_f = [g], [best_val - g @ x]  # t <= g.x + f
    ub = np.inf
    for _ in range(max_iter):
        # variables (x_0..x_K, t); maximise t
        A_ub = np.vstack(
            [np.hstack([A, np.zeros((len(A), 1))]), np.hstack([-np.array(cuts_g), np.ones((len(cuts_g), 1))])]
        )
        b_ub = np.concatenate([b_safe, np.array(cuts_f)])
        res = linprog(
            np.r_[np.zeros(K + 1), -1.0],
            A_ub=A_ub,
            b_ub=b_ub,
            bounds=[(lo, None)] * (K + 1) + [(None, None)],
            method="highs",
        )
        if res.status != 0:  # pragma: no cover - the polytope is non-empty and bounded
            break
        ub = -float(res.fun)
        x = _pull_back(A, b_safe, np.array(res.x[: K + 1]))  # HiGHS's tolerance: back into the polytope
        val, g, ch = F(x)
        if val > best_val:
            best_val, best = val, ch
        cuts_g.append(g)
        cuts_f.append(val - g @ x)
        if ub - best_val <= tol * abs(best_val):
            break
    best.source["gap"] = float(max(ub - best_val, 0.0) / abs(best_val)) if np.isfinite(ub) else None
    return best


def switch_costs(arrays: PositionArrays, full: Any, tail_values: np.ndarray) -> np.ndarray:
    """Least expected charge of each generation when the charge may switch once from ``full`` to the tail's.

    ``V(t) = min( W(t), min_k [ full(t, k) + sum_a P(a | t, k) V(t + a + 1) ] )`` with W the tail
    charge's optimal cost-to-go (``solve(arrays, tail).value``) and V(N) = 0: the least expected charge
    over every budget policy and every switching time (a stopping time of the whole batch's history,
    so no better than the best one of this SSP).

    Returns:
        (G,) V(0) per generation.
    """
    K = arrays.kmax
    S = arrays.survival()
    C = full.charged_table(arrays.U, arrays.L, K)
    out = np.empty(len(arrays.lengths))
    for g in range(len(arrays.lengths)):
        lo, hi = int(arrays.offsets[g]), int(arrays.offsets[g + 1])
        N = hi - lo
        V = np.zeros(N + K + 2)
        for t in range(N - 1, -1, -1):
            surv = np.concatenate([[1.0], S[lo + t, :K], [0.0]])  # P(a >= i), i = 0..K+1
            nxt = V[t + 1 : t + K + 2].copy()  # V after a = 0..K accepted (beyond N: 0)
            best = float(tail_values[lo + t])
            for k in range(K + 1):
                p = surv[: k + 1] - np.r_[surv[1 : k + 1], 0.0]  # P(a) for a = 0..k
                best = min(best, float(C[lo + t, k] + p @ nxt[: k + 1]))
            V[t] = best
        out[g] = V[0]
    return out


def lagrangian_costs(
    arrays: PositionArrays,
    model: BatchCostModel,
    batch_size: int,
    generations: np.ndarray,
    start: tuple[CostModel, CostModel] | None = None,
) -> tuple[np.ndarray, Any, Any]:
    """Lower bounds on the expected cost of the episodes by the Lagrangian splits (:func:`batch_bound`).

    Every request is charged the full-batch split (:func:`lagrangian_split`, ``full=True``) in full
    steps; the at most B-1 requests still running when the tail begins (the steps of fewer than B
    requests, after the last admission) are charged the tail split (``full=False``: valid on steps of
    1..B-1 requests) from the step the tail begins. That step depends on the policy, so such a request
    is bounded by :func:`switch_costs` (the least charge over every switching time), and since which
    requests those are is not known either, the B-1 largest differences ``V_full - V_switch >= 0``
    are subtracted (:func:`_episode_costs`). Candidates: the chord and the max expert share, each
    started at the split rule's charges; the largest total is kept. The caller takes the per-episode
    maximum with the split rule (:func:`expected_costs`), so the bound is never looser than it.

    Args:
        arrays: Positions table.
        model: The batch cost model.
        batch_size: B.
        generations: (E, R) generation index of every request.
        start: The split rule's (full-batch, tail) charges when already computed (:func:`expected_costs`).

    Returns:
        ``(costs (E,), full-batch charge, tail charge)``; costs are -inf when no candidate exists.
    """
    B = int(batch_size)
    gens = np.atleast_2d(np.asarray(generations, dtype=np.int64))
    weights = np.bincount(gens.ravel(), minlength=len(arrays.lengths)).astype(np.float64)
    old_full, old_tail = expected_costs(arrays, model, B, gens)[1:3] if start is None else start
    best: tuple[np.ndarray, Any, Any] = (np.full(len(gens), -np.inf), None, None)
    for expert in ("chord", "max"):
        full = lagrangian_split(arrays, model, B, weights, True, expert, x0=old_full.beta0.copy())
        tail = lagrangian_split(arrays, model, B, weights, False, expert, x0=old_tail.beta0.copy())
        if full is None or tail is None:
            continue
        vf = solve(arrays, full).cost
        vs = np.minimum(switch_costs(arrays, full, solve(arrays, tail).value), vf)
        costs = _episode_costs(vf[gens], vs[gens], B)
        if costs.sum() > best[0].sum():
            best = (costs, full, tail)
    return best
