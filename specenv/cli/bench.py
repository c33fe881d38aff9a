"""The single-request benchmark (``specenv bench``) and the report page (``specenv report``).

``specenv bench --batch B`` is the older spelling of ``specenv batch bench`` (:mod:`specenv.cli.batch`):
it refuses the options the batch benchmark would ignore, then calls the same function.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from specenv.cli.common import (
    MAX_EPISODES,
    MAX_GENERATIONS,
    JsonOpt,
    KmaxOpt,
    OverwriteOpt,
    RayCpusOpt,
    RayOpt,
    SeedOpt,
    TrainCostOpt,
    check_budget,
    check_not_foreign,
    check_out_file,
    check_out_folder,
    check_ray_cpus,
    fail,
    finish,
    load_traces,
    maybe_ray,
    out,
    print_json,
    strict_json,
)
from specenv.progress import Progress


def bench(
    traces: Annotated[str, typer.Argument(help="Trace set: a registered name or a folder.")] = "paper-default",
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder for CSV, JSON, Markdown and the figure.")] = Path(
        "bench-out"
    ),
    episodes: Annotated[
        int, typer.Option(min=1, max=MAX_EPISODES, help="Monte-Carlo episodes per held-out generation.")
    ] = 4,
    seed: SeedOpt = 0,
    kmax: KmaxOpt = None,
    cost_model: TrainCostOpt = "fit-train",
    policies: Annotated[
        Path | None, typer.Option(help="Folder of trained policies: <name>/policy.json or <run>/policy/policy.json.")
    ] = None,
    only: Annotated[list[str] | None, typer.Option(help="Only policies whose name contains this (repeatable).")] = None,
    drafting: Annotated[
        str | None,
        typer.Option(
            help="Only the rows of this drafting mode (none, block, sequential) and the exact fixed-k rows; "
            "block adds its own bound per h."
        ),
    ] = None,
    vs: Annotated[
        str | None,
        typer.Option(
            "--vs",
            metavar="NAME",
            help="The peer of the paired differences: a row's name or a part of exactly one (default: the best "
            "adaptive row that is not learned).",
        ),
    ] = None,
    as_json: JsonOpt = False,
    ray: RayOpt = None,
    ray_cpus: RayCpusOpt = None,
    ray_chunk: Annotated[
        int | None,
        typer.Option(
            "--ray-chunk", min=1, max=MAX_GENERATIONS, help="Held-out generations per Ray task (default: auto)."
        ),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(min=1, max=64, help="Older spelling of `specenv batch bench --batch B` (the batch controllers)."),
    ] = None,
    no_learners: Annotated[
        bool, typer.Option("--no-learners", help="With --batch: as in `specenv batch bench --no-learners`.")
    ] = False,
    learners: Annotated[
        str | None, typer.Option("--learners", help="With --batch: as in `specenv batch bench --learners`.")
    ] = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Benchmark every policy on the held-out split against the exact oracle bound.

    Without --policies it runs the policies shipped for the trace set (policies/shipped/<set>-v<N>/).
    With --ray every Monte-Carlo row runs as Ray tasks over chunks of the held-out generations
    (policies.distributed); the outputs are the same as without it (per-episode seeds).
    Every row shows its difference in pooled speedup to the best fixed k in hindsight and to a peer
    (--vs NAME; default the best adaptive row that is not learned), with paired bootstrap 95% CIs.
    With --batch B it runs `specenv batch bench --batch B` instead (the older spelling).
    """
    from policies.bench.outputs import planned_files, write_outputs
    from policies.bench.single import run_benchmark
    from policies.bench.tables import category_table, markdown_table
    from specenv.cost.model import DRAFTING_MODES

    check_out_folder("--out", out_dir)
    if batch is not None or no_learners or learners is not None:
        others = {
            "--ray": ray,
            "--ray-cpus": ray_cpus,
            "--ray-chunk": ray_chunk,
            "--policies": policies,
            "--only": only,
            "--drafting": drafting,
            "--vs": vs,
        }
        _batch_alias(
            traces, out_dir, episodes, seed, kmax, cost_model, batch, no_learners, learners, as_json, others, overwrite
        )
        return
    check_not_foreign("--out", planned_files("single", out_dir), overwrite)
    if policies is not None and not policies.is_dir():
        fail(f"--policies: {policies} is not a folder")
    if drafting is not None and drafting not in DRAFTING_MODES:
        fail(f"--drafting: {drafting!r} is not one of {', '.join(DRAFTING_MODES)}")
    check_budget(load_traces(traces), kmax)
    if ray_chunk is not None and ray is None:
        fail("--ray-chunk: needs --ray")
    check_ray_cpus(ray, ray_cpus)
    try:
        with (
            maybe_ray(ray, ray_cpus) as on_ray,
            Progress("bench", unit="policies" if ray is None else "units") as prog,
        ):
            executor = None
            if on_ray is not None:
                from policies.distributed import bench_executor

                executor = bench_executor(ray_chunk, lambda done, total, name: prog.update(done, total, name))
            res = run_benchmark(
                traces,
                kmax=kmax,
                cost_model=cost_model,
                episodes=episodes,
                seed=seed,
                policy_dir=policies,
                only=only,
                progress=lambda done, total, name: prog.update(done, total, name),
                drafting=drafting,
                executor=executor,
                vs=vs,
            )
    except ValueError as exc:
        fail(str(exc))
    strict_json(res.to_json())  # a non-finite figure is refused before any file is written
    paths = write_outputs(res, out_dir)
    finish(
        res,
        paths,
        out_dir,
        as_json,
        lambda: [_header(res.context), markdown_table(res), "\nPooled speedup by category:\n", category_table(res)],
        lambda: _lead(res.context),
    )


def _header(ctx: dict[str, Any]) -> str:
    """The first line of ``specenv bench``'s text output: the setting and how the rows are charged."""
    return (
        f"# specenv bench: {ctx['dataset']}, held-out split ({ctx['test_generations']} generations, "
        f"{ctx['episodes']} episode{'' if ctx['episodes'] == 1 else 's'} each), Kmax={ctx['kmax']}; "
        f"cost model {ctx['cost_model']} "
        f"(fitted on: {ctx['cost_model_fitted_on']}); fixed-k rows exact, the others Monte Carlo with bootstrap "
        f"95% CIs over generations; each row charged by its drafting mode (none: T_D(k); sequential: T_D(drafted) "
        f"= T_D(k); block: T_D(max(k, h))), the bound is none's (= sequential's)\n"
    )


def _lead(ctx: dict[str, Any]) -> str:
    """What the last line of ``specenv bench`` says before where the outputs went."""
    return (
        f"best fixed k on train: {ctx['best_fixed_k_train']}; delta-space lambda (oracle boundary slope, "
        f"train): {ctx['delta_lambda_ms']:.3f} ms/token; "
    )


def _batch_alias(
    traces: str,
    out_dir: Path,
    episodes: int,
    seed: int,
    kmax: int | None,
    cost_model: str,
    batch: int | None,
    no_learners: bool,
    learners: str | None,
    as_json: bool,
    others: dict[str, Any],
    overwrite: bool = False,
) -> None:
    """``specenv bench --batch B ...``: the older spelling of ``specenv batch bench --batch B ...``.

    The batch options need --batch, and an option of ``bench`` that the batch benchmark would ignore
    (``others``: their values, None or [] when not given) is refused with one line; then the same
    function runs, with the same outputs.
    """
    if batch is None and no_learners:
        fail("--no-learners: only with --batch (the learned batch controllers it would train)")
    if batch is None:
        fail("--learners: only with --batch (the learned batch controllers to train)")
    for opt, value in others.items():
        if value is not None and value != []:
            what = "runs in this process" if opt.startswith("--ray") else "runs its own batch controllers"
            fail(f"{opt}: the batch benchmark (--batch) {what} (leave {opt} out)")
    from specenv.cli.batch import bench as batch_bench

    batch_bench(
        traces,
        batch=batch,
        out_dir=out_dir,
        episodes=episodes,
        seed=seed,
        kmax=kmax,
        cost_model=cost_model,
        no_learners=no_learners,
        learners=learners,
        as_json=as_json,
        overwrite=overwrite,
    )


def report(
    folder: Annotated[
        Path, typer.Argument(metavar="DIR", help="Folder holding what fit, oracle and bench wrote (see below).")
    ],
    as_json: JsonOpt = False,
    overwrite: OverwriteOpt = False,
) -> None:
    """Write DIR/report.html: the fit, the oracle and the benchmark on one self-contained page.

    It runs nothing: it reads what the other commands wrote into DIR, namely DIR/fit.json
    (specenv fit TRACES --json > DIR/fit.json), DIR/oracle.json (specenv oracle TRACES --sweep
    --delta --json > DIR/oracle.json), the oracle's figures (specenv oracle TRACES --sweep --delta
    --plot DIR) and DIR/bench.json with its figures (specenv bench TRACES --out DIR). The page has
    inline CSS and the figures embedded (no script, no network), so it opens anywhere. A missing
    input is named on the page with the command that writes it; none of the three JSON files, or a
    garbled one, is an error.
    """
    from policies.report import REPORT_FILE, read_inputs, render_html, written_by_report
    from specenv.io import atomic_write_text

    if os.path.lexists(folder) and not folder.is_dir():
        fail(f"DIR: {folder} is not a folder")
    if not folder.exists():
        fail(f"DIR: {folder}: no such folder")
    check_out_file("DIR", folder / REPORT_FILE)
    check_not_foreign("DIR", [folder / REPORT_FILE], overwrite, mine=written_by_report)
    try:
        inputs = read_inputs(folder)
    except ValueError as exc:
        fail(str(exc))
    path = folder / REPORT_FILE
    atomic_write_text(path, render_html(inputs))
    summary = {"report": str(path), "missing": inputs.missing}
    if as_json:
        print_json(summary)
        return
    out.print(f"wrote {path}", markup=False)
    if inputs.missing:
        out.print(f"not found in {folder} (named on the page): {', '.join(inputs.missing)}", markup=False)
