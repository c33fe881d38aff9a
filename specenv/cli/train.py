"""Learning budget controllers: ``specenv train`` (ppo, dqn, imitation, bc), ``export minari`` and ``tune``."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from specenv.cli.common import (
    MAX_EPISODES,
    MAX_SEED,
    JsonOpt,
    KmaxOpt,
    OverwriteOpt,
    RayCpusOpt,
    RayOpt,
    check_budget,
    check_finite,
    check_name,
    check_not_foreign,
    check_out_folder,
    check_ray_cpus,
    fail,
    json_format_is,
    load_traces,
    maybe_ray,
    os_message,
    out,
    print_json,
)
from specenv.progress import Progress


def train(
    algo: Annotated[
        list[str] | None,
        typer.Option(
            help="Learner: ppo, dqn, imitation (DAgger on the oracle) or bc (from a Minari --dataset); "
            "repeatable (default ppo)."
        ),
    ] = None,
    traces: Annotated[
        str, typer.Option("--traces", help="Trace set (name or folder); trains on its train split.")
    ] = "paper-default",
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Run folder: model, logs, exported policy/.")] = Path(
        "runs"
    ),
    timesteps: Annotated[int, typer.Option(min=1000, max=10**10, help="Environment steps (ppo, dqn).")] = 300_000,
    iterations: Annotated[int, typer.Option(min=1, max=1000, help="DAgger iterations (imitation).")] = 6,
    epochs: Annotated[
        int | None, typer.Option(min=1, max=10_000, help="Passes over the DAgger aggregate per iteration (imitation).")
    ] = None,
    seed: Annotated[
        list[int] | None, typer.Option(min=0, max=MAX_SEED, help="Seed; repeatable: one run per learner and seed.")
    ] = None,
    n_envs: Annotated[int, typer.Option(min=1, max=4096, help="Parallel streams of the vector env (ppo, dqn).")] = 32,
    kmax: KmaxOpt = None,
    cost_model: Annotated[
        str,
        typer.Option(
            help="fit-train (fitted on the train split's rounds, the default and the benchmark's), fit (every "
            "round, the test generations' included), profile or a cost-model JSON; recorded in policy.json."
        ),
    ] = "fit-train",
    drafting: Annotated[
        str | None,
        typer.Option(
            help="Drafting mode: none (k before drafting), block (--lookahead h drafts proposed at once) or "
            "sequential (a stop rule on the per-token env specenv/MoESpecSeq-v0). Default: block if --lookahead "
            "> 0, else none."
        ),
    ] = None,
    lookahead: Annotated[
        int | None, typer.Option(min=0, help="Draft confidences in the observation (block: h in 1..Kmax).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Run name (default: ALGO[-hH|-seq]-seedS).")] = None,
    gamma: Annotated[float, typer.Option(min=0.0, max=1.0, help="Discount factor (ppo, dqn).")] = 0.99,
    expert: Annotated[
        str,
        typer.Option(
            help="imitation: the expert imitated: oracle (the clairvoyant SSP oracle, the default), belief (the "
            "belief oracle: the SSP on the acceptances a train-split calibration predicts from what the controller "
            "sees: its observation in mode none, the draft confidences drafted so far otherwise) or rollout "
            "(AggreVaTe with the learner's own cost-to-go: every budget's round on the true acceptances, then the "
            "current learner's own rounds to the generation's end; drafting none or block; no k=0 trap); runs "
            "named ALGO-EXPERT[-hH|-seq]-seedS."
        ),
    ] = "oracle",
    rollout_horizon: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=100_000,
            help="--expert rollout: rounds of the learner's continuation before the belief oracle's cost-to-go "
            "closes a branch (default: to the generation's end; a short horizon lowers the label noise of "
            "stochastic traces); recorded in policy.json.",
        ),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            help="bc: Minari dataset id (specenv/SET/POLICY-v0, written by `specenv export minari`); its "
            "environment replaces --traces, --kmax, --cost-model and --drafting."
        ),
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(help="bc: Minari datasets folder (default $MINARI_DATASETS_PATH, else specenv's cache/minari)."),
    ] = None,
    as_json: JsonOpt = False,
    ray: RayOpt = None,
    ray_cpus: RayCpusOpt = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Train a budget controller on the train split and export it (numpy form, no pickle).

    The cost model defaults to the train split's fit (fit-train), so that training without options
    reads no test round. policy.json records the drafting mode, every hyper-parameter, the trace set
    (name, version, manifest sha256), the cost model and the observation contract (its version included). Repeated
    --algo/--seed train one run per (learner, seed), one after another, or as Ray tasks with --ray
    (policies.distributed; the same run folders and, on one machine, the same networks). bc fits
    the budgets of a Minari dataset's episodes (exported from the train split) by cross-entropy.
    """
    from policies.learn.runs import ALGOS, TrainRun

    check_ray_cpus(ray, ray_cpus)
    algos = list(dict.fromkeys(algo or ["ppo"]))
    seeds = list(dict.fromkeys(seed if seed else [0]))
    for a in algos:
        if a not in (*ALGOS, "bc"):
            fail(f"--algo: unknown learner '{a}' (known: {', '.join((*ALGOS, 'bc'))})")
    if "bc" in algos or dataset is not None or root is not None:
        if algos != ["bc"]:
            fail(f"--dataset: only --algo bc trains from a Minari dataset (got --algo {', '.join(algos)})")
        if len(seeds) > 1:
            fail("--seed: bc trains one run (give one --seed)")
        if ray is not None:
            fail("--ray: bc trains one run in this process (leave --ray out)")
        _train_bc("bc", dataset, root, out_dir, name, epochs, seeds[0], as_json, overwrite)
        return
    check_finite("--gamma", gamma)
    from policies.learn.dagger import EXPERTS

    if expert not in EXPERTS:
        fail(f"--expert: unknown expert '{expert}' (known: {', '.join(EXPERTS)})")
    if expert != "oracle" and algos != ["imitation"]:
        fail(f"--expert: only --algo imitation imitates an expert (got --algo {', '.join(algos)})")
    if name is not None:
        check_name("--name", name)
        if name in (".", "..") or "/" in name or os.sep in name:
            fail(f"--name: {name!r} must be a plain folder name (no '/', not '.' or '..')")
        if len(algos) * len(seeds) > 1:
            fail(f"--name: one name for {len(algos) * len(seeds)} runs (leave it out: each run gets ALGO-seedS)")
    ts = load_traces(traces)
    mode, h = _check_train_drafting(drafting, lookahead, ts)
    if expert == "rollout" and mode == "sequential":
        fail("--expert: rollout labels round-level budgets (drafting none or block), not a sequential stop rule")
    if rollout_horizon is not None and expert != "rollout":
        fail(f"--rollout-horizon: only --expert rollout rolls the learner out (got --expert {expert})")
    suffix = ("" if expert == "oracle" else f"-{expert}") + {"none": "", "block": f"-h{h}", "sequential": "-seq"}[mode]
    runs = [
        TrainRun(
            algo=a,
            traces=traces,
            name=name or f"{a}{suffix}-seed{s}",
            seed=s,
            mode=mode,
            h=h,
            timesteps=timesteps,
            iterations=iterations,
            epochs=epochs,
            n_envs=n_envs,
            kmax=kmax,
            cost_model=cost_model,
            gamma=gamma,
            expert=expert,
            overrides=(("horizon", rollout_horizon),) if rollout_horizon is not None else (),
        )
        for a in algos
        for s in seeds
    ]
    check_out_folder("--out", out_dir)
    for run in runs:
        check_out_folder("--out", out_dir / run.name)
        check_run_outputs(out_dir / run.name, run.algo in ("ppo", "dqn"), overwrite)
    check_budget(ts, kmax, h)
    _check_trainable(ts, traces, kmax, cost_model)
    summaries = _train_runs(runs, out_dir, ray, ray_cpus)
    if as_json:
        print_json(summaries[0] if len(summaries) == 1 else summaries)
        return
    for s in summaries:
        meta = s["meta"]
        out.print(
            f"exported {s['algo']} policy ({mode}{f', h={h}' if mode == 'block' else ''}) to {s['policy']} "
            f"(policy.json + weights.npz) in {meta['train_seconds']:.0f} s"
        )


def check_run_outputs(run: Path, sb3: bool, overwrite: bool) -> None:
    """The output rule in a run folder: its exported policy (and SB3's ``model.zip``) replace only specenv's own.

    A run folder is specenv's when its ``policy/policy.json`` is a specenv policy (the run that wrote it).
    """
    from specenv.policy.mlp import FORMAT

    files = [run / "policy" / "policy.json", run / "policy" / "weights.npz"] + ([run / "model.zip"] if sb3 else [])
    check_not_foreign("--out", files, overwrite, mine=lambda _p: json_format_is(run / "policy" / "policy.json", FORMAT))


#: Generations a trace set's train split must hold for ``specenv train``: standard errors clustered by
#: generation (the fit-train cost model that prices the trained policy's benchmark) need two clusters.
MIN_TRAIN_GENERATIONS = 2


def _check_trainable(ts: Any, traces: str, kmax: int | None, cost_model: str) -> None:
    """Refuse, before any training, a set whose splits cannot support a run, and a cost model that cannot be built.

    The train split needs :data:`MIN_TRAIN_GENERATIONS` generations and the test split one (the
    policy is benchmarked there); the cost model is built here (fitted once, then cached), so its
    refusal is one line before any progress line or run folder.
    """
    from specenv.cost.source import cost_model_for
    from specenv.traces.splits import n_test

    # counted from the generation ids and the split rule alone: no split's rows are selected here
    # (``train`` without options never reads the test rounds)
    frame = ts.positions if ts.positions is not None else ts.rounds
    n_gen = int(frame["generation_id"].nunique())
    counts = {"test": n_test(n_gen), "train": n_gen - n_test(n_gen)}
    n_all = counts["train"] + counts["test"]
    if counts["train"] < MIN_TRAIN_GENERATIONS or counts["test"] < 1:
        fail(
            f"--traces: {traces}: its generations split into {counts['train']} train and {counts['test']} test "
            f"({n_all} in all); training needs at least {MIN_TRAIN_GENERATIONS} train generations (the fit-train "
            "cost model clusters standard errors by generation) and 1 test generation (the benchmark's): use a "
            "trace set of 3 or more generations"
        )
    try:
        cost_model_for(ts, cost_model)
    except ValueError as exc:
        fail(f"--cost-model: {exc}")


def _train_bc(
    algo: str,
    dataset: str | None,
    root: Path | None,
    out_dir: Path,
    name: str | None,
    epochs: int | None,
    seed: int,
    as_json: bool,
    overwrite: bool = False,
) -> None:
    """``specenv train --algo bc --dataset ID``: behaviour cloning from a Minari dataset (policies/learn/bc.py)."""
    if algo != "bc":
        fail(f"--dataset: only --algo bc trains from a Minari dataset (got --algo {algo})")
    if dataset is None:
        fail("--dataset: missing (--algo bc trains from a Minari dataset id, e.g. specenv/paper-default/oracle-v0)")
    if name is not None:
        check_name("--name", name)
        if name in (".", "..") or "/" in name or os.sep in name:
            fail(f"--name: {name!r} must be a plain folder name (no '/', not '.' or '..')")
    run = out_dir / (name or f"bc-seed{seed}")
    check_out_folder("--out", out_dir)
    check_out_folder("--out", run)
    check_run_outputs(run, False, overwrite)
    from policies.learn.offline import open_dataset, resolve_root

    try:
        data = open_dataset(dataset, resolve_root(root))
    except ValueError as exc:
        fail(str(exc))
    try:
        if data.meta.get("split") != "train":
            fail(
                f"--dataset: {dataset} holds {data.meta.get('split')}-split episodes; bc trains on the train "
                "split only (export with --split train)"
            )
        from policies.learn.bc import train_bc
        from policies.learn.export import provenance

        t0 = time.perf_counter()
        n_epochs = epochs or 30
        with Progress("train bc", total=n_epochs, unit="epochs") as prog:

            def epoch_done(line: str) -> None:
                prog.echo(line)
                prog.advance()

            res = train_bc(data, epochs=n_epochs, seed=seed, log=epoch_done)
        kw = data.env.spec.kwargs
        policy = res.policy
        policy.meta = provenance(
            policy.meta,
            load_traces(kw["dataset"]),
            kw["dataset"],
            kw["cost_model"],
            policy.spec,
            time.perf_counter() - t0,
        )
    except ValueError as exc:
        fail(str(exc))
    finally:
        data.env.close()
    policy.save(run / "policy")
    mode = policy.meta["drafting"]
    summary = {"algo": "bc", "drafting": mode, "policy": str(run / "policy"), "meta": policy.meta}
    if as_json:
        print_json(summary)
    else:
        acc = res.history[-1]["accuracy"]
        out.print(
            f"exported bc policy ({mode}) from {dataset} ({len(data.actions)} steps, accuracy {acc:.3f}) to "
            f"{run / 'policy'} (policy.json + weights.npz) in {policy.meta['train_seconds']:.0f} s"
        )


def export(
    fmt: Annotated[str, typer.Argument(metavar="FORMAT", help="Dataset format: minari.")],
    policy: Annotated[
        str,
        typer.Option(
            help="oracle (its k*, expert data), a registered name (fixed-k:k=4, adaedl...), a policy shipped "
            "for the set (imitation, ppo-h3...) or a policy folder."
        ),
    ],
    dataset: Annotated[str, typer.Option("--dataset", help="Trace set: a registered name or a folder.")] = (
        "paper-default"
    ),
    split: Annotated[str, typer.Option(help="Generations replayed: train, test or all.")] = "train",
    episodes: Annotated[int, typer.Option(min=1, max=MAX_EPISODES, help="Episodes per generation.")] = 1,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Base seed of the episodes.")] = 0,
    kmax: KmaxOpt = None,
    cost_model: Annotated[
        str, typer.Option(help="fit-train (the benchmark's), fit, profile or a cost-model JSON.")
    ] = "fit-train",
    drafting: Annotated[
        str | None, typer.Option(help="Drafting mode: none, block or sequential (a policy folder brings its own).")
    ] = None,
    lookahead: Annotated[int | None, typer.Option(min=0, help="Draft confidences h shown (block, sequential).")] = None,
    signals: Annotated[
        str | None,
        typer.Option(help="Draft signals of the lookahead, comma-separated: q (default), q,ent, q,ent,margin."),
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(help="Minari datasets folder (default $MINARI_DATASETS_PATH, else specenv's cache/minari)."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a dataset of the same id that specenv exported.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a policy's episodes on a trace set as a Minari dataset specenv/SET/POLICY-v0 (offline RL).

    The oracle and registered names in mode block or sequential get -hH / -seq after POLICY.

    The dataset records the environment (recover_environment() rebuilds it), its spaces, the trace
    set's manifest sha256, the split, the policy's file sha256 (or the oracle's table) and the
    observation contract. It goes to --root, else $MINARI_DATASETS_PATH, else specenv's cache
    folder (never ~/.minari unless asked); it is written completely or not at all.
    """
    if fmt != "minari":
        fail(f"FORMAT: unknown dataset format {fmt!r} (known: minari)")
    from policies.learn.offline import ROOT_ENV, check_destination, dataset_id, export_minari, plan_policy, resolve_root
    from specenv.traces.splits import check_split

    try:
        check_split(split)
    except ValueError as exc:
        fail(f"--split: {exc}")
    ts = load_traces(dataset)
    k = check_budget(ts, kmax)
    # the option the folder came from: --root, else $MINARI_DATASETS_PATH, else the specenv cache
    where = "--root" if root is not None else ROOT_ENV if os.environ.get(ROOT_ENV) else "--root (the specenv cache)"
    try:
        base = resolve_root(root)
        if os.path.lexists(base) and not base.is_dir():
            fail(f"{where}: {base} exists and is not a folder")
        sig = None if signals is None else tuple(x.strip() for x in signals.split(","))
        plan = plan_policy(policy, dataset, k, drafting, lookahead, sig)
        ident = dataset_id(dataset, policy, plan=plan)
        check_destination(base, ident, overwrite)
    except FileExistsError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{where}: {os_message(exc)}")
    except ValueError as exc:
        fail(str(exc))
    try:
        with contextlib.ExitStack() as stack:
            bar: list[Progress] = []

            def report(done: int, total: int) -> None:
                # the progress lines start once the environment and the policy are built (export_minari
                # reports 0 episodes then): a policy refused while they are built is one line, with
                # no "elapsed" line before it
                if not bar:
                    bar.append(stack.enter_context(Progress("export minari", unit="episodes")))
                bar[0].update(done, total)

            res = export_minari(
                dataset,
                plan,
                base,
                ident,
                split=split,
                kmax=kmax,
                cost_model=cost_model,
                episodes=episodes,
                seed=seed,
                overwrite=overwrite,
                progress=report,
            )
    except FileExistsError as exc:
        fail(str(exc))
    except ValueError as exc:
        fail(str(exc))
    summary = {
        "dataset_id": res.dataset_id,
        "root": str(base),
        "path": str(res.path),
        "episodes": res.episodes,
        "steps": res.steps,
        "size_mb": res.size_mb,
        "speedup_pooled": res.speedup_pooled,
        "metadata": res.metadata,
    }
    if as_json:
        print_json(summary)
    else:
        out.print(
            f"wrote Minari dataset {res.dataset_id} to {res.path}: {res.episodes} episodes, {res.steps} steps, "
            f"{res.size_mb:.1f} MB; policy {policy} ({plan.drafting}, h={plan.lookahead}) on the {split} split, "
            f"pooled speedup {res.speedup_pooled:.3f}",
            markup=False,
        )


def _train_runs(runs: list[Any], out_dir: Path, ray: str | None, ray_cpus: int | None) -> list[dict[str, Any]]:
    """Train ``runs`` here one after another, or as Ray tasks (``--ray``); their summaries in order."""
    from policies.learn.runs import train_run

    summaries = []
    try:
        if ray is not None:
            from policies.distributed import ray_train

            with maybe_ray(ray, ray_cpus), Progress("train", total=len(runs), unit="runs") as prog:
                return ray_train(runs, out_dir, progress=lambda done, total, what: prog.update(done, total, what))
        for run in runs:
            unit = "DAgger iterations" if run.algo == "imitation" else "steps"
            total = run.iterations if run.algo == "imitation" else run.timesteps
            with Progress(f"train {run.algo}", total=total, unit=unit) as prog:
                summaries.append(
                    train_run(
                        run,
                        out_dir / run.name,
                        log=prog.echo,
                        progress=lambda done, total: prog.update(done, total),
                    )
                )
    except ValueError as exc:
        fail(str(exc))
    return summaries


def tune(
    algo: Annotated[
        str, typer.Option(help="Learner: ppo, dqn or imitation (with --drafting sequential: the stop rule).")
    ] = "imitation",
    traces: Annotated[str, typer.Option("--traces", help="Trace set (name or folder).")] = "paper-default",
    out_dir: Annotated[
        Path, typer.Option("--out", "-o", help="Folder: results.csv, results.parquet, best.json.")
    ] = Path("tune-out"),
    samples: Annotated[int, typer.Option(min=1, max=10_000, help="Trials (random search).")] = 8,
    timesteps: Annotated[
        int, typer.Option(min=1000, max=10**10, help="Environment steps per trial (ppo, dqn).")
    ] = 50_000,
    iterations: Annotated[int, typer.Option(min=1, max=1000, help="DAgger iterations per trial (imitation).")] = 3,
    episodes: Annotated[int, typer.Option(min=1, max=MAX_EPISODES, help="Validation episodes per generation.")] = 2,
    seed: Annotated[
        int, typer.Option(min=0, max=MAX_SEED, help="Seed of the search, the learners and validation.")
    ] = 0,
    n_envs: Annotated[int, typer.Option(min=1, max=4096, help="Parallel streams of the vector env (ppo, dqn).")] = 16,
    kmax: KmaxOpt = None,
    cost_model: Annotated[
        str, typer.Option(help="fit-train (fitted on the train split), profile or a cost-model JSON (not fit).")
    ] = "fit-train",
    drafting: Annotated[
        str | None, typer.Option(help="Drafting mode: none, block (with --lookahead) or sequential.")
    ] = None,
    lookahead: Annotated[int | None, typer.Option(min=0, help="Draft confidences (block: h in 1..Kmax).")] = None,
    as_json: JsonOpt = False,
    ray: RayOpt = "local",
    ray_cpus: RayCpusOpt = None,
    overwrite: OverwriteOpt = False,
) -> None:
    """Ray Tune search of a learner's hyper-parameters: fit on train-fit, choose on train-val (both carved from train).

    The validation split is carved from train (specenv.traces.splits); no trial reads a test generation.
    Writes the ResultGrid as results.csv and results.parquet, and best.json (policies.learn.tune).
    """
    from policies.learn.runs import ALGOS, TrainRun

    check_ray_cpus(ray or "local", ray_cpus)
    if algo not in ALGOS:
        fail(f"--algo: unknown learner '{algo}' (known: {', '.join(ALGOS)})")
    if cost_model == "fit":
        fail("--cost-model: 'fit' is fitted on every round, the test generations' included (use fit-train)")
    ts = load_traces(traces)
    mode, h = _check_train_drafting(drafting, lookahead, ts)
    check_out_folder("--out", out_dir)
    from policies.learn.tune import OUTPUTS

    check_not_foreign("--out", [out_dir / name for name in OUTPUTS], overwrite)  # before Ray starts
    check_budget(ts, kmax, h)
    from specenv.cost.source import cost_model_for

    try:  # here, not in every trial: a bad cost model is one line, before Ray starts or a folder is made
        cost_model_for(ts, cost_model)
    except ValueError as exc:
        fail(f"--cost-model: {exc}")
    # trials run in their own folders: a trace-set folder is passed by absolute path
    where = str(Path(traces).resolve()) if Path(traces).is_dir() else traces
    suffix = {"none": "", "block": f"-h{h}", "sequential": "-seq"}[mode]
    base = TrainRun(
        algo=algo,
        traces=where,
        name=f"tune-{algo}{suffix}",
        seed=seed,
        mode=mode,
        h=h,
        timesteps=timesteps,
        iterations=iterations,
        n_envs=n_envs,
        kmax=kmax,
        cost_model=cost_model,
    )
    from policies.learn.tune import run_tune

    try:
        with maybe_ray(ray or "local", ray_cpus), Progress("tune", total=samples, unit="trials") as prog:
            best = run_tune(
                base, out_dir, samples, episodes=episodes, seed=seed, progress=lambda d, t, w: prog.update(d, t, w)
            )
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        print_json(best)
        return
    b = best["best"]
    score, pct = b.get("val_speedup_pooled", float("nan")), b.get("val_oracle_pct", float("nan"))
    out.print(
        f"tune {algo} ({mode}): {best['trials']} trials fitted on train-fit, chosen on train-val "
        f"({b.get('val_generations')} generations): best pooled speedup {score:.4f} "
        f"({pct:.1f}% of the bound) with {best['best_config']}; "
        f"results in {out_dir}/ (results.csv, results.parquet, best.json)",
        markup=False,
    )


def _check_train_drafting(drafting: str | None, lookahead: int | None, ts: Any) -> tuple[str, int]:
    """``--drafting`` and ``--lookahead`` of ``specenv train``: (mode, h); exit 2 when invalid.

    ``sequential`` trains a stop rule on the per-token environment, which shows each draft's own
    confidence as it is drafted: it takes no ``--lookahead``.
    """
    from specenv.cost.model import DRAFTING_MODES, check_drafting

    if drafting is not None and drafting not in DRAFTING_MODES:
        fail(f"--drafting: {drafting!r} is not one of {', '.join(DRAFTING_MODES)}")
    if drafting == "sequential":
        if lookahead:
            fail(
                f"--lookahead: {lookahead} with --drafting sequential (the stop rule sees each draft's confidence "
                "as it is drafted; no lookahead)"
            )
        return "sequential", 0
    if drafting == "block" and not lookahead:
        fail("--lookahead: --drafting block needs the block size h in 1..Kmax (e.g. --lookahead 3)")
    try:
        return check_drafting(drafting, lookahead, int(ts.kmax))
    except ValueError as exc:
        fail(f"--lookahead: {exc}" if "lookahead" in str(exc) else f"--drafting: {exc}")
