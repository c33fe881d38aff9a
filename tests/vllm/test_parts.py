"""Recorder part files without vLLM: atomic parts, what readers ignore, assembling several runs."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from specenv.engines.recorder import PartRecorder, load_recording, recording_status
from specenv.traces.schema import ModelFacts, TraceError
from tests.rows import recorder_row

FACTS = ModelFacts(n_layers=2, n_experts=16, top_k=2)


row = recorder_row


def test_parts_are_complete_and_indexed(tmp_path):
    rec = PartRecorder(tmp_path, FACTS, kmax=4, meta={"engine": "test"}, source="vllm", part_rounds=5)
    for i in range(12):
        rec.add(row(i // 6, i % 6))
        rec.maybe_flush()
    rec.close(summary={"note": "ok"})
    st = recording_status(tmp_path)
    assert st["parts"] == ["part-000000", "part-000001", "part-000002"] and st["rows"] == 12
    assert st["incomplete"] == st["invalid"] == st["rejected"] == []
    for p in st["parts"]:
        idx = json.loads((tmp_path / "parts" / f"{p}.json").read_text())
        assert pq.read_table(tmp_path / "parts" / idx["path"]).num_rows == idx["rows"]
    man = json.loads((tmp_path / "recording.json").read_text())
    assert man["summary"]["rows"] == 12 and man["summary"]["note"] == "ok"
    ts = load_recording(tmp_path)
    assert len(ts.rounds) == 12 and ts.manifest.source == "vllm" and ts.manifest.greedy


def test_readers_ignore_partial_and_corrupt_files(tmp_path):
    rec = PartRecorder(tmp_path, FACTS, kmax=4, meta={}, source="vllm", part_rounds=4)
    for i in range(8):
        rec.add(row(0, i))
        rec.maybe_flush()
    rec.close()
    parts = tmp_path / "parts"
    # what a crash can leave: a temporary, and a Parquet file whose index was never written
    (parts / ".part-000002.parquet.tmp").write_bytes(b"PAR1 half a file")
    (parts / "part-000003.parquet").write_bytes((parts / "part-000000.parquet").read_bytes())
    # and a part whose file no longer matches its index
    bad = json.loads((parts / "part-000001.json").read_text())
    (parts / "part-000001.parquet").write_bytes(b"garbage")
    st = recording_status(tmp_path)
    assert st["parts"] == ["part-000000"]
    assert st["invalid"] == ["part-000001.json"]
    assert set(st["incomplete"]) == {".part-000002.parquet.tmp", "part-000003.parquet"}
    ts = load_recording(tmp_path)
    assert len(ts.rounds) == 4 and len(ts.manifest.extra["skipped_files"]) == 3
    assert bad["rows"] == 4


def test_invalid_rows_are_rejected_not_published(tmp_path):
    rec = PartRecorder(tmp_path, FACTS, kmax=4, meta={}, source="vllm", part_rounds=100)
    bad = row(0, 0)
    bad["U_r"] = 1.0  # below top_k
    rec.add(bad)
    rec.close()
    st = recording_status(tmp_path)
    assert st["parts"] == [] and st["rejected"] == ["rejected-000000.parquet"]
    with pytest.raises(TraceError, match="no complete part"):
        load_recording(tmp_path)


def test_several_runs_assemble_and_resume_numbering(tmp_path):
    a, b = tmp_path / "k2", tmp_path / "k3"
    for folder, K in ((a, 2), (b, 3)):
        rec = PartRecorder(folder, FACTS, kmax=K, meta={"run": K}, source="vllm", part_rounds=3)
        for i in range(4):
            rec.add(row(0, i, K=K, run=f"K={K}"))
            rec.maybe_flush()
        rec.close()
    rec = PartRecorder(a, FACTS, kmax=2, meta={"run": "again"}, source="vllm", part_rounds=3)  # resumes after part 1
    rec.add(row(1, 0, K=2, run="K=2"))
    rec.close()
    assert recording_status(a)["parts"] == ["part-000000", "part-000001", "part-000002"]
    ts = load_recording([a, b], name="both")
    assert ts.manifest.kmax == 3 and ts.manifest.name == "both"
    assert sorted(set(ts.rounds["run"])) == ["K=2", "K=3"] and len(ts.rounds) == 9
    other = PartRecorder(tmp_path / "other", ModelFacts(3, 16, 2), kmax=2, meta={}, source="vllm")
    other.add(row(0, 0, K=2))
    other.close()
    with pytest.raises(TraceError, match="another model"):
        load_recording([a, tmp_path / "other"])
