"""BC on a Minari dataset that is not what was exported: a missing part, a trace set changed since, NaN/inf.

Each is one line naming the dataset (and for a non-finite observation the episode file and row),
exit 2, before any training (before, BC trained on what was left, on a dataset whose rounds the
regenerated set no longer replays, or on NaN observations for 8 s and reported NaN weights).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.hostile.harness import reject_cleanly, run_cli

IDENT = "specenv/small/fixed-k-k-2-v0"


@pytest.fixture(scope="module")
def exported(small_traces, tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("bc")
    traces = base / "set"
    shutil.copytree(small_traces, traces)
    root = base / "root"
    res = run_cli(["export", "minari", "--dataset", traces, "--policy", "fixed-k:k=2", "--root", root])
    assert res.exit_code == 0, res.stderr
    return traces, root


def _copy(exported: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    traces, root = exported
    shutil.copytree(root, tmp_path / "root")
    return traces, tmp_path / "root"


def test_bc_refuses_a_dataset_with_a_missing_part(tmp_path, exported):
    _, root = _copy(exported, tmp_path)
    parts = sorted((root / IDENT / "data").glob("*/part-0.arrow"))
    parts[len(parts) // 2].unlink()
    args = ["train", "--algo", "bc", "--dataset", IDENT, "--root", root, "--out", tmp_path / "run"]
    reject_cleanly(args, ["--dataset", IDENT, "steps", "metadata records"], [tmp_path])


def test_bc_refuses_a_dataset_whose_trace_set_changed(tmp_path, exported):
    traces, root = _copy(exported, tmp_path)
    manifest = traces / "manifest.json"
    before = manifest.read_text()
    try:
        obj = json.loads(before)
        obj["description"] = "regenerated"
        manifest.write_text(json.dumps(obj))
        args = ["train", "--algo", "bc", "--dataset", IDENT, "--root", root, "--out", tmp_path / "run"]
        reject_cleanly(args, ["--dataset", IDENT, "manifest sha256", "export it again"], [tmp_path])
    finally:
        manifest.write_text(before)


def _poison(part: Path, row: int, col: int, value: float) -> None:
    """Set observation ``[row, col]`` of a Minari arrow episode file to ``value`` (the file stays readable)."""
    import numpy as np
    import pyarrow as pa

    table = pa.ipc.open_file(pa.BufferReader(part.read_bytes())).read_all()
    i = table.schema.get_field_index("observations")
    obs = np.array(table.column(i).to_pylist(), dtype=np.float32)
    obs[row, col] = value
    table = table.set_column(i, table.schema.field(i), pa.array(obs.tolist(), type=table.schema.field(i).type))
    with pa.ipc.new_file(part, table.schema) as w:
        w.write_table(table)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_bc_refuses_non_finite_observations_naming_file_and_row(tmp_path, exported, value):
    _, root = _copy(exported, tmp_path)
    part = sorted((root / IDENT / "data").glob("*/part-0.arrow"))[1]
    _poison(part, 3, 2, value)
    args = ["train", "--algo", "bc", "--dataset", IDENT, "--root", root, "--out", tmp_path / "run"]
    where = f"{part.parent.parent.name}/{part.parent.name}/{part.name}"  # data/EPISODE/part-0.arrow
    reject_cleanly(args, ["--dataset", IDENT, where, "observation row 3", str(value)], [tmp_path])
