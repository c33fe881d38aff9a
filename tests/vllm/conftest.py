"""Fixtures of the vLLM integration tests (run in the ``.venv-vllm`` environment: ``make test-vllm``).

Every test module here starts with ``pytest.importorskip("vllm.v1.core.sched.scheduler")`` (a module
only the real vLLM has: with ``tests/`` on ``sys.path`` a bare ``import vllm`` would find this folder as
a namespace package), so the main environment's pytest skips them.

Models: the shipped ``small-moe-v1`` set (trained Qwen3-MoE target, 64 experts, top-4, and dense
draft) when present; otherwise, or with ``SPECENV_VLLM_TEST_MODELS=tiny``, the tiny random pair of
:mod:`specenv.engines.vllm.tinymodels`, built once per session (no download either way).

One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is shared by the session: tests swap
its policy and recording through the controller, which keeps the number of vLLM start-ups small.
A plain greedy engine (no speculation) runs once in a subprocess, started at the beginning, to give
the reference outputs. ``small_collection`` is the session's ``specenv collect --engine vllm`` on the
shipped set (its engines stay alive for the session, like every in-process engine here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# vLLM's CPU worker pins its OpenMP threads to cores by default; on a shared machine a busy process on
# the same core makes every step wait (measured here: 85 ms instead of 1.6 ms per target pass).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from vhelpers import HERE, KMAX, MAX_TOKENS, PROMPTS, collect_args  # noqa: E402


def _use_shipped() -> bool:
    choice = os.environ.get("SPECENV_VLLM_TEST_MODELS", "auto")
    if choice != "auto":
        return choice == "shipped"
    return _shipped()


def _shipped() -> bool:
    from specenv.engines.hf.models import model_dir

    try:
        model_dir("small-moe-v1")
    except ValueError:
        return False
    return True


@pytest.fixture(scope="session")
def small_collection(tmp_path_factory):
    """``specenv collect --engine vllm --models small-moe-v1`` at ``vhelpers.collect_args``'s size: (folder, set)."""
    if not _shipped():
        pytest.skip("needs the shipped small-moe-v1 models")
    from typer.testing import CliRunner

    from specenv.cli import app
    from specenv.traces.traceset import TraceSet

    out = tmp_path_factory.mktemp("vcollect") / "set"
    res = CliRunner().invoke(app, [*collect_args(out, "--models", "small-moe-v1"), "--json"])
    assert res.exit_code == 0, res.output
    return out, TraceSet.load(out)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory):
    """vLLM-ready target/draft folders (the shipped set if present, else tiny random models)."""
    from specenv.engines.vllm.models import vllm_model_dirs

    if _use_shipped():
        return vllm_model_dirs("small-moe-v1")
    from specenv.engines.vllm.tinymodels import build_tiny_models

    root = tmp_path_factory.mktemp("tiny-models")
    build_tiny_models(root)
    return vllm_model_dirs(root)


@pytest.fixture(scope="session")
def plain_reference_proc(model_dirs, tmp_path_factory):
    """Start the plain greedy reference (no speculation, stock scheduler) in a subprocess."""
    out = tmp_path_factory.mktemp("plain") / "reference.json"
    args = {
        "model": str(model_dirs.target),
        "max_model_len": min(model_dirs.max_model_len, 1024),
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "out": str(out),
    }
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 - closed by the consumer fixture
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_plain_greedy.py"), json.dumps(args)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    log.close()


@pytest.fixture(scope="session")
def plain_reference(plain_reference_proc):
    """Prompt -> token ids and text of plain greedy vLLM (waits for the subprocess)."""
    proc, out = plain_reference_proc
    rc = proc.wait(timeout=900)
    assert rc == 0, out.with_suffix(".log").read_text()[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def backend(model_dirs, plain_reference_proc):
    """The shared in-process engine: a VLLMBackend (controller without policy, routing tap bound)."""
    from specenv.engines.vllm import SpecenvSettings
    from specenv.engines.vllm.live import VLLMBackend

    be = VLLMBackend.shared(
        model_dirs.source,
        kmax=KMAX,
        max_new_tokens=MAX_TOKENS,
        stop_at_eos=False,
        settings=SpecenvSettings(record_tokens=True),
        max_num_seqs=4,
        disable_log_stats=False,
        max_model_len=min(model_dirs.max_model_len, 1024),
    )
    yield be
    be.close()


@pytest.fixture
def engine(backend):
    """The shared engine's ``vllm.LLM`` (any generation the backend left running is aborted first)."""
    backend.abort()
    return backend.llm
