"""``specenv tune``: Ray Tune searches of the learners' hyper-parameters, chosen on a validation split.

Every trial trains one :class:`policies.learn.runs.TrainRun` on the ``train-fit`` split (the train split minus
its validation carve, :mod:`specenv.traces.splits`) with the trial's hyper-parameters, then replays its
exported policy on the ``train-val`` split (also carved from train) and reports the pooled speedup
there; the search keeps the trial with the highest validation speedup. No trial reads a test
generation: the splits are carved from train, and the cost model must not be fitted on test rounds
(``--cost-model fit-train``, the default, fits on the train split's rounds; ``fit``, which uses every
round, is refused).

The validation score of a policy: each validation generation is replayed ``episodes`` times in the
replay environment of the policy's drafting mode (the streams of one vector environment,
:func:`specenv.envs.rollout.rollout_vector`, reset seeds :func:`specenv.envs.rollout.episode_seeds`), and the
score is sum of AR cost / sum of the policy's mean episode cost (pooled speedup), also as a share of the
exact oracle bound on the same generations (:func:`oracle.dp.solve`).

The search spaces (:data:`SPACES`) cover the recipe's most sensitive settings: for PPO and DQN the
learning rate plus the entropy bonus (PPO) or the exploration fraction (DQN) and the discount; for
DAgger (``imitation``, in drafting mode ``sequential`` the stop-rule learner) the Adam learning rate,
the epochs per iteration and the hidden layers. Samples are drawn by Ray Tune's random search, seeded
with ``seed`` (:class:`ray.tune.search.BasicVariantGenerator`).

Outputs in the ``--out`` folder: ``results.csv`` and ``results.parquet`` (the ResultGrid's table, one row
per trial: ``config/*`` hyper-parameters and the validation metrics), ``best.json`` (the best trial's
configuration and scores), and Ray Tune's own experiment folder ``ray_results/`` (trial logs and run
folders). Ray is imported only here (the ``ray`` extra).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from policies.learn.runs import TrainRun

#: The metric the search maximises (reported by every trial).
METRIC = "val_speedup_pooled"
#: Cost models a search may use (``fit`` fits on every round, test generations' included).
COST_MODELS_REFUSED = ("fit",)


#: The files :func:`run_tune` writes into its ``out_dir`` (``specenv tune`` keeps a user's file of these names).
OUTPUTS = ("results.csv", "results.parquet", "best.json")


def search_space(algo: str, mode: str) -> dict[str, Any]:
    """Ray Tune's search space of a learner (names as :class:`policies.learn.runs.TrainRun` ``overrides`` take them)."""
    from ray import tune

    if algo == "ppo":
        return {
            "learning_rate": tune.loguniform(1e-4, 3e-3),
            "ent_coef": tune.loguniform(1e-4, 3e-2),
            "gamma": tune.choice([0.95, 0.99]),
        }
    if algo == "dqn":
        return {
            "learning_rate": tune.loguniform(1e-4, 3e-3),
            "exploration_fraction": tune.uniform(0.1, 0.5),
            "gamma": tune.choice([0.95, 0.99]),
        }
    epochs = [4, 8, 16] if mode == "sequential" else [10, 30, 60]
    return {
        "lr": tune.loguniform(3e-4, 1e-2),
        "epochs": tune.choice(epochs),
        "hidden": tune.choice([[32, 32], [64, 64], [128, 128]]),
    }


#: The learners and what their space tunes (the space itself: :func:`search_space`).
SPACES = {
    "ppo": "learning_rate, ent_coef, gamma",
    "dqn": "learning_rate, exploration_fraction, gamma",
    "imitation": "lr, epochs, hidden (DAgger; in drafting mode sequential the stop-rule learner)",
}


def validation_score(policy_dir: Path, run: TrainRun, episodes: int, seed: int) -> dict[str, float]:
    """The exported policy of ``run`` replayed on the validation split (see the module docstring).

    Returns:
        ``val_speedup_pooled``, ``val_speedup_mean``, ``val_oracle_pct`` (pooled speedup / pooled bound),
        ``val_generations``.
    """
    from oracle.dp import solve
    from policies.learn.stopping import load_stop_rule
    from specenv.cost.model import drafting_mode
    from specenv.envs.rollout import rollout_split
    from specenv.policy.mlp import MLPPolicy

    stored = MLPPolicy.load(policy_dir).spec
    if stored.per_token:  # a stop rule: run in the round env, sequential mode, seeing all kmax signals
        kmax = stored.kmax
        h, mode, signals = kmax, "sequential", stored.signals
    else:
        h = stored.lookahead
        mode, signals = drafting_mode(h), (stored.signals if h else ("q",))

    def make_policy(spec: Any) -> Any:
        if stored.per_token:
            return load_stop_rule(policy_dir, expect=spec)
        return MLPPolicy.load(policy_dir, expect=spec)

    played = rollout_split(
        make_policy, run.traces, run.kmax, "train-val", run.cost_model, h, mode, signals, episodes, seed
    )
    res, gids = played.rollouts, played.generation_ids
    cost = res.cost.reshape(len(gids), episodes).mean(axis=1)
    ar = res.ar.reshape(len(gids), episodes)[:, 0]
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    ts = load_dataset(run.traces)
    bound = solve(select_positions(ts, run.kmax, "train-val"), cost_model_for(ts, run.cost_model))
    pooled = float(ar.sum() / cost.sum())
    return {
        "val_speedup_pooled": pooled,
        "val_speedup_mean": float((ar / cost).mean()),
        "val_oracle_pct": 100.0 * pooled / float(bound.speedup_pooled),
        "val_generations": int(len(gids)),
    }


def _trial(config: dict[str, Any], base: TrainRun, episodes: int, seed: int) -> None:
    """Ray Tune trainable: train on ``train-fit`` with ``config``, report the validation score."""
    from ray import tune

    overrides = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))
    run = replace(base, split="train-fit", overrides=overrides)
    folder = Path(tune.get_context().get_trial_dir()) / "run"
    from policies.learn.runs import train_run

    train_run(run, folder)
    tune.report(validation_score(folder / "policy", run, episodes, seed))


def _trials_progress(progress: Callable[[int, int, str], None], samples: int) -> Any:
    """A Tune callback that reports every ended trial to ``progress`` (the CLI's count and ETA).

    Tune pickles its callbacks with the experiment state; ``progress`` (a terminal writer) stays out of
    the pickle: a restored copy counts but reports nothing.
    """
    from ray.tune import Callback

    class TrialsProgress(Callback):
        def __init__(self, report: Callable[[int, int, str], None], total: int) -> None:
            self.ended, self.total = 0, total
            self.progress: Callable[[int, int, str], None] | None = report  # no closure: see above

        def __getstate__(self) -> dict[str, Any]:
            return {**self.__dict__, "progress": None}

        def _ended(self, trial: Any, how: str) -> None:
            self.ended += 1
            if self.progress is not None:
                self.progress(self.ended, self.total, f"trial {trial.trial_id} {how}")

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self._ended(trial, "done")

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self._ended(trial, "failed")

    return TrialsProgress(progress, samples)


def run_tune(
    base: TrainRun,
    out_dir: Path,
    samples: int,
    episodes: int = 2,
    seed: int = 0,
    cpus_per_trial: float = 1.0,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    """Search the hyper-parameters of ``base``'s learner; write the ResultGrid as CSV and Parquet.

    Ray must be initialised (:func:`policies.distributed.ray_cluster`).

    Args:
        base: The run every trial starts from (learner, drafting mode, budget, trace set, seed).
        out_dir: Output folder (created): ``results.csv``, ``results.parquet``, ``best.json``, ``ray_results/``.
        samples: Trials.
        episodes: Validation episodes per generation.
        seed: Seed of the random search and of the validation episodes.
        cpus_per_trial: CPUs Ray reserves per trial.
        progress: ``progress(done, total, what)`` as each trial ends (completed or failed), in the driver.

    Returns:
        The content of ``best.json``.

    Raises:
        ValueError: A refused cost model, or every trial failed (the first error, one line).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    from specenv.io import atomic_file, atomic_write_json, atomic_write_text, record_written

    if base.cost_model in COST_MODELS_REFUSED:
        raise ValueError(
            f"--cost-model: {base.cost_model!r} is fitted on every round, the test generations' included; "
            "a search uses fit-train, profile or a cost-model JSON"
        )
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    trainable = tune.with_resources(
        tune.with_parameters(_trial, base=base, episodes=episodes, seed=seed), {"cpu": cpus_per_trial}
    )
    tuner = tune.Tuner(
        trainable,
        param_space=search_space(base.algo, base.mode),
        tune_config=tune.TuneConfig(
            metric=METRIC,
            mode="max",
            num_samples=samples,
            search_alg=BasicVariantGenerator(random_state=seed),
        ),
        run_config=tune.RunConfig(
            name=f"{base.name}",
            storage_path=str(out_dir / "ray_results"),
            verbose=0,
            callbacks=[] if progress is None else [_trials_progress(progress, samples)],
        ),
    )
    with contextlib.redirect_stdout(sys.stderr):  # Tune's tables go to stderr: stdout stays the command's
        grid = tuner.fit()
    df = grid.get_dataframe()
    if METRIC not in df.columns or df[METRIC].isna().all():
        errors = [str(e).strip().splitlines()[-1] for e in grid.errors] or ["no trial reported a score"]
        raise ValueError(f"tune: every trial failed: {errors[0]}")
    keep = [c for c in df.columns if c.startswith("config/") or c.startswith("val_")]
    keep += [c for c in ("trial_id", "time_total_s", "logdir") if c in df.columns]
    table = df[keep].copy()
    for c in table.columns:  # list-valued choices (hidden layers) as text: one type per column
        if table[c].map(lambda v: isinstance(v, list | tuple)).any():
            table[c] = table[c].map(json.dumps)
    atomic_write_text(out_dir / "results.csv", table.to_csv(index=False))
    with atomic_file(out_dir / "results.parquet") as tmp:
        pq.write_table(pa.Table.from_pandas(table, preserve_index=False), tmp)
    best = grid.get_best_result(metric=METRIC, mode="max")
    summary = {
        "algo": base.algo,
        "drafting": base.mode,
        "traces": base.traces,
        "cost_model": base.cost_model,
        "trained_on": "train-fit (train minus the validation carve)",
        "chosen_on": "train-val (the validation split, carved from train; no test generation is read)",
        "metric": METRIC,
        "trials": int(len(table)),
        "best_config": best.config,
        "best": {k: v for k, v in best.metrics.items() if k.startswith("val_")},
        "results": [str(out_dir / "results.csv"), str(out_dir / "results.parquet")],
    }
    summary["best"] = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary["best"].items()
    }
    atomic_write_json(out_dir / "best.json", summary)
    record_written([out_dir / name for name in OUTPUTS])  # the output rule: a later run may replace them
    return summary
