"""scripts/load_test.py without a server: how outcomes are judged, the percentiles, the arms' commands, the prompts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lt():
    spec = importlib.util.spec_from_file_location("load_test_script", ROOT / "scripts" / "load_test.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _req(lt, i, outcome, text="", sent=0.0, done=1.0, **kw):
    r = lt.Request(i, 0, "completions", sent_at=sent, outcome=outcome, text=text, done_at=done, **kw)
    return r


def test_judge_refusal_counts_only_after_sigterm(lt):
    ref = {(0, "completions"): "abc"}
    reqs = [
        _req(lt, 0, "finished", "abc"),
        _req(lt, 1, "finished", "abd"),
        _req(lt, 2, "refused", sent=4.0, done=4.5, error="HTTP 503"),  # answered after the signal at t = 4
        _req(lt, 3, "refused", sent=1.0, done=2.0, error="HTTP 503"),  # refused before it: a loss
        _req(lt, 4, "lost"),
        _req(lt, 5, "not sent", sent=0.0, done=None),
    ]
    lt.judge(reqs, ref, t_term=4.0)
    assert [r.outcome for r in reqs] == ["ok", "mismatch", "refused", "lost", "lost", "not sent"]
    assert [r.after_sigterm for r in reqs] == [False, False, True, False, False, False]
    assert reqs[3].error.startswith("refused without a SIGTERM")
    # no SIGTERM at all: any refusal is a loss
    again = [_req(lt, 0, "refused", error="APIConnectionError")]
    lt.judge(again, ref, t_term=None)
    assert again[0].outcome == "lost"


def test_summary_percentiles_and_throughput(lt):
    reqs = []
    for i, (ttft, tpot, e2e) in enumerate([(0.1, 0.01, 1.0), (0.2, 0.02, 2.0), (0.3, 0.03, 3.0), (0.4, 0.04, 4.0)]):
        reqs.append(_req(lt, i, "ok", tokens=10, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e))
    reqs.append(_req(lt, 4, "lost", tokens=5, ttft_s=9.0, e2e_s=9.0))  # not counted in tokens/latency
    s = lt.summary(reqs, wall_s=4.0)
    assert s["ok"] == 4 and s["lost"] == 1 and s["mismatch"] == 0
    assert s["tok_per_s"] == pytest.approx(40 / 4.0)
    # numpy's linear percentile of 100, 200, 300, 400 ms: p50 = 250, p99 = 397
    assert s["ttft_ms_p50"] == pytest.approx(250.0) and s["ttft_ms_p99"] == pytest.approx(397.0)
    assert s["tpot_ms_p50"] == pytest.approx(25.0) and s["e2e_ms_p99"] == pytest.approx(3970.0)
    assert lt.summary([_req(lt, 0, "lost")], 1.0)["ttft_ms_p50"] is None


def test_stock_arms_commands(lt, monkeypatch):
    from specenv.engines.vllm.models import vllm_model_dirs

    try:
        dirs = vllm_model_dirs("small-moe-v1")
    except ValueError:
        pytest.skip("needs the shipped small-moe-v1 models")
    plain = lt.stock_command("small-moe-v1", 0, 16, [])
    spec2 = lt.stock_command("small-moe-v1", 2, 4, ["--max-model-len", "512"])
    for cmd in (plain, spec2):
        assert "--scheduler-cls" not in cmd and "--middleware" not in cmd  # stock: no specenv code
        assert "--no-async-scheduling" in cmd and cmd[cmd.index("--model") + 1] == str(dirs.target)
        assert cmd[cmd.index("--shutdown-timeout") + 1] == "30"
    assert "--speculative-config" not in plain and plain[plain.index("--max-num-seqs") + 1] == "16"
    sc = json.loads(spec2[spec2.index("--speculative-config") + 1])
    assert sc == {"method": "draft_model", "model": str(dirs.draft), "num_speculative_tokens": 2}
    assert spec2[spec2.index("--max-model-len") + 1] == "512"  # the user's vLLM arguments reach it
    # the learned arm goes through specenv serve with the policy
    srv_cmd = lt.serve_command("policies/shipped/live-vllm-v1/ppo", "small-moe-v1", 16, [], None)
    assert srv_cmd[srv_cmd.index("--policy") + 1] == "policies/shipped/live-vllm-v1/ppo"
    # an arm may carry more specenv serve options: before the --, after the policy
    opt_cmd = lt.serve_command("fixed-k:k=2 --kmax 2 --draft-horizon policy", "small-moe-v1", 4, [], None)
    assert opt_cmd[opt_cmd.index("--policy") + 1 : opt_cmd.index("--")] == [
        "fixed-k:k=2",
        "--kmax",
        "2",
        "--draft-horizon",
        "policy",
    ]
    # the stock environment is what specenv serve sets (here on CPU): threads unpinned, a KV-cache size
    from specenv.engines.vllm import settings as vs

    monkeypatch.setattr(vs, "vllm_on_cpu", lambda dist: True)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # another test of the worker may have set it
    env = lt.stock_env(plain)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1


def test_prompts_skip_the_train_split(lt):
    from specenv.engines.hf.models import load_prompts
    from specenv.traces.datasets import load_dataset

    try:
        gids = load_dataset("live-vllm").positions["generation_id"]
    except (ValueError, FileNotFoundError):
        pytest.skip("needs the shipped live-vllm trace set")
    ids, texts = lt.load_prompt_texts("stdlib-code-v1", 6, "live-vllm")
    by_id = {p.id: p.text for p in load_prompts("stdlib-code-v1")}
    assert texts == [by_id[i] for i in ids] and ids == sorted(ids) and len(set(ids)) == 6
    # the shipped set's split: 13 of its 16 generations train, 3 held out (policies/shipped/README.md)
    collected = set(np.unique(gids).tolist())
    held = [i for i in ids if i in collected]
    assert len(held) == 3 and len(collected) == 16
    assert all(i not in collected for i in ids if i not in held) and min(set(ids) - collected) == max(collected) + 1
    # without a trace set: the set's first prompts
    assert lt.load_prompt_texts("stdlib-code-v1", 3, None)[0] == [0, 1, 2]
    with pytest.raises(ValueError, match="only"):
        lt.load_prompt_texts("stdlib-code-v1", 10_000, "live-vllm")


def test_sigterm_level_waits_for_the_first_half_and_holds_the_second(lt, monkeypatch):
    """on_half runs once every request of the first half streams; no later request is sent before it returned."""
    import threading
    import time
    import types

    monkeypatch.setitem(sys.modules, "openai", types.SimpleNamespace(OpenAI=lambda **kw: object()))
    monkeypatch.setattr(lt, "model_name", lambda url: "m")
    events, lock = [], threading.Lock()

    def note(*e):
        with lock:
            events.append(e)

    def fake_send(client, model, prompts, req, max_tokens):
        req.sent_at = time.monotonic()
        note("sent", req.index)
        time.sleep(0.05 + 0.03 * (req.index % 3))  # accepted and streaming a little later, not all at once
        req.first_token_at = time.monotonic()
        note("streaming", req.index)
        time.sleep(0.2)
        req.outcome, req.done_at = "finished", time.monotonic()

    monkeypatch.setattr(lt, "send", fake_send)
    lt.run_level("http://x/v1", ["a"], 8, 8, 4, time_limit=60.0, on_half=lambda: note("sigterm", None))
    at = events.index(("sigterm", None))
    assert [e for e in events if e[0] == "sigterm"] == [("sigterm", None)]
    before = events[:at]
    assert {i for kind, i in before if kind == "sent"} == {0, 1, 2, 3}  # the first half, nothing of the second
    assert {i for kind, i in before if kind == "streaming"} == {0, 1, 2, 3}  # all of it streaming at the signal
    assert {i for kind, i in events[at + 1 :] if kind == "sent"} == {4, 5, 6, 7}
