"""How alike identical engines time, with and without huge pages (specenv.engines.vllm.hugepages).

Starts ``--engines`` identical plain vLLM engines (the target alone, batch 1, greedy) in one child
process per page mode, decodes the same prompts on each, interleaved with the order rotated every
repeat, and prints each engine's mean step time and the spread (max - min) / mean, first with the
kernel's default pages (``SPECENV_HUGEPAGES=0``), then with the weights on huge pages. Both modes are
measured in the same run; run it on a quiet machine (it prints the load average).

Usage::

    python scripts/engine_spread.py                                  # wide-moe-v1, 3 engines (~4 min)
    python scripts/engine_spread.py --models small-moe-v1 --engines 2 --prompts 2 --tokens 16

Needs vLLM (``.venv-vllm``) and, for wide-moe-v1, ``specenv models --build wide-moe-v1``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """One page mode: build the engines, time them, print one JSON line."""
    import gc

    import numpy as np
    from tokenizers import Tokenizer

    from specenv.engines.hf.models import load_prompts
    from specenv.engines.vllm import hugepages
    from specenv.engines.vllm.bench import build_llm
    from specenv.engines.vllm.collect import plain_steps
    from specenv.engines.vllm.models import vllm_model_dirs

    engines = [build_llm({"models": args.models, "k": 0, "controller": False}) for _ in range(args.engines)]
    advised = [hugepages.advise_engine(e) for e in engines]
    tok = Tokenizer.from_file(str(vllm_model_dirs(args.models).target / "tokenizer.json"))
    enc = [tok.encode(p.text).ids for p in load_prompts("stdlib-code-v1")[: args.prompts]]
    for e in engines:
        plain_steps(e, enc[0], list(range(8)))  # warm-up
    gc.disable()
    means: dict[int, list[float]] = {i: [] for i in range(args.engines)}
    for rep in range(args.repeats):
        for ids in enc:
            for j in range(args.engines):
                i = (j + rep) % args.engines
                _, ms, _ = plain_steps(engines[i], ids, list(range(args.tokens)))
                means[i].append(float(np.mean(ms)))
    print(
        json.dumps(
            {
                "hugepages": hugepages.enabled(),
                "step_ms": [float(np.mean(v)) for v in means.values()],
                "advised_mb": [a["bytes"] / 2**20 for a in advised],
                "pages": hugepages.backing(),
                "load": os.getloadavg(),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="wide-moe-v1")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from specenv.engines.vllm.bench import engine_env

    rows = []
    for mode in ("0", "1"):
        env = engine_env({**os.environ, "SPECENV_HUGEPAGES": mode})
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not lines:
            sys.exit(f"engine_spread: the child with SPECENV_HUGEPAGES={mode} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(lines[-1]))
    print(f"{args.engines} identical plain engines of {args.models}, {args.prompts} prompts x {args.tokens} tokens x ")
    print(f"{args.repeats} interleaved repeats (order rotated), mean step time per engine:")
    for r in rows:
        ms = r["step_ms"]
        mean = sum(ms) / len(ms)
        label = "huge pages   " if r["hugepages"] else "default pages"
        print(
            f"  {label}: {' / '.join(f'{x:.2f}' for x in ms)} ms; spread {(max(ms) - min(ms)) / mean:.1%}; "
            f"mean {mean:.2f} ms; load {r['load'][0]:.2f}; THP {r['pages']['thp_mode']}"
        )
    off, on = (sum(r["step_ms"]) / len(r["step_ms"]) for r in rows)
    print(f"  huge pages / default pages, mean step time: {on / off:.3f}")


if __name__ == "__main__":
    main()
