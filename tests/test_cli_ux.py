"""What a user sees: progress of long work (bar, plain lines, --quiet), help texts, --version, wording."""

from __future__ import annotations

import io
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from specenv.cli import app
from specenv.progress import Progress, format_duration, is_quiet, set_quiet

LINE = re.compile(r"^generate: (\d+)/8 generations, \d+ s elapsed(, ETA \d+ s)?$")


def _invoke(args: list[str], **env: str):  # noqa: ANN202
    return CliRunner().invoke(app, args, env=env or None)


# ---------------------------------------------------------------- progress


def test_progress_lines_on_a_non_terminal_stderr(tmp_path: Path) -> None:
    res = _invoke(
        ["generate", "-n", "8", "--no-rounds", "--out", str(tmp_path / "g")], SPECENV_PROGRESS_INTERVAL="0.01"
    )
    assert res.exit_code == 0, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) >= 2, res.stderr
    assert all(LINE.match(ln) for ln in lines[:-1]), lines
    counts = [int(LINE.match(ln).group(1)) for ln in lines[:-1]]
    assert counts == sorted(counts)  # the count only grows
    assert re.fullmatch(r"generate: 8/8 generations, done in \d+ s", lines[-1]), lines[-1]
    assert res.stdout.startswith(f"wrote {tmp_path / 'g'}")  # stdout keeps only the result


@pytest.mark.parametrize("where", ["command", "group"])
def test_quiet_turns_progress_off(tmp_path: Path, where: str) -> None:
    args = ["generate", "-n", "4", "--no-rounds", "--out", str(tmp_path / "g")]
    args = [*args, "--quiet"] if where == "command" else ["--quiet", *args]
    res = _invoke(args, SPECENV_PROGRESS_INTERVAL="0.001")
    assert res.exit_code == 0, res.stderr
    assert res.stderr == ""
    assert "wrote" in res.stdout


def test_quiet_does_not_leak_into_the_next_run(tmp_path: Path) -> None:
    assert _invoke(["-q", "datasets"]).exit_code == 0
    _invoke(["datasets"])
    assert not is_quiet()


def test_progress_line_counts_eta_and_final_line() -> None:
    stream = io.StringIO()
    with Progress("bench", total=4, unit="policies", stream=stream, interval=3600) as prog:
        assert prog.mode == "lines"  # a StringIO is no terminal
        prog.update(0, what="ucb")
        assert prog.line() == "bench: 0/4 policies (ucb), 0 s elapsed"  # no ETA before the first item
        prog._start -= 30  # 30 s elapsed
        prog.update(1, what="cascade")
        assert prog.line() == "bench: 1/4 policies (cascade), 30 s elapsed, ETA 1 min 30 s"
        prog.advance(2)
        assert prog.line().endswith("3/4 policies (cascade), 30 s elapsed, ETA 10 s")
        prog._start -= 5  # 5 s later, no item done: the ETA counts down, it does not grow
        assert prog.line().endswith("35 s elapsed, ETA 5 s")
    assert stream.getvalue() == ""  # no timer line was due: no closing line either


def test_progress_phases_have_their_own_count_and_eta() -> None:
    stream = io.StringIO()
    with Progress("abtest", unit="runs", stream=stream, interval=3600) as prog:
        prog.phase("train fit", 4)
        prog._start -= 20
        prog.update(2)
        assert prog.line() == "abtest train fit: 2/4 runs, 20 s elapsed, ETA 20 s"
        prog._start -= 10  # 30 s in all: the second phase starts here, its rate is its own
        prog.phase("repeats", 10)
        assert prog.line() == "abtest repeats: 0/10 runs, 30 s elapsed"
        prog._start -= 4
        prog.update(1)
        assert prog.line() == "abtest repeats: 1/10 runs, 34 s elapsed, ETA 36 s"


def test_progress_timer_writes_lines_and_a_closing_line() -> None:
    stream = io.StringIO()
    with Progress("fit", stream=stream, interval=0.01) as prog:
        while stream.getvalue().count("\n") < 2:
            prog.update(what="K=1")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("fit: (K=1), ") and lines[0].endswith(" s elapsed")
    assert re.fullmatch(r"fit: done in \d+ s", lines[-1]), lines[-1]


def test_progress_no_closing_line_after_an_error() -> None:
    stream = io.StringIO()
    with pytest.raises(RuntimeError), Progress("x", total=3, stream=stream, interval=0.01):
        while not stream.getvalue():
            pass
        raise RuntimeError
    assert "done in" not in stream.getvalue()


def test_progress_off_and_quiet_write_nothing() -> None:
    stream = io.StringIO()
    with Progress("x", total=2, stream=stream, mode="off", interval=0.001) as prog:
        prog.advance()
        prog.echo("a log line")
    set_quiet(True)
    try:
        with Progress("x", stream=stream, interval=0.001) as prog:
            assert prog.mode == "off"
            prog.echo("a log line")
    finally:
        set_quiet(False)
    assert stream.getvalue() == ""
    with pytest.raises(ValueError, match="mode"):
        Progress("x", mode="loud")


def test_progress_bar_in_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    with Progress("train ppo", total=10, unit="steps", stream=stream) as prog:
        assert prog.mode == "bar"
        prog.update(5)
        prog.echo("a log line")
    assert "a log line" in stream.getvalue()


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.4, "0 s"), (41, "41 s"), (185, "3 min 05 s"), (3720, "1 h 02 min"), (-1, "0 s")]
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


# ---------------------------------------------------------------- help and --version


def test_version() -> None:
    res = _invoke(["--version"])
    assert res.exit_code == 0
    assert res.stdout == f"specenv {version('specenv')}\n"
    assert re.fullmatch(r"specenv \d+\.\d+\.\d+\S*\n", res.stdout)


def _commands() -> dict:
    """Every command and family group by how it is called (``fit``, ``batch``, ``batch bench``)."""
    found = {}
    for name, cmd in get_command(app).commands.items():  # type: ignore[attr-defined]
        found[name] = cmd
        for sub, subcmd in getattr(cmd, "commands", {}).items():
            found[f"{name} {sub}"] = subcmd
    return found


@pytest.mark.parametrize("command", [None, *_commands()])
def test_help_at_80_columns_shows_every_option_whole(command: str | None) -> None:
    res = _invoke((command.split() if command else []) + ["--help"], COLUMNS="80")
    assert res.exit_code == 0, res.stderr
    text = res.stdout
    cmd = get_command(app) if command is None else _commands()[command]
    names = [o for p in cmd.params for o in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))]
    names += ["--help"] + (["--quiet", "-q"] if command != "serve" else [])
    for name in names:
        if name.startswith("-"):
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} cut or missing:\n{text}"
    assert "<bool>" not in text and "<int" not in text and "<str>" not in text and "<path>" not in text, text
    assert "{" not in text.splitlines()[0], text  # usage line: TRACES, not {traces}
    assert "…" not in text and "╭" not in text, text  # plain help, nothing cut
    assert max(len(ln) for ln in text.splitlines()) <= 80, text


def test_help_names_arguments_in_capitals() -> None:
    res = _invoke(["fit", "--help"])
    assert res.stdout.splitlines()[0].endswith("fit [OPTIONS] TRACES")
    assert re.search(r"^  TRACES  ", res.stdout, re.M)
    bench = _invoke(["bench", "--help"]).stdout
    assert "[TRACES]" in bench.splitlines()[0] and "--episodes INT" in bench and "--out PATH" in bench


# ---------------------------------------------------------------- wording


def test_fit_shows_the_paper_in_brackets_only_for_a_paper_profile_set(small_traces: Path) -> None:
    live = _invoke(["fit", "live-cpu", "--folds", "2", "-q"], COLUMNS="200")
    assert live.exit_code == 0, live.stderr
    assert "Table A4" not in live.stdout and "Table A6" not in live.stdout and "[paper" not in live.stdout
    assert not re.search(r"\d \[\d", live.stdout)  # no bracketed reference figure in any cell
    assert "not a paper-profile set" in live.stdout
    paper = _invoke(["fit", str(small_traces), "--folds", "2", "-q"], COLUMNS="200")
    assert paper.exit_code == 0, paper.stderr
    assert "paper's Table A4 in brackets" in paper.stdout and "paper's Table A6 in brackets" in paper.stdout
    assert re.search(r"\d \[\d", paper.stdout) and "[paper 0.459*K + 0.073]" in paper.stdout


def test_fit_progress_counts_the_fits(small_traces: Path) -> None:
    res = _invoke(["fit", str(small_traces), "--folds", "2"], SPECENV_PROGRESS_INTERVAL="0.001")
    assert res.exit_code == 0, res.stderr
    assert re.search(r"^fit: \d+/9 fits \((K=\d|U_r)", res.stderr, re.M), res.stderr  # Kmax=6 budgets + 3 forms
    assert res.stderr.splitlines()[-1].startswith("fit: 9/9 fits, done in")


def test_oracle_delta_space_in_words(small_traces: Path) -> None:
    res = _invoke(["oracle", str(small_traces), "--delta", "--episodes", "0", "-q"], COLUMNS="200")
    assert res.exit_code == 0, res.stderr
    for words in ("more accepted drafts, costlier", "fewer accepted drafts, cheaper", "Boundary slope lambda"):
        assert words in res.stdout
    assert "II=" not in res.stdout and "hard envelope" not in res.stdout


def test_datasets_explains_versions() -> None:
    res = _invoke(["datasets"])
    assert res.exit_code == 0
    assert "paper-default-v2:" in res.stdout
    assert "newest version" in res.stdout and "-vN" in res.stdout
