"""The draft floor, measured in one process: plain decoding vs a k = 0 controller, eager and lazy drafter.

A controller that verifies nothing still pays vLLM's drafter in every step (its first forward "keeps the
drafter KV cache in sync"); :mod:`specenv.engines.vllm.lazydraft` skips that forward when no request of
the step drafts. Per batch size, this script builds in one process a plain engine (no speculation,
stock scheduler) and a controller engine (``num_speculative_tokens`` = ``--k``, default 1, a policy that
always answers k = 0, ``draft_horizon="policy"``), and decodes the same prompts (greedy, ``ignore_eos``) on three arms,
interleaved with the order rotated every repeat:

* ``plain``: the plain engine;
* ``k=0 eager``: the controller engine with the drafter run every step (vLLM's behaviour);
* ``k=0 lazy``: the same engine with the lazy drafter (the proposer's ``lazy`` flag, same weights), whose
  idle steps also run as plain steps (:class:`specenv.engines.vllm.lazydraft.PlainIdleSteps`: no
  rejection sampler, no drafter input preparation; counted as ``plain steps``).

Prints per arm the median ms per output token and the throughput ratio to plain with a 95% bootstrap
interval over the repeats x request groups (paired: every cell ran all arms back to back), checks the
outputs are identical, and the load average. Both drafter modes are the same engine, so the lazy/eager
comparison is free of engine-to-engine spread.

Usage (the vLLM environment)::

    python scripts/draft_floor.py                                  # small-moe-v1, batch 1 and 8
    python scripts/draft_floor.py --models wide-moe-v1 --batch 1,4,8 --repeats 5 --out floor.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ARMS = ("plain", "k=0 eager", "k=0 lazy")


def _timed(llm, prompts, sp, batch: int) -> tuple[float, list[list[int]]]:
    """The prompts in groups of ``batch`` concurrent requests (an engine of more sequences runs ``batch``)."""
    t0 = time.perf_counter()
    outs = [o for i in range(0, len(prompts), batch) for o in llm.generate(prompts[i : i + batch], sp, use_tqdm=False)]
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def measure(batch: int, args: argparse.Namespace) -> dict:
    """One batch size: the three arms interleaved, as the module docstring says."""
    import numpy as np
    from vllm import SamplingParams, TokensPrompt

    from policies.heuristics import FixedK
    from specenv.engines.vllm.bench import build_llm, encode_prompts, scheduler_of
    from specenv.engines.vllm.hugepages import advise_engine
    from specenv.engines.vllm.lazydraft import LazyDraftProposer
    from specenv.observation.single import ObservationSpec
    from specenv.stats import bootstrap_ratio_ci

    n = args.prompts or 2 * batch
    base = {"models": args.models, "max_num_seqs": max(batch, args.max_num_seqs)}
    plain = build_llm({**base, "k": 0, "controller": False})
    ctl_llm = build_llm({**base, "k": args.k, "settings": {"draft_horizon": "policy"}})
    for llm in (plain, ctl_llm):  # both engines' weights on huge pages, as abtest's engine processes hold them
        advise_engine(llm)
    ctl = scheduler_of(ctl_llm)
    ctl.set_policy(FixedK(ObservationSpec(kmax=args.k, max_new_tokens=args.tokens, n_experts=ctl.n_experts), 0))
    worker = ctl_llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    drafter = worker.model_runner.drafter
    if not isinstance(drafter, LazyDraftProposer):
        raise SystemExit(f"the controller engine's drafter is {type(drafter).__name__}, not the lazy one")
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in encode_prompts(args.models, list(range(n)))]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    engines = {"plain": plain, "k=0 eager": ctl_llm, "k=0 lazy": ctl_llm}

    def arm_run(name: str) -> tuple[float, list[list[int]]]:
        drafter.lazy = name == "k=0 lazy"
        return _timed(engines[name], prompts, sp, batch)

    for a in ARMS:  # warm-up
        arm_run(a)
    walls: dict[str, list[float]] = {a: [] for a in ARMS}
    outputs: dict[str, list[list[int]]] = {}
    skipped0 = drafter.stats["skipped"]
    plain0 = drafter.stats["plain_steps"]
    for rep in range(args.repeats):
        for j in range(len(ARMS)):
            a = ARMS[(j + rep) % len(ARMS)]
            wall, out = arm_run(a)
            walls[a].append(wall)
            outputs.setdefault(a, out)
    tokens = n * args.tokens
    row: dict = {"batch": batch, "prompts": n, "tokens": args.tokens, "repeats": args.repeats, "k": args.k}
    row["max_num_seqs"] = base["max_num_seqs"]
    row["identical"] = all(outputs[a] == outputs["plain"] for a in ARMS)
    row["skipped_steps"] = drafter.stats["skipped"] - skipped0
    row["plain_steps"] = drafter.stats["plain_steps"] - plain0
    p = np.asarray(walls["plain"])
    for a in ARMS:
        w = np.asarray(walls[a])
        ci = bootstrap_ratio_ci(p, w)["pooled"]  # plain time / arm time = the arm's speed vs plain
        row[a] = {"ms_per_token": 1e3 * float(np.median(w)) * batch / tokens, "vs_plain": ci, "walls": w.tolist()}
    return row  # the engines go with this frame (main collects)


def _batches(text: str) -> list[int]:
    """``--batch``: comma-separated batch sizes, each an integer >= 1 (argparse turns the error into exit 2)."""
    try:
        out = [int(b) for b in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers >= 1, e.g. 1,8")
    return out


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer >= 1")
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="small-moe-v1")
    ap.add_argument("--batch", type=_batches, default="1,8", help="comma-separated batch sizes (max_num_seqs)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per pass (default: 2 x batch)")
    ap.add_argument("--tokens", type=_positive, default=48)
    ap.add_argument("--k", type=_positive, default=1, help="the controller engine's num_speculative_tokens")
    ap.add_argument("--max-num-seqs", type=_positive, default=1, help="both engines' max_num_seqs (at least the batch)")
    ap.add_argument("--repeats", type=_positive, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        os.environ.setdefault(k, v)
    from specenv.engines.vllm.bench import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)

    import gc

    from specenv.engines.vllm.models import vllm_model_dirs

    try:  # a bad --models is one line and exit 2, before any engine starts
        vllm_model_dirs(args.models)
    except ValueError as exc:
        ap.error(f"argument --models: {exc}")
    results = []
    for b in args.batch:  # each batch size printed and written as soon as it is measured
        results.append(measure(b, args))
        gc.collect()
        load = os.getloadavg()
        print(f"{args.models}, greedy, {args.tokens} tokens, {args.repeats} interleaved repeats; load {load[0]:.1f}")
        print(
            "| batch | arm | ms per step (median) | speed vs plain [95% CI] | outputs identical "
            "| skipped draft steps | plain steps |"
        )
        print("|---|---|---|---|---|---|---|")
        r = results[-1]
        for a in ARMS:
            c = r[a]["vs_plain"]
            sk = f"{r['skipped_steps']} | {r['plain_steps']}" if a == "k=0 lazy" else " |"
            ci = f"{c['value']:.3f} [{c['low']:.3f}, {c['high']:.3f}]"
            print(f"| {r['batch']} | {a} | {r[a]['ms_per_token']:.3f} | {ci} | {r['identical']} | {sk} |", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"rows": results, "load": load, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
