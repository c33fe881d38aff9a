"""The batch bound of episodes: expected and pathwise, the larger of the split rule's and the Lagrangian's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from oracle.batch.lagrangian import check_enumerable, lagrangian_costs
from oracle.batch.split import _episode_costs, expected_costs
from specenv.cost.batch import BatchCostModel
from specenv.cost.model import Charge
from specenv.replay.batch import ar_schedule_ms, request_draws
from specenv.traces.traceset import PositionArrays

#: Bound methods: ``"linear"`` is the split rule (:mod:`oracle.batch.split`); ``"lagrangian"`` (the
#: default of :func:`batch_bound`) adds the best per-budget split of the shared step terms and the
#: concave union share (:mod:`oracle.batch.lagrangian`), and keeps the larger of the two per episode.
METHODS: tuple[str, ...] = ("lagrangian", "linear")


def pathwise_costs(
    arrays: PositionArrays,
    share: Charge,
    g: int,
    uniforms: np.ndarray,
    exit: np.ndarray | None = None,
    table: bool = False,
) -> Any:
    """Least total charge of generation ``g`` given its acceptance uniforms (the pathwise bound of one request).

    Round j of the request (j = 0, 1, ...) accepts ``#{i <= k : u_j < P(a >= i | t)}`` drafts, capped at
    the end, as :meth:`specenv.replay.episode.Episode.play` does. Solved by backward induction over the
    position t and the round index j <= t.

    Args:
        arrays: Positions table (budgets 0..arrays.kmax).
        share: The charges (:func:`share_model`).
        g: Generation index in ``arrays``.
        uniforms: (N,) the request's uniforms (:func:`specenv.replay.batch.request_draws`).
        exit: Optional (N+1, N+1) table: from (t, j) the request may instead switch to a charge whose
            least total from there is ``exit[t, j]`` (the tail phase of :func:`lagrangian_costs`).
        table: Return the whole (N+1, N+1) table ``V[t, j]`` instead of ``V[0, 0]``.

    Returns:
        The least total charge in ms (or the table).
    """
    lo, hi = int(arrays.offsets[g]), int(arrays.offsets[g + 1])
    N = hi - lo
    K = arrays.kmax
    S = arrays.survival()[lo:hi]  # (N, K)
    C = share.charged_table(arrays.U[lo:hi], arrays.L[lo:hi], K)  # (N, K+1)
    u = np.asarray(uniforms, dtype=np.float64)[:N]
    # V[t, j]: least charge from position t at round j (j <= t); V[N, :] = 0
    V = np.zeros((N + 1, N + 1))
    ks = np.arange(K + 1)
    for t in range(N - 1, -1, -1):
        j = np.arange(t + 1)
        # accepted drafts for each k and each round j: count of leading u_j < S[t, i]
        passes = u[j][:, None] < S[t][None, :]  # (t+1, K)
        lead = np.cumprod(passes, axis=1).sum(axis=1)  # leading run length (0..K)
        # every budget at once: (t+1, K+1) accepted drafts, then the least charge over k (a minimum: exact)
        a = np.minimum(np.minimum(lead[:, None], ks[None, :]), N - t - 1)
        best = (C[t][None, :] + V[t + a + 1, j[:, None] + 1]).min(axis=1)
        if exit is not None:
            np.minimum(best, exit[t, : t + 1], out=best)
        V[t, : t + 1] = best
    return V if table else float(V[0, 0])


@dataclass
class BatchBound:
    """The bound of a set of batch episodes (module docstring).

    Attributes:
        batch_size: B.
        seeds: (E, R) request seeds of each episode.
        generations: (E, R) generation index of each request.
        ar: (E,) AR cost of each episode (ms).
        expected: (E,) lower bound on the expected cost (sum of single-request SSP optima).
        pathwise: (E,) lower bound on the realised cost of that episode (None when not computed).
        split: The split rule's full-batch intercept split that gave its largest bound (None: the min rule).
        method: ``"lagrangian"`` or ``"linear"`` (:data:`METHODS`).
        linear_expected: (E,) the split rule's expected bound (equal to ``expected`` for ``"linear"``).
        linear_pathwise: (E,) the split rule's pathwise bound (None when not computed).
    """

    batch_size: int
    seeds: np.ndarray
    generations: np.ndarray
    ar: np.ndarray
    expected: np.ndarray
    pathwise: np.ndarray | None
    split: tuple[float, float] | None = None
    method: str = "linear"
    linear_expected: np.ndarray | None = None
    linear_pathwise: np.ndarray | None = None

    @property
    def speedup_expected(self) -> np.ndarray:
        """(E,) upper bound on AR / E[cost] per episode."""
        return self.ar / self.expected

    @property
    def speedup_pathwise(self) -> np.ndarray | None:
        """(E,) upper bound on the realised AR / cost of each episode."""
        return None if self.pathwise is None else self.ar / self.pathwise

    def summary(self) -> dict[str, Any]:
        """Plain-JSON headline numbers (pooled: sum AR / sum bound cost)."""
        out = {
            "batch_size": self.batch_size,
            "episodes": int(len(self.ar)),
            "method": self.method,
            "speedup_pooled_expected": float(self.ar.sum() / self.expected.sum()),
        }
        if self.pathwise is not None:
            out["speedup_pooled_pathwise"] = float(self.ar.sum() / self.pathwise.sum())
        return out

    def linear_summary(self) -> dict[str, Any]:
        """The split rule's headline numbers from the same run (:meth:`summary` of ``method="linear"``)."""
        lin = BatchBound(
            self.batch_size,
            self.seeds,
            self.generations,
            self.ar,
            self.expected if self.linear_expected is None else self.linear_expected,
            self.pathwise if self.linear_pathwise is None else self.linear_pathwise,
            self.split,
            "linear",
        )
        return lin.summary()


def batch_bound(
    arrays: PositionArrays,
    L0: np.ndarray,
    model: BatchCostModel,
    batch_size: int,
    seeds: np.ndarray,
    pathwise: bool = True,
    method: str = "lagrangian",
    progress: Callable[[int, int, str], None] | None = None,
) -> BatchBound:
    """The expected and pathwise bounds of the episodes with these request seeds.

    Every step before an episode's tail holds exactly B requests (a finished request's slot is refilled
    at the next step while requests are waiting), so those rounds are charged by the full-batch share
    (:func:`share_model` with ``full=True``); the at most B-1 requests running when the tail begins
    are charged by :func:`tail_model` for their whole life (it is below both charges). Every intercept
    split of :func:`intercept_splits` gives a valid bound; the largest total over these episodes is kept.

    Args:
        arrays: The split's positions table (the environment's: ``select_positions``).
        L0: (G,) prompt lengths of its generations.
        model: The batch cost model.
        batch_size: B.
        seeds: (E, R) request seeds of each episode (the environment's ``info["seeds"]``).
        pathwise: Also compute the pathwise bound (one shortest path per request and charge).
        method: ``"lagrangian"`` (default): per episode the larger of the split rule's bound and the
            Lagrangian splits' (:func:`lagrangian_costs`), so never looser than ``"linear"``, the split
            rule alone (:func:`expected_costs`, the bound before the Lagrangian splits).
        progress: ``progress(done, total, what)`` as each request's pathwise bound ends (the long part).

    Returns:
        The :class:`BatchBound`.
    """
    B = int(batch_size)
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {', '.join(METHODS)}")
    if method == "lagrangian":
        check_enumerable(B, arrays.kmax)  # before the split rule's work, not after
    seeds = np.atleast_2d(np.asarray(seeds, dtype=np.int64))
    E, R = seeds.shape
    lengths = arrays.lengths
    gens = np.array([[request_draws(int(s), lengths)[0] for s in row] for row in seeds], dtype=np.int64)
    expected, full, tail, chosen = expected_costs(arrays, model, B, gens)
    charges = [(full, tail, False)]
    linear_expected = expected.copy()
    if method == "lagrangian":
        lag, lfull, ltail = lagrangian_costs(arrays, model, B, gens, (full, tail))
        if lfull is not None:
            expected = np.maximum(expected, lag)
            charges.append((lfull, ltail, True))
    paths = None
    linear_paths = None
    if pathwise:
        if arrays.greedy:
            paths, linear_paths = expected.copy(), linear_expected.copy()
        else:
            total = len(charges) * len({int(s) for s in seeds.ravel()})
            done = 0
            for cf, ct, switch in charges:  # every pair of valid charges bounds every episode: keep the larger
                pf = np.empty((E, R))
                pt = np.empty((E, R))
                memo: dict[int, tuple[float, float]] = {}
                for e in range(E):
                    for r in range(R):
                        key = int(seeds[e, r])
                        if key not in memo:
                            g, u = request_draws(key, lengths)
                            vf = pathwise_costs(arrays, cf, g, u)
                            if switch:  # the tail charge from the step the tail begins (lagrangian_costs)
                                vt = pathwise_costs(arrays, ct, g, u, table=True)
                                memo[key] = (vf, min(vf, pathwise_costs(arrays, cf, g, u, exit=vt)))
                            else:
                                memo[key] = (vf, pathwise_costs(arrays, ct, g, u))
                            done += 1
                            if progress is not None:
                                progress(done, total, "pathwise bound" + (" (lagrangian)" if switch else ""))
                        pf[e, r], pt[e, r] = memo[key]
                cand = _episode_costs(pf, pt, B)
                paths = cand if paths is None else np.maximum(paths, cand)
                linear_paths = cand if linear_paths is None else linear_paths
    ar = np.array([ar_schedule_ms(model, gens[e], lengths, L0, B) for e in range(E)])
    return BatchBound(B, seeds, gens, ar, expected, paths, chosen, method, linear_expected, linear_paths)
