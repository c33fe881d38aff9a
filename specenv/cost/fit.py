"""Fitting the cost model on a rounds table (the paper's Appendix A protocol).

* Per K: OLS ``T_T = beta0 + alpha*U_r + c*L`` with standard errors clustered by generation
  (statsmodels), and out-of-sample R2 / RMSE / MAPE under GroupKFold(5) by generation (scikit-learn).
* Pooled forms of Table A6: ``U_r + L``, ``U_r + L + gamma*K`` and ``U_r x C(K) + L``, each with
  in-sample R2 and GroupKFold(5) RMSE and MAPE.
* Draft time ``T_D = d1*K + d0`` on rounds with K >= 1 (zero timings are treated as missing).
* Rounds run with a verification-time expert cap (optional column ``cap`` > 0, trace extension
  caps-v1) carry the *capped* union as ``U_r``, and every fit here takes them as they are: the same
  per-K form with U the capped U. :func:`capped_transfer` measures whether a model fitted on uncapped
  rounds predicts capped ones.
* The AR step (K = 0): fitted on K = 0 rounds when present (U is always top_k there, so alpha is not
  identifiable and is set to 0 with beta0 absorbing it); otherwise extrapolated from the three lowest
  fitted budgets exactly as :func:`specenv.traces.paper.profile_coefficients` does, and flagged.

statsmodels and scikit-learn are imported inside the functions that fit, never at import of this or
any other specenv module. Which model an environment uses (and the caching of its fit) is
:func:`specenv.cost.source.cost_model_for`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from specenv.cost.model import CostModel

__all__ = [
    "FORMS",
    "FitReport",
    "capped_transfer",
    "compare_forms",
    "fit_cost_model",
    "fit_draft",
    "fit_per_k",
    "fit_replay_model",
]

FORMS = ("U_r + L", "U_r + L + gamma*K", "U_r x C(K) + L")


@dataclass
class FitReport:
    """Everything ``specenv fit`` prints.

    Attributes:
        model: The fitted cost model (K = 0..kmax).
        per_k: One row per fitted K: coefficients, clustered SEs, p-values, N, R2, OOS metrics.
        forms: One row per pooled form of Table A6.
        draft: Draft-time fit: d1, d0, their SEs, R2, rows used, missing timings.
        ar: How the K = 0 coefficients were obtained.
    """

    model: CostModel
    per_k: pd.DataFrame
    forms: pd.DataFrame
    draft: dict[str, Any]
    ar: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {
            "per_k": _records(self.per_k),
            "forms": _records(self.forms),
            "draft": self.draft,
            "ar": self.ar,
            "cost_model": self.model.to_json(),
        }


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    out = []
    for rec in df.to_dict(orient="records"):
        out.append({k: (v.item() if isinstance(v, np.generic) else v) for k, v in rec.items()})
    return out


def _ols_cv(X: np.ndarray, y: np.ndarray, groups: np.ndarray, n_splits: int) -> dict[str, float]:
    """GroupKFold out-of-sample R2, RMSE and MAPE of an OLS design."""
    n_groups = len(np.unique(groups))
    splits = min(n_splits, n_groups)
    if n_splits == 0:
        return {}
    if splits < 2:
        return {"oos_r2": float("nan"), "oos_rmse_ms": float("nan"), "oos_mape_pct": float("nan")}
    from sklearn.model_selection import GroupKFold

    pred = np.empty_like(y)
    for train, test in GroupKFold(n_splits=splits).split(X, y, groups):
        beta, *_ = np.linalg.lstsq(X[train], y[train], rcond=None)
        pred[test] = X[test] @ beta
    resid = y - pred
    return {
        "oos_r2": float(1.0 - np.sum(resid**2) / np.sum((y - y.mean()) ** 2)),
        "oos_rmse_ms": float(np.sqrt(np.mean(resid**2))),
        "oos_mape_pct": float(100.0 * np.mean(np.abs(resid) / y)),
    }


def statsmodels_ols() -> Any:
    """The ``OLS`` and ``add_constant`` of statsmodels, imported from their own modules.

    The same objects as ``statsmodels.api.OLS`` and ``statsmodels.api.add_constant``, without the
    import of every statsmodels model that ``statsmodels.api`` does (about 0.6 s of CPU).
    """
    from types import SimpleNamespace

    from statsmodels.regression.linear_model import OLS
    from statsmodels.tools.tools import add_constant

    return SimpleNamespace(OLS=OLS, add_constant=add_constant)


def clustered_ols(
    y: np.ndarray, X: np.ndarray, groups: np.ndarray, where: str, group_col: str = "generation_id"
) -> Any:
    """OLS (statsmodels) with standard errors clustered by ``groups``; degenerate inputs are one line.

    Args:
        y: The timings.
        X: The design (intercept first).
        groups: One cluster label per row.
        where: The table (and subset) for the message: ``"rounds table, K=3"``.
        group_col: The column the clusters come from.

    Raises:
        ValueError: Fewer than two clusters (the clustered covariance divides by G - 1), or
            non-finite coefficients (timings too large to square).
    """
    import warnings

    sm = statsmodels_ols()

    n = len(np.unique(groups))
    if n < 2:
        raise ValueError(
            f"{where}: column '{group_col}': standard errors clustered by {group_col} need rows of two or more "
            f"groups, this fit has {n} (use a trace set with more generations)"
        )
    with warnings.catch_warnings():  # a degenerate fit is refused below, in one line, not warned about
        warnings.simplefilter("ignore", RuntimeWarning)
        res = sm.OLS(y, X).fit(cov_type="cluster", cov_kwds={"groups": groups})
    if not np.all(np.isfinite(res.params)):
        raise ValueError(f"{where}: the least-squares fit gives non-finite coefficients (timings too large?)")
    return res


def _unfit_reason(X: np.ndarray, y: np.ndarray, names: tuple[str, ...], time_col: str) -> str | None:
    """Why the rows of one budget cannot identify ``y = X b``, or None."""
    if len(y) < 5:
        return f"{len(y)} rounds (at least 5 needed)"
    for j, name in enumerate(names, start=1):
        if np.ptp(X[:, j]) == 0:
            return f"column '{name}' is constant ({X[0, j]:g} in every round): collinear with the intercept"
    if np.linalg.matrix_rank(X) < X.shape[1]:
        return f"columns {', '.join(repr(n) for n in names)} are collinear"
    if np.ptp(y) == 0:
        return f"column '{time_col}' is constant ({y[0]:g} ms in every round): no timing variation to fit"
    return None


def _design_k(grp: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    y = grp["T_T_ms"].to_numpy(np.float64)
    X = np.column_stack([np.ones(len(grp)), grp["U_r"].to_numpy(np.float64), grp["L"].to_numpy(np.float64)])
    return X, y


def unfit_budgets(rounds: pd.DataFrame) -> dict[int, str]:
    """The budgets K >= 1 whose rounds cannot identify the per-K form, with why (numpy only, no fitting)."""
    out: dict[int, str] = {}
    for K, grp in rounds[rounds["K"] >= 1].groupby("K", sort=True):
        reason = _unfit_reason(*_design_k(grp), ("U_r", "L"), "T_T_ms")
        if reason is not None:
            out[int(K)] = reason
    return out


def _too_few_budgets(fitted: int, skipped: dict[int, str]) -> ValueError:
    by_reason: dict[str, list[int]] = {}
    for k, r in sorted(skipped.items()):
        by_reason.setdefault(r, []).append(k)
    why = "; ".join(f"K={','.join(map(str, ks))}: {r}" for r, ks in by_reason.items())
    return ValueError(
        "rounds table: cost-model fit needs rounds at two or more budgets K >= 1 that identify "
        f"T_T = beta0 + alpha*U_r + c*L, {fitted} do" + (f" ({why})" if why else "")
    )


def check_fittable(rounds: pd.DataFrame) -> None:
    """Refuse, before any fitting, a rounds table with fewer than two budgets that identify the form.

    Raises:
        ValueError: One line naming the table and, per budget, the column at fault.
    """
    skipped = unfit_budgets(rounds)
    fitted = int(rounds.loc[rounds["K"] >= 1, "K"].nunique()) - len(skipped)
    if fitted < 2:
        raise _too_few_budgets(fitted, skipped)
    n = int(rounds["generation_id"].nunique())
    if n < 2:
        raise ValueError(
            "rounds table: column 'generation_id': standard errors clustered by generation_id need rows of two "
            f"or more groups, this fit has {n} (use a trace set with more generations)"
        )
    _draft_rows(rounds)


def fit_per_k(rounds: pd.DataFrame, n_splits: int = 5, progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    """Per-K OLS with clustered SEs and GroupKFold out-of-sample errors (K >= 1 only).

    ``progress``, if given, is called with ``"K=<k>"`` as each budget's fit starts. A budget whose
    rounds cannot identify the form (fewer than 5, a constant or collinear column) is skipped; why is
    kept in ``attrs["skipped"]`` (``{K: reason}``) for the message of a fit that has too few budgets.
    """
    rows = []
    skipped: dict[int, str] = {}
    for K, grp in rounds[rounds["K"] >= 1].groupby("K", sort=True):
        if progress:
            progress(f"K={K}")
        X, y = _design_k(grp)
        groups = grp["generation_id"].to_numpy()
        reason = _unfit_reason(X, y, ("U_r", "L"), "T_T_ms")
        if reason is not None:
            skipped[int(K)] = reason
            continue
        res = clustered_ols(y, X, groups, f"rounds table, K={K}")
        rows.append(
            {
                "K": int(K),
                "beta0": float(res.params[0]),
                "alpha": float(res.params[1]),
                "c": float(res.params[2]),
                "beta0_se": float(res.bse[0]),
                "alpha_se": float(res.bse[1]),
                "c_se": float(res.bse[2]),
                "alpha_p": float(res.pvalues[1]),
                "c_p": float(res.pvalues[2]),
                "N": int(len(grp)),
                "clusters": int(len(np.unique(groups))),
                "R2": float(res.rsquared),
                **_ols_cv(X, y, groups, n_splits),
                # what U_r alone explains out of sample within this budget (the paper's Table 6 view)
                **{f"{k}_u_only": v for k, v in _ols_cv(X[:, :2], y, groups, n_splits).items() if k == "oos_r2"},
            }
        )
    out = pd.DataFrame(rows)
    out.attrs["skipped"] = skipped
    return out


def _form_design(rounds: pd.DataFrame, form: str) -> np.ndarray:
    U = rounds["U_r"].to_numpy(np.float64)
    L = rounds["L"].to_numpy(np.float64)
    K = rounds["K"].to_numpy(np.int64)
    one = np.ones(len(rounds))
    if form == "U_r + L":
        return np.column_stack([one, U, L])
    if form == "U_r + L + gamma*K":
        return np.column_stack([one, U, L, K.astype(np.float64)])
    if form == "U_r x C(K) + L":
        levels = np.unique(K)
        dummies = (K[:, None] == levels[None, :]).astype(np.float64)
        return np.column_stack([dummies, dummies * U[:, None], L])
    raise ValueError(f"unknown form {form!r}")


def compare_forms(
    rounds: pd.DataFrame, n_splits: int = 5, progress: Callable[[str], None] | None = None
) -> pd.DataFrame:
    """Table A6: pooled model forms on all K >= 1 rounds.

    ``progress``, if given, is called with the name of each form as its fit starts.
    """
    sm = statsmodels_ols()

    data = rounds[rounds["K"] >= 1]
    y = data["T_T_ms"].to_numpy(np.float64)
    groups = data["generation_id"].to_numpy()
    rows = []
    for form in FORMS:
        if progress:
            progress(form)
        X = _form_design(data, form)
        res = sm.OLS(y, X).fit()
        cv = _ols_cv(X, y, groups, n_splits)
        rows.append(
            {
                "model": form,
                "R2": float(res.rsquared),
                "cv_rmse_ms": cv["oos_rmse_ms"],
                "cv_mape_pct": cv["oos_mape_pct"],
                "cv_r2": cv["oos_r2"],
            }
        )
    return pd.DataFrame(rows)


def _draft_rows(rounds: pd.DataFrame) -> pd.DataFrame:
    """The rounds the draft-time fit uses (K >= 1 with a recorded time), or ValueError when they cannot fit it."""
    data = rounds[(rounds["K"] >= 1) & (rounds["T_D_ms"] > 0)]
    if data["K"].nunique() < 2:
        raise ValueError("draft-time fit needs rounds at two or more budgets K >= 1 with draft timings")
    if np.ptp(data["T_D_ms"].to_numpy(np.float64)) == 0:
        raise ValueError(
            f"rounds table: column 'T_D_ms' is constant ({float(data['T_D_ms'].iloc[0]):g} ms in every round "
            "with K >= 1): no draft-time variation to fit"
        )
    return data


def fit_draft(rounds: pd.DataFrame) -> dict[str, Any]:
    """T_D = d1*K + d0 on K >= 1 rounds with a recorded (non-zero) draft time."""
    sm = statsmodels_ols()

    data = _draft_rows(rounds)
    missing = int((rounds.loc[rounds["K"] >= 1, "T_D_ms"] <= 0).sum())
    X = sm.add_constant(data["K"].to_numpy(np.float64))
    res = clustered_ols(
        data["T_D_ms"].to_numpy(np.float64), X, data["generation_id"].to_numpy(), "rounds table (draft times, K >= 1)"
    )
    # the draft floor of k = 0: an engine that drafts at every step (vLLM 0.32 keeps the draft's KV cache
    # in sync with one draft forward per request even at k = 0) records T_D > 0 on its K = 0 rounds;
    # the transformers engine records 0 there. Measured as the mean over those rounds when most have one.
    k0 = rounds.loc[rounds["K"] == 0, "T_D_ms"].to_numpy(np.float64)
    timed = k0[k0 > 0]
    floor = float(np.mean(timed)) if len(k0) and len(timed) * 2 > len(k0) else 0.0
    return {
        "d1": float(res.params[1]),
        "d0": float(res.params[0]),
        "d1_se": float(res.bse[1]),
        "d0_se": float(res.bse[0]),
        "R2": float(res.rsquared),
        "rows": int(len(data)),
        "missing_timings": missing,
        "floor": floor,
        "floor_rows": int(len(timed)) if floor else 0,
    }


def fit_cost_model(
    rounds: pd.DataFrame,
    kmax: int,
    top_k: int,
    n_splits: int = 5,
    source: dict[str, Any] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> FitReport:
    """Fit the full cost model K = 0..kmax from a rounds table.

    Args:
        rounds: A validated rounds table.
        kmax: Largest budget the model must cover (the trace set's Kmax).
        top_k: Experts per token (U of a single position).
        n_splits: GroupKFold folds.
        source: Provenance stored in the model.
        progress: Called as ``progress(done, total, what)`` as each step starts (the per-K fits,
            ``"K=<k>"``, then the pooled forms), with the number of steps done before it.

    Returns:
        The :class:`FitReport`.

    Raises:
        ValueError: If fewer than two budgets K >= 1 can be fitted.
    """
    check_fittable(rounds)  # before any fitting (and before a progress line): one line naming the column
    step: Callable[[str], None] | None = None
    if progress is not None:
        report, total = progress, int(rounds.loc[rounds["K"] >= 1, "K"].nunique()) + len(FORMS)
        done = iter(range(total))

        def step(what: str) -> None:
            report(next(done, total), total, what)

    per_k = fit_per_k(rounds, n_splits, step)
    model = _assemble(per_k, rounds, kmax, top_k, source)
    d = model.diagnostics
    forms = compare_forms(rounds, n_splits, step)
    return FitReport(model=model, per_k=per_k, forms=forms, draft=d["draft"], ar=d["ar"])


def _assemble(
    per_k: pd.DataFrame, rounds: pd.DataFrame, kmax: int, top_k: int, source: dict[str, Any] | None
) -> CostModel:
    """Per-K fits + AR step + draft fit -> a CostModel covering K = 0..kmax."""
    sm = statsmodels_ols()

    if len(per_k) < 2:
        raise _too_few_budgets(len(per_k), per_k.attrs.get("skipped", {}))
    beta0 = np.full(kmax + 1, np.nan)
    alpha = np.full(kmax + 1, np.nan)
    c = np.full(kmax + 1, np.nan)
    for rec in per_k.itertuples():
        if rec.K <= kmax:
            beta0[rec.K], alpha[rec.K], c[rec.K] = rec.beta0, rec.alpha, rec.c
    fitted = [k for k in range(1, kmax + 1) if np.isfinite(beta0[k])]
    filled = [k for k in range(1, kmax + 1) if k not in fitted]
    for arr in (beta0, alpha, c):
        arr[filled] = np.interp(filled, fitted, arr[fitted]) if filled else arr[filled]

    ar0 = rounds[rounds["K"] == 0]
    if len(ar0) >= 5 and ar0["L"].nunique() > 1:
        X = sm.add_constant(ar0["L"].to_numpy(np.float64))
        res = clustered_ols(ar0["T_T_ms"].to_numpy(np.float64), X, ar0["generation_id"].to_numpy(), "rounds table, K=0")
        beta0[0], alpha[0], c[0] = float(res.params[0]), 0.0, float(res.params[1])
        ar = {
            "extrapolated": False,
            "method": "OLS T_T = beta0 + c*L on K=0 rounds (U = top_k)",
            "rows": int(len(ar0)),
            "R2": float(res.rsquared),
        }
    else:
        low = fitted[:3]
        slope, icpt = np.polyfit(low, beta0[low], 1) if len(low) >= 2 else (0.0, beta0[low[0]])
        beta0[0] = float(icpt)
        alpha[0] = float(np.mean(alpha[low]))
        c[0] = float(np.mean(c[low]))
        ar = {
            "extrapolated": True,
            "method": f"beta0 linear in K over K={low} extended to 0; alpha, c their means",
            "rows": 0,
        }
    draft = fit_draft(rounds)
    return CostModel(
        beta0=beta0,
        alpha=alpha,
        c=c,
        d1=draft["d1"],
        d0=draft["d0"],
        d_floor=draft["floor"],
        top_k=top_k,
        ar_extrapolated=bool(ar["extrapolated"]),
        source=dict(source or {}) | {"kind": "fit", "filled_K": filled},
        diagnostics={"per_k": _records(per_k), "draft": draft, "ar": ar},
    )


def fit_replay_model(rounds: pd.DataFrame, kmax: int, top_k: int, source: dict[str, Any] | None = None) -> CostModel:
    """The cost model behind ``cost_model="fit"``: per-K OLS without cross-validation, AR step, draft fit.

    Args:
        rounds: A validated rounds table.
        kmax: Largest budget the model must cover.
        top_k: Experts per token.
        source: Provenance stored in the model.

    Raises:
        ValueError: If fewer than two budgets K >= 1 can be fitted.
    """
    check_fittable(rounds)
    return _assemble(fit_per_k(rounds, n_splits=0), rounds, kmax, top_k, source)


def _mape(model: CostModel, rounds: pd.DataFrame) -> float | None:
    """MAPE (%) of ``model``'s target time on ``rounds`` (None when there are none)."""
    if not len(rounds):
        return None
    y = rounds["T_T_ms"].to_numpy(np.float64)
    pred = model.target_ms(
        rounds["K"].to_numpy(np.int64), rounds["U_r"].to_numpy(np.float64), rounds["L"].to_numpy(np.float64)
    )
    return float(100.0 * np.mean(np.abs(y - pred) / y))


def capped_transfer(rounds: pd.DataFrame, kmax: int, top_k: int, train_ids: Any, test_ids: Any) -> dict[str, Any]:
    """Does the per-K cost model fitted on uncapped rounds price rounds run with an expert cap?

    Two models are fitted on the train generations' rounds (:func:`fit_replay_model`): ``uncapped``
    on the rounds with ``cap`` == 0 only, ``pooled`` on every round (capped rounds with their capped
    ``U_r``). Both are scored out of sample on the test generations' rounds with K >= 1 (the target
    time T_T; k = 0 rounds are never capped): MAPE on the uncapped rounds, on the capped rounds, per
    cap, and per K on the capped rounds. The mean signed error of the uncapped model on capped rounds
    (``bias_pct``, prediction minus measurement over measurement) says whether a cap costs more than
    its lower U predicts (e.g. the overhead of applying it).

    Args:
        rounds: A validated rounds table with the ``cap`` column.
        kmax: Largest budget.
        top_k: Experts per token.
        train_ids: Generation ids that fit the models.
        test_ids: Generation ids that score them.

    Returns:
        A plain-JSON dict.

    Raises:
        ValueError: If the table has no ``cap`` column or no capped rounds.
    """
    if "cap" not in rounds.columns or not (rounds["cap"] > 0).any():
        raise ValueError("capped_transfer: the rounds table has no capped rounds (column 'cap' > 0)")
    train = rounds[rounds["generation_id"].isin(list(train_ids))]
    test = rounds[rounds["generation_id"].isin(list(test_ids)) & (rounds["K"] >= 1)]
    uncapped = fit_replay_model(train[train["cap"] == 0], kmax, top_k, {"fit": "uncapped train rounds"})
    pooled = fit_replay_model(train, kmax, top_k, {"fit": "all train rounds (capped U)"})
    capped_test, plain_test = test[test["cap"] > 0], test[test["cap"] == 0]
    out: dict[str, Any] = {
        "train_rounds": {"uncapped": int((train["cap"] == 0).sum()), "capped": int((train["cap"] > 0).sum())},
        "test_rounds_K_ge_1": {"uncapped": len(plain_test), "capped": len(capped_test)},
    }
    for name, model in (("uncapped_fit", uncapped), ("pooled_fit", pooled)):
        pred = model.target_ms(
            capped_test["K"].to_numpy(np.int64),
            capped_test["U_r"].to_numpy(np.float64),
            capped_test["L"].to_numpy(np.float64),
        )
        y = capped_test["T_T_ms"].to_numpy(np.float64)
        out[name] = {
            "mape_uncapped_pct": _mape(model, plain_test),
            "mape_capped_pct": _mape(model, capped_test),
            "bias_capped_pct": float(100.0 * np.mean((pred - y) / y)),
            "mape_by_cap_pct": {str(int(B)): _mape(model, g) for B, g in capped_test.groupby("cap")},
            "mape_capped_by_K_pct": {str(int(K)): _mape(model, g) for K, g in capped_test.groupby("K")},
            "alpha": [float(a) for a in model.alpha],
            "beta0": [float(b) for b in model.beta0],
        }
    return out
