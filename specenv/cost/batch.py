"""The batch cost model: the time of one batched step of B concurrent speculating requests.

At batch size 1 a round costs ``T_T(K) = beta0(K) + alpha(K) * U + c(K) * L`` (:mod:`specenv.cost.model`,
the seed paper's form). In a batch, one verification pass runs every request's verified positions
together, and the MoE layers load the *union* of the experts that all of them route to. This module
prices that step (DESIGN.md section 6, "batch cost model"):

* **verification** of a step where request i verifies ``m_i = k_i + 1`` positions::

      T_V = beta0(P) + alpha(P) * U_batch + c(P) * sum_i L_i + b_req * (B - 1)

  with ``P = sum_i m_i`` the step's verified positions, ``U_batch`` the mean over MoE layers of the
  per-layer union of the experts of all verified positions of all requests, ``L_i`` the context
  lengths and B the number of requests. The coefficients are tables indexed by P (1 .. max_batch *
  (kmax+1)), so the form is categorical in the step's token count exactly as the single-request
  model is categorical in K: at B = 1, P = K + 1 and the batch model *is* the single model when it
  was built by :meth:`BatchCostModel.from_cost_model`. A step's expert cost depends on its tokens
  and its expert union, not on how the tokens split between requests; each extra request adds
  ``b_req`` (its own sampler/rejection bookkeeping, attention metadata) and its own KV reads
  (``c * L_i``); on an engine whose kernels handle an odd query of more than one token slower than an
  even one, each request verifying an even budget ``k_i >= 2`` (``k_i + 1`` odd) adds ``b_odd_query``
  (:func:`odd_queries`; 0 unless fitted with the ``"parity"`` form, :mod:`specenv.cost.batchfit`);
* **drafting** of the step: ``T_D = d0 + d_step * max_i n_i + d_tok * sum_i n_i`` for the drafted
  token counts n_i (0 when no request drafts). vLLM 0.32's drafter runs ``max_i n_i`` forward steps
  for the whole batch, each over every request (DESIGN.md section 1, drafting modes), so the step
  count term is ``d_step * max`` and the per-token work is ``d_tok * sum``; a vLLM batch in block
  mode drafts the same h for every request, k = 0 ones included;
* **U_batch** from the per-request counts ``U_i = U_{t,k_i}`` that the replay tables hold
  (:meth:`BatchCostModel.predict_u_batch`), by one of :data:`PREDICTORS`:

  - ``"independent"``: per layer, the union of independent uniform draws of ``U_i`` experts out of
    n: ``n * (1 - prod_i (1 - U_i / n))``;
  - ``"shared"``: popular experts are shared more often than independent draws would be, so the
    union is smaller. With the requests sorted so that ``U_1`` is the largest,
    ``1 - U_batch / n = (1 - U_1 / n) * prod_{i > 1} (1 - U_i / n) ** theta``: every further
    request adds experts like an independent draw discounted by the exponent ``0 < theta <= 1``
    (:attr:`BatchCostModel.u_theta`, fitted on the recorded unions by least squares). theta = 1 is
    the independent union, theta -> 0 full overlap (``U_batch = max_i U_i``); the union still
    tends to n as requests are added.

  - ``"pooled"``: the ``"shared"`` form over an effective pool of ``u_pool <= n`` experts instead of n,
    never below ``max_i U_i``: the requests of one workload route to a hot subset of the experts, so
    the union saturates near that subset's size, not n. On ``live-vllm-wide-batch-v6`` (64 experts)
    the fit gives a pool of 33 and theta 0.62: the out-of-sample error of U_batch falls from 14.6%
    (``"shared"``, which underestimates small requests' unions by up to 45% and overestimates large
    ones' at B = 16 by up to 29%) to 5.7%, within about 5% at every batch size and budget.

  All keep ``max_i U_i <= U_batch <= min(n, sum_i U_i)``.

  A caller that knows the exact union (a recording, stored expert ids) passes ``u_batch``.

**Measured choices** (``specenv fit-batch``, :mod:`specenv.cost.batchfit`, on the shipped recording
``live-vllm-batch-v1``: vLLM 0.32 CPU, the small models, B = 1..8, 2162 steps in 64 groups, CPU times
of the forward threads; GroupKFold(5) by group of requests):

* drafting: every recorded step ran exactly n draft forwards for n drafts per request, whatever B
  (``draft_calls == drafted``), so the ``max`` form holds; ``d_step`` = 0.47 ms per forward dominates
  ``d_tok`` = 0.034 ms per drafted token (clustered SEs 0.007 and 0.003);
* U_batch: out-of-sample MAPE of U_batch on steps with B >= 2 is 39% for ``"independent"`` (it
  overestimates by 8.4 experts: popular experts are shared) and 11% for ``"shared"`` (theta = 0.39);
  with the predicted union the step time's OOS MAPE is 7.1% (independent), 5.7% (shared) and 5.8%
  with the recorded (exact) union, so ``"shared"`` is the shipped predictor and stored expert ids
  (an ``"exact"`` predictor) would not pay for a schema change;
* the verification terms: b_pos = 0.040 ms per position (SE 0.002), alpha = 0.028 ms per expert of
  the union (SE 0.005), c = 0.0002 ms per context token (SE 0.00007); the per-request term b_req was
  estimated below 0 (-0.014, SE 0.031) and is fixed at 0.

The plain autoregressive step of the same batch (every k = 0, ``U_i = top_k``, no drafter) is the
reward's unit (:meth:`BatchCostModel.ar_ms`).

Saved and loaded as JSON (``format`` :data:`FORMAT`), validated by :mod:`specenv.validation`
(``BatchCostModelJSON``: finite tables of the right length, every charged time positive over the
whole domain) and written atomically (:mod:`specenv.io`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specenv.cost.model import CostModel
from specenv.io import atomic_write_json
from specenv.traces.schema import ModelFacts

FORMAT = "specenv.batchcost/1"

#: Predictors of U_batch from the per-request unique-expert counts (module docstring).
PREDICTORS: tuple[str, ...] = ("independent", "shared", "pooled")
#: The engines a prefill term is recorded for: with the drafter loaded, and the target alone.
PREFILL_ENGINES: tuple[str, ...] = ("spec", "plain")


def odd_queries(k: Any) -> Any:
    """Requests of a step whose verification query is odd and longer than one token: budgets k >= 2 and even.

    ``k``: budgets, the last axis the step's requests; returns the count over that axis (an int for a 1-D
    ``k``). A request at k verifies ``k + 1`` positions; k = 0 (one query token, a decoding step) is not
    counted. The ``b_odd_query`` term of :class:`BatchCostModel` charges each of them.
    """
    k = np.asarray(k)
    n = np.count_nonzero((k >= 2) & (k % 2 == 0), axis=-1)
    return int(n) if np.ndim(n) == 0 else n


def union_independent(u: np.ndarray, n: float, axis: int = -1) -> np.ndarray:
    """Expected per-layer union of independent uniform draws of ``u[..., i]`` experts out of ``n``.

    ``n * (1 - prod_i (1 - u_i / n))`` along ``axis``; ``u_i`` is clipped to ``[0, n]``.

    Args:
        u: Per-request unique-expert counts (any shape; requests along ``axis``).
        n: Size of the pool (the experts per layer, or an effective pool).
        axis: Axis of the requests.

    Returns:
        The predicted union, ``u`` reduced along ``axis``.
    """
    u = np.clip(np.asarray(u, dtype=np.float64), 0.0, n)
    return n * (1.0 - np.prod(1.0 - u / n, axis=axis))


def plain_union(batch: int | np.ndarray, n: float, top_k: int) -> np.ndarray | float:
    """Expected per-layer union of ``batch`` single tokens, each routed to ``top_k`` of ``n`` experts at random.

    ``n * (1 - (1 - top_k / n) ** B)`` (:func:`union_independent` of B requests of ``top_k`` experts
    each): the experts a plain decode step of B requests touches when routing is independent, ``top_k``
    at B = 1, concave in B. The plain engine's step is fitted on it (``u`` of
    :attr:`BatchCostModel.ar_step`): real routing overlaps more than chance, which the fitted slope
    absorbs; the shape (saturating as B grows) is what a straight line in B misses.
    """
    b = np.asarray(batch, dtype=np.float64)
    out = n * (1.0 - (1.0 - min(float(top_k), n) / n) ** b)
    return float(out) if out.ndim == 0 else out


def union_shared(u: np.ndarray, n: float, theta: float, axis: int = -1) -> np.ndarray:
    """The ``"shared"`` union: ``n * (1 - (1 - U_1/n) * prod_{i>1} (1 - U_i/n) ** theta)``, U_1 the largest.

    ``theta = 1`` is :func:`union_independent`; smaller theta means more overlap. ``u`` is clipped to
    ``[0, n]``; a request of 0 experts (an absent one) adds nothing.
    """
    u = np.moveaxis(np.clip(np.asarray(u, dtype=np.float64), 0.0, n), axis, -1)
    top = u.max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):  # -inf - -inf where the largest covers every expert
        logs = np.log1p(-u / n)  # -inf where a request covers every expert
        rest = np.sum(logs, axis=-1) - np.log1p(-top / n)
    rest = np.where(np.isfinite(rest), rest, 0.0)  # the product of the others; top == n covers all anyway
    return n * (1.0 - (1.0 - top / n) * np.exp(theta * rest))


def union_pooled(u: np.ndarray, pool: float, theta: float, axis: int = -1) -> np.ndarray:
    """The ``"pooled"`` union: :func:`union_shared` over an effective pool of ``pool`` experts, at least ``max_i U_i``.

    Each count is clipped to the pool for the product (a request covering the pool saturates it); the
    result is raised to the largest count, so a request larger than the pool is never priced below
    its own experts.
    """
    u = np.clip(np.asarray(u, dtype=np.float64), 0.0, None)
    return np.maximum(union_shared(np.minimum(u, pool), pool, theta, axis), u.max(axis=axis))


def _as_1d(name: str, value: Any, dtype: Any) -> np.ndarray:
    arr = np.asarray(value, dtype=dtype)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name}: expected a non-empty 1-D array (one entry per request), got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: every entry must be finite")
    return arr


@dataclass(frozen=True, eq=False)
class BatchCostModel:
    """Prices one batched step of B concurrent requests (module docstring for the form).

    Its methods take the requests of one step and return floats of that step; it is not a
    per-request :class:`specenv.cost.model.Charge`.

    Attributes:
        beta0: (max_batch * (kmax+1),) ms per step, index P - 1 (P = verified positions of the step).
        alpha: Same shape: ms per unique expert of the batch union (mean over layers), by P.
        c: Same shape: ms per context token, summed over the requests, by P.
        b_req: ms per request beyond the first.
        d0: Draft ms per step that drafts anything.
        d_step: Draft ms per draft forward step (``max_i n_i`` of them).
        d_tok: Draft ms per drafted token (``sum_i n_i`` of them).
        kmax: Largest per-request budget.
        max_batch: Largest number of requests per step.
        top_k: Experts per token.
        n_experts: Experts per MoE layer.
        n_layers: MoE layers.
        predictor: The U_batch predictor used when ``u_batch`` is not given (:data:`PREDICTORS`).
        u_theta: The exponent theta of the ``"shared"`` and ``"pooled"`` predictors (1.0: no sharing beyond chance).
        u_pool: The effective pool of the ``"pooled"`` predictor, in ``[top_k, n_experts]`` (None: n_experts).
        source: Provenance (recording, fit method, or the B = 1 model and the shape it was scaled by).
        diagnostics: Fit statistics kept with the model.
        overhead: (max_batch,) ms the engine spends per step outside its forwards (scheduler, sampler,
            output processing) at B = 1..max_batch requests, a term of its own in every verification
            (:meth:`verify_from_totals`); zeros for a model of the forwards alone (the default, and every
            model fitted before the step-time form).
        ar_step: ``(a, b_req, c)`` or ``(a, b_req, c, u)``: the plain engine's step (no drafter loaded)
            ``a + b_req * (B-1) + c * sum L + u * (U_ind(B) - top_k)``, ``U_ind(B)`` the expected per-layer
            union of B single tokens routed independently (:func:`plain_union`; 0 at B = 1, so ``a`` is
            the B = 1 step), the 1.0 of every batch speedup (:meth:`ar_ms`); ``u`` is 0 when not given
            (the line of every recording before ``live-vllm-wide-batch-v4``); None: the model's own
            k = 0 step.
        ar_by_batch: (max_batch,) ms added to the plain step's form at B = 1..max_batch: the mean residual
            of the recorded plain steps at each B (measured minus the form; linear between recorded B, the
            nearest at the ends), so the AR reference at a recorded B is the plain engine's measured mean
            step there, as :attr:`overhead` is the engine's measured per-step overhead by B (the form
            alone misses the plain step by up to 19% at B = 1 and 7% at B = 4 on
            ``live-vllm-wide-batch-v6``); None: the form alone (every recording before v6).
        prefill: ``{"spec": (a, b), "plain": (a, b)}``: the prefill phase of a group of requests submitted
            together, ``a + b * (prompt tokens of the group)`` ms until every request has its first token,
            on the engine with the drafter (``"spec"``: the target's and the draft's prefill) and on the
            plain engine (:meth:`prefill_ms`); None: not recorded (predictions price decoding only).
        b_odd_query: ms per request whose verification query is odd and longer than one token (an even
            budget k >= 2, :func:`odd_queries`), >= 0: on ``live-vllm-wide-batch-v6`` (vLLM's CPU kernels)
            such a request costs 1.2 ms more than the position term charges (the ``"parity"`` form of
            :func:`specenv.cost.batchfit.fit_batch_cost`); 0 for every model fitted with the linear form.
    """

    beta0: np.ndarray
    alpha: np.ndarray
    c: np.ndarray
    b_req: float
    d0: float
    d_step: float
    d_tok: float
    kmax: int
    max_batch: int
    top_k: int
    n_experts: int
    n_layers: int
    predictor: str = "independent"
    u_theta: float = 1.0
    source: dict[str, Any] = field(default_factory=dict)
    diagnostics: dict[str, Any] = field(default_factory=dict)
    overhead: np.ndarray | None = None
    ar_step: tuple[float, ...] | None = None
    prefill: dict[str, tuple[float, float]] | None = None
    ar_by_batch: np.ndarray | None = None
    b_odd_query: float = 0.0
    u_pool: float | None = None

    def __post_init__(self) -> None:
        for name in ("kmax", "max_batch", "top_k", "n_experts", "n_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}={v!r}: must be an integer >= 1")
            object.__setattr__(self, name, int(v))
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        n_pos = self.max_batch * (self.kmax + 1)
        for name in ("beta0", "alpha", "c"):
            arr = np.array(getattr(self, name), dtype=np.float64)
            if arr.shape != (n_pos,):
                raise ValueError(f"{name}: expected shape ({n_pos},) = max_batch * (kmax+1), got {arr.shape}")
            if not np.all(np.isfinite(arr)):
                raise ValueError(f"{name}: coefficients must be finite")
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        for name in ("b_req", "d0", "d_step", "d_tok", "u_theta", "b_odd_query"):
            v = float(getattr(self, name))
            if not np.isfinite(v):
                raise ValueError(f"{name}={v!r}: must be finite")
            object.__setattr__(self, name, v)
        if self.b_odd_query < 0:
            raise ValueError(f"b_odd_query={self.b_odd_query!r}: must be >= 0 (a longer query never costs less)")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor={self.predictor!r}: expected one of {PREDICTORS}")
        if not 0.0 < self.u_theta <= 1.0:
            raise ValueError(f"u_theta={self.u_theta!r}: must be in (0, 1]")
        pool = float(self.n_experts if self.u_pool is None else self.u_pool)
        if not (np.isfinite(pool) and self.top_k <= pool <= self.n_experts):
            raise ValueError(
                f"u_pool={self.u_pool!r}: must be in [top_k, n_experts] = [{self.top_k}, {self.n_experts}]"
            )
        object.__setattr__(self, "u_pool", pool)
        over = np.zeros(self.max_batch) if self.overhead is None else np.array(self.overhead, dtype=np.float64)
        if over.shape != (self.max_batch,) or not np.all(np.isfinite(over)) or (over < 0).any():
            raise ValueError(f"overhead: expected {self.max_batch} finite values >= 0 (one per batch size)")
        over.flags.writeable = False
        object.__setattr__(self, "overhead", over)
        if self.ar_step is not None:
            if len(self.ar_step) not in (3, 4):
                raise ValueError(f"ar_step={self.ar_step!r}: expected (a, b_req, c) or (a, b_req, c, u)")
            a, b, c, u = (*(float(x) for x in self.ar_step), 0.0)[:4]
            if not (np.isfinite([a, b, c, u]).all() and a > 0 and b >= 0 and c >= 0 and u >= 0):
                raise ValueError(f"ar_step={self.ar_step!r}: need a > 0 and b_req, c, u >= 0 (finite)")
            object.__setattr__(self, "ar_step", (a, b, c, u))
        if self.ar_by_batch is not None:
            if self.ar_step is None:
                raise ValueError("ar_by_batch: a correction of the plain step's form needs ar_step")
            by = np.array(self.ar_by_batch, dtype=np.float64)
            if by.shape != (self.max_batch,) or not np.all(np.isfinite(by)):
                raise ValueError(f"ar_by_batch: expected {self.max_batch} finite values (one per batch size)")
            form = np.array([self._ar_form(b, 0.0) for b in range(1, self.max_batch + 1)])
            if (form + by <= 0).any():
                b = int(np.flatnonzero(form + by <= 0)[0]) + 1
                step = form[b - 1] + by[b - 1]
                raise ValueError(f"ar_by_batch: the plain step at B={b} would be {step:.3g} ms (<= 0)")
            by.flags.writeable = False
            object.__setattr__(self, "ar_by_batch", by)
        if self.prefill is not None:
            pre = {}
            for engine in PREFILL_ENGINES:
                a, b = (float(x) for x in self.prefill.get(engine, (np.nan, np.nan)))
                if not (np.isfinite([a, b]).all() and a >= 0 and b >= 0):
                    raise ValueError(f"prefill[{engine!r}]: need (a, b), both finite and >= 0")
                pre[engine] = (a, b)
            if set(self.prefill) - set(PREFILL_ENGINES):
                raise ValueError(f"prefill: engines are {PREFILL_ENGINES} (got {sorted(self.prefill)})")
            object.__setattr__(self, "prefill", pre)

    # ------------------------------------------------------------- sizes
    @property
    def max_positions(self) -> int:
        """Largest number of verified positions of a step, ``max_batch * (kmax+1)``."""
        return self.max_batch * (self.kmax + 1)

    def _check_batch(self, k: np.ndarray) -> None:
        if len(k) > self.max_batch:
            raise ValueError(f"batch of {len(k)} requests: the model covers at most max_batch={self.max_batch}")
        if k.min() < 0 or k.max() > self.kmax:
            raise ValueError(f"k: every budget must be in 0..kmax={self.kmax} (got {k.min()}..{k.max()})")

    # ------------------------------------------------------------- U_batch
    def predict_u_batch(self, u: np.ndarray, n_experts: int | None = None) -> float:
        """U_batch of a step from the requests' own unique-expert counts, by :attr:`predictor`.

        Args:
            u: (B,) per-request unique experts (mean over layers), each in ``[0, n]``.
            n_experts: Experts per layer (default the model's).

        Returns:
            The predicted mean-over-layers union, in ``[max(u), min(n, sum(u))]``.
        """
        u = _as_1d("u", u, np.float64)
        return float(self.predict_u_batch_many(u[None, :], n_experts)[0])

    def predict_u_batch_many(self, u: np.ndarray, n_experts: int | None = None) -> np.ndarray:
        """:meth:`predict_u_batch` of many steps at once: ``u`` is (steps, B), NaN marks an absent request."""
        n = float(self.n_experts if n_experts is None else n_experts)
        u = np.asarray(u, dtype=np.float64)
        u = np.where(np.isnan(u), 0.0, np.clip(u, 0.0, n))
        theta = 1.0 if self.predictor == "independent" else self.u_theta
        if self.predictor == "pooled":
            assert self.u_pool is not None  # __post_init__ fills it
            pool = self.u_pool if n_experts is None else self.u_pool * n / self.n_experts
            return union_pooled(u, pool, theta)
        return union_shared(u, n, theta)

    # ------------------------------------------------------------- times
    def verify_from_totals(
        self,
        positions: np.ndarray | int,
        requests: np.ndarray | int,
        u_batch: np.ndarray | float,
        context_sum: np.ndarray | float,
        odd: np.ndarray | int = 0,
    ) -> np.ndarray:
        """Verification time from a step's totals (vectorised; the one formula behind :meth:`verify_ms`).

        Args:
            positions: P, verified positions of the step (1..max_positions).
            requests: B, requests in the step (1..max_batch).
            u_batch: Mean over layers of the per-layer expert union.
            context_sum: Sum of the requests' context lengths.
            odd: Requests verifying an even budget k >= 2 (:func:`odd_queries`); only read when
                :attr:`b_odd_query` is not 0.

        Returns:
            ``beta0[P-1] + alpha[P-1] * u_batch + c[P-1] * context_sum + b_req * (B-1) + overhead[B-1]``
            (``+ b_odd_query * odd`` when that term is fitted) in ms.
        """
        P = np.asarray(positions, dtype=np.int64)
        if P.size and (P.min() < 1 or P.max() > self.max_positions):
            raise ValueError(f"positions must be in 1..{self.max_positions} (max_batch * (kmax+1))")
        i = P - 1
        nreq = np.asarray(requests, dtype=np.int64)
        B = nreq.astype(np.float64)
        assert self.overhead is not None  # __post_init__ fills it
        over = self.overhead[np.clip(nreq, 1, self.max_batch) - 1]
        t = self.beta0[i] + self.alpha[i] * u_batch + self.c[i] * context_sum + self.b_req * (B - 1.0) + over
        if self.b_odd_query:
            t = t + self.b_odd_query * np.asarray(odd, dtype=np.float64)
        return t

    def verify_ms(self, k: np.ndarray, u: np.ndarray, context: np.ndarray, u_batch: float | None = None) -> float:
        """Target verification time of one step.

        Args:
            k: (B,) budgets; request i verifies ``k[i] + 1`` positions.
            u: (B,) the requests' own unique experts ``U_{t,k_i}`` (used to predict U_batch).
            context: (B,) context lengths.
            u_batch: The step's expert union (mean over layers), when known; else predicted from ``u``.

        Returns:
            The time in ms.

        Raises:
            ValueError: Arrays of different lengths, an empty batch, more than ``max_batch`` requests or
                a budget outside 0..kmax.
        """
        k = _as_1d("k", k, np.int64)
        u = _as_1d("u", u, np.float64)
        context = _as_1d("context", context, np.float64)
        if not len(k) == len(u) == len(context):
            raise ValueError(
                f"k, u and context must have one entry per request (got {len(k)}, {len(u)}, {len(context)})"
            )
        self._check_batch(k)
        ub = self.predict_u_batch(u) if u_batch is None else float(u_batch)
        return float(self.verify_from_totals(int(np.sum(k + 1)), len(k), ub, float(np.sum(context)), odd_queries(k)))

    def draft_ms(self, drafted: np.ndarray) -> float:
        """Draft time of one step: ``d0 + d_step * max(drafted) + d_tok * sum(drafted)``, 0 if nothing is drafted.

        Args:
            drafted: (B,) tokens each request's drafter produced this step.
        """
        drafted = _as_1d("drafted", drafted, np.int64)
        if drafted.min() < 0:
            raise ValueError("drafted: token counts must be >= 0")
        top = int(drafted.max())
        if top == 0:
            return 0.0
        return float(self.d0 + self.d_step * top + self.d_tok * int(drafted.sum()))

    def step_ms(
        self,
        k: np.ndarray,
        drafted: np.ndarray,
        u: np.ndarray,
        context: np.ndarray,
        u_batch: float | None = None,
    ) -> float:
        """Draft + verification time of one step (:meth:`draft_ms` + :meth:`verify_ms`)."""
        drafted = _as_1d("drafted", drafted, np.int64)
        if len(drafted) != len(np.atleast_1d(k)):
            raise ValueError(f"drafted: one entry per request (got {len(drafted)} for {len(np.atleast_1d(k))})")
        return self.draft_ms(drafted) + self.verify_ms(k, u, context, u_batch)

    def ar_ms(self, context: np.ndarray) -> float:
        """The plain autoregressive step of the same batch: every k = 0, ``U_i = top_k``, no drafter.

        One float for the whole step of the B requests whose contexts ``context`` holds (a step
        quantity, like :meth:`step_ms`), where :meth:`specenv.cost.model.Charge.ar_ms` gives one AR step
        per context: a batch cost model prices steps, it is not a per-request
        :class:`specenv.cost.model.Charge` (the batch bound's per-request charges are).
        """
        context = _as_1d("context", context, np.float64)
        B = len(context)
        if self.ar_step is not None:  # the plain engine's measured step
            by = 0.0 if self.ar_by_batch is None or B > self.max_batch else float(self.ar_by_batch[B - 1])
            return self._ar_form(B, float(context.sum())) + by
        return self.verify_ms(np.zeros(B, np.int64), np.full(B, float(self.top_k)), context)

    def _ar_form(self, B: int, context_sum: float) -> float:
        """The plain step's fitted form (:attr:`ar_step`) at B requests of ``context_sum`` tokens in all."""
        assert self.ar_step is not None
        a, b, c, u = self.ar_step
        extra = u * (plain_union(B, self.n_experts, self.top_k) - self.top_k) if u else 0.0
        return float(a + b * (B - 1) + c * context_sum + extra)

    def prefill_ms(self, prompt_tokens: float, engine: str) -> float:
        """The prefill phase of a group whose prompts hold ``prompt_tokens`` tokens in all, in ms.

        From the group's submission until every request has its first token, on the engine with the
        drafter (``engine="spec"``) or the plain one (``"plain"``). 0.0 when the model has no prefill
        term (a model of the decoding steps alone).
        """
        if engine not in PREFILL_ENGINES:
            raise ValueError(f"engine={engine!r}: expected one of {PREFILL_ENGINES}")
        if self.prefill is None:
            return 0.0
        a, b = self.prefill[engine]
        return float(a + b * float(prompt_tokens))

    # ------------------------------------------------------------- construction
    @classmethod
    def linear(
        cls,
        *,
        b0: float,
        b_pos: float,
        alpha: float,
        c: float,
        b_req: float,
        d0: float,
        d_step: float,
        d_tok: float,
        kmax: int,
        max_batch: int,
        top_k: int,
        n_experts: int,
        n_layers: int,
        **kwargs: Any,
    ) -> BatchCostModel:
        """The pooled linear form ``b0 + b_pos * P + alpha * U_batch + c * sum L + b_req * (B-1)`` as tables."""
        P = np.arange(1, max_batch * (kmax + 1) + 1, dtype=np.float64)
        return cls(
            beta0=b0 + b_pos * P,
            alpha=np.full(P.shape, alpha),
            c=np.full(P.shape, c),
            b_req=b_req,
            d0=d0,
            d_step=d_step,
            d_tok=d_tok,
            kmax=kmax,
            max_batch=max_batch,
            top_k=top_k,
            n_experts=n_experts,
            n_layers=n_layers,
            **kwargs,
        )

    @classmethod
    def from_cost_model(
        cls,
        cm: CostModel,
        facts: ModelFacts,
        *,
        max_batch: int = 8,
        shape: BatchShape | None = None,
        context_ref: float = 512.0,
    ) -> BatchCostModel:
        """The scaled batch model of a trace set that has no batch timings (e.g. ``paper-default``).

        How it is derived (DESIGN.md section 6, "batch cost model"):

        * steps of ``P <= kmax+1`` positions take the B = 1 model's per-K coefficients of ``K = P-1``
          unchanged: ``beta0[P-1] = cm.beta0[P-1]``, ``alpha[P-1] = cm.alpha[P-1]``, ``c[P-1] =
          cm.c[P-1]``. At B = 1 the batch model is therefore exactly the single-request model
          (``verify_ms([k], [U], [L]) == cm.target_ms(k, U, L)``); a batch of several requests with P
          positions pays what one request verifying P positions with the same expert union pays,
          plus ``b_req`` per extra request and each request's own KV reads (``c * L_i``);
        * longer steps (``P > kmax+1``, which no single request reaches) keep alpha and c of K =
          kmax, and beta0 grows linearly from ``cm.beta0[kmax]`` by ``shape.pos_rel * AR`` per
          position, where ``AR = cm.ar_ms(context_ref)`` is the set's own AR step;
        * ``b_req = shape.req_rel * AR``;
        * the draft: ``d0 = cm.d0`` and ``cm.d1`` split into ``d_step = (1 - shape.tok_share) * d1``
          per draft forward step and ``d_tok = shape.tok_share * d1`` per drafted token, so a single
          request drafting n tokens pays ``cm.draft_ms(n)``. ``cm.d_floor`` (the draft forward a vLLM
          round pays at k = 0) is not carried: the batch form charges the drafted tokens it is given,
          so a vLLM batch in block mode passes ``drafted = h`` for every request, k = 0 ones included;
        * the U_batch predictor and its exponent ``u_theta`` are the measured ones (theta discounts
          each further request's draw relative to independence: dimensionless, it carries over to a
          model with another number of experts).

        ``shape``'s dimensionless factors are measured on vLLM batch recordings
        (:meth:`BatchShape.of_model`): the vLLM fit's marginal costs divided by the vLLM model's own AR
        step. The assumption: the per-position and per-request overheads of a batch are the same
        fraction of an AR step on the set's hardware as on the hardware measured.

        Args:
            cm: The set's single-request cost model (``specenv.cost.source.cost_model_for``).
            facts: The set's model facts (experts per layer, layers, top_k).
            max_batch: Largest batch to price.
            shape: The batch-shape factors (default :func:`default_shape`, measured on the shipped
                vLLM batch recording).
            context_ref: Context length at which the AR step scales the shape factors.

        Returns:
            The scaled model (``source["kind"] == "scaled"``).
        """
        shape = default_shape() if shape is None else shape
        kmax = cm.kmax
        n_pos = max_batch * (kmax + 1)
        ar = float(cm.ar_ms(context_ref))
        extra = np.arange(1, n_pos - kmax, dtype=np.float64)  # P - (kmax+1) for P = kmax+2 .. n_pos
        beta0 = np.concatenate([cm.beta0, cm.beta0[kmax] + shape.pos_rel * ar * extra])
        alpha = np.concatenate([cm.alpha, np.full(extra.shape, cm.alpha[kmax])])
        c = np.concatenate([cm.c, np.full(extra.shape, cm.c[kmax])])
        return cls(
            beta0=beta0,
            alpha=alpha,
            c=c,
            b_req=shape.req_rel * ar,
            d0=cm.d0,
            d_step=(1.0 - shape.tok_share) * cm.d1,
            d_tok=shape.tok_share * cm.d1,
            kmax=kmax,
            max_batch=max_batch,
            top_k=facts.top_k,
            n_experts=facts.n_experts,
            n_layers=facts.n_layers,
            predictor=shape.predictor,
            u_theta=shape.u_theta,
            u_pool=max(float(facts.top_k), min(1.0, shape.u_pool_share) * facts.n_experts),
            source={
                "kind": "scaled",
                "cost_model": dict(cm.source),
                "shape": dataclasses.asdict(shape),
                "context_ref": float(context_ref),
                "ar_ms": ar,
            },
        )

    def replace(self, **changes: Any) -> BatchCostModel:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (floats written by ``repr``: exact round trip)."""
        return {
            "format": FORMAT,
            "kmax": self.kmax,
            "max_batch": self.max_batch,
            "model": {"n_layers": self.n_layers, "n_experts": self.n_experts, "top_k": self.top_k},
            "verify": {
                "beta0": [float(x) for x in self.beta0],
                "alpha": [float(x) for x in self.alpha],
                "c": [float(x) for x in self.c],
                "b_req": self.b_req,
                **({"b_odd_query": self.b_odd_query} if self.b_odd_query else {}),
            },
            "draft": {"d0": self.d0, "d_step": self.d_step, "d_tok": self.d_tok},
            "u_batch": {"predictor": self.predictor, "u_theta": self.u_theta}
            | ({"u_pool": self.u_pool} if self.predictor == "pooled" else {}),
            **(
                {"overhead": [float(x) for x in self.overhead]}
                if self.overhead is not None and self.overhead.any()
                else {}
            ),
            **(
                {
                    "ar_step": dict(zip(("a_ms", "b_req_ms", "c_ms_per_token"), self.ar_step[:3], strict=True))
                    | ({"u_ms_per_expert": self.ar_step[3]} if self.ar_step[3] else {})
                    | ({"by_batch_ms": [float(x) for x in self.ar_by_batch]} if self.ar_by_batch is not None else {})
                }
                if self.ar_step is not None
                else {}
            ),
            **(
                {"prefill": {e: {"a_ms": a, "b_ms_per_token": b} for e, (a, b) in self.prefill.items()}}
                if self.prefill is not None
                else {}
            ),
            "source": self.source,
            "diagnostics": self.diagnostics,
        }

    @classmethod
    def from_json(cls, obj: Any, file: str = "batch cost model") -> BatchCostModel:
        """Parse the JSON form, checked by :mod:`specenv.validation` (``BatchCostModelJSON``).

        Raises:
            ValueError: One line naming the file and the bad field.
        """
        from specenv.validation import check

        m = check("BatchCostModelJSON", obj, file, formats=(FORMAT,), what="specenv batch cost model")
        try:
            return cls._from_checked(m)
        except ValueError as exc:  # a field-wise valid file whose parts disagree (shapes, a step <= 0)
            raise ValueError(f"{file}: {exc}") from None

    @classmethod
    def _from_checked(cls, m: Any) -> BatchCostModel:
        return cls(
            beta0=np.array(m.verify.beta0, dtype=np.float64),
            alpha=np.array(m.verify.alpha, dtype=np.float64),
            c=np.array(m.verify.c, dtype=np.float64),
            b_req=m.verify.b_req,
            b_odd_query=m.verify.b_odd_query,
            d0=m.draft.d0,
            d_step=m.draft.d_step,
            d_tok=m.draft.d_tok,
            kmax=m.kmax,
            max_batch=m.max_batch,
            top_k=m.model.top_k,
            n_experts=m.model.n_experts,
            n_layers=m.model.n_layers,
            predictor=m.u_batch.predictor,
            u_theta=m.u_batch.u_theta,
            u_pool=m.u_batch.u_pool,
            source=dict(m.source),
            diagnostics=dict(m.diagnostics),
            overhead=None if m.overhead is None else np.array(m.overhead, dtype=np.float64),
            ar_step=None
            if m.ar_step is None
            else (m.ar_step.a_ms, m.ar_step.b_req_ms, m.ar_step.c_ms_per_token, m.ar_step.u_ms_per_expert),
            prefill=None if m.prefill is None else {e: (p.a_ms, p.b_ms_per_token) for e, p in m.prefill.items()},
            ar_by_batch=None
            if m.ar_step is None or m.ar_step.by_batch_ms is None
            else np.array(m.ar_step.by_batch_ms, dtype=np.float64),
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON form atomically."""
        path = Path(path)
        atomic_write_json(path, self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BatchCostModel:
        """Read the JSON form written by :meth:`save`; every problem is one line naming the file."""
        from specenv.validation import read_json

        path = Path(path)
        return cls.from_json(read_json(path, what="batch cost model"), str(path))


@dataclass(frozen=True)
class BatchShape:
    """Dimensionless batch-shape factors, measured on vLLM, that scale a B = 1 model to batches.

    Attributes:
        pos_rel: ms per verified position beyond one request's ``kmax+1``, in AR steps.
        req_rel: ms per request beyond the first, in AR steps.
        tok_share: Share of the per-token draft cost that is per drafted token (the rest is per draft
            forward step of the batch): ``d_tok / (d_step + d_tok)``.
        predictor: The U_batch predictor (:data:`PREDICTORS`).
        u_theta: The exponent theta of the ``"shared"`` predictor.
        source: Where the factors were measured.
        u_pool_share: The ``"pooled"`` predictor's effective pool as a share of the experts per layer.
    """

    pos_rel: float
    req_rel: float
    tok_share: float
    predictor: str = "independent"
    u_theta: float = 1.0
    source: str = ""
    u_pool_share: float = 1.0

    @classmethod
    def of_model(cls, model: BatchCostModel, context_ref: float | None = None) -> BatchShape:
        """The factors of a measured batch model, in units of its own AR step at ``context_ref``.

        ``pos_rel`` is the mean slope of ``beta0`` over P beyond ``kmax+1`` (over all P for a model
        without such steps), ``req_rel = b_req / AR``, ``tok_share = d_tok / (d_step + d_tok)``
        (clipped to [0, 1]). ``context_ref`` defaults to the model's recorded mean context
        (``diagnostics["context_mean"]``), else 512.
        """
        if context_ref is None:
            context_ref = float(model.diagnostics.get("context_mean", 512.0))
        ar = model.ar_ms(np.array([context_ref]))
        lo = model.kmax if model.max_positions > model.kmax + 1 else 0
        slope = (model.beta0[-1] - model.beta0[lo]) / max(1, model.max_positions - 1 - lo)
        per_tok = model.d_step + model.d_tok
        share = float(np.clip(model.d_tok / per_tok, 0.0, 1.0)) if per_tok > 0 else 0.5
        return cls(
            pos_rel=float(slope / ar),
            req_rel=float(model.b_req / ar),
            tok_share=share,
            predictor=model.predictor,
            u_theta=model.u_theta,
            source=str(model.source.get("recording", model.source.get("kind", ""))),
            u_pool_share=float(model.u_pool or model.n_experts) / model.n_experts,
        )


#: The shipped vLLM batch recording whose fit prices batches by default (package data).
SHIPPED = "live-vllm-batch-v1"
#: File name of the fitted model inside a steps recording.
MODEL_FILE = "batchcost.json"


def load_batch_cost_model(name_or_path: str | os.PathLike[str] = SHIPPED) -> BatchCostModel:
    """A batch cost model by name or path.

    Args:
        name_or_path: A batch-cost JSON file, a steps recording folder (its ``batchcost.json``), or the
            name of a shipped recording (``live-vllm-batch-v1``, the default: fitted on vLLM CPU steps
            of the shipped small models, B = 1..8).

    Raises:
        ValueError: One line naming the file (missing, not a batch cost model, bad field).
    """
    from specenv.io import package_data

    path = Path(name_or_path)
    if not path.exists() and "/" not in str(name_or_path) and os.sep not in str(name_or_path):
        try:
            path = package_data(str(name_or_path))
        except (FileNotFoundError, OSError):
            pass
        if not path.exists():  # name what was given, not a path inside the package
            root = package_data(SHIPPED).parent
            shipped = sorted(p.parent.name for p in root.glob(f"*/{MODEL_FILE}")) if root.is_dir() else [SHIPPED]
            raise ValueError(f"{name_or_path}: no such file or folder, nor a shipped recording ({', '.join(shipped)})")
    if path.is_dir():
        path = path / MODEL_FILE
    return BatchCostModel.load(path)


def ablate_batch(model: BatchCostModel, term: str) -> BatchCostModel:
    """The batch step model without one term, for the sim-to-real ablations (``specenv abtest``).

    ``"U_r"``: no expert-union term; every step size's intercept absorbs ``alpha * U`` at the mean
    union of the recording (``diagnostics.summary.U_batch_mean``; the midpoint of ``[top_k, n]`` for a
    model without it), so a step of average union costs the same and the union no longer matters.
    ``"overhead"``: no per-step engine overhead. The AR reference (the plain engine's step) is kept.

    Raises:
        ValueError: An unknown term.
    """
    if term == "overhead":
        return model.replace(overhead=np.zeros(model.max_batch))
    if term == "U_r":
        u_mean = model.diagnostics.get("summary", {}).get("U_batch_mean")
        u = float(u_mean) if u_mean is not None else 0.5 * (model.top_k + model.n_experts)
        return model.replace(beta0=model.beta0 + model.alpha * u, alpha=np.zeros_like(model.alpha))
    raise ValueError(f"term={term!r}: expected 'U_r' or 'overhead'")


_SHAPE: list[BatchShape] = []


def default_shape() -> BatchShape:
    """The batch-shape factors of the shipped vLLM batch fit (:data:`SHIPPED`), at its mean context."""
    if not _SHAPE:
        _SHAPE.append(BatchShape.of_model(load_batch_cost_model(SHIPPED)))
    return _SHAPE[0]
