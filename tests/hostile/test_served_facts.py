"""`serve` and `abtest` check the cost model, the trace set and --fallback-k against the served models first.

A cost model fitted for other routing (128 experts, top-8) or for fewer budgets than the server
drafts, a fallback budget above ``num_speculative_tokens``, a trace set of another model (facts or
recorded model set) or without prompts: one line naming the option, exit 2, before vLLM is imported
or any engine starts (``serve`` cases carry ``--print-command``, so a missing check prints instead).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specenv.io import cache_dir
from tests.hostile.harness import private_cache, reject_cleanly, run_cli

ROOT = Path(__file__).resolve().parents[2]
LIVE_VLLM = ROOT / "specenv" / "data" / "live-vllm-v1"  # recorded on small-moe-v1 (6 layers, 64 experts, top-4)
SERVE = ["serve", "--policy", "none", "--models", "small-moe-v1", "--print-command"]
ABTEST = ["abtest", "--models", "small-moe-v1", "--prompts", "1", "--train-prompts", "1"]


@pytest.fixture(scope="module")
def paper_model(tmp_path_factory, small_traces) -> Path:
    """A cost model fitted on a paper-profile set: 128 experts, top-8, 48 layers, kmax 6."""
    path = tmp_path_factory.mktemp("cm") / "paper.json"
    res = run_cli(["fit", small_traces, "--out", path])
    assert res.exit_code == 0, res.stderr
    return path


def _edited(src: Path, dst: Path, **fields: object) -> Path:
    obj = json.loads(src.read_text())
    obj.update(fields)
    dst.write_text(json.dumps(obj))
    return dst


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path: Path) -> None:
    """Each case snapshots a cache of its own (other xdist workers write into the session's)."""
    private_cache(monkeypatch, tmp_path / "cache")


def _roots(tmp_path: Path) -> list[Path]:
    cache = cache_dir()
    return [tmp_path, *([cache / "vllm-models"] if cache is not None else [])]


def test_serve_refuses_a_cost_model_of_other_routing(tmp_path, paper_model):
    reject_cleanly(
        [*SERVE, "--cost-model", paper_model], ["--cost-model", str(paper_model), "top_k", "8", "4"], _roots(tmp_path)
    )


def test_serve_refuses_a_cost_model_of_128_experts(tmp_path, paper_model):
    cm = _edited(paper_model, tmp_path / "cm.json", top_k=4, n_layers=6)
    reject_cleanly([*SERVE, "--cost-model", cm], ["--cost-model", "n_experts", "128", "64"], _roots(tmp_path))


def test_serve_refuses_a_cost_model_of_fewer_budgets(tmp_path, paper_model):
    cm = _edited(paper_model, tmp_path / "cm.json", top_k=4, n_layers=6, n_experts=64)
    reject_cleanly(
        [*SERVE, "--kmax", "8", "--cost-model", cm],
        ["--cost-model", "kmax", "6", "num_speculative_tokens=8"],
        _roots(tmp_path),
    )


@pytest.mark.parametrize("fallback", ["9", "20"])
def test_serve_refuses_a_fallback_above_the_drafted_tokens(tmp_path, fallback):
    reject_cleanly(
        [*SERVE, "--kmax", "8", "--fallback-k", fallback],
        ["--fallback-k", fallback, "num_speculative_tokens=8"],
        _roots(tmp_path),
    )


def test_serve_refuses_a_fallback_above_the_users_speculative_config(tmp_path):
    spec = json.dumps({"method": "draft_model", "model": "d", "num_speculative_tokens": 3})
    args = [
        "serve",
        "--policy",
        "none",
        "--print-command",
        "--fallback-k",
        "5",
        "--",
        "m",
        "--speculative-config",
        spec,
    ]
    reject_cleanly(args, ["--fallback-k", "5", "num_speculative_tokens=3"], _roots(tmp_path))


def test_serve_accepts_a_matching_cost_model_and_fallback(tmp_path, paper_model):
    cm = _edited(paper_model, tmp_path / "cm.json", top_k=4, n_layers=6, n_experts=64, kmax=6)
    res = run_cli([*SERVE, "--kmax", "6", "--fallback-k", "6", "--cost-model", cm])
    assert res.exit_code == 0, res.stderr
    assert "num_speculative_tokens" in res.stdout


def test_abtest_refuses_a_trace_set_of_another_model(tmp_path):
    reject_cleanly([*ABTEST, "--traces", "paper-default"], ["--traces", "paper-default", "top_k"], _roots(tmp_path))


def _live_copy(tmp_path: Path, **extra: object) -> Path:
    dst = tmp_path / "set"
    shutil.copytree(LIVE_VLLM, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for k, v in extra.items():
        if v is None:
            manifest["extra"].pop(k, None)
        else:
            manifest["extra"][k] = v
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_abtest_refuses_a_trace_set_of_another_model_set(tmp_path):
    traces = _live_copy(tmp_path, models={"name": "other-moe", "version": 3})
    reject_cleanly([*ABTEST, "--traces", traces], ["--traces", "other-moe-v3", "small-moe-v1"], _roots(tmp_path))


def test_abtest_refuses_a_trace_set_without_prompts(tmp_path):
    traces = _live_copy(tmp_path, prompt_set=None)
    reject_cleanly([*ABTEST, "--traces", traces], ["--traces", "prompt_set"], _roots(tmp_path))


def test_abtest_refuses_a_cost_model_of_other_routing(tmp_path, paper_model):
    reject_cleanly(
        [*ABTEST, "--traces", LIVE_VLLM, "--cost-model", paper_model],
        ["--cost-model", str(paper_model), "top_k"],
        _roots(tmp_path),
    )
