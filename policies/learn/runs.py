"""One training run of ``specenv train``: the learner it dispatches to, the provenance, the exported folder.

A run is described by plain values (:class:`TrainRun`), so the same run can be trained here (the
local path of ``specenv train``) or in a Ray worker (``specenv train --ray``,
:func:`policies.distributed.ray_train`); both call :func:`train_run`, which writes the run folder
(``policy/policy.json`` + ``policy/weights.npz``; PPO and DQN also ``model.zip`` and TensorBoard logs
under ``tb/``) and returns the summary ``specenv train --json`` prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The learners of ``specenv train`` (``imitation`` with drafting ``sequential`` is the stop-rule learner).
ALGOS = ("ppo", "dqn", "imitation")


@dataclass(frozen=True)
class TrainRun:
    """Everything one training run needs (plain values: it travels to a Ray worker as it is).

    Attributes:
        algo: ``"ppo"``, ``"dqn"`` or ``"imitation"``.
        traces: Trace set name or folder (a folder must be visible at the same path on every worker).
        name: Run folder name.
        seed: Seed of the learner.
        mode: Drafting mode (``"none"``, ``"block"``, ``"sequential"``).
        h: Lookahead (block: the block size; else 0).
        timesteps: Environment steps (ppo, dqn).
        iterations: DAgger iterations (imitation).
        epochs: Passes over the DAgger aggregate per iteration (None: the learner's default).
        n_envs: Parallel streams (ppo, dqn).
        kmax: Largest budget (None: the set's Kmax).
        cost_model: ``"fit-train"`` (the train split's fit, the default), ``"fit"``, ``"profile"`` or a JSON path.
        gamma: Discount factor (ppo, dqn).
        split: Generations trained on (``"train"``; ``"train-fit"`` in a hyper-parameter search).
        expert: The expert imitation imitates (``"oracle"``, ``"belief"`` or ``"rollout"``:
            :func:`policies.learn.dagger.expert_arrays`).
        overrides: Hyper-parameters replacing the recipe's: SB3's names for ppo/dqn
            (:func:`policies.learn.rl.hyperparameters`), ``lr``/``epochs``/``hidden`` for imitation.
    """

    algo: str
    traces: str
    name: str
    seed: int = 0
    mode: str = "none"
    h: int = 0
    timesteps: int = 300_000
    iterations: int = 6
    epochs: int | None = None
    n_envs: int = 32
    kmax: int | None = None
    cost_model: str = "fit-train"
    gamma: float = 0.99
    split: str = "train"
    overrides: tuple[tuple[str, Any], ...] = ()
    expert: str = "oracle"


def train_run(
    run: TrainRun,
    folder: Path,
    log: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Train ``run`` into ``folder`` and export its policy to ``folder/policy`` (numpy form, no pickle).

    Args:
        run: The run.
        folder: The run folder (created; files of the same names are replaced).
        log: One line per DAgger iteration (imitation).
        progress: ``progress(done, total)``: steps (ppo, dqn) or DAgger iterations (imitation).

    Returns:
        ``{"algo", "drafting", "policy", "meta"}``: the summary of ``specenv train --json``.

    Raises:
        ValueError: For a bad learner argument (one line).
    """
    from policies.learn.export import provenance
    from specenv.traces.datasets import load_dataset

    if run.algo not in ALGOS:
        raise ValueError(f"--algo: unknown learner '{run.algo}' (known: {', '.join(ALGOS)})")
    ts = load_dataset(run.traces)
    over = dict(run.overrides)
    t0 = time.perf_counter()
    if run.algo == "imitation":
        done = [0]

        def iteration_done(line: str) -> None:
            done[0] += 1
            if log:
                log(line)
            if progress:
                progress(done[0], run.iterations)

        kw: dict[str, Any] = {"epochs": run.epochs} if run.epochs else {}
        kw |= {k: (tuple(v) if k == "hidden" else v) for k, v in over.items()}
        if run.mode == "sequential":
            from policies.learn.stopping import train_stop_dagger

            res: Any = train_stop_dagger(
                run.traces,
                kmax=run.kmax,
                cost_model=run.cost_model,
                iterations=run.iterations,
                seed=run.seed,
                log=iteration_done,
                split=run.split,
                expert=run.expert,
                **kw,
            )
        else:
            from policies.learn.imitation import train_dagger

            res = train_dagger(
                run.traces,
                kmax=run.kmax,
                cost_model=run.cost_model,
                lookahead=run.h,
                iterations=run.iterations,
                seed=run.seed,
                log=iteration_done,
                split=run.split,
                expert=run.expert,
                **kw,
            )
        policy = res.policy
    else:
        from policies.learn.rl import best_fixed_rate, train_sb3

        gamma = float(over.pop("gamma", run.gamma))  # the discount is train_sb3's own argument
        tr = train_sb3(
            run.algo,
            run.traces,
            folder,
            timesteps=run.timesteps,
            seed=run.seed,
            n_envs=run.n_envs,
            kmax=run.kmax,
            cost_model=run.cost_model,
            lookahead=run.h,
            gamma=gamma,
            drafting=run.mode,
            progress=progress,
            rate=best_fixed_rate(run.traces, run.kmax, run.cost_model, run.split),
            split=run.split,
            overrides=over or None,
        )
        policy = tr.policy
    policy.meta = provenance(
        policy.meta, ts, run.traces, run.cost_model, policy.spec, time.perf_counter() - t0, run.split
    )
    policy.save(folder / "policy")
    return {"algo": run.algo, "drafting": run.mode, "policy": str(folder / "policy"), "meta": policy.meta}
