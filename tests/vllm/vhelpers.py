"""Constants and helpers shared by the vLLM tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
KMAX = 4
MAX_TOKENS = 48
PROMPTS = [
    "def fibonacci(n):\n    return",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(10):\n        print(",
    "# Copyright 2001 Python Software Foundation\n",
    "def test_parse(self):\n    self.assertEqual(",
]
#: The session's vLLM collection (``small_collection``): budgets, tokens and prompts, kept tiny.
COLLECT_KMAX = 4
COLLECT_TOKENS = 16
COLLECT_PROMPTS = 2


def collect_args(out, *models: str) -> list[str]:
    """``specenv collect --engine vllm`` arguments of the session's collection size, writing to ``out``."""
    n, k, tok = str(COLLECT_PROMPTS), str(COLLECT_KMAX), str(COLLECT_TOKENS)
    return ["collect", "--engine", "vllm", "--out", str(out), "-n", n, "--kmax", k, "--max-new-tokens", tok, *models]


def llm_kwargs(dirs, **extra):
    """Engine arguments shared by every engine of the tests."""
    kw = dict(
        model=str(dirs.target),
        tokenizer=str(dirs.target),
        dtype="float32",
        enforce_eager=True,
        max_model_len=min(dirs.max_model_len, 1024),
        seed=0,
        max_num_seqs=4,
        speculative_config={"method": "draft_model", "model": str(dirs.draft), "num_speculative_tokens": KMAX},
    )
    kw.update(extra)
    return kw


def controller_of(llm):
    """The SpecControlScheduler of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def spec_metrics(llm) -> dict[str, object]:
    """vLLM's spec-decode counters (cumulative over the engine's life)."""
    out: dict[str, object] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "values", None) if hasattr(m, "values") else m.value
    return out


def greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
