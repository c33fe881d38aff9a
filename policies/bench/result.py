"""The one result type of every benchmark family (:class:`BenchResult`) and its plain-JSON form."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["FAMILIES", "BenchResult", "plain"]

#: The benchmark families, by the name a :class:`BenchResult` carries.
FAMILIES = ("single", "batch", "caps")


@dataclass
class BenchResult:
    """The tables of one benchmark run of any family.

    Attributes:
        family: ``"single"`` (one request), ``"batch"`` or ``"caps"`` (:data:`FAMILIES`).
        summary: One row per policy, in display order (single: then the bound rows).
        context: What the run used (data set, cost model, seeds, statistics, sizes).
        notes: Lines for the reader.
        bound: The bound's headline numbers (single: the SSP oracle's summary; batch: the batch bound;
            caps: empty, the oracles are rows of ``summary``).
        generations: One row per (policy, generation) (single, caps).
        categories: Pooled speedup per policy and category (single).
        episodes: The Monte-Carlo rows' episodes, one row each (single).
        skipped: Policies that could not run, with the reason (single).
        frontier: The joint oracle's speed / quality frontier, one row per quality weight (caps).
        comparison: The headline comparison under the quality constraint (caps).
        joint_policies: The joint learned policies trained by the run, by row name (caps).
    """

    family: str
    summary: pd.DataFrame
    context: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    bound: dict[str, Any] = field(default_factory=dict)
    generations: pd.DataFrame | None = None
    categories: pd.DataFrame | None = None
    episodes: pd.DataFrame | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)
    frontier: pd.DataFrame | None = None
    comparison: dict[str, Any] = field(default_factory=dict)
    joint_policies: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: expected one of {FAMILIES}")

    @property
    def oracle(self) -> dict[str, Any]:
        """The single-request family's name of :attr:`bound` (the SSP oracle's summary)."""
        return self.bound

    @property
    def rows(self) -> list[dict[str, Any]]:
        """:attr:`summary` as one plain dict per policy (the batch family's rows)."""
        return list(plain(self.summary.to_dict(orient="records")))

    def to_json(self) -> dict[str, Any]:
        """Plain strict JSON: numpy scalars as Python, NaN as ``null``, an infinite value as ``"inf"``.

        The layout is the family's: single ``context, oracle, policies, categories, notes, skipped``;
        batch ``context, bound, policies, notes``; caps ``context, summary, frontier, comparison, notes``.
        """
        records = self.summary.to_dict(orient="records")
        if self.family == "single":
            assert self.categories is not None
            cats = self.categories.pivot(index="policy", columns="category", values="speedup_pooled")
            out = {
                "context": self.context,
                "oracle": self.bound,
                "policies": records,
                "categories": cats.reset_index().to_dict(orient="records"),
                "notes": self.notes,
                "skipped": self.skipped,
            }
        elif self.family == "batch":
            out = {"context": self.context, "bound": self.bound, "policies": records, "notes": self.notes}
        else:
            assert self.frontier is not None
            out = {
                "context": self.context,
                "summary": records,
                "frontier": self.frontier.to_dict(orient="records"),
                "comparison": self.comparison,
                "notes": self.notes,
            }
        return plain(out)


def plain(obj: Any) -> Any:
    """Plain-JSON values: numpy scalars to Python, tuples to lists, NaN to None, +-inf to ``"inf"``/``"-inf"``."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, np.bool_ | bool):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating | float):
        x = float(obj)
        if math.isnan(x):
            return None
        return x if math.isfinite(x) else str(x)
    return obj
