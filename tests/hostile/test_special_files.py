"""Special files where specenv reads a file: FIFOs, devices and links to them are one line, never a hang.

Every file specenv opens goes through :func:`specenv.io.open_regular` (regular files only) and, for
whole-file reads, :func:`specenv.io.read_limited` (at most the cap + 1 bytes, whatever size the file
reports: ``/dev/zero`` reports 0). Each case runs in a subprocess under a 1 GiB address-space and a
time limit: before, a FIFO hung the reader and a ``/dev/zero`` link read until memory ran out.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from specenv.io import FileTooLarge, NotRegularFile, open_regular, read_limited, sha256_file
from tests.hostile.harness import assert_rejected, assert_unchanged, run_limited, run_python_limited, snapshot

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "policies" / "shipped" / "paper-default-v2" / "ppo"
RECORDING = ROOT / "specenv" / "data" / "live-vllm-batch-v1"
SECONDS = 30.0


def _special(path: Path, kind: str) -> None:
    """Replace ``path`` by a FIFO (no writer) or a link to /dev/zero."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


KINDS = ["fifo", "zero"]
WORD = {"fifo": "FIFO", "zero": "device"}


# ---------------------------------------------------------------------- the reader itself
@pytest.mark.parametrize("kind", KINDS)
def test_reader_refuses_special_files_without_blocking(tmp_path, kind):
    path = tmp_path / "f"
    _special(path, kind)
    for fn in (open_regular, sha256_file, lambda p: read_limited(p, 10)):
        with pytest.raises(NotRegularFile, match=WORD[kind]):
            fn(path)


def test_reader_counts_bytes_not_the_reported_size(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 11)
    assert read_limited(path, 11) == b"x" * 11
    with pytest.raises(FileTooLarge, match="more than 10 bytes"):
        read_limited(path, 10)
    with pytest.raises(IsADirectoryError):
        read_limited(tmp_path, 10)


# ---------------------------------------------------------------------- through the CLI
def _policy_dir(tmp_path: Path, part: str, kind: str) -> Path:
    folder = tmp_path / "pols" / "ppo"
    shutil.copytree(POLICY, folder)
    _special(folder / part, kind)
    return folder


def _recording(tmp_path: Path, part: str, kind: str) -> Path:
    folder = tmp_path / "rec"
    shutil.copytree(RECORDING, folder)
    _special(folder / part, kind)
    return folder


def _report_dir(tmp_path: Path, part: str, kind: str) -> Path:
    from tests.hostile.test_cli_report import _write_valid

    folder = tmp_path / "out"
    _write_valid(folder)
    _special(folder / part, kind)
    return folder


CLI_CASES = [
    # (case, build(tmp_path, kind) -> (args, culprit))
    (
        "joint-policy-json",
        lambda t, k: (
            ["caps", "bench", "--joint-policy", _policy_dir(t, "policy.json", k), "--out", t / "o"],
            "policy.json",
        ),
    ),
    ("batch-fit-manifest", lambda t, k: (["batch", "fit", _recording(t, "manifest.json", k)], "manifest.json")),
    ("batch-fit-steps", lambda t, k: (["batch", "fit", _recording(t, "steps.parquet", k)], "steps.parquet")),
    (
        "fit-batch-steps",
        lambda t, k: (["fit-batch", _recording(t, "steps.parquet", k), "--out", t / "m.json"], "steps.parquet"),
    ),
    (
        "serve-policy-json",
        lambda t, k: (
            ["serve", "--policy", _policy_dir(t, "policy.json", k), "--print-command", "--models", "small-moe-v1"],
            "policy.json",
        ),
    ),
    (
        "serve-policy-weights",
        lambda t, k: (
            ["serve", "--policy", _policy_dir(t, "weights.npz", k), "--print-command", "--models", "small-moe-v1"],
            "weights.npz",
        ),
    ),
    (
        "export-policy-json",
        lambda t, k: (
            ["export", "minari", "--policy", _policy_dir(t, "policy.json", k), "--root", t / "root"],
            "policy.json",
        ),
    ),
    ("report-json", lambda t, k: (["report", _report_dir(t, "fit.json", k)], "fit.json")),
    ("report-png", lambda t, k: (["report", _report_dir(t, "speedup.png", k)], "speedup.png")),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("case", "build"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_a_special_file_in_one_line(tmp_path, case, build, kind):
    args, culprit = build(tmp_path, kind)
    before = snapshot(tmp_path)
    out = run_limited(args, seconds=SECONDS)
    assert_rejected(out, culprit, WORD[kind])
    assert_unchanged(before, snapshot(tmp_path))


# ---------------------------------------------------------------------- through the Python API
API_CASES = [
    ("policy-json", "policy.json"),
    ("policy-weights", "weights.npz"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("case", "part"), API_CASES, ids=[c[0] for c in API_CASES])
def test_policy_load_refuses_a_special_file(tmp_path, case, part, kind):
    folder = _policy_dir(tmp_path, part, kind)
    code = (
        "from specenv.policy.mlp import MLPPolicy\n"
        f"try:\n    MLPPolicy.load({str(folder)!r})\nexcept ValueError as e:\n    print(e)\n"
    )
    out = run_python_limited(code, seconds=SECONDS)
    assert out.exit_code == 0, out.stderr[-2000:]
    assert part in out.stdout and WORD[kind] in out.stdout, out.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_batch_env_refuses_a_special_batch_cost_file(tmp_path, kind):
    path = tmp_path / "batchcost.json"
    _special(path, kind)
    code = (
        "import gymnasium as gym, specenv\n"
        f"try:\n    gym.make('specenv/MoESpecBatch-v0', batch_cost={str(path)!r})\n"
        "except ValueError as e:\n    print(e)\n"
    )
    out = run_python_limited(code, seconds=SECONDS)
    assert out.exit_code == 0, out.stderr[-2000:]
    assert str(path) in out.stdout and WORD[kind] in out.stdout, out.stdout
    assert len(out.stdout.strip().splitlines()) == 1, out.stdout


def test_reader_bound_does_not_trust_the_reported_size(tmp_path):
    """A /proc file is regular and reports 0 bytes; its bytes are counted."""
    maps = Path("/proc/self/maps")
    if not maps.is_file() or maps.stat().st_size != 0:
        pytest.skip("needs Linux /proc (a regular file reporting 0 bytes)")
    link = tmp_path / "policy.json"
    link.symlink_to(maps)
    with pytest.raises(FileTooLarge, match="more than 16 bytes"):
        read_limited(link, 16)


# ---------------------------------------------------------------------- a trace table named in a manifest
TRACESET = ROOT / "specenv" / "data" / "live-vllm-v1"
TABLE_WORD = {"fifo": "is a FIFO, not a regular file", "zero": "is a device, not a regular file"}


@pytest.mark.parametrize("kind", [*KINDS, "folder"])
def test_trace_table_that_is_not_a_regular_file_says_so(tmp_path, kind):
    """A FIFO, a /dev/zero link or a folder standing in for a trace table: "not a regular file", not "missing"."""
    folder = tmp_path / "set"
    shutil.copytree(TRACESET, folder)
    table = folder / "positions.parquet"
    if kind == "folder":
        table.unlink()
        table.mkdir()
    else:
        _special(table, kind)
    before = snapshot(tmp_path)
    out = run_limited(["validate", folder], seconds=SECONDS)
    assert_rejected(out, "positions.parquet", TABLE_WORD.get(kind, "is a folder, not a file"))
    assert "missing" not in out.stderr
    assert_unchanged(before, snapshot(tmp_path))


@pytest.mark.parametrize("kind", [*KINDS, "folder"])
def test_trace_manifest_that_is_not_a_regular_file_says_so(tmp_path, kind):
    """A FIFO, a /dev/zero link or a folder standing in for a trace set's manifest: said so, not "missing"."""
    folder = tmp_path / "set"
    shutil.copytree(TRACESET, folder)
    manifest = folder / "manifest.json"
    if kind == "folder":
        manifest.unlink()
        manifest.mkdir()
    else:
        _special(manifest, kind)
    before = snapshot(tmp_path)
    out = run_limited(["validate", folder], seconds=SECONDS)
    assert_rejected(out, "manifest.json", TABLE_WORD.get(kind, "is a folder, not a file"))
    assert "missing" not in out.stderr
    assert_unchanged(before, snapshot(tmp_path))


def test_absent_trace_manifest_is_still_missing(tmp_path):
    folder = tmp_path / "set"
    shutil.copytree(TRACESET, folder)
    (folder / "manifest.json").unlink()
    out = run_limited(["validate", folder], seconds=SECONDS)
    assert_rejected(out, "manifest.json", "missing manifest")
