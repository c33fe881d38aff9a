"""specenv.validation.check validates an object once: a later read of the same JSON gets the value from the cache."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specenv import validation
from specenv.cost.model import CostModel
from specenv.traces.datasets import resolve
from specenv.traces.schema import TraceError
from specenv.traces.traceset import MANIFEST, Manifest, TraceSet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECENV_CACHE", str(folder))
    return folder


@pytest.fixture
def manifest_obj() -> dict:
    return validation.read_json(resolve("paper-default") / MANIFEST)


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / validation.MEMO_SUBDIR).glob("*.json"))


def _no_pydantic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any use of the pydantic models fail (so a result can only come from the cache)."""

    def refuse():  # noqa: ANN202
        raise AssertionError("validated with pydantic")

    monkeypatch.setattr(validation, "_models", refuse)


def _cost_model_json() -> dict:
    return {
        "format": "specenv.costmodel/1",
        "kmax": 2,
        "top_k": 2,
        "target": {str(k): {"beta0": 1.0 + k, "alpha": 0.01, "c": 0.0001} for k in range(3)},
        "draft": {"d0": 0.1, "d1": 0.2, "floor": 0.0},
        "source": {"kind": "test", "nested": {"a": [1, 2.5, None]}},
        "diagnostics": {},
    }


def test_a_second_read_is_the_same_manifest_without_pydantic(cache, manifest_obj, monkeypatch):
    first = Manifest.from_json(copy.deepcopy(manifest_obj), "m.json")
    assert len(_entries(cache)) == 1
    _no_pydantic(monkeypatch)
    again = Manifest.from_json(copy.deepcopy(manifest_obj), "m.json")
    assert json.dumps(again.to_json()) == json.dumps(first.to_json())
    assert again == first


def test_a_second_read_is_the_same_cost_model(cache, monkeypatch):
    obj = _cost_model_json()
    try:
        first = CostModel.from_json(copy.deepcopy(obj), "cm.json")
    except ValueError as exc:  # the test's own JSON must be a valid cost model
        pytest.fail(f"test fixture is not a valid cost model: {exc}")
    _no_pydantic(monkeypatch)
    again = CostModel.from_json(copy.deepcopy(obj), "cm.json")
    assert json.dumps(again.to_json()) == json.dumps(first.to_json())


def test_a_changed_object_is_validated_again(cache, manifest_obj, monkeypatch):
    Manifest.from_json(copy.deepcopy(manifest_obj), "m.json")
    bad = copy.deepcopy(manifest_obj)
    bad["kmax"] = 0
    with pytest.raises(TraceError, match="kmax"):
        Manifest.from_json(bad, "m.json")
    reordered = dict(reversed(list(manifest_obj.items())))  # the same fields in another order: another key
    _no_pydantic(monkeypatch)
    with pytest.raises(AssertionError, match="validated with pydantic"):
        Manifest.from_json(reordered, "m.json")


def test_an_invalid_object_is_never_kept(cache, manifest_obj):
    bad = copy.deepcopy(manifest_obj)
    bad["model"]["top_k"] = True  # a bool for an integer
    for _ in range(2):
        with pytest.raises(TraceError, match="top_k"):
            Manifest.from_json(copy.deepcopy(bad), "m.json")
    assert _entries(cache) == []


@pytest.mark.parametrize("damage", ["truncated", "other key", "not tagged"])
def test_a_damaged_entry_is_validated_again(cache, manifest_obj, damage):
    first = Manifest.from_json(copy.deepcopy(manifest_obj), "m.json")
    (entry,) = _entries(cache)
    text = entry.read_text()
    if damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "other key":
        entry.write_text(json.dumps({**json.loads(text), "key": "0" * 64}))
    else:
        entry.write_text(json.dumps({"key": entry.stem, "value": {"name": "x"}}))
    again = Manifest.from_json(copy.deepcopy(manifest_obj), "m.json")
    assert again == first


def test_no_cache_folder_keeps_nothing(tmp_path, monkeypatch, manifest_obj):
    monkeypatch.setenv("SPECENV_CACHE", "off")
    Manifest.from_json(copy.deepcopy(manifest_obj), "m.json")
    _no_pydantic(monkeypatch)
    with pytest.raises(AssertionError, match="validated with pydantic"):
        Manifest.from_json(copy.deepcopy(manifest_obj), "m.json")


def test_validated_values_are_read_only(cache, manifest_obj, monkeypatch):
    validation.check("ManifestJSON", copy.deepcopy(manifest_obj), "m.json")
    _no_pydantic(monkeypatch)
    hit = validation.check("ManifestJSON", copy.deepcopy(manifest_obj), "m.json")
    assert isinstance(hit, validation.Validated) and hit.model.top_k == manifest_obj["model"]["top_k"]
    with pytest.raises(AttributeError):
        hit.kmax = 3
    with pytest.raises(AttributeError):
        hit.no_such_field  # noqa: B018


def _refuse_table_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import specenv.traces.traceset as traceset

    calls: list[str] = []
    for name in ("validate_positions", "validate_rounds", "validate_pair"):

        def refuse(*a, _name=name, **k):  # noqa: ANN002, ANN003, ANN202
            calls.append(_name)
            raise TraceError("x", f"{_name} ran")

        monkeypatch.setattr(traceset, name, refuse)
    return calls


def test_tables_that_passed_before_are_not_checked_again(cache, small_traces, monkeypatch):
    first = TraceSet.load(small_traces)
    with monkeypatch.context() as m:
        calls = _refuse_table_checks(m)
        again = TraceSet.load(small_traces)  # the same bytes (sha256 verified), the same manifest and code
        assert calls == []
        with pytest.raises(TraceError, match="ran"):  # unverified bytes are checked every time
            TraceSet.load(small_traces, verify_hashes=False)
    assert again.positions.equals(first.positions) and again.rounds.equals(first.rounds)


def test_tables_are_checked_again_when_their_bytes_change(cache, small_traces, tmp_path, monkeypatch):
    import shutil

    TraceSet.load(small_traces)
    copy_dir = tmp_path / "set"
    shutil.copytree(small_traces, copy_dir)
    path = copy_dir / "rounds.parquet"
    if not path.is_file():
        pytest.fail("the small set has no rounds.parquet")
    path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)
    _refuse_table_checks(monkeypatch)
    with pytest.raises(TraceError, match="sha256 does not match"):
        TraceSet.load(copy_dir)


@pytest.mark.slow  # three fresh interpreters
def test_make_imports_no_pydantic_once_the_cache_is_warm(tmp_path):
    env = dict(os.environ, SPECENV_CACHE=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    probe = (
        "import specenv, gymnasium, sys; gymnasium.make('specenv/MoESpec-v1').reset(seed=0); "
        "print('pydantic' in sys.modules)"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", probe], env=env, cwd=ROOT, check=True, timeout=600, capture_output=True, text=True
        ).stdout.split()[-1]
        for _ in range(3)  # the first fits the cost model, the second reads the fit back (validating it)
    ]
    assert runs[0] == "True" and runs[-1] == "False"


def test_a_refused_command_writes_no_memo_entry_and_a_good_one_does(cache: Path, tmp_path: Path) -> None:
    """The CLI holds the memo's entries of a command and writes them only when it ends with status 0.

    Each command in its own process (a process keeps the sets it loaded: a second command in the same
    process would validate nothing).
    """
    env = {**os.environ, "SPECENV_CACHE": str(cache), "PYTHONPATH": str(ROOT)}

    def specenv(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "specenv.cli", *args], env=env, capture_output=True, text=True)

    bad = specenv("bench", "paper-default", "--kmax", "99", "--out", str(tmp_path / "o"))
    assert bad.returncode == 2 and "--kmax" in bad.stderr
    assert _entries(cache) == []  # the set's manifest was validated, then the command was refused
    good = specenv("validate", "paper-default")
    assert good.returncode == 0, good.stderr
    assert _entries(cache) != []
