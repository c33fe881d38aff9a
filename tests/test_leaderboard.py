"""The validated leaderboard (leaderboard/): its records are consistent, and CI re-runs one entry."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _board():
    spec = importlib.util.spec_from_file_location("leaderboard_script", ROOT / "scripts" / "leaderboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_one_entry_per_set_and_mode_with_its_bench_json_and_table() -> None:
    lb = _board()
    entries = json.loads((ROOT / "leaderboard" / "entries.json").read_text())
    assert sorted(e["id"] for e in entries) == sorted(f"{s}/{m}" for s in lb.SETS for m in lb.MODES)
    for e in entries:
        doc = json.loads((ROOT / "leaderboard" / e["bench_json"]).read_text())
        row = lb._row(doc, e["policy"])
        assert row["speedup_pooled"] == e["speedup_pooled"] and row["drafting"] == e["drafting"]
        assert lb.leader(doc, e["drafting"])["policy"] == e["policy"]  # the leader of its mode
        assert e["speedup_pooled"] <= e["bound"] + 1e-9
        lo, hi = e["pooled_ci95"]
        assert lo <= e["speedup_pooled"] <= hi
        if e["policy_file"].startswith("policies/shipped/"):
            assert (ROOT / e["policy_file"]).is_file()
        assert e["command"].startswith(f"specenv bench {e['dataset']} --drafting {e['drafting']} ")
    assert (ROOT / "leaderboard" / "README.md").read_text() == lb.table(entries)
    assert "leaderboard/README.md" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("entry_id", ["live-cpu/sequential"])
def test_an_entry_reproduces_within_its_ci(entry_id: str, tmp_path: Path) -> None:
    lb = _board()
    entries = {e["id"]: e for e in json.loads((ROOT / "leaderboard" / "entries.json").read_text())}
    ok, new = lb.check(entries[entry_id], tmp_path)
    assert ok, (entries[entry_id]["speedup_pooled"], entries[entry_id]["pooled_ci95"], new)
