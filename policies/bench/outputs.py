"""The files a benchmark run writes into its output folder (:func:`write_outputs`, every family).

* single: ``summary.csv``, ``categories.csv``, ``episodes.csv``, ``bench.json``, ``bench.md``,
  ``speedup.png``, ``speedup_by_category.png`` and ``generations.csv``;
* batch: ``bench-batch<B>.json`` and ``bench-batch<B>.md``;
* caps: ``bench_caps.json``, ``bench_caps.md``, ``generations_caps.csv``, ``frontier.png`` and a
  folder per joint policy trained by the run.
"""

from __future__ import annotations

from pathlib import Path

from policies.bench.figures import plot_categories, plot_frontier, plot_speedup
from policies.bench.result import BenchResult
from policies.bench.tables import category_table, frontier_table, markdown_table
from specenv.io import atomic_write_json, atomic_write_text

__all__ = ["write_outputs"]


def write_outputs(res: BenchResult, out: Path) -> list[Path]:
    """Write the run's files into ``out`` (created); returns their paths (the module docstring lists them).

    The single family's figures: ``speedup.png`` (every policy's mean speedup with its bootstrap 95%
    interval, one colour per policy family, the oracle bound as a labelled line;
    :func:`~policies.bench.figures.plot_speedup`) and ``speedup_by_category.png`` (pooled speedup per
    category of the best policy of each family; :func:`~policies.bench.figures.plot_categories`).
    """
    out.mkdir(parents=True, exist_ok=True)
    return {"single": _single, "batch": _batch, "caps": _caps}[res.family](res, out)


def _single(res: BenchResult, out: Path) -> list[Path]:
    import json

    assert res.categories is not None and res.episodes is not None
    paths = [
        out / "summary.csv",
        out / "categories.csv",
        out / "episodes.csv",
        out / "bench.json",
        out / "bench.md",
        out / "speedup.png",
        out / "speedup_by_category.png",
        out / "generations.csv",
    ]
    res.summary.to_csv(paths[0], index=False)
    res.categories.to_csv(paths[1], index=False)
    res.episodes.to_csv(paths[2], index=False)
    paths[3].write_text(json.dumps(res.to_json(), indent=2) + "\n")
    paths[4].write_text(markdown_table(res) + "\n\n" + category_table(res) + "\n")
    plot_speedup(res, paths[5])
    plot_categories(res, paths[6])
    if res.generations is not None:
        res.generations.to_csv(paths[7], index=False)
    else:
        paths.pop()
    return paths


def _batch(res: BenchResult, out: Path) -> list[Path]:
    B = res.context["batch_size"]
    paths = [out / f"bench-batch{B}.json", out / f"bench-batch{B}.md"]
    atomic_write_json(paths[0], res.to_json())
    atomic_write_text(paths[1], markdown_table(res) + "\n")
    return paths


def _caps(res: BenchResult, out: Path) -> list[Path]:
    assert res.generations is not None
    paths = [out / "bench_caps.json", out / "bench_caps.md", out / "generations_caps.csv", out / "frontier.png"]
    atomic_write_json(paths[0], res.to_json())
    atomic_write_text(paths[1], markdown_table(res) + "\n\n" + frontier_table(res) + "\n")
    atomic_write_text(paths[2], res.generations.to_csv(index=False))
    plot_frontier(res, paths[3])
    for pol in res.joint_policies.values():
        folder = out / pol.name
        pol.save(folder)
        paths.append(folder)
    return paths
