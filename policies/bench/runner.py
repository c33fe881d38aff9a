"""The one benchmark loop: context -> roster of rows -> units -> rows -> result, for every family.

A family (:class:`Family`: :class:`policies.bench.single.SingleFamily`,
:class:`policies.bench.batch.BatchFamily`, :class:`policies.bench.caps.CapsFamily`) is built on
the run's :class:`~policies.bench.context.Context` and supplies its roster (the rows, in display
order), the evaluation of one row as a unit (in the row's environment, which the family's
environment factory builds, or exactly), optionally the units that run elsewhere (the Ray executor of
the single-request family), and the tabulation of the rows' outcomes beside its bound into the one
:class:`~policies.bench.result.BenchResult`. :func:`run_family` is the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from policies.bench.result import BenchResult

__all__ = ["Family", "Progress", "run_family"]

Row = TypeVar("Row")
#: ``progress(done, total, name)``: called as each row starts, with the rows done before it.
Progress = Callable[[int, int, str], None]


class Family(Protocol[Row]):
    """A benchmark family: a roster, one row's evaluation (its environment), and its bound and tables."""

    #: Name of a last ``progress(total, total, closing)`` call after every row (None: no such call).
    closing: str | None

    def roster(self) -> list[Row]:
        """The rows of the run, in display order (fitting or training what a row needs)."""
        ...

    def row_name(self, row: Row) -> str:
        """The name a row is shown by while it runs."""
        ...

    def remote(self, rows: list[Row]) -> dict[int, Any] | None:
        """Outcomes of the rows evaluated elsewhere, by row index (None: every row runs here)."""
        ...

    def evaluate(self, row: Row) -> Any:
        """One row evaluated here: its outcome (a table, or the reason it could not run)."""
        ...

    def result(self, rows: list[Row], outcomes: list[Any]) -> BenchResult:
        """The rows' outcomes, in roster order, beside the family's bound: the run's result."""
        ...


def run_family(family: Family[Any], progress: Progress | None = None) -> BenchResult:
    """Run a family: its roster, every row as a unit (here, or elsewhere as the family says), its result.

    ``progress`` is called before every row evaluated here (not when rows run elsewhere: progress is
    then the executor's business), and once more with the family's ``closing`` name if it has one.
    """
    rows = family.roster()
    elsewhere = family.remote(rows)
    outcomes = []
    for i, row in enumerate(rows):
        if progress is not None and elsewhere is None:
            progress(i, len(rows), family.row_name(row))
        outcomes.append(elsewhere[i] if elsewhere is not None and i in elsewhere else family.evaluate(row))
    if progress is not None and family.closing is not None:
        progress(len(rows), len(rows), family.closing)
    return family.result(rows, outcomes)
