"""The paper's models on a GPU: ``specenv collect --engine vllm`` on Qwen3-Coder-30B-A3B + its EAGLE-3 head.

A thin wrapper over the one vLLM collector (:func:`specenv.engines.vllm.collect.collect_vllm`, the code
of ``specenv collect --engine vllm --device cuda --method eagle3 --target DIR --draft DIR``): greedy
reference with warm-up, the plain engine's measured AR baseline, fixed-K rounds K = 0..kmax and the
positions table, written as one trace set (schema v2) to ``OUT/``. What it adds: the paper's models
as defaults (Hugging Face hub ids are downloaded with ``huggingface_hub`` unless they are folders)
and, with ``--ray [ADDRESS] --gpus N`` (the ray extra), the prompts cut into N consecutive shards,
each collected by a Ray actor holding one GPU (:func:`policies.distributed.ray_shards`), merged into
one set (:func:`specenv.engines.merge.merge_sets`; generation ids are the prompts' ids).

Not run in CI (needs a GPU with ~80 GB, a CUDA build of vLLM 0.32 and the two models)::

    pip install 'specenv[vllm]'
    python scripts/collect_vllm_gpu.py --prompts stdlib-code-v1 --out collection/ [-n 64] [--ray --gpus 8]

``--prompts``: a shipped prompt set or a JSON file ``{"prompts": [{"id": 0, "category": "coding",
"text": "..."}, ...]}``. Decoding is greedy (the positions table's verdicts are the target's argmax), or
sampled with ``--temperature 0.7 --seed S`` (rho = min(1, p/q) of draft chains drawn at T; every shard
draws with the same seed, per generation id; not run on a GPU yet: the tempered ``compute_logits``
wrappers of the collector assume it runs outside CUDA graphs, as on vLLM's V1 runner).
"""

from __future__ import annotations

import argparse
from pathlib import Path

TARGET = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
EAGLE3 = "lmsys/SGLang-EAGLE3-Qwen3-Coder-30B-A3B-Instruct-SpecForge"


def local_folder(name: str) -> str:
    """A model folder: ``name`` itself when it is one, else its Hugging Face hub snapshot (downloaded)."""
    if Path(name).is_dir():
        return name
    from huggingface_hub import snapshot_download

    return snapshot_download(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="stdlib-code-v1", help="shipped prompt-set name or prompt JSON file")
    ap.add_argument("--out", required=True, help="output trace-set folder")
    ap.add_argument("-n", "--n-prompts", type=int, default=0, help="only the first N prompts (0 = all)")
    ap.add_argument("--target", default=TARGET, help="target folder or hub id")
    ap.add_argument("--draft", default=EAGLE3, help="draft folder or hub id")
    ap.add_argument("--method", default="eagle3", choices=("eagle3", "draft_model"))
    ap.add_argument("--kmax", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=1000)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--name", default="vllm-qwen3-coder-30b-a3b-eagle3")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy; T > 0 (the paper: 0.7) = a sampled set, rho = min(1, p/q) (traces/README.md)",
    )
    ap.add_argument("--seed", type=int, default=0, help="with --temperature > 0: seed of the sampling")
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
    args = ap.parse_args()

    from specenv.engines.hf.models import load_prompts
    from specenv.engines.vllm.collect import collect_vllm
    from specenv.engines.vllm.models import vllm_pair_dirs

    prompts = load_prompts(args.prompts)[: args.n_prompts or None]
    dirs = vllm_pair_dirs(local_folder(args.target), local_folder(args.draft), args.method)
    common = {
        "kmax": args.kmax,
        "max_new_tokens": args.max_new_tokens,
        "prompt_set": args.prompts,
        "device": "cuda",
        "clock": "wall",
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    if args.temperature > 0:  # a greedy collection passes what it always passed
        common |= {"temperature": args.temperature, "seed": args.seed}
    if args.ray_address is None:
        ts = collect_vllm(dirs, prompts, name=args.name, **common)
    else:
        from policies.distributed import ray_cluster, ray_shards, shard
        from specenv.engines.merge import merge_sets

        with ray_cluster(args.ray_address):
            kwargs = [
                {"models": dirs, "prompts": part, "name": f"{args.name}-shard{i}", **common}
                for i, part in enumerate(shard(prompts, args.gpus))
                if part
            ]
            sets = ray_shards(collect_vllm, kwargs, num_gpus=1.0)
        ts = merge_sets(sets, name=args.name)
    out = ts.save(args.out)
    print(f"wrote {out}: {ts.manifest.counts}; next: specenv fit {out}")


if __name__ == "__main__":
    main()
