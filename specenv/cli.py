"""The ``specenv`` command line.

Every command takes a trace set by registry name (``paper-default``) or by folder path. Bad
arguments and bad files end with one line on stderr (``specenv: error: ...``) and exit code 2;
nothing half-written is left behind (trace sets and cost models are written atomically).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(
    name="specenv",
    help="Speculation-length control on MoE models: traces, cost model, environment, oracle, policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)

Traces = Annotated[str, typer.Argument(help="Trace set: a registered name (e.g. paper-default) or a folder.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


def fail(msg: str) -> NoReturn:
    """Print one error line and exit with code 2."""
    err.print(f"specenv: error: {msg}", markup=False, highlight=False)
    raise typer.Exit(2)


def _progress(transient: bool = True) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=transient, disable=not err.is_terminal,
    )


def _load(traces: str) -> Any:
    from specenv.datasets import load_dataset
    from specenv.schema import TraceError

    try:
        return load_dataset(traces)
    except (TraceError, ValueError) as exc:
        fail(str(exc))


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=float) + "\n")


@app.command()
def generate(
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the trace set to.")],
    profile: Annotated[str, typer.Option(help="Generator profile.")] = "paper",
    generations: Annotated[int, typer.Option("--generations", "-n", min=1, help="Number of generations.")] = 128,
    kmax: Annotated[int, typer.Option(min=1, max=16, help="Longest draft chain.")] = 10,
    seed: Annotated[int, typer.Option(help="Master seed (output is deterministic given it).")] = 0,
    greedy: Annotated[bool, typer.Option(help="Greedy decoding: rho in {0,1} (default: T=0.7 sampling).")] = False,
    rounds: Annotated[bool, typer.Option(help="Also simulate fixed-K runs into a rounds table.")] = True,
    name: Annotated[str, typer.Option(help="Name written to the manifest.")] = "paper-generated",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Generate a synthetic trace set calibrated to the seed paper."""
    from specenv.generator import generate_paper

    if profile != "paper":
        fail(f"--profile: unknown profile '{profile}' (known: paper)")
    if out_dir.exists() and not overwrite:
        fail(f"--out: {out_dir} already exists (use --overwrite)")
    with _progress() as prog:
        task = prog.add_task("generating", total=generations)
        ts = generate_paper(
            generations, kmax, seed=seed, greedy=greedy, with_rounds=rounds, name=name,
            progress=lambda done, total: prog.update(task, completed=done),
        )
    ts.save(out_dir, overwrite=overwrite)
    summary = {"path": str(out_dir), **ts.manifest.counts, "kmax": kmax, "greedy": greedy, "seed": seed}
    if as_json:
        _print_json(summary)
    else:
        out.print(f"wrote {out_dir}: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k != "path"))


@app.command()
def validate(traces: Traces, as_json: JsonOpt = False) -> None:
    """Validate a trace set (schema, ranges, hashes); exit 2 with one line on the first problem."""
    ts = _load(traces)
    m = ts.manifest
    summary = {
        "name": m.name, "version": m.version, "source": m.source, "profile": m.profile,
        "schema_version": m.schema_version, "kmax": m.kmax, "greedy": m.greedy,
        "model": {"n_layers": m.model.n_layers, "n_experts": m.model.n_experts, "top_k": m.model.top_k},
        "counts": m.counts, "valid": True,
    }
    if as_json:
        _print_json(summary)
    else:
        out.print(f"{traces}: valid ({m.name} v{m.version}, {m.source}/{m.profile}, Kmax={m.kmax}, "
                  + ", ".join(f"{k}={v}" for k, v in m.counts.items()) + ")")


@app.command()
def fit(
    traces: Traces,
    save: Annotated[Path | None, typer.Option("--out", "-o", help="Write the cost model JSON here.")] = None,
    folds: Annotated[int, typer.Option(min=2, help="GroupKFold folds (by generation).")] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Fit the per-K cost model T_T = beta0 + alpha*U_r + c*L (and T_D, AR step) on the rounds table."""
    from specenv import paper
    from specenv.fit import fit_cost_model

    ts = _load(traces)
    if ts.rounds is None:
        fail(f"{traces}: trace set has no rounds table to fit on")
    try:
        rep = fit_cost_model(ts.rounds, ts.kmax, ts.facts.top_k, folds, source={"traces": ts.manifest.name})
    except ValueError as exc:
        fail(f"{traces}: {exc}")
    if save is not None:
        rep.model.save(save)
    if as_json:
        _print_json(rep.to_json())
        return
    tab = Table(title=f"Per-K cost model on {ts.manifest.name} (paper's Table A4 in brackets)")
    for col in ("K", "alpha ms/expert", "c 1e-3 ms/tok", "beta0 ms", "N", "R2", "OOS MAPE %", "alpha p"):
        tab.add_column(col, justify="right")
    for r in rep.per_k.itertuples():
        ref = paper.TABLE_A4.get(r.K)

        def cell(v: float, idx: int, scale: float = 1.0, fmt: str = "{:.4f}", ref: Any = ref) -> str:
            s = fmt.format(v * scale)
            if ref is not None and ref[idx] is not None:
                s += " [" + fmt.format(ref[idx] * scale) + "]"
            return s

        tab.add_row(str(r.K), cell(r.alpha, 0), cell(r.c, 1, 1e3, "{:.3f}"), cell(r.beta0, 2, fmt="{:.3f}"),
                    str(r.N), cell(r.R2, 3), cell(r.oos_mape_pct, 4, fmt="{:.2f}"), f"{r.alpha_p:.1e}")
    out.print(tab)
    t6 = Table(title="Pooled forms (paper's Table A6 in brackets)")
    for col in ("model", "R2", "CV RMSE ms", "CV MAPE %"):
        t6.add_column(col, justify="right")
    for r in rep.forms.itertuples():
        ref6 = paper.TABLE_A6[r.model]
        t6.add_row(r.model, f"{r.R2:.3f} [{ref6[0]:.3f}]", f"{r.cv_rmse_ms:.3f} [{ref6[1]:.3f}]",
                   f"{r.cv_mape_pct:.2f} [{ref6[2]:.2f}]")
    out.print(t6)
    d = rep.draft
    out.print(f"draft: T_D = {d['d1']:.3f}*K + {d['d0']:.3f} ms  [paper 0.459*K + 0.073]  "
              f"(R2={d['R2']:.3f}, {d['missing_timings']} missing timings)")
    m = rep.model
    flag = "EXTRAPOLATED (no K=0 rounds)" if rep.ar["extrapolated"] else "fitted on K=0 rounds"
    out.print(f"AR step (K=0): T = {m.beta0[0]:.3f} + {m.alpha[0]:.4f}*U + {m.c[0] * 1e3:.3f}e-3*L ms, {flag}")
    if save is not None:
        out.print(f"cost model written to {save}")


@app.command("datasets")
def datasets_cmd(as_json: JsonOpt = False) -> None:
    """List the registered (shipped) trace sets."""
    from specenv.datasets import list_datasets

    rows = [{"id": d.id, "name": d.name, "version": d.version, "description": d.description} for d in list_datasets()]
    if as_json:
        _print_json(rows)
    else:
        for r in rows:
            out.print(f"{r['id']}: {r['description']}")


def main() -> None:
    """Console entry point."""
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover - interactive
        err.print("specenv: interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
