"""Measurements of the vLLM integration on this machine: controller/recorder overhead, live speedups.

Run ``python -m scripts.vllm_bench overhead --out DIR`` and ``python -m scripts.vllm_bench speedup
--out DIR`` (in the ``vllm`` environment; each configuration runs in a fresh process, one engine at a
time, so several minutes each). Results go to ``DIR/*.json`` and a Markdown table on stdout.

``floor``: the draft floor, a k = 0 step against a plain engine's step (:func:`floor`).

``overhead``: the same greedy workload (prompts of the live prompt set, a fixed number of tokens,
``max_num_seqs`` requests at a time) on (a) vLLM's stock scheduler, (b) the controller with a numpy
MLP policy that always answers ``num_speculative_tokens`` plus the routing tap, and (c) (b) plus the
recorder. Reported: throughput (tokens/s, median of ``--reps`` passes after a warm-up pass) and the
time spent inside specenv's code per step (``stats["overhead_ms"]`` of the controller: policy,
observation bookkeeping, recorder rows), which does not depend on machine noise.

``speedup``: batch size 1, greedy, the held-out (test-split) prompts of the ``live-cpu`` trace set,
its ``max_new_tokens``; configurations: plain decoding (no speculation), fixed k = 1..Kmax
(``num_speculative_tokens = k``), and the paper's delta-space rule through the controller with
``num_speculative_tokens = Kmax`` (draft horizon ``max`` and ``policy``). The rule's cost model is
fitted (:func:`specenv.cost.fit.fit_cost_model`) on the rounds the recorder wrote during the first round of
fixed-k runs -- vLLM's own costs on this machine -- its priors and oracle lambda come from the
``live-cpu`` train split. Every configuration runs ``--rounds`` times, interleaved, in fresh processes;
speedup = median wall time of plain decoding / median wall time of the configuration (greedy: the
same generated tokens in every configuration, checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in this process (:func:`specenv.engines.vllm.bench.run_config`)."""
    from specenv.engines.vllm.bench import run_config as _run

    return _run(cfg, _make_policy)


def _make_policy(spec: dict[str, Any], ctl: Any) -> Any:
    """The policy a JSON description names: :func:`specenv.abtest.make_policy` (one owner), n_experts as given."""
    from specenv.abtest import make_policy

    class _Ctl:
        n_experts = int(spec.get("n_experts") or getattr(ctl, "n_experts", None) or 128)

    return make_policy(spec, _Ctl())


def _spawn(cfg: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
    from specenv.engines.vllm.bench import engine_env

    path = out / f"{name}.json"
    env = engine_env()
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.call(
            [sys.executable, "-m", "scripts.vllm_bench", "_run", json.dumps(cfg), str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if rc != 0:
        raise RuntimeError(f"{name}: exit code {rc}; see {out / (name + '.log')}")
    res = json.loads(path.read_text())
    print(f"  {name}: {res['tok_per_s']:.1f} tok/s ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return res


def overhead(args: argparse.Namespace) -> None:
    """Stock scheduler vs controller (+tap) vs controller + recorder, same workload."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = {
        "models": args.models,
        "k": args.k,
        "max_num_seqs": args.batch,
        "max_tokens": args.tokens,
        "prompt_ids": list(range(args.prompts)),
        "reps": args.reps,
        "warmup": 1,
        "ignore_eos": True,
        "controller": True,
    }
    pol = {"kind": "constant-mlp", "k": args.k, "kmax": args.k, "max_new_tokens": args.tokens}
    configs = {
        "stock": {**base, "controller": False},
        "controller": {**base, "policy": pol},
        "controller+recorder": {**base, "policy": pol, "settings": {"record": str(out / "rec"), "part_rounds": 2048}},
    }
    res = {}
    for rnd in range(args.rounds):  # interleave the configurations to spread machine noise
        for name, cfg in configs.items():
            res.setdefault(name, []).append(_spawn(cfg, out, f"overhead-{name}-{rnd}"))
    stock = statistics.median(r["tok_per_s"] for r in res["stock"])
    rows = []
    for name, rs in res.items():
        tps = statistics.median(r["tok_per_s"] for r in rs)
        ovh = [p["overhead"] for r in rs for p in r["passes"] if p.get("overhead", {}).get("steps")]
        own = [o["frac"] for o in ovh]
        per_step = [o["specenv_ms"] / o["steps"] for o in ovh]
        rows.append(
            {
                "config": name,
                "tok_per_s": tps,
                "vs_stock": tps / stock - 1.0,
                "tok_per_s_all": [round(r["tok_per_s"], 2) for r in rs],
                "specenv_share": statistics.median(own) if own else 0.0,
                "specenv_ms_per_step": statistics.median(per_step) if per_step else 0.0,
            }
        )
    same = all(r["outputs"] == res["stock"][0]["outputs"] for rs in res.values() for r in rs)
    (out / "overhead.json").write_text(
        json.dumps({"rows": rows, "identical_outputs": same, "args": vars(args)}, indent=2)
    )
    print("| config | tokens/s (median) | vs stock | all passes | time in specenv code | per step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['tok_per_s']:.1f} | {r['vs_stock']:+.1%} | {r['tok_per_s_all']} | "
            f"{r['specenv_share']:.2%} | {r['specenv_ms_per_step']:.3f} ms |"
        )
    print(f"identical outputs: {same}")


def floor(args: argparse.Namespace) -> None:
    """The draft floor: a k = 0 step through the controller against a plain engine's step, same workload.

    vLLM's drafter runs its first forward at every step (``num_speculative_tokens`` must be > 0, and
    ``num_spec_tokens_to_schedule = 0`` still runs it to keep the draft's KV cache in sync), so a
    controller that verifies nothing still pays it. Configurations (each in a fresh process, interleaved
    ``--rounds`` times): ``plain`` (no speculation, stock scheduler), ``plain+controller`` (no
    speculation, the controller and tap: its own cost), ``k=0, draft 0`` (one draft token allowed, the
    policy always 0, draft horizon ``policy``, the lazy drafter off: the drafter runs its first forward
    only), ``k=0, lazy draft`` (the same with the lazy drafter, :mod:`specenv.engines.vllm.lazydraft`:
    no draft forward at all) and ``k=0, draft 1`` (horizon ``max``: the drafter also samples the one
    token that is then cut). Every step
    emits one token per request, so ms per step = batch / tokens per second.
    """
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = {
        "models": args.models,
        "max_num_seqs": args.batch,
        "max_tokens": args.tokens,
        "prompt_ids": list(range(args.prompts)),
        "reps": args.reps,
        "warmup": 1,
        "ignore_eos": True,
    }
    pol = {"kind": "fixed", "k": 0, "kmax": 1, "max_new_tokens": args.tokens}
    configs = {
        "plain": {**base, "k": 0, "controller": False},
        "plain+controller": {**base, "k": 0},
        "k=0, draft 0": {**base, "k": 1, "policy": pol, "settings": {"draft_horizon": "policy", "lazy_draft": False}},
        "k=0, lazy draft": {**base, "k": 1, "policy": pol, "settings": {"draft_horizon": "policy"}},
        "k=0, draft 1": {**base, "k": 1, "policy": pol},
    }
    res: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        for name, cfg in configs.items():
            tag = name.replace(" ", "").replace(",", "-").replace("=", "")
            res.setdefault(name, []).append(_spawn(cfg, out, f"floor-{tag}-{rnd}"))
    ms = {name: [1e3 * args.batch / r["tok_per_s"] for r in rs] for name, rs in res.items()}
    plain = statistics.median(ms["plain"])
    rows = [
        {"config": n, "ms_per_step": statistics.median(v), "all": [round(x, 3) for x in v],
         "vs_plain_ms": statistics.median(v) - plain, "ratio": statistics.median(v) / plain}
        for n, v in ms.items()
    ]  # fmt: skip
    same = all(r["outputs"] == res["plain"][0]["outputs"] for rs in res.values() for r in rs)
    (out / "floor.json").write_text(json.dumps({"rows": rows, "identical_outputs": same, "args": vars(args)}, indent=2))
    print(f"batch {args.batch}: | config | ms per step (median) | all rounds | minus plain | / plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['ms_per_step']:.3f} | {r['all']} | {r['vs_plain_ms']:+.3f} | {r['ratio']:.3f} |")
    print(f"identical outputs: {same}")


def speedup(args: argparse.Namespace) -> None:
    """Plain decoding, fixed k = 1..Kmax and the delta-space rule, B = 1, live-cpu test prompts."""
    from oracle.delta import boundary_slope
    from policies.bench.context import train_priors
    from specenv.cost.fit import fit_cost_model
    from specenv.engines.recorder import load_recording
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ts = load_dataset(args.dataset)
    kmax = args.kmax or ts.kmax
    test_ids = [int(g) for g in select_positions(ts, kmax, "test").generation_ids][: args.prompts or None]
    mnt = int(args.tokens or ts.manifest.max_new_tokens)
    base = {"models": args.models, "max_tokens": mnt, "prompt_ids": test_ids, "reps": args.reps, "warmup": 1}
    configs: dict[str, dict[str, Any]] = {"plain": {**base, "k": 0}}
    for k in range(1, kmax + 1):
        configs[f"k={k}"] = {**base, "k": k}
    res: dict[str, list[dict[str, Any]]] = {}
    for name, cfg in configs.items():  # round 0 of the fixed-k runs is recorded: the cost model's data
        rec = {"record": str(out / "rec" / name), "run": name}
        res[name] = [_spawn({**cfg, "settings": rec}, out, f"speedup-{name}-0")]
    rec_ts = load_recording([out / "rec" / name for name in configs], name="vllm-cpu-fixed-k")
    fit = fit_cost_model(rec_ts.rounds, kmax, rec_ts.facts.top_k, 5, source={"traces": "vllm fixed-k runs (bench)"})
    cm_path = out / "vllm-cost-model.json"
    fit.model.save(cm_path)
    train = select_positions(ts, kmax, "train")
    lam = float(boundary_slope(train, fit.model))
    u_prior, rho_prior = train_priors(train)
    pol = {
        "kind": "delta",
        "kmax": kmax,
        "max_new_tokens": mnt,
        "n_experts": ts.facts.n_experts,
        "cost_model": str(cm_path),
        "lam_ms": lam,
        "u_prior": u_prior.tolist(),
        "rho_prior": rho_prior.tolist(),
    }
    for name, p, horizon in (
        ("delta, oracle lambda, horizon max", pol, "max"),
        ("delta, oracle lambda, horizon policy", pol, "policy"),
        ("delta, adaptive lambda, horizon policy", {**pol, "adaptive": True}, "policy"),
    ):
        configs[name] = {
            **base,
            "k": kmax,
            "policy": p,
            "settings": {"draft_horizon": horizon, "cost_model": str(cm_path)},
        }
    for rnd in range(args.rounds):  # interleave: every configuration once per round
        for name, cfg in configs.items():
            if rnd == 0 and name in res:
                continue
            tag = name.replace(" ", "").replace(",", "-")
            res.setdefault(name, []).append(_spawn(cfg, out, f"speedup-{tag}-{rnd}"))
    ref = res["plain"][0]["outputs"]
    plain = statistics.median(r["wall_s"] for r in res["plain"])
    rows = []
    for name, rs in res.items():
        wall = statistics.median(r["wall_s"] for r in rs)
        st = rs[-1].get("stats", {})
        rows.append(
            {
                "config": name,
                "wall_s": wall,
                "walls": [round(r["wall_s"], 2) for r in rs],
                "tok_per_s": rs[0]["tokens"] / wall,
                "speedup": plain / wall,
                "lossless": all(r["outputs"] == ref for r in rs),
                "fallbacks": st.get("fallbacks", 0),
                "capped": st.get("capped", 0),
                "decisions": st.get("decisions", 0),
            }
        )
    fixed = [r for r in rows if r["config"].startswith("k=")]
    best = max(fixed, key=lambda r: r["speedup"])
    doc = {
        "rows": rows,
        "best_fixed": best["config"],
        "lambda_ms": lam,
        "cost_model": fit.model.to_json(),
        "prompts": test_ids,
        "max_new_tokens": mnt,
        "args": vars(args),
    }
    (out / "speedup.json").write_text(json.dumps(doc, indent=2, default=float))
    print("| config | wall s (median) | walls | tokens/s | speedup vs plain | vs best fixed | lossless | capped |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['wall_s']:.2f} | {r['walls']} | {r['tok_per_s']:.1f} | {r['speedup']:.3f} | "
            f"{r['speedup'] / best['speedup']:.3f} | {r['lossless']} | {r['capped']} |"
        )
    print(f"best fixed: {best['config']} ({best['speedup']:.3f}); oracle lambda on the vLLM cost model: {lam:.3f} ms")


def main() -> None:
    """Command line (see the module docstring)."""
    if len(sys.argv) >= 2 and sys.argv[1] == "_run":
        res = run_config(json.loads(sys.argv[2]))
        Path(sys.argv[3]).write_text(json.dumps(res, default=float))
        return
    ap = argparse.ArgumentParser(prog="python -m scripts.vllm_bench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overhead", help="controller and recorder overhead on throughput")
    o.add_argument("--out", required=True)
    o.add_argument("--models", default="small-moe-v1")
    o.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    o.add_argument("--batch", type=int, default=4, help="max_num_seqs")
    o.add_argument("--prompts", type=int, default=8)
    o.add_argument("--tokens", type=int, default=96)
    o.add_argument("--reps", type=int, default=3)
    o.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of the three processes")
    f = sub.add_parser("floor", help="the draft floor: a k = 0 step against a plain engine's step")
    f.add_argument("--out", required=True)
    f.add_argument("--models", default="small-moe-v1")
    f.add_argument("--batch", type=int, default=1, help="max_num_seqs")
    f.add_argument("--prompts", type=int, default=8)
    f.add_argument("--tokens", type=int, default=64)
    f.add_argument("--reps", type=int, default=2)
    f.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of the five processes")
    s = sub.add_parser("speedup", help="delta-space rule vs fixed k vs plain decoding, B = 1")
    s.add_argument("--out", required=True)
    s.add_argument("--models", default="small-moe-v1")
    s.add_argument("--dataset", default="live-cpu")
    s.add_argument("--kmax", type=int, default=None)
    s.add_argument("--prompts", type=int, default=0, help="at most this many test prompts (0 = all)")
    s.add_argument("--tokens", type=int, default=0, help="max_new_tokens (0 = the dataset's)")
    s.add_argument("--reps", type=int, default=1, help="timed passes per process (after one warm-up pass)")
    s.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every configuration")
    args = ap.parse_args()
    {"overhead": overhead, "floor": floor, "speedup": speedup}[args.cmd](args)


if __name__ == "__main__":
    main()
