"""Hostile arguments and output locations, command by command, and a safe ``--overwrite``.

Every refused case: exit 2, one ``specenv: error:`` line naming the argument (or file), nothing
written or deleted under the case's folder and the trace set it reads. Placeholders in the
arguments: ``{T}`` the small trace set (Kmax 6, 8 generations), ``{F}`` a plain file, ``{D}`` a
folder holding a user's file, ``{J}`` a truncated JSON file.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from specenv.cli import common
from tests.hostile.harness import assert_rejected, reject_cleanly, run_cli, snapshot

HUGE = str(10**30)

ARGUMENT_CASES: list[tuple[str, list[str], list[str]]] = [
    # generate
    ("generate-n-zero", ["generate", "--out", "o", "-n", "0"], ["--generations"]),
    ("generate-n-negative", ["generate", "--out", "o", "-n", "-5"], ["--generations"]),
    ("generate-n-huge", ["generate", "--out", "o", "-n", HUGE], ["--generations"]),
    ("generate-n-text", ["generate", "--out", "o", "-n", "many"], ["--generations"]),
    ("generate-kmax-zero", ["generate", "--out", "o", "--kmax", "0"], ["--kmax"]),
    ("generate-kmax-1000", ["generate", "--out", "o", "--kmax", "1000"], ["--kmax"]),
    ("generate-kmax-float", ["generate", "--out", "o", "--kmax", "1.5"], ["--kmax"]),
    ("generate-seed-negative", ["generate", "--out", "o", "--seed", "-1"], ["--seed"]),
    ("generate-seed-huge", ["generate", "--out", "o", "--seed", HUGE], ["--seed"]),
    ("generate-profile-unknown", ["generate", "--out", "o", "--profile", "nope"], ["--profile"]),
    ("generate-name-empty", ["generate", "--out", "o", "--name", ""], ["--name"]),
    ("generate-name-newline", ["generate", "--out", "o", "--name", "a\nb"], ["--name"]),
    ("generate-name-too-long", ["generate", "--out", "o", "--name", "x" * 500], ["--name"]),
    ("generate-out-missing", ["generate", "-n", "2"], ["--out"]),
    ("generate-unknown-option", ["generate", "--out", "o", "--bogus"], ["--bogus"]),
    ("generate-extra-argument", ["generate", "--out", "o", "surplus"], ["surplus"]),
    ("unknown-command", ["regenerate"], ["regenerate"]),
    # validate
    ("validate-missing-traces", ["validate"], ["TRACES"]),
    ("validate-no-such-set", ["validate", "no-such-set"], ["no-such-set"]),
    ("validate-a-file", ["validate", "{F}"], ["{F}"]),
    # fit
    ("fit-folds-1", ["fit", "{T}", "--folds", "1"], ["--folds"]),
    ("fit-folds-0", ["fit", "{T}", "--folds", "0"], ["--folds"]),
    ("fit-folds-over-generations", ["fit", "{T}", "--folds", "9"], ["--folds"]),
    ("fit-folds-huge", ["fit", "{T}", "--folds", HUGE], ["--folds"]),
    ("fit-folds-text", ["fit", "{T}", "--folds", "five"], ["--folds"]),
    # datasets
    ("datasets-extra-argument", ["datasets", "surplus"], ["surplus"]),
    ("datasets-unknown-option", ["datasets", "--bogus"], ["--bogus"]),
    # oracle
    ("oracle-lookahead-1000", ["oracle", "{T}", "--lookahead", "1000"], ["--lookahead"]),
    ("oracle-lookahead-over-kmax", ["oracle", "{T}", "--lookahead", "7"], ["--lookahead"]),
    ("oracle-lookahead-over-chosen-kmax", ["oracle", "{T}", "--kmax", "2", "--lookahead", "3"], ["--lookahead"]),
    ("oracle-lookahead-negative", ["oracle", "{T}", "--lookahead", "-1"], ["--lookahead"]),
    ("oracle-drafting-unknown", ["oracle", "{T}", "--drafting", "speculative"], ["--drafting"]),
    (
        "oracle-drafting-none-with-lookahead",
        ["oracle", "{T}", "--drafting", "none", "--lookahead", "2"],
        ["--lookahead"],
    ),
    ("oracle-drafting-block-without-lookahead", ["oracle", "{T}", "--drafting", "block"], ["--lookahead"]),
    ("oracle-episodes-negative", ["oracle", "{T}", "--episodes", "-1"], ["--episodes"]),
    ("oracle-episodes-huge", ["oracle", "{T}", "--episodes", HUGE], ["--episodes"]),
    ("oracle-seed-negative", ["oracle", "{T}", "--seed", "-1"], ["--seed"]),
    ("oracle-kmax-zero", ["oracle", "{T}", "--kmax", "0"], ["--kmax"]),
    ("oracle-kmax-1000", ["oracle", "{T}", "--kmax", "1000"], ["--kmax"]),
    ("oracle-split-unknown", ["oracle", "{T}", "--split", "validation"], ["--split"]),
    ("oracle-plot-without-figures", ["oracle", "{T}", "--plot", "figs"], ["--plot"]),
    ("oracle-cost-model-missing", ["oracle", "{T}", "--cost-model", "no-such.json"], ["--cost-model"]),
    # train
    ("train-gamma-nan", ["train", "--traces", "{T}", "--gamma", "nan"], ["--gamma"]),
    ("train-gamma-inf", ["train", "--traces", "{T}", "--gamma", "inf"], ["--gamma"]),
    ("train-gamma-2", ["train", "--traces", "{T}", "--gamma", "2"], ["--gamma"]),
    ("train-algo-unknown", ["train", "--traces", "{T}", "--algo", "a2c"], ["--algo"]),
    ("train-timesteps-small", ["train", "--traces", "{T}", "--timesteps", "10"], ["--timesteps"]),
    ("train-timesteps-huge", ["train", "--traces", "{T}", "--timesteps", HUGE], ["--timesteps"]),
    ("train-n-envs-zero", ["train", "--traces", "{T}", "--n-envs", "0"], ["--n-envs"]),
    ("train-iterations-zero", ["train", "--traces", "{T}", "--iterations", "0"], ["--iterations"]),
    ("train-seed-negative", ["train", "--traces", "{T}", "--seed", "-1"], ["--seed"]),
    ("train-seed-over-32-bits", ["train", "--traces", "{T}", "--seed", str(2**32)], ["--seed"]),
    ("train-lookahead-over-kmax", ["train", "--traces", "{T}", "--lookahead", "99"], ["--lookahead"]),
    ("train-kmax-over-traces", ["train", "--traces", "{T}", "--kmax", "99"], ["--kmax"]),
    ("train-name-parent", ["train", "--traces", "{T}", "--name", "../escape"], ["--name"]),
    ("train-name-slash", ["train", "--traces", "{T}", "--name", "a/b"], ["--name"]),
    ("train-name-dotdot", ["train", "--traces", "{T}", "--name", ".."], ["--name"]),
    ("train-traces-unknown", ["train", "--traces", "no-such-set"], ["no-such-set"]),
    # bench
    ("bench-episodes-zero", ["bench", "{T}", "--episodes", "0"], ["--episodes"]),
    ("bench-episodes-huge", ["bench", "{T}", "--episodes", HUGE], ["--episodes"]),
    ("bench-seed-negative", ["bench", "{T}", "--seed", "-1"], ["--seed"]),
    ("bench-kmax-over-traces", ["bench", "{T}", "--kmax", "99"], ["--kmax"]),
    ("bench-kmax-zero", ["bench", "{T}", "--kmax", "0"], ["--kmax"]),
    ("bench-policies-a-file", ["bench", "{T}", "--policies", "{F}"], ["--policies"]),
    # collect (all refused before the models load)
    ("collect-engine-unknown", ["collect", "--out", "o", "--engine", "vllm"], ["--engine"]),
    ("collect-clock-unknown", ["collect", "--out", "o", "--clock", "sundial"], ["--clock"]),
    ("collect-cpu-clock-threads", ["collect", "--out", "o", "--threads", "2"], ["--clock"]),
    ("collect-n-zero", ["collect", "--out", "o", "-n", "0"], ["--n-prompts"]),
    ("collect-n-over-prompt-set", ["collect", "--out", "o", "-n", "99999"], ["--n-prompts"]),
    ("collect-kmax-17", ["collect", "--out", "o", "--kmax", "17"], ["--kmax"]),
    ("collect-max-new-tokens-zero", ["collect", "--out", "o", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    ("collect-max-new-tokens-huge", ["collect", "--out", "o", "--max-new-tokens", HUGE], ["--max-new-tokens"]),
    ("collect-prompts-unknown", ["collect", "--out", "o", "--prompts", "no-such-prompts"], ["--prompts"]),
    ("collect-prompts-truncated", ["collect", "--out", "o", "--prompts", "{J}"], ["--prompts"]),
    ("collect-models-unknown", ["collect", "--out", "o", "--models", "no-such-models"], ["--models"]),
    ("collect-name-tab", ["collect", "--out", "o", "--name", "a\tb"], ["--name"]),
    # serve (all refused before vLLM is imported)
    ("serve-policy-missing", ["serve", "--", "m"], ["--policy"]),
    ("serve-no-vllm-arguments", ["serve", "--policy", "none"], ["vLLM arguments"]),
    (
        "serve-flag-set-by-specenv",
        ["serve", "--policy", "none", "--", "m", "--scheduler-cls", "x"],
        ["--scheduler-cls"],
    ),
    ("serve-fallback-k-negative", ["serve", "--policy", "none", "--fallback-k", "-1", "--", "m"], ["--fallback-k"]),
    ("serve-fallback-k-huge", ["serve", "--policy", "none", "--fallback-k", "1000", "--", "m"], ["--fallback-k"]),
    ("serve-part-rounds-zero", ["serve", "--policy", "none", "--part-rounds", "0", "--", "m"], ["--part-rounds"]),
    (
        "serve-draft-horizon-unknown",
        ["serve", "--policy", "none", "--draft-horizon", "x", "--", "m"],
        ["--draft-horizon"],
    ),
    ("serve-cost-model-truncated", ["serve", "--policy", "none", "--cost-model", "{J}", "--", "m"], ["--cost-model"]),
    ("serve-cost-model-a-folder", ["serve", "--policy", "none", "--cost-model", "{D}", "--", "m"], ["--cost-model"]),
]

OUTPUT_CASES: list[tuple[str, list[str], list[str]]] = [
    # generate / collect --out: existing, not a folder, uncreatable
    ("generate-out-exists", ["generate", "--out", "{D}", "-n", "1"], ["--out", "--overwrite"]),
    ("generate-out-file-sub", ["generate", "--out", "{F}/sub", "-n", "1"], ["--out", "{F}"]),
    ("generate-out-proc", ["generate", "--out", "/proc/specenv-x", "-n", "1"], ["--out", "/proc"]),
    ("collect-out-file-sub", ["collect", "--out", "{F}/sub"], ["--out", "{F}"]),
    ("collect-out-exists", ["collect", "--out", "{D}"], ["--out", "--overwrite"]),
    # fit --out (a file)
    ("fit-out-missing-folder", ["fit", "{T}", "--out", "nodir/c.json"], ["--out", "nodir"]),
    ("fit-out-existing-folder", ["fit", "{T}", "--out", "{D}"], ["--out", "{D}"]),
    ("fit-out-under-a-file", ["fit", "{T}", "--out", "{F}/c.json"], ["--out", "{F}"]),
    ("fit-out-proc", ["fit", "{T}", "--out", "/proc/c.json"], ["--out", "/proc"]),
    # bench / train --out, oracle --plot (folders)
    ("bench-out-a-file", ["bench", "{T}", "--out", "{F}"], ["--out", "{F}"]),
    ("bench-out-under-a-file", ["bench", "{T}", "--out", "{F}/b"], ["--out", "{F}"]),
    ("bench-out-proc", ["bench", "{T}", "--out", "/proc/specenv-x/b"], ["--out", "/proc"]),
    ("train-out-a-file", ["train", "--traces", "{T}", "--out", "{F}"], ["--out", "{F}"]),
    ("train-out-proc", ["train", "--traces", "{T}", "--out", "/proc/specenv-x"], ["--out", "/proc"]),
    ("oracle-plot-proc", ["oracle", "{T}", "--sweep", "--plot", "/proc/specenv-x"], ["--plot", "/proc"]),
    ("oracle-plot-a-file", ["oracle", "{T}", "--delta", "--plot", "{F}"], ["--plot", "{F}"]),
    ("oracle-plot-under-a-file", ["oracle", "{T}", "--sweep", "--plot", "{F}/figs"], ["--plot", "{F}"]),
    # serve --record, before vLLM starts
    ("serve-record-proc", ["serve", "--policy", "none", "--record", "/proc/specenv-x", "--", "m"], ["--record"]),
    ("serve-record-a-file", ["serve", "--policy", "none", "--record", "{F}", "--", "m"], ["--record", "{F}"]),
    ("serve-record-under-a-file", ["serve", "--policy", "none", "--record", "{F}/r", "--", "m"], ["--record"]),
]

OVERWRITE_CASES: list[tuple[str, list[str], list[str]]] = [
    (
        "generate-overwrite-user-folder",
        ["generate", "--out", "{D}", "-n", "1", "--overwrite"],
        ["--out", "not a trace set"],
    ),
    ("generate-overwrite-cwd", ["generate", "--out", ".", "-n", "1", "--overwrite"], ["--out", "working directory"]),
    ("generate-overwrite-cwd-abs", ["generate", "--out", "{CWD}", "-n", "1", "--overwrite"], ["--out", "working"]),
    (
        "generate-overwrite-parent",
        ["generate", "--out", "..", "-n", "1", "--overwrite"],
        ["--out", "working directory"],
    ),
    ("generate-overwrite-root", ["generate", "--out", "/", "-n", "1", "--overwrite"], ["--out", "root"]),
    ("generate-overwrite-home", ["generate", "--out", "{HOME}", "-n", "1", "--overwrite"], ["--out", "home"]),
    ("generate-overwrite-a-file", ["generate", "--out", "{F}", "-n", "1", "--overwrite"], ["--out", "not a folder"]),
    ("generate-overwrite-set-with-notes", ["generate", "--out", "{S+}", "-n", "1", "--overwrite"], ["not a trace set"]),
    ("generate-overwrite-symlink-to-set", ["generate", "--out", "{L}", "-n", "1", "--overwrite"], ["symbolic link"]),
    (
        "generate-overwrite-foreign-manifest",
        ["generate", "--out", "{M}", "-n", "1", "--overwrite"],
        ["not a trace set"],
    ),
    ("generate-overwrite-empty-folder", ["generate", "--out", "{E}", "-n", "1", "--overwrite"], ["not a trace set"]),
    ("collect-overwrite-user-folder", ["collect", "--out", "{D}", "--overwrite"], ["--out", "not a trace set"]),
    ("collect-overwrite-cwd", ["collect", "--out", ".", "--overwrite"], ["--out", "working directory"]),
    ("collect-overwrite-parent", ["collect", "--out", "..", "--overwrite"], ["--out", "working directory"]),
]


@pytest.fixture
def place(tmp_path, small_traces, monkeypatch):
    """The case's folder (cwd ``work``) with a file, a user's folder and broken/foreign trace-set look-alikes."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("a user's file\n")
    (work / "user").mkdir()
    (work / "user" / "thesis.tex").write_text("months of work\n")
    (work / "empty").mkdir()
    (work / "broken.json").write_text('{"version": 1, "per_k": [')
    seted = work / "set-plus"
    shutil.copytree(small_traces, seted)
    (seted / "README").write_text("my notes\n")
    foreign = work / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"format": "somebody.else"}\n')
    os.symlink(small_traces, work / "link")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("x\n")
    monkeypatch.setenv("HOME", str(home))
    subs = {
        "{T}": str(small_traces),
        "{F}": str(work / "notes.txt"),
        "{D}": str(work / "user"),
        "{E}": str(work / "empty"),
        "{J}": str(work / "broken.json"),
        "{S+}": str(seted),
        "{M}": str(foreign),
        "{L}": str(work / "link"),
        "{HOME}": str(home),
        "{CWD}": str(work),
    }
    return tmp_path, work, subs


def _fill(items, subs):
    out = []
    for item in items:
        for key, val in subs.items():
            item = item.replace(key, val)
        out.append(item)
    return out


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize(
    ("case", "args", "names"), ARGUMENT_CASES + OUTPUT_CASES, ids=_ids(ARGUMENT_CASES + OUTPUT_CASES)
)
def test_bad_argument_or_output_location_is_one_line_and_writes_nothing(place, small_traces, case, args, names):
    tmp_path, work, subs = place
    reject_cleanly(_fill(args, subs), _fill(names, subs), [tmp_path, small_traces], cwd=work)


@pytest.mark.parametrize(("case", "args", "names"), OVERWRITE_CASES, ids=_ids(OVERWRITE_CASES))
def test_overwrite_refuses_anything_but_a_trace_set(place, small_traces, case, args, names):
    tmp_path, work, subs = place
    cwd = work / "user" if ".." in args else work
    reject_cleanly(_fill(args, subs), _fill(names, subs), [tmp_path, small_traces], cwd=cwd)


def test_case_count():
    assert len(ARGUMENT_CASES) + len(OUTPUT_CASES) + len(OVERWRITE_CASES) >= 100
    assert len({c[0] for c in ARGUMENT_CASES + OUTPUT_CASES + OVERWRITE_CASES}) == len(
        ARGUMENT_CASES + OUTPUT_CASES + OVERWRITE_CASES
    )


def test_overwrite_replaces_a_trace_set_and_leaves_no_temporaries(tmp_path):
    out = tmp_path / "set"
    first = run_cli(["generate", "--out", out, "-n", "2", "--kmax", "3", "--seed", "1", "--json"])
    assert first.exit_code == 0, first.stderr
    manifest = (out / "manifest.json").read_text()
    again = run_cli(["generate", "--out", out, "-n", "3", "--kmax", "3", "--seed", "2", "--overwrite", "--json"])
    assert again.exit_code == 0, again.stderr
    assert (out / "manifest.json").read_text() != manifest
    assert sorted(os.listdir(tmp_path)) == ["set"]
    assert run_cli(["validate", out]).exit_code == 0


def test_a_killed_generate_is_cleaned_up_by_the_next_one(tmp_path):
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    half = tmp_path / f".set.{dead}.0badf00d"
    half.mkdir()
    (half / "positions.parquet").write_bytes(b"PAR1 half")
    (tmp_path / f".c.json.{dead}.0badf00d.tmp").write_text("{")
    mine = tmp_path / ".set.backup"
    mine.mkdir()
    res = run_cli(["generate", "--out", tmp_path / "set", "-n", "2", "--kmax", "3"])
    assert res.exit_code == 0, res.stderr
    assert sorted(os.listdir(tmp_path)) == [f".c.json.{dead}.0badf00d.tmp", ".set.backup", "set"]


def test_serve_refuses_a_bad_record_folder_in_under_a_second(tmp_path):
    before = snapshot(tmp_path)
    t0 = time.perf_counter()
    res = run_cli(["serve", "--policy", "none", "--record", "/proc/specenv-x/rec", "--", "some/model"])
    assert time.perf_counter() - t0 < 1.0
    assert_rejected(res, "--record")
    assert snapshot(tmp_path) == before


def test_json_output_is_strict():
    assert common.nonfinite_field({"a": [1.0, {"b": float("nan")}]}) == "a[1].b"
    assert common.nonfinite_field({"a": [1, "x", None, 2.5]}) is None
    with pytest.raises(common.typer.Exit):
        common.print_json({"s_max": float("inf")})


def test_an_error_line_escapes_control_characters():
    assert common.one_line("bad\nname\t\x1b[31m") == "bad\\nname\\t\\x1b[31m"
