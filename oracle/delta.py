"""Delta-space analysis of the oracle's decisions (the seed paper's Figure 3) and the boundary slope.

At every decision state t on the optimal path and for every rejected budget k != k*(t):

    dE[Cost] = C(t,k) - C(t,k*)            (the round cost is deterministic given t and k)
    dE[a]    = E[a(t,k)] - E[a(t,k*)],     E[a(t,k)] = sum_{i=1..k} prod_{j<=i} rho_{t,j}

(``E[a]`` is the trace's acceptance expectation, not truncated at the end of the generation).

**Which states.** ``states="occupancy"`` (default, exact): every state the optimal policy visits
with probability above ``min_occupancy`` (1e-9), each weighted by its occupancy probability (the
expected number of decisions taken there). For greedy traces occupancy is 0 or 1, so this is exactly
the deterministic optimal path with weight 1 per decision. ``states="mc"``: the states visited by
seeded Monte-Carlo episodes of the optimal policy, weight 1 per visit.

**Quadrants** (x = dE[a], y = dE[Cost]): I: x > tol_a, y > tol_cost; II: x > tol_a, y < -tol_cost;
III: x < -tol_a, y < -tol_cost; IV: x < -tol_a, y > tol_cost; everything within a tolerance of an
axis (e.g. greedy candidates whose extra drafts are surely rejected, x = 0) is counted as ``axis``.
Tolerances: ``tol_cost = 1e-9`` ms and ``tol_a = 1e-9`` tokens, i.e. floating-point noise only.
Quadrant II (cheaper *and* more progress) is empty whenever V is non-increasing in t; quadrant IV
(costlier *and* less progress) is not excluded by optimality and does occur when the cost model is
not monotone in k (the paper's Table A4 has beta0 dropping from K=3 to K=4: a 4-draft round can be
cheaper than a 3-draft one).

**Slopes.** Two lines through the origin are fitted:

* ``lambda_ls``: weighted least squares ``dCost = lambda * da`` over all rejected points, with the
  uncentred R^2 (``1 - sum w r^2 / sum w y^2``) and the residual spread. This is the centre of the
  cloud the paper draws; it is *not* the decision boundary.
* ``lambda_sep`` (the **boundary slope**): if V were linear in t with slope -mu, k* would maximise
  ``mu*E[a(k)] - C(k)``, so every rejected point would satisfy ``dCost >= mu * da`` (I: dCost/da >=
  mu; III: dCost/da <= mu). ``lambda_sep`` is the mu that minimises the weighted share of points on
  the wrong side of that line (exact, by a sorted scan of the ratios); ``lambda_interval`` is the
  hard envelope [max ratio in III, min ratio in I] (empty when lo > hi: no line separates all).

``lambda_sep`` matches the optimal cost per committed token V(0)/N and the value function's mean
marginal along the path, which is the marginal condition dE[Cost]/dE[a] ~ lambda of the paper.
:func:`boundary_slope` returns it (or a variant) for the delta-space heuristic policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal

import numpy as np

from oracle.dp import Evaluation, cost_table, evaluate_policy, expected_accepted, simulate, solve
from specenv.cost.model import CostModel
from specenv.traces.traceset import PositionArrays

__all__ = [
    "DeltaAnalysis",
    "boundary_slope",
    "delta_analysis",
    "delta_rule_policy",
    "plot_delta",
]

States = Literal["occupancy", "mc"]
QUADRANTS = ("I", "II", "III", "IV", "axis")


@dataclass
class DeltaAnalysis:
    """Result of :func:`delta_analysis`.

    Attributes:
        states: ``"occupancy"`` or ``"mc"`` (see the module docstring).
        decisions: Number of decision states used.
        points: Number of (state, rejected k) points.
        tol_cost: Tolerance on dE[Cost] (ms).
        tol_a: Tolerance on dE[a] (tokens).
        quadrants: Point counts per quadrant (I, II, III, IV, axis).
        quadrants_weighted: Occupancy-weighted counts (expected numbers of points per pass).
        lambda_ls: Weighted least-squares slope through the origin (ms per accepted token).
        r2_origin: Uncentred R^2 of the least-squares line.
        resid_sd: Weighted SD of the least-squares residuals (ms).
        resid_quantiles: 5%, 50%, 95% quantiles of the residuals (ms, unweighted).
        lambda_sep: Boundary slope minimising the weighted share of points on the wrong side.
        sep_error: That weighted share (0 = the line separates all points).
        lambda_interval: (lo, hi) hard envelope; lo > hi means no line separates all points.
        v0_per_token: Optimal cost per committed token, sum V(0) / sum N (ms).
        marginal_dv: Occupancy-weighted mean of V(t) - V(t+1) over the decision states (ms).
        ar_per_token: AR cost per token (ms): divide a slope by it to get AR-step units.
        da: (points,) dE[a] of every point.
        dc: (points,) dE[Cost] of every point.
        weight: (points,) weight of every point.
        k: (points,) rejected budget.
        kstar: (points,) oracle's budget at the point's state.
    """

    states: str
    decisions: int
    points: int
    tol_cost: float
    tol_a: float
    quadrants: dict[str, int]
    quadrants_weighted: dict[str, float]
    lambda_ls: float
    r2_origin: float
    resid_sd: float
    resid_quantiles: tuple[float, float, float]
    lambda_sep: float
    sep_error: float
    lambda_interval: tuple[float, float]
    v0_per_token: float
    marginal_dv: float
    ar_per_token: float
    da: np.ndarray = field(repr=False)
    dc: np.ndarray = field(repr=False)
    weight: np.ndarray = field(repr=False)
    k: np.ndarray = field(repr=False)
    kstar: np.ndarray = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON summary (no per-point arrays)."""
        return {
            "states": self.states,
            "decisions": self.decisions,
            "points": self.points,
            "tol_cost_ms": self.tol_cost,
            "tol_a": self.tol_a,
            "quadrants": dict(self.quadrants),
            "quadrants_weighted": dict(self.quadrants_weighted),
            "lambda_ls_ms": self.lambda_ls,
            "r2_origin": self.r2_origin,
            "resid_sd_ms": self.resid_sd,
            "resid_quantiles_ms": list(self.resid_quantiles),
            "lambda_sep_ms": self.lambda_sep,
            "sep_error": self.sep_error,
            "lambda_interval_ms": list(self.lambda_interval),
            "v0_per_token_ms": self.v0_per_token,
            "marginal_dv_ms": self.marginal_dv,
            "ar_per_token_ms": self.ar_per_token,
            "lambda_sep_ar_units": self.lambda_sep / self.ar_per_token,
            "lambda_ls_ar_units": self.lambda_ls / self.ar_per_token,
        }


def _separating_slope(x: np.ndarray, y: np.ndarray, w: np.ndarray, tol_a: float) -> tuple[float, float]:
    """Mu minimising sum_{x>0, y/x<mu} w + sum_{x<0, y/x>mu} w, and that error's weighted share."""
    pos = x > tol_a
    neg = x < -tol_a
    if not (pos.any() or neg.any()):
        return float("nan"), float("nan")
    r = np.concatenate([y[pos] / x[pos], y[neg] / x[neg]])
    wp = np.concatenate([w[pos], np.zeros(neg.sum())])
    wn = np.concatenate([np.zeros(pos.sum()), w[neg]])
    vals, inv = np.unique(r, return_inverse=True)
    cp = np.cumsum(np.bincount(inv, wp, len(vals)))  # pos weight with ratio <= vals[j]
    cn = np.cumsum(np.bincount(inv, wn, len(vals)))  # neg weight with ratio <= vals[j]
    total = w[pos].sum() + w[neg].sum()
    # mu in (vals[j], vals[j+1]): errors = pos with ratio <= vals[j] + neg with ratio > vals[j]
    err = cp + (cn[-1] - cn)
    err_below = cn[-1]  # mu below every ratio: all neg points are wrong
    j = int(np.argmin(err))
    if err_below <= err[j]:
        return float(vals[0] - 1.0), float(err_below / total)
    mu = 0.5 * (vals[j] + vals[j + 1]) if j + 1 < len(vals) else vals[j] + 1.0
    return float(mu), float(err[j] / total)


def _state_weights(
    arrays: PositionArrays,
    cost_model: CostModel,
    res: Evaluation,
    states: States,
    min_occupancy: float,
    episodes: int,
    seed: int,
) -> np.ndarray:
    if states == "occupancy":
        w = res.occupancy.copy()
        w[w <= min_occupancy] = 0.0
        return w
    if states == "mc":
        sim = simulate(
            arrays, cost_model, res.k, episodes=episodes, seed=seed, lookahead=res.lookahead, drafting=res.drafting
        )
        return sim.visits.astype(np.float64)
    raise ValueError(f"states must be 'occupancy' or 'mc', got {states!r}")


def delta_analysis(
    arrays: PositionArrays,
    cost_model: CostModel,
    lookahead: int = 0,
    result: Evaluation | None = None,
    states: States = "occupancy",
    min_occupancy: float = 1e-9,
    episodes: int = 1,
    seed: int = 0,
    tol_cost: float = 1e-9,
    tol_a: float = 1e-9,
    drafting: str | None = None,
) -> DeltaAnalysis:
    """Delta-space analysis of the oracle's decisions (paper Figure 3).

    Args:
        arrays: Positions table.
        cost_model: Cost model covering ``arrays.kmax``.
        lookahead: Draft lookahead h (as in :func:`oracle.dp.solve`).
        result: A :func:`oracle.dp.solve` result for the same inputs (solved here if None).
        states: ``"occupancy"`` (exact, weighted) or ``"mc"`` (Monte-Carlo visits).
        min_occupancy: States visited with probability <= this are left out (occupancy mode).
        episodes: Episodes per generation (mc mode).
        seed: Seed (mc mode).
        tol_cost: |dE[Cost]| <= tol_cost counts as on the axis (ms).
        tol_a: |dE[a]| <= tol_a counts as on the axis (tokens).
        drafting: The drafting mode (as in :func:`oracle.dp.solve`; default: ``result``'s mode when
            a result is given, else block for h > 0 and none for h = 0).

    Returns:
        The :class:`DeltaAnalysis`.
    """
    if drafting is None and result is not None:
        drafting = result.drafting
    res = result if result is not None else solve(arrays, cost_model, lookahead=lookahead, drafting=drafting)
    if res.kmax != arrays.kmax or len(res.k) != len(arrays.L):
        raise ValueError("result does not belong to these arrays (solve them with the same kmax)")
    w_state = _state_weights(arrays, cost_model, res, states, min_occupancy, episodes, seed)
    rows = np.flatnonzero(w_state > 0)
    x, y, w, kk, kst = _rejected_points(arrays, cost_model, lookahead, res.k[rows], rows, w_state, drafting)
    masks = _quadrant_masks(x, y, tol_a, tol_cost)
    lam, r2, rsd, rq = _least_squares_line(x, y, w)
    mu, err = _separating_slope(x, y, w, tol_a)
    return DeltaAnalysis(
        states=states,
        decisions=int(len(rows)),
        points=int(len(x)),
        tol_cost=tol_cost,
        tol_a=tol_a,
        quadrants={q: int(m.sum()) for q, m in masks.items()},
        quadrants_weighted={q: float(w[m].sum()) for q, m in masks.items()},
        lambda_ls=lam,
        r2_origin=r2,
        resid_sd=rsd,
        resid_quantiles=rq,
        lambda_sep=mu,
        sep_error=err,
        lambda_interval=_hard_envelope(x, y, tol_a),
        v0_per_token=res.v0_per_token,
        marginal_dv=_marginal_dv(arrays, res, rows, w_state[rows]),
        ar_per_token=float(res.ar.sum() / res.lengths.sum()),
        da=x,
        dc=y,
        weight=w,
        k=kk,
        kstar=kst,
    )


def _rejected_points(
    arrays: PositionArrays,
    cost_model: CostModel,
    lookahead: int,
    ks: np.ndarray,
    rows: np.ndarray,
    w_state: np.ndarray,
    drafting: str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (decision state, rejected k) point, flattened row by row.

    Args:
        arrays: Positions table.
        cost_model: Cost model covering ``arrays.kmax``.
        lookahead: Draft lookahead h.
        ks: (len(rows),) the oracle's budget k* at each decision state.
        rows: Position rows of the decision states.
        w_state: (n,) weight of every position row.
        drafting: The drafting mode.

    Returns:
        ``(da, dc, weight, k, kstar)``, each of shape (points,).
    """
    C = cost_table(arrays, cost_model, lookahead, drafting)
    A = expected_accepted(arrays)
    K1 = arrays.kmax + 1
    dc = C[rows] - C[rows, ks][:, None]
    da = A[rows] - A[rows, ks][:, None]
    rej = np.arange(K1)[None, :] != ks[:, None]
    y = dc[rej]
    x = da[rej]
    w = np.broadcast_to(w_state[rows][:, None], dc.shape)[rej]
    kk = np.broadcast_to(np.arange(K1)[None, :], dc.shape)[rej]
    kst = np.broadcast_to(ks[:, None], dc.shape)[rej]
    return x, y, w, kk, kst


def _quadrant_masks(x: np.ndarray, y: np.ndarray, tol_a: float, tol_cost: float) -> dict[str, np.ndarray]:
    """Boolean mask of every quadrant of ``QUADRANTS`` (x = dE[a], y = dE[Cost]; see the module docstring)."""
    px, nx = x > tol_a, x < -tol_a
    py, ny = y > tol_cost, y < -tol_cost
    masks = {"I": px & py, "II": px & ny, "III": nx & ny, "IV": nx & py}
    masks["axis"] = ~(masks["I"] | masks["II"] | masks["III"] | masks["IV"])
    return masks


def _least_squares_line(
    x: np.ndarray, y: np.ndarray, w: np.ndarray
) -> tuple[float, float, float, tuple[float, float, float]]:
    """Weighted least-squares line ``y = lambda * x`` through the origin.

    Returns:
        ``(lambda, uncentred R^2, weighted residual SD, residual 5/50/95% quantiles)``; NaN where
        undefined (no points, zero weights).
    """
    sxx = float((w * x * x).sum())
    lam = float((w * x * y).sum() / sxx) if sxx > 0 else float("nan")
    resid = y - lam * x
    syy = float((w * y * y).sum())
    r2 = 1.0 - float((w * resid**2).sum()) / syy if syy > 0 else float("nan")
    wsum = float(w.sum())
    rmean = float((w * resid).sum() / wsum) if wsum > 0 else float("nan")
    rsd = float(np.sqrt((w * (resid - rmean) ** 2).sum() / wsum)) if wsum > 0 else float("nan")
    rq = tuple(float(v) for v in np.percentile(resid, [5, 50, 95])) if len(resid) else (np.nan,) * 3
    return lam, r2, rsd, rq  # type: ignore[return-value]


def _hard_envelope(x: np.ndarray, y: np.ndarray, tol_a: float) -> tuple[float, float]:
    """``(lo, hi)`` = (max ratio y/x of the points with x < 0, min ratio of those with x > 0).

    Every line ``y = mu * x`` with ``lo <= mu <= hi`` separates all points; lo > hi means none does.
    """
    px, nx = x > tol_a, x < -tol_a
    ratios_i = y[px] / x[px]
    ratios_iii = y[nx] / x[nx]
    hi = float(ratios_i.min()) if len(ratios_i) else float("inf")
    lo = float(ratios_iii.max()) if len(ratios_iii) else float("-inf")
    return lo, hi


def _marginal_dv(arrays: PositionArrays, res: Evaluation, rows: np.ndarray, ws: np.ndarray) -> float:
    """Weighted mean of the marginal V(t) - V(t+1) (V(N) = 0) over the decision states ``rows``."""
    V = res.value
    nxt = np.append(V[1:], 0.0)
    nxt[arrays.offsets[1:] - 1] = 0.0
    dv = V - nxt
    return float((dv[rows] * ws).sum() / ws.sum()) if ws.sum() > 0 else float("nan")


def delta_rule_policy(
    arrays: PositionArrays, cost_model: CostModel, lam: float, lookahead: int = 0, drafting: str | None = None
) -> np.ndarray:
    """Budgets of the delta rule with the trace's true acceptance: ``argmax_k lam*E[a(t,k)] - C(t,k)``.

    This is the offline (perfect-information) form of the delta-space heuristic; evaluate it with
    :func:`oracle.dp.evaluate_policy`.

    Returns:
        (n,) int64 budgets per position row.
    """
    C = cost_table(arrays, cost_model, lookahead, drafting)
    A = expected_accepted(arrays)
    return np.argmax(lam * A - C, axis=1).astype(np.int64)


def _policy_optimal_slope(
    arrays: PositionArrays,
    cost_model: CostModel,
    lookahead: int,
    start: float,
    iters: int = 24,
    drafting: str | None = None,
) -> float:
    """Lambda minimising the exact expected cost of :func:`delta_rule_policy` (grid + golden section)."""

    def cost(lam: float) -> float:
        k = delta_rule_policy(arrays, cost_model, lam, lookahead, drafting)
        return float(evaluate_policy(arrays, cost_model, k, lookahead, drafting).cost.sum())

    grid = start * np.geomspace(0.5, 2.0, 9)
    vals = [cost(g) for g in grid]
    i = int(np.argmin(vals))
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    phi = (np.sqrt(5.0) - 1.0) / 2.0
    c, d = b - phi * (b - a), a + phi * (b - a)
    fc, fd = cost(c), cost(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - phi * (b - a)
            fc = cost(c)
        else:
            a, c, fc = c, d, fd
            d = a + phi * (b - a)
            fd = cost(d)
    best = min([(vals[i], grid[i]), (fc, c), (fd, d)])
    return float(best[1])


def boundary_slope(
    arrays: PositionArrays,
    cost_model: CostModel,
    lookahead: int = 0,
    method: Literal["separating", "ls", "v0", "policy"] = "separating",
    states: States = "occupancy",
    unit_ms: float = 1.0,
    drafting: str | None = None,
) -> float:
    """The delta-space boundary slope lambda fitted on the given generations (e.g. the train split).

    The delta-space heuristic picks ``argmax_k lambda*E[a(k)] - E[C(k)]``; this returns its lambda.

    Args:
        arrays: Positions of the generations to fit on (``arrays.select(train_index)``), with the
            budgets the policy will use (``arrays.with_kmax(k)``).
        cost_model: Cost model.
        lookahead: Draft lookahead h charged in every round.
        method: ``"separating"`` (default): the boundary line of the oracle's rejected candidates
            (:attr:`DeltaAnalysis.lambda_sep`); ``"ls"``: least-squares slope of all rejected
            candidates (:attr:`DeltaAnalysis.lambda_ls`, the cloud's centre; a poor rule);
            ``"v0"``: optimal cost per committed token, sum V(0) / sum N; ``"policy"``: the lambda
            that minimises the exact expected cost of the rule itself with the trace's true
            acceptance (grid + golden-section search started at the separating slope; slower).
        states: Decision states for the delta analysis (see :func:`delta_analysis`).
        unit_ms: Unit of the returned slope in ms (1.0: ms per accepted token; pass the mean AR
            step cost in ms to get AR-step units as the environment's rewards use).
        drafting: The drafting mode (as in :func:`oracle.dp.solve`).

    Returns:
        lambda in ``unit_ms`` per accepted token.
    """
    res = solve(arrays, cost_model, lookahead=lookahead, drafting=drafting)
    if method == "v0":
        return res.v0_per_token / unit_ms
    an = delta_analysis(arrays, cost_model, lookahead=lookahead, result=res, states=states)
    if method == "separating":
        return an.lambda_sep / unit_ms
    if method == "ls":
        return an.lambda_ls / unit_ms
    if method == "policy":
        return _policy_optimal_slope(arrays, cost_model, lookahead, an.lambda_sep, drafting=res.drafting) / unit_ms
    raise ValueError(f"method must be 'separating', 'ls', 'v0' or 'policy', got {method!r}")


def plot_delta(analysis: DeltaAnalysis, path: str | BinaryIO, max_points: int = 20000, seed: int = 0) -> str:
    """Scatter of dE[Cost] against dE[a] with both fitted lines (paper Figure 3); writes ``path`` (file or stream).

    Every point is one budget k the oracle rejected at a decision state, placed relative to the
    budget k* it chose there. The legend names each quadrant with its meaning and full count (I:
    costlier and accepts more, II: cheaper and accepts more, III: cheaper and accepts fewer, IV:
    costlier and accepts fewer), the boundary line with the share of the weight on its wrong side
    (below it: where the linear rule lambda*E[a] - Cost would prefer the rejected k to k*), and the
    least-squares line. Points are subsampled (seeded, with probability proportional to their
    weight) to ``max_points``.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = _subsample(analysis.weight, max_points, seed)
    fig, ax = plt.subplots(figsize=(10, 8.4))
    _scatter_quadrants(ax, analysis, idx)
    _plot_slopes(ax, analysis)
    ax.axhline(0, color="0.3", lw=0.6)
    ax.axvline(0, color="0.3", lw=0.6)
    _label_quadrants(ax)
    ax.set_xlabel("dE[a]: expected accepted drafts of the rejected k minus those of k*  (tokens per round)")
    ax.set_ylabel("dE[Cost]: round cost of the rejected k minus that of k*  (ms)")
    ax.set_title(
        f"Delta space of the oracle's decisions: each point is a budget k the oracle rejected, relative to its k*\n"
        f"({analysis.points:,} points at {analysis.decisions:,} decision states; optimal cost per token "
        f"V(0)/N = {analysis.v0_per_token:.3f} ms, AR {analysis.ar_per_token:.3f} ms)",
        fontsize=9,
    )
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        fontsize=8,
        markerscale=4,
        loc="lower center",
        ncol=2,
        framealpha=0.95,
        title="wrong side: k* maximises lambda*E[a] - Cost, so every rejected point should lie above the boundary "
        f"line;\n{analysis.sep_error:.1%} of the weight of the points off the dE[a] = 0 axis lies below it",
        title_fontsize=8,
    )
    fig.tight_layout(rect=(0, 1.45 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return str(path)


#: What each quadrant means (x = dE[a], y = dE[Cost], both relative to the oracle's k*).
QUADRANT_MEANING = {
    "I": "costlier, accepts more",
    "II": "cheaper, accepts more (empty when V(t) falls with t)",
    "III": "cheaper, accepts fewer",
    "IV": "costlier, accepts fewer",
    "axis": "on an axis (e.g. drafts surely rejected)",
}


def _label_quadrants(ax: Any) -> None:
    """The quadrant numerals, half-way out along dE[a] and near the dE[Cost] edge of each quadrant."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    spots = {"I": (x1, y1), "II": (x1, y0), "III": (x0, y0), "IV": (x0, y1)}
    for q, (x, y) in spots.items():
        if x * (1 if q in ("I", "II") else -1) <= 0 or y * (1 if q in ("I", "IV") else -1) <= 0:
            continue  # the axes do not reach into this quadrant
        ax.text(
            0.5 * x,
            0.95 * y,
            q,
            ha="center",
            va="top" if y > 0 else "bottom",
            fontsize=16,
            fontweight="bold",
            color="0.4",
        )


def _subsample(w: np.ndarray, max_points: int, seed: int) -> np.ndarray:
    """Indices of at most ``max_points`` points, drawn without replacement with probability proportional to ``w``."""
    n = len(w)
    if n <= max_points:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    p = w / w.sum()
    return rng.choice(n, size=max_points, replace=False, p=p)


def _scatter_quadrants(ax: Any, analysis: DeltaAnalysis, idx: np.ndarray) -> None:
    """The points ``idx`` of ``analysis``, one colour per quadrant, labelled with the quadrant's full count."""
    colors = {"I": "tab:red", "II": "tab:purple", "III": "tab:blue", "IV": "tab:orange", "axis": "0.6"}
    xs, ys = analysis.da[idx], analysis.dc[idx]
    masks = _quadrant_masks(xs, ys, analysis.tol_a, analysis.tol_cost)
    for q in QUADRANTS:
        m = masks[q]
        name = "" if q == "axis" else f"{q}: "
        label = f"{name}{QUADRANT_MEANING[q]}: {analysis.quadrants[q]:,} points"
        # an empty quadrant still gets its legend entry (its count, 0, is a finding)
        ax.scatter(xs[m], ys[m], s=3, alpha=0.35, color=colors[q], label=label, rasterized=True)


def _plot_slopes(ax: Any, analysis: DeltaAnalysis) -> None:
    """The boundary line (solid) and the least-squares line (dashed) across the points' dE[a] range."""
    x = analysis.da
    lim = np.array([x.min(), x.max()]) if len(x) else np.array([-1.0, 1.0])
    ax.plot(
        lim,
        analysis.lambda_sep * lim,
        color="k",
        lw=1.5,
        label=f"boundary line: lambda = {analysis.lambda_sep:.3f} ms/token ({analysis.sep_error:.1%} of the "
        "weight on its wrong side)",
    )
    ax.plot(
        lim,
        analysis.lambda_ls * lim,
        color="k",
        lw=1,
        ls="--",
        label=f"least-squares line: lambda = {analysis.lambda_ls:.3f} ms/token "
        f"(R2 through 0: {analysis.r2_origin:.3f})",
    )
