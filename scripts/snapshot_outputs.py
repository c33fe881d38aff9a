"""Run the commands whose outputs a refactor must not change, and keep every output in one folder.

A change that should move no result (a redesign, a speed-up) is checked by running this script on
the commit before and after it and comparing the two folders byte for byte::

    python scripts/snapshot_outputs.py /tmp/before --checkout /path/to/old/clone
    python scripts/snapshot_outputs.py /tmp/after
    diff -r /tmp/before /tmp/after   # or: python scripts/snapshot_outputs.py --compare /tmp/before /tmp/after

Each command runs as ``specenv ...`` of the checkout (``specenv.cli:main`` with the checkout first on
``sys.path``) with a fresh cost-model cache; its standard output (the JSON of ``--json``) is kept as
``<name>.json`` and the files it writes under ``--out`` as ``<name>/``. ``--quick`` runs one set only.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SETS = ("paper-default", "live-cpu", "live-vllm")


# (name, argv after `specenv`, writes files under --out)
def commands(quick: bool) -> list[tuple[str, list[str], bool]]:
    sets = SETS[:1] if quick else SETS
    cmds: list[tuple[str, list[str], bool]] = []
    for s in sets:
        cmds.append((f"fit-{s}", ["fit", s, "--json"], False))
        for mode, extra in (("none", []), ("block", ["--lookahead", "3"]), ("sequential", [])):
            cmds.append((f"oracle-{s}-{mode}", ["oracle", s, "--drafting", mode, *extra, "--json"], False))
        cmds.append((f"oracle-{s}-sweep", ["oracle", s, "--sweep", "--delta", "--json"], False))
        cmds.append((f"bench-{s}", ["bench", s, "--json"], True))
        cmds.append((f"bench-{s}-batch4", ["bench", s, "--batch", "4", "--episodes", "2", "--json"], True))
    if not quick:
        cmds.append(("fit-batch-default", ["fit-batch", "--json"], False))
        cmds.append(("bench-caps-live-cpu-caps", ["bench-caps", "live-cpu-caps", "--json"], True))
    return cmds


def run(out: Path, checkout: Path, quick: bool, only: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(checkout), SPECENV_QUIET="1")
    launcher = "import sys; sys.argv[0] = 'specenv'; from specenv.cli import main; main()"
    failed = 0
    with tempfile.TemporaryDirectory() as cache:
        env["SPECENV_CACHE"] = cache
        for name, argv, writes in commands(quick):
            if only and not any(o in name for o in only):
                continue
            files = out / name
            if writes:
                argv = [*argv, "--out", str(files)]
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-c", launcher, *argv], cwd=checkout, env=env, capture_output=True, text=True
            )
            (out / f"{name}.json").write_text(proc.stdout)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
            failed += proc.returncode != 0
            print(f"{name}: {status} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


# Wall-clock figures of a run (keys, and "trained in 46 s" in notes) are the only expected differences.
CLOCK_KEYS = ("seconds", "elapsed", "wall")
CLOCK_TEXT = re.compile(r"\b(in|took) [0-9.]+ ?s\b")


def _without_clock(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _without_clock(v) for k, v in obj.items() if not any(c in k for c in CLOCK_KEYS)}
    if isinstance(obj, list):
        return [_without_clock(v) for v in obj]
    if isinstance(obj, str):
        return CLOCK_TEXT.sub(r"\1 <clock> s", obj)
    return obj


def _same(fa: Path, fb: Path) -> bool:
    """Byte-identical, or JSON identical once the wall-clock figures are masked."""
    if filecmp.cmp(fa, fb, shallow=False):
        return True
    if fa.suffix != ".json":
        return False
    try:
        return _without_clock(json.loads(fa.read_text())) == _without_clock(json.loads(fb.read_text()))
    except ValueError:
        return False


def compare(a: Path, b: Path) -> int:
    """Print every file that differs (beyond wall-clock figures) or is missing on one side; exit 1 if any."""
    diffs: list[str] = []

    def walk(cmp: filecmp.dircmp, rel: str) -> None:
        diffs.extend(f"only in {a / rel}: {n}" for n in cmp.left_only)
        diffs.extend(f"only in {b / rel}: {n}" for n in cmp.right_only)
        diffs.extend(f"differs: {rel}/{n}" for n in cmp.diff_files if not _same(a / rel / n, b / rel / n))
        for name, sub in cmp.subdirs.items():
            walk(sub, f"{rel}/{name}")

    filecmp.clear_cache()
    walk(filecmp.dircmp(a, b, ignore=[]), ".")
    for d in diffs:
        print(d)
    print(f"{len(diffs)} difference(s)")
    return 1 if diffs else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, nargs="?", help="folder for the outputs")
    ap.add_argument("--checkout", type=Path, default=ROOT, help="checkout to run (default: this one)")
    ap.add_argument("--quick", action="store_true", help="paper-default only")
    ap.add_argument("--only", action="append", default=[], help="only commands whose name contains this")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two output folders")
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if args.out is None:
        ap.error("give the output folder (or --compare A B)")
    sys.exit(run(args.out.resolve(), args.checkout.resolve(), args.quick, args.only))


if __name__ == "__main__":
    main()
