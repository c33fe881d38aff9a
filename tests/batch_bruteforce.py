"""The exact joint optimum of a tiny batch episode, by brute force: the reference the batch bound is tested against.

Test-only (exponential in the batch size): tests/test_batch_bound.py checks that the bound of
:mod:`oracle.batch` is above it and measures the gap.
"""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np

from specenv.cost.batch import BatchCostModel
from specenv.traces.traceset import PositionArrays


def joint_optimum(
    arrays: PositionArrays,
    L0: np.ndarray,
    model: BatchCostModel,
    batch_size: int,
    generations: list[int],
    drafting: str = "none",
) -> float:
    """The exact optimal expected cost of a tiny batch episode, by brute force (expectimax).

    The joint state is the (request, position) of every slot and the next request to admit; each
    step enumerates every joint budget vector and every joint acceptance outcome. Exponential in B:
    for tests on a few short generations only.

    Args:
        arrays: Positions table.
        L0: (G,) prompt lengths (context = L0 + t, as the environment).
        model: The batch cost model (U_batch predicted from the requests' own U).
        batch_size: B.
        generations: The requests' generation indices in arrival order.
        drafting: ``"none"`` (request i drafts k_i) or ``"sequential"`` (the same charge).

    Returns:
        The optimal expected episode cost in ms.
    """
    if drafting not in ("none", "sequential"):
        raise ValueError(f"drafting={drafting!r}: the brute force charges modes none and sequential")
    K = arrays.kmax
    S = arrays.survival()
    lengths = arrays.lengths
    gens = list(generations)
    R = len(gens)

    def outcomes(g: int, t: int, k: int) -> list[tuple[float, int]]:
        """(probability, committed) of a round with budget k at position t of generation g."""
        row = int(arrays.offsets[g]) + t
        surv = [1.0] + [float(S[row, i]) for i in range(k)] + [0.0]
        n_left = int(lengths[g]) - t
        out: dict[int, float] = {}
        for a in range(k + 1):
            p = surv[a] - surv[a + 1]
            if p > 0:
                c = min(a + 1, n_left)
                out[c] = out.get(c, 0.0) + p
        return [(p, c) for c, p in out.items()]

    @cache
    def V(slots: tuple[tuple[int, int], ...], nxt: int) -> float:
        # admit requests into free slots (lowest first), as the environment does
        sl = list(slots)
        for s in range(batch_size):
            if sl[s][0] < 0 and nxt < R:
                sl[s] = (nxt, 0)
                nxt += 1
        active = [s for s in range(batch_size) if sl[s][0] >= 0]
        if not active:
            return 0.0
        best = np.inf
        for ks in itertools.product(range(K + 1), repeat=len(active)):
            k = np.array(ks, dtype=np.int64)
            rows = [int(arrays.offsets[gens[sl[s][0]]]) + sl[s][1] for s in active]
            u = np.array([arrays.U[r, kk] for r, kk in zip(rows, ks, strict=True)])
            ctx = np.array([L0[gens[sl[s][0]]] + sl[s][1] for s in active], dtype=np.float64)
            cost = model.step_ms(k, k, u, ctx)
            per = [outcomes(gens[sl[s][0]], sl[s][1], kk) for s, kk in zip(active, ks, strict=True)]
            exp = 0.0
            for combo in itertools.product(*per):
                p = 1.0
                new = list(sl)
                for s, (pi, c) in zip(active, combo, strict=True):
                    p *= pi
                    req, t = new[s]
                    t += c
                    new[s] = (-1, 0) if t >= lengths[gens[req]] else (req, t)
                exp += p * V(tuple(new), nxt)
            best = min(best, cost + exp)
            if best == -np.inf:  # pragma: no cover
                break
        return float(best)

    return V(tuple((-1, 0) for _ in range(batch_size)), 0)
