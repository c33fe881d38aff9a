"""The step-time cost model: what a user of a serving engine waits for, term by term.

The paper's cost model prices the *forwards* of a round: ``T_T = beta0(K) + alpha(K) U_r + c L`` for the
target's verification and ``T_D = d1 K + d0`` for the draft. A serving engine's step costs more than its
forwards: vLLM schedules, samples (the rejection sampler), and processes outputs in every step, and that
time is charged to every token a user waits for. An engine that times whole steps records it
(``rounds.T_step_ms``, the wall time of the engine step that ran the round), and a plain engine with no
drafter loaded gives the honest speedup reference (``manifest.extra.ar_reference``: its measured steps
and their line ``a + c L``).

:func:`fit_step_model` builds the :class:`~specenv.cost.model.CostModel` the environments, the oracle
and the benchmark then use for such a set, with every term of its own:

* the target and draft terms are the paper's forms fitted on the *wall-clock* forward times
  (``T_T_wall_ms``, ``T_D_wall_ms``; :func:`specenv.cost.fit.fit_replay_model`), a budget whose context
  slope comes out negative (noise: a step never gets cheaper with context) refitted with ``c = 0``;
* ``overhead[K]``: the engine's per-step time outside the forwards, the mean over the rounds at budget
  K of ``T_step - T_T_wall - T_D_wall`` (K = 0 included: a speculating engine's k = 0 step pays it too);
* ``ar_step = (a, c)``: the plain engine's step, the 1.0 of every speedup.

The analysis tables (``specenv fit``: the paper's Table A4/A6 view) keep the forward-time fit.

:func:`ablate` gives the two ablations of the sim-to-real table: without the ``U_r`` term (each K's
intercept absorbs the mean ``alpha U_r``) and without the per-step overhead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from specenv.cost.model import CostModel

#: Columns a rounds table needs for the step-time model.
STEP_COLUMNS = ("T_step_ms", "T_T_wall_ms", "T_D_wall_ms")


def has_step_times(rounds: pd.DataFrame | None, manifest_extra: dict[str, Any] | None) -> bool:
    """Whether a set carries what the step-time model needs (step and wall times, a plain reference)."""
    if rounds is None or not all(c in rounds.columns for c in STEP_COLUMNS):
        return False
    ref = (manifest_extra or {}).get("ar_reference")
    return isinstance(ref, dict) and "a_ms" in ref and "c_ms_per_token" in ref and bool((rounds["T_step_ms"] > 0).all())


def step_overhead(rounds: pd.DataFrame, kmax: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Per-K mean of ``T_step - T_T_wall - T_D_wall`` (ms) and its diagnostics.

    Budgets without rounds get the mean of the budgets that have them.

    Raises:
        ValueError: No round has a step time, or a mean is negative (the step time must contain its
            forwards: clocks that disagree, named with the budget).
    """
    rest = (rounds["T_step_ms"] - rounds["T_T_wall_ms"] - rounds["T_D_wall_ms"]).to_numpy(np.float64)
    K = rounds["K"].to_numpy(np.int64)
    over = np.full(kmax + 1, np.nan)
    sd = np.full(kmax + 1, np.nan)
    n = np.zeros(kmax + 1, dtype=np.int64)
    for k in range(kmax + 1):
        sel = rest[K == k]
        n[k] = len(sel)
        if len(sel):
            over[k], sd[k] = float(sel.mean()), float(sel.std(ddof=1)) if len(sel) > 1 else 0.0
    if not np.isfinite(over).any():
        raise ValueError("rounds: no round with a step time (T_step_ms) to fit the step overhead on")
    if np.any(over[np.isfinite(over)] < 0):
        k = int(np.flatnonzero(over < 0)[0])
        raise ValueError(
            f"rounds, column T_step_ms: at K={k} the step is shorter than its forwards on average "
            f"({over[k]:.3f} ms): the clocks disagree"
        )
    over[~np.isfinite(over)] = float(np.nanmean(over))
    return over, {"mean_ms": over.tolist(), "sd_ms": sd.tolist(), "rows": n.tolist()}


def fit_step_model(
    rounds: pd.DataFrame, kmax: int, top_k: int, ar_reference: dict[str, Any], source: dict[str, Any] | None = None
) -> CostModel:
    """The step-time cost model of a set (see the module docstring).

    Args:
        rounds: A validated rounds table with :data:`STEP_COLUMNS`.
        kmax: Largest budget the model covers.
        top_k: Experts per token.
        ar_reference: The plain engine's step line (``a_ms``, ``c_ms_per_token``; the manifest's
            ``extra.ar_reference``).
        source: Provenance stored in the model.

    Raises:
        ValueError: As :func:`specenv.cost.fit.fit_replay_model`, or a plain step that is not positive.
    """
    from specenv.cost.fit import fit_replay_model

    wall = rounds.assign(T_T_ms=rounds["T_T_wall_ms"], T_D_ms=rounds["T_D_wall_ms"])
    model = fit_replay_model(wall, kmax, top_k, source)
    refit = _nonnegative_context(model, wall)
    over, diag = step_overhead(rounds, kmax)
    a, c = float(ar_reference["a_ms"]), float(ar_reference["c_ms_per_token"])
    model.overhead = over
    model.ar_step = (a, c)
    model.__post_init__()  # re-check the two new terms
    model.source = dict(model.source) | {"kind": "fit-step", "clock": "wall"}
    model.diagnostics = dict(model.diagnostics) | {
        "overhead": diag,
        "c_refit_at_zero": refit,
        "ar_step": {
            k: ar_reference[k]
            for k in ("engine", "steps", "mean_ms", "a_ms", "c_ms_per_token", "r2")
            if k in ar_reference
        },
    }
    return model


def _nonnegative_context(model: CostModel, rounds: pd.DataFrame) -> list[int]:
    """Refit, with ``c = 0``, every budget whose context slope came out negative; returns those budgets.

    A verification step never gets cheaper with a longer context: a negative ``c`` is noise (the
    contexts of a set span a few hundred tokens), and a model that extrapolates it charges negative
    costs at long contexts. Those budgets get the OLS of ``T_T`` on ``1 + U_r`` alone (K = 0: the mean).
    """
    changed = []
    for k in range(model.kmax + 1):
        if model.c[k] >= 0:
            continue
        sel = rounds[rounds["K"] == k]
        y = sel["T_T_ms"].to_numpy(np.float64)
        if not len(y):
            continue
        if k == 0 or np.ptp(sel["U_r"].to_numpy(np.float64)) == 0:
            model.beta0[k], model.alpha[k] = float(y.mean()), 0.0
        else:
            X = np.column_stack([np.ones(len(y)), sel["U_r"].to_numpy(np.float64)])
            (b0, a), *_ = np.linalg.lstsq(X, y, rcond=None)
            model.beta0[k], model.alpha[k] = float(b0), float(a)
        model.c[k] = 0.0
        changed.append(k)
    return changed


def ablate(model: CostModel, rounds: pd.DataFrame, without: str) -> CostModel:
    """A copy of a step-time model with one term removed.

    Args:
        model: The full model.
        rounds: The rounds it was fitted on (``"U_r"``: each K's intercept absorbs ``alpha(K)`` times the
            mean ``U_r`` of its rounds, so the mean cost at K is kept).
        without: ``"U_r"`` (alpha = 0) or ``"overhead"`` (no per-step overhead).

    Raises:
        ValueError: For another ``without``.
    """
    beta0, alpha, over = model.beta0.copy(), model.alpha.copy(), model.overhead.copy()
    if without == "U_r":
        means = rounds.groupby("K")["U_r"].mean()
        for k in range(model.kmax + 1):
            u = float(means.get(k, model.top_k if k == 0 else np.nan))
            if not np.isfinite(u):
                u = float(model.top_k)
            beta0[k] += alpha[k] * u
        alpha[:] = 0.0
    elif without == "overhead":
        over[:] = 0.0
    else:
        raise ValueError(f"without={without!r}: expected 'U_r' or 'overhead'")
    return CostModel(
        beta0=beta0,
        alpha=alpha,
        c=model.c.copy(),
        d1=model.d1,
        d0=model.d0,
        top_k=model.top_k,
        ar_extrapolated=model.ar_extrapolated,
        source=dict(model.source) | {"ablation": f"without {without}"},
        diagnostics=dict(model.diagnostics),
        n_experts=model.n_experts,
        n_layers=model.n_layers,
        d_floor=model.d_floor,
        overhead=over,
        ar_step=model.ar_step,
    )
