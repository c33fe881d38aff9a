"""Issue 26 cases that had no regression test: each fails on 8664a5a (checked) and holds now.

- ``export minari --policy disco`` (a peer in drafting mode none): StopIteration traceback before.
- ``bench`` and ``tune`` on a 2-generation set (a 1-generation train split): ZeroDivisionError before.
- ``MoESpecBatch-v0(batch_cost=<a 1e308 coefficient>)``: accepted before, reward NaN / -1.7e308.
- ``bench --json`` with a 1e308 cost model: every output but the JSON written before.
- a FIFO or /dev/zero link as policy.json in ``bench --policies`` / ``bench-caps --policies``: a hang
  (FIFO) or a MemoryError traceback (/dev/zero) before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specenv.generator import generate_paper
from tests.hostile.harness import (
    assert_rejected,
    assert_unchanged,
    reject_cleanly,
    run_limited,
    run_python_limited,
    snapshot,
)
from tests.hostile.test_special_files import KINDS, WORD, _policy_dir

ROOT = Path(__file__).resolve().parents[2]
BATCH_COST = ROOT / "specenv" / "data" / "live-vllm-batch-v1" / "batchcost.json"
SECONDS = 120.0
MEMORY = 4 << 30  # bench imports matplotlib and compiles the numba oracle: 1 GiB is not enough to start
CLUSTER = ["'generation_id'", "two or more"]


@pytest.fixture(scope="module")
def two_generations(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("two") / "two"
    generate_paper(2, kmax=4, seed=3, name="two").save(path)
    return path


# ---------------------------------------------------------------------- a: a peer in drafting mode none
@pytest.mark.parametrize("name", ["disco", "specdec-pp"])
def test_export_of_a_lookahead_peer_without_lookahead_is_one_line(tmp_path, name):
    root = tmp_path / "root"
    reject_cleanly(["export", "minari", "--policy", name, "--root", root], [repr(name), "lookahead >= 1"], [tmp_path])
    assert not root.exists()


# ---------------------------------------------------------------------- b: a 2-generation set
def test_bench_on_two_generations(tmp_path, two_generations):
    reject_cleanly(["bench", two_generations, "--out", tmp_path / "out", "-q"], CLUSTER, [tmp_path, two_generations])


def test_tune_on_two_generations(tmp_path, two_generations):
    args = ["tune", "--traces", two_generations, "--out", tmp_path / "out", "--samples", "1", "--timesteps", "1000"]
    reject_cleanly([*args, "--algo", "ppo", "-q"], ["--cost-model", *CLUSTER], [tmp_path, two_generations])


# ---------------------------------------------------------------------- c: a 1e308 batch cost coefficient
def _set_beta0(d: dict) -> None:
    d["verify"]["beta0"][3] = 1e308


def _set_alpha(d: dict) -> None:
    d["verify"]["alpha"] = [1e308] * len(d["verify"]["alpha"])


def _set_d0(d: dict) -> None:
    d["draft"]["d0"] = 1e308


def _set_b_req(d: dict) -> None:
    d["verify"]["b_req"] = 1e308


BATCH_CASES = [("beta0", _set_beta0, "'verify'"), ("alpha", _set_alpha, "'verify'"), ("d0", _set_d0, "'draft'")]
BATCH_CASES.append(("b_req", _set_b_req, "'verify'"))


@pytest.mark.parametrize(("case", "edit", "field"), BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
def test_batch_env_refuses_an_implausible_batch_cost(tmp_path, case, edit, field):
    # a set of the model's Kmax (8): on 8664a5a the default set (Kmax 10) was refused for its Kmax instead
    data = tmp_path / "k8"
    generate_paper(4, kmax=8, seed=3, name="k8").save(data)
    obj = json.loads(BATCH_COST.read_text())
    edit(obj)
    path = tmp_path / "batchcost.json"
    path.write_text(json.dumps(obj))
    code = (
        "import gymnasium as gym, specenv\n"
        "try:\n"
        f"    env = gym.make('specenv/MoESpecBatch-v0', batch_cost={str(path)!r}, dataset={str(data)!r})\n"
        "    env.reset(seed=0)\n"
        "    print('ACCEPTED', env.step(env.action_space.sample())[1])\n"
        "except ValueError as e:\n    print(e)\n"
    )
    out = run_python_limited(code, memory_bytes=MEMORY, seconds=SECONDS)
    assert out.exit_code == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "ACCEPTED" not in lines[0], out.stdout
    for name in (str(path), field, "not a plausible time"):
        assert name in lines[0], lines[0]


# ---------------------------------------------------------------------- d: bench --json, implausible cost model
def test_bench_json_with_an_implausible_cost_model_writes_nothing(tmp_path, small_traces):
    from specenv.cost.source import fresh_fit
    from specenv.traces.traceset import TraceSet

    obj = fresh_fit(TraceSet.load(small_traces)).to_json()
    obj["target"]["2"]["beta0"] = 1e308
    model = tmp_path / "model.json"
    model.write_text(json.dumps(obj))
    out = tmp_path / "out"
    args = ["bench", small_traces, "--cost-model", model, "--json", "--out", out, "-q"]
    reject_cleanly(args, [str(model), "'target.2'", "plausible"], [tmp_path, small_traces])
    assert not out.exists()  # no bench.json, no summary.csv


# ---------------------------------------------------------------------- e: special policy files in bench
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["bench", "bench-caps"])
def test_bench_policies_with_a_special_policy_file_does_not_hang(tmp_path, small_traces, command, kind):
    pols = _policy_dir(tmp_path, "policy.json", kind).parent
    head = ["bench", small_traces] if command == "bench" else ["bench-caps"]
    args = [*head, "--policies", pols, "--only", "ppo", "--out", tmp_path / "o", "-q"]
    before = snapshot(tmp_path)
    out = run_limited(args, memory_bytes=MEMORY, seconds=SECONDS)  # a FIFO hung here; /dev/zero: MemoryError
    assert_rejected(out, "'ppo'", "policy.json", WORD[kind], "not a regular file")
    assert_unchanged(before, snapshot(tmp_path))
    assert os.path.exists(pols)
