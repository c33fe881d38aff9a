"""Engines behind one interface: an engine-agnostic recorder, engines that never import the environments."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from specenv.engines.recorder import PartRecorder, load_recording
from specenv.traces.schema import ModelFacts, TraceError
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


def test_cli_takes_a_recording_folder(tmp_path):
    """``specenv validate|fit|oracle`` read a recording folder (parts) directly, no manual assembly."""
    from typer.testing import CliRunner

    from specenv.cli import app

    rec = PartRecorder(tmp_path / "rec", FACTS, kmax=4, meta={"engine": "test"}, source="vllm", part_rounds=64)
    for gid in range(6):
        for rnd in range(12):
            K = rnd % 5
            row = recorder_row(gid, rnd, K, acc=min(K, 1), drafted=K)
            row |= {
                "L": 20 + 3 * rnd + gid,
                "T_T_ms": 3.0 + 0.4 * K + 0.01 * (rnd + gid),
                "T_D_ms": 1.0 + 0.5 * K + 0.02 * (rnd % 4),
                "U_r": 2.0 + K * 0.5 + 0.1 * ((rnd + gid) % 3),
            }
            if K == 0:
                row |= {"U_r": 2.0, "E_max": 1.0}
            rec.add(row)
    rec.close()
    folder = str(tmp_path / "rec")
    res = CliRunner().invoke(app, ["validate", folder, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["counts"]["rounds"] == 72
    res = CliRunner().invoke(app, ["fit", folder, "--json", "--folds", "3"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["ar"]["extrapolated"] is False  # the K = 0 rounds measure the AR step
    res = CliRunner().invoke(app, ["oracle", folder])
    assert res.exit_code == 2 and "no positions table" in res.output  # loads; rounds alone cannot back the oracle
    assert "missing manifest" not in res.output


def test_deferred_rows_are_built_by_the_writer_in_their_place(tmp_path):
    import threading

    built_on = []

    def build(rows):
        def make():
            built_on.append(threading.current_thread().name)
            return rows

        return make

    rec = PartRecorder(tmp_path / "rec", FACTS, kmax=4, meta={}, source="vllm", part_rounds=64)
    rec.add(_row(0, 0))
    rec.add_deferred(2, build([_row(0, 1), _row(1, 0)]))
    rec.add(_row(0, 2))
    rec.add_deferred(1, build([_row(1, 1)]))
    assert rec.rows_buffered == 5 and not built_on  # nothing built on the serving side
    rec.flush()
    rec.add_deferred(2, build([_row(2, 0)]))  # announced 2, builds 1: its part is lost, reported
    rec.close()
    assert built_on[:2] == ["specenv-recorder"] * 2
    r = load_recording(tmp_path / "rec").rounds
    assert list(zip(r["generation_id"], r["round"], strict=True)) == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1)]
    errors = json.loads((tmp_path / "rec" / "recording.json").read_text())["summary"]["errors"]
    assert len(errors) == 1 and "1 rows, 2 announced" in errors[0]


def _brute_force(routing, spans, n_experts):
    """U_r, E_max of each span and the forward's union, one layer and one expert at a time."""
    L = routing.shape[0]
    U, E = [], []
    for o, m in spans:
        per_layer = [[int((routing[layer, o : o + m] == e).sum()) for e in range(n_experts)] for layer in range(L)]
        U.append(sum(sum(c > 0 for c in row) for row in per_layer) / L)
        E.append(sum(max(row) for row in per_layer) / L)
    union = sum(len(set(routing[layer].ravel().tolist())) for layer in range(L)) / L
    return U, E, union


@pytest.mark.parametrize("layout", ["one pass", "passes and a prefill", "passes with gaps"])
def test_step_experts_equal_span_expert_stats_and_a_brute_force(layout):
    import numpy as np

    from specenv.engines.base import StepExperts, span_expert_stats

    rng = np.random.default_rng(7)
    L, n_experts, top_k = 3, 16, 2
    spans = {"one pass": [(0, 5)], "passes and a prefill": [(0, 3), (3, 1), (4, 5), (9, 2)]}.get(
        layout, [(2, 3), (7, 1), (11, 4)]
    )
    T = {"one pass": 5, "passes and a prefill": 24}.get(layout, 17)  # tokens of no pass: prefills
    experts = StepExperts(L, n_experts, top_k, capacity=4)  # smaller than the forward: grows
    for _ in range(5):
        routing = np.stack([[rng.choice(n_experts, top_k, replace=False) for _ in range(T)] for _ in range(L)])
        routing = routing.astype(np.int32)
        U, E, union = experts.step(routing, [o for o, _ in spans], [m for _, m in spans])
        want_U, want_E, want_union = _brute_force(routing, spans, n_experts)
        assert U.tolist() == pytest.approx(want_U, abs=0) and E.tolist() == pytest.approx(want_E, abs=0)
        assert union == want_union
        ref_U, ref_E = span_expert_stats(routing, spans, n_experts)  # bit for bit the function it replaces
        assert np.array_equal(U, ref_U) and np.array_equal(E, ref_E)
