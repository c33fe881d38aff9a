"""Engines behind one interface: an engine-agnostic recorder, engines that never import the environments."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from specenv.engines.recorder import PartRecorder, load_recording
from specenv.schema import ModelFacts, TraceError
from tests.rows import recorder_row

FACTS = ModelFacts(n_layers=2, n_experts=16, top_k=2)
ENGINES = pathlib.Path(__file__).resolve().parents[1] / "specenv" / "engines"


def _row(gid: int, rnd: int, K: int = 3) -> dict:
    return recorder_row(gid, rnd, K, drafted=K)


def _record(folder, source: str, n: int = 3) -> None:
    rec = PartRecorder(folder, FACTS, kmax=4, meta={"engine": f"{source} test"}, source=source, part_rounds=2)
    for i in range(n):
        rec.add(_row(0, i))
        rec.maybe_flush()
    rec.close()


def test_recorder_records_any_engine(tmp_path):
    _record(tmp_path / "hf", "hf")
    ts = load_recording(tmp_path / "hf")
    assert ts.manifest.source == "hf" and len(ts.rounds) == 3
    assert json.loads((tmp_path / "hf" / "recording.json").read_text())["source"] == "hf"
    assert "vllm" not in ts.manifest.description.lower()


def test_recorder_refuses_to_mix_engines(tmp_path):
    _record(tmp_path / "a", "hf")
    _record(tmp_path / "b", "sglang")
    with pytest.raises(TraceError, match="another engine"):
        load_recording([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(ValueError, match="another engine"):
        PartRecorder(tmp_path / "a", FACTS, kmax=4, meta={}, source="vllm")


def test_recordings_of_earlier_releases_still_load(tmp_path):
    _record(tmp_path, "vllm")
    man = json.loads((tmp_path / "recording.json").read_text())
    man["format"] = "specenv.vllm.recording/1"
    del man["source"]
    (tmp_path / "recording.json").write_text(json.dumps(man))
    for idx in (tmp_path / "parts").glob("part-*.json"):
        ent = json.loads(idx.read_text())
        ent["format"] = "specenv.vllm.part/1"
        idx.write_text(json.dumps(ent))
    ts = load_recording(tmp_path)
    assert ts.manifest.source == "vllm" and len(ts.rounds) == 3


def test_engines_do_not_import_the_environments_and_recorder_not_vllm():
    pattern = re.compile(r"^\s*(from|import)\s+specenv\.envs\b|^\s*from\s+specenv\s+import\s+envs\b", re.M)
    for path in ENGINES.rglob("*.py"):
        assert not pattern.search(path.read_text()), f"{path} imports specenv.envs"
    recorder = (ENGINES / "recorder.py").read_text()
    assert not re.search(r"^\s*(from|import)\s+(vllm|specenv\.engines\.vllm)\b", recorder, re.M)
