"""Hostile arguments on the commands of the Minari / expert-caps / batch-cost / Ray session.

Each case was a silent misbehaviour found by the review (an option ignored, a filter that kept
nothing, a traceback from a Ray trial, a message naming a path inside the package) and is refused
now the way every other bad argument is: exit 2, one ``specenv: error:`` line naming the argument,
nothing written or deleted under the case's folder and the trace set it reads. Placeholders as in
``test_cli.py`` (``{T}`` the small trace set, ``{J}`` a truncated JSON file).
"""

from __future__ import annotations

import pytest

from tests.hostile.harness import reject_cleanly
from tests.hostile.test_cli import _fill, _ids, place  # noqa: F401  (place is a fixture)

SESSION_CASES: list[tuple[str, list[str], list[str]]] = [
    # --ray-cpus sizes the local cluster of a bare --ray: without one it was silently ignored
    ("bench-ray-cpus-without-ray", ["bench", "{T}", "--ray-cpus", "2", "--out", "b"], ["--ray-cpus", "bare --ray"]),
    ("bench-ray-cpus-with-address", ["bench", "{T}", "--ray", "auto", "--ray-cpus", "2"], ["--ray-cpus", "'auto'"]),
    ("oracle-ray-cpus-without-ray", ["oracle", "{T}", "--sweep", "--ray-cpus", "2"], ["--ray-cpus"]),
    ("train-ray-cpus-without-ray", ["train", "--traces", "{T}", "--ray-cpus", "2", "--out", "r"], ["--ray-cpus"]),
    ("tune-ray-cpus-with-address", ["tune", "--traces", "{T}", "--ray", "auto", "--ray-cpus", "2"], ["--ray-cpus"]),
    # oracle --ray without --sweep ran locally without a word
    ("oracle-ray-without-sweep", ["oracle", "{T}", "--ray"], ["--ray", "--sweep"]),
    # tune checked the cost model in every Ray trial: 500 lines of tracebacks and a half-made --out
    ("tune-cost-model-truncated", ["tune", "--traces", "{T}", "--cost-model", "{J}", "--out", "t"], ["--cost-model"]),
    # bench-caps --only that keeps no k-policy ran the oracles alone (bench refuses it)
    ("bench-caps-only-no-match", ["bench-caps", "--out", "o", "--only", "zzzz"], ["--only", "zzzz"]),
    # fit-batch named a path inside the installed package for an unknown recording name
    ("fit-batch-unknown-recording", ["fit-batch", "no-such-recording"], ["no-such-recording", "shipped"]),
    ("fit-batch-empty-recording", ["fit-batch", ""], ["RECORDING"]),
    # bench --batch ran its own rows and silently dropped the options of the k-only benchmark
    ("bench-batch-policies", ["bench", "{T}", "--batch", "2", "--policies", "{D}"], ["--policies", "--batch"]),
    ("bench-batch-only", ["bench", "{T}", "--batch", "2", "--only", "fixed"], ["--only", "--batch"]),
    ("bench-batch-drafting", ["bench", "{T}", "--batch", "2", "--drafting", "block"], ["--drafting", "--batch"]),
    ("bench-batch-ray-cpus", ["bench", "{T}", "--batch", "2", "--ray-cpus", "2"], ["--ray-cpus", "--batch"]),
    ("bench-batch-ray-chunk", ["bench", "{T}", "--batch", "2", "--ray-chunk", "3"], ["--ray-chunk", "--batch"]),
    ("bench-no-learners-without-batch", ["bench", "{T}", "--no-learners"], ["--no-learners", "--batch"]),
]


@pytest.mark.parametrize(("case", "args", "names"), SESSION_CASES, ids=_ids(SESSION_CASES))
def test_session_command_refuses_cleanly(place, small_traces, case, args, names):  # noqa: F811
    tmp_path, work, subs = place
    reject_cleanly(_fill(args, subs), _fill(names, subs), [tmp_path, small_traces], cwd=work)
