"""Check a batch step-time model on this machine: the steps a fixed k serves, measured and priced.

A step-time model (``specenv batch fit --timing step``) is fitted on steps with random draft lengths
and random per-request budgets, recorded on one machine. What an A/B runs is different: a fixed k for
every request of every step, on the machine at hand. This script builds the controller engine (routing
tap) and a plain engine (no drafter loaded) as ``scripts/collect_vllm_batch.py`` does, serves groups of
B requests at a fixed k on the first (every step drafts k, every request verifies k:
:func:`specenv.engines.vllm.batchrec.record_batch_steps` with ``uniform=True``) and the same groups
on the plain engine right after, then prices every recorded step with the model (its exact k, own
unions, contexts and batch union) and every plain step with the model's plain step. Per (B, k) it
prints the measured and predicted engine step, their ratio, the same for the plain engine, and the
ratio that decides a speedup: the k step over the plain step, measured and predicted.

    python scripts/check_step_model.py --model live-vllm-wide-batch-v6 --batches 1,4,8 --k 1,3

Run in the vLLM environment (about 4 minutes for the default on wide-moe-v1). Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(_k, _v)


def _ints(text: str, what: str) -> list[int]:
    """Comma-separated integers >= 1 ('a-b': a range), or ValueError naming the argument."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            vals = list(range(lo, hi + 1))
        else:
            vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a comma-separated list of integers or 'a-b'") from None
    if not vals or min(vals) < (0 if what == "--prompt-ids" else 1):
        raise ValueError(f"{what}: {text!r}: give integers >= 1 (prompt ids >= 0)")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="live-vllm-wide-batch-v6", help="a batch step-time model: shipped name or JSON")
    ap.add_argument("--models", default="wide-moe-v1", help="the model set the engines serve")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--k", default="1,3", help="fixed budgets, comma-separated")
    ap.add_argument("--reps", type=int, default=2, help="groups per (B, k), each on other prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-set", default="stdlib-code-v1")
    ap.add_argument("--prompt-ids", default="0-15", help="'a-b' or comma-separated")
    args = ap.parse_args(argv)
    try:
        batches, ks = _ints(args.batches, "--batches"), _ints(args.k, "--k")
        ids = _ints(args.prompt_ids, "--prompt-ids")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.reps < 1 or args.max_tokens < 2:
        print("error: need --reps >= 1 and --max-tokens >= 2", file=sys.stderr)
        return 2

    import numpy as np
    import pandas as pd

    from specenv.cost.batch import BatchCostModel, load_batch_cost_model

    try:
        model = BatchCostModel.load(args.model) if args.model.endswith(".json") else load_batch_cost_model(args.model)
    except (OSError, ValueError) as exc:
        print(f"error: --model: {exc}", file=sys.stderr)
        return 2
    if model.ar_step is None:
        print(f"error: --model: {args.model} is not a step-time model (no plain engine's step)", file=sys.stderr)
        return 2
    if max(batches) > model.max_batch or max(ks) > model.kmax:
        print(f"error: --batches/--k: the model covers B <= {model.max_batch}, k <= {model.kmax}", file=sys.stderr)
        return 2

    from specenv.engines.vllm.batchrec import record_batch_steps, record_plain_steps, step_engines
    from specenv.engines.vllm.bench import encode_prompts

    try:
        prompts = encode_prompts(args.models, ids, args.prompt_set)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    top = max(batches)
    llm, plain = step_engines(args.models, max(ks), [prompts[i % len(prompts)] for i in range(top)])
    record_batch_steps(llm, prompts[:top], [top], 1, 16, max(ks), seed=1)  # a warm-up, not kept
    spec_rows, plain_rows, cursor = [], [], 0
    load0 = os.getloadavg()[0]
    for rep in range(args.reps):
        for B in batches:
            chosen = [list(prompts[(cursor + i) % len(prompts)]) for i in range(B)]
            cursor += B
            for k in ks:
                steps, _ = record_batch_steps(llm, chosen, [B], 1, args.max_tokens, k, uniform=True)
                spec_rows.append(steps.assign(kfix=k))
            plain_rows.extend(record_plain_steps(plain, chosen, args.max_tokens, f"rep{rep}", B, rep))
    load1 = os.getloadavg()[0]
    spec = pd.concat(spec_rows, ignore_index=True)
    pl = pd.DataFrame(plain_rows)
    spec["pred_ms"] = [
        model.step_ms(np.asarray(r.k), np.full(len(r.k), r.drafted), np.asarray(r.U), np.asarray(r.L, float), r.U_batch)
        for r in spec.itertuples()
    ]
    pl["pred_ms"] = [model.ar_ms(np.full(int(r.B), r.context_sum / r.B)) for r in pl.itertuples()]
    print(
        f"# {args.models}, model {args.model}: fixed k on the controller engine vs the plain engine, "
        f"{args.reps} groups x {args.max_tokens} tokens per (B, k); load {load0:.2f} -> {load1:.2f}"
    )
    print(
        "| B | k | steps | step ms live / model | ratio | plain ms live / model | ratio | k step / plain: live, model |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (B, k), g in spec.groupby(["B", "kfix"]):
        if B not in batches:
            continue  # a step after a request ended (fewer requests)
        p = pl[pl["B"] == B]
        live, pred = g["engine_step_ms"].mean(), g["pred_ms"].mean()
        pl_live, pl_pred = p["engine_step_ms"].mean(), p["pred_ms"].mean()
        print(
            f"| {B} | {k} | {len(g)} | {live:.1f} / {pred:.1f} | {live / pred:.3f} | {pl_live:.1f} / {pl_pred:.1f} "
            f"| {pl_live / pl_pred:.3f} | {live / pl_live:.2f}, {pred / pl_pred:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
