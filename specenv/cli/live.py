"""Live engines: ``specenv collect`` (record a trace set), ``abtest`` (live A/B through vLLM) and ``models``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from specenv.cli.common import (
    MAX_GENERATIONS,
    VLLM_HINT,
    JsonOpt,
    check_budget,
    check_name,
    check_out_folder,
    check_traceset_out,
    fail,
    load_traces,
    out,
    print_json,
)
from specenv.progress import Progress


def collect(
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the trace set to.")],
    engine: Annotated[
        str,
        typer.Option(help="Engine: hf (transformers, CPU) or vllm (vLLM in process; needs the vllm extra)."),
    ] = "hf",
    prompts: Annotated[str, typer.Option(help="Prompt set: shipped name or JSON file.")] = "stdlib-code-v1",
    n_prompts: Annotated[
        int, typer.Option("--n-prompts", "-n", min=1, max=MAX_GENERATIONS, help="First N prompts of the set.")
    ] = 64,
    kmax: Annotated[int, typer.Option(min=1, max=16, help="Fixed-K runs K=0..Kmax; sweep chain length.")] = 8,
    max_new_tokens: Annotated[int, typer.Option(min=2, max=32768, help="Tokens generated per prompt.")] = 128,
    threads: Annotated[int, typer.Option(min=1, max=1024, help="Torch threads of the engine.")] = 1,
    clock: Annotated[
        str | None,
        typer.Option(
            help="T_T/T_D clock: cpu (thread CPU time, needs 1 thread) or wall (on cuda: CUDA events). "
            "Default: cpu on cpu, wall on cuda."
        ),
    ] = None,
    models: Annotated[
        str | None, typer.Option(help="Model set: shipped name or folder (default small-moe-v1).")
    ] = None,
    target: Annotated[
        Path | None,
        typer.Option(help="vllm only: a Hugging Face MoE target folder (config, weights, tokenizer); with --draft."),
    ] = None,
    draft: Annotated[
        Path | None,
        typer.Option(help="vllm only: the draft's folder (a model of the target's vocabulary, or an EAGLE-3 head)."),
    ] = None,
    method: Annotated[
        str | None, typer.Option(help="vllm only: the draft's speculative method, draft_model (default) or eagle3.")
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda (vllm: the installed vLLM build's device).")] = "cpu",
    gpu_memory_utilization: Annotated[
        float,
        typer.Option(min=0.05, max=1.0, help="vllm on cuda: fraction of the GPU both engines together use."),
    ] = 0.9,
    name: Annotated[
        str | None, typer.Option(help="Name written to the manifest (default: live-cpu for hf, live-vllm for vllm).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
    caps: Annotated[
        str | None,
        typer.Option(
            help="Expert caps (hf only; trace extension caps-v1): 'auto' (quartiles of the train split's "
            "per-layer expert union at K=Kmax) or ascending caps 'B1,B2,...'; adds capped runs and a capped "
            "verification pass per (position, k, cap)."
        ),
    ] = None,
    temperature: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=100.0,
            help="vllm only: 0 = greedy (rho in {0,1}); T > 0 = sampling at T: reference sampled by the target, "
            "draft chains sampled from the draft at T, rho = min(1, p/q) from the two models' probabilities.",
        ),
    ] = 0.0,
    seed: Annotated[
        int, typer.Option(min=0, max=2**31 - 1, help="vllm, T > 0: seed of the sampling (per generation streams).")
    ] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Record a trace set with a live engine: fixed-K rounds (K=0..Kmax) and the counterfactual sweep."""
    if engine not in ("hf", "vllm"):
        fail(f"--engine: unknown engine '{engine}' (known: hf, vllm)")
    if temperature > 0 and engine != "vllm":
        fail(f"--temperature {temperature:g}: sampled trace sets are collected by --engine vllm only (hf is greedy)")
    if temperature > 0 and caps is not None:
        fail("--caps: the expert-cap columns are greedy verdicts; collect them at --temperature 0")
    cap_grid = _parse_caps(caps, engine)
    clock = clock or ("wall" if device == "cuda" else "cpu")
    if clock not in ("cpu", "wall"):
        fail(f"--clock: unknown clock '{clock}' (known: cpu, wall)")
    if clock == "cpu" and threads != 1:
        fail("--clock cpu measures the calling thread only: use --threads 1 or --clock wall")
    name = name or ("live-cpu" if engine == "hf" else "live-vllm")
    check_name("--name", name)
    check_traceset_out(out_dir, overwrite)
    from specenv.engines.hf.models import load_prompts, model_dir

    pair = _model_pair(engine, models, target, draft, method, device)
    models = models or "small-moe-v1"
    if pair is None:
        try:
            model_dir(models)
        except ValueError as exc:
            fail(f"--models: {exc}")
    try:
        plist = load_prompts(prompts)
    except ValueError as exc:
        fail(f"--prompts: {exc}")
    if n_prompts > len(plist):
        fail(f"--n-prompts: {n_prompts} exceeds the {len(plist)} prompts of {prompts}")
    plist = plist[:n_prompts]
    common = dict(kmax=kmax, max_new_tokens=max_new_tokens, threads=threads, name=name, prompt_set=prompts, clock=clock)
    if cap_grid is not None:
        common["caps"] = cap_grid
    try:
        if engine == "hf":
            from specenv.engines.hf.collect import collect_live as run
            from specenv.engines.hf.models import load_models

            mdl: Any = load_models(models)
        else:
            import vllm.v1.engine  # noqa: F401 - fail early with the install hint (a bare "vllm" may be a folder)

            from specenv.engines.vllm.collect import collect_vllm as run

            mdl = pair if pair is not None else models
            common |= {"device": device, "gpu_memory_utilization": gpu_memory_utilization}
            if temperature > 0:  # a greedy collection passes exactly what it always passed
                common |= {"temperature": temperature, "seed": seed}
            _check_vllm(mdl, device, clock)
    except ImportError as exc:
        hint = "pip install -e '.[live]' (make venv does)" if engine == "hf" else VLLM_HINT
        fail(f"--engine {engine}: {exc}; {hint}")
    try:
        with Progress("collect", total=len(plist), unit="prompts") as prog:
            ts = run(mdl, plist, progress=lambda done, total: prog.update(done, total), **common)
    except ValueError as exc:
        fail(str(exc))
    ts.save(out_dir, overwrite=overwrite)
    summary = {
        "path": str(out_dir),
        "engine": engine,
        **ts.manifest.counts,
        "kmax": kmax,
        **({"temperature": temperature, "seed": seed} if temperature > 0 else {}),
        "lossless_mismatches": ts.manifest.extra["lossless"]["mismatched_runs"],
        "wall_seconds": ts.manifest.extra["wall_seconds"],
        **({"caps": ts.manifest.caps} if ts.manifest.caps else {}),
    }
    if as_json:
        print_json(summary)
    else:
        out.print(f"wrote {out_dir}: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k != "path"))


def _check_vllm(models: Any, device: str, clock: str) -> None:
    """The vLLM collector's refusals that need no engine (device, clock, model runner and method): exit 2."""
    from specenv.engines.vllm.collect import check_collect
    from specenv.engines.vllm.models import vllm_model_dirs

    try:
        check_collect(vllm_model_dirs(models), device, clock)
    except ValueError as exc:
        fail(str(exc))


def _model_pair(
    engine: str, models: str | None, target: Path | None, draft: Path | None, method: str | None, device: str
) -> Any:
    """The ``--target``/``--draft``/``--method`` pair of ``collect`` (None when a model set names the models).

    Exits 2 with one line on a combination that names the models twice or half, or on folders that are
    not a MoE target and a draft of its vocabulary (:func:`specenv.engines.vllm.models.vllm_pair_dirs`).
    """
    if device not in ("cpu", "cuda"):
        fail(f"--device: unknown device '{device}' (known: cpu, cuda)")
    if engine == "hf":
        if device != "cpu":
            fail(f"--device {device}: the hf engine runs on cpu only (use --engine vllm)")
        for opt, val in (("--target", target), ("--draft", draft), ("--method", method)):
            if val is not None:
                fail(f"{opt}: vllm only (the hf engine loads a model set: --models)")
        return None
    from specenv.engines.vllm.support import METHODS

    if method is not None and method not in METHODS:
        fail(f"--method: unknown method '{method}' (known: {', '.join(METHODS)})")
    if target is None and draft is None:
        if method not in (None, "draft_model"):
            fail(f"--method {method}: a model set's draft is a draft_model; name an EAGLE-3 head with --target/--draft")
        return None
    if models is not None:
        fail("--models and --target/--draft: name the models one way")
    if target is None or draft is None:
        fail(f"--{'draft' if draft is None else 'target'}: needed with --{'target' if draft is None else 'draft'}")
    from specenv.engines.vllm.models import vllm_pair_dirs

    try:
        return vllm_pair_dirs(target, draft, method or "draft_model")
    except ValueError as exc:
        fail(f"--target/--draft: {exc}")


def _parse_caps(caps: str | None, engine: str) -> list[int] | str | None:
    """The ``--caps`` option of ``collect``: None, ``"auto"`` or ascending positive caps (exits 2 otherwise)."""
    if caps is None:
        return None
    if engine != "hf":
        fail(f"--caps: the expert cap runs in the hf engine only (vLLM's router cannot cap; got --engine {engine})")
    if caps == "auto":
        return "auto"
    try:
        grid = [int(x) for x in caps.split(",")]
    except ValueError:
        fail(f"--caps: expected 'auto' or comma-separated whole numbers like 9,12,16 (got {caps!r})")
    if any(b < 1 for b in grid) or any(b >= a for a, b in zip(grid[1:], grid[:-1], strict=False)):
        fail(f"--caps: caps must be positive and strictly ascending (got {caps!r})")
    from specenv.validation import CAP_LEVELS_MAX

    if len(grid) > CAP_LEVELS_MAX:
        fail(f"--caps: {len(grid)} caps given, a trace set holds at most {CAP_LEVELS_MAX} cap levels (caps-v1)")
    return grid


def abtest(
    models: Annotated[str, typer.Option(help="Model set served by vLLM: shipped name or folder.")] = "small-moe-v1",
    traces: Annotated[
        str,
        typer.Option(
            "--traces",
            help="Trace set of the same models: its test-split prompts are served, its train split fits "
            "the policies and the replay predicts the speedups.",
        ),
    ] = "live-cpu",
    prompts: Annotated[int, typer.Option(min=1, max=MAX_GENERATIONS, help="Held-out (test-split) prompts.")] = 8,
    cycle_prompts: Annotated[
        bool,
        typer.Option(
            help="Let --prompts exceed the test split: the held-out prompts are served in turn, so a batch "
            "larger than the split still fills (never a train prompt)."
        ),
    ] = False,
    train_prompts: Annotated[
        int, typer.Option(min=1, max=MAX_GENERATIONS, help="Train prompts for --fit measured.")
    ] = 8,
    fit_repeats: Annotated[
        int,
        typer.Option(
            min=1,
            max=20,
            help="Interleaved passes of the train prompts per k and batch size for --fit measured; a k is "
            "chosen over no speculation only if it beat plain in every pass.",
        ),
    ] = 1,
    fit_kmax: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Largest k the measured fit tries (k = 0..this; default: --kmax): fewer train runs where a "
            "larger k is known not to pay; the arms keep --kmax.",
        ),
    ] = None,
    fit_from: Annotated[
        Path | None,
        typer.Option(
            help="Reuse the train fit (best k per batch size) of an earlier abtest.json of the same models, "
            "trace set and kmax instead of measuring it again."
        ),
    ] = None,
    step_model: Annotated[
        str | None,
        typer.Option(
            help="The batch step-time model that predicts every batch size: a shipped recording's name, a "
            "recording folder (scripts/collect_vllm_batch.py --plain, then specenv batch fit --timing step: one "
            "made on this machine) or its batchcost.json. Default: the newest shipped recording of --models."
        ),
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, max=4096, help="Tokens generated per prompt.")] = 64,
    repeats: Annotated[int, typer.Option(min=1, max=100, help="Interleaved repeats (median); >= 3 for the A/B.")] = 3,
    batch: Annotated[str, typer.Option(help="Comma-separated batch sizes (concurrent requests), e.g. 1,8.")] = "1,8",
    arms: Annotated[
        str,
        typer.Option(
            help="Comma-separated arm groups: plain, fixed, best, dynamic, table, adaptive, heuristic, delta, "
            "learned, gated (the learned policies switched off where the train-fitted table says k = 0 for the "
            "step's batch size), outcome (the learned policies without a lookahead block, their drafts set once "
            "the target verified: draft_horizon=outcome), overhead, batch, survival, or all (every one of these); "
            "fixedctl (every fixed k through specenv's controller, on the learned arms' engine) only when named. "
            "Plain is always run (the reference)."
        ),
    ] = "all",
    kmax: Annotated[int | None, typer.Option(min=1, max=64, help="Largest k (default: the trace set's Kmax).")] = None,
    fit: Annotated[
        str, typer.Option(help="How best fixed k and vLLM's dynamic-SD table are chosen: measured (train) or replay.")
    ] = "measured",
    cost_model: Annotated[
        str,
        typer.Option(
            help="Replay cost model: fit-train (of the prompt set's traces), vllm (fitted on vLLM's own "
            "recorded rounds: target forward time only, it misses vLLM's per-step overhead), fit or a JSON."
        ),
    ] = "fit-train",
    policy_dir: Annotated[
        list[Path] | None, typer.Option(help="Another folder of trained policies (repeatable).")
    ] = None,
    learned: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated names of the learned policies the learned and gated arms run (e.g. "
            "live-vllm-wide-v1/ppo; default: every one the served model accepts)."
        ),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Folder for logs, the recording and abtest.json (default: temp).")
    ] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Generate max_tokens tokens even past the end of text.")] = False,
    max_engines: Annotated[
        int | None,
        typer.Option(
            min=2,
            max=64,
            help="Most engines alive at once (default: as many as 70% of the available memory holds); the "
            "least recently used one is closed and restarted when needed, the arms stay interleaved.",
        ),
    ] = None,
    interleave: Annotated[
        str,
        typer.Option(
            help="What the arms alternate in when every engine stays up: 'group' (each group of --batch "
            "requests run by every arm in turn; a pass is joined from its groups) or 'pass' (whole passes).",
        ),
    ] = "group",
    warmup_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            max=4096,
            help="Before a timed run on an engine other than the last run's, decode this many tokens of the "
            "run's first prompt on it, untimed (0: off): the engines are measured as a server that is serving.",
        ),
    ] = 16,
    as_json: JsonOpt = False,
) -> None:
    """Live A/B through vLLM: plain, every fixed k, best fixed k (train), vLLM's dynamic SD, heuristics, learned.

    Every engine runs in its own process and stays up; the arms run interleaved, repeated, at every
    batch size, on the trace set's held-out prompts. Prints one table: tokens/s, live speedup over
    plain, the replay's predicted speedup, live/predicted, outputs identical to plain greedy, and the
    controller's CPU per step; plus the specenv path's overhead against stock vLLM. Needs the vllm extra.
    """
    from specenv.abtest import ALL_GROUPS, ARM_GROUPS, FIT_MODES, INTERLEAVE, AbtestOptions

    try:
        parts = batch.split(",")
        if any(not x.strip() for x in parts):  # "1,,8" or a trailing comma: a typo, never a silent skip
            raise ValueError(batch)
        batches = sorted({int(x) for x in parts})
    except ValueError:
        fail(f"--batch: {batch!r} is not a comma-separated list of integers")
    if not batches or min(batches) < 1 or max(batches) > 256:
        fail(f"--batch: {batch!r}: give batch sizes in 1..256")
    groups = [a.strip() for a in arms.split(",") if a.strip()]
    if groups == ["all"]:
        groups = list(ALL_GROUPS)
    bad = [g for g in groups if g not in ARM_GROUPS]
    if bad or not groups:
        fail(f"--arms: unknown arm group {bad[0] if bad else arms!r} (known: {', '.join(ARM_GROUPS)}, all)")
    if fit not in FIT_MODES:
        fail(f"--fit: unknown mode {fit!r} (known: {', '.join(FIT_MODES)})")
    if interleave not in INTERLEAVE:
        fail(f"--interleave: unknown unit {interleave!r} (known: {', '.join(INTERLEAVE)})")
    if out_dir is not None:
        check_out_folder("--out", out_dir)
    for d in policy_dir or []:
        if not d.is_dir():
            fail(f"--policy-dir: {d} is not a folder")
    names: list[str] | None = None
    if learned is not None:
        from specenv.abtest import learned_policies

        names = list(dict.fromkeys(n.strip() for n in learned.split(",")))
        known = learned_policies(traces, [str(d) for d in policy_dir or []])
        bad = [n for n in names if n not in known]
        if not names or bad:
            fail(
                f"--learned: unknown policy {bad[0] if bad else learned!r} "
                f"(known for --traces {traces}: {', '.join(sorted(known)) or 'none'})"
            )
    ts = load_traces(traces)
    k = check_budget(ts, kmax)
    if fit_kmax is not None and fit_kmax > k:
        fail(f"--fit-kmax: {fit_kmax} exceeds the run's kmax {k}")
    from specenv.replay.tables import SelectionError, select_positions

    try:
        n_test = len(select_positions(ts, k, "test").generation_ids)
        n_train = len(select_positions(ts, k, "train").generation_ids)
    except SelectionError as exc:
        fail(f"--traces: {exc}")
    if prompts > n_test and not cycle_prompts:
        fail(
            f"--prompts: {prompts} exceeds the {n_test} test-split prompts of {traces} "
            "(--cycle-prompts serves them in turn)"
        )
    if train_prompts > n_train:
        fail(f"--train-prompts: {train_prompts} exceeds the {n_train} train-split prompts of {traces}")
    if cost_model not in ("vllm", "fit", "fit-train", "profile"):
        if not Path(cost_model).is_file():
            fail(f"--cost-model: {cost_model!r} is not vllm, fit, fit-train, profile or a cost-model JSON file")
        from specenv.cost.model import CostModel

        try:
            CostModel.load(cost_model)
        except (OSError, ValueError) as exc:
            fail(f"--cost-model: {exc}")
    if step_model is not None:
        from specenv.abtest import step_model_for

        try:
            step_model_for(models, step_model, k, batches)
        except ValueError as exc:
            fail(f"--step-model: {exc}")
    if fit_from is not None:
        from specenv.abtest import fit_from_file

        try:
            fit_from_file(fit_from, models, traces, k, batches, max_tokens)
        except ValueError as exc:
            fail(f"--fit-from: {exc}")
    from specenv.engines.vllm.facts import served_facts, served_refusal
    from specenv.engines.vllm.models import check_model_set

    try:
        served = served_facts(check_model_set(models))
    except ValueError as exc:
        fail(f"--models: {exc}")
    json_cm = cost_model if cost_model not in ("vllm", "fit", "fit-train", "profile") else None
    why = served_refusal(served, num_spec_tokens=k, cost_model=json_cm, traces=ts)
    if why is not None:  # the cost model and the trace set against the served models, before any engine
        fail(why)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        fail(f"specenv abtest needs vLLM: {VLLM_HINT}")
    from specenv.abtest import markdown, run_abtest
    from specenv.engines.vllm.bench import EngineError
    from specenv.progress import is_quiet

    opts = AbtestOptions(
        models=models,
        dataset=traces,
        prompts=prompts,
        cycle_prompts=cycle_prompts,
        train_prompts=train_prompts,
        fit_repeats=fit_repeats,
        fit_kmax=fit_kmax,
        fit_from=None if fit_from is None else str(fit_from),
        step_model=step_model,
        max_tokens=max_tokens,
        repeats=repeats,
        batches=batches,
        arms=groups,
        kmax=k,
        fit=fit,
        cost_model=cost_model,
        policy_dirs=[str(d) for d in policy_dir or []],
        learned=names,
        out=None if out_dir is None else str(out_dir),
        ignore_eos=ignore_eos,
        max_engines=max_engines,
        interleave=interleave,
        warmup_tokens=warmup_tokens,
    )

    def progress(phase: str, done: int, total: int) -> None:
        if prog.phase_name != phase:
            prog.phase(phase, total)
        prog.update(done, total)

    try:
        with Progress("abtest", unit="runs") as prog:
            doc = run_abtest(opts, quiet=is_quiet(), progress=progress)
    except (EngineError, ValueError) as exc:  # a bad trace set, cost model or policy folder: one line
        fail(str(exc))
    if as_json:
        print_json(doc)
    else:
        out.print(markdown(doc), markup=False, highlight=False)


def models(
    as_json: JsonOpt = False,
    build: Annotated[
        str | None,
        typer.Option(
            "--build",
            help="Build a derived model set from its shipped recipe into the cache (e.g. wide-moe-v1: "
            "small-moe-v1 with every expert widened by zeros; deterministic, sha256-checked).",
        ),
    ] = None,
) -> None:
    """List the shipped model sets (for `serve --models` and `collect --models`): sizes and sha256 check."""
    from specenv.engines.hf.models import list_model_sets

    if build is not None:
        from specenv.engines.hf.widen import build_derived_set, derived_ids

        if build not in derived_ids():
            fail(f"--build {build!r}: not a derived model set ({', '.join(derived_ids()) or 'none'})")
        try:
            import safetensors  # noqa: F401
            import torch  # noqa: F401
        except ImportError as exc:
            fail(f"--build needs torch and safetensors (pip install 'specenv[live]'): {exc}")
        try:
            folder = build_derived_set(build)
        except (ValueError, OSError) as exc:
            fail(str(exc))
        out.print(f"built {build} in {folder}", markup=False, highlight=False)
    try:
        rows = [m.to_json() for m in list_model_sets()]
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        print_json(rows)
        return
    for r in rows:
        t, d = r["target"], r["draft"]
        experts = f", {t['experts']} experts top-{t['top_k']}" if "experts" in t else ""
        out.print(
            f"{r['id']}: {r['name']} v{r['version']}; target {t['class']} {t['layers']} layers{experts}, "
            f"{_params(t['params'])} params; draft {d['class']} {d['layers']} layers, {_params(d['params'])} params; "
            f"sha256 {r['sha256']}",
            markup=False,
            highlight=False,
        )
        out.print(f"  {r['description']}", markup=False, highlight=False)


def _params(n: Any) -> str:
    """A parameter count for people (``10.0M``), ``?`` when unknown."""
    if not isinstance(n, int):
        return "?"
    return f"{n / 1e6:.2f}M" if n >= 10**6 else f"{n / 1e3:.0f}k"
