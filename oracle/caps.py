"""The joint oracle: exact SSP over the action (k, expert cap), with a Lagrangian weight on mismatches.

The round model with an expert cap is DESIGN.md section 1 ("A verification-time expert cap"). At
position t the action is a pair (k, c): a budget k = 0..Kmax and a cap level c = 0..C, where c = 0
is the uncapped target (rho as in :mod:`oracle.dp`) and c >= 1 the cap ``B_c`` of the set's caps
extension. A capped round (c >= 1, k >= 1) is deterministic: it accepts ``acc_c(t,k)`` drafts (the
capped target's greedy verdict on the same chain), commits ``min(acc + 1, N - t)`` tokens of the
*reference* text, costs ``C_c(t,k) = T_D(k) + T_T(k, U_c(t,k), L_t)`` (the same
:class:`~specenv.cost.model.CostModel`, at the capped unique experts) and loses ``mis_c(t,k)``
tokens of quality: committed tokens that differ from the uncapped reference (clipped to the tokens
the round commits). k = 0 is never capped: the pairs (0, c >= 1) are not separate actions (the
oracle never picks them; the environment plays them as (0, 0)).

With a quality weight ``lam`` (ms per mismatched token) the oracle solves

    V(t) = min_{k,c} [ C(t,k,c) + lam * mis(t,k,c) + E V(next) ],   V(N) = 0,

by the backward sweep of :mod:`oracle.dp` (the same layout and the same uncapped arithmetic; the
capped pairs are added by the sweep's ``extra`` hook), so with no cap level (C = 0) it *is*
:func:`oracle.dp.solve`, bit for bit. ``lam = 0`` gives the speed bound of the joint action, which
is never below the k-only bound (the uncapped pairs are a subset of the joint ones); sweeping ``lam``
gives the speed / quality frontier (speedup against the rate of mismatched tokens), the joint
action's analogue of the paper's Fig. 2. ``lam = inf`` forbids every capped action that changes a
token (caps that change nothing stay allowed). Weights are given in AR-step units, ``lam =
quality_weight * unit_ms`` with ``unit_ms`` the mean plain AR step C(t, 0) of the rows (the
replay environment's ``ar_unit_ms``), so the weight means the same as the environment's
``quality_weight``: one mismatched token costs ``quality_weight`` AR steps.

Ties go to the smallest joint index ``c * (Kmax+1) + k``: the uncapped target first, then the
smallest budget.

:func:`evaluate_joint` gives the exact expected cost, mismatches and log-prob gap of any
position-indexed joint policy (a capped choice is a k-only round whose survival is 1 up to its
accepted drafts and 0 beyond, so :mod:`oracle.dp`'s sweeps evaluate it unchanged).

Inputs: the positions table's caps columns, ``arrays.caps`` (:class:`specenv.traces.traceset.CapArrays`,
extension ``caps-v1``), charged and clipped by :func:`specenv.replay.caps.joint_tables`; ``caps=``
passes them separately (any object with ``caps`` and the (C, Kmax'+1, n) arrays ``acc``, ``U``,
``mis``, ``lpgap`` over the same rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from oracle.dp import Evaluation, _backward, _forward, _Layout, _mode, ar_costs, step_tables
from specenv.cost.model import CostModel
from specenv.replay.caps import JointTables, joint_tables
from specenv.traces.traceset import PositionArrays

__all__ = [
    "DEFAULT_WEIGHTS",
    "JointEvaluation",
    "JointTables",
    "evaluate_joint",
    "frontier",
    "joint_action_values",
    "joint_tables",
    "solve_joint",
]

#: Quality weights (AR steps per mismatched token) of the default frontier sweep; inf = no token may change.
DEFAULT_WEIGHTS: tuple[float, ...] = (0.0, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, float("inf"))


def _lam(quality_weight: float, unit_ms: float) -> float:
    if not quality_weight >= 0:
        raise ValueError(f"quality_weight={quality_weight!r}: must be >= 0 (inf forbids every mismatch)")
    return float("inf") if np.isinf(quality_weight) else float(quality_weight) * unit_ms


def _penalised(tab: JointTables, lam: float) -> np.ndarray:
    """(C, K+1, n) cost + lam * mismatches of the capped actions; k = 0 columns are inf (never capped)."""
    if np.isinf(lam):
        pen = np.where(tab.mis > 0, np.inf, 0.0)
    else:
        pen = lam * tab.mis
    out = tab.cost + pen
    out[:, 0, :] = np.inf
    return out


# --------------------------------------------------------------------------- results
@dataclass
class JointEvaluation:
    """Exact expected cost and quality loss of a position-indexed joint policy (or of the joint oracle).

    The expected cost and path statistics are an :class:`oracle.dp.Evaluation` (``evaluation``: per
    generation ``cost``, ``ar``, ``rounds``, ``k_sum``, ``accepted_sum``; per row ``value``, ``k``,
    ``occupancy``; ``speedup``, ``speedup_pooled``, ``mean_k`` ...), read through this object as its
    own attributes; beside it the cap columns. For the joint oracle the evaluation's ``value`` is the
    penalised V(t) (cost + lam * mismatches to go) and its ``cost`` the expected cost without the penalty.

    Per-generation arrays follow ``arrays.generation_ids``; per-row arrays the flat rows.

    Attributes:
        evaluation: The expected cost and path statistics (:class:`oracle.dp.Evaluation`).
        quality_weight: The weight (AR steps per mismatched token) the policy was solved for (None
            for a policy that was only evaluated).
        levels: The caps B_1..B_C.
        mismatches: (G,) expected mismatched tokens.
        lpgap: (G,) expected sum over rounds of the round's log-prob gap x its committed tokens.
        capped_rounds: (G,) expected capped rounds.
        cap: (n,) cap level at every row (0 = uncapped).
    """

    evaluation: Evaluation
    quality_weight: float | None
    levels: tuple[int, ...]
    mismatches: np.ndarray
    lpgap: np.ndarray
    capped_rounds: np.ndarray
    cap: np.ndarray

    def __getattr__(self, name: str) -> Any:
        """The evaluation's fields and statistics (``cost``, ``ar``, ``lengths``, ``speedup_pooled`` ...)."""
        if name == "evaluation" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.evaluation, name)

    @property
    def mismatch_rate(self) -> float:
        """Expected mismatched tokens / tokens, pooled."""
        return float(self.mismatches.sum() / self.lengths.sum())

    @property
    def lpgap_mean(self) -> float:
        """Token-weighted mean log-prob gap per committed token (uncapped rounds count 0)."""
        return float(self.lpgap.sum() / self.lengths.sum())

    @property
    def capped_share(self) -> float:
        """Expected share of the rounds that run capped."""
        return float(self.capped_rounds.sum() / self.rounds.sum())

    def summary(self) -> dict[str, Any]:
        """Plain-JSON headline numbers."""
        w = self.quality_weight
        return {
            "policy": self.policy,
            "quality_weight": None if w is None else (str(w) if np.isinf(w) else float(w)),
            "caps": list(self.levels),
            "generations": int(len(self.cost)),
            "tokens": int(self.lengths.sum()),
            "speedup_pooled": self.speedup_pooled,
            "mismatch_rate": self.mismatch_rate,
            "lpgap_mean": self.lpgap_mean,
            "capped_share": self.capped_share,
            "expected_rounds": float(self.rounds.sum()),
            "cost_ms": float(self.cost.sum()),
            "ar_ms": float(self.ar.sum()),
        } | self.extra


# --------------------------------------------------------------------------- solve / evaluate
def _chosen(tab: JointTables, Ct: np.ndarray, St: np.ndarray, lay: _Layout, k: np.ndarray, c: np.ndarray) -> dict:
    """Step-order tables of the chosen actions: effective survival, cost, mismatches, lpgap x committed."""
    perm = lay.perm
    K = tab.kmax
    capped = c > 0
    idx = np.flatnonzero(capped)
    cc, kk, rr = c[idx] - 1, k[idx], perm[idx]
    cost = Ct[k, np.arange(len(k))].copy()
    cost[idx] = tab.cost[cc, kk, rr]
    mis = np.zeros(len(k))
    mis[idx] = tab.mis[cc, kk, rr]
    lp = np.zeros(len(k))
    lp[idx] = tab.lpgap[cc, kk, rr] * tab.committed[cc, kk, rr]
    Se = St.copy()
    if K and len(idx):
        Se[:, idx] = (np.arange(1, K + 1)[:, None] <= tab.acc[cc, kk, rr][None, :]).astype(np.float64)
    return {"cost": cost, "mis": mis, "lp": lp, "surv": Se, "capped": capped}


def _result(
    label: str,
    weight: float | None,
    arrays: PositionArrays,
    tab: JointTables,
    cost_model: CostModel,
    lay: _Layout,
    ch: dict,
    Ct: np.ndarray,
    Vp: np.ndarray | None,
    kp: np.ndarray,
    cp: np.ndarray,
    lookahead: int,
    drafting: str | None,
) -> JointEvaluation:
    occp = _forward(ch["surv"], kp, lay)
    n = len(arrays.L)
    # the expected cost (no penalty) by the evaluation sweep: bit-identical to oracle.dp for uncapped choices
    Ce = Ct.copy()
    Ce[kp, np.arange(n)] = ch["cost"]
    Vc, _ = _backward(Ce, ch["surv"], lay, kp)
    if Vp is None:
        Vp = Vc

    def rows(x: np.ndarray, dtype: Any = np.float64) -> np.ndarray:
        out = np.empty(n, dtype=dtype)
        out[lay.perm] = x
        return out

    occ = rows(occp)
    starts = arrays.offsets[:-1]

    def per_gen(x: np.ndarray) -> np.ndarray:
        return np.add.reduceat(occ * rows(x), starts)

    k_rows = rows(kp, np.int64)
    lengths = arrays.lengths.astype(np.int64)
    expected_rounds = np.add.reduceat(occ, starts)
    evaluation = Evaluation(
        policy=label,
        kmax=arrays.kmax,
        lookahead=lookahead,
        generation_ids=arrays.generation_ids,
        lengths=lengths,
        cost=rows(Vc)[starts],
        ar=ar_costs(arrays, cost_model),
        value=rows(Vp),
        k=k_rows,
        occupancy=occ,
        rounds=expected_rounds,
        k_sum=np.add.reduceat(occ * k_rows, starts),
        accepted_sum=lengths - expected_rounds,
        offsets=arrays.offsets,
        drafting=_mode(lookahead, drafting),
    )
    return JointEvaluation(
        evaluation=evaluation,
        quality_weight=weight,
        levels=tab.levels,
        mismatches=per_gen(ch["mis"]),
        lpgap=per_gen(ch["lp"]),
        capped_rounds=per_gen(ch["capped"].astype(np.float64)),
        cap=rows(cp, np.int64),
    )


def solve_joint(
    arrays: PositionArrays,
    cost_model: CostModel,
    quality_weight: float = 0.0,
    lookahead: int = 0,
    drafting: str | None = None,
    caps: Any = None,
    tables: JointTables | None = None,
) -> JointEvaluation:
    """Exact joint oracle: the optimal (k, cap) at every position for a quality weight.

    Args:
        arrays: Positions table (budgets 0..``arrays.kmax``).
        cost_model: Per-K cost model.
        quality_weight: AR steps charged per mismatched token (0: the speed bound; inf: no token may change).
        lookahead: Draft lookahead h (as in :func:`oracle.dp.solve`).
        drafting: The drafting mode (as in :func:`oracle.dp.solve`).
        caps: The caps columns (default ``arrays.caps``); ignored when ``tables`` is given.
        tables: Precomputed :func:`~specenv.replay.caps.joint_tables` (reused across a sweep).

    Returns:
        The :class:`JointEvaluation` of the optimal policy; ``value`` is the penalised V(t),
        ``cost`` the expected cost without the penalty.
    """
    tab = tables if tables is not None else joint_tables(arrays, cost_model, lookahead, drafting, caps)
    lam = _lam(quality_weight, tab.unit_ms)
    lay, Ct, St = step_tables(arrays, cost_model, lookahead, drafting)
    K1 = tab.kmax + 1
    C = tab.n_levels
    n = len(arrays.L)
    if C:
        Pc = lay.to_steps(_penalised(tab, lam).reshape(C * K1, n).T)
        Ac = lay.to_steps(tab.acc.reshape(C * K1, n).T)
        cols = np.arange(len(lay.order))

        def extra(p: int, na: int, b: int, q: np.ndarray, W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            sl = slice(p, p + na)
            cn = cols[:na]
            qc = Pc[:, sl] + (W[b + 1 + Ac[:, sl], cn] - W[b + 1, :na])
            qa = np.concatenate([q, qc])
            j = qa.argmin(axis=0)
            return j, qa[j, cn]

        Vp, jp = _backward(Ct, St, lay, None, extra)
    else:
        Vp, jp = _backward(Ct, St, lay, None)
    kp, cp = jp % K1, jp // K1
    ch = _chosen(tab, Ct, St, lay, kp, cp)
    return _result(
        "joint oracle", float(quality_weight), arrays, tab, cost_model, lay, ch, Ct, Vp, kp, cp, lookahead, drafting
    )


def _policy_arrays(policy: Any, n: int, K: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(policy, tuple) and len(policy) == 2:
        k, c = (np.broadcast_to(np.asarray(x), (n,)) for x in policy)
    else:
        raise ValueError("policy: expected a pair (k, cap) of ints or of (n,) integer arrays")
    for name, x, hi in (("k", k, K), ("cap", c, C)):
        if not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"policy {name}: must be integers")
        if n and (x.min() < 0 or x.max() > hi):
            raise ValueError(f"policy {name}: must lie in 0..{hi}")
    k = k.astype(np.int64)
    c = np.where(k == 0, 0, c).astype(np.int64)  # k = 0 is never capped
    return k, c


def evaluate_joint(
    arrays: PositionArrays,
    cost_model: CostModel,
    policy: tuple[Any, Any],
    label: str = "position-indexed",
    lookahead: int = 0,
    drafting: str | None = None,
    caps: Any = None,
    tables: JointTables | None = None,
) -> JointEvaluation:
    """Exact expected cost, mismatches and log-prob gap of a position-indexed joint policy.

    Args:
        arrays: Positions table.
        cost_model: Per-K cost model.
        policy: ``(k, cap)``: ints (a fixed budget and cap level, MoE-Spec's fixed budget with fixed
            k) or (n,) integer arrays per row (e.g. ``(res.k, res.cap)`` of :func:`solve_joint`). A
            cap level at k = 0 is ignored (k = 0 is never capped).
        label: Label of the result.
        lookahead: Draft lookahead h.
        drafting: The drafting mode.
        caps: The caps columns (default ``arrays.caps``); ignored when ``tables`` is given.
        tables: Precomputed :func:`~specenv.replay.caps.joint_tables`.

    Returns:
        The :class:`JointEvaluation` (``value`` = expected cost-to-go, no penalty).
    """
    tab = tables if tables is not None else joint_tables(arrays, cost_model, lookahead, drafting, caps)
    n = len(arrays.L)
    k, c = _policy_arrays(policy, n, tab.kmax, tab.n_levels)
    lay, Ct, St = step_tables(arrays, cost_model, lookahead, drafting)
    kp, cp = k[lay.perm], c[lay.perm]
    ch = _chosen(tab, Ct, St, lay, kp, cp)
    return _result(label, None, arrays, tab, cost_model, lay, ch, Ct, None, kp, cp, lookahead, drafting)


def joint_action_values(
    arrays: PositionArrays,
    tab: JointTables,
    cost_model: CostModel,
    value: np.ndarray,
    rows: np.ndarray | None = None,
    quality_weight: float = 0.0,
    lookahead: int = 0,
    drafting: str | None = None,
) -> np.ndarray:
    """``Q(t, (k, c)) = C + lam * mis + E V(next)`` for every joint action (index ``c * (Kmax+1) + k``).

    Args:
        arrays: Positions table.
        tab: Its :func:`~specenv.replay.caps.joint_tables`.
        cost_model: Cost model.
        value: (n,) cost-to-go, e.g. ``solve_joint(...).value`` at the same weight (then ``min Q = V``).
        rows: Rows to compute (default all).
        quality_weight: AR steps per mismatched token.
        lookahead: Draft lookahead h.
        drafting: The drafting mode.

    Returns:
        (len(rows), (C+1)(Kmax+1)) action values in ms; capped k = 0 pairs are inf.
    """
    from oracle.dp import action_values

    lam = _lam(quality_weight, tab.unit_ms)
    rows = np.arange(len(arrays.L)) if rows is None else np.asarray(rows, dtype=np.int64)
    q0 = action_values(arrays, cost_model, value, rows, lookahead, drafting)
    if not tab.n_levels:
        return q0
    gen = np.searchsorted(arrays.offsets, rows, side="right") - 1
    end = arrays.offsets[gen + 1]
    acc = tab.acc[:, :, rows]
    nxt = rows[None, None, :] + acc + 1
    Vn = np.where(nxt < end[None, None, :], value[np.minimum(nxt, len(value) - 1)], 0.0)
    qc = _penalised(tab, lam)[:, :, rows] + Vn
    return np.concatenate([q0, qc.reshape(-1, len(rows)).T], axis=1)


def frontier(
    arrays: PositionArrays,
    cost_model: CostModel,
    weights: Sequence[float] = DEFAULT_WEIGHTS,
    lookahead: int = 0,
    drafting: str | None = None,
    caps: Any = None,
    tables: JointTables | None = None,
) -> list[JointEvaluation]:
    """The joint oracle at every quality weight: the speed / quality frontier.

    Returns:
        One :class:`JointEvaluation` per weight, in the order given.
    """
    tab = tables if tables is not None else joint_tables(arrays, cost_model, lookahead, drafting, caps)
    return [solve_joint(arrays, cost_model, w, lookahead, drafting, tables=tab) for w in weights]
