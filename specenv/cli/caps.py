"""The expert-cap family: ``specenv caps bench`` (alias ``specenv bench-caps``), the joint (k, expert cap) benchmark."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

from specenv.cli.common import (
    MAX_EPISODES,
    MAX_SEED,
    JsonOpt,
    KmaxOpt,
    OverwriteOpt,
    TrainCostOpt,
    check_budget,
    check_not_foreign,
    check_out_folder,
    fail,
    finish,
    load_traces,
    strict_json,
)
from specenv.progress import Progress


def bench(
    traces: Annotated[
        str, typer.Argument(help="Trace set with expert caps (extension caps-v1): a registered name or a folder.")
    ] = "live-cpu-caps",
    out_dir: Annotated[
        Path, typer.Option("--out", "-o", help="Folder for bench_caps.json/.md, the CSV, frontier.png, the policies.")
    ] = Path("bench-caps-out"),
    kmax: KmaxOpt = None,
    cost_model: TrainCostOpt = "fit-train",
    policies: Annotated[
        Path | None, typer.Option(help="Folder of trained k-policies (default: those shipped for the set).")
    ] = None,
    weight: Annotated[
        list[float] | None,
        typer.Option(help="Quality weight of the frontier sweep, AR steps per mismatched token (repeatable; inf ok)."),
    ] = None,
    train_joint: Annotated[
        list[float] | None,
        typer.Option(
            help="Train a joint learned controller (imitation of the joint oracle) at this weight (repeatable)."
        ),
    ] = None,
    joint_policy: Annotated[
        list[Path] | None, typer.Option(help="Folder of a trained joint (k, cap) policy to evaluate (repeatable).")
    ] = None,
    joint_lookahead: Annotated[
        int,
        typer.Option(
            min=0, max=64, help="Draft confidences h the --train-joint learners see (block drafting; 0: none)."
        ),
    ] = 0,
    episodes: Annotated[
        int, typer.Option(min=1, max=MAX_EPISODES, help="Rollout episodes per held-out generation (1 on greedy sets).")
    ] = 1,
    max_mismatch: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Quality constraint of the headline comparison (token rate).")
    ] = 0.01,
    only: Annotated[
        list[str] | None, typer.Option(help="Only the k-policies whose name contains this (repeatable).")
    ] = None,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Base seed of the episodes, bootstrap, training.")] = 0,
    as_json: JsonOpt = False,
    overwrite: OverwriteOpt = False,
) -> None:
    """Joint (k, expert cap) benchmark: speedup beside token mismatches, and the joint oracle's frontier.

    Every k-policy at every cap level, MoE-Spec's fixed cap with fixed k, the k-only and joint oracles
    (a sweep of the quality weight) and the joint learned controllers, on the held-out split.
    """
    from policies.bench.caps import DEFAULT_WEIGHTS, cap_bench_family
    from policies.bench.outputs import planned_files, write_outputs
    from policies.bench.runner import run_family
    from policies.bench.tables import frontier_table, markdown_table

    check_out_folder("--out", out_dir)
    check_not_foreign("--out", planned_files("caps", out_dir), overwrite)
    if policies is not None and not policies.is_dir():
        fail(f"--policies: {policies} is not a folder")
    for w in (weight or []) + (train_joint or []):
        if not w >= 0 or math.isnan(w):
            fail(f"--weight/--train-joint: {w} must be >= 0")
    for w in train_joint or []:
        if math.isinf(w):
            fail("--train-joint: the weight must be finite (the environment's quality_weight)")
    for folder in joint_policy or []:
        if not folder.is_dir():
            fail(f"--joint-policy: {folder} is not a folder")
        from policies.caps.controllers import JointMLP

        try:
            JointMLP.load(folder)  # its files read before any fitting; the contract is checked at its row
        except ValueError as exc:
            fail(f"--joint-policy: {exc}")
    ts = load_traces(traces)
    k_eff = check_budget(ts, kmax)
    if joint_lookahead > k_eff:
        fail(f"--joint-lookahead: {joint_lookahead} outside 0..{k_eff} (the largest budget, Kmax)")
    if not ts.manifest.caps:
        fail(f"{traces}: trace set '{ts.manifest.name}' has no expert-cap columns (extension caps-v1)")
    try:
        family = cap_bench_family(  # the refusals before any row (one line, no progress line before it)
            traces,
            kmax=kmax,
            cost_model=cost_model,
            policy_dir=policies,
            weights=tuple(weight) if weight else DEFAULT_WEIGHTS,
            train_weights=tuple(train_joint or ()),
            joint_policies=tuple(joint_policy or ()),
            episodes=episodes,
            seed=seed,
            max_mismatch=max_mismatch,
            only=only,
            train_kwargs={"lookahead": joint_lookahead} if joint_lookahead else None,
        )
        with Progress("caps bench", unit="rows") as prog:
            res = run_family(family, lambda done, total, name: prog.update(done, total, name))
    except ValueError as exc:
        fail(str(exc))
    strict_json(res.to_json())  # a non-finite figure is refused before any file is written
    paths = write_outputs(res, out_dir)
    finish(res, paths, out_dir, as_json, lambda: _text(res, max_mismatch, markdown_table, frontier_table))


def _text(res: Any, max_mismatch: float, markdown_table: Any, frontier_table: Any) -> list[str]:
    """``specenv caps bench``'s text blocks: the setting, the rows, the frontier and the headline comparison."""
    c = res.context
    blocks = [
        f"# specenv caps bench: {c['dataset']}, held-out split ({c['test_generations']} generations, "
        f"{c['test_tokens']} tokens), Kmax={c['kmax']}, caps {c['caps']}; cost model {c['cost_model']}; "
        "speedup pooled with a bootstrap 95% CI over generations; mismatched tokens = committed tokens that differ "
        "from the uncapped reference\n",
        markdown_table(res),
        "\nJoint oracle frontier (quality-weight sweep):\n",
        frontier_table(res),
    ]
    cmp = res.comparison
    within = f"(<= {100 * max_mismatch:g}%)"
    for key, label in (
        ("best_k_only_controller", "best k-only controller"),
        ("best_fixed_cap_controller_within_constraint", f"best fixed-cap controller {within}"),
        ("best_joint_learned_within_constraint", f"best joint learned {within}"),
        ("joint_oracle_within_constraint", f"joint oracle {within}"),
    ):
        r = cmp.get(key)
        if r:
            blocks.append(
                f"{label}: {r['policy']}: speedup {r['speedup']:.3f} [{r['speedup_lo']:.3f}, {r['speedup_hi']:.3f}], "
                f"mismatched {100 * r['mismatch_rate']:.2f}%"
            )
    if "joint_learned_gain_over_best_k_only" in cmp:
        blocks.append(
            f"joint learned vs best k-only: {100 * cmp['joint_learned_gain_over_best_k_only']:+.1f}% "
            f"(goal +10%: {'met' if cmp['goal_10pct_met'] else 'not met'})"
        )
    return blocks
