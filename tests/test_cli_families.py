"""The problem families on the command line: ``specenv batch fit|bench`` and ``specenv caps bench``.

The older spellings (``fit-batch``, ``bench --batch B``, ``bench-caps``) are aliases: hidden from the
command list, the same functions, the same JSON and the same files byte for byte.
"""

from __future__ import annotations

import filecmp
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specenv.cli import app, batch_app, caps_app
from specenv.io import OUTPUTS_MARK
from tests.rows import cap_trace_set


def _run(args: list[str]):  # noqa: ANN202
    return CliRunner().invoke(app, [*map(str, args), "--quiet"])


def _untimed(text: str) -> dict:
    """A batch benchmark's JSON without its one wall-clock field (``context.seconds``)."""
    doc = json.loads(text)
    doc["context"].pop("seconds")
    return doc


def _same_files(a: Path, b: Path, timed: tuple[str, ...] = ()) -> None:
    """The same file names in ``a`` and ``b``, byte for byte (the ``timed`` JSON files: but for their wall clock)."""
    # the output mark lists the files' sha256, the timed ones included: compared through them
    names = sorted(p.name for p in a.iterdir() if p.name != OUTPUTS_MARK)
    assert names == sorted(p.name for p in b.iterdir() if p.name != OUTPUTS_MARK) and names
    assert set(timed) <= set(names)
    for name in timed:
        assert _untimed((a / name).read_text()) == _untimed((b / name).read_text()), name
    match, mismatch, errors = filecmp.cmpfiles(a, b, [n for n in names if n not in timed], shallow=False)
    assert (mismatch, errors) == ([], []), (mismatch, errors)


def _callbacks(typer_app) -> dict:  # noqa: ANN001
    return {c.name: c.callback for c in typer_app.registered_commands}


def test_old_spellings_are_hidden_aliases_of_the_family_commands() -> None:
    top = _callbacks(app)
    assert top["fit-batch"] is _callbacks(batch_app)["fit"]
    assert top["bench-caps"] is _callbacks(caps_app)["bench"]
    hidden = {c.name for c in app.registered_commands if c.hidden}
    assert hidden == {"fit-batch", "bench-caps"}
    listing = _run(["--help"]).stdout
    commands = re.findall(r"^  (\S+)  ", listing.split("Commands:")[1], re.M)
    assert "batch" in commands and "caps" in commands
    assert "fit-batch" not in commands and "bench-caps" not in commands
    assert {"fit", "oracle", "train", "bench"} <= set(commands)  # the single-request family stays on top


def test_batch_bench_equals_bench_with_batch(small_traces: Path, tmp_path: Path) -> None:
    common = ["--episodes", "1", "--kmax", "3", "--no-learners", "--seed", "1", "--json"]
    new = _run(["batch", "bench", small_traces, "--batch", "2", "--out", tmp_path / "new", *common])
    old = _run(["bench", small_traces, "--batch", "2", "--out", tmp_path / "old", *common])
    assert new.exit_code == 0, new.output
    assert old.exit_code == 0, old.output
    assert json.loads(new.stdout)["context"]["batch_size"] == 2
    assert _untimed(new.stdout) == _untimed(old.stdout)
    _same_files(tmp_path / "new", tmp_path / "old", timed=("bench-batch2.json",))


def test_batch_fit_equals_fit_batch(tmp_path: Path) -> None:
    new = _run(["batch", "fit", "--folds", "2", "--out", tmp_path / "new.json", "--json"])
    old = _run(["fit-batch", "--folds", "2", "--out", tmp_path / "old.json", "--json"])
    assert new.exit_code == 0, new.output
    assert new.stdout == old.stdout and json.loads(new.stdout)
    assert (tmp_path / "new.json").read_bytes() == (tmp_path / "old.json").read_bytes()


def test_caps_bench_equals_bench_caps(tmp_path: Path) -> None:
    cap_set = tmp_path / "caps-syn"
    cap_trace_set(n_generations=12, kmax=4, seed=5).save(cap_set)
    common = [cap_set, "--weight", "0", "--weight", "inf", "--only", "transformers", "--json"]
    new = _run(["caps", "bench", *common, "--out", tmp_path / "new"])
    old = _run(["bench-caps", *common, "--out", tmp_path / "old"])
    assert new.exit_code == 0, new.output
    assert new.stdout == old.stdout and json.loads(new.stdout)["summary"]
    _same_files(tmp_path / "new", tmp_path / "old")


@pytest.mark.parametrize("option", [["--ray"], ["--policies", "."], ["--only", "fixed"], ["--drafting", "block"]])
def test_batch_bench_has_no_option_it_would_ignore(small_traces: Path, tmp_path: Path, option: list[str]) -> None:
    res = _run(["batch", "bench", small_traces, "--out", tmp_path / "x", *option])
    assert res.exit_code == 2
    assert res.stderr.startswith(f"specenv: error: {option[0]}: no such option") and res.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_batch_bench_refuses_bad_values_before_any_work(small_traces: Path, tmp_path: Path) -> None:
    for args, needle in (
        (["--batch", "0"], "--batch"),
        (["--learners", "nope"], "--learners"),
        (["--kmax", "99"], "--kmax"),
    ):
        res = _run(["batch", "bench", small_traces, "--out", tmp_path / "x", *args])
        assert res.exit_code == 2 and res.stderr.startswith(f"specenv: error: {needle}"), (args, res.stderr)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("where", ["group", "command"])
def test_quiet_is_accepted_on_the_family_group_and_its_command(tmp_path: Path, where: str) -> None:
    args = ["fit", "--folds", "2", "--out", str(tmp_path / "m.json")]
    argv = ["batch", "--quiet", *args] if where == "group" else ["batch", *args, "--quiet"]
    res = CliRunner().invoke(app, argv, env={"SPECENV_PROGRESS_INTERVAL": "0.001"})
    assert res.exit_code == 0, res.output
    assert res.stderr == "" and "batch cost model written to" in res.stdout
