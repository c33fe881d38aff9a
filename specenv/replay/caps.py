"""The capped rounds of the joint (k, expert cap) action, as replay tables.

A set with the ``caps-v1`` extension carries, for every position row, cap level c = 1..C and budget
k, the capped target's accepted drafts, unique experts, mismatched tokens and log-prob gap
(:class:`specenv.traces.traceset.CapArrays`). :func:`joint_tables` turns them into what a replayed capped
round needs (DESIGN.md section 1, "A verification-time expert cap"): the accepted drafts, the tokens
the round commits ``min(acc + 1, N - t)``, the charged cost at the capped unique experts
(:meth:`specenv.cost.model.CostModel.charged_by_budget`: the cost model takes U as it is) and the
mismatched tokens clipped to the committed ones. The joint oracle (:mod:`oracle.caps`) and the
joint environment (:mod:`specenv.envs.caps`) both read these tables; nobody else recomputes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from specenv.cost.model import CostModel
from specenv.traces.traceset import PositionArrays

__all__ = ["JointTables", "joint_tables"]


@dataclass(frozen=True)
class JointTables:
    """The capped rounds of every position row, clipped at the generation's end (row order).

    Attributes:
        levels: (C,) the caps B_1..B_C (experts per layer), level c = index c-1.
        kmax: Largest budget.
        acc: (C, Kmax+1, n) int64 accepted drafts under cap c at budget k (column k = 0 is 0).
        committed: (C, Kmax+1, n) tokens the capped round commits, ``min(acc + 1, N - t)``.
        cost: (C, Kmax+1, n) charged cost in ms at the capped unique experts.
        U: (C, Kmax+1, n) capped unique experts.
        mis: (C, Kmax+1, n) mismatched committed tokens, clipped to ``committed``.
        lpgap: (C, Kmax+1, n) mean log-prob gap of the capped round (as recorded).
        unit_ms: Mean plain AR step C(t, 0) of the rows (the unit of the quality weight).
    """

    levels: tuple[int, ...]
    kmax: int
    acc: np.ndarray
    committed: np.ndarray
    cost: np.ndarray
    U: np.ndarray
    mis: np.ndarray
    lpgap: np.ndarray
    unit_ms: float

    @property
    def n_levels(self) -> int:
        """Number C of cap levels (excluding the uncapped level 0)."""
        return len(self.levels)

    @property
    def n_actions(self) -> int:
        """Joint actions ``(C+1) * (Kmax+1)``, index ``c * (Kmax+1) + k``."""
        return (self.n_levels + 1) * (self.kmax + 1)


def _distance(arrays: PositionArrays) -> np.ndarray:
    """(n,) tokens left N - t at every row."""
    lengths = arrays.lengths.astype(np.int64)
    starts = arrays.offsets[:-1].astype(np.int64)
    t = np.arange(len(arrays.L)) - np.repeat(starts, lengths)
    return np.repeat(lengths, lengths) - t


def joint_tables(
    arrays: PositionArrays,
    cost_model: CostModel,
    lookahead: int = 0,
    drafting: str | None = None,
    caps: Any = None,
) -> JointTables:
    """The capped rounds of ``caps`` on the rows of ``arrays``, charged by ``cost_model``.

    Args:
        arrays: The positions table (budgets 0..``arrays.kmax``).
        cost_model: The per-K cost model (it takes the capped U as it is).
        lookahead: Draft lookahead h (the draft charge of :meth:`~specenv.cost.model.CostModel.charged_table`).
        drafting: The drafting mode (:data:`specenv.cost.model.DRAFTING_MODES`).
        caps: The caps columns over the same rows (default ``arrays.cap_arrays()``): any object with
            ``caps`` (the levels B_1..B_C) and the (C, Kmax'+1, n) arrays ``acc``, ``U``, ``mis``, ``lpgap``.

    Raises:
        ValueError: Naming the array whose shape or values do not fit the rows.
    """
    if caps is None:
        caps = arrays.cap_arrays("the joint (k, cap) action")
    K, n = arrays.kmax, len(arrays.L)
    levels = tuple(int(x) for x in caps.caps)
    C = len(levels)
    out: dict[str, np.ndarray] = {}
    for name in ("acc", "U", "mis", "lpgap"):
        x = np.asarray(getattr(caps, name))
        if x.ndim != 3 or x.shape[0] != C or x.shape[1] < K + 1 or x.shape[2] != n:
            raise ValueError(f"caps.{name}: shape {x.shape}, need ({C}, >={K + 1}, {n}) for {C} cap levels")
        x = x[:, : K + 1, :]
        if not np.all(np.isfinite(x)):
            raise ValueError(f"caps.{name}: holds NaN or infinite values")
        out[name] = x
    acc = out["acc"].astype(np.int64)
    ks = np.arange(K + 1)[None, :, None]
    if np.any(acc < 0) or np.any(acc > ks):
        c, k, r = np.argwhere((acc < 0) | (acc > ks))[0]
        raise ValueError(f"caps.acc[{c}, {k}, {r}] = {acc[c, k, r]}: accepted drafts must lie in 0..k")
    if np.any(out["mis"] < 0):
        raise ValueError("caps.mis: mismatched tokens must be >= 0")
    dist = _distance(arrays)[None, None, :]
    committed = np.minimum(acc + 1, dist)
    mis = np.minimum(out["mis"].astype(np.float64), committed)
    U = out["U"].astype(np.float64)
    cost = np.empty((C, K + 1, n))
    for c in range(C):
        cost[c] = cost_model.charged_by_budget(U[c], arrays.L, lookahead, drafting=drafting)
    unit = float(np.mean(cost_model.target_ms(0, arrays.U[:, 0], arrays.L)))
    return JointTables(levels, K, acc, committed, cost, U, mis, out["lpgap"].astype(np.float64), unit)
