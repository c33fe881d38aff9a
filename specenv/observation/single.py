"""The observation contract: what a real server knows before it verifies a round.

This module owns everything about the observation vector: its layout and scaling
(:class:`ObservationSpec`, versioned by :data:`OBSERVATION_VERSION` and serialisable with
:meth:`ObservationSpec.to_json`), the running statistics that produce it (:class:`ObservationState`,
vectorised over a batch of independent streams, and :class:`ScalarObservation`, the same arithmetic
for one stream in Python floats), and the decoder policies read it with (:class:`ObsView`). The replay
environment, its native vector form, the live environment and the vLLM controller all build their
observations here, so a policy sees the same features everywhere.

Layout of the float32 vector, version 2 (``ObservationSpec.names`` gives the names in order):

======================  ===============================================================  =========
name                    meaning and scaling                                              range
======================  ===============================================================  =========
context                 L_t / 4096 (context length; 4096 = the paper's max_model_len)    [0, 64]
progress                t / max_new_tokens (tokens generated so far, clipped)            [0, 1]
prev_k                  previous round's budget k / kmax (0 before the first round)      [0, 1]
prev_accepted           previous round's accepted drafts / kmax                          [0, 1]
prev_U                  previous round's observed U_r / n_experts                        [0, 1]
prev_cost               previous round's cost / C_AR(L) at its context, / (kmax + 1)     [0, 16]
acc_rate                EMA of accepted/k over rounds with k >= 1 (prior 0.5)            [0, 1]
acc_len                 EMA of accepted/kmax over rounds with k >= 1 (prior 0)           [0, 1]
cost_per_token          EMA of round cost / C_AR(L) per committed token (prior 1)        [0, 16]
first_round             1 on a generation's first round, else 0                          [0, 1]
acc_depth_1..kmax       EMA of the conditional acceptance at draft depth j, updated      [0, 1]
                        on rounds that reached depth j (k >= j, accepted >= j-1);
                        prior 0.5
conf_1..h               the draft's confidence q_{t,j} of its next h tokens (only when   [0, 1]
                        lookahead h > 0; in drafting mode block, drafting max(k, h)
                        tokens is then charged)
ent_1..h                only with signal "ent": entropy (nats) of the draft's            [0, 16]
                        distribution at each of those tokens
margin_1..h             only with signal "margin": top-1 minus top-2 probability of      [0, 1]
                        that distribution
draft_conf              per-token environment only (``per_token``): the confidence q of  [0, 1]
                        the draft just drafted in this round (0 before the first)
drafted                 per-token only: drafts drafted so far in this round / kmax       [0, 1]
draft_conf_prod         per-token only: product of this round's drafted confidences      [0, 1]
                        (1 before the first; an estimate of P(all accepted))
draft_ent               per-token with signal "ent": entropy of the draft just drafted   [0, 16]
draft_margin            per-token with signal "margin": its top-1/top-2 margin           [0, 1]
======================  ===============================================================  =========

**Joint (k, expert cap) policies.** ``cap_levels = C > 0`` marks the contract of the joint
environment ``specenv/MoESpecCap-v0`` (:mod:`specenv.envs.caps`): a policy then scores the
``(C + 1) * (kmax + 1)`` joint actions ``c * (kmax + 1) + k`` (cap level c = 0 uncapped, 1..C the
set's caps). The observation vector is the one above, unchanged: ``prev_U`` and ``prev_cost`` are the
capped round's when it ran capped, and the round model is Markov in the position, so no cap feature is
needed. ``cap_levels`` is in the JSON only when set (a k-only contract is unchanged).

The per-token features (:data:`TOKEN_FEATURES`, plus ``draft_ent``/``draft_margin`` for those
signals) appear only with ``per_token=True`` (and ``per_token`` in the JSON only when set): the
observation of ``specenv/MoESpecSeq-v0`` (:mod:`specenv.envs.sequential`), where each step is one
draft decision. The draft signals (``signals``, an ordered subset of :data:`SIGNALS`; default
``("q",)``) say which per-token draft statistics the lookahead and per-token blocks carry; the trace
schema v2 columns ``q_j``, ``ent_j``, ``margin_j`` fill them.

Every EMA keeps weight 0.8 on its old value. ``prev_cost`` and ``cost_per_token`` are in units of the
plain autoregressive step at the round's own context, ``C(k, U_r, L) / C_AR(L)``
(``prev_cost_norm = "ar_step_at_context"``): what a server knows at that moment, computed the same
way by the replay environments (from the cost model), the live environment and the vLLM controller.
Version 1 divided by the mean AR step of the replayed split, which a server cannot know; a version-1
policy is refused with one line (retrain it). The caller of :meth:`ObservationState.update` does the
division.

Nothing of the current round's acceptance or routing, nor the generation's length N, nor any
future position enters the vector.

The contract (version, feature names, sizes and every scaling constant) is what a trained policy
records in its ``policy.json``; :meth:`ObservationSpec.mismatch` names the first field in which two
contracts differ, so that a policy trained on another contract fails to load with that one line.
Changing a feature or a constant means a new version.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from gymnasium import spaces

OBSERVATION_VERSION = 2
"""Version of the observation contract (features and their meaning); bumped on any change."""

CONTEXT_SCALE = 4096.0
EMA = 0.8  # weight of the old value in every running statistic
PRIOR_RATE = 0.5
CONTEXT_HIGH = 64.0  # Box bound of ``context``
COST_HIGH = 16.0  # Box bound of ``prev_cost`` and ``cost_per_token``
ENT_HIGH = 16.0  # Box bound of the entropy features (nats)
PREV_COST_NORM = "ar_step_at_context"
PREV_COST_NORMS = (PREV_COST_NORM,)
SIGNALS = ("q", "ent", "margin")
"""Per-token draft signals the lookahead and per-token blocks can carry, in layout order."""
_SIGNAL_PREFIX = {"q": "conf", "ent": "ent", "margin": "margin"}
"""Known normalisations of the round cost (``prev_cost``, ``cost_per_token``)."""

BASE_FEATURES = (
    "context",
    "progress",
    "prev_k",
    "prev_accepted",
    "prev_U",
    "prev_cost",
    "acc_rate",
    "acc_len",
    "cost_per_token",
    "first_round",
)
#: Per-token features (``ObservationSpec.per_token``): the draft just drafted, the count, the product.
TOKEN_FEATURES = ("draft_conf", "drafted", "draft_conf_prod")
_PREV_BLOCK = ("prev_k", "prev_accepted", "prev_U", "prev_cost")
_RATE_BLOCK = ("acc_rate", "acc_len")

# the constants of version 1 as first shipped: a policy.json written before the contract recorded them
_LEGACY_V1 = {
    "version": 1,
    "context_scale": 4096.0,
    "ema": 0.8,
    "prior_rate": 0.5,
    "prev_cost_norm": "mean_ar_step_of_split",
    "context_high": 64.0,
    "cost_high": 16.0,
}
_JSON_KEYS = (
    "version",
    "kmax",
    "lookahead",
    "max_new_tokens",
    "n_experts",
    "dim",
    "names",
    "context_scale",
    "ema",
    "prior_rate",
    "prev_cost_norm",
    "signals",
    "low",
    "high",
    "per_token",
    "cap_levels",
)


def feature_names(kmax: int, lookahead: int, per_token: bool = False, signals: tuple[str, ...] = ("q",)) -> list[str]:
    """The feature names for budgets up to kmax, h = lookahead draft signals, and the per-token ones."""
    return (
        list(BASE_FEATURES)
        + [f"acc_depth_{j}" for j in range(1, kmax + 1)]
        + [f"{_SIGNAL_PREFIX[sig]}_{j}" for sig in signals for j in range(1, lookahead + 1)]
        + (token_feature_names(signals) if per_token else [])
    )


def token_feature_names(signals: tuple[str, ...] = ("q",)) -> list[str]:
    """The per-token features: :data:`TOKEN_FEATURES`, then ``draft_ent``/``draft_margin`` for those signals."""
    return list(TOKEN_FEATURES) + [f"draft_{sig}" for sig in signals if sig != "q"]


def check_signals(signals: Any) -> tuple[str, ...]:
    """The draft signals as a tuple in layout order.

    Args:
        signals: A sequence of names from :data:`SIGNALS` (or one name), which must include ``"q"``.

    Raises:
        ValueError: One line naming the bad value.
    """
    if isinstance(signals, str):
        signals = (signals,)
    try:
        names = tuple(signals)
    except TypeError:
        raise ValueError(f"signals={signals!r}: expected names from {SIGNALS}") from None
    bad = [s for s in names if s not in SIGNALS]
    if bad or len(set(names)) != len(names) or "q" not in names:
        raise ValueError(f"signals={signals!r}: expected distinct names from {SIGNALS}, including 'q'")
    return tuple(s for s in SIGNALS if s in names)


# --------------------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ObservationSpec:
    """Shape and scaling of the observation vector: the contract between environment and policy.

    Attributes:
        kmax: Largest budget (action space is 0..kmax).
        lookahead: Number h of draft confidences exposed (0 = none).
        max_new_tokens: Generation cap used to scale ``progress``.
        n_experts: Experts per layer, to scale ``prev_U``.
        version: Contract version (:data:`OBSERVATION_VERSION`; the only one this code builds).
        context_scale: Divisor of the context length L_t.
        ema: Weight of the old value in every running statistic.
        prior_rate: Prior of ``acc_rate`` and of every ``acc_depth_j``.
        context_high: Box upper bound of ``context``.
        cost_high: Box upper bound of ``prev_cost`` and ``cost_per_token``.
        prev_cost_norm: What the round cost is divided by before it enters the vector (one of
            :data:`PREV_COST_NORMS`).
        per_token: Append the per-token features :data:`TOKEN_FEATURES` (the observation of the
            per-token environment ``specenv/MoESpecSeq-v0``).
        signals: Draft signals of the lookahead and per-token blocks (ordered subset of
            :data:`SIGNALS` with ``"q"``).
        cap_levels: Expert-cap levels C of a joint (k, cap) policy (0: a k-only policy); the vector
            does not change, the policy scores ``(C + 1) * (kmax + 1)`` joint actions.
    """

    kmax: int
    lookahead: int = 0
    max_new_tokens: int = 1000
    n_experts: int = 128
    version: int = OBSERVATION_VERSION
    context_scale: float = CONTEXT_SCALE
    ema: float = EMA
    prior_rate: float = PRIOR_RATE
    context_high: float = CONTEXT_HIGH
    cost_high: float = COST_HIGH
    prev_cost_norm: str = PREV_COST_NORM
    per_token: bool = False
    signals: tuple[str, ...] = ("q",)
    cap_levels: int = 0

    def __post_init__(self) -> None:
        if self.version != OBSERVATION_VERSION:
            raise ValueError(
                f"observation contract version {self.version} != {OBSERVATION_VERSION} "
                f"(this code builds version {OBSERVATION_VERSION} only)"
            )
        if self.prev_cost_norm not in PREV_COST_NORMS:
            raise ValueError(f"prev_cost_norm={self.prev_cost_norm!r}: expected one of {PREV_COST_NORMS}")
        object.__setattr__(self, "signals", check_signals(self.signals))
        if isinstance(self.cap_levels, bool) or not isinstance(self.cap_levels, int) or not 0 <= self.cap_levels <= 64:
            raise ValueError(f"cap_levels={self.cap_levels!r}: must be an integer in 0..64")
        if self.cap_levels and self.per_token:
            raise ValueError("cap_levels: a per-token (stop rule) contract has no cap action")

    @property
    def names(self) -> list[str]:
        """Feature names in vector order."""
        return feature_names(self.kmax, self.lookahead, self.per_token, self.signals)

    @property
    def n_token_features(self) -> int:
        """Number of per-token features (0 unless ``per_token``)."""
        return len(token_feature_names(self.signals)) if self.per_token else 0

    @property
    def dim(self) -> int:
        """Length of the vector."""
        return len(BASE_FEATURES) + self.kmax + self.lookahead * len(self.signals) + self.n_token_features

    def index(self, name: str) -> int:
        """Position of a named feature.

        Raises:
            ValueError: If the layout has no feature of that name.
        """
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(
                f"no observation feature {name!r} (kmax={self.kmax}, lookahead={self.lookahead})"
            ) from None

    def high(self) -> np.ndarray:
        """Upper bounds of the Box (the lower bounds are 0)."""
        hi = np.ones(self.dim, dtype=np.float32)
        hi[self.index("context")] = self.context_high
        hi[self.index("prev_cost")] = self.cost_high
        hi[self.index("cost_per_token")] = self.cost_high
        for name in self.names:
            if name.startswith("ent_") or name == "draft_ent":
                hi[self.index(name)] = ENT_HIGH
        return hi

    def space(self) -> spaces.Box:
        """The single-stream observation space."""
        return spaces.Box(low=np.zeros(self.dim, dtype=np.float32), high=self.high(), dtype=np.float32)

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> dict[str, Any]:
        """The full contract as plain JSON: version, sizes, feature names and every scaling constant.

        ``"per_token": true`` is added only for a per-token spec (a round-level contract is unchanged).
        """
        extra = ({"per_token": True} if self.per_token else {}) | (
            {"cap_levels": self.cap_levels} if self.cap_levels else {}
        )
        return {
            "version": self.version,
            "kmax": self.kmax,
            "lookahead": self.lookahead,
            "max_new_tokens": self.max_new_tokens,
            "n_experts": self.n_experts,
            "dim": self.dim,
            "names": self.names,
            "context_scale": self.context_scale,
            "ema": self.ema,
            "prior_rate": self.prior_rate,
            "prev_cost_norm": self.prev_cost_norm,
            "signals": list(self.signals),
            "low": 0.0,
            "high": [float(x) for x in self.high()],
        } | extra

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ObservationSpec:
        """The spec a :meth:`to_json` dictionary describes.

        A dictionary without ``"version"`` (a ``policy.json`` written before the contract was
        versioned: only kmax, lookahead, max_new_tokens, n_experts and perhaps dim and names) is read
        as version 1 with the constants it was trained with (:func:`upgrade_contract`).

        Raises:
            ValueError: One line naming the first field this code cannot build (another version, a
                missing size, names or bounds that do not follow from the other fields).
        """
        d = upgrade_contract(data)
        if d.get("per_token", True) is False:  # written out explicitly: the same as absent
            del d["per_token"]
        if d.get("version") != OBSERVATION_VERSION:
            old = " (version 1 divided prev_cost by the split's mean AR step; retrain the policy)"
            raise ValueError(
                f"version {d.get('version')!r} != {OBSERVATION_VERSION}" + (old if d.get("version") == 1 else "")
            )
        try:
            kw: dict[str, Any] = {k: int(d[k]) for k in ("kmax", "lookahead", "max_new_tokens", "n_experts")}
            kw |= {k: float(d[k]) for k in ("context_scale", "ema", "prior_rate")}
            kw["prev_cost_norm"] = str(d["prev_cost_norm"])
            sig = d["signals"]
            if not isinstance(sig, list) or not all(isinstance(x, str) for x in sig):
                raise ValueError(f"signals={sig!r}: expected a list of names")
            kw["signals"] = check_signals(sig)
            if d.get("per_token", False) is not False:
                if d["per_token"] is not True:
                    raise ValueError(f"per_token={d['per_token']!r}: must be true or false")
                kw["per_token"] = True
            if d.get("cap_levels", 0):
                cl = d["cap_levels"]
                if isinstance(cl, bool) or not isinstance(cl, int):
                    raise ValueError(f"cap_levels={cl!r}: must be an integer")
                kw["cap_levels"] = cl
        except KeyError as exc:
            raise ValueError(f"{exc.args[0]} missing") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad value ({exc})") from None
        base = cls(**kw)
        high = d.get("high")
        if isinstance(high, list) and len(high) == base.dim:
            kw["context_high"] = float(high[base.index("context")])
            kw["cost_high"] = float(high[base.index("prev_cost")])
        spec = cls(**kw)
        bad = mismatch_json(d, spec.to_json(), keys=tuple(k for k in _JSON_KEYS if k in d))
        if bad is not None:
            raise ValueError(f"inconsistent contract: {bad}")
        return spec

    def mismatch(self, other: ObservationSpec | Mapping[str, Any]) -> str | None:
        """The first field in which this contract differs from ``other``, as one line; None if equal.

        Args:
            other: A spec or a :meth:`to_json` dictionary (old dictionaries are upgraded first).

        Returns:
            ``"<field> <this value> != <other value>"`` (e.g. ``"kmax 10 != 8"``), or None.
        """
        theirs = other.to_json() if isinstance(other, ObservationSpec) else upgrade_contract(other)
        return mismatch_json(self.to_json(), theirs)


def upgrade_contract(data: Mapping[str, Any]) -> dict[str, Any]:
    """A contract dictionary with the fields an unversioned ``policy.json`` lacks.

    Unversioned files were written by the first release, whose features and constants are those of
    version 1: the missing fields (version, constants, dim, names, bounds) are filled in with them.
    Versioned dictionaries come back as a copy, unchanged.
    """
    d = dict(data)
    if "version" in d:
        return d
    legacy = dict(_LEGACY_V1)
    ctx_hi, cost_hi = legacy.pop("context_high"), legacy.pop("cost_high")
    for key, value in legacy.items():
        d.setdefault(key, value)
    d.setdefault("low", 0.0)
    try:
        kmax, h = int(d["kmax"]), int(d["lookahead"])
    except (KeyError, TypeError, ValueError):
        return d  # from_json names the bad field
    names = feature_names(kmax, h)
    d.setdefault("dim", len(names))
    d.setdefault("names", names)
    high = [1.0] * len(names)
    for name, value in (("context", ctx_hi), ("prev_cost", cost_hi), ("cost_per_token", cost_hi)):
        high[names.index(name)] = value
    d.setdefault("high", high)
    return d


def mismatch_json(a: Mapping[str, Any], b: Mapping[str, Any], keys: tuple[str, ...] = _JSON_KEYS) -> str | None:
    """The first of ``keys`` in which two contract dictionaries differ, as one line; None if none does.

    Lists (names, high) name their first differing entry, e.g. ``"names[12] 'acc_depth_3' != 'conf_1'"``;
    a field present on one side only reads ``"ema (absent) != 0.8"``.
    """
    for key in keys:
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if isinstance(va, list | tuple) and isinstance(vb, list | tuple):
            for i, (x, y) in enumerate(zip(va, vb, strict=False)):
                if x != y:
                    return f"{key}[{i}] {x!r} != {y!r}"
            if len(va) != len(vb):
                return f"{key} has {len(va)} entries != {len(vb)}"
        elif va != vb:
            return f"{key} {_show(va)} != {_show(vb)}"
    return None


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _show(v: Any) -> str:
    """A value for a one-line message: strings quoted, numbers bare, long lists cut."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------------------------------
# The running statistics, vectorised
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _ema_tables(k_top: int, kmax: int, ema: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-(k, a) multiplier and addend of the statistics block for budgets 0..k_top (read-only).

    Row ``k * (k_top + 1) + a``; columns ``[acc_rate, acc_len, cost_per_token, first_round,
    acc_depth_1..kmax]`` (:class:`ObservationState`'s block ``E``). Where a round updates a statistic
    with value x: ``M = ema, A = (1 - ema) * x``; elsewhere ``M = 1, A = 0`` (``s * 1.0 + 0.0 == s``
    exactly). ``cost_per_token`` gets ``M = ema, A = 0`` (its addend depends on the cost: the update
    adds it), ``first_round`` ``M = A = 0``.
    """
    K = k_top + 1
    w = 1 - ema
    M = np.ones((K * K, 4 + kmax))
    A = np.zeros((K * K, 4 + kmax))
    M[:, 2] = ema
    M[:, 3] = 0.0
    for k in range(K):
        for a in range(k + 1):
            row = k * K + a
            if k >= 1:
                M[row, 0:2] = ema
                A[row, 0] = w * (float(a) / float(k))
                A[row, 1] = w * (float(a) / kmax)
            for j in range(1, kmax + 1):
                if k >= j and a >= j - 1:  # depth j reached; success when a >= j
                    M[row, 3 + j] = ema
                    A[row, 3 + j] = w * (1.0 if a >= j else 0.0)
    M.flags.writeable = False
    A.flags.writeable = False
    return M, A


def _column(block: str, col: int | slice, doc: str) -> property:
    """A read/write view of column(s) ``col`` of the block attribute ``block``."""

    def get(self: ObservationState) -> np.ndarray:
        return getattr(self, block)[:, col]

    def put(self: ObservationState, value: Any) -> None:
        getattr(self, block)[:, col] = value

    return property(get, put, doc=doc)


class StateView(NamedTuple):
    """:meth:`ObservationState.kernel_view`: what a compiled stepper reads and writes."""

    P: np.ndarray
    E: np.ndarray
    E_init: np.ndarray
    M: np.ndarray
    A: np.ndarray
    K: int
    w: float
    scale: np.ndarray
    ctx_scale: float
    mnt: float
    cols: np.ndarray
    hi: np.ndarray


class ObservationState:
    """Running statistics of a batch of n independent streams, and the observation builder.

    The statistics live in two contiguous float64 blocks, in the order of the vector: ``P = [prev_k,
    prev_acc, prev_U, prev_cost]`` (the last round as it was, unscaled) and ``E = [acc_rate,
    acc_len, cost_per_token, first_round, acc_depth_1..kmax]``; the attributes of those names are
    views into the blocks. Every statistic in ``E`` is an EMA (or, for ``first_round``, a reset)
    gated by the round's (k, accepted) only, so one update is ``E = E * M[k, a] + A[k, a]`` with
    tables precomputed per (k, a) (:func:`_ema_tables`), plus the cost term of ``cost_per_token``:
    the same float operations as updating each statistic on its own, at a fraction of the numpy
    calls. Budgets above the table (a vLLM server verifying more drafts than the policy's kmax)
    extend the table on first use. :meth:`build` writes the vector with one operation per block
    (each feature computed in float64 and rounded once to float32), then clips it to the Box unless
    :attr:`clip` is off.

    Rounds must satisfy ``0 <= accepted <= k``.

    Args:
        spec: The observation layout.
        n: Number of streams.
    """

    def __init__(self, spec: ObservationSpec, n: int = 1):
        self.spec = spec
        self.n = n
        km = spec.kmax
        self._ema = spec.ema
        self._w = 1 - spec.ema
        self._P = np.zeros((n, 4))
        self._E_init = np.array([spec.prior_rate, 0.0, 1.0, 1.0] + [spec.prior_rate] * km)
        self._E = np.empty((n, 4 + km))
        self._E[:] = self._E_init
        self._scale = np.array([km, km, spec.n_experts, km + 1], dtype=np.float64)
        self._hi_row = spec.high()[None, :]
        self._set_tables(km)
        # column layout of the vector, read from the spec once
        idx = spec.index
        self._c_context = idx("context")
        self._c_progress = idx("progress")
        self._c_prev = _block(spec, _PREV_BLOCK)
        stats = (*_RATE_BLOCK, "cost_per_token", "first_round", *(f"acc_depth_{j}" for j in range(1, km + 1)))
        self._c_stats = _block(spec, stats)  # E is written as one block
        self._c_conf = _lookahead_block(spec)
        self._c_token = _block(spec, tuple(token_feature_names(spec.signals)) if spec.per_token else ())
        self._token_scale = np.array([1.0, km, 1.0] + [1.0] * (spec.n_token_features - 3 if spec.per_token else 0))
        self._dim = spec.dim
        self._ctx_scale = float(spec.context_scale)
        self._mnt = float(spec.max_new_tokens)
        self._idx = np.empty(n, dtype=np.intp)
        self._f = np.empty(n)
        #: Clip every vector to the Box; a caller whose rounds keep every feature in range (the replay
        #: environments when :attr:`specenv.replay.tables.ReplayData.within_box`) may turn it off.
        self.clip = True

    def _set_tables(self, k_top: int) -> None:
        self._K = k_top + 1
        self._M, self._A = _ema_tables(k_top, self.spec.kmax, self._ema)

    # -- the statistics by name (views into the blocks; assigning writes into them)
    prev_k = _column("_P", 0, "Previous round's budget per stream.")
    prev_acc = _column("_P", 1, "Previous round's accepted drafts per stream.")
    prev_U = _column("_P", 2, "Previous round's unique experts per stream.")
    prev_cost = _column("_P", 3, "Previous round's cost per stream (units of ``prev_cost_norm``).")
    acc_rate = _column("_E", 0, "EMA of accepted/k per stream.")
    acc_len = _column("_E", 1, "EMA of accepted/kmax per stream.")
    cost_per_token = _column("_E", 2, "EMA of the round cost per committed token per stream.")
    first = _column("_E", 3, "1 before a stream's first round, else 0.")
    acc_depth = _column("_E", slice(4, None), "(n, kmax) EMA of the conditional acceptance per depth.")

    def reset(self, mask: np.ndarray | None = None) -> None:
        """Forget the history of the streams in ``mask`` (all when None)."""
        m = slice(None) if mask is None else np.asarray(mask, dtype=bool)
        self._P[m] = 0.0
        self._E[m] = self._E_init

    def update(
        self,
        k: np.ndarray,
        accepted: np.ndarray,
        U_r: np.ndarray,
        cost_units: np.ndarray,
        committed: np.ndarray,
        mask: np.ndarray | None = None,
    ) -> None:
        """Fold one executed round per stream into the statistics.

        Args:
            k: Budgets used.
            accepted: Accepted drafts (0..k).
            U_r: Observed unique experts of the verification pass.
            cost_units: Round cost in the units of ``spec.prev_cost_norm``.
            committed: Tokens committed by the round (accepted + 1, capped at the end).
            mask: Streams to update (all when None).
        """
        if mask is not None:  # update everything, then restore the streams not selected
            keep = ~np.asarray(mask, dtype=bool)
            saved = (self._P[keep], self._E[keep])
            self.update(k, accepted, U_r, cost_units, committed)
            self._P[keep], self._E[keep] = saved
            return
        idx = self._idx
        np.multiply(k, self._K, out=idx, casting="unsafe")
        np.add(idx, accepted, out=idx, casting="unsafe")
        try:
            Mk = self._M.take(idx, axis=0)  # (take with out= is buffered, several times slower)
        except IndexError:  # a budget above the table: extend it
            self._set_tables(max(int(np.max(k)), self.spec.kmax))
            np.multiply(k, self._K, out=idx, casting="unsafe")
            np.add(idx, accepted, out=idx, casting="unsafe")
            Mk = self._M.take(idx, axis=0)
        E = self._E
        E *= Mk
        E += self._A.take(idx, axis=0)
        # cost_per_token = ema * cost_per_token + (1 - ema) * cost / max(committed, 1); the ema
        # factor is in M above
        cpt = self._f
        np.maximum(committed, 1.0, out=cpt)
        np.divide(cost_units, cpt, out=cpt)
        cpt *= self._w
        E[:, 2] += cpt
        P = self._P
        P[:, 0] = k
        P[:, 1] = accepted
        P[:, 2] = U_r
        P[:, 3] = cost_units

    def build(
        self,
        L: np.ndarray,
        t: np.ndarray,
        conf: np.ndarray | None = None,
        token: np.ndarray | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """The (n, dim) float32 observations at context ``L`` after ``t`` generated tokens.

        Args:
            L: Context lengths L_t.
            t: Tokens generated so far.
            conf: (n, lookahead * len(signals)) draft signals of the next drafts, one block of h
                columns per signal in ``spec.signals`` order (required iff lookahead > 0).
            token: (n, 3 + extra) per-token features ``[q of the draft just drafted, drafted so far,
                product of the round's drafted q, then its entropy / margin for those signals]``,
                unscaled (required iff ``spec.per_token``); ``drafted`` is divided by kmax here.
            out: An (n, dim) float32 array to write the observations into (and return); a new one
                when None.
        """
        s = self.spec
        obs = np.empty((self.n, self._dim), dtype=np.float32) if out is None else out
        # each feature in float64, rounded once to float32 on the write
        np.divide(L, self._ctx_scale, out=obs[:, self._c_context], dtype=np.float64)
        np.divide(t, self._mnt, out=obs[:, self._c_progress], dtype=np.float64)
        np.divide(self._P, self._scale, out=obs[:, self._c_prev])
        obs[:, self._c_stats] = self._E
        if s.lookahead:
            if conf is None:
                raise ValueError("conf is required when lookahead > 0")
            obs[:, self._c_conf] = conf
        if s.per_token:
            if token is None:
                raise ValueError("token is required when spec.per_token")
            np.divide(token, self._token_scale, out=obs[:, self._c_token], dtype=np.float64)
        if self.clip:
            np.minimum(obs, self._hi_row, out=obs)  # == np.clip(obs, 0, hi): no NaN can occur
            np.maximum(obs, 0.0, out=obs)
        return obs

    def kernel_view(self) -> StateView:
        """The blocks and constants of the statistics, for a compiled stepper (:mod:`specenv.envs.vector_kernel`).

        ``P`` and ``E`` are the live blocks (a stepper writes the update into them); the tables ``M``,
        ``A`` cover budgets 0..``K - 1`` (0..kmax). The stepper must do :meth:`update`'s and
        :meth:`build`'s float operations in their order (it is tested bit for bit against them).
        """
        cols = np.array(
            [self._c_context, self._c_progress, self._c_prev.start, self._c_stats.start, self._c_conf.start],
            dtype=np.int64,
        )
        return StateView(
            self._P, self._E, self._E_init, self._M, self._A, self._K, self._w, self._scale, self._ctx_scale,
            self._mnt, cols,
            np.ascontiguousarray(self._hi_row[0]),
        )  # fmt: skip

    def take(self, rows: Any) -> ObservationState:
        """A copy of the statistics of some streams, as a state of its own (rows in the given order)."""
        sub = ObservationState(self.spec, len(np.arange(self.n)[rows]))
        sub._P[:] = self._P[rows]
        sub._E[:] = self._E[rows]
        return sub

    def resized(self, n: int) -> ObservationState:
        """A state of n streams: the first ``min(n, self.n)`` copied from this one, the others fresh."""
        new = ObservationState(self.spec, n)
        m = min(n, self.n)
        new._P[:m] = self._P[:m]
        new._E[:m] = self._E[:m]
        return new


def _lookahead_block(spec: ObservationSpec) -> slice:
    """The slice of the whole lookahead block (every signal's h columns)."""
    h = spec.lookahead
    return _block(spec, tuple(f"{_SIGNAL_PREFIX[sig]}_{j}" for sig in spec.signals for j in range(1, h + 1)))


def _block(spec: ObservationSpec, names: tuple[str, ...]) -> slice:
    """The slice of consecutive features ``names`` (empty slice for none)."""
    if not names:
        return slice(spec.dim, spec.dim)
    start = spec.index(names[0])
    if spec.names[start : start + len(names)] != list(names):
        raise ValueError(f"observation layout: features {names} are not consecutive")
    return slice(start, start + len(names))


# --------------------------------------------------------------------------------------------------
# One stream in Python floats (the single environments' fast path)
# --------------------------------------------------------------------------------------------------
_FLOAT32 = np.dtype(np.float32)


class ScalarObservation:
    """:class:`ObservationState` for one stream, in Python floats.

    Same features, same arithmetic in the same order, hence bit-identical float32 vectors (tested on
    random rounds against :class:`ObservationState`); it exists because per-step numpy calls on
    length-1 arrays would dominate a single environment's step time. The statistics are kept as one
    list in the order of the vector (:attr:`values`: ``prev_k`` .. ``acc_depth_kmax``, the previous
    round's figures already divided by their scales, the division :meth:`ObservationState.build`
    does), so that :meth:`build` is one list and one conversion. Rounds must satisfy
    ``0 <= accepted <= k <= kmax``.

    Args:
        spec: The observation layout.
    """

    __slots__ = ("spec", "clip", "kmax", "ema", "w", "prior", "values", "hi_context", "hi_cost", "_scales")

    def __init__(self, spec: ObservationSpec):
        self.spec = spec
        self.clip = True  # as ObservationState.clip
        self.hi_context = float(np.float32(spec.context_high))  # the Box's float32 bounds
        self.hi_cost = float(np.float32(spec.cost_high))
        self.kmax = spec.kmax
        self.ema = spec.ema
        self.w = 1 - spec.ema
        self.prior = spec.prior_rate
        # the divisors of the context, the progress, prev_U and prev_cost, as build() used them
        self._scales = (spec.context_scale, spec.max_new_tokens, spec.n_experts, spec.kmax + 1)
        if spec.names[: len(BASE_FEATURES)] != list(BASE_FEATURES):
            raise ValueError("ScalarObservation: unexpected layout")  # build() lists the features in order
        self.reset()

    def reset(self) -> None:
        """Forget the stream's history."""
        p = self.prior
        #: [prev_k / kmax, prev_accepted / kmax, prev_U / n_experts, prev_cost / (kmax + 1), acc_rate,
        #: acc_len, cost_per_token, first_round, acc_depth_1..kmax]: the vector's features 2.. as floats
        self.values = [0.0, 0.0, 0.0, 0.0, p, 0.0, 1.0, 1.0] + [p] * self.kmax

    def update(self, k: int, a: int, U_r: float, cost_units: float, committed: int) -> None:
        """Fold one executed round into the statistics (see :meth:`ObservationState.update`)."""
        v = self.values
        ema = self.ema
        w = self.w
        kmax = self.kmax
        kf = float(k)
        af = float(a)
        _, _, n_experts, width = self._scales
        v[0] = kf / kmax
        v[1] = af / kmax
        v[2] = U_r / n_experts
        v[3] = cost_units / width
        if k >= 1:
            v[4] = ema * v[4] + w * (af / kf)
            v[5] = ema * v[5] + w * (af / kmax)
        v[6] = ema * v[6] + w * (cost_units / max(float(committed), 1.0))
        v[7] = 0.0
        # depth j+1 is reached for j < min(k, a + 1); success (x = 1) for j < a, failure (x = 0) at j = a < k
        for j in range(8, 8 + a):
            v[j] = ema * v[j] + w
        if a < k:
            v[8 + a] = ema * v[8 + a] + 0.0  # w * 0.0

    def build(
        self, L: float, t: int, conf: list[float] | None, token: tuple[float, int, float] | None = None
    ) -> np.ndarray:
        """The float32 observation at context ``L`` after ``t`` generated tokens.

        ``conf`` (h per signal, in ``spec.signals`` order) iff lookahead; ``token = (q of the draft
        just drafted, drafted so far, product of the round's drafted q, then its entropy / margin for
        those signals)`` iff ``spec.per_token`` (see :meth:`ObservationState.build`).
        """
        context_scale, max_new_tokens, _, _ = self._scales
        if self.clip:
            # Clipping to the Box in float64 before the float32 cast equals ObservationState's
            # cast-then-clip (the bounds 0, 1, 16, 64 are exact in float32 and rounding is monotone).
            # Only these features can leave their range; the others stay in [0, 1] by construction.
            # The list follows BASE_FEATURES (checked in __init__).
            v = self.values
            vals = [
                min(max(L / context_scale, 0.0), self.hi_context),
                min(t / max_new_tokens, 1.0),
                v[0],
                v[1],
                min(max(v[2], 0.0), 1.0),
                min(max(v[3], 0.0), self.hi_cost),
                v[4],
                v[5],
                min(max(v[6], 0.0), self.hi_cost),
                *v[7:],
            ]
        else:  # the same values, known to be in range
            vals = [L / context_scale, t / max_new_tokens, *self.values]
        if conf is not None:
            vals.extend(conf)
        if token is not None:
            vals.extend((token[0], token[1] / self.kmax, token[2], *token[3:]))
        return np.array(vals, _FLOAT32)


# --------------------------------------------------------------------------------------------------
# The decoder policies read observations with
# --------------------------------------------------------------------------------------------------
class ObsView:
    """Decodes an observation vector back into physical units; every index comes from the spec.

    Args:
        spec: The layout of the vectors to decode.
    """

    def __init__(self, spec: ObservationSpec):
        self.spec = spec
        self.scale = spec.context_scale
        idx = spec.index
        self.i_context = idx("context")
        self.i_progress = idx("progress")
        self.i_prev_k = idx("prev_k")
        self.i_prev_accepted = idx("prev_accepted")
        self.i_prev_U = idx("prev_U")
        self.i_prev_cost = idx("prev_cost")
        self.i_acc_rate = idx("acc_rate")
        self.i_acc_len = idx("acc_len")
        self.i_cost_per_token = idx("cost_per_token")
        self.i_first_round = idx("first_round")
        self.depth_slice = _block(spec, tuple(f"acc_depth_{j}" for j in range(1, spec.kmax + 1)))
        h = spec.lookahead
        self.lookahead_slice = _lookahead_block(spec)
        self.conf_slice = _block(spec, tuple(f"conf_{j}" for j in range(1, h + 1)))
        self.ent_slice = _block(spec, tuple(f"ent_{j}" for j in range(1, h + 1)) if "ent" in spec.signals else ())
        self.margin_slice = _block(
            spec, tuple(f"margin_{j}" for j in range(1, h + 1)) if "margin" in spec.signals else ()
        )
        self.token_slice = _block(spec, tuple(token_feature_names(spec.signals)) if spec.per_token else ())

    def raw(self, obs: np.ndarray, name: str) -> float:
        """The scaled value of a named feature, as stored in the vector."""
        return float(obs[self.spec.index(name)])

    def L(self, obs: np.ndarray) -> float:
        """Context length."""
        return float(obs[self.i_context]) * self.scale

    def t(self, obs: np.ndarray) -> float:
        """Tokens generated so far (saturates at max_new_tokens)."""
        return float(obs[self.i_progress]) * self.spec.max_new_tokens

    def prev_k(self, obs: np.ndarray) -> int:
        """Previous round's budget."""
        return int(round(float(obs[self.i_prev_k]) * self.spec.kmax))

    def prev_accepted(self, obs: np.ndarray) -> int:
        """Previous round's accepted drafts."""
        return int(round(float(obs[self.i_prev_accepted]) * self.spec.kmax))

    def prev_U(self, obs: np.ndarray) -> float:
        """Previous round's unique experts."""
        return float(obs[self.i_prev_U]) * self.spec.n_experts

    def prev_cost(self, obs: np.ndarray) -> float:
        """Previous round's cost in the units of ``spec.prev_cost_norm`` (AR steps at its context)."""
        return float(obs[self.i_prev_cost]) * (self.spec.kmax + 1)

    def acc_rate(self, obs: np.ndarray) -> float:
        """Running per-draft acceptance rate."""
        return float(obs[self.i_acc_rate])

    def acc_len(self, obs: np.ndarray) -> float:
        """Running accepted drafts per speculative round (EMA, in drafts)."""
        return float(obs[self.i_acc_len]) * self.spec.kmax

    def cost_per_token(self, obs: np.ndarray) -> float:
        """Running cost per committed token, in the units of ``spec.prev_cost_norm``."""
        return float(obs[self.i_cost_per_token])

    def first_round(self, obs: np.ndarray) -> bool:
        """True on a generation's first round."""
        return bool(obs[self.i_first_round] >= 0.5)

    def acc_depth(self, obs: np.ndarray) -> np.ndarray:
        """Running conditional acceptance per draft depth (kmax,)."""
        return np.asarray(obs[self.depth_slice], dtype=np.float64)

    def conf(self, obs: np.ndarray) -> np.ndarray:
        """Draft confidences of the next ``lookahead`` drafts (empty without lookahead)."""
        return np.asarray(obs[self.conf_slice], dtype=np.float64)

    def ent(self, obs: np.ndarray) -> np.ndarray:
        """Draft entropies (nats) of the next ``lookahead`` drafts (empty without signal ``"ent"``)."""
        return np.asarray(obs[self.ent_slice], dtype=np.float64)

    def margin(self, obs: np.ndarray) -> np.ndarray:
        """Top-1/top-2 margins of the next ``lookahead`` drafts (empty without signal ``"margin"``)."""
        return np.asarray(obs[self.margin_slice], dtype=np.float64)

    def draft_ent(self, obs: np.ndarray) -> float:
        """Per-token observation with signal ``"ent"``: entropy of the draft just drafted (0 before the first)."""
        return float(obs[self.spec.index("draft_ent")])

    def draft_margin(self, obs: np.ndarray) -> float:
        """Per-token observation with signal ``"margin"``: margin of the draft just drafted (0 before the first)."""
        return float(obs[self.spec.index("draft_margin")])

    def draft_conf(self, obs: np.ndarray) -> float:
        """Per-token observation: confidence of the draft just drafted (0 before the first)."""
        return float(obs[self.spec.index("draft_conf")])

    def drafted(self, obs: np.ndarray) -> int:
        """Per-token observation: drafts drafted so far in this round."""
        return int(round(float(obs[self.spec.index("drafted")]) * self.spec.kmax))

    def draft_conf_prod(self, obs: np.ndarray) -> float:
        """Per-token observation: product of this round's drafted confidences (1 before the first)."""
        return float(obs[self.spec.index("draft_conf_prod")])
