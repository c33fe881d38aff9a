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
