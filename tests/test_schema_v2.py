"""Trace schema v2: the draft's entropy and margin (validation, v1 compatibility, generator, live engine)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from specenv.cli import app
from specenv.generator import PaperProfile, draft_signals, generate_generation, generate_paper
from specenv.traces.datasets import find_dataset, load_dataset
from specenv.traces.schema import (
    ROUNDS_COLUMNS,
    SCHEMA_VERSION,
    TraceError,
    binary_entropy,
    column_strings,
    column_values,
    ent_columns,
    margin_columns,
    q_columns,
    rho_columns,
    signal_columns,
    u_columns,
    validate_positions,
)
from specenv.traces.traceset import TraceSet

runner = CliRunner()

#: sha256 of the v1 columns (generation_id, t, L, rho, q, U as float64) of paper-default-v1, and of
#: its rounds table's schema columns: version 2 must carry them bit for bit.
PAPER_V1_POSITIONS = "252d2399c45f73d685cc1ff6bc2bfefe5a7b4c50321a2bab1bac75a159b00bd8"
PAPER_V1_ROUNDS = "4fa5c0be2eb25c60b4e21dbe6b50b052e80b7df54fa326fe56e0f72b19eed454"


def _digest(table: pa.Table, cols: list[str]) -> str:
    h = hashlib.sha256()
    for c in cols:
        if c == "category":
            h.update("\n".join(column_strings(table, c)).encode())
        else:
            h.update(np.ascontiguousarray(column_values(table, c, np.float64)).tobytes())
    return h.hexdigest()


def _table(ts: TraceSet) -> pa.Table:
    return pa.Table.from_pandas(ts.positions, preserve_index=False)


# ---------------------------------------------------------------------------------------- validation
def test_schema_version_and_columns() -> None:
    assert SCHEMA_VERSION == 2
    assert ent_columns(3) == ["ent_1", "ent_2", "ent_3"]
    assert margin_columns(2) == ["margin_1", "margin_2"]
    assert signal_columns(2) == ["ent_1", "ent_2", "margin_1", "margin_2"]


def test_binary_entropy() -> None:
    q = np.array([0.0, 0.5, 1.0, 0.1])
    np.testing.assert_allclose(binary_entropy(q), [0.0, np.log(2), 0.0, -(0.1 * np.log(0.1) + 0.9 * np.log(0.9))])


@pytest.mark.parametrize(
    ("col", "row", "value", "needle"),
    [
        ("ent_2", 5, np.nan, "NaN or infinite"),
        ("ent_1", 7, -np.inf, "NaN or infinite"),
        ("margin_3", 2, np.nan, "NaN or infinite"),
        ("ent_1", 4, -1e-2, "negative entropy"),
        ("ent_3", 9, np.log(151936) + 0.01, "log(vocab_size=151936)"),
        ("margin_1", 6, 1.01, "outside [0, 1]"),
        ("margin_2", 1, -0.01, "outside [0, 1]"),
    ],
)
def test_signal_ranges_name_column_and_row(small_set: TraceSet, col: str, row: int, value: float, needle: str) -> None:
    table = _table(small_set)
    vals = column_values(table, col, np.float32).copy()
    vals[row] = value
    table = table.set_column(table.column_names.index(col), col, pa.array(vals, type=pa.float32()))
    with pytest.raises(TraceError) as err:
        validate_positions(table, small_set.facts, small_set.kmax, small_set.manifest.greedy, vocab_size=151936)
    msg = str(err.value)
    assert f"column '{col}'" in msg and f"row {row}" in msg and needle in msg, msg
    assert "\n" not in msg


def test_entropy_and_margin_consistent_with_q(small_set: TraceSet) -> None:
    """A token of probability q forces entropy >= h(q) and margin >= 2q - 1; the first row breaking it is named."""
    base = _table(small_set)
    q = column_values(base, "q_2", np.float64)
    rows = np.flatnonzero((q > 0.3) & (q < 0.7))[:2]
    ent = column_values(base, "ent_2", np.float32).copy()
    ent[rows] = 0.0
    table = base.set_column(base.column_names.index("ent_2"), "ent_2", pa.array(ent, type=pa.float32()))
    with pytest.raises(TraceError, match=rf"column 'ent_2', row {rows[0]}: entropy below h\(q_2\)"):
        validate_positions(table, small_set.facts, small_set.kmax, False)
    q = column_values(base, "q_1", np.float64)
    rows = np.flatnonzero(q > 0.8)[:2]
    mar = column_values(base, "margin_1", np.float32).copy()
    mar[rows] = 0.5
    table = base.set_column(base.column_names.index("margin_1"), "margin_1", pa.array(mar, type=pa.float32()))
    with pytest.raises(TraceError, match=rf"column 'margin_1', row {rows[0]}: margin below 2\*q_1 - 1"):
        validate_positions(table, small_set.facts, small_set.kmax, False)


def test_v2_requires_signals_v1_does_not(small_set: TraceSet) -> None:
    table = _table(small_set)
    v1 = table.drop_columns(signal_columns(small_set.kmax))
    with pytest.raises(TraceError, match="column 'ent_1'.*missing required column"):
        validate_positions(v1, small_set.facts, small_set.kmax, False, schema_version=2)
    validate_positions(v1, small_set.facts, small_set.kmax, False, schema_version=1)
    # a v1 table with some signal columns must have them all (and valid)
    partial = table.drop_columns(margin_columns(small_set.kmax))
    with pytest.raises(TraceError, match="column 'margin_1'.*missing required column"):
        validate_positions(partial, small_set.facts, small_set.kmax, False, schema_version=1)


# ------------------------------------------------------------------------------------ v1 compatibility
@pytest.fixture(scope="module")
def v1_set(small_set: TraceSet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small set saved without its signal columns: a schema-v1 set."""
    pos = small_set.positions.drop(columns=signal_columns(small_set.kmax))
    path = tmp_path_factory.mktemp("v1") / "set"
    TraceSet(copy.deepcopy(small_set.manifest), pos, small_set.rounds).save(path)
    return path


def test_v1_set_loads_and_says_what_is_missing(v1_set: Path, small_set: TraceSet) -> None:
    assert json.loads((v1_set / "manifest.json").read_text())["schema_version"] == 1
    ts = TraceSet.load(v1_set)
    arr = ts.arrays()
    assert arr.ent is None and arr.margin is None and not arr.has_signals
    np.testing.assert_array_equal(arr.q, small_set.arrays().q)
    np.testing.assert_array_equal(arr.select([1, 0]).q, small_set.arrays().select([1, 0]).q)
    assert arr.with_kmax(3).ent is None
    with pytest.raises(ValueError, match="AdaEDL needs the draft's entropy and margin") as err:
        arr.signals("AdaEDL")
    assert "\n" not in str(err.value) and "schema v1" in str(err.value)
    result = runner.invoke(app, ["validate", str(v1_set), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["schema_version"] == 1


def test_v2_arrays_carry_signals(small_set: TraceSet) -> None:
    arr = small_set.arrays()
    assert small_set.manifest.schema_version == 2 and small_set.manifest.vocab_size == PaperProfile().vocab_size
    ent, margin = arr.signals()
    assert ent.shape == margin.shape == arr.q.shape
    assert not ent.flags.writeable
    np.testing.assert_array_equal(ent[:, 0], small_set.positions["ent_1"].to_numpy(np.float64))
    sub = arr.select([2, 0]).with_kmax(4)
    rows = np.r_[arr.offsets[2] : arr.offsets[3], arr.offsets[0] : arr.offsets[1]]
    np.testing.assert_array_equal(sub.margin, margin[rows, :4])
    frame = type(arr).from_frame(small_set.positions, small_set.kmax, small_set.manifest.greedy)
    np.testing.assert_array_equal(frame.ent, ent)
    np.testing.assert_array_equal(frame.margin, margin)


# ------------------------------------------------------------------------------------------ generator
def test_shipped_paper_default_keeps_v1_columns_bit_for_bit() -> None:
    ds = find_dataset("paper-default")
    assert ds is not None and ds.version == 2 and find_dataset("paper-default-v2") == ds
    ts = load_dataset("paper-default")
    assert ts.manifest.schema_version == 2
    pos = ts._tables["positions"]
    cols = ["generation_id", "t", "L", *rho_columns(10), *q_columns(10), *u_columns(10)]
    assert _digest(pos, cols) == PAPER_V1_POSITIONS
    assert _digest(ts._tables["rounds"], list(ROUNDS_COLUMNS)) == PAPER_V1_ROUNDS
    ent, margin = ts.arrays().signals()
    assert np.isfinite(ent).all() and np.isfinite(margin).all()


def test_signal_stream_leaves_every_other_draw_unchanged() -> None:
    pr = PaperProfile()
    for greedy in (False, True):
        a = generate_generation(0, "coding", 6, pr, np.random.default_rng([5, 0]), greedy)
        b = generate_generation(
            0, "coding", 6, pr, np.random.default_rng([5, 0]), greedy, signal_rng=np.random.default_rng([5, 0, 1])
        )
        assert a.ent is None and b.ent is not None
        for name in ("L", "rho", "q", "U", "E"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


@pytest.mark.slow  # seconds of work; the full suite runs it
@pytest.mark.parametrize("greedy", [False, True])
def test_generator_signals_are_a_distribution(greedy: bool) -> None:
    ts = generate_paper(6, kmax=5, seed=11, greedy=greedy, with_rounds=False)
    arr = ts.arrays()
    ent, margin = arr.signals()
    assert (ent >= 0).all() and (ent <= np.log(PaperProfile().vocab_size)).all()
    assert ((margin >= 0) & (margin <= 1)).all()
    assert (margin >= 2 * arr.q - 1 - 1e-3).all()
    assert (ent >= binary_entropy(arr.q) - 1e-3).all()
    # the signals carry information about acceptance beyond noise: confident drafts are concentrated
    assert np.corrcoef(arr.q.ravel(), ent.ravel())[0, 1] < -0.5
    if greedy:  # the drafted token is the argmax: top-1 = q, so margin <= q
        inside = (arr.q > 0.01) & (arr.q < 0.99)
        assert (margin[inside] <= arr.q[inside] + 1e-3).all()


def test_draft_signals_match_the_explicit_distribution() -> None:
    rng = np.random.default_rng(0)
    q, theta = rng.random(50), rng.random(50) * 0.99
    ent, margin = draft_signals(q, theta)
    i = np.arange(1, 20001)
    for qq, th, e, m in zip(q, theta, ent, margin, strict=True):
        p = np.r_[qq, (1 - qq) * (1 - th) * th ** (i - 1)]
        p = p[p > 0]
        assert e == pytest.approx(-(p * np.log(p)).sum(), abs=1e-9)
        top = np.sort(p)[::-1]
        assert m == pytest.approx(top[0] - top[1], abs=1e-12)


# ----------------------------------------------------------------------------------------- live engine
@pytest.fixture(scope="module")
def live():
    pytest.importorskip("transformers")
    from specenv.engines.hf import LiveEngine, load_models

    models = load_models()
    eng = LiveEngine(models, kmax=4, max_new_tokens=6)
    yield models, eng
    eng.close()


def _check_engine_signals(q: np.ndarray, ent: np.ndarray, margin: np.ndarray, vocab: int) -> None:
    assert q.shape == ent.shape == margin.shape and q.size
    assert (ent >= 0).all() and (ent <= np.log(vocab) + 1e-6).all()
    assert ((margin >= 0) & (margin <= 1)).all()
    assert (margin >= 2 * q - 1 - 1e-6).all()  # q is the top-1 probability under greedy decoding
    assert (margin <= q + 1e-6).all()  # ... and top-1 - top-2 <= top-1
    assert (ent >= binary_entropy(q) - 1e-5).all()


def test_engine_fills_entropy_and_margin(live) -> None:
    import torch

    from specenv.engines.hf.engine import draft_signals as engine_signals

    models, eng = live
    vocab = int(models.draft.config.vocab_size)
    ids = models.encode("def add(a, b):")
    eng.start(ids)
    q = eng.propose(3)
    assert len(eng.draft_entropy) == len(eng.draft_margin) == 3
    _check_engine_signals(np.array(q), np.array(eng.draft_entropy), np.array(eng.draft_margin), vocab)
    r = eng.step(2)
    assert len(r.ent) == len(r.margin) == len(r.q) == 3
    assert eng.draft_entropy == []  # cleared with the round
    ref = []
    eng.start(ids)
    while not eng.done:
        r = eng.step(0)
        ref += list(r.committed)
    sw = eng.sweep(ids, ref, 4)
    _check_engine_signals(sw["q"], sw["ent"], sw["margin"], vocab)
    # the helper itself: a point mass and a uniform distribution
    assert engine_signals(torch.tensor([1.0, 0.0, 0.0])) == (0.0, 1.0)
    e, m = engine_signals(torch.full((4,), 0.25))
    assert e == pytest.approx(np.log(4)) and m == 0.0


@pytest.mark.slow
def test_collect_writes_schema_v2(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "live"
    result = runner.invoke(
        app,
        ["collect", "--engine", "hf", "--out", str(out), "--n-prompts", "1", "--max-new-tokens", "5", "--kmax", "3"],
    )
    assert result.exit_code == 0, result.output
    man = json.loads((out / "manifest.json").read_text())
    assert man["schema_version"] == 2 and man["vocab_size"] == 2048
    ts = TraceSet.load(out)
    ent, margin = ts.arrays().signals()
    _check_engine_signals(ts.arrays().q, ent, margin, 2048)
