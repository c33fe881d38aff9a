"""Issue 26, the last round of probes: the cases that failed on 2fa0132 (each checked there by hand), held now.

- ``bench SET --batch 64 --no-learners --episodes 1`` on a 4-generation set (Kmax 10): minutes of fits on
  train, then a hang in the batch bound's enumeration of every step's budget multiset (C(B+K, K) of
  them: 4.9e12 here). Refused now in seconds with one line naming --batch, the count and the largest B.
- ``oracle --plot DIR`` replaced a user's ``DIR/oracle_sweep.png`` (there was no --overwrite), followed a
  link of that name onto a foreign file, and a FIFO of that name gave "File or stream is not seekable.".
- Policy strings: ``fixed-k:k=1_0`` and ``fixed-k:k=٣`` were read as 10 and 3 (Python's int());
  ``cascade:candidates=zzz`` said "'<=' not supported between instances of 'str' and 'int'",
  ``ucb:arms=zzz`` "invalid literal for int() with base 10: 'z'", ``cascade:candidates=5`` a TypeError.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from oracle.batch import MAX_MULTISETS, check_enumerable
from oracle.batch.lagrangian import multiset_count
from specenv.generator import generate_paper
from specenv.observation.single import ObservationSpec
from specenv.policy import registry
from tests.hostile.harness import (
    assert_rejected,
    assert_unchanged,
    reject_cleanly,
    run_cli,
    run_limited,
    snapshot,
)
from tests.hostile.test_policy_params import SPEC, _message

SECONDS = 120.0
MEMORY = 4 << 30  # bench imports matplotlib and numba: 1 GiB is not enough to start


# ---------------------------------------------------------------------- bench --batch 64
@pytest.fixture(scope="module")
def four_generations(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("four") / "four"
    generate_paper(4, kmax=10, seed=3, name="four").save(path)
    return path


def test_bench_batch_64_on_four_generations_is_refused_in_seconds(tmp_path, four_generations):
    out = tmp_path / "out"
    args = ["bench", four_generations, "--batch", "64", "--no-learners", "--episodes", "1", "--out", out]
    before = snapshot(tmp_path, four_generations)
    res = run_limited(args, memory_bytes=MEMORY, seconds=SECONDS)  # hung in the bound's enumeration before
    assert_rejected(res, "--batch", "64 requests", "Kmax 10", "multiset", "<= 11")
    assert_unchanged(before, snapshot(tmp_path, four_generations))
    assert not out.exists()


def test_the_batch_bound_api_refuses_before_its_work():
    import numpy as np

    from oracle.batch import batch_bound
    from specenv.traces.datasets import load_dataset

    arrays = load_dataset("paper-default").arrays()
    with pytest.raises(ValueError, match="batch_size: 64 requests per step at Kmax 10") as info:
        batch_bound(arrays, np.zeros(arrays.n_generations), None, 64, np.zeros((1, 4), dtype=np.int64))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("B", "K"), [(1, 3), (2, 3), (4, 3), (3, 5), (5, 2)])
def test_the_multiset_count_is_what_the_bound_enumerates(B, K):
    """Counted by enumeration here (full steps of B requests, tail steps of 1..B-1, 1 when B = 1)."""
    full = sum(1 for _ in itertools.combinations_with_replacement(range(K + 1), B))
    tail = sum(sum(1 for _ in itertools.combinations_with_replacement(range(K + 1), n)) for n in range(1, max(B, 2)))
    assert multiset_count(B, K) == full + tail


def test_the_limit_keeps_the_batch_sizes_the_project_runs():
    check_enumerable(4, 10)  # README: specenv batch bench live-vllm --batch 4
    check_enumerable(11, 10)  # the largest at Kmax 10
    with pytest.raises(ValueError, match="<= 11 at this Kmax"):
        check_enumerable(12, 10)
    assert multiset_count(11, 10) <= MAX_MULTISETS < multiset_count(12, 10)


# ---------------------------------------------------------------------- oracle --plot and the output rule
def _oracle(traces: Path, plot: Path, *extra: str) -> list:
    return ["oracle", traces, "--sweep", "--episodes", "0", "--plot", plot, "-q", *extra]


def test_oracle_keeps_a_users_figure(tmp_path, small_traces):
    plot = tmp_path / "p"
    plot.mkdir()
    (plot / "oracle_sweep.png").write_text("mine")
    reject_cleanly(_oracle(small_traces, plot), ["--plot", "oracle_sweep.png", "--overwrite"], [tmp_path])


def test_oracle_does_not_write_through_a_link(tmp_path, small_traces):
    plot = tmp_path / "p"
    plot.mkdir()
    (tmp_path / "mine.txt").write_text("mine")
    os.symlink("../mine.txt", plot / "oracle_sweep.png")
    names = ["--plot", "oracle_sweep.png", "not a regular file"]
    reject_cleanly([*_oracle(small_traces, plot), "--overwrite"], names, [tmp_path])
    assert (tmp_path / "mine.txt").read_text() == "mine"


def test_oracle_refuses_a_fifo_figure_without_opening_it(tmp_path, small_traces):
    plot = tmp_path / "p"
    plot.mkdir()
    os.mkfifo(plot / "oracle_sweep.png")
    before = snapshot(tmp_path)
    res = run_limited(_oracle(small_traces, plot), memory_bytes=MEMORY, seconds=SECONDS)
    assert_rejected(res, "--plot", "oracle_sweep.png", "not a regular file")
    assert_unchanged(before, snapshot(tmp_path))


def test_oracle_replaces_its_own_figure_and_a_users_with_overwrite(tmp_path, small_traces):
    plot = tmp_path / "p"
    first = run_cli(_oracle(small_traces, plot))
    assert first.exit_code == 0, first.stderr
    png = (plot / "oracle_sweep.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    again = run_cli(_oracle(small_traces, plot))  # specenv wrote it: no --overwrite needed
    assert again.exit_code == 0, again.stderr
    (plot / "oracle_sweep.png").write_text("mine")
    forced = run_cli(_oracle(small_traces, plot, "--overwrite"))
    assert forced.exit_code == 0, forced.stderr
    assert (plot / "oracle_sweep.png").read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------------- policy strings
BAD = [
    ("fixed-k:k=1_0", "'k'", "must be an integer"),
    ("fixed-k:k=٣", "'k'", "must be an integer"),
    ("ucb:c=1_0", "'c'", "must be a number"),
    ("cascade:candidates=zzz", "'candidates'", "list of integers"),
    ("cascade:candidates=5", "'candidates'", "list of integers"),
    ("ucb:arms=zzz", "'arms'", "list of integers"),
]


@pytest.mark.parametrize(("text", "named", "problem"), BAD, ids=[b[0] for b in BAD])
def test_policy_strings_read_ascii_numbers_and_declared_lists(text, named, problem):
    checked, resolved = _message(registry.check, text), _message(registry.resolve, text, SPEC)
    assert checked == resolved
    assert checked.startswith(f"policy {text!r}: parameter {named}") and problem in checked
    assert "\n" not in checked


@pytest.mark.parametrize("text", ["fixed-k:k=1_0", "cascade:candidates=zzz", "ucb:arms=zzz"])
def test_serve_refuses_them_before_start(tmp_path, text):
    named = text.split(":")[1].split("=")[0]
    reject_cleanly(
        ["serve", "--models", "small-moe-v1", "--policy", text, "--print-command"], [repr(named)], [tmp_path]
    )


def test_lists_through_the_api_are_checked_against_kmax():
    spec = ObservationSpec(6, 0)
    assert registry.resolve("cascade", spec, candidates=[1, 2]).candidates == (1, 2)
    assert registry.resolve("ucb", spec, arms=(0, 3)).arms == (0, 3)
    for name, kw, said in [
        ("cascade", {"candidates": (9,)}, "none is <= kmax=6"),
        ("ucb", {"arms": (0, 9)}, "0..kmax=6"),
        ("ucb", {"arms": (True,)}, "'arms'"),
        ("ucb", {"arms": ()}, "'arms'"),
    ]:
        assert said in _message(lambda name=name, kw=kw: registry.resolve(name, spec, **kw))
    assert registry.resolve("fixed-k:k=+3", spec).k == 3  # a sign is still a number
    assert registry.resolve("ucb:c=.5", spec).c == 0.5


def test_a_dsd_table_given_both_k_and_a_schedule_is_refused_not_half_ignored():
    """``vllm-dsd-table:k=2,schedule=1-4:3`` was accepted (the schedule won, k ignored), by serve's check too."""
    from policies.peers import VLLMDSDTable

    text = "vllm-dsd-table:k=2,schedule=1-4:3"
    checked, resolved = _message(registry.check, text), _message(registry.resolve, text, SPEC)
    assert checked == resolved == f"policy {text!r}: parameters 'k' and 'schedule': give one of them, not both"
    assert "give one" in _message(VLLMDSDTable, SPEC, 2, "1-4:3")
    assert registry.resolve("vllm-dsd-table:schedule=1-4:3", SPEC).k == 3


@pytest.mark.parametrize("address", ["local", "auto"])
def test_a_failed_ray_start_is_one_line_without_rays_notices(monkeypatch, capfd, address):
    """``tune`` (a local Ray cluster) printed Ray's token-auth notice before its error line when the start timed
    out; a remote address already held fd 2. Ray is faked: it writes to fd 2 from "C++" and fails."""
    from policies import distributed

    class FakeRay:
        def is_initialized(self) -> bool:
            return False

        def init(self, **kw) -> None:
            os.write(2, b"Token authentication is enabled for this Ray cluster.\n")
            raise RuntimeError("The current node timed out during startup.\nmore")

    monkeypatch.setattr(distributed, "ray_module", FakeRay)
    with pytest.raises(distributed.RayUnavailable) as info, distributed.ray_cluster(address):
        pass
    assert (
        str(info.value)
        == f"--ray: cannot connect to the Ray cluster at {address!r}: The current node timed out during startup."
    )
    assert capfd.readouterr().err == ""


# ---------------------------------------------------------------------- train --out: the run folder's outputs
def _train(traces: Path, out: Path, *extra: str) -> list:
    return ["train", "--algo", "imitation", "--traces", traces, "--out", out, "--iterations", "1", "-q", *extra]


def test_train_keeps_a_users_file_in_the_run_folder(tmp_path, small_traces):
    """``train --out run`` replaced a user's ``run/imitation-seed0/policy/policy.json`` (and a link of that name)."""
    pol = tmp_path / "run" / "imitation-seed0" / "policy"
    pol.mkdir(parents=True)
    (pol / "policy.json").write_text("mine")
    reject_cleanly(_train(small_traces, tmp_path / "run"), ["--out", "policy.json", "--overwrite"], [tmp_path])
    (pol / "policy.json").unlink()
    (tmp_path / "mine.json").write_text("mine")
    os.symlink("../../../mine.json", pol / "policy.json")
    names = ["--out", "policy.json", "not a regular file"]
    reject_cleanly([*_train(small_traces, tmp_path / "run"), "--overwrite"], names, [tmp_path])


def test_train_reruns_into_its_own_run_folder(tmp_path, small_traces):
    first = run_cli(_train(small_traces, tmp_path / "run"))
    assert first.exit_code == 0, first.stderr
    again = run_cli(_train(small_traces, tmp_path / "run"))  # specenv's run: replaced without --overwrite
    assert again.exit_code == 0, again.stderr


def test_tune_keeps_a_users_results_before_ray_starts(tmp_path, small_traces):
    """``tune --out t`` wrote t/results.csv, results.parquet and best.json over a user's files after the search."""
    t = tmp_path / "t"
    t.mkdir()
    (t / "results.csv").write_text("mine")
    args = ["tune", "--traces", small_traces, "--out", t, "--samples", "1", "--algo", "imitation", "-q"]
    reject_cleanly(args, ["--out", "results.csv", "--overwrite"], [tmp_path])
    (t / "results.csv").unlink()
    (tmp_path / "mine.json").write_text("mine")
    os.symlink("../mine.json", t / "best.json")
    reject_cleanly([*args, "--overwrite"], ["--out", "best.json", "not a regular file"], [tmp_path])
