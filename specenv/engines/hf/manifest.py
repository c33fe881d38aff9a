"""A model set's ``manifest.json``: read and checked, and every file's sha256 compared with it.

A model set (``specenv/data/models/<id>/``, or a folder of the same layout, or a derived set built
into the cache by :mod:`specenv.engines.hf.widen`) names every file by a relative path with its sha256.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def read_model_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """A model set's ``manifest.json``, checked (:mod:`specenv.validation` ``ModelSetJSON``).

    Every file is named by a relative path inside the folder (no ``..``, not absolute) with its sha256.

    Raises:
        ValueError: One line naming the file and the field.
    """
    from specenv.validation import check, read_json

    mpath = Path(folder) / "manifest.json"
    obj = read_json(mpath, what="model manifest")
    check("ModelSetJSON", obj, str(mpath))
    return obj


def check_files(path: Path, manifest: dict[str, Any]) -> str | None:
    """The first file of a model set that is missing or whose sha256 differs from the manifest, else None.

    Returns:
        ``"missing: FILE"``, ``"mismatch: FILE"`` or None.
    """
    from specenv.io import sha256_file

    for rel, ent in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            return f"missing: {rel}"
        if sha256_file(f) != ent["sha256"]:
            return f"mismatch: {rel}"
    return None
