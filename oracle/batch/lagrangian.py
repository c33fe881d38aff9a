"""The Lagrangian charges of the batch bound: the best per-budget split of a step's shared terms."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from oracle.batch.split import _episode_costs, _union_share, expected_costs
from oracle.dp import solve
from specenv.cost.batch import BatchCostModel
from specenv.cost.model import Charge, CostModel
from specenv.traces.traceset import PositionArrays


class SplitCharge(Charge):
    """A per-request charge ``l(k, U, L) = x[k] + e0[k] + eu[k] U + ew[k] w(U) + z[k] L``, ``w(U) = -log(1 - U/n)``.

    ``x`` is the request's share of the step's intercept and draft terms (:func:`lagrangian_split`),
    ``e0 + eu U + ew w(U)`` its share of the expert term (:func:`expert_share`), ``z`` its share of
    the context term. A :class:`specenv.cost.model.Charge` for :func:`oracle.dp.solve` and
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


#: Most budget multisets (full and tail steps, :func:`multiset_count`) the Lagrangian bound enumerates:
#: each is a Python-built row of its cutting-plane LP, enumerated four times (two expert shares, full and
#: tail), ~10 s at the limit on a 2-core machine. C(B+K, K) grows as B^K: 8e11 at B = 64, Kmax = 10.
MAX_MULTISETS = 1_000_000

#: Splits :func:`lagrangian_costs` solves (chord and max expert share, each for full and tail steps).
SPLITS = 4


def multiset_count(batch_size: int, kmax: int) -> int:
    """Budget multisets :func:`_multisets` enumerates: C(B+K, K) full steps and C(n+K, K) tail steps per n < B."""
    B, K = int(batch_size), int(kmax)
    tail = math.comb(max(B - 1, 1) + K + 1, K + 1) - 1  # sum over n = 1..max(B-1, 1) of C(n+K, K)
    return math.comb(B + K, K) + tail


def check_enumerable(batch_size: int, kmax: int, what: str = "batch_size") -> None:
    """Refuse a batch size whose Lagrangian bound would enumerate more than :data:`MAX_MULTISETS` multisets.

    Raises:
        ValueError: One line naming ``what``, the count and the largest batch size allowed at this Kmax.
    """
    B, K = int(batch_size), int(kmax)
    n = multiset_count(B, K)
    if n > MAX_MULTISETS:
        most = max((b for b in range(1, B) if multiset_count(b, K) <= MAX_MULTISETS), default=0)
        raise ValueError(
            f"{what}: {B} requests per step at Kmax {K}: the batch bound (Lagrangian) enumerates every step's "
            f"budget multiset, {n:.3g} of them (at most {MAX_MULTISETS:,}): give a batch size <= {most} at this "
            "Kmax, or a smaller Kmax"
        )


def _multisets(model: BatchCostModel, B: int, K: int, full: bool) -> tuple[np.ndarray, np.ndarray]:
    """Every step's budget multiset as counts (rows, K+1 columns) and its intercept + least draft (rhs).

    ``full``: steps of exactly B requests; else the tail's steps, of 1..B-1 requests (1 when B = 1).

    The step's shared terms ``beta0(P) + b_req (n-1) + T_D`` with each request drafting its k (the
    least any mode drafts; T_D is nondecreasing in the drafted tokens when d0, d_step, d_tok >= 0).
    Rows in the order of ``itertools.combinations_with_replacement`` per size (the LP's row order),
    built as arrays: the same numbers as :func:`_multisets_reference`, the one-multiset-at-a-time form.
    """
    sizes = [B] if full else range(1, max(B, 2))
    rows, rhs = [], []
    for n in sizes:
        k = np.array(list(itertools.combinations_with_replacement(range(K + 1), n)), dtype=np.int64).reshape(-1, n)
        rows.append(np.stack([(k == i).sum(axis=1) for i in range(K + 1)], axis=1))
        ksum = k.sum(axis=1)
        top = k.max(axis=1)
        P = ksum + n
        draft = np.where(top == 0, 0.0, model.d0 + model.d_step * top + model.d_tok * ksum)
        rhs.append(np.asarray(model.beta0, dtype=np.float64)[P - 1] + model.b_req * (n - 1) + draft)
    return np.concatenate(rows).astype(np.float64), np.concatenate(rhs).astype(np.float64)


def _multisets_reference(model: BatchCostModel, B: int, K: int, full: bool) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_multisets` one multiset at a time (the straightforward form, kept for the tests)."""
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
    multisets: tuple[np.ndarray, np.ndarray] | None = None,
    progress: Callable[[int], None] | None = None,
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
        multisets: :func:`_multisets` of this B, Kmax and ``full`` when already built.
        progress: ``progress(i)`` as cutting-plane iteration i (1, 2, ...) ends.

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
    A, b = _multisets(model, B, K, full) if multisets is None else multisets
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
        if progress is not None:
            progress(len(cuts_g) - 1)
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
            drop = surv[:-1] - surv[1:]  # P(a = i) under budget K, i = 0..K
            nxt = V[t + 1 : t + K + 2].copy()  # V after a = 0..K accepted (beyond N: 0)
            best = float(tail_values[lo + t])
            for k in range(K + 1):
                p = drop[: k + 1].copy()  # P(a) for a = 0..k: the same differences, the last one P(a >= k) - 0
                p[k] = surv[k]
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
    progress: Callable[[int, int, str], None] | None = None,
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
        progress: ``progress(done, total, what)`` as each of the :data:`SPLITS` splits ends (``done`` of
            ``total``) and as each of its cutting-plane iterations ends (``what`` names the split and the
            iteration), the splits' order: chord then max expert share, each full steps then tail steps.

    Returns:
        ``(costs (E,), full-batch charge, tail charge)``; costs are -inf when no candidate exists.

    Raises:
        ValueError: When B and Kmax have more budget multisets than :data:`MAX_MULTISETS` (:func:`check_enumerable`).
    """
    B = int(batch_size)
    check_enumerable(B, arrays.kmax)
    gens = np.atleast_2d(np.asarray(generations, dtype=np.int64))
    weights = np.bincount(gens.ravel(), minlength=len(arrays.lengths)).astype(np.float64)
    old_full, old_tail = expected_costs(arrays, model, B, gens)[1:3] if start is None else start
    best: tuple[np.ndarray, Any, Any] = (np.full(len(gens), -np.inf), None, None)
    rows: dict[bool, tuple[np.ndarray, np.ndarray]] = {}  # the LP's rows, shared by both expert shares
    done = 0

    def split(expert: str, full: bool, x0: np.ndarray) -> SplitCharge | None:
        nonlocal done
        name = f"lagrangian: {expert} expert share, {'full' if full else 'tail'} steps"

        def tick(i: int) -> None:
            if progress is not None:
                progress(done, SPLITS, f"{name}, cutting-plane LP {i}")

        tick(0)
        if full not in rows:
            rows[full] = _multisets(model, B, arrays.kmax, full)
        out = lagrangian_split(arrays, model, B, weights, full, expert, x0=x0, multisets=rows[full], progress=tick)
        done += 1
        if progress is not None:
            progress(done, SPLITS, name)
        return out

    for expert in ("chord", "max"):
        full = split(expert, True, old_full.beta0.copy())
        tail = split(expert, False, old_tail.beta0.copy())
        if full is None or tail is None:
            continue
        vf = solve(arrays, full).cost
        vs = np.minimum(switch_costs(arrays, full, solve(arrays, tail).value), vf)
        costs = _episode_costs(vf[gens], vs[gens], B)
        if costs.sum() > best[0].sum():
            best = (costs, full, tail)
    return best
