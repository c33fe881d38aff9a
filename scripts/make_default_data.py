"""Regenerate the shipped default trace set (specenv/data/paper-default-v1) and print its registry hash.

Usage: python scripts/make_default_data.py [--generations 128] [--seed 0]
After running, put the printed manifest sha256 into specenv/datasets.py (REGISTRY) and bump the
version if the content changed.
"""

import argparse
from pathlib import Path

from specenv.datasets import install_dataset_files
from specenv.generator import generate_paper
from specenv.progress import Progress

ap = argparse.ArgumentParser()
ap.add_argument("--generations", type=int, default=128)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--folder", default="paper-default-v1")
args = ap.parse_args()
with Progress("generate", total=args.generations, unit="generations") as prog:
    ts = generate_paper(
        args.generations, 10, seed=args.seed, name="paper-default", progress=lambda d, t: prog.update(d, t)
    )
ts.manifest.version = 1
dest = Path(__file__).resolve().parents[1] / "specenv" / "data" / args.folder
sha = install_dataset_files(ts, dest)
size = sum(p.stat().st_size for p in dest.iterdir())
print(f"{dest}: {ts.manifest.counts}, {size / 1e6:.2f} MB")
print(f"manifest_sha256={sha}")
