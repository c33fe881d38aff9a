"""The files a benchmark run writes into its output folder (:func:`write_outputs`, every family).

* single: ``summary.csv``, ``categories.csv``, ``episodes.csv``, ``bench.json``, ``bench.md``,
  ``speedup.png``, ``speedup_by_category.png`` and ``generations.csv``;
* batch: ``bench-batch<B>.json`` and ``bench-batch<B>.md``;
* caps: ``bench_caps.json``, ``bench_caps.md``, ``generations_caps.csv``, ``frontier.png`` and a
  folder per joint policy trained by the run.

The files written are recorded in the folder's :data:`specenv.io.OUTPUTS_MARK`; a command checks
:func:`planned_files` before it runs, so it never replaces a file of these names that a user put there
(:func:`specenv.io.foreign_files`) without ``--overwrite``.
"""

from __future__ import annotations

from pathlib import Path

from policies.bench.figures import plot_categories, plot_frontier, plot_speedup
from policies.bench.result import BenchResult
from policies.bench.tables import category_table, frontier_table, markdown_table
from specenv.io import atomic_write_json, atomic_write_text, record_written

__all__ = ["planned_files", "write_outputs"]

_SINGLE = (
    "summary.csv",
    "categories.csv",
    "episodes.csv",
    "bench.json",
    "bench.md",
    "speedup.png",
    "speedup_by_category.png",
    "generations.csv",
)
_CAPS = ("bench_caps.json", "bench_caps.md", "generations_caps.csv", "frontier.png")


def planned_files(family: str, out: Path, batch_size: int | None = None) -> list[Path]:
    """The files a run of ``family`` may write into ``out`` (``batch_size`` names the batch family's)."""
    if family == "batch":
        return [out / f"bench-batch{batch_size}.json", out / f"bench-batch{batch_size}.md"]
    return [out / name for name in (_SINGLE if family == "single" else _CAPS)]


def write_outputs(res: BenchResult, out: Path) -> list[Path]:
    """Write the run's files into ``out`` (created); returns their paths (the module docstring lists them).

    The single family's figures: ``speedup.png`` (every policy's mean speedup with its bootstrap 95%
    interval, one colour per policy family, the oracle bound as a labelled line;
    :func:`~policies.bench.figures.plot_speedup`) and ``speedup_by_category.png`` (pooled speedup per
    category of the best policy of each family; :func:`~policies.bench.figures.plot_categories`).
    """
    out.mkdir(parents=True, exist_ok=True)
    paths = {"single": _single, "batch": _batch, "caps": _caps}[res.family](res, out)
    record_written([p for p in paths if p.is_file()])
    return paths


def _single(res: BenchResult, out: Path) -> list[Path]:
    import json

    assert res.categories is not None and res.episodes is not None
    paths = planned_files("single", out)
    text = json.dumps(res.to_json(), indent=2, allow_nan=False)  # strict JSON, checked before any file
    res.summary.to_csv(paths[0], index=False)
    res.categories.to_csv(paths[1], index=False)
    res.episodes.to_csv(paths[2], index=False)
    paths[3].write_text(text + "\n")
    paths[4].write_text(markdown_table(res) + "\n\n" + category_table(res) + "\n")
    plot_speedup(res, paths[5])
    plot_categories(res, paths[6])
    if res.generations is not None:
        res.generations.to_csv(paths[7], index=False)
    else:
        paths.pop()
    return paths


def _batch(res: BenchResult, out: Path) -> list[Path]:
    paths = planned_files("batch", out, res.context["batch_size"])
    atomic_write_json(paths[0], res.to_json())
    atomic_write_text(paths[1], markdown_table(res) + "\n")
    return paths


def _caps(res: BenchResult, out: Path) -> list[Path]:
    assert res.generations is not None
    paths = planned_files("caps", out)
    atomic_write_json(paths[0], res.to_json())
    atomic_write_text(paths[1], markdown_table(res) + "\n\n" + frontier_table(res) + "\n")
    atomic_write_text(paths[2], res.generations.to_csv(index=False))
    plot_frontier(res, paths[3])
    for pol in res.joint_policies.values():
        folder = out / pol.name
        pol.save(folder)
        paths.append(folder)
    return paths
