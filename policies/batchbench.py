"""The batch benchmark, now :mod:`policies.bench.batch` (this module re-exports it for old imports)."""

from policies.bench.batch import LEARNERS, VLLM_RULES, _episodes, run_batch_benchmark
from policies.bench.outputs import write_outputs as write_batch_outputs
from policies.bench.result import BenchResult as BatchBenchResult
from policies.bench.tables import batch_table as batch_markdown

__all__ = [
    "LEARNERS",
    "VLLM_RULES",
    "BatchBenchResult",
    "_episodes",
    "batch_markdown",
    "run_batch_benchmark",
    "write_batch_outputs",
]
