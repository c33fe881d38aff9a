"""The single-request cost-model fit: ``specenv fit`` (per-K T_T, the pooled forms, T_D and the AR step)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from specenv.cli.common import (
    JsonOpt,
    OverwriteOpt,
    Traces,
    check_not_foreign,
    check_out_file,
    fail,
    json_format_is,
    load_traces,
    out,
    strict_json,
)
from specenv.progress import Progress


def fit(
    traces: Traces,
    save: Annotated[Path | None, typer.Option("--out", "-o", help="Write the cost model JSON here.")] = None,
    folds: Annotated[int, typer.Option(min=2, max=1000, help="GroupKFold folds (by generation).")] = 5,
    as_json: JsonOpt = False,
    overwrite: OverwriteOpt = False,
) -> None:
    """Fit the per-K cost model T_T = beta0 + alpha*U_r + c*L (and T_D, AR step) on the rounds table."""
    from specenv.cost.fit import fit_cost_model
    from specenv.cost.model import FORMAT, CostModel

    if save is not None:
        check_out_file("--out", save)
        check_not_foreign("--out", [save], overwrite, mine=lambda p: json_format_is(p, FORMAT))
    ts = load_traces(traces)
    if not ts.has_rounds:
        fail(f"{traces}: trace set has no rounds table to fit on")
    n_gen = int(ts.rounds["generation_id"].nunique())
    if folds > n_gen:
        fail(f"--folds: {folds} folds need at least {folds} generations, the rounds table has {n_gen}")
    try:
        with Progress("fit", unit="fits") as prog:
            rep = fit_cost_model(
                ts.rounds,
                ts.kmax,
                ts.facts.top_k,
                folds,
                source={"traces": ts.manifest.name},
                progress=lambda done, total, what: prog.update(done, total, what),
            )
        from specenv.cost.steptime import fit_step_model, has_step_times

        extra = ts.manifest.extra or {}
        if has_step_times(ts.rounds, extra):  # the model the envs and the oracle use: the step's wall time
            rep.model = fit_step_model(
                ts.rounds, ts.kmax, ts.facts.top_k, extra["ar_reference"], {"traces": ts.manifest.name}
            )
    except ValueError as exc:
        fail(f"{traces}: {exc}")
    rep.model.n_experts, rep.model.n_layers = ts.facts.n_experts, ts.facts.n_layers  # recorded in the JSON
    try:  # what loading the model would refuse is refused before anything is written
        CostModel.from_json(rep.model.to_json(), f"{traces}: fitted cost model")
    except ValueError as exc:
        fail(str(exc))
    text = strict_json(rep.to_json())  # a non-finite figure is refused before anything is written
    if save is not None:
        rep.model.save(save)
    if as_json:
        sys.stdout.write(text + "\n")
        return
    _print_fit(rep, ts.manifest.name, paper_profile=_is_paper_profile(ts.manifest))
    if save is not None:
        out.print(f"cost model written to {save}")


def _is_paper_profile(manifest: Any) -> bool:
    """Whether a trace set comes from the paper-profile generator (its figures compare with the paper's)."""
    return manifest.source == "generator" and manifest.profile == "paper"


def _print_fit(rep: Any, name: str, paper_profile: bool = True) -> None:
    """Human-readable ``specenv fit`` output: the per-K table, the pooled forms, T_D and the AR step.

    Args:
        rep: The fit (:class:`specenv.cost.fit.FitReport`).
        name: The trace set's name (the tables' titles).
        paper_profile: Show the paper's figures (Tables A4, A6, its T_D) in brackets: only for a
            paper-profile set, since any other set measures another model.
    """
    from specenv.traces import paper

    brackets = " (paper's Table A{} in brackets)" if paper_profile else ""
    tab = Table(title=f"Per-K cost model on {name}" + brackets.format(4))
    u_only = "oos_r2_u_only" in rep.per_k.columns
    cols = ("K", "alpha ms/expert", "c 1e-3 ms/tok", "beta0 ms", "N", "R2", "OOS MAPE %", "alpha p")
    for col in cols + (("U_r-only OOS R2",) if u_only else ()):
        tab.add_column(col, justify="right")
    for r in rep.per_k.itertuples():
        ref = paper.TABLE_A4.get(r.K) if paper_profile else None

        def cell(v: float, idx: int, scale: float = 1.0, fmt: str = "{:.4f}", ref: Any = ref) -> str:
            s = fmt.format(v * scale)
            if ref is not None and ref[idx] is not None:
                s += " [" + fmt.format(ref[idx] * scale) + "]"
            return s

        tab.add_row(
            str(r.K),
            cell(r.alpha, 0),
            cell(r.c, 1, 1e3, "{:.3f}"),
            cell(r.beta0, 2, fmt="{:.3f}"),
            str(r.N),
            cell(r.R2, 3),
            cell(r.oos_mape_pct, 4, fmt="{:.2f}"),
            f"{r.alpha_p:.1e}",
            *((f"{r.oos_r2_u_only:.3f}",) if u_only else ()),
        )
    out.print(tab)
    t6 = Table(title="Pooled forms" + brackets.format(6))
    for col in ("model", "R2", "CV RMSE ms", "CV MAPE %"):
        t6.add_column(col, justify="right")
    for r in rep.forms.itertuples():
        ref6 = paper.TABLE_A6[r.model] if paper_profile else None

        def cell6(v: float, idx: int, fmt: str, ref6: Any = ref6) -> str:
            return fmt.format(v) + (" [" + fmt.format(ref6[idx]) + "]" if ref6 is not None else "")

        t6.add_row(
            r.model, cell6(r.R2, 0, "{:.3f}"), cell6(r.cv_rmse_ms, 1, "{:.3f}"), cell6(r.cv_mape_pct, 2, "{:.2f}")
        )
    out.print(t6)
    d = rep.draft
    ref_d = "  [paper 0.459*K + 0.073]  " if paper_profile else "  "
    out.print(
        f"draft: T_D = {d['d1']:.3f}*K + {d['d0']:.3f} ms{ref_d}"
        f"(R2={d['R2']:.3f}, {d['missing_timings']} missing timings)",
        markup=False,
    )
    if d.get("floor"):
        out.print(
            f"draft floor at k=0: {d['floor']:.3f} ms (measured on {d['floor_rows']} K=0 rounds: the engine drafts "
            "every step; charged to k=0 rounds, not to plain decoding)",
            markup=False,
        )
    m = rep.model
    flag = "EXTRAPOLATED (no K=0 rounds)" if rep.ar["extrapolated"] else "fitted on K=0 rounds"
    out.print(f"AR step (K=0): T = {m.beta0[0]:.3f} + {m.alpha[0]:.4f}*U + {m.c[0] * 1e3:.3f}e-3*L ms, {flag}")
    if m.ar_step is not None:
        a, c = m.ar_step
        ar_mid = float(m.diagnostics.get("ar_step", {}).get("mean_ms", a))
        over = ", ".join(f"{x:.2f}" for x in m.overhead)
        out.print(
            f"step time (what a user waits for): plain engine (no drafter) {a:.3f} + {c * 1e3:.3f}e-3*L ms per token; "
            f"engine overhead per step outside the forwards, K=0..{m.kmax}: {over} ms; "
            f"a drafted token costs {m.d1:.3f} ms (wall) = {100 * m.d1 / max(ar_mid, 1e-9):.1f}% "
            f"of the mean plain step ({ar_mid:.3f} ms)",
            markup=False,
        )
    if not paper_profile:
        out.print(f"(no paper figures in brackets: {name} is not a paper-profile set, it measures another model)")
