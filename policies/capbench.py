"""The joint (k, expert cap) benchmark, now :mod:`policies.bench.caps` (this module re-exports it for old imports)."""

from policies.bench.caps import DEFAULT_WEIGHTS, K_ORACLE, run_cap_bench
from policies.bench.figures import plot_frontier
from policies.bench.outputs import write_outputs
from policies.bench.result import BenchResult as CapBenchResult
from policies.bench.tables import frontier_table, markdown_table

__all__ = [
    "DEFAULT_WEIGHTS",
    "K_ORACLE",
    "CapBenchResult",
    "frontier_table",
    "markdown_table",
    "plot_frontier",
    "run_cap_bench",
    "write_outputs",
]
