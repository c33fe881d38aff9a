"""Malformed trace sets: each gives one clear line naming the file (and column/row) and exit code 2."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from specenv.cli import app
from specenv.traces.schema import TraceError
from specenv.traces.traceset import TraceSet, sha256_file

runner = CliRunner()


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "set"
    shutil.copytree(src, dst)
    return dst


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _write_manifest(root: Path, obj: dict) -> None:
    (root / "manifest.json").write_text(json.dumps(obj))


def _rehash(root: Path, table: str) -> None:
    """Make the manifest agree with the (modified) file so the check under test is reached."""
    m = _manifest(root)
    path = root / m["files"][table]["path"]
    m["files"][table]["sha256"] = sha256_file(path)
    m["files"][table].pop("rows", None)
    _write_manifest(root, m)


def _edit(root: Path, table: str, fn: Callable[[pd.DataFrame], pd.DataFrame]) -> None:
    path = root / f"{table}.parquet"
    df = fn(pq.read_table(path).to_pandas())
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)
    _rehash(root, table)


def _set(col: str, row: int, value: object) -> Callable[[pd.DataFrame], pd.DataFrame]:
    def fn(df: pd.DataFrame) -> pd.DataFrame:
        if isinstance(value, str):
            df[col] = df[col].astype(str)
        df.loc[row, col] = value
        return df

    return fn


def _drop_col(col: str) -> Callable[[pd.DataFrame], pd.DataFrame]:
    return lambda df: df.drop(columns=[col])


def _drop_row(row: int) -> Callable[[pd.DataFrame], pd.DataFrame]:
    return lambda df: df.drop(index=row).reset_index(drop=True)


def _u_decreasing(df: pd.DataFrame) -> pd.DataFrame:
    df.loc[7, "U_3"] = df.loc[7, "U_2"] - 1.0
    return df


def _swap_blocks(df: pd.DataFrame) -> pd.DataFrame:
    # move generation 0's last row to the end: generation 0 is then split in two blocks
    g0 = df.index[df["generation_id"] == df["generation_id"].iloc[0]]
    row = df.loc[[g0[-1]]]
    return pd.concat([df.drop(index=g0[-1]), row], ignore_index=True)


def _category_flip(df: pd.DataFrame) -> pd.DataFrame:
    df["category"] = df["category"].astype(str)
    df.loc[3, "category"] = "not_" + df.loc[3, "category"]
    return df


def _truncate(root: Path) -> None:
    path = root / "positions.parquet"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _rehash(root, "positions")


def _empty(root: Path) -> None:
    (root / "rounds.parquet").write_bytes(b"")
    _rehash(root, "rounds")


def _hash_mismatch(root: Path) -> None:
    path = root / "rounds.parquet"
    df = pq.read_table(path).to_pandas()
    df.loc[0, "T_T_ms"] = df.loc[0, "T_T_ms"] + 1.0
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)  # manifest not updated


def _manifest_edit(**changes: object) -> Callable[[Path], None]:
    def fn(root: Path) -> None:
        m = _manifest(root)
        m.update(changes)
        _write_manifest(root, m)

    return fn


def _rows_mismatch(root: Path) -> None:
    m = _manifest(root)
    m["files"]["rounds"]["rows"] = m["files"]["rounds"]["rows"] + 1
    _write_manifest(root, m)


def _greedy_flag(root: Path) -> None:
    _manifest_edit(greedy=True)(root)


def _first_row(df: pd.DataFrame, col: str, lo: float, hi: float) -> int:
    return int(np.flatnonzero((df[col] > lo) & (df[col] < hi))[0])


def _ent_below_hq(df: pd.DataFrame) -> pd.DataFrame:
    df.loc[_first_row(df, "q_2", 0.2, 0.8), "ent_2"] = 0.0  # h(q) > 0.5 nats there
    return df


def _margin_below(df: pd.DataFrame) -> pd.DataFrame:
    df.loc[_first_row(df, "q_3", 0.7, 1.0), "margin_3"] = 0.0  # 2q - 1 > 0.4 there
    return df


def _drop_signals(root: Path) -> None:
    """A schema-v2 set whose positions lost every signal column but whose manifest still says 2."""
    _edit(root, "positions", lambda df: df.drop(columns=[c for c in df.columns if c.startswith(("ent_", "margin_"))]))


# (id, mutation of the folder, text the one-line error must contain)
CASES: list[tuple[str, Callable[[Path], None], list[str]]] = [
    ("missing-column", lambda r: _edit(r, "positions", _drop_col("rho_3")), ["positions.parquet", "rho_3", "missing"]),
    ("nan", lambda r: _edit(r, "positions", _set("rho_2", 11, np.nan)), ["positions.parquet", "rho_2", "row 11"]),
    ("rho-above-1", lambda r: _edit(r, "positions", _set("rho_1", 4, 1.5)), ["rho_1", "row 4", "[0, 1]"]),
    ("q-negative", lambda r: _edit(r, "positions", _set("q_2", 9, -0.1)), ["q_2", "row 9"]),
    (
        "accepted-above-K",
        lambda r: _edit(r, "rounds", _set("accepted", 5, 99)),
        ["rounds.parquet", "accepted", "row 5"],
    ),
    ("m-above-K+1", lambda r: _edit(r, "rounds", _set("m", 6, 50)), ["rounds.parquet", "'m'", "row 6"]),
    ("negative-target-time", lambda r: _edit(r, "rounds", _set("T_T_ms", 2, -1.0)), ["T_T_ms", "row 2"]),
    ("U-decreasing", lambda r: _edit(r, "positions", _u_decreasing), ["U_3", "row 7", "decreasing"]),
    ("U-above-n_experts", lambda r: _edit(r, "positions", _set("U_6", 3, 500.0)), ["U_", "row 3"]),
    ("U0-not-top_k", lambda r: _edit(r, "positions", _set("U_0", 8, 9.0)), ["U_0", "row 8", "top_k"]),
    ("gap-in-positions", lambda r: _edit(r, "positions", _drop_row(10)), ["positions.parquet", "'t'", "row 10"]),
    ("L-not-contiguous", lambda r: _edit(r, "positions", _set("L", 12, 1)), ["'L'", "row 12"]),
    ("generation-split", lambda r: _edit(r, "positions", _swap_blocks), ["generation_id", "contiguous"]),
    ("category-changes", lambda r: _edit(r, "positions", _category_flip), ["category", "row 3"]),
    ("wrong-type", lambda r: _edit(r, "positions", _set("rho_1", 0, "high")), ["rho_1", "type"]),
    ("wrong-schema-version", _manifest_edit(schema_version=3), ["manifest.json", "schema_version"]),
    ("hash-mismatch", _hash_mismatch, ["rounds.parquet", "sha256"]),
    ("truncated-parquet", _truncate, ["positions.parquet", "Parquet"]),
    ("empty-file", _empty, ["rounds.parquet", "Parquet"]),
    ("missing-manifest", lambda r: (r / "manifest.json").unlink(), ["manifest.json", "missing"]),
    ("manifest-not-json", lambda r: (r / "manifest.json").write_text("{not json"), ["manifest.json", "JSON"]),
    ("missing-table-file", lambda r: (r / "rounds.parquet").unlink(), ["rounds.parquet", "missing"]),
    ("row-count-mismatch", _rows_mismatch, ["rounds.parquet", "rows"]),
    ("greedy-with-fractional-rho", _greedy_flag, ["rho_", "greedy"]),
    ("bad-model-facts", _manifest_edit(model={"n_layers": 48, "n_experts": 4, "top_k": 8}), ["manifest.json", "model"]),
    # schema v2: the draft's entropy and margin
    ("v2-missing-ent", lambda r: _edit(r, "positions", _drop_col("ent_3")), ["positions.parquet", "ent_3", "missing"]),
    ("v2-no-signals", _drop_signals, ["positions.parquet", "ent_1", "missing"]),
    ("ent-nan", lambda r: _edit(r, "positions", _set("ent_2", 11, np.nan)), ["positions.parquet", "ent_2", "row 11"]),
    ("ent-infinite", lambda r: _edit(r, "positions", _set("ent_1", 3, np.inf)), ["ent_1", "row 3", "infinite"]),
    ("ent-negative", lambda r: _edit(r, "positions", _set("ent_4", 6, -0.5)), ["ent_4", "row 6", "negative"]),
    ("ent-above-log-vocab", lambda r: _edit(r, "positions", _set("ent_1", 2, 12.5)), ["ent_1", "row 2", "log(vocab"]),
    ("ent-below-h(q)", lambda r: _edit(r, "positions", _ent_below_hq), ["ent_2", "h(q_2)"]),
    (
        "margin-nan",
        lambda r: _edit(r, "positions", _set("margin_5", 8, np.nan)),
        ["positions.parquet", "margin_5", "row 8"],
    ),
    ("margin-above-1", lambda r: _edit(r, "positions", _set("margin_1", 4, 1.5)), ["margin_1", "row 4", "[0, 1]"]),
    ("margin-negative", lambda r: _edit(r, "positions", _set("margin_2", 0, -0.1)), ["margin_2", "row 0", "[0, 1]"]),
    ("margin-below-2q-1", lambda r: _edit(r, "positions", _margin_below), ["margin_3", "2*q_3 - 1"]),
    ("ent-wrong-type", lambda r: _edit(r, "positions", _set("ent_1", 0, "high")), ["ent_1", "type"]),
    ("margin-beyond-kmax", lambda r: _edit(r, "positions", _set("margin_7", 0, 0.5)), ["margin_7", "kmax=6"]),
    ("v1-manifest-v2-tables", _manifest_edit(schema_version=1), ["positions.parquet", "schema_version 2"]),
    ("vocab-size-zero", _manifest_edit(vocab_size=0), ["manifest.json", "vocab_size"]),
    ("vocab-size-string", _manifest_edit(vocab_size="151936"), ["manifest.json", "vocab_size"]),
]


@pytest.mark.parametrize(("case", "mutate", "needles"), CASES, ids=[c[0] for c in CASES])
def test_malformed_trace_gives_one_line_and_exit_2(
    small_traces: Path, tmp_path: Path, case: str, mutate: Callable[[Path], None], needles: list[str]
) -> None:
    root = _copy(small_traces, tmp_path)
    mutate(root)
    result = runner.invoke(app, ["validate", str(root)])
    assert result.exit_code == 2, (case, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("specenv: error: ")
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in result.output


def test_valid_set_passes(small_traces: Path) -> None:
    result = runner.invoke(app, ["validate", str(small_traces), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["valid"] is True
    assert info["counts"]["generations"] == 8


def test_unknown_dataset_name_exit_2() -> None:
    result = runner.invoke(app, ["validate", "no-such-dataset-or-folder"])
    assert result.exit_code == 2
    assert "no-such-dataset-or-folder" in result.stderr


def test_traceerror_names_file_column_row() -> None:
    err = TraceError("f.parquet", "bad", column="c", row=3)
    assert str(err) == "f.parquet, column 'c', row 3: bad"


def test_save_is_atomic_on_invalid_table(small_set: TraceSet, tmp_path: Path) -> None:
    bad = TraceSet(small_set.manifest, small_set.positions.copy(), small_set.rounds)
    bad.positions.loc[5, "rho_1"] = 2.0
    dest = tmp_path / "out"
    with pytest.raises(TraceError):
        bad.save(dest)
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []  # no half-written temp folder left behind
