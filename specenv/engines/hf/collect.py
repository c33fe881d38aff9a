"""Record a trace set (schema v2) with the live CPU engine: executed rounds and the counterfactual table.

For every prompt:

1. **Fixed-K runs** K = 0..Kmax (K = 0 first: plain greedy decoding gives the reference output y);
   every round the engine executes becomes a row of the ``rounds`` table (measured ``T_T_ms``,
   ``T_D_ms``, observed ``U_r``, ``E_max``). Greedy speculative decoding is lossless, so every run
   must reproduce y; mismatches are counted in the manifest (``extra.lossless``).
2. **Counterfactual sweep** over y (:meth:`specenv.engines.hf.engine.LiveEngine.sweep`): at every position t
   the draft's greedy chain of Kmax tokens, its teacher-forced verification by the target
   (rho in {0, 1}), the draft's probabilities q, the entropy and top-1/top-2 margin of its
   distribution at every drafted token, and the unique experts U_{t,0..Kmax}; one row of the
   ``positions`` table per (prompt, t).

With expert caps (``caps=``, ``specenv collect --caps``; trace extension caps-v1) the fixed-K runs
are repeated under every cap and the sweep adds one capped verification pass per (position, k, cap);
see :func:`collect_live`.

:func:`recollect_positions` redoes step 2 alone for an existing set (its rounds stay): the migration
of a schema-v1 live set to v2.

Timings: every round is timed twice, by the wall clock (``time.perf_counter``) and by the CPU time
of the calling thread (``time.thread_time``; the engine runs one torch thread, so this is all of its
work). On a shared machine (the project's 2-core boxes run other jobs) the wall clock also counts the
time the process waits for a core, which dominated the noise of the first live sets (OOS MAPE ~25 %,
versus ~5 % on CPU time). ``clock="cpu"`` (the default) therefore puts the CPU times into the schema
columns ``T_T_ms``/``T_D_ms``; both clocks are kept as extra columns either way.

The runs of one prompt are executed back to back, so every K sees the same machine load; the
manifest records the load average before and after. Python's garbage collector is paused during
collection so that its pauses do not land in timed rounds.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from specenv.engines.counterfactual import (
    CLOCKS,
    choose_caps,
    first_difference,
    lossless_summary,
    positions_frame,
    rounds_frame,
    run_provenance,
)
from specenv.engines.hf.engine import LiveEngine
from specenv.engines.hf.models import PROMPT_SET, Prompt, SmallModels, load_models, load_prompts
from specenv.traces.schema import ModelFacts, ent_columns, margin_columns
from specenv.traces.traceset import Manifest, PositionArrays, TraceSet


def collect_live(
    models: SmallModels | None = None,
    prompts: Sequence[Prompt] | None = None,
    n_prompts: int = 64,
    kmax: int = 8,
    max_new_tokens: int = 128,
    threads: int = 1,
    name: str = "live-cpu",
    prompt_set: str = PROMPT_SET,
    progress: Callable[[int, int], None] | None = None,
    clock: str = "cpu",
    caps: Sequence[int] | str | None = None,
) -> TraceSet:
    """Run the live engine over a prompt set and build an in-memory trace set.

    With ``caps`` (trace extension ``caps-v1``, traces/README.md "Expert caps") the collection runs
    in two passes. Pass 1, per prompt: the uncapped fixed-K runs K = 0..kmax (the reference, the
    lossless check, and the per-layer expert unions of the executed K = kmax passes). The cap grid is
    then ``caps`` itself, or for ``"auto"`` :func:`specenv.engines.counterfactual.choose_caps` on the
    unions of the train split's generations (:mod:`specenv.traces.splits`). Pass 2, per prompt: the capped
    fixed-K runs (every cap, K = 1..kmax; rounds column ``cap`` = B, 0 on the uncapped runs; their
    outputs may leave the reference, counted in ``extra.caps.capped_runs``) and the sweep with caps
    (:meth:`specenv.engines.hf.engine.LiveEngine.sweep`).

    Args:
        models: Loaded models (default: the shipped ``small-moe-v1``).
        prompts: Prompts (default: the first ``n_prompts`` of ``prompt_set``).
        n_prompts: Number of prompts when ``prompts`` is None.
        kmax: Largest budget (fixed-K runs K = 0..kmax; chain length of the sweep).
        max_new_tokens: Tokens generated per prompt (fewer if the target emits end-of-text).
        threads: Torch threads of the engine.
        name: Name written to the manifest.
        prompt_set: Name or path of the prompt set (when ``prompts`` is None).
        progress: Called as progress(done, total) after each prompt.
        clock: Which measurement goes into ``T_T_ms``/``T_D_ms``: ``"cpu"`` (thread CPU time,
            ``time.thread_time``; needs ``threads=1``; unaffected by other processes on the machine)
            or ``"wall"`` (``time.perf_counter``). Both are always kept as extra columns
            ``T_T_wall_ms``, ``T_D_wall_ms``, ``T_T_cpu_ms``, ``T_D_cpu_ms``.
        caps: None (no caps), ``"auto"``, or the caps B_1 < ... < B_C (each in 1..n_experts-1).

    Returns:
        A :class:`TraceSet` with both tables (``source="hf"``, ``greedy=True``).

    Raises:
        ValueError: Bad ``clock``/``threads``/``caps`` or no prompts.
    """
    if caps is not None and caps != "auto":
        if isinstance(caps, str):
            raise ValueError(f"caps={caps!r}: expected 'auto' or a list of caps")
        caps = [int(b) for b in caps]
        if not caps or any(b >= a for a, b in zip(caps[1:], caps[:-1], strict=False)):
            raise ValueError(f"caps={caps}: expected a non-empty, strictly ascending list")
    if caps is not None:
        return _collect_with_caps(
            models, prompts, n_prompts, kmax, max_new_tokens, threads, name, prompt_set, progress, clock, caps
        )
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {CLOCKS}")
    if clock == "cpu" and threads != 1:
        raise ValueError(f"clock='cpu' measures the calling thread only: it needs threads=1 (got {threads})")
    models = models or load_models()
    if prompts is None:
        prompts = load_prompts(prompt_set)[:n_prompts]
    if not prompts:
        raise ValueError("no prompts to run")
    eng = LiveEngine(models, kmax=kmax, max_new_tokens=max_new_tokens, threads=threads)
    load_before = os.getloadavg()
    wall0 = time.perf_counter()
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()  # no collector pauses inside timed rounds
    try:
        _warm_up(eng, models.encode(prompts[0].text), kmax)
        round_frames, pos_frames = [], []
        mismatches: list[dict[str, int]] = []
        for i, p in enumerate(prompts):
            rounds, positions = _collect_prompt(eng, models.encode(p.text), p, kmax, clock, mismatches)
            round_frames += rounds
            pos_frames.append(positions)
            if progress:
                progress(i + 1, len(prompts))
    finally:
        eng.close()
        if gc_was:
            gc.enable()
    manifest = _manifest(
        models,
        prompts,
        name=name,
        kmax=kmax,
        max_new_tokens=max_new_tokens,
        threads=threads,
        prompt_set=prompt_set,
        clock=clock,
        mismatches=mismatches,
        load_before=load_before,
        wall=time.perf_counter() - wall0,
    )
    rounds_df = pd.concat(round_frames, ignore_index=True)
    positions = pd.concat(pos_frames, ignore_index=True)
    return TraceSet(manifest, positions, rounds_df)


def _collect_with_caps(
    models: SmallModels | None,
    prompts: Sequence[Prompt] | None,
    n_prompts: int,
    kmax: int,
    max_new_tokens: int,
    threads: int,
    name: str,
    prompt_set: str,
    progress: Callable[[int, int], None] | None,
    clock: str,
    caps: list[int] | str,
) -> TraceSet:
    """:func:`collect_live` with expert caps: the two passes of its docstring."""
    from specenv.traces.splits import split_mask

    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {CLOCKS}")
    if clock == "cpu" and threads != 1:
        raise ValueError(f"clock='cpu' measures the calling thread only: it needs threads=1 (got {threads})")
    models = models or load_models()
    if prompts is None:
        prompts = load_prompts(prompt_set)[:n_prompts]
    if not prompts:
        raise ValueError("no prompts to run")
    if caps != "auto" and caps[-1] >= models.n_experts:
        raise ValueError(f"caps={caps}: every cap must be below n_experts={models.n_experts}")
    eng = LiveEngine(models, kmax=kmax, max_new_tokens=max_new_tokens, threads=threads)
    load_before = os.getloadavg()
    wall0 = time.perf_counter()
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()
    total = 2 * len(prompts)
    try:
        _warm_up(eng, models.encode(prompts[0].text), kmax)
        rounds_by_prompt: list[list[pd.DataFrame]] = []
        references: list[list[int]] = []
        unions: list[np.ndarray] = []
        mismatches: list[dict[str, int]] = []
        for i, p in enumerate(prompts):
            frames, reference, union = _uncapped_runs(eng, models.encode(p.text), p, kmax, clock, mismatches, cap=0)
            rounds_by_prompt.append(frames)
            references.append(reference)
            unions.append(union)
            if progress:
                progress(i + 1, total)
        train = split_mask([p.id for p in prompts], "train")
        if caps == "auto":
            pooled = [u for u, keep in zip(unions, train, strict=True) if keep] or unions
            chosen = choose_caps(np.concatenate(pooled), models.n_experts)
        else:
            chosen = list(caps)
        pos_frames = []
        capped_runs: list[dict[str, Any]] = []
        for i, p in enumerate(prompts):
            ids = models.encode(p.text)
            for B in chosen:
                eng.set_expert_cap(B)
                try:
                    for K in range(1, kmax + 1):
                        out, rounds = eng.generate(ids, K)
                        first = first_difference(out, references[i])
                        capped_runs.append({"generation_id": p.id, "cap": B, "K": K, "first_diff": first})
                        rounds_by_prompt[i].append(rounds_frame(p.id, p.category, K, rounds, clock, cap=B))
                finally:
                    eng.set_expert_cap(None)
            sw = eng.sweep(ids, references[i], kmax, caps=tuple(chosen))
            pos_frames.append(
                positions_frame(
                    p.id, p.category, sw, kmax, extra={"T_T_sweep_ms": sw["T_T_ms"], "T_T_cap_ms": sw["T_T_cap_ms"]}
                )
            )
            if progress:
                progress(len(prompts) + i + 1, total)
    finally:
        eng.close()
        if gc_was:
            gc.enable()
    manifest = _manifest(
        models,
        prompts,
        name=name,
        kmax=kmax,
        max_new_tokens=max_new_tokens,
        threads=threads,
        prompt_set=prompt_set,
        clock=clock,
        mismatches=mismatches,
        load_before=load_before,
        wall=time.perf_counter() - wall0,
    )
    manifest.caps = chosen
    manifest.extensions = ["caps-v1"]
    train_unions = np.concatenate([u for u, keep in zip(unions, train, strict=True) if keep] or unions)
    manifest.extra["caps"] = _caps_note(caps, chosen, train_unions, capped_runs, kmax)
    manifest.extra["extra_columns"]["rounds.cap"] = "expert cap B of the run (0 = none); U_r is the capped union"
    manifest.extra["extra_columns"]["positions.T_T_cap_ms"] = "time of all capped verification passes at t"
    manifest.description += (
        f" Expert caps {chosen} (extension caps-v1): one capped verification pass per (position, k, cap) and "
        f"capped fixed-K runs K=1..{kmax} per cap."
    )
    rounds_df = pd.concat([f for frames in rounds_by_prompt for f in frames], ignore_index=True)
    return TraceSet(manifest, pd.concat(pos_frames, ignore_index=True), rounds_df)


def _caps_note(
    requested: list[int] | str, chosen: list[int], unions: np.ndarray, capped_runs: list[dict[str, Any]], kmax: int
) -> dict[str, Any]:
    """The manifest's ``extra.caps``: how the grid was chosen and how often the capped runs left the reference."""
    from specenv.engines.counterfactual import CAP_QUANTILES

    qs = [0.1, *CAP_QUANTILES, 0.9]
    per_cap = {}
    for B in chosen:
        runs = [r for r in capped_runs if r["cap"] == B]
        diverged = [r for r in runs if r["first_diff"] is not None]
        per_cap[str(B)] = {
            "runs": len(runs),
            "runs_leaving_reference": len(diverged),
            "median_first_difference": float(np.median([r["first_diff"] for r in diverged])) if diverged else None,
        }
    return {
        "rule": "auto: quantiles "
        + ", ".join(map(str, CAP_QUANTILES))
        + f" of the per-layer expert union of the executed K={kmax} uncapped verification passes of the train "
        "split, rounded (specenv.engines.counterfactual.choose_caps)"
        if requested == "auto"
        else "given",
        "caps": chosen,
        "layer_union_quantiles": {str(q): float(np.quantile(unions, q)) for q in qs},
        "layer_union_passes": int(unions.size),
        "capped_runs": per_cap,
        "lossless": "capped runs are not lossless and are not in the lossless check",
    }


def _uncapped_runs(
    eng: LiveEngine, ids: list[int], p: Prompt, kmax: int, clock: str, mismatches: list[dict[str, int]], cap: int
) -> tuple[list[pd.DataFrame], list[int], np.ndarray]:
    """The uncapped fixed-K runs K = 0..kmax of one prompt, with the per-layer unions of its K = kmax passes.

    Returns:
        ``(frames, reference, unions)``: the rounds frames (column ``cap`` = ``cap``), the K = 0
        output, and the union size of every MoE layer of every K = kmax pass (flat int array).
    """
    frames = []
    reference: list[int] = []
    unions: list[np.ndarray] = []
    for K in range(kmax + 1):
        eng.start(ids)
        rounds = []
        while not eng.done:
            rounds.append(eng.step(K))
            if K == kmax:
                r = eng.last_routing
                unions.append(np.array([len(np.unique(r[layer])) for layer in range(r.shape[0])]))
        out = eng.generated
        if K == 0:
            reference = out
        elif (first := first_difference(out, reference)) is not None:
            mismatches.append({"generation_id": p.id, "K": K, "first_diff": int(first)})
        frames.append(rounds_frame(p.id, p.category, K, rounds, clock, cap=cap))
    return frames, reference, np.concatenate(unions) if unions else np.zeros(0, dtype=np.int64)


def _warm_up(eng: LiveEngine, ids: list[int], kmax: int) -> None:
    """Let the allocator, kernels and caches see every shape once before anything is timed."""
    for K in range(kmax + 1):
        eng.start(ids)
        for _ in range(3):
            if not eng.done:
                eng.step(K)


def _collect_prompt(
    eng: LiveEngine, ids: list[int], p: Prompt, kmax: int, clock: str, mismatches: list[dict[str, int]]
) -> tuple[list[pd.DataFrame], pd.DataFrame]:
    """The fixed-K runs K = 0..kmax of one prompt (rounds frames) and its counterfactual sweep (positions).

    Runs that do not reproduce the K = 0 output are appended to ``mismatches``.
    """
    frames = []
    reference: list[int] = []
    for K in range(kmax + 1):
        out, rounds = eng.generate(ids, K)
        if K == 0:
            reference = out
        elif (first := first_difference(out, reference)) is not None:
            mismatches.append({"generation_id": p.id, "K": K, "first_diff": int(first)})
        frames.append(rounds_frame(p.id, p.category, K, rounds, clock))
    return frames, _positions_frame(p, eng.sweep(ids, reference, kmax), kmax)


def _positions_frame(p: Prompt, sw: dict[str, np.ndarray], kmax: int) -> pd.DataFrame:
    """Rows of the positions table of one prompt from its counterfactual sweep (with the sweep's timing)."""
    return positions_frame(p.id, p.category, sw, kmax, extra={"T_T_sweep_ms": sw["T_T_ms"]})


def _manifest(
    models: SmallModels,
    prompts: Sequence[Prompt],
    *,
    name: str,
    kmax: int,
    max_new_tokens: int,
    threads: int,
    prompt_set: str,
    clock: str,
    mismatches: list[dict[str, int]],
    load_before: tuple[float, float, float],
    wall: float,
) -> Manifest:
    """The trace set's manifest: models, prompts, clocks, machine, and the lossless check."""
    import torch
    import transformers

    mm = models.manifest
    n_runs = len(prompts) * kmax
    return Manifest(
        name=name,
        source="hf",
        profile=f"{mm.get('name', 'small-moe')}-v{mm.get('version', 1)} (transformers, CPU, {threads} thread(s))",
        model=ModelFacts(models.n_layers, models.n_experts, models.top_k),
        kmax=kmax,
        greedy=True,
        description=(
            f"Live CPU engine: {len(prompts)} stdlib code prompts x up to {max_new_tokens} greedy tokens on the "
            f"shipped small Qwen3-MoE target ({models.n_experts} experts, top-{models.top_k}, {models.n_layers} "
            f"layers) with a dense Qwen3 draft; fixed-K rounds K=0..{kmax} with measured times and routing; "
            "counterfactual positions from teacher-forced verification of the draft's greedy chains."
        ),
        max_new_tokens=max_new_tokens,
        vocab_size=int(models.draft.config.vocab_size),
        extra={
            "engine": "specenv.engines.hf.engine.LiveEngine",
            "collector": "specenv.engines.hf.collect.collect_live",
            "models": {
                "name": mm.get("name"),
                "version": mm.get("version"),
                "files": {k: v["sha256"] for k, v in mm.get("files", {}).items()},
            },
            "prompt_set": prompt_set if isinstance(prompt_set, str) else str(prompt_set),
            "prompts": [p.id for p in prompts],
            "threads": threads,
            "clock": clock,
            "timing": (
                "T_T_ms/T_D_ms are thread CPU times (time.thread_time, 1 torch thread): the work of the "
                "phase without the time the process was descheduled by other processes"
                if clock == "cpu"
                else "T_T_ms/T_D_ms are wall-clock times (time.perf_counter)"
            ),
            "temperature": 0.0,
            "stop_at_eos": True,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **run_provenance(load_before, wall),
            "lossless": lossless_summary(n_runs, mismatches),
            "extra_columns": {
                "rounds.run": "fixed-K{K}",
                "rounds.T_T_wall_ms, rounds.T_D_wall_ms": "wall-clock time of the phases (time.perf_counter)",
                "rounds.T_T_cpu_ms, rounds.T_D_cpu_ms": "thread CPU time of the same phases "
                "(time.thread_time; excludes time descheduled by other processes)",
                "positions.T_T_sweep_ms": "time of the teacher-forced verification pass (m = Kmax+1)",
            },
            "signals": "ent_j, margin_j: entropy (nats) and top-1 minus top-2 probability of the draft's "
            "softmax at d_j (specenv.engines.hf.engine.draft_signals, float64)",
        },
    )


def recollect_positions(
    ts: TraceSet,
    models: SmallModels | None = None,
    prompt_set: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    keep_columns: bool = True,
    q_tolerance: float = 1e-4,
) -> tuple[TraceSet, dict[str, Any]]:
    """Re-collect the positions table of a live set (reference output + counterfactual sweep); keep its rounds.

    For every generation the greedy reference is decoded again (K = 0) and must have the length the
    old positions table has; the sweep then yields every column of schema v2. The result's
    manifest is the old one with the new positions, ``vocab_size`` and a ``recollected`` note.

    Args:
        ts: A set written by :func:`collect_live` (``source="hf"``): generation ids are prompt ids.
        models: Loaded models (default: the shipped ``small-moe-v1``; must be those of ``ts``).
        prompt_set: Prompt set name or path (default: the one in the manifest).
        progress: Called as progress(done, total) after each generation.
        keep_columns: Keep every column of the old table bit for bit (every figure computed from
            them stays identical) and add the new signal columns, after checking that the new sweep
            reproduces the old rho and U exactly and q to ``q_tolerance`` (float32 softmax on another
            build moves q in the last bits). False takes the new sweep's table as it is (with the
            sweep's new timings ``T_T_sweep_ms``).
        q_tolerance: Largest absolute change of q accepted with ``keep_columns``.

    Returns:
        ``(new_set, report)``: the report counts the cells of rho, q and U that differ from the old
        table.

    Raises:
        ValueError: If the set is not a live set, a prompt is missing, a reference has another
            length, or (``keep_columns``) the sweep does not reproduce the old columns.
    """
    m = ts.manifest
    if m.source != "hf" or not ts.has_positions:
        raise ValueError(f"trace set '{m.name}': not a live set with a positions table (source={m.source!r})")
    models = models or load_models()
    plist = load_prompts(prompt_set or m.extra.get("prompt_set", PROMPT_SET))
    by_id = {p.id: p for p in plist}
    old = ts.arrays()
    eng = LiveEngine(models, kmax=m.kmax, max_new_tokens=m.max_new_tokens, threads=int(m.extra.get("threads", 1)))
    frames = []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        for g, gid in enumerate(old.generation_ids):
            p = by_id.get(int(gid))
            if p is None:
                raise ValueError(f"generation {int(gid)}: no such prompt in the prompt set")
            ids = models.encode(p.text)
            reference, _ = eng.generate(ids, 0)
            n_old = int(old.lengths[g])
            if len(reference) != n_old:
                raise ValueError(f"generation {int(gid)}: reference has {len(reference)} tokens, the set has {n_old}")
            frames.append(_positions_frame(p, eng.sweep(ids, reference, m.kmax), m.kmax))
            if progress:
                progress(g + 1, len(old.generation_ids))
    finally:
        eng.close()
    positions = pd.concat(frames, ignore_index=True)
    new_arrays = PositionArrays.from_frame(positions, m.kmax, m.greedy)
    report = {
        "generations": len(frames),
        "rho_cells_changed": int(np.count_nonzero(new_arrays.rho != old.rho)),
        "q_max_abs_change": float(np.max(np.abs(new_arrays.q - old.q))),
        "U_cells_changed": int(np.count_nonzero(new_arrays.U != old.U)),
        "wall_seconds": round(time.perf_counter() - wall0, 1),
        "cpu_seconds": round(time.process_time() - cpu0, 1),
    }
    if keep_columns:
        if report["rho_cells_changed"] or report["U_cells_changed"] or report["q_max_abs_change"] > q_tolerance:
            raise ValueError(f"the sweep does not reproduce the old rho/q/U of '{m.name}': {report}")
        signals = ent_columns(m.kmax) + margin_columns(m.kmax)
        kept = ts.positions.drop(columns=[c for c in signals if c in ts.positions.columns])
        positions = pd.concat([kept.reset_index(drop=True), positions[signals]], axis=1)
    report["kept_old_columns"] = keep_columns
    extra = dict(m.extra)
    extra["signals"] = (
        "ent_j, margin_j: entropy (nats) and top-1 minus top-2 probability of the draft's softmax at d_j "
        "(specenv.engines.hf.engine.draft_signals, float64)"
    )
    extra["recollected"] = {
        "positions": "re-collected for trace schema v2 by specenv.engines.hf.collect.recollect_positions; "
        "the rounds table is the schema-v1 one",
        **report,
        "torch": __import__("torch").__version__,
    }
    manifest = Manifest(
        name=m.name,
        source=m.source,
        profile=m.profile,
        model=m.model,
        kmax=m.kmax,
        greedy=m.greedy,
        version=m.version,
        description=m.description,
        max_new_tokens=m.max_new_tokens,
        extra=extra,
        vocab_size=int(models.draft.config.vocab_size),
    )
    return TraceSet(manifest, positions, ts.rounds), report
