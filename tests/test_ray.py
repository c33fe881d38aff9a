"""Ray as the distributed engine (policies/distributed.py, policies/learn/tune.py): the same outputs as the local path.

The module starts its own local cluster (``ray.init(num_cpus=2)``) once and shuts it down at the end;
the CLI's ``--ray`` keeps a cluster the process already started.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specenv.cli import app
from specenv.cli.common import bare_ray

ray = pytest.importorskip("ray", reason="the ray extra is not installed (make venv installs it)")

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
#: bench rows covering every kind of Monte-Carlo row: a heuristic with per-stream memory, a fitted peer,
#: a sequential stop rule, block drafting, and the shipped learned policies (MLPs on batches of streams)
BENCH_ONLY = ["UCB", "SpecDec++", "confidence ROC", "delta-space + confidences", "(learned)"]


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of 2 CPUs for this module (``ray.init(num_cpus=2)``, shut down at the end)."""
    from policies.distributed import ray_cluster

    with ray_cluster("local", num_cpus=2):
        assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 2
        yield ray
    assert not ray.is_initialized()


def _ok(args: list[str]) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return res.stdout


@pytest.mark.slow
def test_bench_ray_equals_local_exactly(cluster, tmp_path: Path) -> None:
    only = [a for o in BENCH_ONLY for a in ("--only", o)]
    common = ["bench", "paper-default", "--episodes", "2", "--seed", "3", "--quiet", *only]
    _ok([*common, "--out", str(tmp_path / "local")])
    # chunks of 7 of the 26 held-out generations (7, 7, 7, 5): every row is cut across tasks
    _ok([*common, "--out", str(tmp_path / "ray"), "--ray", "--ray-chunk", "7"])
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ray").iterdir())
    for name in names:  # the CSVs, bench.json, bench.md and both figures, byte for byte
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "ray" / name).read_bytes(), name
    summary = json.loads((tmp_path / "ray" / "bench.json").read_text())
    rows = {p["policy"] for p in summary["policies"]}
    assert any("(learned)" in r or "constant" in r for r in rows) and any(r.startswith("UCB") for r in rows)
    assert len(summary["policies"]) >= 8


def test_bench_units_partition_and_chunking_does_not_change_a_row(cluster) -> None:
    """run_unit over any partition of the test generations concatenates to run_policy's frame."""
    import pandas as pd

    from policies.bench.single import BenchSetup, run_policy, run_unit, setup_entries
    from policies.distributed import chunks

    ctx, entries = setup_entries(BenchSetup("paper-default", None, "fit-train", None, ("UCB",), None))
    (i,) = [j for j, e in enumerate(entries) if e.exact_k is None]
    whole, _ = run_policy(entries[i], ctx, 2, 5)
    gids = np.asarray(ctx.test.generation_ids, dtype=np.int64)
    for size in (1, 5, 26):
        parts = [run_unit(ctx, entries, i, part, 2, 5) for part in chunks(gids, size)]
        pd.testing.assert_frame_equal(pd.concat(parts, ignore_index=True), whole, check_exact=True)
    with pytest.raises(ValueError, match="--ray-chunk"):
        chunks(gids, 0)


def test_oracle_ray_equals_local(cluster, tmp_path: Path) -> None:
    args = ["oracle", "paper-default", "--sweep", "--delta", "--episodes", "2", "--json", "--quiet"]
    local = json.loads(_ok(args))
    on_ray = json.loads(_ok([*args, "--ray"]))
    assert on_ray == local
    assert [r["kmax"] for r in local["sweep"]] == list(range(1, local["kmax"] + 1))


def test_train_ray_writes_the_local_runs(cluster, tmp_path: Path) -> None:
    args = ["train", "--algo", "imitation", "--iterations", "1", "--epochs", "2", "--seed", "0", "--seed", "1"]
    args += ["--quiet", "--json"]
    local = json.loads(_ok([*args, "--out", str(tmp_path / "local")]))
    on_ray = json.loads(_ok([*args, "--out", str(tmp_path / "ray"), "--ray"]))
    assert [Path(s["policy"]).parent.name for s in on_ray] == ["imitation-seed0", "imitation-seed1"]
    weights = {}
    for s_local, s_ray in zip(local, on_ray, strict=True):
        a, b = Path(s_local["policy"]), Path(s_ray["policy"])
        assert b.parent.parent == tmp_path / "ray"
        wa, wb = np.load(a / "weights.npz"), np.load(b / "weights.npz")
        assert sorted(wa.files) == sorted(wb.files)
        # DAgger runs torch on one thread in both places: the same seed gives the same network
        for f in wa.files:
            np.testing.assert_array_equal(wa[f], wb[f])
        weights[b.parent.name] = wb
        ma, mb = (json.loads((p / "policy.json").read_text())["meta"] for p in (a, b))
        ma.pop("train_seconds"), mb.pop("train_seconds")
        assert ma == mb
    w0, w1 = weights["imitation-seed0"], weights["imitation-seed1"]
    assert any(not np.array_equal(w0[f], w1[f]) for f in w0.files)  # two seeds: two different runs


@pytest.mark.slow
def test_train_ray_sb3_runs_equal_the_local_runs(cluster, tmp_path: Path) -> None:
    """PPO and DQN set one torch thread: the same seed trains the same network here and in a worker."""
    args = ["train", "--algo", "ppo", "--algo", "dqn", "--timesteps", "1000", "--n-envs", "4", "--quiet", "--json"]
    local = json.loads(_ok([*args, "--out", str(tmp_path / "local")]))
    on_ray = json.loads(_ok([*args, "--out", str(tmp_path / "ray"), "--ray"]))
    for s_local, s_ray in zip(local, on_ray, strict=True):
        a, b = Path(s_local["policy"]), Path(s_ray["policy"])
        assert a.parent.name == b.parent.name and (b.parent / "model.zip").is_file()
        wa, wb = np.load(a / "weights.npz"), np.load(b / "weights.npz")
        for f in wa.files:
            np.testing.assert_array_equal(wa[f], wb[f])


def test_tune_trial_never_reads_test(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What a trial runs (train on train-fit, score on train-val) asks for no split but train's."""
    import specenv.traces.splits as splits
    from policies.learn.runs import TrainRun, train_run
    from policies.learn.tune import validation_score

    asked: list[str] = []
    real = splits.split_mask

    def spy(ids, split):  # noqa: ANN001, ANN202
        asked.append(split)
        return real(ids, split)

    monkeypatch.setattr(splits, "split_mask", spy)
    run = TrainRun("imitation", "paper-default", "t", iterations=1, epochs=2, cost_model="fit-train")
    run = replace(run, split="train-fit", overrides=(("hidden", (16,)), ("lr", 0.01)))
    summary = train_run(run, tmp_path / "t")
    score = validation_score(tmp_path / "t" / "policy", run, episodes=1, seed=0)
    assert asked and set(asked) <= {"train", "train-fit", "train-val"}, sorted(set(asked))
    assert "train-val" in asked and "train-fit" in asked
    assert summary["meta"]["trace_set"]["split"] == "train-fit"
    assert summary["meta"]["hyperparameters"]["hidden"] == [16]
    assert summary["meta"]["hyperparameters"]["learning_rate"] == 0.01
    assert score["val_generations"] == 20 and 0.5 < score["val_speedup_pooled"]
    assert 0 < score["val_oracle_pct"] <= 100.0 + 1e-9


def test_sb3_trial_takes_every_hyper_parameter_of_its_space(tmp_path: Path) -> None:
    """The PPO space's names (gamma included, train_sb3's own argument) reach the recipe."""
    from policies.learn.runs import TrainRun, train_run

    over = (("ent_coef", 0.003), ("gamma", 0.95), ("learning_rate", 0.0007))
    run = TrainRun("ppo", "paper-default", "p", timesteps=1000, n_envs=4, split="train-fit", overrides=over)
    hp = train_run(run, tmp_path / "p")["meta"]["hyperparameters"]
    assert (hp["ent_coef"], hp["gamma"], hp["learning_rate"]) == (0.003, 0.95, 0.0007)


def test_tune_writes_result_grid_csv_and_parquet(cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / "tune"
    monkeypatch.setenv("SPECENV_PROGRESS_INTERVAL", "0.2")
    res = runner.invoke(
        app,
        ["tune", "--algo", "imitation", "--samples", "2", "--iterations", "1", "--episodes", "1"]
        + ["--out", str(out), "--json"],
    )
    assert res.exit_code == 0, res.output
    best = json.loads(res.stdout)
    # the trials are counted as Tune ends them (a callback in the driver): the count, then the closing line
    assert "tune: 2/2 trials, done in" in res.stderr, res.stderr[-2000:]
    table = pq.read_table(out / "results.parquet").to_pandas()
    csv = (out / "results.csv").read_text().splitlines()
    assert len(table) == 2 and len(csv) == 3
    assert {"config/lr", "config/epochs", "config/hidden", "val_speedup_pooled", "val_oracle_pct"} <= set(table)
    assert best["best"]["val_speedup_pooled"] == pytest.approx(table["val_speedup_pooled"].max())
    assert best["chosen_on"].startswith("train-val") and best["cost_model"] == "fit-train"
    assert json.loads((out / "best.json").read_text()) == best


def test_tune_refuses_a_cost_model_fitted_on_test(tmp_path: Path) -> None:
    res = runner.invoke(app, ["tune", "--cost-model", "fit", "--out", str(tmp_path / "t")])
    assert res.exit_code == 2
    assert "--cost-model" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("address", "words"),
    [("127.0.0.1:1", "cannot connect"), ("nonsense", "not a cluster address"), ("ray://localhost:1", "cannot connect")],
)
def test_bad_ray_address_is_one_line_exit_2(address: str, words: str, tmp_path: Path) -> None:
    for cmd in (["bench", "--out", str(tmp_path / "b")], ["oracle", "paper-default", "--sweep"]):
        res = runner.invoke(app, [*cmd, "--ray", address, "--quiet"])
        assert res.exit_code == 2, res.output
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("specenv: error: --ray:") and words in lines[0], lines
    assert not (tmp_path / "b").exists()


def test_ray_chunk_needs_ray(tmp_path: Path) -> None:
    res = runner.invoke(app, ["bench", "--ray-chunk", "3", "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "--ray-chunk: needs --ray" in res.stderr


def test_bare_ray_means_a_local_cluster() -> None:
    assert bare_ray(["bench", "--ray"]) == ["bench", "--ray", "local"]
    assert bare_ray(["bench", "--ray", "--quiet"]) == ["bench", "--ray", "local", "--quiet"]
    assert bare_ray(["bench", "--ray", "auto"]) == ["bench", "--ray", "auto"]
    assert bare_ray(["bench", "--ray=h:1"]) == ["bench", "--ray=h:1"]
    assert bare_ray(["x", "--", "--ray"]) == ["x", "--", "--ray"]


def test_validation_split_is_carved_from_train() -> None:
    from specenv.traces.splits import split_ids

    ids = np.arange(1000, 1128)
    train, test = set(split_ids(ids, "train")), set(split_ids(ids, "test"))
    fit, val = set(split_ids(ids, "train-fit")), set(split_ids(ids, "train-val"))
    assert fit | val == train and not fit & val and not (fit | val) & test
    assert len(val) == round(0.2 * len(train))
    assert set(split_ids(ids[::-1], "train-val")) == val  # order does not matter


def test_core_and_cli_import_no_ray() -> None:
    probe = (
        "import sys; import specenv, specenv.cli, policies.distributed, policies.learn.tune, policies.bench.single; "
        "import oracle; "
        "from typer.testing import CliRunner; r = CliRunner().invoke(specenv.cli.app, ['--help']); "
        "assert r.exit_code == 0; print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
