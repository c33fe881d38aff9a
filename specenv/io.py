"""Small file helpers shared by every writer and cache in specenv: atomic writes, digests, cache folder.

Atomic writes go to a temporary sibling file that is renamed over the destination with
:func:`os.replace`, so a reader sees either the old file or the complete new one, never a partial
write (a crash leaves at most a stray ``.<name>.*.tmp`` file next to it).

Folders are written the same way: into a hidden temporary sibling folder that is renamed into place
when complete (:func:`atomic_dir`).

Only the standard library is imported here: this module is on the ``import specenv`` path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
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


@contextmanager
def atomic_dir(dest: str | os.PathLike[str], replace: bool = False) -> Iterator[Path]:
    """Yield a hidden temporary sibling folder; when the block succeeds it becomes ``dest``.

    Args:
        dest: The folder to create.
        replace: Replace an existing ``dest`` (otherwise an existing ``dest`` raises
            FileExistsError before anything is written).

    On an exception the temporary folder is removed and ``dest`` is untouched.
    """
    dest = Path(dest)
    if dest.exists() and not replace:
        raise FileExistsError(f"{dest}: already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
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


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
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
