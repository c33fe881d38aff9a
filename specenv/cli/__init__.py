"""The ``specenv`` command line: the typer app, one module per command group.

Every command takes a trace set by registry name (``paper-default``) or by folder path. Bad
arguments and bad files end with one line on stderr (``specenv: error: ...``) naming the argument,
file or field, and exit code 2 (click's usage errors too: :class:`specenv.cli.common.Group`
formats them). Every command checks its arguments, inputs and output locations before it does any
work or prints progress, so a refused command has written nothing. Nothing half-written is left
behind either (trace sets and cost models are written atomically), and ``--overwrite`` replaces
only a trace set (:func:`specenv.traces.traceset.check_save_destination`). JSON output never holds NaN or
Infinity.

Warnings of the libraries underneath (statsmodels, numpy, Ray, gymnasium, Stable-Baselines3, Minari)
are not shown, so the one error line of a refusal is the only line (:func:`quiet_warnings`); set
``SPECENV_WARNINGS=1`` (or give Python ``-W`` options) to see them. ``serve`` hands its process over
to vLLM, whose warnings are its own: it is left alone.

The problem families are reached the same way: the single-request family at the top
(``specenv fit|oracle|train|bench``), the others as a group each, ``specenv batch fit|bench`` and
``specenv caps bench``. The older spellings ``specenv fit-batch``, ``specenv bench --batch B`` and
``specenv bench-caps`` are aliases (hidden from the command list): they call the same functions and
write the same JSON and files.

The command modules hold plain functions; this module registers them, so the whole command line
reads here: :mod:`~specenv.cli.traces` (generate, validate, datasets), :mod:`~specenv.cli.fit`,
:mod:`~specenv.cli.oracle`, :mod:`~specenv.cli.train` (train, export, tune),
:mod:`~specenv.cli.bench` (bench, report), :mod:`~specenv.cli.batch`, :mod:`~specenv.cli.caps`,
:mod:`~specenv.cli.live` (collect, abtest, models) and :mod:`~specenv.cli.serve`.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from specenv.cli import batch, bench, caps, fit, live, oracle, serve, traces, train
from specenv.cli.common import HELP_WIDTH, Group, QuietOpt, err, out
from specenv.validation import hold_memo, release_memo

#: Settings every group of the command line shares: plain click help, one-line errors (:class:`Group`).
_GROUP = {
    "cls": Group,
    "no_args_is_help": True,
    "add_completion": False,
    "pretty_exceptions_enable": False,
    # plain click help: no <bool>/<int> type markers, option names never cut in a narrow terminal
    "rich_markup_mode": None,
    "context_settings": {"max_content_width": HELP_WIDTH},
}

app = typer.Typer(
    name="specenv",
    help="Speculation-length control on MoE models: traces, cost model, environment, oracle, policies.",
    **_GROUP,
)


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


@app.callback()
def _root(
    ctx: typer.Context,
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
    # a refused or failed command writes nothing, not even the validation cache's entries
    hold_memo()
    ctx.call_on_close(lambda: release_memo(_ended_well()))
    if ctx.invoked_subcommand != "serve":
        ctx.with_resource(quiet_warnings())


#: Set to 1 to see the warnings of the libraries underneath (:func:`quiet_warnings`).
WARNINGS_ENV = "SPECENV_WARNINGS"


@contextmanager
def quiet_warnings() -> Iterator[None]:
    """For one command: no Python warnings but specenv's own, and Ray's logs at errors only.

    Off when ``SPECENV_WARNINGS`` is set (not ``0``) or Python was given ``-W`` options
    (``sys.warnoptions``: the user chose). The filters and the environment are restored at the end.
    """
    if sys.warnoptions or os.environ.get(WARNINGS_ENV, "0") not in ("", "0"):
        yield
        return
    import logging

    ray_var = "RAY_BACKEND_LOG_LEVEL"  # Ray's core worker (gcs_client connection retries) logs on stderr
    had = os.environ.get(ray_var)
    os.environ.setdefault(ray_var, "error")
    ray_log = logging.getLogger("ray")  # and its Python side (log_to_driver=False keeps the workers' off)
    level = ray_log.level
    ray_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.filterwarnings("default", message=r"specenv")  # specenv's own notes stay visible
            yield
    finally:
        ray_log.setLevel(level)
        if had is None:
            os.environ.pop(ray_var, None)


def _ended_well() -> bool:
    """Whether the command being closed ends without an exception, or with exit status 0."""
    exc = sys.exc_info()[1]
    if exc is None:
        return True
    code = getattr(exc, "exit_code", getattr(exc, "code", 1))
    return code in (None, 0)


# the trace sets
app.command("generate")(traces.generate)
app.command("validate")(traces.validate)
app.command("datasets")(traces.datasets)
# the single-request family
app.command("fit")(fit.fit)
app.command("oracle")(oracle.oracle_cmd)
app.command("train")(train.train)
app.command("export")(train.export)
app.command("tune")(train.tune)
app.command("bench")(bench.bench)
app.command("report")(bench.report)
# live engines
app.command("collect")(live.collect)
app.command("abtest")(live.abtest)
app.command("models")(live.models)
app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve.serve)

# the batch family: B concurrent requests
batch_app = typer.Typer(
    name="batch",
    help="The batch family (B concurrent requests): fit the batch cost model, benchmark the batch controllers.",
    epilog="Older spellings, still accepted: specenv fit-batch (batch fit), specenv bench --batch B (batch bench).",
    **_GROUP,
)
batch_app.command("fit")(batch.fit)
batch_app.command("bench")(batch.bench)
app.add_typer(batch_app)
app.command("fit-batch", hidden=True)(batch.fit)  # alias of `specenv batch fit`

# the expert-cap family: the joint (k, expert cap) action
caps_app = typer.Typer(
    name="caps",
    help="The expert-cap family (the joint (k, expert cap) action): benchmark it against the joint oracle.",
    epilog="Older spelling, still accepted: specenv bench-caps (caps bench).",
    **_GROUP,
)
caps_app.command("bench")(caps.bench)
app.add_typer(caps_app)
app.command("bench-caps", hidden=True)(caps.bench)  # alias of `specenv caps bench`


def main() -> None:
    """Console entry point."""
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover - interactive
        err.print("specenv: interrupted")
        sys.exit(130)
