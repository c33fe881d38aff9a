"""Issue 26, round 4: the last cases of round 3 and this round's probes that failed (scripts/hostile_probes.py).

- ``bench SET --batch 64 --no-learners --episodes 1`` on a 4-generation set at Kmax 2 took 277 s at
  load ~1, 180 s of it the pathwise batch bound (one O(N^2) DP per request and charge, 512 of them, in
  numpy). The bound is compiled now (numba: all of a request's charges in one sweep over its reachable
  states), bit-identical to the numpy form (tests/test_batch_bound.py). The whole command still spends
  about a minute and a half in fits on train and the rows, so the case here is the bound itself, in a
  subprocess under a time and an address-space limit, and the command at --batch 8.
- The Lagrangian phase of the bound (85 s at B = 11, Kmax 10) printed no progress: it is its own phase
  now, ``bound (lagrangian)``, counting its splits with an ETA.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specenv.generator import generate_paper
from tests.hostile.harness import run_python_limited

MEMORY = 4 << 30  # numba and scipy: 1 GiB is not enough to start


@pytest.fixture(scope="module")
def four_k2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("four-k2") / "four"
    generate_paper(4, kmax=2, seed=0, name="four").save(path)
    return path


def test_pathwise_bound_of_64_requests_per_step_at_kmax_2_takes_seconds(four_k2):
    """The bound of ``bench --batch 64`` on this set: 256 requests (one episode of 4 B), both methods' charges."""
    code = f"""
import time
import numpy as np
from oracle.batch import batch_bound
from specenv.cost.batch import BatchCostModel
from specenv.cost.model import CostModel
from specenv.replay.tables import select_positions
from specenv.traces.traceset import TraceSet

ts = TraceSet.load({str(four_k2)!r})
arrays = select_positions(ts, None, "all")
L0 = np.full(arrays.n_generations, 100.0)
model = BatchCostModel.from_cost_model(CostModel.paper_profile(kmax=2), ts.manifest.model, max_batch=64)
seeds = np.random.default_rng(0).integers(0, 2**31, size=(1, 256))
t = time.monotonic()
bb = batch_bound(arrays, L0, model, 64, seeds, pathwise=True)
assert bb.pathwise.shape == (1,) and np.all(np.isfinite(bb.pathwise)) and np.all(bb.pathwise > 0)
print(f"{{time.monotonic() - t:.1f}}")
"""
    out = run_python_limited(code, memory_bytes=MEMORY, seconds=90.0)
    assert out.exit_code == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 60.0  # 180 s at load ~1 before (numpy, one DP per request and charge)


def test_bench_batch_reports_the_lagrangian_phase_with_an_eta(four_k2, tmp_path):
    """``bench --batch 8 --no-learners``: the bound's Lagrangian splits are a phase of their own, with an ETA."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, SPECENV_PROGRESS_INTERVAL="0.02")
    out = tmp_path / "out"
    args = ["bench", str(four_k2), "--batch", "8", "--no-learners", "--episodes", "1", "--out", str(out)]
    p = subprocess.run(
        [sys.executable, "-m", "specenv.cli", *args], capture_output=True, text=True, timeout=240, env=env
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    lag = [ln for ln in lines if ln.startswith("batch bench bound (lagrangian): ")]
    assert lag, p.stderr[-3000:]
    assert all(re.search(r": \d/4 splits \((chord|max) expert share, (full|tail) steps", ln) for ln in lag), lag[:5]
    assert any(", ETA " in ln for ln in lag), lag[-5:]
    assert any(ln.startswith("batch bench bound: ") and "request bounds" in ln for ln in lines)
    assert "Traceback" not in p.stderr


# ---------------------------------------------------------------------- round 4 probes that failed
@pytest.fixture(scope="module")
def six_k2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("six-k2") / "six"
    generate_paper(6, kmax=2, seed=0, name="six").save(path)
    return path


def test_bench_at_kmax_2_has_one_row_per_fixed_k(six_k2, tmp_path):
    """At Kmax <= 4 the rows fixed k=min(4, Kmax) and fixed k=Kmax had one name: bench died in its paired
    differences with "cannot reindex on an axis with duplicate labels" (and wrote nothing)."""
    import json

    from tests.hostile.harness import run_cli

    out = tmp_path / "out"
    res = run_cli(["-q", "bench", six_k2, "--episodes", "1", "--only", "fixed", "--out", out])
    assert res.exit_code == 0, res.stderr[-3000:]
    rows = [r["policy"] for r in json.loads((out / "bench.json").read_text())["policies"]]
    fixed = [r for r in rows if r.startswith("fixed k=")]
    assert fixed == ["fixed k=1", "fixed k=2"] and len(rows) == len(set(rows)), rows


@pytest.mark.parametrize("kind", ["fifo", "zero", "folder", "dangling"])
@pytest.mark.parametrize(
    ("command", "word"),
    [
        (["oracle", "{set}", "--cost-model", "{f}"], "--cost-model"),
        (["bench", "{set}", "--episodes", "1", "--cost-model", "{f}", "--out", "{d}/o"], "cost_model"),
        (
            ["serve", "--print-command", "--models", "small-moe-v1", "--policy", "fixed-k:k=1", "--cost-model", "{f}"],
            "--cost-model",
        ),
        (["collect", "--out", "{d}/c", "--prompts", "{f}", "-n", "1", "--kmax", "1"], "--prompts"),
    ],
    ids=["oracle", "bench", "serve", "collect"],
)
def test_a_special_file_named_as_a_json_input_says_what_it_is(six_k2, tmp_path, command, word, kind):
    """Was: "expected 'fit', 'fit-train', 'profile' or an existing .json file" (it exists), "not a shipped
    prompt set nor a JSON file", "is not a file"; now the file and what it is, in one line."""
    import os

    from tests.hostile.harness import assert_rejected, assert_unchanged, run_limited, snapshot

    f = tmp_path / "x.json"
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "zero":
        f.symlink_to("/dev/zero")
    elif kind == "folder":
        f.mkdir()
    else:
        f.symlink_to(tmp_path / "missing.json")
    what = {
        "fifo": "is a FIFO, not a regular file",
        "zero": "is a device, not a regular file",
        "folder": "is a folder, not a file",
        "dangling": "is a link to a missing file",
    }[kind]
    args = [a.format(set=six_k2, f=f, d=tmp_path) for a in command]
    before = snapshot(tmp_path)
    res = run_limited(args, memory_bytes=MEMORY, seconds=120.0)
    assert_rejected(res, word, str(f), what)
    assert_unchanged(before, snapshot(tmp_path))
