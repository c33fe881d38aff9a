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
