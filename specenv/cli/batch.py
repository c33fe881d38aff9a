"""The batch family (B concurrent requests): ``specenv batch fit`` and ``specenv batch bench``.

``specenv fit-batch`` and ``specenv bench --batch B`` are aliases of these functions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from specenv.cli.common import (
    MAX_EPISODES,
    JsonOpt,
    KmaxOpt,
    OverwriteOpt,
    SeedOpt,
    TrainCostOpt,
    check_budget,
    check_not_foreign,
    check_out_file,
    check_out_folder,
    fail,
    finish,
    json_format_is,
    load_traces,
    out,
    strict_json,
)
from specenv.progress import Progress


def fit(
    recording: Annotated[
        str,
        typer.Argument(
            metavar="RECORDING",
            help="Steps recording: a folder written by scripts/collect_vllm_batch.py, or 'live-vllm-batch-v1'.",
        ),
    ] = "live-vllm-batch-v1",
    save: Annotated[Path | None, typer.Option("--out", "-o", help="Write the batch cost model JSON here.")] = None,
    timing: Annotated[
        str,
        typer.Option(
            help="cpu (forwards' thread CPU time, default), wall, or step (the step-time model: "
            "needs engine_step_ms and the plain engine's reference)."
        ),
    ] = "cpu",
    verify_form: Annotated[
        str,
        typer.Option(
            help="linear (default) or parity: adds a term per request verifying an even budget k >= 2 "
            "(an odd query of k+1 tokens; BatchCostModel.b_odd_query)."
        ),
    ] = "linear",
    predictors: Annotated[
        str,
        typer.Option(
            help="U_batch predictors the model may choose from, comma-separated (independent, shared, pooled; "
            "default independent,shared)."
        ),
    ] = "independent,shared",
    folds: Annotated[int, typer.Option(min=2, max=1000, help="GroupKFold folds (by group of requests).")] = 5,
    as_json: JsonOpt = False,
    overwrite: OverwriteOpt = False,
) -> None:
    """Fit the batch cost model (verification, draft, U_batch predictors) on recorded vLLM batch steps.

    Prints the coefficients with SEs clustered by group, the verification forms and the U_batch
    predictors with their GroupKFold out-of-sample errors (specenv.cost.batchfit).
    """
    from specenv.cost.batch import FORMAT, PREDICTORS, BatchCostModel
    from specenv.cost.batchfit import MAIN_FORMS, TIMINGS, fit_batch_cost, format_report, load_steps

    if not recording.strip():
        fail("RECORDING: empty (a steps recording folder, or live-vllm-batch-v1)")
    if timing not in TIMINGS:
        fail(f"--timing: {timing!r} is not one of {', '.join(TIMINGS)}")
    if verify_form not in MAIN_FORMS:
        fail(f"--verify-form: {verify_form!r} is not one of {', '.join(MAIN_FORMS)}")
    asked = tuple(p.strip() for p in predictors.split(",") if p.strip())
    if not asked or set(asked) - set(PREDICTORS):
        fail(f"--predictors: {predictors!r}: expected some of {', '.join(PREDICTORS)}, comma-separated")
    if save is not None:
        check_out_file("--out", save)
        check_not_foreign("--out", [save], overwrite, mine=lambda p: json_format_is(p, FORMAT))
    try:
        steps, manifest = load_steps(recording)
    except ValueError as exc:
        fail(str(exc))
    n_groups = int(steps["group"].nunique())
    if folds > n_groups:
        fail(f"--folds: {folds} folds need at least {folds} groups, {recording} has {n_groups}")
    try:
        rep = fit_batch_cost(
            steps,
            manifest,
            folds,
            source={"recording": str(manifest["name"])},
            timing=timing,
            verify_form=verify_form,
            predictors=asked,
        )
    except ValueError as exc:
        fail(f"{recording}: {exc}")
    try:  # what loading the model would refuse is refused before anything is written
        BatchCostModel.from_json(rep.model.to_json(), f"{recording}: fitted batch cost model")
    except ValueError as exc:
        fail(str(exc))
    text = strict_json(rep.to_json())  # a non-finite figure is refused before anything is written
    if save is not None:
        rep.model.save(save)
    if as_json:
        sys.stdout.write(text + "\n")
        return
    out.print(format_report(rep), markup=False, highlight=False)
    if save is not None:
        out.print(f"batch cost model written to {save}")


def bench(
    traces: Annotated[str, typer.Argument(help="Trace set: a registered name or a folder.")] = "paper-default",
    batch: Annotated[
        int,
        typer.Option(
            "--batch", "-B", min=1, max=64, help="Batch size B: the concurrent requests of specenv/MoESpecBatch-v0."
        ),
    ] = 4,
    out_dir: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for the CSV, JSON, Markdown and the learned controllers.")
    ] = Path("bench-batch-out"),
    episodes: Annotated[
        int, typer.Option(min=1, max=MAX_EPISODES, help="Held-out batch episodes (4 B requests each).")
    ] = 4,
    seed: SeedOpt = 0,
    kmax: KmaxOpt = None,
    cost_model: TrainCostOpt = "fit-train",
    no_learners: Annotated[
        bool, typer.Option("--no-learners", help="Skip training the learned batch controllers.")
    ] = False,
    learners: Annotated[
        str | None,
        typer.Option(
            "--learners",
            help="Comma-separated learned controllers to train (imitation, ppo, survival; default all).",
        ),
    ] = None,
    as_json: JsonOpt = False,
    overwrite: OverwriteOpt = False,
) -> None:
    """Benchmark the batch controllers in specenv/MoESpecBatch-v0 beside the batch bound (held-out split).

    The rows are the batch controllers of policies/bench/batch.py and, unless --no-learners, the
    learned ones (trained on the train split).
    """
    from policies.bench.batch import LEARNERS, check_enumerable, run_batch_benchmark
    from policies.bench.outputs import planned_files
    from policies.bench.outputs import write_outputs as write_batch_outputs
    from policies.bench.tables import batch_table as batch_markdown

    check_out_folder("--out", out_dir)
    check_not_foreign("--out", planned_files("batch", out_dir, batch), overwrite)
    if no_learners and learners is not None:
        fail("--learners: the learned controllers to train, but --no-learners trains none (give one of them)")
    rows = LEARNERS if learners is None else tuple(x.strip() for x in learners.split(",") if x.strip())
    if not rows or set(rows) - set(LEARNERS):
        fail(f"--learners: {learners!r}: give a comma-separated subset of {', '.join(LEARNERS)}")
    try:  # the bound's enumeration grows as B^Kmax: refused before minutes of fits, not after
        check_enumerable(batch, check_budget(load_traces(traces), kmax), "--batch")
    except ValueError as exc:
        fail(str(exc))
    try:
        with Progress("batch bench", unit="fits") as prog:

            def in_phase(name: str, unit: str, by_part: bool = False) -> Callable[[int, int, str], None]:
                def update(done: int, total: int, what: str) -> None:
                    # by_part: each part of the fits (``DSD table n=3``, ``block rule h=2``) is its own phase
                    phase = f"{name} ({what.rsplit(' ', 1)[0]})" if by_part else name
                    if prog.phase_name != phase:
                        prog.phase(phase, total)
                        prog.unit = unit
                    prog.update(done, total, what)

                return update

            lagrangian, pathwise = in_phase("bound (lagrangian)", "splits"), in_phase("bound", "request bounds")

            def bound_phase(done: int, total: int, what: str) -> None:
                # the Lagrangian splits (oracle.batch.lagrangian_costs), then the pathwise bound: two phases
                (lagrangian if what.startswith("lagrangian:") else pathwise)(
                    done, total, what.removeprefix("lagrangian: ")
                )

            res = run_batch_benchmark(
                traces,
                batch_size=batch,
                episodes=episodes,
                seed=seed,
                kmax=kmax,
                cost_model=cost_model,
                learners=not no_learners,
                learner_rows=rows,
                progress=in_phase("rows", "policies"),
                fit_progress=in_phase("fit on train", "fits", by_part=True),
                bound_progress=bound_phase,
            )
    except ValueError as exc:
        fail(str(exc))
    strict_json(res.to_json())  # a non-finite figure is refused before any file is written
    paths = write_batch_outputs(res, out_dir)
    finish(res, paths, out_dir, as_json, lambda: [_header(res.context), batch_markdown(res)])


def _header(ctx: dict) -> str:
    """The first line of ``specenv batch bench``'s text output: the setting."""
    return (
        f"# specenv batch bench --batch {ctx['batch_size']}: {ctx['dataset']}, {ctx['episodes']} held-out episodes "
        f"of {ctx['n_requests']} requests (test split, {ctx['test_generations']} generations), Kmax={ctx['kmax']}; "
        f"batch cost model {ctx['batch_cost_kind']}; pooled speedup with bootstrap 95% CIs over episodes; each row "
        "charged by its drafting mode; the bound holds for every policy (expected: pooled; pathwise: every episode)\n"
    )
