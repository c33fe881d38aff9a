"""The single-request benchmark, now :mod:`policies.bench` (this module re-exports it for old imports)."""

from policies.bench.context import (
    DEFAULT_COST_MODEL,
    N_BOOT,
    Context,
    build_context,
    shipped_policy_dir,
    train_priors,
)
from policies.bench.figures import FAMILIES, family_representatives, plot_categories, plot_speedup, policy_family
from policies.bench.outputs import write_outputs
from policies.bench.result import BenchResult
from policies.bench.single import (
    LEARNED,
    ORACLE_ROW,
    BenchExecutor,
    BenchSetup,
    Entry,
    _learned,
    default_entries,
    exact_generations,
    find_policies,
    peer_entries,
    run_benchmark,
    run_entry,
    run_policy,
    run_unit,
    select_entries,
    setup_entries,
)
from policies.bench.stats import generation_table, summarise
from policies.bench.tables import category_table, markdown_table

__all__ = [
    "DEFAULT_COST_MODEL",
    "FAMILIES",
    "LEARNED",
    "N_BOOT",
    "ORACLE_ROW",
    "BenchExecutor",
    "BenchResult",
    "BenchSetup",
    "Context",
    "Entry",
    "_learned",
    "build_context",
    "category_table",
    "default_entries",
    "exact_generations",
    "family_representatives",
    "find_policies",
    "generation_table",
    "markdown_table",
    "peer_entries",
    "plot_categories",
    "plot_speedup",
    "policy_family",
    "run_benchmark",
    "run_entry",
    "run_policy",
    "run_unit",
    "select_entries",
    "setup_entries",
    "shipped_policy_dir",
    "summarise",
    "train_priors",
    "write_outputs",
]
