"""The ``caps-v1`` extension of the positions table (issue 17 item 2): writer, reader, validation.

The data here is synthetic (tests/rows.py ``cap_trace_set``); the collected set is checked in
tests/test_caps_collect.py.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from rows import SYNTHETIC_CAPS, cap_trace_set

from specenv.traces.schema import TraceError, cap_column
from specenv.traces.traceset import TraceSet

KMAX = 4


@pytest.fixture(scope="module")
def cap_set():
    return cap_trace_set(n_generations=3, kmax=KMAX)


@pytest.fixture(scope="module")
def saved(cap_set, tmp_path_factory):
    path = tmp_path_factory.mktemp("caps") / "set"
    cap_set.save(path)
    return path


def edited(cap_set, column, row, value, tmp_path, manifest=None):
    """``cap_set`` (positions only) with one cell of ``column`` (made float) set to ``value``, in memory."""
    df = cap_set.positions.copy()
    df[column] = df[column].astype(np.float64)
    df.loc[row, column] = value
    ts = TraceSet(copy.deepcopy(manifest or cap_set.manifest), df, None)
    return ts


def test_round_trip_manifest_and_arrays(cap_set, saved):
    m = json.loads((saved / "manifest.json").read_text())
    assert m["caps"] == list(SYNTHETIC_CAPS) and m["extensions"] == ["caps-v1"] and m["schema_version"] == 2
    loaded = TraceSet.load(saved)
    a = loaded.arrays()
    ca = a.cap_arrays()
    C, n = len(SYNTHETIC_CAPS), len(a.L)
    assert ca.caps.tolist() == list(SYNTHETIC_CAPS)
    for arr in (ca.acc, ca.U, ca.mis, ca.lpgap):
        assert arr.shape == (C, KMAX + 1, n)
    # k = 0 is the uncapped AR round
    assert (ca.acc[:, 0] == 0).all() and (ca.mis[:, 0] == 0).all() and (ca.lpgap[:, 0] == 0).all()
    assert np.array_equal(ca.U[:, 0], np.broadcast_to(a.U[:, 0], (C, n)))
    # every cell is the column it came from
    df = cap_set.positions
    for c in range(C):
        for k in range(1, KMAX + 1):
            assert np.array_equal(ca.acc[c, k], df[cap_column("acc", c + 1, k)].to_numpy())
            assert np.array_equal(ca.U[c, k], df[cap_column("U", c + 1, k)].to_numpy(np.float64))
            assert np.array_equal(ca.mis[c, k], df[cap_column("mis", c + 1, k)].to_numpy())
            assert np.array_equal(ca.lpgap[c, k], df[cap_column("lpgap", c + 1, k)].to_numpy(np.float64))
    # the in-memory (pandas) path packs the same arrays
    mem = cap_set.arrays().cap_arrays()
    assert all(np.array_equal(getattr(mem, f), getattr(ca, f)) for f in ("acc", "U", "mis", "lpgap"))
    # select and with_kmax carry the cap arrays along
    sub = a.select([2, 0])
    rows = np.r_[a.offsets[2] : a.offsets[3], a.offsets[0] : a.offsets[1]]
    assert np.array_equal(sub.cap_arrays().acc, ca.acc[..., rows])
    assert a.with_kmax(2).cap_arrays().U.shape == (C, 3, n)
    assert loaded.rounds["cap"].isin([0, *SYNTHETIC_CAPS]).all()


def test_cap_quality_is_the_pooled_ratio(saved):
    a = TraceSet.load(saved).arrays()
    ca = a.cap_arrays()
    qual = a.cap_quality()
    c, k = 0, KMAX
    committed = [min(int(ca.acc[c, k, i]) + 1, int(n)) for i, n in enumerate(a.remaining())]
    assert qual["mismatch_rate"][c, k] == pytest.approx(ca.mis[c, k].sum() / sum(committed))
    assert qual["lpgap"][c, k] == pytest.approx(ca.lpgap[c, k].mean())
    assert (qual["mismatch_rate"][:, 0] == 0).all()
    # remaining() is N - t
    g0 = int(a.lengths[0])
    assert a.remaining()[:g0].tolist() == list(range(g0, 0, -1))


def test_a_set_without_caps_is_unchanged(small_greedy_traces):
    m = json.loads((small_greedy_traces / "manifest.json").read_text())
    assert "caps" not in m and "extensions" not in m
    a = TraceSet.load(small_greedy_traces).arrays()
    assert not a.has_caps
    with pytest.raises(ValueError, match="the joint env needs the expert-cap columns.*caps-v1") as err:
        a.cap_arrays("the joint env")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("column", "value", "problem"),
    [
        ("acc_c1_k2", 3, r"accepted drafts outside 0\.\.2"),
        ("acc_c2_k1", -1, r"accepted drafts outside 0\.\.1"),
        ("acc_c1_k3", 1.5, "must be a whole number"),
        ("mis_c3_k4", 99, r"more mismatches than committed tokens \(acc_c3_k4 \+ 1\)"),
        ("mis_c1_k1", -1, "negative mismatch count"),
        ("U_c1_k4", SYNTHETIC_CAPS[0] + 0.5, f"above the cap B={SYNTHETIC_CAPS[0]}"),
        ("U_c3_k2", 2.0, r"below min\(top_k, cap\) = 8"),
        ("lpgap_c2_k2", np.nan, "NaN or infinite value|null value"),
    ],
)
def test_bad_cells_are_refused_with_one_line(cap_set, tmp_path, column, value, problem):
    row = 5
    ts = edited(cap_set, column, row, value, tmp_path)
    with pytest.raises(TraceError, match=rf"positions \(in memory\), column '{column}', row {row}: ({problem})") as err:
        ts.save(tmp_path / "bad")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "bad").exists()  # nothing half-written


def test_missing_and_stray_cap_columns(cap_set, tmp_path):
    ts = TraceSet(copy.deepcopy(cap_set.manifest), cap_set.positions.drop(columns=["lpgap_c3_k4"]), None)
    with pytest.raises(TraceError, match="column 'lpgap_c3_k4'.*missing required column"):
        ts.save(tmp_path / "a")
    m = copy.deepcopy(cap_set.manifest)
    m.caps, m.extensions = None, []
    with pytest.raises(TraceError, match="column 'acc_c1_k1'.*manifest declares no caps"):
        TraceSet(m, cap_set.positions, None).save(tmp_path / "b")
    m = copy.deepcopy(cap_set.manifest)
    m.caps = list(SYNTHETIC_CAPS[:2])
    with pytest.raises(TraceError, match=r"column 'acc_c3_k1'.*cap level outside 1\.\.2"):
        TraceSet(m, cap_set.positions, None).save(tmp_path / "c")


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ({"caps": [20, 12, 32]}, "strictly ascending"),
        ({"caps": [12, 20, 128]}, "every cap must be < n_experts=128"),
        ({"caps": [12, 20, 32.0]}, "caps"),
        ({"extensions": []}, "field 'caps' and extension 'caps-v1' go together"),
        ({"extensions": ["caps-v1", "caps-v9"]}, "unknown extension 'caps-v9'"),
    ],
)
def test_bad_manifest_caps_are_refused(saved, tmp_path, edit, problem):
    import shutil

    dest = tmp_path / "set"
    shutil.copytree(saved, dest)
    m = json.loads((dest / "manifest.json").read_text())
    m.update(edit)
    (dest / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TraceError, match=problem) as err:
        TraceSet.load(dest)
    assert "manifest.json" in str(err.value) and "\n" not in str(err.value)


def test_capped_rounds_obey_their_cap(cap_set, tmp_path):
    r = cap_set.rounds.copy()
    row = int(np.flatnonzero((r["cap"] == SYNTHETIC_CAPS[0]).to_numpy())[3])
    r.loc[row, "U_r"] = SYNTHETIC_CAPS[0] + 1.0
    ts = TraceSet(copy.deepcopy(cap_set.manifest), None, r)
    with pytest.raises(TraceError, match=rf"column 'U_r', row {row}: above the round's expert cap"):
        ts.save(tmp_path / "r")
    r = cap_set.rounds.copy()
    r.loc[0, "cap"] = -1
    with pytest.raises(TraceError, match=r"column 'cap', row 0: cap outside 0\.\.128"):
        TraceSet(copy.deepcopy(cap_set.manifest), None, r).save(tmp_path / "r2")
