"""Hostile folders for ``specenv export minari --overwrite`` and ``specenv train --algo bc``.

``--overwrite`` replaced any folder whose ``data/metadata.json`` carried specenv's block, deleting a
user's notes or files put inside it; it now refuses a dataset folder holding anything Minari and
specenv do not write. A missing or damaged episode file was a bare path (or Arrow's message) without
the option; it is one line naming ``--dataset`` now, with nothing written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.hostile.harness import reject_cleanly, run_cli

pytest.importorskip("minari")

IDENT = "specenv/small/fixed-k-k-2-v0"


@pytest.fixture(scope="module")
def exported(small_traces: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean export of fixed k = 2 on the small set (the original; each test copies it)."""
    root = tmp_path_factory.mktemp("minari-session")
    res = run_cli(["export", "minari", "--policy", "fixed-k:k=2", "--dataset", small_traces, "--root", root, "-q"])
    assert res.exit_code == 0, res.stderr
    return root


def _copy(exported: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "root"
    shutil.copytree(exported, root, symlinks=True)
    return root, root / IDENT


@pytest.mark.parametrize("extra", ["NOTES.md", "data/0/mine.txt", "data/link", "data/9999x"])
def test_overwrite_refuses_a_dataset_holding_what_specenv_did_not_write(exported, small_traces, tmp_path, extra):
    root, dest = _copy(exported, tmp_path)
    path = dest / extra
    if extra.endswith("link"):
        os.symlink(tmp_path, path)
    elif extra.endswith("x"):
        path.mkdir()
    else:
        path.write_text("a user's file\n")
    args = ["export", "minari", "--policy", "fixed-k:k=2", "--dataset", small_traces, "--root", root, "--overwrite"]
    reject_cleanly(args, [str(dest), extra, "did not write"], [tmp_path, small_traces])


def test_overwrite_still_replaces_a_clean_export(exported, small_traces, tmp_path):
    root, dest = _copy(exported, tmp_path)
    args = ["export", "minari", "--policy", "fixed-k:k=2", "--dataset", small_traces, "--root", root, "--seed", "3"]
    res = run_cli([*args, "--overwrite", "-q"])
    assert res.exit_code == 0, res.stderr
    assert (dest / "data" / "metadata.json").is_file()


@pytest.mark.parametrize("damage", ["truncated-part", "missing-episode"])
def test_bc_on_a_damaged_episode_is_one_line_naming_the_dataset(exported, small_traces, tmp_path, damage):
    root, dest = _copy(exported, tmp_path)
    if damage == "truncated-part":
        part = dest / "data" / "1" / "part-0.arrow"
        part.write_bytes(part.read_bytes()[:100])
    else:
        shutil.rmtree(dest / "data" / "1")
    args = ["train", "--algo", "bc", "--dataset", IDENT, "--root", root, "--out", tmp_path / "runs"]
    reject_cleanly(args, ["--dataset", IDENT, "an episode cannot be read"], [tmp_path, small_traces])
