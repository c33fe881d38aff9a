"""The exact bound: ``specenv oracle`` (S_max, k*, optionally the Kmax sweep and the delta space)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from specenv.cli.common import (
    MAX_EPISODES,
    MAX_SEED,
    JsonOpt,
    KmaxOpt,
    OverwriteOpt,
    RayCpusOpt,
    RayOpt,
    Traces,
    check_not_foreign,
    check_out_folder,
    check_ray_cpus,
    fail,
    load_traces,
    maybe_ray,
    out,
    print_json,
)
from specenv.progress import Progress


def oracle_cmd(
    traces: Traces,
    kmax: KmaxOpt = None,
    sweep: Annotated[bool, typer.Option("--sweep", help="Also sweep Kmax = 1..K (paper Figure 2).")] = False,
    delta: Annotated[bool, typer.Option("--delta", help="Also run the delta-space analysis (Figure 3).")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the figures of --sweep/--delta here.")] = None,
    cost_model: Annotated[str, typer.Option("--cost-model", help="'fit', 'profile' or a cost-model JSON.")] = "fit",
    split: Annotated[str, typer.Option(help="Generations: all, train or test (specenv.traces.splits).")] = "all",
    lookahead: Annotated[
        int, typer.Option(help="Draft confidences h (0..Kmax); in drafting mode block charged as T_D(max(k, h)).")
    ] = 0,
    drafting: Annotated[
        str | None,
        typer.Option(
            help="Drafting mode: none (T_D(k)), block (T_D(max(k, h)), needs --lookahead >= 1) or sequential "
            "(T_D(k): its bound is none's). Default: block if --lookahead > 0, else none."
        ),
    ] = None,
    episodes: Annotated[int, typer.Option(max=MAX_EPISODES, help="Monte-Carlo episodes per generation (0: none).")] = 4,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed of the Monte-Carlo episodes.")] = 0,
    as_json: JsonOpt = False,
    ray: RayOpt = None,
    ray_cpus: RayCpusOpt = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Exact SSP oracle bound: S_max, mean k*, mean accepted (optionally Kmax sweep, delta space).

    With --ray the Kmax sweep's units (one solve per Kmax, one exact evaluation per fixed k) run as Ray
    tasks (policies.distributed); the output is the same.
    """
    import oracle
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import SelectionError, select_positions
    from specenv.traces.splits import check_split

    check_ray_cpus(ray, ray_cpus)
    try:
        check_split(split)
    except ValueError as exc:
        fail(f"--split: {exc}")
    _check_oracle_options(lookahead, episodes, plot, sweep=sweep, delta=delta)
    if plot is not None:  # the output rule: a user's file of the same name is kept unless --overwrite
        check_not_foreign("--plot", _figures(plot, sweep=sweep, delta=delta), overwrite)
    if ray is not None and not sweep:
        fail("--ray: only the Kmax sweep runs on Ray (add --sweep, or leave --ray out)")
    mode = _check_oracle_drafting(drafting, lookahead)
    ts = load_traces(traces)
    if not ts.has_positions:
        fail(f"{traces}: trace set has no positions table")
    try:
        arrays = select_positions(ts, kmax, split)
    except SelectionError as exc:
        fail(f"--{exc.argument}: {exc}")
    k = arrays.kmax
    if lookahead > k:
        fail(f"--lookahead: {lookahead} outside 0..{k} (the largest budget, Kmax)")
    try:
        model = cost_model_for(ts, cost_model)
    except ValueError as exc:
        fail(f"--cost-model: {exc}")
    with (
        maybe_ray(ray if sweep else None, ray_cpus) as map_calls,
        Progress("oracle", total=1 + sweep + delta, unit="steps") as prog,
    ):
        prog.update(what="exact bound" + (" and Monte Carlo" if episodes else ""))
        res = oracle.solve(arrays, model, lookahead=lookahead, mc_episodes=episodes, seed=seed, drafting=mode)
        setting = {
            "dataset": ts.manifest.name,
            "split": split,
            "cost_model": cost_model,
            "kmax": k,
            "lookahead": lookahead,
        }
        setting |= {"drafting": mode, "drafting_note": _drafting_note(mode, lookahead)}
        report = _oracle_report(res, setting, greedy=bool(arrays.greedy))
        table, an = _oracle_analyses(
            report, arrays, model, res, sweep=sweep, delta=delta, plot=plot, prog=prog, map_calls=map_calls
        )
    if as_json:
        print_json(report)
        return
    _print_oracle(report, table, an)


def _check_oracle_options(lookahead: int, episodes: int, plot: Path | None, *, sweep: bool, delta: bool) -> None:
    """Fail (exit 2) on ``specenv oracle`` options that are invalid whatever the trace set."""
    if lookahead < 0:
        fail(f"--lookahead: must be >= 0, got {lookahead}")
    if episodes < 0:
        fail(f"--episodes: must be >= 0, got {episodes}")
    if plot is not None and not (sweep or delta):
        fail("--plot: needs --sweep and/or --delta (the figures it writes)")
    if plot is not None:
        check_out_folder("--plot", plot)


def _figures(plot: Path, *, sweep: bool, delta: bool) -> list[Path]:
    """The figures ``--plot`` writes: the Kmax sweep's and the delta space's."""
    return [plot / name for name, on in (("oracle_sweep.png", sweep), ("oracle_delta.png", delta)) if on]


def _write_figure(draw: Any, path: Path) -> str:
    """``draw(buffer)`` (a PNG) written to ``path`` atomically and recorded as specenv's (the output rule)."""
    import io

    from specenv.io import atomic_write_bytes, record_written

    buf = io.BytesIO()
    draw(buf)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    record_written([path])
    return str(path)


def _check_oracle_drafting(drafting: str | None, lookahead: int) -> str:
    """``--drafting`` of ``specenv oracle`` with ``--lookahead``; returns the mode (exit 2 when invalid)."""
    from specenv.cost.model import DRAFTING_MODES, drafting_mode

    if drafting is None:
        return drafting_mode(lookahead)
    if drafting not in DRAFTING_MODES:
        fail(f"--drafting: {drafting!r} is not one of {', '.join(DRAFTING_MODES)}")
    if drafting == "none" and lookahead:
        fail(f"--lookahead: {lookahead} with --drafting none (k is chosen before drafting: no confidence is seen)")
    if drafting == "block" and not lookahead:
        fail("--lookahead: --drafting block needs the block size h in 1..Kmax (e.g. --lookahead 3)")
    return drafting


def _drafting_note(mode: str, lookahead: int) -> str:
    """One sentence on what the bound charges in this drafting mode."""
    if mode == "block":
        return (
            f"block: the drafter proposes h={lookahead} tokens at once, so every round pays T_D(max(k, {lookahead})), "
            "also at k = 0; the bound is below the bound of none/sequential"
        )
    if mode == "sequential":
        return (
            "sequential: the drafter stops after any token and the round pays T_D(tokens drafted); an oracle that "
            "knows where to stop drafts exactly k, so this bound is the bound of none"
        )
    return "none: k is chosen before drafting and the round pays T_D(k)"


def _oracle_report(res: Any, setting: dict[str, Any], greedy: bool) -> dict[str, Any]:
    """The JSON report of ``specenv oracle``: its setting and the oracle's summary (keys in output order).

    Args:
        res: The oracle's solution (:func:`oracle.solve`).
        setting: ``dataset``, ``split``, ``cost_model``, ``kmax``, ``lookahead``, ``drafting`` and
            ``drafting_note`` of the run.
        greedy: Whether the trace set is greedy (rho in {0, 1}).
    """
    s = res.summary()
    return {
        **setting,
        "greedy": greedy,
        "generations": s["generations"],
        "tokens": s["tokens"],
        "s_max_pooled": s["speedup_pooled"],
        "s_max_mean": s["speedup_mean"],
        "mean_k": s["mean_k"],
        "mean_accepted": s["mean_accepted"],
        "expected_rounds": s["expected_rounds"],
        "v0_ms": s["cost_ms"],
        "ar_ms": s["ar_ms"],
        "cost_per_token_ms": s["cost_per_token_ms"],
        "ar_per_token_ms": s["ar_per_token_ms"],
        "mc": s.get("mc"),
    }


def _oracle_analyses(
    report: dict[str, Any],
    arrays: Any,
    model: Any,
    res: Any,
    *,
    sweep: bool,
    delta: bool,
    plot: Path | None,
    prog: Progress | None = None,
    map_calls: Any = None,
) -> tuple[Any, Any]:
    """Run the optional Kmax sweep and delta-space analysis, add them (and their figures) to ``report``.

    ``prog``, if given, advances by one step as each analysis starts; ``map_calls`` runs the sweep's
    units (:func:`oracle.kmax_sweep`; None: here).

    Returns:
        The sweep table (or None) and the :class:`oracle.DeltaAnalysis` (or None).
    """
    import oracle

    lookahead, mode = report["lookahead"], report["drafting"]
    plots: list[str] = []
    sweep_png, delta_png = (plot / "oracle_sweep.png", plot / "oracle_delta.png") if plot is not None else (None, None)
    table = None
    if sweep:
        if prog is not None:
            prog.advance(what="Kmax sweep")
        table = oracle.kmax_sweep(arrays, model, lookahead=lookahead, drafting=mode, map_calls=map_calls)
        report["sweep"] = [
            {c: (v.item() if hasattr(v, "item") else v) for c, v in r.items()} for r in table.to_dict(orient="records")
        ]
        if plot is not None:
            title = f"{report['dataset']} ({report['split']}), cost model {report['cost_model']}"
            plots.append(_write_figure(lambda buf: oracle.plot_kmax_sweep(table, buf, title), sweep_png))
    an = None
    if delta:
        if prog is not None:
            prog.advance(what="delta space")
        an = oracle.delta_analysis(arrays, model, lookahead=lookahead, result=res, drafting=mode)
        report["delta"] = an.to_json()
        if plot is not None:
            plots.append(_write_figure(lambda buf: oracle.plot_delta(an, buf), delta_png))
    if plots:
        report["plots"] = plots
    return table, an


def _print_oracle(report: dict[str, Any], table: Any, an: Any) -> None:
    """Human-readable ``specenv oracle`` output: the bound, Monte Carlo, then the sweep and delta space."""
    out.print(
        f"Oracle on {report['dataset']} ({report['split']}: {report['generations']} generations, "
        f"{report['tokens']} tokens), Kmax={report['kmax']}, lookahead={report['lookahead']}, "
        f"cost model {report['cost_model']}"
    )
    out.print(f"drafting mode {report['drafting_note']}")
    out.print(
        f"S_max = {report['s_max_pooled']:.4f} (pooled: sum AR / sum V(0)); "
        f"mean over generations {report['s_max_mean']:.4f}"
    )
    out.print(
        f"optimal path: mean k* = {report['mean_k']:.3f}, mean accepted = {report['mean_accepted']:.3f} "
        f"per round, {report['expected_rounds']:.1f} expected rounds; "
        f"V(0)/N = {report['cost_per_token_ms']:.4f} ms vs AR {report['ar_per_token_ms']:.4f} ms per token"
    )
    mc = report["mc"]
    if mc:
        out.print(
            f"Monte Carlo ({mc['episodes']} episodes, seed {mc['seed']}): S_max = "
            f"{mc['speedup_pooled']['value']:.4f} +- {mc['speedup_pooled']['ci95']:.4f}, mean k* = "
            f"{mc['mean_k']['value']:.3f} +- {mc['mean_k']['ci95']:.3f}, mean accepted = "
            f"{mc['mean_accepted']['value']:.3f} +- {mc['mean_accepted']['ci95']:.3f}"
        )
    if table is not None:
        _print_kmax_sweep(table)
    if an is not None:
        _print_delta(an)
    for p in report.get("plots", []):
        out.print(f"wrote {p}")


def _print_kmax_sweep(table: Any) -> None:
    """The Kmax sweep as a table (paper Figure 2)."""
    tab = Table(title="Oracle against Kmax (paper Figure 2)")
    for col in ("Kmax", "S_max pooled", "S_max mean", "mean k*", "mean accepted", "best fixed k", "its speedup"):
        tab.add_column(col, justify="right")
    for r in table.itertuples():
        tab.add_row(
            str(r.kmax),
            f"{r.s_max_pooled:.4f}",
            f"{r.s_max_mean:.4f}",
            f"{r.mean_k:.3f}",
            f"{r.mean_accepted:.3f}",
            str(r.best_fixed_k),
            f"{r.best_fixed_speedup:.4f}",
        )
    out.print(tab)


#: The quadrants of the delta space in words: a rejected budget k against the oracle's choice k*.
_QUADRANT_WORDS = {
    "I": ("more accepted drafts, costlier", "the extra tokens were not worth their cost"),
    "II": ("more accepted drafts, cheaper", "better on both: an optimal choice leaves none here"),
    "III": ("fewer accepted drafts, cheaper", "the saving was not worth the tokens lost"),
    "IV": ("fewer accepted drafts, costlier", "worse on both (the cost is not monotone in k)"),
    "axis": ("same accepted drafts or same cost", "e.g. extra drafts that are surely rejected"),
}


def _print_delta(an: Any) -> None:
    """The delta-space analysis in words (paper Figure 3): the quadrants and the boundary slope."""
    q = an.quadrants
    total = max(sum(q.values()), 1)
    where = (
        "the states the optimal policy visits, weighted by how often"
        if an.states == "occupancy"
        else "the states Monte-Carlo episodes of the optimal policy visit"
    )
    out.print(
        f"Delta space (paper Figure 3): the {an.points} budgets k the oracle rejected at {an.decisions} "
        f"decision states ({where}), each against its choice k* (x: extra expected accepted drafts, "
        "y: extra round cost):",
        markup=False,
    )
    for name, (where, why) in _QUADRANT_WORDS.items():
        out.print(f"  {name:>4}  {where:<34} {q[name]:>9} ({q[name] / total:6.1%})  {why}", markup=False)
    lo, hi = an.lambda_interval
    envelope = (
        f"every slope in [{lo:.3f}, {hi:.3f}] separates all points"
        if lo <= hi
        else "no line separates all points (the slopes of I and III overlap)"
    )
    out.print(
        f"Boundary slope lambda = {an.lambda_sep:.4f} ms per accepted token: the oracle acts as if an accepted "
        f"draft saves lambda ms, taking a longer draft when (extra accepted drafts) x lambda exceeds the extra "
        f"cost; {an.sep_error:.1%} of the weight lies on the wrong side of that line, {envelope}.",
        markup=False,
    )
    out.print(
        f"For comparison: the least-squares line through the cloud has slope {an.lambda_ls:.4f} ms/token "
        f"(R2 through the origin {an.r2_origin:.3f}, residual SD {an.resid_sd:.3f} ms; the centre of the cloud, "
        f"not the boundary); the optimal cost per token V(0)/N = {an.v0_per_token:.4f} ms and the mean marginal "
        f"V(t)-V(t+1) = {an.marginal_dv:.4f} ms.",
        markup=False,
    )
