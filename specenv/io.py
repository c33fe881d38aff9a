"""Small file helpers shared by every writer and cache in specenv: atomic writes, digests, cache folder.

Atomic writes go to a temporary sibling file that is renamed over the destination with
:func:`os.replace`, so a reader sees either the old file or the complete new one, never a partial
write.

Folders are written the same way: into a hidden temporary sibling folder that is renamed into place
when complete (:func:`atomic_dir`). Replacing an existing folder exchanges the two folders in one
step (Linux ``renameat2(RENAME_EXCHANGE)``) and then removes the old one, so a reader sees the old
folder or the new one, never none and never a mix. Where the filesystem cannot exchange (EINVAL,
ENOSYS, or not Linux), the old folder is renamed aside and the new one renamed into place: two
renames, with a window of two system calls in which the destination does not exist (a crash inside
it leaves the old folder under a hidden temporary name, removed by the next write).

Temporaries are named ``.<name>.<pid>.<8 hex>`` (folders) and ``.<name>.<pid>.<8 hex>.tmp``
(files) next to the destination ``<name>``. A run killed mid-write leaves them behind; the next
write to the same destination removes those whose process is gone (:func:`remove_stale_temporaries`),
and nothing else.

Files are read through :func:`open_regular` / :func:`read_limited` (and hashed through
:func:`sha256_file`): regular files only (a FIFO, a device, a socket or a link to one is refused
before anything blocks), and at most a cap + 1 bytes read, whatever size the file reports.

Only the standard library is imported here: this module is on the ``import specenv`` path.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

#: Environment variable naming specenv's cache folder; empty, ``0`` or ``off`` disables the disk cache.
CACHE_ENV = "SPECENV_CACHE"


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, fsync: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically (temporary sibling file, then :func:`os.replace`).

    Args:
        path: Destination file; its folder must exist.
        data: The bytes to write.
        fsync: Flush the file to disk before the rename (survives a power loss, not only a crash).

    Returns:
        The destination path.
    """
    path = Path(path)
    with atomic_file(path, fsync=fsync) as tmp, open(tmp, "xb") as fh:  # exclusive create, umask permissions
        fh.write(data)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8", fsync: bool = False) -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write_bytes`).

    Args:
        path: Destination file; its folder must exist.
        text: The text to write.
        encoding: Text encoding.
        fsync: Flush the file to disk before the rename.

    Returns:
        The destination path.
    """
    return atomic_write_bytes(path, text.encode(encoding), fsync=fsync)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, fsync: bool = False) -> Path:
    """Write ``obj`` as indented JSON (with a final newline) to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2) + "\n", fsync=fsync)


@contextmanager
def atomic_file(path: str | os.PathLike[str], fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling path to write with any library; rename it over ``path`` on success.

    Example::

        with atomic_file(folder / "rounds.parquet") as tmp:
            pyarrow.parquet.write_table(table, tmp)

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    remove_stale_temporaries(path)
    tmp = temp_sibling(path, ".tmp")
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class ReplaceRefused(ValueError):
    """An existing path that specenv will not replace (the working directory, a folder above it, home, ...)."""


def temp_sibling(dest: str | os.PathLike[str], suffix: str = "") -> Path:
    """A fresh temporary name next to ``dest``: ``.<name>.<pid>.<8 hex><suffix>`` (not created here)."""
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.{os.getpid()}.{os.urandom(4).hex()}{suffix}")


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_stale_temporaries(dest: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries that killed specenv runs left next to ``dest``; return what was removed.

    Only names of the exact form ``.<name>.<pid>.<8 hex>`` (a real folder) or ``.<name>.<pid>.<8
    hex>.tmp`` (a regular file) whose process ``pid`` no longer runs are removed: a concurrent writer's
    temporaries and anything else stay.
    """
    dest = Path(dest)
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.([1-9][0-9]{{0,9}})\.[0-9a-f]{{8}}(\.tmp)?")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = Path(entry.path)
        try:
            if m.group(2) and entry.is_file(follow_symlinks=False):
                path.unlink()
            elif not m.group(2) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                continue
        except OSError:
            continue
        removed.append(path)
    return removed


AT_FDCWD = -100
RENAME_EXCHANGE = 2
#: ``renameat2`` system call numbers where libc has no ``renameat2`` symbol (glibc < 2.28).
_SYS_RENAMEAT2 = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276, "i686": 353, "i386": 353}


def _renameat2() -> Any:
    """A callable ``(old: bytes, new: bytes, flags: int) -> int`` for Linux's renameat2, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return lambda old, new, flags: fn(AT_FDCWD, old, AT_FDCWD, new, flags)
    nr = _SYS_RENAMEAT2.get(platform.machine().lower())
    if nr is None:
        return None
    libc.syscall.restype = ctypes.c_long
    return lambda old, new, flags: libc.syscall(
        ctypes.c_long(nr),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(old),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(new),
        ctypes.c_uint(flags),
    )


def exchange(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Exchange two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns:
        True when exchanged; False when this system or filesystem cannot (no renameat2, EINVAL,
        ENOSYS, EOPNOTSUPP): nothing was changed then.

    Raises:
        OSError: Any other failure (with its errno), nothing changed.
    """
    fn = _renameat2()
    if fn is None:
        return False
    ctypes.set_errno(0)
    if fn(os.fsencode(a), os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def replace_dir(new: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """Put the folder ``new`` in place of the existing ``dest`` and remove the old ``dest``.

    One atomic exchange where the filesystem supports it; otherwise the old folder is renamed aside
    (to a temporary name that :func:`remove_stale_temporaries` recognises), ``new`` renamed into place
    and the old one removed. A failure to remove the old folder is not an error (it is a stale
    temporary then).
    """
    new, dest = Path(new), Path(dest)
    if exchange(new, dest):
        shutil.rmtree(new, ignore_errors=True)  # ``new`` now holds the old folder
        return
    aside = temp_sibling(dest)
    os.rename(dest, aside)
    try:
        os.rename(new, dest)
    except BaseException:
        os.rename(aside, dest)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def check_replaceable(dest: str | os.PathLike[str]) -> None:
    """Refuse to replace a path that no writer may replace, whatever it holds.

    Raises:
        ReplaceRefused: ``dest`` is a symbolic link or not a folder, the filesystem root, the home
            folder or a folder above it, or the working directory or a folder above it.
    """
    dest = Path(dest)
    if dest.is_symlink():
        raise ReplaceRefused(f"{dest}: is a symbolic link: refusing to replace it")
    if not dest.is_dir():
        raise ReplaceRefused(f"{dest}: exists and is not a folder: refusing to replace it")
    real = dest.resolve()
    if real == Path(real.anchor):
        raise ReplaceRefused(f"{dest}: is the filesystem root: refusing to replace it")
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise ReplaceRefused(f"{dest}: is the working directory or a folder above it: refusing to replace it")
    try:
        home = Path.home().resolve()
    except (KeyError, RuntimeError):
        home = None
    if home is not None and (real == home or real in home.parents):
        raise ReplaceRefused(f"{dest}: is the home folder or a folder above it: refusing to replace it")


def check_new_path(dest: str | os.PathLike[str]) -> None:
    """Check that ``dest`` (file or folder, missing parent folders allowed) could be created.

    The nearest existing ancestor must be a folder in which a folder can be created: this is tried
    (a temporary folder is created and removed at once), so read-only filesystems, ``/proc`` and
    permissions are all seen as they are.

    Raises:
        NotADirectoryError: An existing ancestor is not a folder.
        OSError: Nothing can be created there (its errno and file name say why).
    """
    dest = Path(dest)
    anc = dest.parent
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"cannot be created ({anc} is not a folder)", str(dest))
    probe = temp_sibling(anc / dest.name)
    try:
        os.mkdir(probe)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot be created in {anc} ({exc.strerror})", str(dest)) from None
    os.rmdir(probe)


@contextmanager
def atomic_dir(dest: str | os.PathLike[str], replace: bool = False) -> Iterator[Path]:
    """Yield a hidden temporary sibling folder; when the block succeeds it becomes ``dest``.

    Args:
        dest: The folder to create.
        replace: Replace an existing ``dest`` (otherwise an existing ``dest`` raises
            FileExistsError before anything is written). The new folder is exchanged with the old one
            in one step (see the module docstring), then the old one is removed. A caller that only
            replaces certain folders checks that itself first (``TraceSet.save``: trace sets only).

    Raises:
        FileExistsError: ``dest`` exists and ``replace`` is false.
        ReplaceRefused: ``dest`` may never be replaced (:func:`check_replaceable`).

    On an exception the temporary folder is removed and ``dest`` is untouched. Temporaries that
    killed runs left next to ``dest`` are removed first (:func:`remove_stale_temporaries`).
    """
    dest = Path(dest)
    exists = os.path.lexists(dest)
    if exists and not replace:
        raise FileExistsError(f"{dest}: already exists")
    if exists:
        check_replaceable(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(dest)
    tmp = temp_sibling(dest)
    os.mkdir(tmp, 0o777)
    try:
        yield tmp
        if os.path.lexists(dest):
            replace_dir(tmp, dest)
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def package_data(*parts: str) -> Path:
    """A real filesystem path for ``specenv/data/<parts...>`` (file or folder).

    Installed from a wheel or a source tree the package data already is on disk; from a zipped
    install it is copied (recursively) into a private temporary folder first.
    """
    from importlib import resources

    trav = resources.files("specenv").joinpath("data", *parts)
    if isinstance(trav, Path):
        return trav
    out = Path(tempfile.mkdtemp(prefix="specenv-data-")) / parts[-1]

    def copy(src: Any, dst: Path) -> None:
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            for child in src.iterdir():
                copy(child, dst / child.name)
        else:
            dst.write_bytes(src.read_bytes())

    copy(trav, out)
    return out


class NotRegularFile(OSError):
    """A path that specenv will not read: a folder, a FIFO, a device or a socket (or a link to one)."""


class FileTooLarge(OSError):
    """A file holding more bytes than its reader's cap (counted by reading, not from the reported size)."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _refuse(mode: int, path: str | os.PathLike[str]) -> NoReturn:
    kind = _kind(mode)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    raise NotRegularFile(errno.EINVAL, f"is {kind}, not a regular file", str(path))


def check_regular(path: str | os.PathLike[str]) -> None:
    """Refuse anything but a regular file (a link is followed): folders, FIFOs, devices, sockets.

    For a reader that takes a path (pyarrow, numpy, PIL): called before handing it the path.

    Raises:
        FileNotFoundError, PermissionError: As :func:`os.stat`.
        IsADirectoryError: A folder.
        NotRegularFile: A FIFO, a device or a socket (``strerror`` says which).
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        _refuse(mode, path)


def not_regular(path: str | os.PathLike[str]) -> str | None:
    """Why specenv would not read ``path`` as a file, in words (None: a regular file, or a link to one).

    ``"is a FIFO, not a regular file"``, ``"is a folder, not a file"``, ``"is a link to a missing file"``,
    ``"does not exist"`` or ``"cannot be read (...)"``: the end of a one-line message that names the path.
    """
    try:
        check_regular(path)
    except FileNotFoundError:
        return "is a link to a missing file" if os.path.islink(path) else "does not exist"
    except (IsADirectoryError, NotRegularFile) as exc:
        return exc.strerror
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc.__class__.__name__})"
    return None


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open a regular file for binary reading; anything else is refused without blocking.

    The path is checked before it is opened (a device is never opened) and the open file again
    (``fstat``); a FIFO is opened non-blocking, so a FIFO without a writer cannot hang the check.

    Raises:
        As :func:`check_regular`.
    """
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            _refuse(mode, path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_limited(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of a regular file holding at most ``limit`` bytes (at most ``limit + 1`` are read).

    The reported size is not trusted (``/proc`` files and devices report 0).

    Raises:
        FileTooLarge: The file holds more than ``limit`` bytes.
        As :func:`open_regular` otherwise.
    """
    with open_regular(path) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise FileTooLarge(errno.EFBIG, f"more than {limit} bytes", str(path))
    return data


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a regular file's bytes (anything else refused as by :func:`open_regular`)."""
    h = hashlib.sha256()
    with open_regular(path) as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def json_digest(obj: Any) -> str:
    """Stable short digest (16 hex digits of sha256) of a JSON-able object, keys sorted."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path | None:
    """The per-user cache folder of specenv, or None when the disk cache is disabled.

    ``$SPECENV_CACHE`` when set (empty, ``0`` or ``off`` disables the cache), else
    ``$XDG_CACHE_HOME/specenv``, else ``~/.cache/specenv``. The folder is not created here.
    """
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        if env.strip().lower() in ("", "0", "off", "none", "false"):
            return None
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specenv"


#: The hidden file in which a folder records the files specenv wrote into it (name -> sha256).
OUTPUTS_MARK = ".specenv-outputs.json"
_MARK_MAX = 1 << 20


def _read_mark(folder: Path) -> dict[str, str]:
    try:
        obj = json.loads(read_limited(folder / OUTPUTS_MARK, _MARK_MAX))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(obj, dict) else {}


def foreign_files(paths: list[Any], mine: Any = None) -> list[Path]:
    """Of ``paths``, those that exist and that specenv did not write (or that changed since it did).

    A file is specenv's when its folder's :data:`OUTPUTS_MARK` lists it with its current sha256
    (:func:`record_written`), or when ``mine(path)`` says so (a file that carries its own marker, e.g. a
    cost model's ``format``). Anything else that exists (a user's file, a folder, a link, a FIFO) is
    foreign: the output rule is that no command replaces it without ``--overwrite``.
    """
    out: list[Path] = []
    for p in map(Path, paths):
        if not os.path.lexists(p):
            continue
        if p.is_symlink() or not p.is_file():
            out.append(p)
            continue
        try:
            if _read_mark(p.parent).get(p.name) == sha256_file(p):
                continue
        except OSError:
            out.append(p)
            continue
        if mine is not None and mine(p):
            continue
        out.append(p)
    return out


def record_written(paths: list[Any]) -> None:
    """Record the regular files ``paths`` as written by specenv in their folders' :data:`OUTPUTS_MARK`."""
    by_folder: dict[Path, list[Path]] = {}
    for p in map(Path, paths):
        by_folder.setdefault(p.parent, []).append(p)
    for folder, files in by_folder.items():
        mark = _read_mark(folder)
        for p in files:
            try:
                mark[p.name] = sha256_file(p)
            except OSError:
                mark.pop(p.name, None)
        try:
            atomic_write_json(folder / OUTPUTS_MARK, dict(sorted(mark.items())))
        except OSError:
            pass  # a folder that cannot take the mark: its files are merely not recognised later
