"""The output rule: no command replaces a file it did not write without ``--overwrite``.

A file is specenv's when it carries specenv's own marker (a cost model's ``format``, the report's
generator tag) or, for the files of a result folder (CSV, figures), when the folder's mark
(:data:`specenv.io.OUTPUTS_MARK`) lists it with its current sha256. A user's file of the same name
is refused before any work, one line, nothing changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specenv.io import OUTPUTS_MARK, foreign_files, record_written
from tests.hostile.harness import reject_cleanly, run_cli
from tests.hostile.test_cli_report import _write_valid

USER = "a user's file\n"
REFUSED = ["specenv did not write it", "--overwrite"]


def _user_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(USER)
    return path


def test_foreign_files_by_mark_and_content(tmp_path):
    mine, theirs, changed = tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "c.csv"
    for p in (mine, theirs, changed):
        p.write_text("x\n")
    record_written([mine, changed])
    changed.write_text("edited\n")
    assert foreign_files([mine, theirs, changed, tmp_path / "missing"]) == [theirs, changed]
    assert foreign_files([theirs], mine=lambda p: True) == []
    assert json.loads((tmp_path / OUTPUTS_MARK).read_text()).keys() == {"a.csv", "c.csv"}


@pytest.mark.parametrize(
    "command", [["fit", "{T}"], ["batch", "fit"], ["fit-batch"]], ids=["fit", "batch-fit", "fit-batch"]
)
def test_fit_out_keeps_a_users_file(tmp_path, small_traces, command):
    target = _user_file(tmp_path / "model.json")
    args = [str(small_traces) if a == "{T}" else a for a in command]
    reject_cleanly([*args, "--out", target], [str(target), *REFUSED], [tmp_path])


def test_fit_out_replaces_its_own_model_and_a_file_given_overwrite(tmp_path, small_traces):
    target = _user_file(tmp_path / "model.json")
    assert run_cli(["fit", small_traces, "--out", target, "--overwrite"]).exit_code == 0
    assert json.loads(target.read_text())["format"] == "specenv.costmodel/1"
    first = target.read_bytes()
    assert run_cli(["fit", small_traces, "--out", target]).exit_code == 0  # its format says it is specenv's
    assert target.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json"]  # no mark beside a single file


CASES = [
    ("bench-summary", ["bench", "{T}", "--out", "{D}"], "summary.csv"),
    ("bench-figure", ["bench", "{T}", "--out", "{D}"], "speedup.png"),
    ("batch-bench", ["batch", "bench", "{T}", "--batch", "2", "--out", "{D}"], "bench-batch2.json"),
    ("bench-batch-alias", ["bench", "{T}", "--batch", "2", "--out", "{D}"], "bench-batch2.md"),
    ("caps-bench", ["caps", "bench", "--out", "{D}"], "frontier.png"),
]


@pytest.mark.parametrize(("case", "args", "name"), CASES, ids=[c[0] for c in CASES])
def test_result_folder_keeps_a_users_file(tmp_path, small_traces, case, args, name):
    folder = tmp_path / "out"
    target = _user_file(folder / name)
    fill = {"{T}": str(small_traces), "{D}": str(folder)}
    reject_cleanly([fill.get(a, a) for a in args], [str(target), *REFUSED], [tmp_path])


def test_report_keeps_a_users_page_and_replaces_its_own(tmp_path):
    folder = tmp_path / "out"
    _write_valid(folder)
    page = _user_file(folder / "report.html")
    reject_cleanly(["report", folder], [str(page), *REFUSED], [tmp_path])
    assert run_cli(["report", folder, "--overwrite"]).exit_code == 0
    assert page.read_text() != USER
    assert run_cli(["report", folder]).exit_code == 0  # its own page, recognised by the generator tag


def test_overwrite_never_replaces_a_folder_or_link(tmp_path, small_traces):
    (tmp_path / "model.json").symlink_to(tmp_path / "elsewhere.json")
    reject_cleanly(
        ["fit", small_traces, "--out", tmp_path / "model.json", "--overwrite"], ["not a regular file"], [tmp_path]
    )


# ---------------------------------------------------------------------- argument checks of round 3
ARG_CASES = [
    (
        "collect-17-caps",
        ["collect", "--engine", "hf", "--caps", ",".join(map(str, range(1, 18))), "-o", "{W}/c"],
        ["--caps", "16"],
    ),
    (
        "batch-no-learners-with-learners",
        ["batch", "bench", "{T}", "--no-learners", "--learners", "survival", "--out", "{W}/o"],
        ["--learners"],
    ),
    (
        "bench-batch-no-learners-with-learners",
        ["bench", "{T}", "--batch", "2", "--no-learners", "--learners", "survival", "--out", "{W}/o"],
        ["--learners"],
    ),
    ("abtest-batch-empty-item", ["abtest", "--batch", "1,,8"], ["--batch", "1,,8"]),
    ("abtest-batch-trailing-comma", ["abtest", "--batch", "2,"], ["--batch"]),
    (
        "export-block-without-lookahead",
        ["export", "minari", "--dataset", "{T}", "--policy", "oracle", "--drafting", "block", "--root", "{W}/r"],
        ["--lookahead", "block"],
    ),
]


@pytest.mark.parametrize(("case", "args", "names"), ARG_CASES, ids=[c[0] for c in ARG_CASES])
def test_argument_refused_before_work(tmp_path, small_traces, case, args, names):
    fill = {"{T}": str(small_traces), "{W}": str(tmp_path)}
    reject_cleanly([fill.get(a, a.replace("{W}", str(tmp_path))) for a in args], names, [tmp_path])


def test_failed_export_leaves_no_root_behind(tmp_path, small_traces):
    """A policy that fails on its first action: the export fails after the root was made; it is removed again."""
    from specenv.policy import registry
    from specenv.policy.base import Policy

    class Boom(Policy):
        name = "boom"

        def _act(self, obs):
            raise ValueError("policy 'boom': cannot act")

    registry.register("boom-test", lambda spec: Boom(spec), replace=True)
    try:
        root = tmp_path / "a" / "root"
        args = ["export", "minari", "--dataset", small_traces, "--policy", "boom-test", "--root", root]
        reject_cleanly(args, ["boom"], [tmp_path, small_traces])
        assert not (tmp_path / "a").exists()
    finally:
        registry.unregister("boom-test")


def test_export_names_the_variable_that_gave_its_root(tmp_path, small_traces, monkeypatch):
    monkeypatch.setenv("MINARI_DATASETS_PATH", "/proc/x")
    args = ["export", "minari", "--dataset", small_traces, "--policy", "fixed-k:k=2"]
    reject_cleanly(args, ["MINARI_DATASETS_PATH", "/proc/x"], [tmp_path, small_traces])
