"""Record batched vLLM steps (B = 1..8, per-request k) and fit the batch cost model on them.

Writes a folder (default ``specenv/data/live-vllm-batch-v1``) holding

* ``steps.parquet``: one row per pure engine step (:data:`specenv.engines.vllm.batchrec.STEP_COLUMNS`),
  recorded by :func:`specenv.engines.vllm.batchrec.record_batch_steps`;
* ``manifest.json``: format ``specenv.batchsteps/1``, the model facts, kmax, the settings, the machine's
  load during the run, and the sha256 of ``steps.parquet`` (checked by :func:`specenv.cost.batchfit.load_steps`);
* ``batchcost.json``: the batch cost model fitted on it (:func:`specenv.cost.batchfit.fit_batch_cost`), unless
  ``--no-fit``.

Run in the vLLM environment (CPU, the shipped small models, about two minutes)::

    python scripts/collect_vllm_batch.py --out /tmp/vllm-batch --replace

An existing folder is replaced only with ``--replace``, atomically (nothing half-written).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(_k, _v)
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "specenv" / "data" / "live-vllm-batch-v1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: the shipped set)")
    ap.add_argument("--replace", action="store_true", help="replace an existing folder")
    ap.add_argument("--models", default="small-moe-v1")
    ap.add_argument("--kmax", type=int, default=8, help="num_speculative_tokens (default 8, as live-vllm)")
    ap.add_argument("--batches", default="1,2,3,4,5,6,7,8", help="batch sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every batch size (interleaved)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-set", default="stdlib-code-v1")
    ap.add_argument("--prompt-ids", default="0-15", help="prompt ids, 'a-b' or comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fit", action="store_true", help="do not write batchcost.json")
    ap.add_argument(
        "--plain",
        action="store_true",
        help="also run every group on a plain engine (no drafter loaded), interleaved: the batch AR reference "
        "of the step-time model (manifest extra.ar_reference)",
    )
    ap.add_argument(
        "--fixed-share",
        type=float,
        default=0.0,
        help="share of groups served as a fixed k serves them (k uniform in 1..kmax per group, every step drafting "
        "k and every request verifying k; the rest: random draft lengths and budgets). Default 0",
    )
    ap.add_argument("--name", default="live-vllm-batch", help="the recording's name (manifest)")
    ap.add_argument(
        "--version", type=int, default=1, help="the recording's version (manifest; the folder is NAME-vVERSION)"
    )
    args = ap.parse_args(argv)

    from specenv.io import check_new_path

    try:
        batches = [int(b) for b in args.batches.split(",")]
        if "-" in args.prompt_ids:
            lo, hi = (int(x) for x in args.prompt_ids.split("-"))
            ids = list(range(lo, hi + 1))
        else:
            ids = [int(x) for x in args.prompt_ids.split(",")]
    except ValueError as exc:
        print(f"error: --batches/--prompt-ids: {exc}", file=sys.stderr)
        return 2
    if (
        not batches
        or min(batches) < 1
        or not 1 <= args.kmax <= 64
        or args.reps < 1
        or args.max_tokens < 2
        or args.version < 1
        or not 0.0 <= args.fixed_share <= 1.0
    ):
        print(
            "error: need batches >= 1, 1 <= --kmax <= 64, --reps >= 1, --max-tokens >= 2, --version >= 1, "
            "0 <= --fixed-share <= 1",
            file=sys.stderr,
        )
        return 2
    from specenv.cost.batchfit import STEPS_FORMAT, recording_format

    if os.path.lexists(args.out):
        if not args.replace:
            print(f"error: --out: {args.out}: already exists (pass --replace)", file=sys.stderr)
            return 2
        if recording_format(args.out / "manifest.json") != STEPS_FORMAT:
            print(f"error: --out: {args.out}: is not a steps recording: refusing to replace it", file=sys.stderr)
            return 2
    else:
        try:
            check_new_path(args.out)
        except OSError as exc:
            print(f"error: --out: {exc}", file=sys.stderr)
            return 2

    from specenv.engines.vllm.batchrec import PREFILL_COLUMNS, record_batch_steps, record_plain_steps, step_engines
    from specenv.engines.vllm.bench import encode_prompts
    from specenv.progress import Progress

    try:
        prompts = encode_prompts(args.models, ids, args.prompt_set)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    warm = [prompts[i % len(prompts)] for i in range(max(batches))]
    llm, plain_llm = step_engines(args.models, args.kmax, warm, plain=args.plain)
    startup = time.perf_counter() - t0
    # warm-up: one group at the largest batch, not kept
    record_batch_steps(llm, prompts, [max(batches)], 1, 16, args.kmax, seed=args.seed + 1000)
    plain_rows: list[dict] = []
    plain_prefill: list[dict] = []
    groups = iter(range(10**9))

    def plain_group(rep: int, B: int, chosen: list[list[int]]) -> None:
        if plain_llm is not None:  # the same prompts right after the speculative group: the same load
            plain_rows.extend(
                record_plain_steps(
                    plain_llm, chosen, args.max_tokens, f"rep{rep}", B, next(groups), prefill=plain_prefill
                )
            )

    load0 = os.getloadavg()
    t1 = time.perf_counter()
    with Progress("batch steps", total=args.reps * len(batches), unit="groups") as bar:
        steps, stats = record_batch_steps(
            llm,
            prompts,
            batches,
            args.reps,
            args.max_tokens,
            args.kmax,
            seed=args.seed,
            progress=bar.update,
            between=plain_group,
            fixed_share=args.fixed_share,
        )
    wall = time.perf_counter() - t1
    load1 = os.getloadavg()
    # every group's prefill phase on both engines (the time to the last request's first token)
    prefill = {"columns": list(PREFILL_COLUMNS), "rows": stats.pop("prefill") + plain_prefill}
    ctl = llm.llm_engine.engine_core.engine_core.scheduler
    import pandas as pd
    import vllm

    from specenv.cost.batchfit import summarize_plain_batch, write_steps

    model_facts = {"n_layers": ctl.tap.n_layers, "n_experts": ctl.n_experts, "top_k": ctl.top_k}
    plain_table = pd.DataFrame(plain_rows) if plain_llm is not None else None
    ar_reference = (
        summarize_plain_batch(plain_table, model_facts["n_experts"], model_facts["top_k"])
        if plain_table is not None
        else None
    )
    manifest = {
        "name": args.name,
        "version": args.version,
        "description": (
            f"vLLM {vllm.__version__} on CPU, {args.models}: groups of B = {args.batches} concurrent greedy requests "
            f"(ignore_eos, {args.max_tokens} tokens), {args.reps} interleaved repetitions; per step a random draft "
            f"length n in 1..{args.kmax} for the batch and a random k in 0..n per request"
            + (
                f" ({args.fixed_share:g} of the groups instead at a fixed k in 1..{args.kmax}: every step drafting k, "
                "every request verifying k; extra.fixed_groups); "
                if args.fixed_share
                else "; "
            )
            + "pure verification steps only; every group's prefill phase timed (extra.prefill)"
            + ("; every group also on a plain engine (the batch AR reference)." if args.plain else ".")
        ),
        "model": model_facts,
        "kmax": args.kmax,
        "max_batch": max(batches),
        "extra": {
            "collector": "specenv.engines.vllm.batchrec.record_batch_steps",
            "script": "scripts/collect_vllm_batch.py",
            "vllm": vllm.__version__,
            "models": args.models,
            "prompt_set": args.prompt_set,
            "prompt_ids": ids,
            "batches": batches,
            "reps": args.reps,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "fixed_share": args.fixed_share,
            **({"ar_reference": ar_reference} if ar_reference is not None else {}),
            "prefill": prefill,
            "startup_s": round(startup, 1),
            "wall_s": round(wall, 1),
            **stats,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "loadavg_before": [round(x, 2) for x in load0],
                "loadavg_after": [round(x, 2) for x in load1],
                "omp_threads": os.environ.get("OMP_NUM_THREADS"),
                "note": "shared machine: other processes ran during the collection (see loadavg)",
            },
        },
    }
    write_steps(args.out, steps, manifest, replace=args.replace, fit=not args.no_fit, plain=plain_table)
    print(f"{len(steps)} steps ({stats['dropped_steps']} with prefill dropped) in {wall:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
