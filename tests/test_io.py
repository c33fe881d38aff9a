"""specenv.io: atomic folder replacement (one exchange, and its fallback) and stale temporaries."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest

from specenv import io
from specenv.generator import generate_paper
from specenv.traces.traceset import TraceSet, check_save_destination, is_trace_set


def _dead_pid() -> int:
    """A process id that no process has (above the kernel's pid_max)."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    except OSError:
        return 999_999_999


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def _make(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def tiny_set() -> TraceSet:
    return generate_paper(2, kmax=3, seed=1, name="tiny")


def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    a = _make(tmp_path / "a", {"x": "A"})
    b = _make(tmp_path / "b", {"y": "B"})
    assert io.exchange(a, b)
    assert _tree(a) == {"y": "B"} and _tree(b) == {"x": "A"}


def test_exchange_reports_unsupported_and_raises_other_errors(tmp_path, monkeypatch):
    a = _make(tmp_path / "a", {"x": "A"})
    b = _make(tmp_path / "b", {"y": "B"})
    for code, supported in ((errno.EINVAL, False), (errno.ENOSYS, False), (errno.EACCES, True)):

        def fake(old, new, flags, code=code):
            assert flags == io.RENAME_EXCHANGE
            ctypes.set_errno(code)
            return -1

        monkeypatch.setattr(io, "_renameat2", lambda fake=fake: fake)
        if supported:
            with pytest.raises(OSError) as info:
                io.exchange(a, b)
            assert info.value.errno == errno.EACCES
        else:
            assert io.exchange(a, b) is False
        assert _tree(a) == {"x": "A"} and _tree(b) == {"y": "B"}
    monkeypatch.setattr(io, "_renameat2", lambda: None)
    assert io.exchange(a, b) is False


@pytest.mark.parametrize("exchange_works", [True, False], ids=["renameat2-exchange", "fallback-two-renames"])
def test_atomic_dir_replace_swaps_and_leaves_no_temporaries(tmp_path, monkeypatch, exchange_works):
    calls = []
    real = io.exchange

    def spy(a, b):
        calls.append((a, b))
        return real(a, b) if exchange_works else False

    monkeypatch.setattr(io, "exchange", spy)
    dest = _make(tmp_path / "out", {"old": "1", "both": "old"})
    with io.atomic_dir(dest, replace=True) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.")
        _make(tmp, {"new": "2", "both": "new"})
        assert _tree(dest) == {"old": "1", "both": "old"}  # untouched until the block ends
    assert _tree(dest) == {"new": "2", "both": "new"}
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert len(calls) == 1


def test_fallback_puts_the_old_folder_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "exchange", lambda a, b: False)
    dest = _make(tmp_path / "out", {"old": "1"})
    real_rename = os.rename
    n = {"calls": 0}

    def flaky(src, dst):
        n["calls"] += 1
        if n["calls"] == 2:  # the old folder is aside, the new one fails to move into place
            raise OSError(errno.EIO, "simulated", str(src))
        return real_rename(src, dst)

    monkeypatch.setattr(io.os, "rename", flaky)
    with pytest.raises(OSError, match="simulated"), io.atomic_dir(dest, replace=True) as tmp:
        _make(tmp, {"new": "2"})
    assert _tree(dest) == {"old": "1"}
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_exception_in_the_block_leaves_the_destination_and_no_temporary(tmp_path):
    dest = _make(tmp_path / "out", {"old": "1"})
    with pytest.raises(RuntimeError), io.atomic_dir(dest, replace=True) as tmp:
        _make(tmp, {"half": "written"})
        raise RuntimeError("killed mid-write")
    assert _tree(dest) == {"old": "1"}
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_atomic_dir_without_replace_refuses_an_existing_folder(tmp_path):
    dest = _make(tmp_path / "out", {"old": "1"})
    with pytest.raises(FileExistsError), io.atomic_dir(dest):
        pass
    assert _tree(dest) == {"old": "1"}


def test_stale_temporaries_of_dead_runs_are_removed_and_nothing_else(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    _make(tmp_path / f".out.{dead}.0badc0de", {"half": "x"})  # a killed atomic_dir
    (tmp_path / f".out.{dead}.deadbeef.tmp").write_text("x")  # a killed atomic_file
    keep = [
        _make(tmp_path / f".out.{live}.0badc0de", {"running": "x"}),  # a live writer's
        _make(tmp_path / f".out.{dead}.0BADC0DE", {}),  # not our hex
        _make(tmp_path / f".out.{dead}.0badc0d", {}),  # too short
        _make(tmp_path / f".out.{dead}.0badc0de.bak", {}),  # other suffix
        _make(tmp_path / f".other.{dead}.0badc0de", {}),  # another destination's
        _make(tmp_path / f"out.{dead}.0badc0de", {}),  # not hidden
        _make(tmp_path / f".out.{dead}.0badc0de.tmp", {}),  # a folder with the file pattern
        _make(tmp_path / ".out.backup", {"mine": "x"}),
        _make(tmp_path / ".out.0.0badc0de", {}),  # pid 0 is never ours
    ]
    (tmp_path / f".out.{dead}.feedface").write_text("a file with the folder pattern")
    keep.append(tmp_path / f".out.{dead}.feedface")
    os.symlink(tmp_path / ".out.backup", tmp_path / f".out.{dead}.cafebabe")
    keep.append(tmp_path / f".out.{dead}.cafebabe")
    removed = io.remove_stale_temporaries(tmp_path / "out")
    assert sorted(p.name for p in removed) == sorted([f".out.{dead}.0badc0de", f".out.{dead}.deadbeef.tmp"])
    assert all(os.path.lexists(p) for p in keep)
    assert _tree(tmp_path / ".out.backup") == {"mine": "x"}


def test_a_killed_run_is_cleaned_up_by_the_next_write(tmp_path, tiny_set):
    dead = _dead_pid()
    dest = tmp_path / "traces"
    _make(tmp_path / f".traces.{dead}.0123abcd", {"positions.parquet": "half"})
    (tmp_path / f".c.json.{dead}.89abcdef.tmp").write_text("{")
    tiny_set.save(dest)
    io.atomic_write_json(tmp_path / "c.json", {"a": 1})
    assert sorted(os.listdir(tmp_path)) == ["c.json", "traces"]


def test_check_replaceable_refuses_root_home_cwd_and_above(tmp_path, monkeypatch):
    work = _make(tmp_path / "a" / "b", {})
    monkeypatch.chdir(work)
    for path in ("/", ".", "..", str(tmp_path), str(Path.home())):
        with pytest.raises(io.ReplaceRefused):
            io.check_replaceable(path)
    (work / "f").write_text("x")
    os.symlink(work, work / "link")
    for path in ("f", "link"):
        with pytest.raises(io.ReplaceRefused):
            io.check_replaceable(path)
    _make(work / "sub", {})
    io.check_replaceable("sub")


def test_check_new_path(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        io.check_new_path(tmp_path / "file" / "sub")
    with pytest.raises(OSError):
        io.check_new_path("/proc/specenv-x/y")
    io.check_new_path(tmp_path / "new" / "deeper" / "out")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_traceset_overwrite_replaces_only_a_trace_set(tmp_path, tiny_set):
    dest = tmp_path / "set"
    tiny_set.save(dest)
    assert is_trace_set(dest)
    first = (dest / "manifest.json").read_text()
    with pytest.raises(FileExistsError):
        tiny_set.save(dest)
    generate_paper(3, kmax=3, seed=2, name="tiny2").save(dest, overwrite=True)
    assert (dest / "manifest.json").read_text() != first
    assert TraceSet.load(dest).manifest.name == "tiny2"
    assert sorted(os.listdir(tmp_path)) == ["set"]
    (dest / "notes.txt").write_text("mine")  # a trace set holding a user's file is no longer only a trace set
    with pytest.raises(io.ReplaceRefused, match="not a trace set"):
        tiny_set.save(dest, overwrite=True)
    assert (dest / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "manifest",
    ["", "{", "[]", '{"format": "other"}', '{"format": 5}', '"specenv.traces"'],
    ids=["empty", "truncated", "list", "other-format", "format-int", "string"],
)
def test_a_folder_whose_manifest_does_not_say_trace_set_is_never_replaced(tmp_path, tiny_set, manifest):
    dest = _make(tmp_path / "set", {"manifest.json": manifest})
    with pytest.raises(io.ReplaceRefused):
        check_save_destination(dest, overwrite=True)
    with pytest.raises(io.ReplaceRefused):
        tiny_set.save(dest, overwrite=True)
    assert _tree(dest) == {"manifest.json": manifest}
