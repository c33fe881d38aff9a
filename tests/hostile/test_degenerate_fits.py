"""Degenerate data refused at fit time: one line naming the table and column, nothing written.

Constant or implausibly large timings, constant (collinear) regressors and sets too small for the
standard errors clustered by generation, through ``fit`` (with ``--out`` and ``--json``), the commands
that fit a cost model on a split (``oracle``, ``export``, ``bench --batch``), the environment's
``cost_model="fit"`` and ``batch fit``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import specenv  # noqa: F401  (registers the environments)
from specenv.cost.batchfit import load_steps, write_steps
from specenv.generator import generate_paper
from tests.hostile.harness import reject_cleanly

RECORDING = Path(__file__).resolve().parents[2] / "specenv" / "data" / "live-vllm-batch-v1"


def _with_rounds(src: Path, dst: Path, edit: Callable[[pd.DataFrame], None]) -> Path:
    """A copy of the trace set ``src`` whose rounds table went through ``edit`` (manifest sha256 updated)."""
    shutil.copytree(src, dst)
    table = pq.read_table(dst / "rounds.parquet")
    df = table.to_pandas()
    edit(df)
    pq.write_table(pa.Table.from_pandas(df, schema=table.schema, preserve_index=False), dst / "rounds.parquet")
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["files"]["rounds"]["sha256"] = hashlib.sha256((dst / "rounds.parquet").read_bytes()).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _set(col: str, value: float) -> Callable[[pd.DataFrame], None]:
    return lambda df: df.__setitem__(col, value)


ROUNDS_CASES = [
    ("constant-target-times", _set("T_T_ms", 5.0), ["rounds table", "'T_T_ms'", "constant"]),
    ("constant-draft-times", _set("T_D_ms", 2.0), ["rounds table", "'T_D_ms'", "constant"]),
    ("constant-U", _set("U_r", 8.0), ["rounds table", "'U_r'", "collinear"]),
    ("constant-L", _set("L", 100), ["rounds table", "'L'", "collinear"]),
    ("huge-target-times", lambda df: df.__setitem__("T_T_ms", df["T_T_ms"] * 1e37), ["rounds.parquet", "'T_T_ms'"]),
    ("huge-draft-times", lambda df: df.__setitem__("T_D_ms", df["T_D_ms"] * 1e37), ["rounds.parquet", "'T_D_ms'"]),
]


@pytest.mark.parametrize(("case", "edit", "names"), ROUNDS_CASES, ids=[c[0] for c in ROUNDS_CASES])
def test_fit_refuses_degenerate_rounds(tmp_path, small_traces, case, edit, names):
    traces = _with_rounds(small_traces, tmp_path / "set", edit)
    work = tmp_path / "work"
    work.mkdir()
    reject_cleanly(["fit", traces, "--out", work / "model.json", "--json"], names, [tmp_path])


@pytest.fixture(scope="module")
def one_generation(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("one") / "one"
    generate_paper(1, kmax=4, seed=3, name="one").save(path)
    return path


@pytest.fixture(scope="module")
def two_generations(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("two") / "two"
    generate_paper(2, kmax=4, seed=3, name="two").save(path)
    return path


CLUSTER = ["'generation_id'", "two or more"]


def test_oracle_on_one_generation(tmp_path, one_generation):
    reject_cleanly(["oracle", one_generation], CLUSTER, [tmp_path, one_generation])


def test_export_with_a_one_generation_train_split(tmp_path, two_generations):
    root = tmp_path / "root"
    args = ["export", "minari", "--dataset", two_generations, "--policy", "fixed-k:k=2", "--root", root]
    reject_cleanly(args, CLUSTER, [tmp_path, two_generations])
    assert not root.exists()


def test_batch_bench_with_a_one_generation_train_split(tmp_path, two_generations):
    args = ["bench", two_generations, "--batch", "2", "--no-learners", "--out", tmp_path / "out"]
    reject_cleanly(args, CLUSTER, [tmp_path, two_generations])


def test_env_fit_on_one_generation_is_a_value_error(one_generation):
    with pytest.raises(ValueError, match="'generation_id'.*two or more"):
        gym.make("specenv/MoESpec-v1", dataset=str(one_generation), cost_model="fit")


# ---------------------------------------------------------------------- batch steps
def _steps(tmp_path: Path, edit: Callable[[pd.DataFrame], None]) -> Path:
    steps, manifest = load_steps(RECORDING)
    steps = steps.copy()
    edit(steps)
    folder = tmp_path / "rec"
    manifest = {k: v for k, v in manifest.items() if k != "files"}
    # written without fitting (the fit is what is under test), with its sha256: a valid recording file
    import pyarrow as pa

    from specenv.cost import batchfit
    from specenv.io import sha256_file

    folder.mkdir()
    pq.write_table(
        pa.Table.from_pandas(steps[list(batchfit.STEP_COLUMNS)], preserve_index=False), folder / "steps.parquet"
    )
    manifest["files"] = {
        "steps": {"path": "steps.parquet", "sha256": sha256_file(folder / "steps.parquet"), "rows": len(steps)}
    }
    (folder / "manifest.json").write_text(json.dumps({"format": batchfit.STEPS_FORMAT, **manifest}))
    return folder


STEPS_CASES = [
    ("constant-cpu-times", _set("T_T_cpu_ms", 4.0), ["'T_T_cpu_ms'", "constant"]),
    ("zero-cpu-times", _set("T_T_cpu_ms", 0.0), ["'T_T_cpu_ms'", "> 0"]),
    ("constant-draft-cpu-times", _set("T_D_cpu_ms", 1.0), ["'T_D_cpu_ms'", "constant"]),
    ("huge-times", _set("T_T_ms", 1e308), ["'T_T_ms'", "at most"]),
    ("huge-cpu-times", _set("T_T_cpu_ms", 1e300), ["'T_T_cpu_ms'", "at most"]),
]


@pytest.mark.parametrize(("case", "edit", "names"), STEPS_CASES, ids=[c[0] for c in STEPS_CASES])
def test_batch_fit_refuses_degenerate_steps(tmp_path, case, edit, names):
    rec = _steps(tmp_path, edit)
    reject_cleanly(
        ["batch", "fit", rec, "--out", tmp_path / "bc.json", "--json"], ["steps.parquet", *names], [tmp_path]
    )


def test_write_steps_still_writes_good_steps(tmp_path):
    steps, manifest = load_steps(RECORDING)
    write_steps(tmp_path / "rec", steps, manifest, fit=False)
    assert load_steps(tmp_path / "rec")[0].shape == steps.shape


# ---------------------------------------------------------------------- cost models given as files
@pytest.fixture(scope="module")
def fitted_model(small_traces, tmp_path_factory) -> dict:
    from specenv.cost.source import fresh_fit
    from specenv.traces.traceset import TraceSet

    return fresh_fit(TraceSet.load(small_traces)).to_json()


MODEL_CASES = [
    ("huge-intercept", ("target", 2, "beta0", 1e308), "'target.2'"),
    ("huge-context-slope", ("target", 1, "c", 1e3), "'target.1'"),
    ("huge-draft", ("draft", None, "d0", 1e300), "'draft'"),
]


@pytest.mark.parametrize(("case", "edit", "named"), MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_implausible_cost_model_refused_before_any_output(tmp_path, small_traces, fitted_model, case, edit, named):
    obj = json.loads(json.dumps(fitted_model))
    part, k, key, value = edit
    if k is None:
        obj[part][key] = value
    else:
        obj[part][str(k)][key] = value
    path = tmp_path / "model.json"
    path.write_text(json.dumps(obj))
    reject_cleanly(
        ["oracle", small_traces, "--cost-model", path, "--json"], [str(path), named, "plausible"], [tmp_path]
    )


def test_held_stderr_drops_a_library_s_fd2_noise_unless_released(capfd):
    import os

    from policies.distributed import _stderr_held

    with _stderr_held():
        os.write(2, b"gcs_client.cc: retrying\n")
    assert capfd.readouterr().err == ""
    with _stderr_held() as held:
        os.write(2, b"kept\n")
    held.release()
    assert capfd.readouterr().err == "kept\n"


# ---------------------------------------------------------------------- validate refuses what later commands refuse
def test_validate_refuses_a_negative_generation_id(tmp_path, small_traces):
    def edit(df: pd.DataFrame) -> None:
        df.loc[df["generation_id"] == df["generation_id"].min(), "generation_id"] = -1

    traces = _with_rounds(small_traces, tmp_path / "set", edit)
    reject_cleanly(["validate", traces], ["rounds.parquet", "'generation_id'", "negative"], [tmp_path])


@pytest.mark.parametrize("name", ["..", ".", "a/b"])
def test_validate_refuses_a_set_name_that_is_not_one_path_part(tmp_path, small_traces, name):
    traces = tmp_path / "set"
    shutil.copytree(small_traces, traces)
    manifest = json.loads((traces / "manifest.json").read_text())
    manifest["name"] = name
    (traces / "manifest.json").write_text(json.dumps(manifest))
    reject_cleanly(["validate", traces], ["manifest.json", "'name'"], [tmp_path])
