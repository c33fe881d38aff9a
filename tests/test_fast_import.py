"""Fast import: no heavy library on the ``make`` path, the fitted cost model cached on disk, bit-identical.

Nothing here is timed (``scripts/bench_import.py`` measures the import cost); the tests assert what makes
it fast: which modules a fresh interpreter holds after ``make``, that the disk cache is used, and that
what it returns equals a fresh fit bit for bit and is never trusted when damaged or stale.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from specenv.cost import source as costsource
from specenv.cost.model import CostModel
from specenv.cost.source import cost_model_for, fit_cache_key, fit_cache_path, fresh_fit
from specenv.io import atomic_write_bytes, atomic_write_text, cache_dir, json_digest, sha256_file
from specenv.traces.datasets import load_dataset
from specenv.traces.traceset import PositionArrays, TraceSet
from specenv.validation import MEMO_SUBDIR

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("statsmodels", "sklearn", "pandas", "scipy", "matplotlib", "torch", "typer", "rich", "ray", "numba")
ARRAY_FIELDS = ("generation_ids", "categories", "offsets", "L", "rho", "q", "U")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private, empty disk cache and an empty in-process fit cache."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECENV_CACHE", str(folder))
    monkeypatch.setattr(costsource, "_FIT_CACHE", {})
    return folder


@pytest.fixture
def count_fits(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every fresh fit computed through :func:`cost_model_for`."""
    calls: list[str] = []
    real = costsource.fresh_fit

    def counting(traces):  # noqa: ANN001, ANN202
        calls.append(traces.manifest.name)
        return real(traces)

    monkeypatch.setattr(costsource, "fresh_fit", counting)
    return calls


def _assert_same_model(a: CostModel, b: CostModel) -> None:
    for name in ("beta0", "alpha", "c"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == np.float64 and np.array_equal(x, y), name
    assert a.d0 == b.d0 and a.d1 == b.d1 and a.top_k == b.top_k and a.ar_extrapolated == b.ar_extrapolated
    assert json.dumps(a.to_json()) == json.dumps(b.to_json())  # source and diagnostics too


def _forget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(costsource, "_FIT_CACHE", {})


def _subprocess_env(cache_folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["SPECENV_CACHE"] = str(cache_folder)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


# ------------------------------------------------------------------ modules on the make path
MAKE = "import specenv, gymnasium; env = gymnasium.make('specenv/MoESpec-v0'); env.reset(seed=0)"


@pytest.mark.slow  # seconds of work; the full suite runs it
def test_make_loads_no_heavy_module(tmp_path: Path) -> None:
    env = _subprocess_env(tmp_path / "cache")
    subprocess.run([sys.executable, "-c", MAKE], env=env, cwd=ROOT, check=True, timeout=600)  # warms the disk cache
    assert list((tmp_path / "cache" / costsource.CACHE_SUBDIR).glob("fit-*.json")), "make wrote no cache entry"
    probe = f"{MAKE}; import sys, json; print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=ROOT, check=True, timeout=600, capture_output=True, text=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_import_loads_no_heavy_module() -> None:
    probe = (
        "import sys, json; import specenv, specenv.envs.replay, specenv.envs.vector, specenv.cost.source, "
        "specenv.traces.traceset, specenv.traces.datasets, specenv.traces.splits, specenv.io, oracle; "
        f"heavy = {HEAVY!r} + ('pyarrow.dataset',); before = sorted(m for m in heavy if m in sys.modules); "
        "import specenv.cost.fit; after = sorted(m for m in heavy if m in sys.modules); "
        "print(json.dumps([before, after]))"
    )
    env = _subprocess_env(Path("/nonexistent-specenv-cache"))
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=ROOT, check=True, timeout=600, capture_output=True, text=True
    )
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == []
    # importing the fit module itself does not load statsmodels or scikit-learn either (only fitting does)
    assert not {"statsmodels", "sklearn", "scipy"} & set(after)


# ------------------------------------------------------------------ the disk cache
def test_cached_model_equals_fresh_fit(cache: Path, count_fits: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ts = TraceSet.load(load_dataset("paper-default").root)
    first = cost_model_for(ts, "fit")
    assert count_fits == ["paper-default"]
    path = fit_cache_path(fit_cache_key(ts))
    assert path is not None and path.is_file() and path.parent.parent == cache
    _forget(monkeypatch)
    cached = cost_model_for(ts, "fit")
    assert count_fits == ["paper-default"], "the cached entry was not used"
    assert cached is not first
    _assert_same_model(cached, first)
    _assert_same_model(cached, fresh_fit(ts))
    assert cost_model_for(ts, "fit") is cached  # the in-process cache stays in front


@pytest.mark.parametrize(
    "damage",
    [
        "truncate",
        "garbage",
        "coefficient",
        "stale-version",
        "stale-rounds",
        "stale-library",
        "wrong-format",
        "not-a-model",
    ],
)
def test_damaged_or_stale_entry_is_refitted(
    damage: str, cache: Path, count_fits: list[str], small_traces: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ts = TraceSet.load(small_traces)
    good = cost_model_for(ts, "fit")
    path = fit_cache_path(fit_cache_key(ts))
    text = path.read_text()
    entry = json.loads(text)
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "coefficient":  # a changed number: the model digest no longer matches
        entry["model"]["target"]["1"]["alpha"] += 1.0
        path.write_text(json.dumps(entry))
    else:
        if damage == "stale-version":
            entry["key"]["fit_version"] = costsource.FIT_VERSION - 1
        elif damage == "stale-rounds":
            entry["key"]["rounds_sha256"] = "0" * 64
        elif damage == "stale-library":
            entry["key"]["libraries"]["statsmodels"] = "0.0.1"
        elif damage == "wrong-format":
            entry["format"] = "specenv.fitcache/0"
        elif damage == "not-a-model":
            entry["model"] = {"format": "something else"}
        if "model" in entry and isinstance(entry["model"], dict):
            entry["model_sha256"] = hashlib.sha256(json.dumps(entry["model"], sort_keys=True).encode()).hexdigest()
        path.write_text(json.dumps(entry))
    _forget(monkeypatch)
    again = cost_model_for(ts, "fit")
    assert count_fits == ["small", "small"], f"{damage}: the bad entry was trusted"
    _assert_same_model(again, good)
    # the entry was rewritten and is good again
    _forget(monkeypatch)
    _assert_same_model(cost_model_for(ts, "fit"), good)
    assert count_fits == ["small", "small"]


def test_unverified_sets_do_not_use_the_disk_cache(
    cache: Path, count_fits: list[str], small_traces: Path, small_set: TraceSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    unverified = TraceSet.load(small_traces, verify_hashes=False)
    in_memory = TraceSet(small_set.manifest, small_set.positions, small_set.rounds)
    replaced = TraceSet.load(small_traces)
    replaced.rounds = replaced.rounds.copy()
    for ts in (unverified, in_memory, replaced):
        assert fit_cache_key(ts) is None
        _forget(monkeypatch)
        cost_model_for(ts, "fit")
    assert count_fits == ["small"] * 3
    # no fit entry: the cache holds at most the validated manifests (specenv.validation.MEMO_SUBDIR)
    assert not cache.exists() or [p.name for p in cache.iterdir()] == [MEMO_SUBDIR]
    verified = TraceSet.load(small_traces)
    assert verified.verified_sha256("rounds") == verified.manifest.files["rounds"]["sha256"]
    assert fit_cache_key(verified) is not None


def test_disabled_cache_writes_nothing(
    tmp_path: Path, count_fits: list[str], small_traces: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECENV_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _forget(monkeypatch)
    ts = TraceSet.load(small_traces)
    assert cache_dir() is None and fit_cache_path(fit_cache_key(ts)) is None
    cost_model_for(ts, "fit")
    assert count_fits == ["small"] and not any(tmp_path.rglob("*.json"))


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECENV_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "specenv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "specenv"
    monkeypatch.setenv("SPECENV_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    for off in ("", "0", "off", "OFF"):
        monkeypatch.setenv("SPECENV_CACHE", off)
        assert cache_dir() is None


# ------------------------------------------------------------------ pandas-free loading
@pytest.mark.parametrize("name", ["paper-default", "live-cpu"])
def test_arrays_from_arrow_equal_arrays_from_pandas(name: str) -> None:
    ts = TraceSet.load(load_dataset(name).root)
    a = ts.arrays()
    b = PositionArrays.from_frame(ts.positions, ts.kmax, ts.manifest.greedy)
    assert a.greedy == b.greedy
    for field in ARRAY_FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), field
        # same memory layout, so every reduction downstream sums in the same order
        assert (x.flags.c_contiguous, x.flags.f_contiguous) == (y.flags.c_contiguous, y.flags.f_contiguous), field
    assert [type(c) for c in a.categories] == [str] * len(a.categories)


def test_lazy_frames_match_the_files(small_traces: Path) -> None:
    ts = TraceSet.load(small_traces)
    assert ts.has_positions and ts.has_rounds
    for tab in ("positions", "rounds"):
        frame = getattr(ts, tab)
        assert getattr(ts, tab) is frame  # converted once, then shared
        assert frame.equals(pq.read_table(small_traces / f"{tab}.parquet").to_pandas())
    ts.positions = None
    assert not ts.has_positions and ts.positions is None
    with pytest.raises(ValueError, match="no positions table"):
        ts.arrays()


# ------------------------------------------------------------------ specenv.io
def test_atomic_writes_and_digests(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    atomic_write_text(target, "first\n")
    atomic_write_bytes(target, b"second\n")
    assert target.read_bytes() == b"second\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left behind
    assert sha256_file(target) == hashlib.sha256(b"second\n").hexdigest()
    assert json_digest({"b": 1, "a": [1, 2]}) == json_digest({"a": [1, 2], "b": 1})
    assert json_digest({"a": 1}) != json_digest({"a": 2}) and len(json_digest({})) == 16
    with pytest.raises(FileNotFoundError):
        atomic_write_text(tmp_path / "missing" / "x.txt", "x")
    assert not (tmp_path / "missing").exists()


def test_column_readers_match_pyarrow_on_chunked_and_sliced_tables() -> None:
    import pyarrow as pa

    from specenv.traces.schema import column_strings, column_values

    nums = pa.chunked_array([pa.array([5, 6, 7, 8], pa.int32()).slice(1), pa.array([], pa.int32()), [9, 10]])
    floats = pa.chunked_array(
        [pa.array([0.5, 1.5], pa.float32()), pa.array([2.25, 3.0, 4.0], pa.float32()).slice(1, 1)]
    )
    cats = pa.chunked_array(
        [
            pa.array(["b", "a", "b"]).dictionary_encode().slice(1),
            pa.array(["c", "a"]).dictionary_encode(),
            pa.array(["z"]).dictionary_encode(),
        ]
    )
    plain = pa.chunked_array([pa.array(["x", "yy"]), pa.array(["", "x"]).slice(1)])
    table = pa.table({"n": nums, "c": cats})
    assert np.array_equal(column_values(table, "n", np.int64), nums.to_numpy().astype(np.int64))
    assert column_values(table, "n", np.int64).dtype == np.int64
    f = column_values(pa.table({"f": floats}), "f", np.float64)
    assert f.dtype == np.float64 and np.array_equal(f, floats.to_numpy().astype(np.float64))
    got = column_strings(table, "c")
    assert got.dtype == object and got.tolist() == cats.cast(pa.string()).to_pylist() == ["a", "b", "c", "a", "z"]
    assert column_strings(pa.table({"s": plain}), "s").tolist() == ["x", "yy", "x"]
    with pytest.raises(TypeError, match="not a numeric"):
        column_values(pa.table({"s": plain}), "s", np.int64)
