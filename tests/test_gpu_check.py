"""scripts/gpu_check.py end to end in its tiny CPU mode: routing read by the engine's hooks, the per-K fit, the JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_cpu_run_fits_alpha_per_k(tmp_path, capsys):
    gc = _script()
    out = tmp_path / "fit.json"
    report = gc.main(
        ["--tiny", "--device", "cpu", "--ks", "0,1,3", "--contexts", "8,16", "--reps", "5", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert json.loads(capsys.readouterr().out) == json.loads(out.read_text())  # the printed JSON is the file's
    assert report["graphs"] is False and report["timer"] == "perf_counter" and report["graph_error"] is None
    assert report["experts_implementation"] == "grouped_mm"
    assert report["rows"] == 3 * 2 * 5 and report["skipped_cells"] == []
    top_k, n_experts = gc.TINY_SHAPE["num_experts_per_tok"], gc.TINY_SHAPE["num_experts"]
    # one position loads exactly its top-k experts in every layer: the hooks did read the routing
    assert report["mean_by_K"]["0"]["U_r"] == top_k
    for k in (1, 3):
        assert top_k < report["mean_by_K"][str(k)]["U_r"] <= min(n_experts, (k + 1) * top_k)
    assert [r["K"] for r in report["per_k"]] == [1, 3]  # K = 0 has no U_r spread: not fitted per K
    for r in report["per_k"]:
        assert 0.0 <= r["alpha_p"] <= 1.0 and r["N"] == 10
        assert r["alpha_us_per_expert_layer"] == pytest.approx(r["alpha"] * 1e3 / 2)
    floor = 3 * 64 * 32 * 2 / 4.8e12 * 1e6  # one tiny expert's weights in bf16 at 4.8 TB/s, in us
    assert report["floor_us_per_expert_layer"] == pytest.approx(floor)


def test_bad_arguments_are_one_line(tmp_path):
    gc = _script()
    with pytest.raises(SystemExit, match="--ks: 'a,1' is not a comma-separated list"):
        gc.main(["--tiny", "--device", "cpu", "--ks", "a,1", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="two or more context lengths"):
        gc.main(["--tiny", "--device", "cpu", "--contexts", "8", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
