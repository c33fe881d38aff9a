"""Measurements of the vLLM integration on this machine: controller/recorder overhead, live speedups.

Run ``python -m scripts.vllm_bench overhead --out DIR`` and ``python -m scripts.vllm_bench speedup
--out DIR`` (in the ``vllm`` environment; ``floor`` and ``speedup`` run each configuration in a fresh
process, one engine at a time, ``overhead`` keeps one engine per arm alive; several minutes each).
Results go to ``DIR/*.json`` and a Markdown table on stdout.

``floor``: the draft floor, a k = 0 step against a plain engine's step (:func:`floor`).

``overhead``: the specenv path (controller + routing tap + recorder + a numpy MLP policy that always answers
k) against stock vLLM at the same ``num_speculative_tokens = k``, in one run: every arm is one engine kept
alive in its own process, and per batch size (``--batch 1,8,16``) the arms run interleaved, the order
rotated per repeat, on the same ``--groups x batch`` prompts. Printed per batch size: ms per engine step,
tokens/s, each arm's throughput over stock's with a paired 95% bootstrap CI over (repeat, request group)
cells, stock's own repeat-to-repeat spread, the controller's CPU time per step as a share of the step, and
the machine load before and after. More arms (``--arms``): ``stock2`` (a second stock engine: the
engine-to-engine spread), ``specenv-kmax`` (``num_speculative_tokens = --kmax``, ``draft_horizon="policy"``:
as the learned arms are served), ``base`` (the same path from another source tree, ``--base-src``:
before/after a change in one run) and ablations (``ctl``: no recorder; ``ctl-notap``: no recorder, no tap;
``nolazy``: vLLM's own drafter; ``base-kmax``: ``specenv-kmax`` from ``--base-src``; ``kmax-2call``: ``specenv-kmax``
with the horizon asked by a second policy call per step, ``horizon_one_call=False``)::

    python -m scripts.vllm_bench overhead --out DIR --models wide-moe-v1 --k 3 --batch 1,8,16 \
        --groups 3 --tokens 48 --repeats 5 --arms stock,stock2,specenv

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
import os
import re
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


#: Arms of ``overhead`` (``--arms``): the engine configuration and policy of each, built by :func:`_overhead_arms`.
OVERHEAD_ARMS = (
    "stock",
    "stock2",
    "specenv",
    "base",
    "specenv-kmax",
    "base-kmax",
    "kmax-2call",
    "ctl",
    "ctl-notap",
    "nolazy",
    "norec",
)


def _overhead_arms(args: argparse.Namespace, out: Path) -> dict[str, tuple[dict[str, Any], dict[str, Any] | None]]:
    """``{arm: (engine cfg, policy description or None)}`` of the ``overhead`` arms asked for.

    * ``stock``: stock vLLM, ``num_speculative_tokens = k``, stock scheduler (``async_scheduling=False``);
      ``stock2`` a second engine of the same configuration (engine-to-engine spread);
    * ``specenv``: the served path at the same k: controller + routing tap + recorder (+ the lazy drafter,
      on by default on CPU), a numpy MLP policy that always answers k (``constant-mlp``);
    * ``specenv-kmax``: the same with ``num_speculative_tokens = --kmax`` and ``draft_horizon="policy"``
      (how the learned arms are served: the drafter is asked for k through ``num_spec_tokens_to_schedule``);
    * ``base``: ``specenv`` run by another source tree (``--base-src``, e.g. an export of the commit before a
      change: ``git archive REV | tar -x -C DIR``), through its ``specenv.abtest`` engine process: before/after
      in one run; ``base-kmax`` the ``specenv-kmax`` arm run by that tree;
    * ``kmax-2call``: ``specenv-kmax`` with ``horizon_one_call=False`` (the horizon asked by a second policy
      call at ``schedule``, as before the one-call path);
    * ablations of ``specenv``: ``ctl`` (no recorder), ``ctl-notap`` (no recorder, no tap: prior U_r),
      ``nolazy`` (vLLM's drafter instead of the lazy one), ``norec`` (= ``ctl``, kept for symmetry of names);
    * any arm's name followed by a number (``stock3``, ``ctl2``): another engine of that arm (the spread between
      identical engines beside the difference between paths).
    """
    k = args.k
    base = {"models": args.models, "max_num_seqs": max(args.batch), "max_model_len": 1024}
    pol = {"kind": "constant-mlp", "k": k, "kmax": k, "max_new_tokens": args.tokens}
    rec = {"record": str(out / "rec"), "run": "overhead", "max_new_tokens": args.tokens}
    arms: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
        "stock": ({**base, "k": k, "controller": False}, None),
        "stock2": ({**base, "k": k, "controller": False}, None),
        "specenv": ({**base, "k": k, "settings": rec}, pol),
        "base": ({**base, "k": k, "settings": {**rec, "record": str(out / "rec-base")}}, pol),
        "specenv-kmax": (
            {**base, "k": args.kmax, "settings": {**rec, "record": str(out / "rec-kmax"), "draft_horizon": "policy"}},
            {**pol, "kmax": args.kmax},
        ),
        "base-kmax": (
            {
                **base,
                "k": args.kmax,
                "settings": {**rec, "record": str(out / "rec-base-kmax"), "draft_horizon": "policy"},
            },
            {**pol, "kmax": args.kmax},
        ),
        "kmax-2call": (
            {
                **base,
                "k": args.kmax,
                "settings": {
                    **rec,
                    "record": str(out / "rec-kmax-2call"),
                    "draft_horizon": "policy",
                    "horizon_one_call": False,
                },
            },
            {**pol, "kmax": args.kmax},
        ),
        "ctl": ({**base, "k": k}, pol),
        "norec": ({**base, "k": k}, pol),
        "ctl-notap": ({**base, "k": k, "tap": False}, pol),
        "nolazy": ({**base, "k": k, "settings": {**rec, "record": str(out / "rec-nolazy"), "lazy_draft": False}}, pol),
    }
    for a in args.arms:  # another engine of an arm: its name and a number (stock3, ctl2), its own recording
        m = re.fullmatch(r"(\D.*?)(\d+)", a)
        if a not in arms and m and m.group(1) in arms:
            cfg, p = arms[m.group(1)]
            if "record" in cfg.get("settings", {}):
                cfg = {**cfg, "settings": {**cfg["settings"], "record": str(out / f"rec-{a}")}}
            arms[a] = (cfg, p)
    unknown = [a for a in args.arms if a not in arms]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {', '.join(OVERHEAD_ARMS)}")
    if any(a.startswith("base") for a in args.arms) and not args.base_src:
        raise SystemExit("arms base and base-kmax need --base-src DIR")
    if "stock" not in args.arms:
        raise SystemExit("--arms needs stock (the reference)")
    return {a: arms[a] for a in args.arms}


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


def overhead(args: argparse.Namespace) -> None:
    """The specenv path against stock vLLM at the same k, interleaved in one run, per batch size.

    Every arm is one engine kept alive in its own process (:class:`specenv.engines.vllm.bench.EngineProcess`,
    all started before anything is measured), so the arms run interleaved: per batch size, ``--repeats``
    repeats, each running every arm once on the same ``--groups x batch`` prompts (``batch`` concurrent
    requests per group, greedy, ``--tokens`` tokens each, ``ignore_eos``), the arms' order rotated per
    repeat; one untimed pass per arm and batch size first. Reported per batch size: ms per engine step and
    tokens/s (medians over repeats), each arm's throughput over stock's paired by (repeat, group) with a
    95% bootstrap CI (:func:`specenv.abtest._paired`), stock's own repeat-to-repeat spread, the
    controller's CPU time per step as a share of the step (:func:`specenv.abtest._pooled`: the
    controller's step log), whether every output equals stock's, and the machine load before and after.
    """
    from specenv.abtest import _paired, _pooled
    from specenv.engines.vllm.bench import EngineProcess

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = _overhead_arms(args, out)
    t_start = time.time()
    print(f"# vllm_bench overhead: models {args.models}, k={args.k}, arms {list(arms)}, batches {args.batch}, "
          f"{args.groups} groups x batch prompts x {args.tokens} tokens, {args.repeats} repeats; {_load()}",
          flush=True)  # fmt: skip
    engines: dict[str, EngineProcess] = {}
    doc: dict[str, Any] = {"args": vars(args), "batches": {}, "engines": {}}
    try:
        for name, (cfg, pol) in arms.items():
            t0 = time.time()
            module, env = "scripts.vllm_bench", None
            if name.startswith("base"):  # the other tree's own engine process (its scripts/ may not have one)
                module, env = "specenv.abtest", {"PYTHONPATH": str(Path(args.base_src).resolve())}
            eng = engines[name] = EngineProcess(module, cfg, out / f"engine-{name}.log", env=env)
            doc["engines"][name] = info = eng.ready()
            if pol is not None:
                eng.call(op="policy", policy=pol)
            eng.call(op="run", prompt_ids=[0], max_tokens=8, batch=1, ignore_eos=True)  # warm-up
            print(f"  engine {name} up in {time.time() - t0:.0f} s (rss {info['rss_mb']:.0f} MB)", flush=True)
        names = list(arms)
        for b in args.batch:
            ids = list(range(args.groups * b))
            load0 = _load()
            for eng in engines.values():  # untimed pass at this batch size
                eng.call(op="run", prompt_ids=ids[:b], max_tokens=args.tokens, batch=b, ignore_eos=True)
            res: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            t_b = time.time()
            for rep in range(args.repeats):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    res[name].append(
                        engines[name].call(op="run", prompt_ids=ids, max_tokens=args.tokens, batch=b, ignore_eos=True)
                    )
            doc["batches"][str(b)] = summary = _overhead_batch(res, _paired, _pooled)
            summary.update(load_before=load0, load_after=_load(), seconds=time.time() - t_b)
            for n, rs in res.items():  # keep the passes (without outputs) for later analysis
                summary["arms"][n]["passes"] = [{k: v for k, v in r.items() if k not in ("outputs",)} for r in rs]
            _print_overhead_batch(b, summary)
            (out / "overhead.json").write_text(json.dumps(doc, indent=2, default=float))
    finally:
        for eng in engines.values():
            eng.close()
    print(f"# done in {time.time() - t_start:.0f} s; {_load()}; {out / 'overhead.json'}")


def _overhead_batch(res: dict[str, list[dict[str, Any]]], paired: Any, pooled: Any) -> dict[str, Any]:
    """One batch size's figures of ``overhead`` (see :func:`overhead`)."""
    stock = res["stock"]
    s_tps = [r["tok_per_s"] for r in stock]
    med = statistics.median(s_tps)
    ref = stock[0]["outputs"]
    out: dict[str, Any] = {
        "stock_spread": (max(s_tps) - min(s_tps)) / med,
        "stock_cv": statistics.stdev(s_tps) / statistics.mean(s_tps) if len(s_tps) > 1 else None,
        "arms": {},
    }
    for name, rs in res.items():
        # an engine of an older tree does not count its steps: stock's (the same outputs, the same steps)
        ms = [1e3 * r["wall_s"] / max(r.get("steps", s.get("steps", 0)), 1) for r, s in zip(rs, stock, strict=False)]
        ctl = pooled([r for r in rs if r.get("overhead", {}).get("steps")])
        out["arms"][name] = {
            "ms_per_step": statistics.median(ms),
            "ms_per_step_all": ms,
            "tok_per_s": statistics.median(r["tok_per_s"] for r in rs),
            "steps": rs[0].get("steps"),
            "tokens": rs[0]["tokens"],
            "vs_stock": None if name == "stock" else paired(rs, stock),
            "ctl_cpu": None if ctl is None else {k: v for k, v in ctl.items()},
            "identical": all(r["outputs"] == ref for r in rs),
            "fallbacks": sum(r.get("fallbacks", 0) for r in rs),
        }
    return out


def _print_overhead_batch(b: int, s: dict[str, Any]) -> None:
    print(f"\n## batch {b} ({s['seconds']:.0f} s; before: {s['load_before']}; after: {s['load_after']})")
    print(f"stock's own spread over repeats: {s['stock_spread']:.1%} (max-min)/median, CV {s['stock_cv'] or 0:.1%}")
    print(
        "| arm | ms/step | tok/s | steps | vs stock [95% CI] (per repeat) | ctl CPU/step [95% CI] | ctl ms/step |",
        end="",
    )
    print(" same |")
    print("|---|---|---|---|---|---|---|---|")
    for name, a in s["arms"].items():
        p = a["vs_stock"]
        vs = "1 (reference)"
        if p:
            reps = ", ".join(f"{x:.3f}" for x in p["per_repeat"])
            vs = f"{p['ratio']:.4f} [{p['ci95'][0]:.4f}, {p['ci95'][1]:.4f}] ({reps})"
        c = a["ctl_cpu"]
        cpu = f"{c['value']:.2%} [{c['ci95'][0]:.2%}, {c['ci95'][1]:.2%}]" if c else "-"
        cms = f"{c['cpu_ms_per_step']:.3f} of {c['step_ms']:.1f}" if c else "-"
        print(f"| {name} | {a['ms_per_step']:.2f} | {a['tok_per_s']:.1f} | {a['steps']} | {vs} | {cpu} | {cms} | "
              f"{'yes' if a['identical'] else 'NO'} |")  # fmt: skip
    sys.stdout.flush()


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
    if len(sys.argv) == 3 and sys.argv[1] == "_engine":  # an engine process of ``overhead``
        from specenv.engines.vllm.bench import worker_main

        worker_main(sys.argv[2], _make_policy)
        return
    if len(sys.argv) >= 2 and sys.argv[1] == "_run":
        res = run_config(json.loads(sys.argv[2]))
        Path(sys.argv[3]).write_text(json.dumps(res, default=float))
        return
    ap = argparse.ArgumentParser(prog="python -m scripts.vllm_bench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overhead", help="the specenv path vs stock vLLM at the same k, interleaved, per batch size")
    o.add_argument("--out", required=True)
    o.add_argument("--models", default="wide-moe-v1")
    o.add_argument("--k", type=int, default=3, help="num_speculative_tokens of stock and the fixed k of the policy")
    o.add_argument("--kmax", type=int, default=8, help="num_speculative_tokens of the specenv-kmax arm")
    o.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16])
    o.add_argument("--groups", type=int, default=3, help="request groups per pass (prompts = groups x batch)")
    o.add_argument("--tokens", type=int, default=48)
    o.add_argument("--repeats", type=int, default=5)
    o.add_argument("--base-src", default=None, help="source tree of the base arm")
    o.add_argument(
        "--arms",
        type=lambda s: s.split(","),
        default=["stock", "specenv"],
        help=f"of {OVERHEAD_ARMS}; an arm and a number (stock3, ctl2): another engine of it",
    )
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
