"""`specenv serve` stopped by SIGTERM with requests in flight: all answered, recording complete, exit 0.

The OpenAI Python client (as a user's) sends completions and chat completions at once, more than the
server runs at a time (some wait in the scheduler); SIGTERM reaches the API server while they stream.
Every one of them finishes with its full length (completions: plain greedy's text), a request sent
after the signal is refused with HTTP 503 (the drain gate, :mod:`specenv.engines.vllm.drain`), the
server exits 0 within its grace period with no traceback in its log, and the recording holds every
round of every request.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a live vLLM server

from vhelpers import KMAX, MAX_TOKENS, PROMPTS  # noqa: E402

from specenv.engines.recorder import RUN_MANIFEST, load_recording, recording_status  # noqa: E402
from specenv.engines.vllm.drain import SHUTTING_DOWN_MESSAGE  # noqa: E402
from specenv.engines.vllm.settings import SHUTDOWN_TIMEOUT_S  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from scripts.load_test import TRACEBACK, Request, Server, send  # noqa: E402


def in_server(srv: Server) -> int:
    """Requests the engine holds (running + waiting), from the server's Prometheus metrics."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
        )
    )


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(model_dirs, plain_reference, tmp_path):
    rec, name = tmp_path / "rec", "served"
    cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'specenv'; from specenv.cli import main; main()"]
    cmd += ["serve", "--policy", "ucb", "--record", str(rec), "--"]
    cmd += [str(model_dirs.target), "--tokenizer", str(model_dirs.target), "--served-model-name", name]
    cmd += ["--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-num-seqs", "2"]
    cmd += ["--max-model-len", str(min(model_dirs.max_model_len, 1024))]
    spec = {"method": "draft_model", "model": str(model_dirs.draft), "num_speculative_tokens": KMAX}
    cmd += ["--speculative-config", json.dumps(spec)]
    cfg = json.loads((Path(model_dirs.target) / "tokenizer_config.json").read_text())
    if not cfg.get("chat_template"):  # the tiny random models have none
        cmd += ["--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"]
    srv = Server(cmd, tmp_path / "server.log")
    import openai

    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0, timeout=300)
        prompts = PROMPTS[:3]
        # one chat completion alone first: the sequential answer the concurrent ones must repeat
        alone = Request(-1, 0, "chat")
        send(client, name, prompts, alone, MAX_TOKENS)
        assert alone.outcome == "finished", alone
        # 3 completions + 3 chat completions at once; the server runs 2 at a time, the others wait
        reqs = [Request(i, i % 3, "chat" if i >= 3 else "completions") for i in range(6)]
        threads = [threading.Thread(target=send, args=(client, name, prompts, r, MAX_TOKENS)) for r in reqs]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        # SIGTERM once all six are in the server (2 running, 4 waiting) and the first is streaming
        while (in_server(srv) < len(reqs) or not any(r.first_token_at for r in reqs)) and time.monotonic() - t0 < 300:
            time.sleep(0.02)
        assert any(r.first_token_at for r in reqs), "no request started streaming"
        srv.sigterm()  # to the API server (`specenv serve`), as a process manager sends it
        while srv.proc.poll() is None and time.monotonic() - srv.t_term < 1.0:
            time.sleep(0.01)
        late = Request(6, 0, "completions")
        send(client, name, prompts, late, MAX_TOKENS)  # sent after the signal: refused, cleanly
        for t in threads:
            t.join(timeout=SHUTDOWN_TIMEOUT_S + 60)
        stopped = srv.stop(timeout=SHUTDOWN_TIMEOUT_S + 60)
    finally:
        srv.kill()
    text = srv.log.read_text(errors="replace")
    started = sum(r.first_token_at is not None and r.first_token_at < srv.t_term for r in reqs)
    print(
        f"SIGTERM with {started} streaming and {6 - started} waiting; exit {stopped.rc} after {stopped.seconds:.1f} s"
    )
    assert stopped.rc == 0, text[-6000:]
    assert TRACEBACK not in text and "EngineDeadError" not in text, text[-6000:]
    assert "force killing" not in text, text[-6000:]  # the engine core stopped within its grace period
    assert stopped.seconds < SHUTDOWN_TIMEOUT_S, stopped
    # every request accepted before the signal ran to its full length; completions equal plain greedy
    for r in reqs:
        assert r.outcome == "finished" and r.finish_reason == "length" and r.tokens == MAX_TOKENS, r
        if r.api == "completions":
            assert r.text == plain_reference[prompts[r.prompt]]["text"], r
        elif r.prompt == 0:
            assert r.text == alone.text, r  # concurrent = sequential
    # the one sent after it: HTTP 503 with the gate's message, or no connection once the server had gone
    assert late.outcome == "refused", late
    assert late.error.startswith("APIConnectionError") or SHUTTING_DOWN_MESSAGE in late.error, late
    # the recording: closed after the last request, nothing half-written, every round of every request
    st = recording_status(rec)
    assert st["invalid"] == st["rejected"] == st["incomplete"] == [], st
    man = json.loads((rec / RUN_MANIFEST).read_text())
    assert man["summary"]["closed_by"] == "signal" and man["summary"]["rows"] == st["rows"], man["summary"]
    df = load_recording(rec).rounds
    assert df["generation_id"].nunique() == len(reqs) + 1  # and the one sent alone
    for rid, g in df.groupby("request_id"):
        g = g.sort_values("round")
        rounds, t, acc = list(g["round"]), list(g["t"]), list(g["accepted"])
        assert rounds == list(range(len(g))), rid  # every round, none twice
        assert t[0] == 1, rid  # the prefill gives token 1
        assert all(t[j + 1] == t[j] + acc[j] + 1 for j in range(len(g) - 1)), rid
        assert t[-1] < MAX_TOKENS <= t[-1] + acc[-1] + 1, rid  # the last round reaches the full length
