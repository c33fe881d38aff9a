"""The one benchmark loop (policies.bench.runner.run_family) and the one result type's JSON."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pytest

from policies.bench.result import BenchResult, plain
from policies.bench.runner import run_family


@dataclass
class Toy:
    """A family of three rows whose outcome is the row squared; rows in ``away`` run "elsewhere" (negated)."""

    away: set[int] = field(default_factory=set)
    closing: str | None = None
    evaluated: list[int] = field(default_factory=list)

    def roster(self) -> list[int]:
        return [1, 2, 3]

    def row_name(self, row: int) -> str:
        return f"row {row}"

    def remote(self, rows: list[int]) -> dict[int, Any] | None:
        return {i: -rows[i] for i in self.away} if self.away else None

    def evaluate(self, row: int) -> int:
        self.evaluated.append(row)
        return row * row

    def result(self, rows: list[int], outcomes: list[Any]) -> BenchResult:
        df = pd.DataFrame({"policy": [self.row_name(r) for r in rows], "value": outcomes})
        return BenchResult("batch", df, {"rows": len(rows)})


def test_every_row_is_evaluated_once_in_roster_order_with_progress_before_each() -> None:
    calls: list[tuple[int, int, str]] = []
    fam = Toy(closing="bound")
    res = run_family(fam, lambda d, t, n: calls.append((d, t, n)))
    assert fam.evaluated == [1, 2, 3]
    assert res.summary["value"].tolist() == [1, 4, 9]
    assert calls == [(0, 3, "row 1"), (1, 3, "row 2"), (2, 3, "row 3"), (3, 3, "bound")]


def test_rows_run_elsewhere_are_not_evaluated_here_and_progress_is_the_executors() -> None:
    calls: list[tuple[int, int, str]] = []
    fam = Toy(away={0, 2})
    res = run_family(fam, lambda d, t, n: calls.append((d, t, n)))
    assert fam.evaluated == [2]
    assert res.summary["value"].tolist() == [-1, 4, -3]
    assert calls == []


def test_plain_json_values() -> None:
    got = plain({1: (np.int64(3), np.float64(0.5), np.bool_(True)), "x": [math.nan, math.inf, -math.inf, None]})
    assert got == {"1": [3, 0.5, True], "x": [None, "inf", "-inf", None]}
    assert type(got["1"][0]) is int and type(got["1"][1]) is float and type(got["1"][2]) is bool


def test_the_json_layout_is_the_familys() -> None:
    s = pd.DataFrame({"policy": ["a"], "speedup": [1.5]})
    batch = BenchResult("batch", s, {"c": 1}, ["n"], bound={"b": np.float64(2.0)}).to_json()
    assert list(batch) == ["context", "bound", "policies", "notes"]
    assert batch["policies"] == [{"policy": "a", "speedup": 1.5}] and batch["bound"] == {"b": 2.0}
    caps = BenchResult("caps", s, {}, frontier=pd.DataFrame({"quality_weight": [math.inf]})).to_json()
    assert list(caps) == ["context", "summary", "frontier", "comparison", "notes"]
    assert caps["frontier"] == [{"quality_weight": "inf"}]
    cats = pd.DataFrame({"policy": ["a", "a"], "category": ["x", "y"], "speedup_pooled": [1.0, 2.0]})
    single = BenchResult("single", s, {}, categories=cats, skipped=[{"policy": "p"}]).to_json()
    assert list(single) == ["context", "oracle", "policies", "categories", "notes", "skipped"]
    assert single["categories"] == [{"policy": "a", "x": 1.0, "y": 2.0}]
    with pytest.raises(ValueError, match="family"):
        BenchResult("k-only", s, {})
