"""Exact Stochastic-Shortest-Path oracle and exact policy evaluation on a positions table.

The round model: generation g has N positions; the state is the number t of committed
tokens. At state t a round with budget k costs ``C(t, k)`` and accepts ``a`` drafts with
``P(a >= i) = S_{t,i} = prod_{j<=i} rho_{t,j}`` (a in 0..k); the round commits ``a+1`` tokens,
``t' = min(t + a + 1, N)``. The oracle solves

    V(t) = min_k [ C(t,k) + sum_a P(a | t,k) V(min(t+a+1, N)) ],   V(N) = 0,

by backward induction. Evaluating a fixed position-indexed policy ``k(t)`` is the same recursion
with the min replaced by the policy's choice.

**Vectorisation across generations.** States are indexed by their distance to the end,
``s = N - t`` (s = 0 is terminal). Generations are sorted by N (longest first), so at sweep step
``s`` the generations that still have a state at distance s form a prefix of that order; the cost
and survival tables are permuted once into that step order (``(K+1, n)`` and ``(K, n)``), so each
step reads contiguous slices. The value function of all generations lives in one 2-D buffer
``W[nmax - x, g]`` (V at distance x; the rows for x <= 0 stay zero), so the values after
``a = 0..K`` accepted drafts are the contiguous block ``W[nmax-s+1 : nmax-s+K+2]``. One sweep of
``max(N)`` steps, each a dozen numpy operations on a ``(K+1, G_active)`` block into preallocated
buffers, solves every generation at once (on blocks of at least ``_WIDE`` generations the
cumulative sum runs row by row and the argmin as a min, an equality and a max, several times faster
there than their axis-0 forms; the floats are the same). The forward sweep for the occupancy
probabilities uses the same layout. The layout and the permuted tables are built once per
(positions table, cost model, lookahead, drafting mode) and cached (:func:`step_tables`), so the
evaluations of many policies on one positions table, the delta-space analysis and the repeated
solves of the CLI and the benchmark pay for them once. ``scripts/bench_oracle.py`` times each part
on a pool of the paper's size (641 generations x 1000 positions x Kmax 10).

**Compiled sweeps.** Where numba is installed (and ``SPECENV_NUMBA`` is not ``0``) the two sweeps and
the gather into step order run as the compiled loops of :mod:`oracle.kernels` (several times faster:
no per-step numpy calls, no temporaries); they do the numpy forms' floating-point operations in the
same order, so the results are the same bit for bit (``tests/test_oracle_kernels.py``). The numpy
forms here (:func:`_backward_numpy`, :func:`_forward_numpy`) are the reference and the fallback, and
the joint oracle's ``extra`` hook always runs in them.

The expectation uses summation by parts (Abel): with ``V_a`` the value after accepting a drafts,
``sum_{a=0..k} P(a) V_a = V_0 + sum_{i=1..k} S_i (V_i - V_{i-1})``, so the expected next value for
every k is one cumulative sum.

**Conventions** (shared with the environment):

* accepted drafts that would run past the end are not counted: a round at ``t`` records
  ``min(a, N-t-1)`` accepted tokens and commits ``min(a+1, N-t)`` tokens, so over a generation the
  accepted counts plus the rounds sum to N exactly;
* the drafting mode decides the draft charge (:data:`specenv.cost.model.DRAFTING_MODES`): in mode
  ``"block"`` with a lookahead ``h`` (the policy sees the draft's confidences of its next h tokens)
  every round drafts ``max(k, h)`` tokens and is charged ``T_D(max(k, h))``, also at k = 0; in modes
  ``"none"`` and ``"sequential"`` a round drafts (and pays for) the k tokens it verifies. The bound
  of ``"sequential"`` is therefore the bound of ``"none"``: an oracle that knows where to stop
  drafts exactly k. ``drafting=None`` reads the lookahead as always (block for h > 0, else none);
* the autoregressive (AR) baseline never drafts: ``AR = sum_t [T_T(0, top_k, L_t)]`` whatever the
  lookahead, and speedup = AR / policy cost;
* among budgets with equal value the smallest k is chosen (``argmin``).
"""

from __future__ import annotations

import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specenv.cost.model import DRAFTING_MODES, Charge, CostModel, drafting_mode
from specenv.stats import mean_ci, ratio_ci
from specenv.traces.traceset import PositionArrays, expected_accepted_table, survival_table

__all__ = [
    "Evaluation",
    "action_values",
    "Simulation",
    "ar_costs",
    "cost_table",
    "evaluate_policy",
    "expected_accepted",
    "simulate",
    "solve",
    "survival",
    "step_tables",
]


# --------------------------------------------------------------------------- inputs
def _check_inputs(arrays: PositionArrays, cost_model: Charge, lookahead: int, drafting: str | None = None) -> None:
    if arrays.n_generations < 1:
        raise ValueError("the positions table holds no generation")
    if np.any(arrays.lengths < 1):
        raise ValueError("every generation needs at least one position")
    if cost_model.kmax < arrays.kmax:
        raise ValueError(
            f"cost model covers K <= {cost_model.kmax}, the positions need Kmax={arrays.kmax} "
            "(use arrays.with_kmax(...) to restrict the budgets)"
        )
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    if drafting is not None and drafting not in DRAFTING_MODES:
        raise ValueError(f"drafting={drafting!r}: expected one of {DRAFTING_MODES}")


def _mode(lookahead: int, drafting: str | None) -> str:
    """The drafting mode of a call: as given, or ``"block"`` for h > 0 and ``"none"`` for h = 0."""
    return drafting_mode(lookahead) if drafting is None else drafting


def cost_table(
    arrays: PositionArrays, cost_model: Charge, lookahead: int = 0, drafting: str | None = None
) -> np.ndarray:
    """Round cost C(t, k) in ms for every position row and every budget k = 0..Kmax.

    ``C(t,k) = T_T(k, U_{t,k}, L_t) + T_D(drafted)`` (``T_D(0) = 0``), drafted = max(k, h) in mode
    ``"block"`` and k in modes ``"none"`` and ``"sequential"``: the cost model's
    :meth:`~specenv.cost.model.CostModel.charged_table`.

    Args:
        arrays: The positions table.
        cost_model: Per-K cost model covering at least ``arrays.kmax``.
        lookahead: Draft confidences h a policy sees (in mode ``"block"`` also drafted and paid for
            before it chooses k).
        drafting: ``"none"``, ``"block"``, ``"sequential"`` or None (block for h > 0, else none).

    Returns:
        (n, Kmax+1) float64 array.
    """
    _check_inputs(arrays, cost_model, lookahead, drafting)
    return cost_model.charged_table(arrays.U, arrays.L, arrays.kmax, lookahead, drafting)


def survival(arrays: PositionArrays) -> np.ndarray:
    """``S[t, i-1] = P(a >= i) = prod_{j<=i} rho_{t,j}`` for i = 1..Kmax, shape (n, Kmax).

    The positions table's :meth:`~specenv.traces.traceset.PositionArrays.survival`.
    """
    return arrays.survival()


def expected_accepted(arrays: PositionArrays) -> np.ndarray:
    """``E[a(t,k)] = sum_{i=1..k} S_{t,i}`` for k = 0..Kmax, shape (n, Kmax+1) (column 0 is 0)."""
    return expected_accepted_table(arrays.rho)


def ar_costs(arrays: PositionArrays, cost_model: Charge) -> np.ndarray:
    """Per-generation cost of plain autoregressive decoding, ``sum_t T_T(0, top_k, L_t)``, in ms."""
    per_pos = cost_model.ar_ms(arrays.L)
    return np.add.reduceat(per_pos, arrays.offsets[:-1])


# --------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class _Layout:
    """Generations sorted by length (longest first) and aligned by distance s = N - t to their end.

    ``perm`` lists the flat rows step by step: the states at distance s of the ``n_active[s]``
    longest generations are ``perm[start[s] : start[s] + n_active[s]]`` (in sorted slot order), so
    per-step data are contiguous slices once the tables are permuted.
    """

    order: np.ndarray  # (G,) generation index at each sorted slot
    lengths: np.ndarray  # (G,) N of each sorted slot
    n_active: np.ndarray  # (nmax+1,) slots with N >= s
    start: np.ndarray  # (nmax+2,) offset in perm of step s's block
    perm: np.ndarray  # (n,) flat rows in step order
    nmax: int

    @classmethod
    def of(cls, arrays: PositionArrays) -> _Layout:
        lengths = arrays.lengths.astype(np.int64)
        order = np.argsort(-lengths, kind="stable")
        ls = lengths[order]
        ends = arrays.offsets[1:][order].astype(np.int64)
        nmax = int(ls[0])
        n_active = np.searchsorted(-ls, -np.arange(nmax + 1), side="right").astype(np.int64)
        start = np.zeros(nmax + 2, dtype=np.int64)
        start[2:] = np.cumsum(n_active[1:])
        s_of = np.repeat(np.arange(1, nmax + 1), n_active[1:])
        slot = np.arange(len(s_of)) - start[s_of]
        perm = ends[slot] - s_of
        return cls(order, ls, n_active, start, perm, nmax)

    def to_steps(self, x: np.ndarray) -> np.ndarray:
        """Per-row (n, m) table -> (m, n) contiguous table in step order (compiled where numba is there)."""
        out = np.empty((x.shape[1], len(self.perm)), dtype=x.dtype)
        kern = _kernels()
        if kern is not None and x.dtype == np.float64:
            kern.take_columns(_readonly(x.T, np.float64), _readonly(self.perm, np.int64), out)
            return out
        for j in range(x.shape[1]):
            np.take(x[:, j], self.perm, out=out[j])
        return out


def _step_tables(
    arrays: PositionArrays, cost_model: Charge, lookahead: int, lay: _Layout, drafting: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Cost (K+1, n) and survival (K, n) tables in step order.

    The same functions as :func:`cost_table` and :func:`survival`
    (:meth:`~specenv.cost.model.CostModel.charged_by_budget`, :func:`~specenv.traces.traceset.survival_table`)
    applied in place to the inputs permuted by :meth:`_Layout.to_steps`, so each step reads contiguous
    slices; the values equal ``cost_table(...)[lay.perm].T`` and ``survival(...)[lay.perm].T`` exactly.
    """
    _check_inputs(arrays, cost_model, lookahead, drafting)
    Ct = lay.to_steps(arrays.U[:, : arrays.kmax + 1])
    cost_model.charged_by_budget(Ct, arrays.L[lay.perm], lookahead, out=Ct, drafting=drafting)
    St = lay.to_steps(arrays.rho)
    survival_table(St, axis=0, out=St)
    return Ct, St


#: Entries of the in-memory cache of :func:`step_tables` (each holds about ``(2 Kmax + 1) n`` floats).
TABLES_CACHE_SIZE = 4
_TABLES: OrderedDict[tuple[Any, ...], tuple[weakref.ref, _Layout, np.ndarray, np.ndarray]] = OrderedDict()


def _tables_key(arrays: PositionArrays, cost_model: Charge, lookahead: int, drafting: str | None) -> tuple | None:
    """The cache key of a solve's tables, or None for a charge that is not a :class:`CostModel`.

    The positions table by identity (it is immutable: a frozen dataclass of arrays loaded once per
    trace set, ``PositionArrays.with_kmax`` makes a new one), the cost model by its content (its
    JSON, which round-trips every float exactly), the lookahead and the drafting mode.
    """
    if type(cost_model) is not CostModel:
        return None  # other charges (the batch bound's) are built per call: one solve each
    model = json.dumps(cost_model.to_json(), sort_keys=True)
    return (id(arrays), model, int(lookahead), _mode(lookahead, drafting))


def step_tables(
    arrays: PositionArrays, cost_model: Charge, lookahead: int = 0, drafting: str | None = None
) -> tuple[_Layout, np.ndarray, np.ndarray]:
    """The layout and the step-order cost (K+1, n) and survival (K, n) tables of a solve, built once.

    Every :func:`solve`, :func:`evaluate_policy`, the joint oracle (:mod:`oracle.caps`) and the sweeps
    built on them read the tables through here: built by :func:`_step_tables` on first use for a
    (positions table, cost model, lookahead, drafting mode) and kept, read-only, in a small in-memory
    LRU cache (:data:`TABLES_CACHE_SIZE` entries; an entry goes when its positions table is freed).
    """
    _check_inputs(arrays, cost_model, lookahead, drafting)
    key = _tables_key(arrays, cost_model, lookahead, drafting)
    hit = _TABLES.get(key) if key is not None else None
    if hit is not None and hit[0]() is arrays:
        _TABLES.move_to_end(key)
        return hit[1], hit[2], hit[3]
    lay = _Layout.of(arrays)
    Ct, St = _step_tables(arrays, cost_model, lookahead, lay, drafting)
    if key is None:
        return lay, Ct, St
    for x in (lay.order, lay.lengths, lay.n_active, lay.start, lay.perm, Ct, St):
        x.flags.writeable = False
    _TABLES[key] = (weakref.ref(arrays, lambda _, key=key: _TABLES.pop(key, None)), lay, Ct, St)
    while len(_TABLES) > TABLES_CACHE_SIZE:
        _TABLES.popitem(last=False)
    return lay, Ct, St


#: Active generations from which a backward step takes its wide form (row-wise cumulative sum, argmin
#: as min/equal/max: fewer passes over memory, more numpy calls); narrower steps keep cumsum/argmin.
#: Both forms give the same floats (the cumulative sum is sequential either way).
_WIDE = 256


def _kernels() -> Any:
    """The compiled sweeps (:mod:`oracle.kernels`), or None: numba missing, or ``SPECENV_NUMBA=0``.

    Imported on the first sweep (numba's import costs a few tenths of a second: ``import oracle``
    does not pay it).
    """
    global _KERNELS
    if _KERNELS is False:
        _KERNELS = None
        from specenv.numba_support import enabled

        if enabled():  # SPECENV_NUMBA=0: the numpy forms
            try:
                from oracle import kernels
            except ImportError:  # numba not installed: the numpy forms
                pass
            else:
                _KERNELS = kernels
    return _KERNELS


_KERNELS: Any = False  # not looked up yet


def _backward(
    Ct: np.ndarray, St: np.ndarray, lay: _Layout, policy: np.ndarray | None, extra: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Backward sweep in step order: value and chosen k per state (optimal if policy is None).

    The compiled kernel (:func:`oracle.kernels.backward`) where numba is there and no ``extra`` is
    given, else :func:`_backward_numpy`; the same floats either way.
    """
    kern = _kernels() if extra is None else None
    if kern is None:
        return _backward_numpy(Ct, St, lay, policy, extra)
    optimal = policy is None
    pol = _NO_POLICY if optimal else _readonly(policy, np.int64)
    return kern.backward(
        _readonly(Ct, np.float64),
        _readonly(St, np.float64),
        _readonly(lay.n_active, np.int64),
        _readonly(lay.start, np.int64),
        len(lay.order),
        pol,
        optimal,
    )


def _readonly(x: np.ndarray, dtype: type) -> np.ndarray:
    """A read-only C-contiguous view (a copy only where the dtype or layout differ) of a kernel's input.

    Every call then has the same argument types, so numba compiles (and caches) each kernel once.
    """
    v = np.ascontiguousarray(x, dtype=dtype).view()
    v.flags.writeable = False
    return v


_NO_POLICY = _readonly(np.zeros(0, dtype=np.int64), np.int64)


def _backward_numpy(
    Ct: np.ndarray, St: np.ndarray, lay: _Layout, policy: np.ndarray | None, extra: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Backward sweep in step order, in numpy: value and chosen k per state (optimal if policy is None).

    ``Ct`` (K+1, n) and ``St`` (K, n) are the cost and survival tables in step order
    (:meth:`_Layout.to_steps`); ``policy`` (n,) budgets in step order or None. ``W[nmax - x]``
    holds V at distance x (rows for x <= 0 stay zero).

    ``extra`` (optimal sweep only) widens the action set: ``extra(p, na, b, q, W) -> (choice, qv)``
    receives the step's block offset ``p``, its active generations ``na``, the row ``b = nmax - s``
    of ``W`` and the budgets' values ``q`` (K+1, na) *without* the value after 0 accepted drafts
    ``W[b+1]``, and returns each state's chosen action index and its value on the same footing
    (:mod:`oracle.caps`, the joint (k, expert cap) action).
    """
    K1, n = Ct.shape
    K = K1 - 1
    G = len(lay.order)
    nm = lay.nmax
    W = np.zeros((nm + K1, G))
    Vp = np.empty(n)
    kp = np.empty(n, dtype=np.int64)
    # work buffers: the step's budget values, value differences, and the argmin's
    Q = np.empty((K1, G))
    D = np.empty((max(K, 1), G))
    eq = np.empty((K1, G), dtype=bool)
    rank = np.empty((K1, G), dtype=np.int16)
    top = np.empty(G, dtype=np.int16)
    first = np.arange(K1, 0, -1, dtype=np.int16)[:, None]  # K1 - k: largest at the smallest budget
    cols = np.arange(G)
    for s in range(1, nm + 1):
        na = int(lay.n_active[s])
        p = int(lay.start[s])
        b = nm - s
        Cs = Ct[:, p : p + na]
        q = Q[:, :na]
        q[0] = Cs[0]
        if K:
            d = D[:, :na]
            # d[i-1] = V after i accepted - V after i-1 accepted; times P(a >= i); cumulate (Abel)
            np.subtract(W[b + 2 : b + K1 + 1, :na], W[b + 1 : b + K1, :na], out=d)
            np.multiply(d, St[:, p : p + na], out=d)
            if na >= _WIDE:  # the cumulative sum row by row (cumsum along axis 0 is slower on wide blocks)
                for i in range(1, K):
                    np.add(d[i - 1], d[i], out=d[i])
                np.add(d, Cs[1:], out=q[1:])
            else:
                np.cumsum(d, axis=0, out=q[1:])
                q[1:] += Cs[1:]
        v = Vp[p : p + na]
        if extra is not None:
            k, v[:] = extra(p, na, b, q, W)
            kp[p : p + na] = k
        elif policy is None and na < _WIDE:
            k = q.argmin(axis=0)
            v[:] = q[k, cols[:na]]
            kp[p : p + na] = k
        elif policy is None:
            # the smallest budget of least value (argmin's choice), without argmin along axis 0
            np.minimum.reduce(q, axis=0, out=v)
            e, r, m = eq[:, :na], rank[:, :na], top[:na]
            np.equal(q, v, out=e)
            np.multiply(e, first, out=r)
            np.maximum.reduce(r, axis=0, out=m)
            np.subtract(K1, m, out=kp[p : p + na])
        else:
            k = policy[p : p + na]
            v[:] = q[k, cols[:na]]
            kp[p : p + na] = k
        v += W[b + 1, :na]
        W[b, :na] = v
    return Vp, kp


def _forward(St: np.ndarray, kp: np.ndarray, lay: _Layout) -> np.ndarray:
    """Occupancy in step order: probability that each state is visited under the budgets ``kp``.

    The compiled kernel (:func:`oracle.kernels.forward`) where numba is there, else
    :func:`_forward_numpy`; the same floats either way.
    """
    kern = _kernels()
    if kern is None:
        return _forward_numpy(St, kp, lay)
    return kern.forward(
        _readonly(St, np.float64),
        _readonly(kp, np.int64),
        _readonly(lay.n_active, np.int64),
        _readonly(lay.start, np.int64),
        _readonly(lay.lengths, np.int64),
    )


def _forward_numpy(St: np.ndarray, kp: np.ndarray, lay: _Layout) -> np.ndarray:
    """Occupancy in step order, in numpy (the reference form of :func:`_forward`)."""
    K, n = St.shape
    G = len(lay.order)
    nm = lay.nmax
    occ_buf = np.zeros((nm + K + 1, G))
    occ_buf[nm - lay.lengths, np.arange(G)] = 1.0
    occp = np.empty(n)
    F = np.zeros((K + 2, G))  # row K + 1 stays 0
    within = np.empty((K, G), dtype=bool)
    depth = np.arange(1, K + 1)[:, None]
    for s in range(nm, 0, -1):
        na = int(lay.n_active[s])
        p = int(lay.start[s])
        b = nm - s
        o = occ_buf[b, :na]
        occp[p : p + na] = o
        if not o.any():
            continue
        f = F[:, :na]  # f[i] = occupancy * P(a >= i), zero beyond the budget
        f[0] = o
        if K:
            w = within[:, :na]
            np.less_equal(depth, kp[p : p + na], out=w)
            np.multiply(St[:, p : p + na], w, out=f[1 : K + 1])
            f[1 : K + 1] *= o
        tgt = occ_buf[b + 1 : b + K + 2, :na]  # distance s - a - 1 for a = 0..K
        tgt += f[:-1]
        tgt -= f[1:]
    return occp


# --------------------------------------------------------------------------- results
@dataclass
class Evaluation:
    """Exact expected cost and path statistics of a position-indexed policy (or of the oracle).

    Per-generation arrays are in the order of ``arrays.generation_ids``; per-row arrays follow the
    flat rows of the positions table (row ``offsets[g] + t``).

    Attributes:
        policy: Label (``"oracle"``, ``"fixed k=3"``, ``"position-indexed"``).
        kmax: Largest budget available.
        lookahead: Draft confidences h seen (charged in every round in mode ``"block"``).
        generation_ids: (G,) generation ids.
        lengths: (G,) tokens N per generation.
        cost: (G,) expected total cost in ms (V(0) for the oracle).
        ar: (G,) autoregressive cost in ms.
        value: (n,) expected cost-to-go V(t) from every state.
        k: (n,) budget chosen at every state (k*(t) for the oracle).
        occupancy: (n,) probability that the state is visited (a decision is taken there).
        rounds: (G,) expected number of rounds.
        k_sum: (G,) expected sum of budgets over the rounds.
        accepted_sum: (G,) expected sum of accepted drafts (``= lengths - rounds``).
        offsets: (G+1,) row offsets (as in the positions table).
        drafting: The drafting mode that charged the rounds (``"none"``, ``"block"``, ``"sequential"``).
    """

    policy: str
    kmax: int
    lookahead: int
    generation_ids: np.ndarray
    lengths: np.ndarray
    cost: np.ndarray
    ar: np.ndarray
    value: np.ndarray
    k: np.ndarray
    occupancy: np.ndarray
    rounds: np.ndarray
    k_sum: np.ndarray
    accepted_sum: np.ndarray
    offsets: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)
    drafting: str = "none"

    @property
    def speedup(self) -> np.ndarray:
        """(G,) per-generation speedup AR / cost (S_max for the oracle)."""
        return self.ar / self.cost

    @property
    def speedup_pooled(self) -> float:
        """Speedup of the whole set: sum AR / sum cost (the headline S_max for the oracle)."""
        return float(self.ar.sum() / self.cost.sum())

    @property
    def speedup_mean(self) -> float:
        """Mean over generations of the per-generation speedup."""
        return float(self.speedup.mean())

    @property
    def mean_k(self) -> float:
        """Mean budget per round, pooled over all rounds of all generations (ratio of expectations)."""
        return float(self.k_sum.sum() / self.rounds.sum())

    @property
    def mean_accepted(self) -> float:
        """Mean accepted drafts per round, pooled over all rounds (ratio of expectations)."""
        return float(self.accepted_sum.sum() / self.rounds.sum())

    @property
    def v0_per_token(self) -> float:
        """Optimal (policy) cost per committed token, sum cost / sum N, in ms."""
        return float(self.cost.sum() / self.lengths.sum())

    def summary(self) -> dict[str, Any]:
        """Plain-JSON headline numbers."""
        return {
            "policy": self.policy,
            "kmax": self.kmax,
            "lookahead": self.lookahead,
            "drafting": self.drafting,
            "generations": int(len(self.cost)),
            "tokens": int(self.lengths.sum()),
            "speedup_pooled": self.speedup_pooled,
            "speedup_mean": self.speedup_mean,
            "mean_k": self.mean_k,
            "mean_accepted": self.mean_accepted,
            "expected_rounds": float(self.rounds.sum()),
            "cost_ms": float(self.cost.sum()),
            "ar_ms": float(self.ar.sum()),
            "cost_per_token_ms": self.v0_per_token,
            "ar_per_token_ms": float(self.ar.sum() / self.lengths.sum()),
        } | self.extra

    def k_of(self, g: int) -> np.ndarray:
        """Budgets k(t), t = 0..N-1, of the generation at index g."""
        return self.k[self.offsets[g] : self.offsets[g + 1]]

    def value_of(self, g: int) -> np.ndarray:
        """V(t), t = 0..N-1, of the generation at index g."""
        return self.value[self.offsets[g] : self.offsets[g + 1]]


def _policy_rows(policy: int | np.ndarray, arrays: PositionArrays) -> tuple[np.ndarray, str]:
    n = len(arrays.L)
    if isinstance(policy, int | np.integer):
        k = np.full(n, int(policy), dtype=np.int64)
        label = f"fixed k={int(policy)}"
    else:
        k = np.asarray(policy)
        if k.shape != (n,):
            raise ValueError(
                f"a position-indexed policy needs one budget per position row: shape ({n},), got {k.shape}"
            )
        if not np.issubdtype(k.dtype, np.integer):
            if not np.all(np.equal(np.mod(k, 1), 0)):
                raise ValueError("budgets must be integers")
        k = k.astype(np.int64)
        label = "position-indexed"
    if n and (k.min() < 0 or k.max() > arrays.kmax):
        raise ValueError(f"budgets must lie in 0..{arrays.kmax}")
    return k, label


def _evaluate(
    arrays: PositionArrays,
    cost_model: Charge,
    policy: np.ndarray | None,
    label: str,
    lookahead: int,
    drafting: str | None = None,
) -> Evaluation:
    lay, Ct, St = step_tables(arrays, cost_model, lookahead, drafting)
    Vp, kp = _backward(Ct, St, lay, None if policy is None else policy[lay.perm])
    occp = _forward(St, kp, lay)
    n = len(arrays.L)
    V = np.empty(n)
    V[lay.perm] = Vp
    k = np.empty(n, dtype=np.int64)
    k[lay.perm] = kp
    occ = np.empty(n)
    occ[lay.perm] = occp
    starts = arrays.offsets[:-1]
    rounds = np.add.reduceat(occ, starts)
    lengths = arrays.lengths.astype(np.int64)
    return Evaluation(
        policy=label,
        kmax=arrays.kmax,
        lookahead=lookahead,
        generation_ids=arrays.generation_ids,
        lengths=lengths,
        cost=V[starts].copy(),
        ar=ar_costs(arrays, cost_model),
        value=V,
        k=k,
        occupancy=occ,
        rounds=rounds,
        k_sum=np.add.reduceat(occ * k, starts),
        accepted_sum=lengths - rounds,
        offsets=arrays.offsets,
        drafting=_mode(lookahead, drafting),
    )


def solve(
    arrays: PositionArrays,
    cost_model: Charge,
    lookahead: int = 0,
    mc_episodes: int = 0,
    seed: int = 0,
    drafting: str | None = None,
) -> Evaluation:
    """Exact SSP oracle: optimal budgets k*(t) and optimal expected cost V(0) per generation.

    Args:
        arrays: Positions table (greedy or stochastic). Budgets 0..``arrays.kmax`` are allowed;
            restrict them with ``arrays.with_kmax(k)``.
        cost_model: Per-K cost model covering ``arrays.kmax``.
        lookahead: Draft lookahead h (in mode ``"block"`` every round is charged ``T_D(max(k, h))``).
        mc_episodes: If > 0, also run this many seeded Monte-Carlo episodes per generation along
            the optimal policy; the result goes to ``extra["mc"]`` (see :func:`simulate`).
        seed: Seed of the Monte-Carlo episodes.
        drafting: ``"none"``, ``"block"``, ``"sequential"`` or None (block for h > 0, else none). The
            bound of ``"sequential"`` equals the bound of ``"none"`` (the oracle knows where to stop
            and drafts exactly k); the bound of ``"block"`` with h > 0 is lower.

    Returns:
        The :class:`Evaluation` of the optimal policy (``policy == "oracle"``); ``speedup`` is the
        per-generation S_max and ``speedup_pooled`` the set's S_max.
    """
    res = _evaluate(arrays, cost_model, None, "oracle", lookahead, drafting)
    if mc_episodes > 0:
        sim = simulate(
            arrays, cost_model, res.k, episodes=mc_episodes, seed=seed, lookahead=lookahead, drafting=drafting
        )
        res.extra["mc"] = sim.summary()
    return res


def evaluate_policy(
    arrays: PositionArrays,
    cost_model: Charge,
    policy: int | np.ndarray,
    lookahead: int = 0,
    drafting: str | None = None,
) -> Evaluation:
    """Exact expected cost of a position-indexed policy (same recursion with k fixed per state).

    Args:
        arrays: Positions table.
        cost_model: Per-K cost model covering ``arrays.kmax``.
        policy: A fixed budget ``k`` for every state, or an (n,) integer array with the budget at
            every position row (row ``offsets[g] + t``), e.g. ``solve(...).k``.
        lookahead: Draft lookahead h.
        drafting: The drafting mode (as in :func:`solve`).

    Returns:
        The :class:`Evaluation` (expected cost per generation in ``cost``).
    """
    k, label = _policy_rows(policy, arrays)
    return _evaluate(arrays, cost_model, k, label, lookahead, drafting)


def action_values(
    arrays: PositionArrays,
    cost_model: Charge,
    value: np.ndarray,
    rows: np.ndarray | None = None,
    lookahead: int = 0,
    drafting: str | None = None,
    rho: np.ndarray | None = None,
) -> np.ndarray:
    """Action values ``Q(t,k) = C(t,k) + sum_a P(a|t,k) V(min(t+a+1, N))`` for every budget.

    Args:
        arrays: Positions table.
        cost_model: Cost model.
        value: (n,) cost-to-go per row, e.g. ``solve(...).value`` (then ``min_k Q = V``).
        rows: Flat position rows to compute (default all).
        lookahead: Draft lookahead h.
        drafting: The drafting mode (as in :func:`solve`).
        rho: (len(rows), Kmax) conditional acceptances of the round at ``rows`` replacing the
            table's (e.g. a belief given what a stop rule has seen so far); default the table's.

    Returns:
        (len(rows), Kmax+1) float64 action values in ms.
    """
    C = cost_table(arrays, cost_model, lookahead, drafting)
    rows = np.arange(len(arrays.L)) if rows is None else np.asarray(rows, dtype=np.int64)
    K = arrays.kmax
    if rho is None:
        S_rows = survival(arrays)[rows]
    elif np.shape(rho) != (len(rows), K):
        raise ValueError(f"action_values: rho has shape {np.shape(rho)}, the rows need {(len(rows), K)}")
    else:
        S_rows = survival_table(np.asarray(rho, dtype=np.float64))
    gen = np.searchsorted(arrays.offsets, rows, side="right") - 1
    end = arrays.offsets[gen + 1]
    nxt = rows[:, None] + 1 + np.arange(K + 1)[None, :]  # row after accepting a = 0..K
    Vn = np.where(nxt < end[:, None], value[np.minimum(nxt, len(value) - 1)], 0.0)
    ev = np.concatenate([Vn[:, :1], Vn[:, :1] + np.cumsum(S_rows * np.diff(Vn, axis=1), axis=1)], axis=1)
    return C[rows] + ev


# --------------------------------------------------------------------------- Monte Carlo
@dataclass
class Simulation:
    """Monte-Carlo episodes of a position-indexed policy on the positions table.

    Attributes:
        generation_index: (E,) index (into the positions table's generations) of each episode.
        cost: (E,) total cost in ms of each episode.
        ar: (E,) AR cost of the episode's generation.
        rounds: (E,) rounds of each episode.
        k_sum: (E,) sum of budgets.
        accepted_sum: (E,) sum of accepted drafts (counted as in :class:`Evaluation`).
        seed: Seed used.
        visits: (n,) number of decisions taken at every position row over all episodes.
    """

    generation_index: np.ndarray
    cost: np.ndarray
    ar: np.ndarray
    rounds: np.ndarray
    k_sum: np.ndarray
    accepted_sum: np.ndarray
    seed: int
    visits: np.ndarray

    def summary(self) -> dict[str, Any]:
        """Pooled estimates with 95% normal confidence half-widths (ratio estimators, delta method)."""
        return {
            "episodes": int(len(self.cost)),
            "seed": self.seed,
            "speedup_pooled": ratio_ci(self.ar, self.cost),
            "speedup_mean": mean_ci(self.ar / self.cost),
            "mean_k": ratio_ci(self.k_sum, self.rounds),
            "mean_accepted": ratio_ci(self.accepted_sum, self.rounds),
            "cost_ms_mean": mean_ci(self.cost),
        }


def simulate(
    arrays: PositionArrays,
    cost_model: Charge,
    policy: int | np.ndarray,
    episodes: int = 1,
    seed: int = 0,
    lookahead: int = 0,
    drafting: str | None = None,
) -> Simulation:
    """Seeded Monte-Carlo episodes of a position-indexed policy, all generations at once.

    Each round draws one uniform u and accepts ``a = #{i <= k : u < S_{t,i}}`` drafts, so
    ``P(a >= i) = S_{t,i}`` exactly (greedy traces are deterministic).

    Args:
        arrays: Positions table.
        cost_model: Cost model.
        policy: Fixed budget or (n,) budgets per position row (e.g. ``solve(...).k``).
        episodes: Episodes per generation.
        seed: Seed of ``numpy.random.default_rng``.
        lookahead: Draft lookahead h.
        drafting: The drafting mode (as in :func:`solve`).

    Returns:
        The :class:`Simulation`, episodes ordered generation-major.
    """
    if episodes < 1:
        raise ValueError("episodes must be >= 1")
    k_rows, _ = _policy_rows(policy, arrays)
    C = cost_table(arrays, cost_model, lookahead, drafting)
    S = survival(arrays)
    rng = np.random.default_rng(seed)
    G = arrays.n_generations
    gidx = np.repeat(np.arange(G), episodes)
    start = arrays.offsets[:-1][gidx].astype(np.int64)
    N = arrays.lengths[gidx].astype(np.int64)
    E = len(gidx)
    t = np.zeros(E, dtype=np.int64)
    cost = np.zeros(E)
    rounds = np.zeros(E, dtype=np.int64)
    ksum = np.zeros(E, dtype=np.int64)
    acc = np.zeros(E, dtype=np.int64)
    live = np.arange(E)
    visits = np.zeros(len(k_rows), dtype=np.int64)
    cols = np.arange(1, arrays.kmax + 1)
    while live.size:
        row = start[live] + t[live]
        k = k_rows[row]
        u = rng.random(live.size)
        a = np.count_nonzero((S[row] > u[:, None]) & (cols[None, :] <= k[:, None]), axis=1)
        a = np.minimum(a, N[live] - t[live] - 1)
        cost[live] += C[row, k]
        np.add.at(visits, row, 1)
        rounds[live] += 1
        ksum[live] += k
        acc[live] += a
        t[live] += a + 1
        live = live[t[live] < N[live]]
    ar = ar_costs(arrays, cost_model)[gidx]
    return Simulation(gidx, cost, ar, rounds, ksum, acc, seed, visits)
