"""The vLLM controller's own CPU per engine step, with the compiled bookkeeping kernels on and off, in one run.

Each measurement is a child process (``SPECENV_NUMBA`` is read once per process): it builds one
in-process controller engine on ``--models`` (``num_speculative_tokens = --kmax``, the A/B's
``draft_horizon`` of the arm: ``policy`` as the learned arm, ``outcome`` as the arm drafting after the
outcome), serves ``--policy`` with the rounds priced by ``--cost-model`` (``specenv fit TRACES --out``;
none: measured times), decodes ``--prompts`` held-out prompts x ``--tokens`` greedy tokens in groups of
``--batch`` once to warm up and ``--passes`` times measured, and reports the controller's thread CPU per
engine step (its step log: ``schedule``, ``update_from_output``, ``outcome_drafts`` and
``update_draft_token_ids``, vLLM's own code excluded) and its share of the step's wall time. The
``numpy`` rows run with ``SPECENV_NUMBA=0`` (the numpy forms of :mod:`specenv.engines.kernels`), the
``compiled`` rows with the kernels; the two alternate ``--repeats`` times. Run it on a quiet machine
with the vLLM environment::

    python scripts/controller_cpu.py --models wide-moe-v1 --batch 1,8 --horizon outcome,policy --repeats 3 \\
        --cost-model /tmp/cm.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HORIZONS = ("policy", "outcome")


def child(args: argparse.Namespace) -> None:
    """One measurement (in its own process): prints one JSON line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from specenv.engines.vllm.bench import ENGINE_ENV

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import SamplingParams, TokensPrompt

    from specenv.engines.kernels import kernels
    from specenv.engines.vllm.bench import build_llm, encode_prompts, scheduler_of, step_overhead
    from specenv.policy.mlp import MLPPolicy

    settings = {"draft_horizon": args.horizon}
    if args.cost_model:
        settings["cost_model"] = args.cost_model
    llm = build_llm({"models": args.models, "k": args.kmax, "max_num_seqs": args.batch, "settings": settings})
    ctl = scheduler_of(llm)
    ctl.set_policy(MLPPolicy.load(args.policy))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in encode_prompts(args.models, list(range(args.prompts)))]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    def run() -> None:
        for i in range(0, len(prompts), args.batch):
            llm.generate(prompts[i : i + args.batch], sp, use_tqdm=False)

    run()
    n0 = ctl._steplog.n
    for _ in range(args.passes):
        run()
    o = step_overhead(ctl, n0)
    out = {
        "compiled": kernels() is not None,
        "steps": o["steps"],
        "cpu_us": 1e3 * o["specenv_cpu_ms"] / o["steps"],
        "step_ms": o["step_ms"] / o["steps"],
        "cpu_frac": o["cpu_frac"],
        "errors": ctl.stats["errors"][:3],
    }
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python scripts/controller_cpu.py", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="wide-moe-v1")
    ap.add_argument("--policy", default="policies/shipped/live-vllm-wide-v1/ppo", help="an exported MLP folder")
    ap.add_argument("--cost-model", default=None, help="cost-model JSON for the rounds' prices")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--horizon", default="outcome", help=f"comma-separated: {', '.join(HORIZONS)}")
    ap.add_argument("--kmax", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.batch = int(args.batch)
        child(args)
        return
    try:
        batches = [int(b) for b in args.batch.split(",") if b]
    except ValueError:
        ap.exit(2, f"--batch: expected comma-separated integers, got {args.batch!r}\n")
    horizons = [h for h in args.horizon.split(",") if h]
    bad = [h for h in horizons if h not in HORIZONS]
    if bad or not horizons or not batches or min(batches) < 1:
        ap.exit(2, f"--horizon/--batch: unknown or empty value (horizons: {', '.join(HORIZONS)})\n")
    if args.cost_model and not os.path.isfile(args.cost_model):
        ap.exit(2, f"--cost-model: no file {args.cost_model}\n")
    from specenv.engines.vllm.models import vllm_model_dirs
    from specenv.policy.mlp import MLPPolicy

    try:  # one line and exit 2 before any engine starts
        vllm_model_dirs(args.models)
    except ValueError as exc:
        ap.exit(2, f"--models: {exc}\n")
    try:
        MLPPolicy.load(args.policy)
    except (OSError, ValueError) as exc:
        ap.exit(2, f"--policy: {exc}\n")
    res: dict[tuple[str, int, str], list[dict]] = {}
    for rep in range(args.repeats):
        for h in horizons:
            for b in batches:
                kinds = ("numpy", "compiled") if rep % 2 == 0 else ("compiled", "numpy")
                for kind in kinds:
                    env = {**os.environ, "SPECENV_NUMBA": "0" if kind == "numpy" else "1"}
                    cmd = [sys.executable, __file__, "--child", "--batch", str(b), "--horizon", h]
                    for name in ("models", "policy", "kmax", "prompts", "tokens", "passes"):
                        cmd += [f"--{name}", str(getattr(args, name))]
                    if args.cost_model:
                        cmd += ["--cost-model", args.cost_model]
                    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                    if p.returncode != 0 or line is None:
                        sys.stderr.write(p.stderr[-3000:])
                        ap.exit(1, f"measurement {h} batch {b} {kind} failed (exit {p.returncode})\n")
                    r = json.loads(line[len("RESULT ") :])
                    if r["compiled"] != (kind == "compiled") or r["errors"]:
                        ap.exit(
                            1, f"measurement {h} batch {b} {kind}: compiled={r['compiled']}, errors {r['errors']}\n"
                        )
                    res.setdefault((h, b, kind), []).append(r)
                    print(f"# {h} batch {b} {kind}: {r['cpu_us']:.0f} us/step, {r['cpu_frac']:.2%}", flush=True)
    print(f"\n# {args.models}, {args.policy}, kmax {args.kmax}, {args.prompts} prompts x {args.tokens} tokens x "
          f"{args.passes} passes, {args.repeats} repeats (median); load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("| horizon | batch | numpy: CPU us/step | share of step | compiled: CPU us/step | share of step | ratio |")
    print("|---|---|---|---|---|---|---|")
    for h in horizons:
        for b in batches:
            a, c = res[(h, b, "numpy")], res[(h, b, "compiled")]
            ua, uc = statistics.median(x["cpu_us"] for x in a), statistics.median(x["cpu_us"] for x in c)
            fa, fc = statistics.median(x["cpu_frac"] for x in a), statistics.median(x["cpu_frac"] for x in c)
            print(f"| {h} | {b} | {ua:.0f} | {fa:.2%} | {uc:.0f} | {fc:.2%} | {uc / ua:.3f} |")


if __name__ == "__main__":
    main()
