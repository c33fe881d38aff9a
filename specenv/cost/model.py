"""The round cost model C(t, k) = T_D(k) + T_T(k), categorical in the budget K.

``T_T(K) = beta0(K) + alpha(K) * U + c(K) * L`` per K (the paper's "U_r x C(K) + L" form), and
``T_D(K) = d1*K + d0`` for K >= 1, ``T_D(0) = 0``. K = 0 is plain autoregressive decoding (m = 1,
U = top_k). Coefficients come from :func:`specenv.cost.fit.fit_cost_model` on a rounds table, or from the
paper profile (:meth:`CostModel.paper_profile`). Saved and loaded as JSON.

**The charged cost of a round** is owned here: :meth:`CostModel.charged_ms` (one round) and
:meth:`CostModel.charged_table` (every position and budget) compute ``T_T(k, U, L) + T_D(drafted)``
with the number of drafted tokens given by the drafting mode (:data:`DRAFTING_MODES`):

* ``"none"``: k is chosen before drafting, the round drafts (and pays for) k tokens;
* ``"block"``: the drafter proposes h tokens at once (the lookahead), the controller trims to
  ``k <= h`` after seeing their confidences; the round pays ``T_D(max(k, h))``, also at k = 0;
* ``"sequential"``: the drafter produces one token at a time and the controller stops after any of
  them, verifying every token drafted; the round pays ``T_D(tokens drafted) = T_D(k)``.

:func:`check_drafting` validates a (mode, lookahead) pair, :func:`drafted_tokens` gives the drafted
tokens of a budget in each mode.

Environments, the oracle and the benchmark all charge rounds through these two methods.

:class:`Charge` is the protocol of what prices one request's rounds for the single-request oracle
(:mod:`oracle.dp`): :class:`CostModel` implements it, and so do the batch bound's per-request charges
(:class:`oracle.batch.FairShare`, :class:`oracle.batch.SplitCharge`). The batch cost model
(:class:`specenv.cost.batch.BatchCostModel`) prices a whole step and is not a :class:`Charge`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from specenv.io import atomic_write_json
from specenv.traces import paper

FORMAT = "specenv.costmodel/1"

#: How the draft cost of a round is charged (see the module docstring).
DRAFTING_MODES: tuple[str, ...] = ("none", "block", "sequential")
NONE, BLOCK, SEQUENTIAL = DRAFTING_MODES


def drafting_mode(lookahead: int) -> str:
    """The drafting mode of a replay with this lookahead when none is named: ``"block"`` for h > 0, else ``"none"``."""
    return BLOCK if lookahead > 0 else NONE


def check_drafting(drafting: str | None, lookahead: int | None, kmax: int) -> tuple[str, int]:
    """The drafting mode and the number h of confidences shown, checked against ``kmax``.

    ``drafting=None`` keeps the meaning the lookahead always had: ``"block"`` for h > 0, ``"none"``
    for h = 0 (or None). A named mode takes its own default h: 0 for ``"none"`` (k is chosen before
    drafting: no confidence can be shown), ``kmax`` for ``"block"`` (the drafter proposes kmax tokens,
    as vLLM's ``num_speculative_tokens``) and ``"sequential"`` (the confidences of every draft the
    controller may reach).

    Args:
        drafting: ``"none"``, ``"block"``, ``"sequential"`` or None.
        lookahead: Confidences shown, h (None: the mode's default).
        kmax: Largest budget.

    Returns:
        ``(mode, h)``.

    Raises:
        ValueError: Naming ``drafting`` or ``lookahead`` when one is invalid (h outside 0..kmax, a
            lookahead with ``"none"``, h = 0 with ``"block"`` or ``"sequential"``).
    """
    if drafting is not None and drafting not in DRAFTING_MODES:
        raise ValueError(f"drafting={drafting!r}: expected one of {DRAFTING_MODES}")
    if lookahead is not None and (isinstance(lookahead, bool) or not isinstance(lookahead, (int, np.integer))):
        raise ValueError(f"lookahead={lookahead!r}: must be an integer")
    if drafting is None:
        h = 0 if lookahead is None else int(lookahead)
        drafting = drafting_mode(h)
    elif lookahead is None:
        h = 0 if drafting == NONE else int(kmax)
    else:
        h = int(lookahead)
    if not 0 <= h <= kmax:
        raise ValueError(f"lookahead={h}: must be in 0..kmax={kmax}")
    if drafting == NONE and h:
        raise ValueError(
            f"lookahead={h}: drafting='none' chooses k before drafting and shows no confidence "
            "(use drafting='block' or 'sequential')"
        )
    if drafting != NONE and not h:
        raise ValueError(f"lookahead=0: drafting={drafting!r} shows the confidences of 1..kmax={kmax} drafts")
    return drafting, h


def charged_lookahead(lookahead: int, drafting: str | None = None) -> int:
    """The h of the charge ``T_D(max(k, h))`` of a round: h in mode ``"block"``, else 0.

    In mode ``"none"`` the round drafts k tokens; in mode ``"sequential"`` it drafts the k tokens it
    verifies (the controller stops after the draft whose confidence ended the round, and that draft is
    verified: DESIGN.md section 1, drafting modes), so both pay ``T_D(k)``.
    ``drafting=None`` reads the lookahead as before (block for h > 0).
    """
    if lookahead < 0:
        raise ValueError(f"lookahead={lookahead}: must be >= 0")
    mode = drafting_mode(lookahead) if drafting is None else drafting
    if mode not in DRAFTING_MODES:
        raise ValueError(f"drafting={mode!r}: expected one of {DRAFTING_MODES}")
    return lookahead if mode == BLOCK else 0


def drafted_tokens(k: np.ndarray | int, lookahead: int = 0, drafting: str | None = None) -> np.ndarray:
    """Tokens drafted by a round with budget ``k``.

    ``max(k, h)`` in mode ``"block"`` (the default for h > 0), ``k`` in modes ``"none"`` and
    ``"sequential"`` (:func:`charged_lookahead`).
    """
    return np.maximum(np.asarray(k, dtype=np.int64), charged_lookahead(lookahead, drafting))


@runtime_checkable
class Charge(Protocol):
    """What prices the rounds of one request, position by position and budget by budget.

    The arguments and the shapes are :class:`CostModel`'s (its methods of these names say what they
    mean); an implementation may ignore ``lookahead`` and ``drafting`` when its charge does not depend
    on the drafting mode (it says so).
    """

    @property
    def kmax(self) -> int:
        """Largest budget covered."""
        ...

    def charged_by_budget(
        self,
        U: np.ndarray,
        L: np.ndarray,
        lookahead: int = 0,
        out: np.ndarray | None = None,
        drafting: str | None = None,
    ) -> np.ndarray:
        """(kmax+1, n) charges in ms, row k = budget k, from (kmax+1, n) unique experts and (n,) contexts."""
        ...

    def charged_table(
        self,
        U: np.ndarray,
        L: np.ndarray,
        kmax: int | None = None,
        lookahead: int = 0,
        drafting: str | None = None,
    ) -> np.ndarray:
        """(n, kmax+1) C-contiguous charges in ms, from (n, >=kmax+1) unique experts and (n,) contexts.

        The default (inherited by a class that subclasses :class:`Charge`): the transpose of
        :meth:`charged_by_budget` on the first kmax+1 columns of ``U``, for a charge that does not depend
        on the drafting mode (``lookahead`` and ``drafting`` are ignored).
        """
        K = U.shape[1] - 1 if kmax is None else int(kmax)
        return np.ascontiguousarray(self.charged_by_budget(np.array(U[:, : K + 1].T, dtype=np.float64), L).T)

    def ar_ms(self, L: np.ndarray) -> np.ndarray:
        """The charge of a plain autoregressive step at each context of ``L`` (an array shaped like ``L``)."""
        ...


@dataclass(frozen=True, slots=True)
class RoundPricer:
    """One round's charge in AR steps, :meth:`CostModel.round_units` in Python floats (:meth:`CostModel.pricer`)."""

    beta0: tuple[float, ...]
    alpha: tuple[float, ...]
    c: tuple[float, ...]
    d1: float
    d0: float
    d_floor: float
    overhead: tuple[float, ...] | None
    ar_step: tuple[float, float] | None
    top_k: float

    def __call__(self, k: int, U: float, L: float, drafted: int) -> float:
        """``charged_ms(k, U, L, drafted) / ar_ms(L)`` for ``k`` in 0..kmax and ``drafted >= 0`` (not checked)."""
        t = self.beta0[k] + self.alpha[k] * U + self.c[k] * L
        cost = t + (self.d1 * drafted + self.d0 if drafted > 0 else self.d_floor)
        if self.overhead is not None:
            cost = cost + self.overhead[k]
        if self.ar_step is not None:
            a, c = self.ar_step
            ar = a + c * float(L)
        else:
            ar = self.beta0[0] + self.alpha[0] * self.top_k + self.c[0] * L
        return float(cost / ar)


@dataclass
class CostModel:
    """Per-K linear target-time model plus a linear draft-time model.

    Attributes:
        beta0: (Kmax+1,) intercepts in ms, index K.
        alpha: (Kmax+1,) ms per unique expert, index K.
        c: (Kmax+1,) ms per context token, index K.
        d1: Draft ms per drafted token.
        d0: Draft ms fixed cost of a round with K >= 1.
        d_floor: Draft ms a K = 0 round pays in an engine that keeps its draft in step at every
            decoding step (vLLM 0.32 runs one draft forward for each request even at k = 0, to keep
            the draft's KV cache in sync): measured on the K = 0 rounds of a recording, 0 where the
            engine drafts nothing at k = 0 (the transformers engine, the paper profile). Plain
            decoding without speculation, the speedup reference (:meth:`ar_ms`), never pays it.
        overhead: (Kmax+1,) ms per step at budget K that the engine spends outside the timed target
            and draft forwards (scheduling, sampling, output processing): a term of its own in the
            step-time model of an engine that times whole steps (:mod:`specenv.cost.steptime`); zeros
            for a model of the forwards alone.
        ar_step: ``(a, c)``: one step of a *plain* engine (no drafter loaded) costs ``a + c * L`` ms,
            measured; the speedup reference :meth:`ar_ms` when set (None: the model's own K = 0 step).
        top_k: Experts per token (U of a single position).
        n_experts: Experts per MoE layer of the model it was fitted for (None: not recorded).
        n_layers: MoE layers of that model (None: not recorded).
        ar_extrapolated: True when the K = 0 coefficients were not fitted on K = 0 rounds.
        source: Provenance (trace set name, fit method...).
        diagnostics: Fit statistics kept with the model (per-K SEs, R2, OOS errors...).
    """

    beta0: np.ndarray
    alpha: np.ndarray
    c: np.ndarray
    d1: float
    d0: float
    top_k: int
    ar_extrapolated: bool = False
    source: dict[str, Any] = field(default_factory=dict)
    diagnostics: dict[str, Any] = field(default_factory=dict)
    n_experts: int | None = None
    n_layers: int | None = None
    d_floor: float = 0.0
    overhead: np.ndarray | None = None
    ar_step: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        self.beta0 = np.asarray(self.beta0, dtype=np.float64)
        self.alpha = np.asarray(self.alpha, dtype=np.float64)
        self.c = np.asarray(self.c, dtype=np.float64)
        if not (self.beta0.shape == self.alpha.shape == self.c.shape) or self.beta0.ndim != 1:
            raise ValueError("beta0, alpha and c must be 1-D arrays of the same length (Kmax+1)")
        if not np.all(np.isfinite(np.concatenate([self.beta0, self.alpha, self.c]))):
            raise ValueError("cost model coefficients must be finite")
        self.overhead = (
            np.zeros_like(self.beta0) if self.overhead is None else np.asarray(self.overhead, dtype=np.float64)
        )
        if (
            self.overhead.shape != self.beta0.shape
            or not np.all(np.isfinite(self.overhead))
            or np.any(self.overhead < 0)
        ):
            raise ValueError("overhead must be finite ms >= 0, one per budget K = 0..Kmax")
        if self.ar_step is not None:
            a, c = (float(x) for x in self.ar_step)
            if not (np.isfinite(a) and np.isfinite(c) and a > 0 and a + min(c, 0.0) * 2**20 > 0):
                raise ValueError(f"ar_step={self.ar_step!r}: a plain step a + c*L must be finite and positive")
            self.ar_step = (a, c)
        self.d_floor = float(self.d_floor)
        if not (np.isfinite(self.d_floor) and self.d_floor >= 0):
            raise ValueError(f"d_floor={self.d_floor!r}: must be a finite number >= 0")

    @property
    def kmax(self) -> int:
        """Largest budget the model covers."""
        return len(self.beta0) - 1

    # ------------------------------------------------------------- prediction
    def target_ms(self, K: np.ndarray | int, U: np.ndarray | float, L: np.ndarray | float) -> np.ndarray:
        """Predicted target (verification) time T_T in ms; broadcasts over arrays."""
        K = np.asarray(K, dtype=np.int64)
        return self.beta0[K] + self.alpha[K] * U + self.c[K] * L

    def draft_ms(self, K: np.ndarray | int) -> np.ndarray:
        """Predicted draft time T_D in ms (``d_floor`` for K = 0: 0 unless the engine drafts at k = 0)."""
        K = np.asarray(K, dtype=np.float64)
        return np.where(K > 0, self.d1 * K + self.d0, self.d_floor)

    def round_ms(self, K: np.ndarray | int, U: np.ndarray | float, L: np.ndarray | float) -> np.ndarray:
        """Cost of one round that drafts K tokens (mode ``"none"``), C = T_D(K) + T_T(K, U, L), in ms.

        The same as :meth:`charged_ms` with ``drafted=K``.
        """
        return self.charged_ms(K, U, L)

    def charged_ms(
        self, k: np.ndarray | int, U: np.ndarray | float, L: np.ndarray | float, drafted: np.ndarray | int | None = None
    ) -> np.ndarray:
        """Charged cost of a round with budget ``k``: ``T_T(k, U, L) + T_D(drafted)`` in ms.

        Args:
            k: Budget (verified drafts).
            U: Unique experts of the round.
            L: Context length.
            drafted: Tokens the drafter produced (default ``k``: modes ``"none"`` and ``"sequential"``);
                ``max(k, h)`` in mode ``"block"`` (:func:`drafted_tokens`).

        Returns:
            The cost (broadcast over array arguments).
        """
        cost = self.target_ms(k, U, L) + self.draft_ms(k if drafted is None else drafted)
        if self.overhead.any():  # (the sum without it is bit-identical to a model without the term)
            cost = cost + self.overhead[np.asarray(k, dtype=np.int64)]
        return cost

    def charged_table(
        self,
        U: np.ndarray,
        L: np.ndarray,
        kmax: int | None = None,
        lookahead: int = 0,
        drafting: str | None = None,
    ) -> np.ndarray:
        """Charged cost C(t, k) = T_T(k, U_{t,k}, L_t) + T_D(drafted) for every row and k = 0..kmax.

        The drafted tokens follow :func:`drafted_tokens`: with ``drafting=None``, ``lookahead = h = 0``
        is drafting mode ``"none"`` (the round drafts k tokens) and ``h > 0`` mode ``"block"`` (every
        round drafts max(k, h) tokens, also at k = 0); ``drafting="sequential"`` drafts k tokens
        whatever h. Computed by :meth:`charged_by_budget`, with the arithmetic of :meth:`charged_ms`
        (bit-identical).

        Args:
            U: (n, >=kmax+1) unique experts per chain prefix.
            L: (n,) context lengths.
            kmax: Budgets to cover (default: U's width - 1).
            lookahead: Draft confidences h shown (in mode ``"block"``: tokens every round drafts at least).
            drafting: The drafting mode (None: ``"block"`` for h > 0, else ``"none"``).

        Returns:
            (n, kmax+1) C-contiguous float64 costs in ms.

        Raises:
            ValueError: If ``kmax`` exceeds the model's Kmax or ``lookahead < 0``.
        """
        kmax = U.shape[1] - 1 if kmax is None else kmax
        by_budget = np.array(U[:, : kmax + 1].T, dtype=np.float64, order="C")  # always a copy
        return np.ascontiguousarray(self.charged_by_budget(by_budget, L, lookahead, out=by_budget, drafting=drafting).T)

    def charged_by_budget(
        self,
        U: np.ndarray,
        L: np.ndarray,
        lookahead: int = 0,
        out: np.ndarray | None = None,
        drafting: str | None = None,
    ) -> np.ndarray:
        """:meth:`charged_table` in budget-major layout: row k holds C(., k) for every position.

        The one implementation of the charged table (the oracle calls it on its step-ordered tables).
        Per element: ``((beta0[k] + alpha[k] * U) + c[k] * L) + T_D(drafted(k))``, as in :meth:`charged_ms`.

        Args:
            U: (kmax+1, n) unique experts, row k = budget k.
            L: (n,) context lengths.
            lookahead: Draft confidences h shown (in mode ``"block"``: tokens every round drafts at least).
            out: Where to write (may be ``U`` itself, for in-place use); default a new array.
            drafting: The drafting mode (None: ``"block"`` for h > 0, else ``"none"``).

        Returns:
            (kmax+1, n) float64 costs in ms.

        Raises:
            ValueError: If ``kmax`` exceeds the model's Kmax or ``lookahead < 0``.
        """
        kmax = U.shape[0] - 1
        if kmax > self.kmax:
            raise ValueError(f"kmax={kmax} exceeds the cost model's Kmax={self.kmax}")
        ks = np.arange(kmax + 1)
        draft = self.draft_ms(drafted_tokens(ks, lookahead, drafting))
        out = np.multiply(U, self.alpha[ks, None], out=out)
        out += self.beta0[ks, None]
        extra = self.overhead.any()
        for k in range(kmax + 1):
            out[k] += self.c[k] * L
            out[k] += draft[k]
            if extra:
                out[k] += self.overhead[k]
        return out

    def ar_ms(self, L: np.ndarray | float) -> np.ndarray:
        """Cost of one step of plain autoregressive decoding (K = 0, U = top_k, no draft) at context L.

        The speedup reference. A k = 0 round of a speculating engine may pay ``d_floor`` (and its
        ``overhead[0]``) on top (:meth:`charged_ms`). With a measured plain engine (``ar_step``) it is
        that engine's step, ``a + c * L``.
        """
        return self.ar_table(float(self.top_k), L)

    def ar_table(self, U0: np.ndarray | float, L: np.ndarray | float) -> np.ndarray:
        """The AR reference per position: ``ar_step``'s ``a + c * L`` when measured, else T_T(0, U0, L)."""
        if self.ar_step is not None:
            a, c = self.ar_step
            return a + c * np.asarray(L, dtype=np.float64)
        return self.target_ms(0, U0, L)

    def round_units(self, k: int, U: float, L: float, drafted: int) -> float:
        """One round's charge in AR steps at its context: ``charged_ms(k, U, L, drafted) / ar_ms(L)``, scalars.

        The same IEEE operations in the same order as the array methods (bit-identical), without their
        per-call array conversions: the vLLM controller prices every round of every step with it.
        ``k`` in 0..kmax and ``drafted >= 0`` are the caller's to check.
        """
        t = self.beta0[k] + self.alpha[k] * U + self.c[k] * L
        cost = t + (self.d1 * drafted + self.d0 if drafted > 0 else self.d_floor)
        if self.overhead.any():
            cost = cost + self.overhead[k]
        if self.ar_step is not None:
            a, c = self.ar_step
            ar = a + c * float(L)
        else:
            ar = self.beta0[0] + self.alpha[0] * float(self.top_k) + self.c[0] * L
        return float(cost / ar)

    def pricer(self) -> RoundPricer:
        """:meth:`round_units` as a snapshot of the coefficients in Python floats (the per-step hot path).

        The same IEEE operations in the same order (bit-identical to :meth:`round_units` and so to the
        array charge), without a numpy scalar or reduction per call: the vLLM controller prices every
        round of every step with it. A snapshot: a later change of the model's arrays does not reach it.
        """
        return RoundPricer(
            tuple(self.beta0.tolist()),
            tuple(self.alpha.tolist()),
            tuple(self.c.tolist()),
            float(self.d1),
            float(self.d0),
            float(self.d_floor),
            tuple(self.overhead.tolist()) if self.overhead.any() else None,
            self.ar_step,
            float(self.top_k),
        )

    @property
    def plain_is_k0(self) -> bool:
        """Whether the model's k = 0 round costs exactly the AR reference (no floor, overhead or plain engine)."""
        return self.d_floor == 0 and self.ar_step is None and not self.overhead.any()

    # ------------------------------------------------------------- construction
    @classmethod
    def paper_profile(cls, kmax: int = 10) -> CostModel:
        """The paper's coefficients (Table A4, gaps filled by :func:`specenv.traces.paper.profile_coefficients`)."""
        coef = paper.profile_coefficients(kmax)
        ks = range(kmax + 1)
        return cls(
            beta0=np.array([coef[k][0] for k in ks]),
            alpha=np.array([coef[k][1] for k in ks]),
            c=np.array([coef[k][2] for k in ks]),
            d1=paper.DRAFT_D1,
            d0=paper.DRAFT_D0,
            top_k=paper.TOP_K,
            n_experts=paper.N_EXPERTS,
            n_layers=paper.N_LAYERS,
            ar_extrapolated=True,
            source={"kind": "paper-profile", "table": "A4", "gaps": "specenv.traces.paper.profile_coefficients"},
        )

    # ------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (``n_experts``/``n_layers`` only when known)."""
        facts = {k: int(v) for k, v in (("n_experts", self.n_experts), ("n_layers", self.n_layers)) if v is not None}
        return {
            "format": FORMAT,
            "kmax": self.kmax,
            "top_k": self.top_k,
            **facts,
            "target": {
                str(k): {"beta0": float(self.beta0[k]), "alpha": float(self.alpha[k]), "c": float(self.c[k])}
                | ({"overhead": float(self.overhead[k])} if self.overhead.any() else {})
                for k in range(self.kmax + 1)
            },
            "draft": {"d1": float(self.d1), "d0": float(self.d0)} | ({"floor": self.d_floor} if self.d_floor else {}),
            "ar_extrapolated": bool(self.ar_extrapolated),
            **({"ar_step": {"a": self.ar_step[0], "c": self.ar_step[1]}} if self.ar_step is not None else {}),
            "source": self.source,
            "diagnostics": self.diagnostics,
        }

    @classmethod
    def from_json(cls, obj: Any, file: str = "cost model") -> CostModel:
        """Parse the JSON form, checked by :mod:`specenv.validation` (``CostModelJSON``).

        Strict types, finite coefficients, kmax 1..64, top_k 1..4096, every charged cost positive.

        Raises:
            ValueError: One line naming the file and the bad field.
        """
        from specenv.validation import check

        m = check("CostModelJSON", obj, file, formats=(FORMAT,), what="specenv cost model")
        rows = [m.target[str(k)] for k in range(m.kmax + 1)]
        return cls(
            beta0=np.array([r.beta0 for r in rows], dtype=np.float64),
            alpha=np.array([r.alpha for r in rows], dtype=np.float64),
            c=np.array([r.c for r in rows], dtype=np.float64),
            d1=float(m.draft.d1),
            d0=float(m.draft.d0),
            d_floor=float(m.draft.floor),
            top_k=m.top_k,
            ar_extrapolated=m.ar_extrapolated,
            source=dict(m.source),
            diagnostics=dict(m.diagnostics),
            n_experts=m.n_experts,
            n_layers=m.n_layers,
            overhead=np.array([r.overhead for r in rows], dtype=np.float64),
            ar_step=None if m.ar_step is None else (float(m.ar_step.a), float(m.ar_step.c)),
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON form atomically."""
        path = Path(path)
        atomic_write_json(path, self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read the JSON form written by :meth:`save`."""
        from specenv.validation import read_json

        path = Path(path)
        return cls.from_json(read_json(path, what="cost model"), str(path))
