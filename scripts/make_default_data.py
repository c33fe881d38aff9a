"""Regenerate the shipped trace sets (specenv/data/<name>-v<version>) and print their registry hashes.

Usage:
    python scripts/make_default_data.py [--generations 128] [--seed 0]     # paper-default
    python scripts/make_default_data.py --live [--live-from live-cpu]       # live-cpu's positions
    python scripts/make_default_data.py --vllm --version 1 [--prompts 16]   # live-vllm (in .venv-vllm)

``paper-default`` is generated from scratch (trace schema v2: the generator's entropy and margin
come from their own random stream, so every other column is the same as in v1 for the same seed).
``--live`` re-collects the positions table of the live set with the live CPU engine
(:func:`specenv.engines.hf.collect.recollect_positions`): its rounds stay, rho/q/U are kept bit for
bit after the sweep has reproduced them, and the schema-v2 columns are added.
``--vllm`` collects ``live-vllm`` with vLLM itself (:func:`specenv.engines.vllm.collect.collect_vllm`:
fixed-K rounds K=0..8 and the counterfactual positions; the first ``--prompts`` prompts of the shipped
prompt set x 128 tokens); it needs the vLLM extra.

After running, put the printed manifest sha256 into specenv/traces/datasets.py (REGISTRY), with the new
version and folder when the content changed, remove the old folder and update traces/README.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specenv.generator import generate_paper
from specenv.progress import Progress
from specenv.traces.datasets import install_dataset_files, load_dataset

DATA = Path(__file__).resolve().parents[1] / "specenv" / "data"

ap = argparse.ArgumentParser()
ap.add_argument("--generations", type=int, default=128)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--version", type=int, default=2, help="version written to the manifest and the folder name")
ap.add_argument("--folder", default=None, help="folder under specenv/data (default: <name>-v<version>)")
ap.add_argument("--live", action="store_true", help="re-collect live-cpu's positions instead of paper-default")
ap.add_argument("--live-from", default="live-cpu", help="the live set whose positions are re-collected")
ap.add_argument("--vllm", action="store_true", help="collect live-vllm with vLLM (needs the vllm extra)")
ap.add_argument("--prompts", type=int, default=16, help="prompts of live-vllm")
args = ap.parse_args()

if args.vllm:
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from specenv.engines.vllm.collect import collect_vllm

    with Progress("collect", unit="stages") as prog:
        ts = collect_vllm(
            n_prompts=args.prompts,
            kmax=8,
            max_new_tokens=128,
            name="live-vllm",
            progress=lambda d, t: prog.update(d, t),
        )
    print(json.dumps({k: ts.manifest.extra[k] for k in ("wall_seconds", "lossless", "near_ties")}))
    name = "live-vllm"
elif args.live:
    from specenv.engines.hf.collect import recollect_positions

    old = load_dataset(args.live_from, cache=False)
    c0 = time.process_time()
    ts, report = recollect_positions(old, progress=lambda d, n: print(f"  {d}/{n}", flush=True) if d % 8 == 0 else None)
    print(json.dumps(report))
    print(f"cpu seconds: {time.process_time() - c0:.1f}")
    name = "live-cpu"
else:
    with Progress("generate", total=args.generations, unit="generations") as prog:
        ts = generate_paper(
            args.generations, 10, seed=args.seed, name="paper-default", progress=lambda d, t: prog.update(d, t)
        )
    name = "paper-default"
ts.manifest.version = args.version
dest = DATA / (args.folder or f"{name}-v{args.version}")
sha = install_dataset_files(ts, dest)
size = sum(p.stat().st_size for p in dest.iterdir())
print(f"{dest}: {ts.manifest.counts}, {size / 1e6:.2f} MB")
print(f"manifest_sha256={sha}")
