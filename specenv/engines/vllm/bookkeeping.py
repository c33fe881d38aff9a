"""The vLLM controller's per-request bookkeeping: observation slots, request state, step clocks and log.

* :class:`ObsSlots` -- the running observation statistics of every request (one
  :class:`specenv.observation.single.ObservationState`, one slot per request, one vectorised update per step);
* :class:`Req` -- what the controller keeps per request (generation id, slot, last decision, drafts,
  draft signals, last outcome);
* :class:`Round` / :class:`StepClock` -- one verification round of a step and the step's times;
* :class:`StepLog` -- specenv's own time per engine step (a ring of the last steps);
* :func:`committed_len` / :func:`batch_offsets` -- what a round commits, where a request's tokens sit in
  the step's flattened batch.

No vLLM import: the controller (:mod:`specenv.engines.vllm.controller`) owns the hooks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specenv.observation.single import ObservationSpec, ObservationState

__all__ = ["OUTCOME_FIELDS", "ObsSlots", "Req", "Round", "StepClock", "StepLog", "batch_offsets", "committed_len"]


class ObsSlots:
    """The running observation statistics of all requests: one ObservationState, one slot per request.

    One vectorised ``update`` and one ``build`` per engine step, whatever the batch size (the slot
    array grows by doubling when needed).
    """

    def __init__(self, spec: ObservationSpec, n: int = 64, compiled: bool = True):
        self.spec = spec
        self.state = ObservationState(spec, n)
        self.free = list(range(n - 1, -1, -1))
        self._scratch: dict[int, ObservationState] = {}
        self._what_if_scratch: dict[int, ObservationState] = {}  # :meth:`what_if`'s own (never the fresh subset)
        self._stacked_scratch: dict[tuple[int, int], tuple[ObservationState, ObservationState]] = {}
        #: ``(slots, sub)``: the subset the last :meth:`update` folded and scattered back (its rows equal the
        #: state's), reused by ``subset(slots, reuse=True)`` until any other subset, alloc or release.
        self._fresh: tuple[tuple[int, ...], ObservationState] | None = None
        #: ``(slots, inputs, hyp)``: the last :meth:`what_if`'s fold (``inputs``: its k, accepted, U, cost as a
        #: (4, rows) float64 array), which :meth:`update` of the same rounds scatters instead of folding
        #: again (``draft_horizon="outcome"`` asks about a round's known outcome before it is folded); any
        #: change of the state (update, alloc, release) drops it.
        self._folded: tuple[tuple[int, ...], np.ndarray, ObservationState] | None = None
        from specenv.engines.kernels import kernels

        #: the compiled what-if and commit (:mod:`specenv.engines.kernels`; None: numpy only)
        self._kernels = kernels() if compiled else None
        # what the compiled what-if builds: the observation without lookahead or per-token columns
        self._compiled_rows = not spec.lookahead and not spec.per_token and spec.dim == 6 + 4 + spec.kmax
        st = self.state
        self._cols = np.array([st._c_context, st._c_progress, st._c_prev.start, st._c_stats.start], dtype=np.int64)
        self._hi = np.ascontiguousarray(st._hi_row[0], dtype=np.float32)
        self._no_rows = np.empty((0, spec.dim), dtype=np.float32)  # the compiled fold builds nothing

    def alloc(self) -> int:
        """A fresh slot (statistics at their priors)."""
        self._fresh = None
        self._folded = None
        if not self.free:
            n = self.state.n
            self.state = self.state.resized(2 * n)
            self.free = list(range(2 * n - 1, n - 1, -1))
        i = self.free.pop()
        self.state._P[i] = 0.0
        self.state._E[i] = self.state._E_init
        return i

    def release(self, i: int) -> None:
        """Give a slot back."""
        self._fresh = None
        self._folded = None
        self.free.append(i)

    def subset(self, slots: Any, reuse: bool = False) -> ObservationState:
        """The statistics of some slots, as an ObservationState of their own (rows in the given order).

        The state is a scratch buffer kept per number of rows (no allocation, no table building per
        step): valid until the next ``subset`` of the same size. With ``reuse``, the subset the last
        :meth:`update` left is returned as it is when it holds the same slots in the same order (the
        controller builds the observations of the rounds it just folded: no second gather); a caller that
        changes the returned rows (a hypothetical update) must not pass ``reuse``.
        """
        fresh = self._fresh
        if reuse and fresh is not None and fresh[0] == _key(slots):
            return fresh[1]
        self._fresh = None
        return self._gather(self._scratch, slots)

    def _gather(self, scratch: dict[int, ObservationState], slots: Any) -> ObservationState:
        """The listed slots' statistics copied into ``scratch``'s state of that many rows (kept per size)."""
        sub = scratch.get(len(slots))
        if sub is None:
            sub = scratch[len(slots)] = ObservationState(self.spec, len(slots))
        st = self.state
        # the named statistics (cost_per_token, first, ...) are columns of these two blocks
        np.take(st._P, slots, axis=0, out=sub._P)
        np.take(st._E, slots, axis=0, out=sub._E)
        return sub

    def update(self, slots: Any, k: Any, acc: Any, U: Any, cost: Any) -> None:
        """Fold one round per listed slot into the statistics (gather, one vectorised update, scatter).

        Arguments are sequences or arrays of one value per slot (``k`` and ``acc`` integers).
        """
        folded, self._folded = self._folded, None
        key = _key(slots)
        kern = self._kernels
        if (
            folded is not None
            and folded[0] == key
            and kern is not None
            and _typed(np.int64, slots, k, acc)
            and _typed(np.float64, U, cost)
        ):
            # the same rounds a what_if just folded: its rows scattered, not folded again (one compiled call)
            sub = self._scratch.get(len(key))
            if sub is None:
                sub = self._scratch[len(key)] = ObservationState(self.spec, len(key))
            self._fresh = None
            st = self.state
            hyp = folded[2]
            if kern.commit(folded[1], k, acc, U, cost, hyp._P, hyp._E, slots, st._P, st._E, sub._P, sub._E):
                self._fresh = (key, sub)
                return
        elif folded is not None and folded[0] == key:  # the same, in numpy
            ins = np.array([k, acc, U, cost], dtype=np.float64)
            if np.array_equal(ins, folded[1]):  # (NaN never equal: folded again)
                self._fresh = None
                sub = self._scratch.get(len(key))
                if sub is None:
                    sub = self._scratch[len(key)] = ObservationState(self.spec, len(key))
                np.copyto(sub._P, folded[2]._P)
                np.copyto(sub._E, folded[2]._E)
                st = self.state
                st._P[slots] = sub._P
                st._E[slots] = sub._E
                self._fresh = (key, sub)
                return
        sub = self._scratch.get(len(key))
        if sub is None:
            sub = self._scratch[len(key)] = ObservationState(self.spec, len(key))
        self._fresh = None
        if self._compiled(sub, slots, 0, k, acc, U, cost, None, None, None, scatter=True) is not None:
            self._fresh = (key, sub)
            return
        sub = self.subset(slots)
        acc_a = np.asarray(acc, dtype=np.float64)
        sub.update(np.asarray(k), np.asarray(acc), np.asarray(U, dtype=np.float64), np.asarray(cost), acc_a + 1)
        st = self.state
        st._P[slots] = sub._P
        st._E[slots] = sub._E
        self._fresh = (_key(slots), sub)

    def what_if(
        self,
        slots: Any,
        k: np.ndarray,
        U: Any,
        L: np.ndarray,
        t: np.ndarray,
        out: Any = None,
        accepted: np.ndarray | None = None,
        cost: np.ndarray | None = None,
    ) -> np.ndarray:
        """Observations one round ahead, if every one of ``k`` drafts were accepted; the statistics unchanged.

        Row r: slot ``slots[r]`` (a slot may repeat: one row per budget asked about) folded with a round
        of ``k[r]`` drafts, all accepted (``k[r] + 1`` committed), ``U[r]`` unique experts and the slot's
        last cost (1 before one), then built at context ``L[r]`` after ``t[r]`` generated tokens (the
        controller's draft horizon). On a scratch state of its own (kept per number of rows), so the
        subset that :meth:`update` left for ``subset(reuse=True)`` stays valid.

        Args:
            slots: Slot per row.
            k: (rows,) float64 budgets.
            U: (rows,) unique experts of the hypothetical round.
            L: (rows,) float64 context lengths after it.
            t: (rows,) float64 tokens generated after it.
            out: An array of (rows, dim) float32 to build into (else a new one).
            accepted: (rows,) float64 accepted drafts of the round instead of all ``k`` (``accepted + 1``
                committed): the round's known outcome (``draft_horizon="outcome"``).
            cost: (rows,) float64 the round's cost (AR steps) instead of the slot's last one: known once the
                target has verified (``draft_horizon="outcome"``).
        """
        a = k if accepted is None else accepted
        U = np.asarray(U, dtype=np.float64)
        if out is None or (out.dtype == np.float32 and out.ndim == 2):  # one compiled call, if it applies
            hyp = self._what_if_scratch.get(len(slots))
            if hyp is None:
                hyp = self._what_if_scratch[len(slots)] = ObservationState(self.spec, len(slots))
            obs = self._compiled(hyp, slots, 0, k, a, U, cost, L, t, out, scatter=False)
            if obs is not None:
                if cost is None:
                    cost = hyp.prev_cost.copy()
                self._folded = (_key(slots), np.array([k, a, U, cost], dtype=np.float64), hyp)
                return obs
        hyp = self._gather(self._what_if_scratch, slots)
        if cost is None:
            cost = np.where(hyp.prev_cost > 0, hyp.prev_cost, 1.0)
        hyp.update(k, a, U, cost, a + 1)
        self._folded = (_key(slots), np.array([k, a, U, cost], dtype=np.float64), hyp)
        return hyp.build(L, t, out=out)

    def _compiled(
        self,
        into: ObservationState,
        slots: Any,
        first: int,
        k: Any,
        a: Any,
        U: Any,
        cost: Any,
        L: Any,
        t: Any,
        out: Any,
        scatter: bool,
    ) -> np.ndarray | None:
        """:func:`specenv.engines.kernels.rows` into ``into``'s blocks (one compiled call), or None: numpy then.

        Returns the built rows (an empty array when ``L`` is None: the fold alone), or None where the
        kernel does not apply: no numba, an observation with lookahead or per-token columns, other dtypes
        than it takes, a round outside the statistics' table.
        """
        kern = self._kernels
        if kern is None or not self._compiled_rows:
            return None
        ints = _typed(np.int64, k, a)
        if not (ints or _typed(np.float64, k, a)) or not _typed(np.float64, U, U if cost is None else cost):
            return None
        if L is not None and not _typed(np.float64, L, t):
            return None
        n = len(slots)
        st = self.state
        if L is None:
            obs = self._no_rows
        else:
            obs = np.empty((n, self.spec.dim), dtype=np.float32) if out is None else out
        ok = kern.rows(
            st._P, st._E, slots if _typed(np.int64, slots) else np.asarray(slots, dtype=np.int64), first, k, a, U,
            U if cost is None else cost, cost is not None, U if L is None else L, U if t is None else t,
            st._M, st._A, st._K, st._w, st._scale, st._ctx_scale, st._mnt, self._cols, st.clip, self._hi,
            into._P, into._E, obs, scatter,
        )  # fmt: skip
        return obs if ok else None

    def stacked(
        self, slots: Any, L: Any, t: Any, src: np.ndarray, K: np.ndarray, K1: np.ndarray, K1_all: np.ndarray, U: Any
    ) -> np.ndarray:
        """The observations of ``slots`` at ``(L, t)``, then :meth:`what_if` rows of them, in one (n + m, dim) array.

        Row i < n: slot ``slots[i]`` as it is, at context ``L[i]`` after ``t[i]`` tokens (``build``). Row
        n + r: slot ``slots[src[n + r]]`` after a round of ``K[r]`` drafts all accepted, ``U[r]`` experts
        and the slot's last cost (1 before one), at ``L + K + 1``, ``t + K + 1`` -- :meth:`what_if`'s
        rows. Both from one gather and one ``build`` (``K1 = K + 1``; ``K1_all``: 0 for the first n rows,
        then ``K1``): the same float operations, row by row, as ``subset(slots).build(L, t)`` and
        :meth:`what_if`. On a scratch state of its own (kept per (n, m)).
        """
        n, m = len(slots), len(K)
        pair = self._stacked_scratch.get((n, m))
        if pair is None:
            both, tail = ObservationState(self.spec, n + m), ObservationState(self.spec, m)
            tail._P, tail._E = both._P[n:], both._E[n:]  # the what-if rows: views of the stacked blocks
            pair = self._stacked_scratch[(n, m)] = (both, tail)
        both, tail = pair
        rows = np.take(np.asarray(slots, dtype=np.intp), src)
        if self._kernels is not None:  # one compiled call, if it applies
            L_all = np.take(np.asarray(L, dtype=np.float64), src) + K1_all
            t_all = np.take(np.asarray(t, dtype=np.float64), src) + K1_all
            obs = self._compiled(both, rows, n, K, K, np.asarray(U, dtype=np.float64), None, L_all, t_all, None, False)
            if obs is not None:
                return obs
        st = self.state
        np.take(st._P, rows, axis=0, out=both._P)
        np.take(st._E, rows, axis=0, out=both._E)
        cost = np.where(tail.prev_cost > 0, tail.prev_cost, 1.0)
        tail.update(K, K, np.asarray(U, dtype=np.float64), cost, K1)
        # exact: integers in float64 (+ 0 for the step's own rows)
        return both.build(
            np.take(np.asarray(L, dtype=np.float64), src) + K1_all,
            np.take(np.asarray(t, dtype=np.float64), src) + K1_all,
        )


def _typed(dtype: Any, *xs: Any) -> bool:
    """Whether every one of ``xs`` is a 1-D numpy array of ``dtype`` (what the compiled kernels take)."""
    for x in xs:
        if not (isinstance(x, np.ndarray) and x.dtype == dtype and x.ndim == 1):
            return False
    return True


def _key(slots: Any) -> tuple[int, ...]:
    return tuple(slots.tolist() if isinstance(slots, np.ndarray) else slots)


class StepLog:
    """Per engine step: specenv's own wall and CPU time, and the step's wall time (a ring of the last steps).

    A step runs from the controller's ``schedule`` to the end of its last hook of the step
    (``update_from_output`` or ``update_draft_token_ids``); the idle time between steps is not part of it.
    Each hook calls :meth:`add` with its own (wall, thread-CPU) start stamps; the row of a step is written
    when the next step is scheduled (or by :meth:`close`).
    """

    CAP = 1 << 16

    def __init__(self) -> None:
        self.rows = np.zeros((self.CAP, 3))
        self.n = 0
        self.t0: float | None = None  # the open step's start
        self.t_end = 0.0
        self.over = 0.0
        self.cpu = 0.0

    def open(self, t: float) -> None:
        """A step starts at ``t`` (closing the previous one)."""
        self.close()
        self.t0, self.t_end = t, t

    def add(self, t0: float, c0: float) -> float:
        """Charge specenv's code from ``(t0, c0)`` (``perf_counter``, ``thread_time``) to now; returns the ms."""
        t, c = time.perf_counter(), time.thread_time()
        ms = (t - t0) * 1e3
        self.over += ms
        self.cpu += (c - c0) * 1e3
        self.t_end = t
        return ms

    def close(self) -> None:
        """Write the open step's row."""
        if self.t0 is None:
            return
        self.rows[self.n % self.CAP] = (self.over, self.cpu, (self.t_end - self.t0) * 1e3)
        self.n += 1
        self.t0, self.over, self.cpu = None, 0.0, 0.0

    def since(self, start: int) -> np.ndarray:
        """``(steps, 3)`` rows (specenv ms, specenv CPU ms, step ms) of the steps numbered ``start..`` (last CAP)."""
        self.close()
        start = max(start, self.n - self.CAP)
        idx = np.arange(start, self.n) % self.CAP
        return self.rows[idx].copy()


@dataclass
class Req:
    """Per-request controller state."""

    gid: int
    slot: int
    rounds: int = 0
    policy_k: int = -1
    drafted: int = 0
    fallback: bool = False
    capped: bool = False
    td_ms: float = 0.0
    td_cpu_ms: float = 0.0
    last_U: dict[int, float] = field(default_factory=dict)
    full_drafts: list[int] = field(default_factory=list)
    signals: np.ndarray | None = None  # (drafts, 3) q, entropy, margin of full_drafts (when captured)
    greedy: bool | None = None  # the request's sampling is greedy (known from its first round)
    stops: frozenset[int] | None = None  # the request's stop tokens (:func:`stop_tokens`, from its first round)
    #: The draft horizon of the request's next round, asked in the same policy call as its k (the
    #: controller's one-call path): ``(step, L, t, ks)``, ``ks[K]`` the policy's k (validated, or None)
    #: if all K drafts in flight are accepted, for K = 0..len(ks)-1, valid at the schedule after ``step``
    #: while the request is still at context L after t tokens.
    horizon: tuple[int, int, int, list[Any]] | None = None
    #: The last round's outcome: the values of :data:`OUTCOME_FIELDS`, then the round's sampled tokens
    #: and the drafts proposed for it (what :attr:`last` is made of, on demand).
    out: tuple[Any, ...] | None = None

    @property
    def last(self) -> dict[str, Any] | None:
        """The last round's outcome as a dict (:data:`OUTCOME_FIELDS`, ``committed``, ``drafted``), or None."""
        out = self.out
        if out is None:
            return None
        d = dict(zip(OUTCOME_FIELDS, out, strict=False))
        d["committed"] = list(out[-2][: d["accepted"] + 1])
        d["drafted"] = list(out[-1])
        return d


#: The scalar fields of a round's outcome (``Req.out``), in order; ``T_D_ms``/``T_D_cpu_ms`` are the
#: drafting that fed the round (0 when the step was not timed by the forward hooks).
OUTCOME_FIELDS = (
    "K",
    "m",
    "accepted",
    "accepted_raw",
    "L",
    "t",
    "U_r",
    "E_max",
    "T_T_ms",
    "T_D_ms",
    "T_T_cpu_ms",
    "T_D_cpu_ms",
    "step_ms",
    "cost_units",
)


@dataclass
class StepClock:
    """Times of one engine step: its wall time, and the target/draft forwards'.

    ``timing``: ``hooks`` (forward hooks, CPU clocks), ``events`` (forward hooks, CUDA events) or
    ``step`` (no hook ran: T_T is the step's wall time, T_D missing); on an accelerator followed by
    ``:MODE``, the step's CUDA-graph mode (``:FULL``, ``:PIECEWISE``, ``:NONE``).
    """

    step_ms: float
    t_ms: float
    d_ms: float
    t_cpu: float
    d_cpu: float
    timing: str

    @property
    def hooked(self) -> bool:
        """Whether the target's forward hooks timed the step (T_T and T_D measured)."""
        return self.timing.split(":", 1)[0] != "step"


@dataclass
class Round:
    """A request whose step was a verification round: ``n = 1 + K`` tokens, ``gen`` sampled."""

    req_id: str
    n: int
    request: Any
    st: Req
    gen: list[int]
    drafts: Any
    K: int


def stop_tokens(request: Any) -> frozenset[int]:
    """The token ids that end ``request`` (its ``stop_token_ids`` and end-of-text): fixed for its lifetime."""
    sp = request.sampling_params
    stops = set(getattr(sp, "stop_token_ids", None) or ())
    eos = getattr(sp, "eos_token_id", None)
    if eos is not None:
        stops.add(eos)
    return frozenset(stops)


def committed_len(request: Any, gen: list[int], max_model_len: int, stops: frozenset[int] | None = None) -> int:
    """How many of a round's sampled tokens ``gen`` the request keeps (vLLM's ``check_stop``, read only).

    vLLM's sampler returns every accepted draft plus the bonus token; the scheduler then appends them
    one by one and cuts the request after an end-of-text or stop token, at ``max_tokens`` and at the
    model's length. The controller sees the step before that cut, so it applies the same rule here:
    the recorded ``accepted`` never makes a request commit more tokens than it returns.
    """
    if stops is None:
        stops = stop_tokens(request)
    out, total = int(request.num_output_tokens), int(request.num_tokens)
    max_tokens = getattr(request, "max_tokens", None)
    for i, tok in enumerate(gen, 1):
        if tok in stops or total + i >= max_model_len or (max_tokens is not None and out + i >= int(max_tokens)):
            return i
    return len(gen)


def batch_offsets(sched: dict[str, int], index: dict[str, int]) -> tuple[dict[str, int], int]:
    """Each request's first token in the step's flattened batch (in the runner's order), and the total."""
    offsets, off = {}, 0
    for r in sorted(sched, key=lambda r: index.get(r, 1 << 30)):
        offsets[r] = off
        off += sched[r]
    return offsets, off
