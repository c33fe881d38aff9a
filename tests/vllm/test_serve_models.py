"""`specenv serve --models small-moe-v1`: the shipped set served as the README says, through the OpenAI client.

One engine start: a completion and a chat completion (the view's chat template), both greedy and
non-empty, with speculative decoding running (vLLM's spec-decode counters move), then SIGTERM and a
clean exit. The server's environment lacks ``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CPU_OMP_THREADS_BIND``
(conftest sets both for the in-process engines): ``specenv serve`` must set them itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a live vLLM engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.load_test import Server  # noqa: E402  - the load test's server process, on loopback
from specenv.engines.vllm.models import vllm_model_dirs  # noqa: E402

KMAX = 3
MAX_TOKENS = 24
UNSET = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")


def _drafts(port: int) -> float:
    """vLLM's counter of drafted tokens (Prometheus text of ``/metrics``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:spec_decode_num_draft_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def test_serve_models_answers_completion_and_chat_then_exits_on_sigterm(tmp_path):
    log = tmp_path / "server.log"
    specenv_bin = Path(sys.executable).parent / "specenv"
    cmd = [
        str(specenv_bin),
        "serve",
        "--models",
        "small-moe-v1",
        "--policy",
        "ucb",  # a registered policy, built by the controller for the served model
        "--kmax",
        str(KMAX),
        "--",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-num-seqs",
        "2",
        "--seed",
        "0",
    ]
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    sep = cmd.index("--")
    printed = subprocess.run(
        [*cmd[:sep], "--print-command", *cmd[sep:]], env=env, capture_output=True, text=True, timeout=120
    )
    assert printed.returncode == 0, printed.stderr
    line = printed.stdout.strip()
    assert "VLLM_CPU_KVCACHE_SPACE=" in line and "VLLM_CPU_OMP_THREADS_BIND=nobind" in line, line
    assert '"num_speculative_tokens": 3' in line and "--served-model-name small-moe-v1" in line, line

    t0 = time.monotonic()
    srv = Server(cmd, log, env=env)  # appends --host 127.0.0.1 --port, a session of its own
    proc, port = srv.proc, srv.port
    try:
        srv.wait_ready()
        start_s = time.monotonic() - t0
        text = log.read_text()
        assert re.search(r"VLLM_CPU_KVCACHE_SPACE=[1-4] \(set by specenv serve", text), text[-4000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120)
        assert [m.id for m in client.models.list().data] == ["small-moe-v1"]

        t1 = time.monotonic()
        comp = client.completions.create(
            model="small-moe-v1", prompt="def fibonacci(n):\n    return", max_tokens=MAX_TOKENS, temperature=0
        )
        comp_s = time.monotonic() - t1
        assert comp.choices[0].text.strip(), comp
        assert 0 < comp.usage.completion_tokens <= MAX_TOKENS
        again = client.completions.create(
            model="small-moe-v1", prompt="def fibonacci(n):\n    return", max_tokens=MAX_TOKENS, temperature=0
        )
        assert again.choices[0].text == comp.choices[0].text  # greedy: the same text twice

        chat = client.chat.completions.create(
            model="small-moe-v1",
            messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert chat.choices[0].message.content, chat
        assert chat.choices[0].message.role == "assistant"
        # the ChatML-style template of the view was applied: the prompt holds its markers
        assert chat.usage.prompt_tokens > len("Write a Python function that adds two numbers.") // 8
        assert _drafts(port) > 0  # the draft model ran: --speculative-config was built by --models
        print(f"\nengine start {start_s:.1f} s; completion of {comp.usage.completion_tokens} tokens {comp_s:.2f} s")
        print(f"completion {comp.choices[0].text!r}\nchat {chat.choices[0].message.content!r}")

        t2 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        assert rc == 0, log.read_text()[-4000:]
        print(f"SIGTERM -> exit {time.monotonic() - t2:.1f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_view_has_a_chat_template():
    """The view ``vllm_model_dirs`` writes carries the ChatML-style template (no engine needed)."""
    from transformers import AutoTokenizer

    dirs = vllm_model_dirs("small-moe-v1")
    tok = AutoTokenizer.from_pretrained(str(dirs.target))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert dirs.name == "small-moe-v1"
