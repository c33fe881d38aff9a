"""The batch bound of episodes: expected and pathwise, the larger of the split rule's and the Lagrangian's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from oracle.batch.lagrangian import check_enumerable, lagrangian_costs
from oracle.batch.split import _episode_costs, expected_costs
from specenv import numba_support
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
    position t and the round index j <= t: O(N^2 Kmax) per request, run by the compiled loop
    :func:`_pathwise_loop` where numba imports (and ``SPECENV_NUMBA`` is not ``0``), else by
    :func:`pathwise_costs_numpy` (the reference). Both take the least of the same sums (one addition
    each, no reassociation), so the results are identical bit for bit (``tests/test_batch_bound.py``).

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
    kernel = _kernel()
    if kernel is None:
        return pathwise_costs_numpy(arrays, share, g, uniforms, exit, table)
    S, C, u = _pathwise_inputs(arrays, share, g, uniforms)
    N = len(S)
    ex = np.zeros((0, 0)) if exit is None else np.ascontiguousarray(exit, dtype=np.float64)
    if exit is not None and (ex.ndim != 2 or ex.shape[0] < N or ex.shape[1] < N):
        raise ValueError(f"exit: shape {ex.shape}, expected at least ({N}, {N})")
    V = kernel(S, C, u, ex, exit is not None)
    return V if table else float(V[0, 0])


def _pathwise_inputs(
    arrays: PositionArrays, share: Charge, g: int, uniforms: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generation ``g``'s survival (N, K), charge (N, K+1) tables and its first N uniforms (contiguous float64)."""
    lo, hi = int(arrays.offsets[g]), int(arrays.offsets[g + 1])
    N = hi - lo
    K = arrays.kmax
    S = np.ascontiguousarray(arrays.survival()[lo:hi], dtype=np.float64)  # (N, K)
    C = np.ascontiguousarray(share.charged_table(arrays.U[lo:hi], arrays.L[lo:hi], K), dtype=np.float64)
    u = np.ascontiguousarray(np.asarray(uniforms, dtype=np.float64)[:N])
    if len(u) < N:
        raise ValueError(f"uniforms: {len(u)} given, generation {g} needs {N}")
    return S, C, u


def pathwise_costs_numpy(
    arrays: PositionArrays,
    share: Charge,
    g: int,
    uniforms: np.ndarray,
    exit: np.ndarray | None = None,
    table: bool = False,
) -> Any:
    """:func:`pathwise_costs` in numpy, one vectorised step per position t (the reference and the fallback)."""
    S, C, u = _pathwise_inputs(arrays, share, g, uniforms)  # (N, K), (N, K+1), (N,)
    N, K = S.shape
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


def _pathwise_loop(
    S: np.ndarray, C: np.ndarray, u: np.ndarray, exit: np.ndarray, has_exit: bool
) -> np.ndarray:  # pragma: no cover - compiled (its numpy twin is pathwise_costs_numpy; tested against it)
    """The backward induction of :func:`pathwise_costs_numpy` as scalar loops: ``V[t, j]`` for j <= t.

    Each state takes the least of ``C[t, k] + V[t + a + 1, j + 1]`` over k (the same sums; a NaN
    propagates, as numpy's ``min`` and ``minimum`` do), then the least with ``exit[t, j]``.
    """
    N, K = S.shape
    V = np.zeros((N + 1, N + 1))
    for t in range(N - 1, -1, -1):
        cap = N - t - 1
        for j in range(t + 1):
            uj = u[j]
            lead = 0
            while lead < K and uj < S[t, lead]:
                lead += 1
            best = C[t, 0] + V[t + 1, j + 1]
            nan = best != best
            for k in range(1, K + 1):
                val = C[t, k] + V[t + min(lead, k, cap) + 1, j + 1]
                nan |= val != val
                if val < best:
                    best = val
            if has_exit:
                e = exit[t, j]
                nan |= e != e
                if e < best:
                    best = e
            V[t, j] = np.nan if nan else best
    return V


def _pathwise_many(
    S: np.ndarray, Cs: np.ndarray, u: np.ndarray, exit_of: np.ndarray
) -> np.ndarray:  # pragma: no cover - compiled (tested against pathwise_costs_numpy)
    """``V[0, 0]`` of several charges of one request in one sweep: :func:`_pathwise_loop`'s states and sums.

    ``Cs[c]`` is charge c's (N, K+1) table; ``exit_of[c] >= 0`` makes charge c's exit the value table
    of charge ``exit_of[c] < c`` (:func:`pathwise_costs`' ``exit``), -1 none. The accepted-draft counts
    of a state are found once for every charge; only the K+2 rows the recursion reads are kept; and
    only the states reachable from (0, 0) are solved: round j has committed between j and j (K+1)
    tokens, so ``j >= ceil(t / (K+1))`` (every state such a state reads is reachable too). Each value
    is the same least of the same sums as in the full table, so ``V[0, 0]`` is the same float.
    """
    N, K = S.shape
    nc = Cs.shape[0]
    R = K + 2
    V = np.zeros((nc, R, N + 2))  # V[c, x % R, j]: row x of charge c's table
    lead = np.empty(N + 1, dtype=np.int64)
    rows = np.empty(K + 1, dtype=np.int64)
    for t in range(N - 1, -1, -1):
        cap = N - t - 1
        j0 = (t + K) // (K + 1)
        for j in range(j0, t + 1):
            uj = u[j]
            n = 0
            while n < K and uj < S[t, n]:
                n += 1
            lead[j] = n
        for a in range(K + 1):
            rows[a] = (t + min(a, cap) + 1) % R
        cur = t % R
        for c in range(nc):
            e = exit_of[c]
            for j in range(j0, t + 1):
                n = lead[j]
                best = Cs[c, t, 0] + V[c, rows[0], j + 1]
                nan = best != best
                for k in range(1, K + 1):
                    val = Cs[c, t, k] + V[c, rows[min(n, k)], j + 1]
                    nan |= val != val
                    if val < best:
                        best = val
                if e >= 0:
                    x = V[e, cur, j]
                    nan |= x != x
                    if x < best:
                        best = x
                V[c, cur, j] = np.nan if nan else best
    return V[:, 0, 0].copy()


def _pathwise_values(
    arrays: PositionArrays, charges: list[Charge], exit_of: list[int], g: int, u: np.ndarray
) -> list[float]:
    """``pathwise_costs(arrays, charges[c], g, u, exit=<table of charges[exit_of[c]]>)`` for every c (one sweep).

    The compiled :func:`_pathwise_many` where numba imports, else :func:`pathwise_costs_numpy` charge by charge.
    """
    many = _kernel(1)
    if many is None:
        tables: list[np.ndarray] = []
        out = []
        for c, ch in enumerate(charges):
            e = exit_of[c]
            V = pathwise_costs_numpy(arrays, ch, g, u, exit=None if e < 0 else tables[e], table=True)
            tables.append(V)
            out.append(float(V[0, 0]))
        return out
    S, C0, uu = _pathwise_inputs(arrays, charges[0], g, u)
    Cs = np.empty((len(charges), *C0.shape))
    Cs[0] = C0
    for c, ch in enumerate(charges[1:], start=1):
        Cs[c] = _pathwise_inputs(arrays, ch, g, u)[1]
    return [float(v) for v in many(S, Cs, uu, np.asarray(exit_of, dtype=np.int64))]


_KERNELS: list[Any] = [None, None]  # compiled _pathwise_loop, _pathwise_many (False: numba missing)


def _kernel(which: int = 0) -> Any:
    """The compiled :func:`_pathwise_loop` (0) or :func:`_pathwise_many` (1), or None (no numba, ``SPECENV_NUMBA=0``).

    Compiled on first use, cached on disk by numba (``cache=True``).
    """
    if not numba_support.enabled():
        return None
    if _KERNELS[which] is None:
        numba = numba_support.numba_module()
        fn = (_pathwise_loop, _pathwise_many)[which]
        _KERNELS[which] = False if numba is None else numba.njit(cache=True, nogil=True)(fn)
    return _KERNELS[which] or None


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
        progress: ``progress(done, total, what)`` as each Lagrangian split and each of its cutting-plane
            iterations ends (``what`` starts with ``lagrangian:``, :func:`lagrangian_costs`), then as each
            request's pathwise bound ends (``what`` is ``pathwise bound``; ``done`` counts charges).

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
        lag, lfull, ltail = lagrangian_costs(arrays, model, B, gens, (full, tail), progress=progress)
        if lfull is not None:
            expected = np.maximum(expected, lag)
            charges.append((lfull, ltail, True))
    paths = None
    linear_paths = None
    if pathwise:
        if arrays.greedy:
            paths, linear_paths = expected.copy(), linear_expected.copy()
        else:
            # every request's charges in one sweep: each pair (full, tail) of valid charges bounds every
            # episode (keep the larger); a switching pair's tail value is min(V_full, V_full with the tail as exit)
            flat: list[Charge] = []
            exit_of: list[int] = []
            slots: list[tuple[int, int, bool]] = []
            for cf, ct, switch in charges:
                i = len(flat)
                flat += [cf, ct] + ([cf] if switch else [])
                exit_of += [-1, -1] + ([i + 1] if switch else [])
                slots.append((i, i + 2 if switch else i + 1, switch))
            keys = {int(s) for s in seeds.ravel()}
            total = len(charges) * len(keys)
            memo: dict[int, list[float]] = {}
            for e in range(E):
                for r in range(R):
                    key = int(seeds[e, r])
                    if key not in memo:
                        g, u = request_draws(key, lengths)
                        memo[key] = _pathwise_values(arrays, flat, exit_of, g, u)
                        if progress is not None:
                            progress(len(memo) * len(charges), total, "pathwise bound")
            for i, j, switch in slots:
                pf = np.array([[memo[int(s)][i] for s in row] for row in seeds], dtype=np.float64)
                pick = (lambda v, i=i, j=j: min(v[i], v[j])) if switch else (lambda v, j=j: v[j])
                pt = np.array([[pick(memo[int(s)]) for s in row] for row in seeds], dtype=np.float64)
                cand = _episode_costs(pf, pt, B)
                paths = cand if paths is None else np.maximum(paths, cand)
                linear_paths = cand if linear_paths is None else linear_paths
    ar = np.array([ar_schedule_ms(model, gens[e], lengths, L0, B) for e in range(E)])
    return BatchBound(B, seeds, gens, ar, expected, paths, chosen, method, linear_expected, linear_paths)
