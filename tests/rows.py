"""Rows of the recorder's rounds table (schema columns + the recorder's extra columns) for tests."""

from __future__ import annotations


def recorder_row(gid: int, rnd: int, K: int = 3, acc: int = 1, run: str = "", drafted: int = 4) -> dict:
    """One plausible recorded round of generation ``gid`` (request ``r{gid}``), round ``rnd``, budget ``K``."""
    return {
        "generation_id": gid,
        "category": "code",
        "round": rnd,
        "K": K,
        "m": K + 1,
        "accepted": acc,
        "L": 20 + rnd,
        "U_r": 4.5,
        "E_max": 2.0,
        "T_T_ms": 3.0,
        "T_D_ms": 1.5,
        "request_id": f"r{gid}",
        "t": rnd,
        "step": rnd,
        "batch_size": 1,
        "batch_tokens": K + 1,
        "drafted": drafted,
        "policy_k": K,
        "fallback": False,
        "capped": False,
        "greedy": True,
        "step_ms": 5.0,
        "T_T_cpu_ms": 2.9,
        "T_D_cpu_ms": 1.4,
        "timing": "hooks",
        "run": run,
        "accepted_raw": acc,
    }


#: Caps of :func:`cap_trace_set` (paper profile: 128 experts, top-8).
SYNTHETIC_CAPS = (12, 20, 32)


def add_synthetic_caps(ts, caps=SYNTHETIC_CAPS, seed: int = 0):
    """A copy of a *greedy* trace set with plausible synthetic ``caps-v1`` columns (and capped rounds).

    Not a model of any engine, only data that obeys the extension's contract (traces/README.md,
    "Expert caps"), for tests written before a collected set exists. Per (cap B, k, position): the
    uncapped acceptance a0 (leading ones of rho) is kept where the chain's union U_k fits the cap, else
    cut at a random point with probability s = (U_k - B) / U_k; U = min(U_k, B); ``mis`` ~
    Binomial(committed, 0.2 s) over the committed tokens inside the reference; ``lpgap`` = s * Exp(0.5)
    (0 where the cap does not bind). Rounds: every K >= 1 round is repeated once per cap with column
    ``cap`` = B, ``U_r`` = min(U_r, B) and the target time scaled by (1 + U_r,capped / U_r) / 2.

    Args:
        ts: A greedy :class:`specenv.traces.traceset.TraceSet` with positions (e.g. ``generate_paper(greedy=True)``).
        caps: Caps B_1 < ... < B_C, each below the model's n_experts.
        seed: Seed of the draws.

    Returns:
        A new in-memory TraceSet whose manifest declares ``caps``.
    """
    import copy

    import numpy as np
    import pandas as pd

    from specenv.traces.schema import cap_column
    from specenv.traces.traceset import TraceSet

    if not ts.manifest.greedy:
        raise ValueError("add_synthetic_caps needs a greedy set (acceptance under a cap is a verdict)")
    rng = np.random.default_rng(seed)
    arr = ts.arrays()
    kmax, n = arr.kmax, len(arr.L)
    remaining = arr.remaining()
    lead = np.cumprod(arr.rho > 0.5, axis=1).sum(axis=1)  # uncapped accepted drafts at k = kmax
    cols = {}
    for c, B in enumerate(caps, start=1):
        for k in range(1, kmax + 1):
            a0 = np.minimum(lead, k)
            Uk = arr.U[:, k]
            s = np.clip((Uk - B) / Uk, 0.0, 1.0)
            cut = rng.random(n) < s
            acc = np.where(cut, np.floor(rng.random(n) * (a0 + 1)), a0).astype(np.int32)
            committed = np.minimum(acc + 1, remaining)
            cols[cap_column("acc", c, k)] = acc
            cols[cap_column("U", c, k)] = np.minimum(Uk, B).astype(np.float32)
            cols[cap_column("mis", c, k)] = rng.binomial(committed, 0.2 * s).astype(np.int32)
            cols[cap_column("lpgap", c, k)] = (s * rng.exponential(0.5, n)).astype(np.float32)
    positions = pd.concat([ts.positions.reset_index(drop=True), pd.DataFrame(cols)], axis=1)
    rounds = None
    if ts.has_rounds:
        base = ts.rounds.assign(cap=np.int32(0))
        parts = [base]
        for B in caps:
            r = base[base["K"] >= 1].copy()
            u = np.minimum(r["U_r"].to_numpy(np.float64), B)
            r["T_T_ms"] = (r["T_T_ms"] * (1 + u / r["U_r"]) / 2).astype(np.float32)
            r["U_r"] = u.astype(np.float32)
            r["cap"] = np.int32(B)
            parts.append(r)
        rounds = pd.concat(parts, ignore_index=True)
    manifest = copy.deepcopy(ts.manifest)
    manifest.caps = [int(b) for b in caps]
    manifest.extensions = ["caps-v1"]
    return TraceSet(manifest, positions, rounds)


def cap_trace_set(n_generations: int = 8, kmax: int = 6, caps=SYNTHETIC_CAPS, seed: int = 7, name: str = "caps-syn"):
    """A small greedy paper-profile set with synthetic ``caps-v1`` columns (:func:`add_synthetic_caps`), in memory."""
    from specenv.generator import generate_paper

    return add_synthetic_caps(generate_paper(n_generations, kmax=kmax, seed=seed, greedy=True, name=name), caps, seed)
