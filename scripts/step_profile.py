"""Where a step's time goes: vLLM's and specenv's per-step functions timed on several engines in one process.

Builds the engines named by ``--arms`` in this process (``plain``: no speculation, stock scheduler; ``stock``:
stock vLLM at ``num_speculative_tokens = --k``, no controller; ``lazy``: the controller engine at
``num_speculative_tokens = --k``, ``draft_horizon="policy"``, a policy that always answers k = ``--policy-k``
(default 0; ``--policy mlp``: a numpy MLP, the controller's full path, else ``FixedK``, its blind path), the lazy
drafter; ``eager``: the same with vLLM's drafter run every step; ``nohook``: ``lazy``
with the routing tap's hooks removed; a ``2`` or any suffix after ``-`` makes another engine of the same kind,
e.g. ``plain-2``: the engine-to-engine spread), wraps the engine core's, scheduler's, model runner's and
drafter's per-step methods with wall-clock timers, then decodes the same prompts on every engine (greedy,
``ignore_eos``, groups of ``--batch`` requests) in ``--repeats`` interleaved passes, the order rotated per
pass. Prints each engine's wall time and its ratio to the first arm's, then per function the mean
milliseconds per engine step on each engine (a function an engine never calls shows 0). The timers add about
a microsecond per call; compare engines, not absolute figures.

Usage (the vLLM environment)::

    python scripts/step_profile.py --models wide-moe-v1 --batch 2 --k 8 --max-num-seqs 8 --arms plain,plain-2,lazy
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Any

KINDS = ("plain", "stock", "lazy", "eager", "nohook")

#: (object path from the engine core, method names) timed on every engine that has them
TIMED = (
    ("core", ("step", "post_step")),
    ("scheduler", ("schedule", "update_from_output", "update_draft_token_ids")),
    ("executor", ("execute_model", "sample_tokens", "take_draft_token_ids")),
    (
        "runner",
        (
            "execute_model",
            "sample_tokens",
            "_update_states",
            "_prepare_inputs",
            "_preprocess",
            "_model_forward",
            "_sample",
            "_bookkeeping_sync",
            "propose_draft_token_ids",
            "take_draft_token_ids",
            "_build_attention_metadata",
        ),
    ),
    ("drafter", ("propose",)),
)


def _kind(arm: str) -> str:
    return arm.split("-", 1)[0]


def _arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in arms if _kind(a) not in KINDS]
    if not arms or bad:
        raise argparse.ArgumentTypeError(f"{bad or text!r}: arms are {', '.join(KINDS)} (optionally -SUFFIX)")
    if len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"{text!r}: an arm named twice (add a suffix: plain-2)")
    return arms


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return v


def _parts(llm: Any) -> dict[str, Any]:
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    return {
        "core": core,
        "scheduler": core.scheduler,
        "executor": core.model_executor,
        "runner": runner,
        "drafter": getattr(runner, "drafter", None),
    }


def _wrap(obj: Any, name: str, label: str, total: dict[str, float]) -> None:
    fn = getattr(obj, name, None)
    if obj is None or fn is None:
        return

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            total[label] += time.perf_counter() - t0

    setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="wide-moe-v1")
    ap.add_argument("--arms", type=_arms, default=_arms("plain,lazy"), help=f"comma-separated, of {KINDS}")
    ap.add_argument("--batch", type=_positive, default=1, help="concurrent requests per group")
    ap.add_argument("--k", type=_positive, default=1, help="num_speculative_tokens of the controller engines")
    ap.add_argument("--policy-k", type=int, default=0, help="the k the controller engines' fixed policy answers")
    ap.add_argument(
        "--policy",
        choices=("fixed", "mlp"),
        default="fixed",
        help="fixed: FixedK (reads no observation: the controller's blind path, no routing capture); mlp: a numpy "
        "MLP that always answers --policy-k (the full path: routing capture, expert statistics, observations)",
    )
    ap.add_argument("--max-num-seqs", type=_positive, default=None, help="every engine's (default: the batch)")
    ap.add_argument("--groups", type=_positive, default=2, help="request groups per pass")
    ap.add_argument("--tokens", type=_positive, default=48)
    ap.add_argument("--repeats", type=_positive, default=3)
    args = ap.parse_args()
    if not 0 <= args.policy_k <= args.k:
        ap.error(f"--policy-k {args.policy_k} is outside 0..--k ({args.k})")
    if args.max_num_seqs is not None and args.max_num_seqs < args.batch:
        ap.error(f"--max-num-seqs {args.max_num_seqs} is below --batch {args.batch}")
    from specenv.engines.vllm.models import vllm_model_dirs

    try:  # a bad --models is one line and exit 2, before any engine starts
        vllm_model_dirs(args.models)
    except ValueError as exc:
        ap.error(f"argument --models: {exc}")

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from specenv.engines.vllm.bench import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import SamplingParams, TokensPrompt

    from policies.heuristics import FixedK
    from specenv.abtest import make_policy
    from specenv.engines.vllm.bench import build_llm, encode_prompts, scheduler_of
    from specenv.engines.vllm.hugepages import advise_engine
    from specenv.engines.vllm.tap import TAPS
    from specenv.observation.single import ObservationSpec

    base = {"models": args.models, "max_num_seqs": args.max_num_seqs or args.batch}
    engines: dict[str, Any] = {}
    for arm in args.arms:
        kind = _kind(arm)
        if kind == "plain":
            engines[arm] = build_llm({**base, "k": 0, "controller": False})
        elif kind == "stock":
            engines[arm] = build_llm({**base, "k": args.k, "controller": False})
        else:
            taps_before = len(TAPS)
            llm = engines[arm] = build_llm({**base, "k": args.k, "settings": {"draft_horizon": "policy"}})
            ctl = scheduler_of(llm)
            if args.policy == "mlp":
                desc = {"kind": "constant-mlp", "k": args.policy_k, "kmax": args.k, "max_new_tokens": args.tokens}
                ctl.set_policy(make_policy(desc, ctl))
            else:
                spec = ObservationSpec(kmax=args.k, max_new_tokens=args.tokens, n_experts=ctl.n_experts)
                ctl.set_policy(FixedK(spec, args.policy_k))
            drafter = _parts(llm)["drafter"]
            if kind == "eager" and hasattr(drafter, "lazy"):
                drafter.lazy = False
            if kind == "nohook":  # the tap's module hooks and router captures off: the bare forward
                for m in _parts(llm)["runner"].model.modules():
                    if getattr(m, "capture_fn", None) is not None and hasattr(m, "set_capture_fn"):
                        m.set_capture_fn(None)
                for tap in TAPS[taps_before:]:
                    for h in tap.handles:
                        h.remove()
        advise_engine(engines[arm])
    totals = {a: collections.defaultdict(float) for a in args.arms}
    steps = {a: 0 for a in args.arms}
    for arm, llm in engines.items():
        parts = _parts(llm)
        for where, names in TIMED:
            for name in names:
                _wrap(parts[where], name, f"{where}.{name}", totals[arm])
        step = llm.llm_engine.step

        def counted(arm: str = arm, step: Any = step) -> Any:
            steps[arm] += 1
            return step()

        llm.llm_engine.step = counted
    prompts = [
        TokensPrompt(prompt_token_ids=ids) for ids in encode_prompts(args.models, list(range(args.groups * args.batch)))
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def run(llm: Any) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(prompts), args.batch):
            llm.generate(prompts[i : i + args.batch], sp, use_tqdm=False)
        return time.perf_counter() - t0

    for llm in engines.values():  # warm-up, untimed
        run(llm)
    for arm in args.arms:
        totals[arm].clear()
        steps[arm] = 0
    walls = {a: 0.0 for a in args.arms}
    for rep in range(args.repeats):
        for j in range(len(args.arms)):
            arm = args.arms[(j + rep) % len(args.arms)]
            walls[arm] += run(engines[arm])
    ref = args.arms[0]
    print(f"# {args.models}, batch {args.batch}, k {args.k}, {args.groups} groups x {args.tokens} tokens, "
          f"{args.repeats} interleaved passes; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| arm | wall s | speed vs " + ref + " | engine steps |\n|---|---|---|---|")
    for arm in args.arms:
        print(f"| {arm} | {walls[arm]:.3f} | {walls[ref] / walls[arm]:.4f} | {steps[arm]} |")
    labels = sorted(set().union(*totals.values()), key=lambda k: -max(totals[a].get(k, 0.0) for a in args.arms))
    print("\n| ms per step | " + " | ".join(args.arms) + " |\n|---|" + "---|" * len(args.arms))
    for label in labels:
        cells = " | ".join(f"{1e3 * totals[a].get(label, 0.0) / max(steps[a], 1):.3f}" for a in args.arms)
        print(f"| {label} | {cells} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
