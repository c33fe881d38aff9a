"""What every hostile-input case asserts: exit 2, one line naming the culprit, nothing written or deleted.

A case runs a ``specenv`` command in-process (typer's ``CliRunner``; subprocesses only where a
resource limit or a signal is needed), with the folders it could touch snapshotted before and after.
"""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from specenv.cli import app

PREFIX = "specenv: error: "


@dataclass(frozen=True)
class Outcome:
    """What a command did."""

    exit_code: int
    stdout: str
    stderr: str


def run_cli(args: Sequence[str], cwd: str | os.PathLike[str] | None = None) -> Outcome:
    """Run ``specenv ARGS`` in-process (optionally from another working directory)."""
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        res = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        os.chdir(old)
    stderr = res.stderr if res.stderr_bytes is not None else ""
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        # an uncaught exception is a traceback for the user: make it visible in the failure
        import traceback

        stderr += "".join(traceback.format_exception(res.exception))
    return Outcome(res.exit_code, res.stdout, stderr)


def run_limited(args: Sequence[str], memory_bytes: int = 1 << 30, seconds: float = 30.0) -> Outcome:
    """Run ``python -m specenv.cli ARGS`` in a subprocess under an address-space limit."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    p = subprocess.run(
        [sys.executable, "-m", "specenv.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=seconds,
        preexec_fn=limit,
    )
    return Outcome(p.returncode, p.stdout, p.stderr)


def run_python_limited(code: str, memory_bytes: int = 1 << 30, seconds: float = 30.0) -> Outcome:
    """Run ``python -c CODE`` in a subprocess under an address-space and a time limit (API cases)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=seconds, preexec_fn=limit)
    return Outcome(p.returncode, p.stdout, p.stderr)


from specenv.validation import MEMO_SUBDIR as MEMO  # noqa: E402


def snapshot(*roots: str | os.PathLike[str]) -> dict[str, tuple[str, str]]:
    """Every file and folder under ``roots``: path -> (kind, sha256 of the content for files)."""
    out: dict[str, tuple[str, str]] = {}
    for root in map(Path, roots):
        if not root.exists():
            continue
        for p in [root, *sorted(root.rglob("*"))]:
            if MEMO in p.parts[len(root.parts) :]:
                # the validation memo: other test workers' successful commands add entries at any time; a
                # refused command's own entries are dropped (tests/test_validation_memo.py checks that)
                continue
            if p.is_symlink():
                out[str(p)] = ("link", os.readlink(p))
            elif p.is_dir():
                out[str(p)] = ("dir", "")
            elif not p.is_file():  # a FIFO, device or socket: never opened (a FIFO would block)
                out[str(p)] = ("special", oct(p.stat().st_mode))
            else:
                out[str(p)] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def assert_rejected(out: Outcome, *names: str) -> None:
    """Exit code 2, one line ``specenv: error: ...`` on stderr naming every string in ``names``.

    Nothing on stdout, no traceback anywhere.
    """
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    assert out.exit_code == 2, f"exit {out.exit_code}; stderr: {out.stderr[-2000:]!r}"
    assert len(lines) == 1, f"expected one line, got {len(lines)}: {out.stderr[-2000:]!r}"
    assert lines[0].startswith(PREFIX), lines[0]
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    assert out.stdout.strip() == "", out.stdout[-2000:]


def assert_unchanged(before: dict[str, tuple[str, str]], after: dict[str, tuple[str, str]]) -> None:
    """Nothing written, changed or deleted under the snapshotted roots."""
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    assert not (added or removed or changed), f"added {added[:5]}, removed {removed[:5]}, changed {changed[:5]}"


def reject_cleanly(
    args: Sequence[str], names: Iterable[str], roots: Iterable[str | os.PathLike[str]], cwd=None
) -> None:
    """Run a command that must be refused: one line naming ``names``, exit 2, ``roots`` untouched."""
    roots = list(roots)
    before = snapshot(*roots)
    out = run_cli(args, cwd=cwd)
    assert_rejected(out, *names)
    assert_unchanged(before, snapshot(*roots))


def private_cache(monkeypatch, dst: Path) -> Path:
    """A copy of the session's cache at ``dst``, made this test's ``$SPECENV_CACHE``; returns it.

    The session cache (tests/conftest.py) is shared by the pytest-xdist workers: a fit another
    worker caches while a case runs would read as the case writing it. A case that snapshots the
    cache snapshots its own copy (the fits already cached stay cached: the command under test sees
    the cache it would see).
    """
    import shutil

    from specenv.io import CACHE_ENV, cache_dir

    def link_or_copy(a: str, b: str) -> None:  # hard links: a cache holding built model sets (GBs) costs no disk
        try:
            os.link(a, b)
        except OSError:  # another file system
            shutil.copy2(a, b)

    src = cache_dir()
    if src is not None and src.is_dir():
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.tmp*", ".*"), copy_function=link_or_copy)
    else:
        dst.mkdir(parents=True)
    monkeypatch.setenv(CACHE_ENV, str(dst))
    return dst
