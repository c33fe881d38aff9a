"""The tables of a collected trace set, built the same way for every engine (trace schema v2).

A collection (``specenv collect --engine hf|vllm``) produces, per prompt, the fixed-K rounds an
engine executed (:class:`specenv.engines.base.RoundResult` objects) and a counterfactual sweep over
the greedy reference output (at every position t the draft's chain of Kmax tokens, its
teacher-forced verdicts rho, the draft's q / entropy / margin and U_{t,0..Kmax}). This module turns
both into rows of the ``rounds`` and ``positions`` tables (:func:`rounds_frame`,
:func:`positions_frame`), checks the lossless property of greedy speculative decoding
(:func:`first_difference`, summarised by :func:`lossless_summary`) and records where and how long a
collection ran (:func:`run_provenance`) for the trace set's manifest; the engines' collectors
(:mod:`specenv.engines.hf.collect`, :mod:`specenv.engines.vllm.collect`) only run the engine.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from specenv.traces.schema import (
    ROUNDS_CAP_COLUMN,
    cap_column,
    ent_columns,
    margin_columns,
    q_columns,
    rho_columns,
    u_columns,
)

__all__ = [
    "CAP_QUANTILES",
    "CAP_SWEEP_KEYS",
    "CLOCKS",
    "SWEEP_KEYS",
    "choose_caps",
    "first_difference",
    "lossless_summary",
    "positions_frame",
    "rounds_frame",
    "run_provenance",
]

#: Which measurement goes into ``T_T_ms``/``T_D_ms``: thread CPU time or wall clock.
CLOCKS = ("cpu", "wall")
#: The arrays a counterfactual sweep of one generation provides (N positions, chains of Kmax tokens):
#: ``rho``, ``q``, ``ent``, ``margin`` (N, Kmax); ``U`` (N, Kmax+1); ``L`` (N,).
SWEEP_KEYS = ("rho", "q", "ent", "margin", "U", "L")
#: The arrays a sweep with expert caps adds (trace extension caps-v1): ``acc_cap``, ``U_cap``,
#: ``mis_cap``, ``lpgap_cap``, each (C, Kmax+1, N) (index k = 0 unused: k = 0 is never capped).
CAP_SWEEP_KEYS = ("acc_cap", "U_cap", "mis_cap", "lpgap_cap")
#: Quantiles of the per-layer expert union of executed K = Kmax verification passes that ``--caps auto``
#: takes as the cap grid (:func:`choose_caps`).
CAP_QUANTILES = (0.25, 0.5, 0.75)


def choose_caps(layer_unions: np.ndarray, n_experts: int, quantiles: Sequence[float] = CAP_QUANTILES) -> list[int]:
    """The cap grid of ``--caps auto``: quantiles of the live per-layer expert union at k = Kmax.

    The rule: pool the union size of every MoE layer of every executed K = Kmax verification pass
    (m = Kmax+1 positions) of the train split's generations, take the ``quantiles`` (numpy's default
    linear interpolation), round each to the nearest whole number, and keep the distinct values in
    1..n_experts-1, ascending. With the quartiles, the tightest cap binds in about three quarters of
    the layer passes at k = Kmax, the loosest in about a quarter, and shorter chains (smaller unions)
    are capped less often.

    Args:
        layer_unions: Union sizes, any shape (flattened).
        n_experts: Experts per MoE layer (a cap must drop something: B < n_experts).
        quantiles: Quantiles in (0, 1).

    Returns:
        The caps B_1 < ... < B_C.

    Raises:
        ValueError: If there are no unions or no cap in 1..n_experts-1 results.
    """
    u = np.asarray(layer_unions, dtype=np.float64).ravel()
    if u.size == 0:
        raise ValueError("choose_caps: no verification passes to choose the caps from")
    caps = sorted({int(np.rint(v)) for v in np.quantile(u, list(quantiles))})
    caps = [b for b in caps if 1 <= b < n_experts]
    if not caps:
        raise ValueError(f"choose_caps: no quantile of the unions lies in 1..{n_experts - 1}")
    return caps


def first_difference(out: Sequence[int], reference: Sequence[int]) -> int | None:
    """The first index where two token lists differ (the shorter length if one is a prefix), or None if equal."""
    if list(out) == list(reference):
        return None
    return next(
        (j for j, (x, y) in enumerate(zip(out, reference, strict=False)) if x != y), min(len(out), len(reference))
    )


def lossless_summary(runs_checked: int, mismatches: Sequence[Mapping[str, int]]) -> dict[str, Any]:
    """The manifest's ``lossless`` entry: runs compared with the reference output, and the first 50 mismatches."""
    return {"runs_checked": runs_checked, "mismatched_runs": len(mismatches), "mismatches": list(mismatches[:50])}


def run_provenance(load_before: tuple[float, float, float], wall: float) -> dict[str, Any]:
    """Where and how long a collection ran, for the manifest's ``extra``: ``python``, ``machine``, ``wall_seconds``.

    Args:
        load_before: ``os.getloadavg()`` when the collection started (the load after is read now).
        wall: Wall-clock seconds the collection took.
    """
    return {
        "python": platform.python_version(),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "wall_seconds": round(wall, 1),
    }


def positions_frame(
    generation_id: int,
    category: str,
    sweep: Mapping[str, np.ndarray],
    kmax: int,
    extra: Mapping[str, np.ndarray] | None = None,
) -> pd.DataFrame:
    """Rows of the positions table of one generation from its counterfactual sweep.

    Args:
        generation_id: The generation's id (the prompt's).
        category: Its category.
        sweep: The arrays of :data:`SWEEP_KEYS` (one row per position t = 0..N-1), and those of
            :data:`CAP_SWEEP_KEYS` for a sweep with caps (their columns ``acc_c{c}_k{k}``... follow).
        kmax: Chain length.
        extra: More columns (one value per position), appended after the schema's.
    """
    n = len(sweep["L"])
    cols: dict[str, Any] = {
        "generation_id": np.full(n, generation_id, dtype=np.int64),
        "category": category,
        "t": np.arange(n, dtype=np.int32),
        "L": np.asarray(sweep["L"], dtype=np.int32),
    }
    for j, c in enumerate(rho_columns(kmax)):
        cols[c] = sweep["rho"][:, j]
    for j, c in enumerate(q_columns(kmax)):
        cols[c] = np.clip(sweep["q"][:, j], 0.0, 1.0)
    for j, c in enumerate(u_columns(kmax)):
        cols[c] = sweep["U"][:, j]
    for j, c in enumerate(ent_columns(kmax)):
        cols[c] = np.maximum(sweep["ent"][:, j], 0.0)
    for j, c in enumerate(margin_columns(kmax)):
        cols[c] = np.clip(sweep["margin"][:, j], 0.0, 1.0)
    if "acc_cap" in sweep:
        for c in range(sweep["acc_cap"].shape[0]):
            for k in range(1, kmax + 1):
                cols[cap_column("acc", c + 1, k)] = np.asarray(sweep["acc_cap"][c, k], dtype=np.int32)
                cols[cap_column("U", c + 1, k)] = np.asarray(sweep["U_cap"][c, k], dtype=np.float32)
                cols[cap_column("mis", c + 1, k)] = np.asarray(sweep["mis_cap"][c, k], dtype=np.int32)
                cols[cap_column("lpgap", c + 1, k)] = np.asarray(sweep["lpgap_cap"][c, k], dtype=np.float32)
    for c, v in (extra or {}).items():
        cols[c] = v
    return pd.DataFrame(cols)


def rounds_frame(
    generation_id: int, category: str, K: int, rounds: Sequence[Any], clock: str, cap: int | None = None
) -> pd.DataFrame:
    """Rows of the rounds table of one fixed-K run (:class:`specenv.engines.base.RoundResult` objects).

    ``T_T_ms``/``T_D_ms`` hold the ``clock`` measurement (``"cpu"``: thread CPU time, ``"wall"``:
    wall clock); both are kept as extra columns ``T_T_wall_ms``, ``T_D_wall_ms``, ``T_T_cpu_ms``,
    ``T_D_cpu_ms`` (and ``T_step_ms``, the engine step's wall time, when the engine measured it);
    ``run`` is ``fixed-K<K>``, or ``fixed-K<K>-cap<B>`` for a capped run.

    Args:
        generation_id: The generation's id.
        category: Its category.
        K: The run's budget.
        rounds: The run's rounds.
        clock: ``"cpu"`` or ``"wall"``.
        cap: The expert cap the run used, written to the optional ``cap`` column (0 = none); None
            writes no such column (a set collected without caps).
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {CLOCKS}")
    wall_t = np.array([r.T_T_ms for r in rounds], dtype=np.float32)
    wall_d = np.array([r.T_D_ms for r in rounds], dtype=np.float32)
    cpu_t = np.array([r.T_T_cpu_ms for r in rounds], dtype=np.float32)
    cpu_d = np.array([r.T_D_cpu_ms for r in rounds], dtype=np.float32)
    df = pd.DataFrame(
        {
            "generation_id": np.full(len(rounds), generation_id, dtype=np.int64),
            "category": category,
            "round": np.arange(len(rounds), dtype=np.int32),
            "K": np.full(len(rounds), K, dtype=np.int32),
            "m": np.array([r.m for r in rounds], dtype=np.int32),
            "accepted": np.array([r.accepted for r in rounds], dtype=np.int32),
            "L": np.array([r.L for r in rounds], dtype=np.int32),
            "U_r": np.array([r.U_r for r in rounds], dtype=np.float32),
            "E_max": np.array([r.E_max for r in rounds], dtype=np.float32),
            "T_T_ms": cpu_t if clock == "cpu" else wall_t,
            "T_D_ms": cpu_d if clock == "cpu" else wall_d,
            "run": f"fixed-K{K}" + (f"-cap{cap}" if cap else ""),
            "T_T_wall_ms": wall_t,
            "T_D_wall_ms": wall_d,
            "T_T_cpu_ms": cpu_t,
            "T_D_cpu_ms": cpu_d,
        }
    )
    step = np.array([r.T_step_ms for r in rounds], dtype=np.float32)
    if np.any(step > 0):  # engines that time the whole step (vLLM): what a user waits for
        df["T_step_ms"] = step
    if cap is not None:
        df[ROUNDS_CAP_COLUMN] = np.full(len(rounds), int(cap), dtype=np.int32)
    return df
