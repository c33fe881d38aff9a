"""The peers' budget controllers as baselines: each a :class:`specenv.policy.base.Policy` with its published rule.

Every rule reads only what the observation shows (the draft's signals of the next h = kmax tokens:
confidence q, and where the observation contract exposes them, entropy and top-1/top-2 margin) and is
charged by the drafting mode it really uses (DESIGN.md section 1):

======================================  ==========================  ===========================================
policy                                  drafting mode               what is fitted on the **train** split
======================================  ==========================  ===========================================
:class:`AdaEDL` (Agrawal et al. 2024)   ``sequential`` (h = kmax)   the threshold lambda
:class:`SVIP` (Zhang et al. 2024)       ``sequential`` (h = kmax)   the entropy threshold h
:class:`SpecDecPP` (Huang et al. 2024)  ``sequential`` (h = kmax)   the acceptance head (logistic regression)
                                                                    and the stop threshold
:class:`DISCO` (Mamou et al. 2024)      ``sequential`` (h = kmax)   the continue/stop classifier (logistic
                                                                    regression) and its threshold
:class:`VLLMAdaptiveVerification`       ``block`` (h = kmax)        nothing (the cost curve is the server's
                                                                    cost model; U(k) the train means)
:class:`VLLMDSDTable`                   ``none``                    the batch-size table (at batch 1: the best
                                                                    fixed k on train)
======================================  ==========================  ===========================================

The stop rules (the first four) are *stopping rules*: the budget is the first depth j whose own signals
say stop (that token is still verified, as transformers' ``ConfidenceCriteria`` keeps it), or kmax.
Their choice of k reads the signals of drafts 1..k only, so the sequential charge T_D(k) is exact
(DESIGN.md section 1). They keep no state across rounds (``stateless``), so a batch is one numpy
expression over the batch, and :meth:`StopRule.budgets` computes the same budgets from the raw signal
arrays of a positions table (that is how thresholds are fitted: the exact expected speedup of the
position-indexed rule on the train split, :func:`oracle.dp.evaluate_policy`).

Fitting (:func:`fit_peers`) reads a :class:`specenv.traces.traceset.PositionArrays` of the **train** split only.
scikit-learn is imported only when a classifier is fitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specenv.cost.model import CostModel
from specenv.observation.single import SIGNALS as OBS_SIGNALS
from specenv.observation.single import ObservationSpec
from specenv.policy.base import Policy
from specenv.policy.registry import BUDGET, COUNT, FLAG, NONNEGATIVE, PROBABILITY, REAL, TEXT, Param, declare
from specenv.traces.traceset import PositionArrays

__all__ = [
    "DISCO",
    "SIGNALS",
    "SVIP",
    "AdaEDL",
    "PeerFit",
    "SpecDecPP",
    "StopRule",
    "VLLMAdaptiveVerification",
    "VLLMDSDTable",
    "fit_peers",
    "parse_schedule",
]

#: The draft signals a rule may read, in the observation's order; each has (n, h) values per state.
SIGNALS = OBS_SIGNALS
#: Observation feature prefix of each signal (``conf_1..h``, ``ent_1..h``, ``margin_1..h``).
_PREFIX = {"q": "conf", "ent": "ent", "margin": "margin"}
#: Default paper-profile data set the registry factories fit on when given no fitted values.
DEFAULT_FIT_DATASET = "paper-default"

Signals = Mapping[str, np.ndarray]


def spec_signals(spec: ObservationSpec) -> tuple[str, ...]:
    """The signals a spec's observation shows for its lookahead (in :data:`SIGNALS` order)."""
    if spec.lookahead < 1:
        return ()
    names = set(spec.names)
    return tuple(s for s in SIGNALS if f"{_PREFIX[s]}_1" in names)


def array_signals(arrays: PositionArrays, signals: Sequence[str], h: int | None = None) -> dict[str, np.ndarray]:
    """The raw (n, h) signal blocks of a positions table (h defaults to its kmax).

    Raises:
        ValueError: When a signal is asked for that the table lacks (entropy and margin: schema v2).
    """
    h = arrays.kmax if h is None else h
    out: dict[str, np.ndarray] = {}
    for s in signals:
        if s == "q":
            out[s] = np.asarray(arrays.q[:, :h], dtype=np.float64)
        else:
            ent, margin = arrays.signals(f"signal {s!r}")
            out[s] = np.asarray((ent if s == "ent" else margin)[:, :h], dtype=np.float64)
    return out


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0)))


def first_stop(stop: np.ndarray) -> np.ndarray:
    """Budgets of a stopping rule: the first depth j (1-based) where ``stop[:, j-1]`` holds, else h.

    Args:
        stop: (n, h) bool, True where the rule stops after drafting token j.
    """
    stop = np.asarray(stop, dtype=bool)
    n, h = stop.shape
    any_stop = stop.any(axis=1)
    return np.where(any_stop, np.argmax(stop, axis=1) + 1, h).astype(np.int64)


# --------------------------------------------------------------------------------------------------
# Stop rules (sequential drafting)
# --------------------------------------------------------------------------------------------------
class StopRule(Policy):
    """A stateless stopping rule over the draft's per-token signals: stop after the first token that fails.

    Subclasses set :attr:`needs` (the signals they read) and implement :meth:`stops`. The observation
    must show the signals for lookahead h >= 1 (the benchmark runs them with h = kmax in drafting mode
    ``sequential``).

    Args:
        spec: Observation layout (lookahead >= 1, with the signals in :attr:`needs`).
    """

    needs: tuple[str, ...] = ("q",)
    stateless = True

    def __init__(self, spec: ObservationSpec):
        if spec.lookahead < 1:
            raise ValueError(f"{type(self).__name__} needs an observation with lookahead >= 1")
        shown = spec_signals(spec)
        missing = [s for s in self.needs if s not in shown]
        if missing:
            raise ValueError(
                f"{type(self).__name__} reads the draft's {', '.join(missing)}: the observation shows only "
                f"{', '.join(shown) or 'no signal'} (make the environment with signals={self.needs!r})"
            )
        super().__init__(spec)
        self._cols = {s: [spec.index(f"{_PREFIX[s]}_{j}") for j in range(1, spec.lookahead + 1)] for s in self.needs}

    def stops(self, sig: Signals) -> np.ndarray:
        """(n, h) bool: True where the rule stops after drafting token j (its signals at depth j)."""
        raise NotImplementedError

    def budgets(self, sig: Signals) -> np.ndarray:
        """(n,) budgets from raw (n, h) signal blocks: the first stopping depth, else h (capped at kmax)."""
        return np.minimum(first_stop(self.stops(sig)), self.spec.kmax)

    def observed(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        """The (n, h) signal blocks of a batch of observations (raw values: q, entropy in nats, margin)."""
        obs = np.atleast_2d(np.asarray(obs, dtype=np.float32))
        return {s: obs[:, cols].astype(np.float64) for s, cols in self._cols.items()}

    def _act(self, obs: np.ndarray) -> int:
        return int(self.budgets(self.observed(obs))[0])

    def _act_rows(self, obs: np.ndarray) -> np.ndarray:
        return self.budgets(self.observed(obs))


class AdaEDL(StopRule):
    """AdaEDL: stop drafting once the entropy-based lower bound on the token's acceptance falls below lambda.

    Source: S. Agrawal, W. Jeon, M. Lee, "AdaEDL: Early Draft Stopping for Speculative Decoding of Large
    Language Models via an Entropy-based Lower Bound on Token Acceptance Probability", 2024,
    arXiv:2410.18351. The acceptance probability of a drafted token is bounded below by
    ``1 - sqrt(gamma * H(p_draft))`` (H the entropy of the draft's distribution at that token, in nats;
    the paper's gamma = 0.2), and drafting stops after the token where ::

        1 - sqrt(gamma * H_j) < lambda

    Here lambda is static, chosen on the train split (:func:`fit_peers`); the paper's online adjustment of
    lambda from the observed acceptance rate is not reproduced. Reads the entropy (observation signal
    ``ent``).

    Args:
        spec: Observation layout (lookahead >= 1, with entropy).
        lam: The threshold lambda.
        gamma: The entropy scale gamma.
    """

    needs = ("ent",)

    def __init__(self, spec: ObservationSpec, lam: float = 0.5, gamma: float = 0.2):
        if not gamma > 0:
            raise ValueError(f"gamma={gamma}: must be > 0")
        self.lam = float(lam)
        self.gamma = float(gamma)
        self.name = f"adaedl-{self.lam:g}"
        super().__init__(spec)

    def bound(self, ent: np.ndarray) -> np.ndarray:
        """The lower bound on acceptance, ``1 - sqrt(gamma * H)``."""
        return 1.0 - np.sqrt(self.gamma * np.maximum(ent, 0.0))

    def stops(self, sig: Signals) -> np.ndarray:
        """Stop where ``1 - sqrt(gamma * H_j) < lambda``."""
        return self.bound(sig["ent"]) < self.lam


class SVIP(StopRule):
    """SVIP: the draft stops when the square root of its entropy exceeds a threshold.

    Source: Z. Zhang, J. Xu, T. Liang, X. Chen, Z. He, R. Wang, Z. Tu, "Draft Model Knows When to Stop:
    A Self-Verification Length Policy for Speculative Decoding", 2024, arXiv:2411.18462. The acceptance
    rate of a drafted token is bounded below by a decreasing function of the draft's entropy
    (``1 - sqrt(H/2)``-type, from Pinsker's inequality), so the length policy drafts while the draft is
    sure and stops after the first token with ::

        sqrt(H_j) > h

    h chosen on the train split (:func:`fit_peers`). With a static lambda this is the same family as
    :class:`AdaEDL` (``h = (1 - lambda) / sqrt(gamma)``); the two rows differ only by their fitted
    thresholds. Reads the entropy (observation signal ``ent``).

    Args:
        spec: Observation layout (lookahead >= 1, with entropy).
        h: The threshold on sqrt(entropy) (nats^0.5).
    """

    needs = ("ent",)

    def __init__(self, spec: ObservationSpec, h: float = 1.0):
        self.h = float(h)
        self.name = f"svip-{self.h:g}"
        super().__init__(spec)

    def stops(self, sig: Signals) -> np.ndarray:
        """Stop where ``sqrt(H_j) > h``."""
        return np.sqrt(np.maximum(sig["ent"], 0.0)) > self.h


@dataclass(frozen=True)
class LinearHead:
    """A logistic model over per-token features: ``p = sigmoid(bias + sum_f w_f * x_f + w_depth * j)``.

    Attributes:
        features: The signals it reads, in :data:`SIGNALS` order.
        weights: One weight per feature.
        w_depth: Weight of the depth j (1-based).
        bias: Intercept.
    """

    features: tuple[str, ...]
    weights: tuple[float, ...]
    w_depth: float
    bias: float

    def prob(self, sig: Signals) -> np.ndarray:
        """(n, h) predicted probabilities at every depth."""
        first = sig[self.features[0]] if self.features else next(iter(sig.values()))
        j = np.arange(1, first.shape[1] + 1, dtype=np.float64)
        z = self.bias + self.w_depth * j[None, :]
        for f, w in zip(self.features, self.weights, strict=True):
            z = z + w * sig[f]
        return _sigmoid(z)

    def to_params(self) -> dict[str, float]:
        """Registry parameters (``w_q``, ``w_ent``, ``w_margin``, ``w_depth``, ``bias``)."""
        return {f"w_{f}": w for f, w in zip(self.features, self.weights, strict=True)} | {
            "w_depth": self.w_depth,
            "bias": self.bias,
        }

    @classmethod
    def from_params(cls, features: Sequence[str], params: Mapping[str, Any]) -> LinearHead:
        """The head of registry parameters (missing feature weights are 0)."""
        feats = tuple(f for f in SIGNALS if f in features)
        return cls(
            feats,
            tuple(float(params.get(f"w_{f}", 0.0)) for f in feats),
            float(params.get("w_depth", 0.0)),
            float(params.get("bias", 0.0)),
        )


def _fit_head(x: dict[str, np.ndarray], depth: np.ndarray, y: np.ndarray, w: np.ndarray) -> LinearHead:
    """Weighted logistic regression (scikit-learn) on standardised features, mapped back to raw units.

    Soft labels y in [0, 1] enter as two weighted samples (label 1 with weight w*y, label 0 with w*(1-y)).
    """
    from sklearn.linear_model import LogisticRegression

    feats = tuple(f for f in SIGNALS if f in x)
    cols = [x[f] for f in feats] + [depth.astype(np.float64)]
    X = np.column_stack(cols)
    mu, sd = X.mean(axis=0), X.std(axis=0)
    sd = np.where(sd > 1e-12, sd, 1.0)
    Z = (X - mu) / sd
    ZZ = np.concatenate([Z, Z])
    yy = np.concatenate([np.ones(len(Z)), np.zeros(len(Z))])
    ww = np.concatenate([w * y, w * (1.0 - y)])
    keep = ww > 0
    if len(np.unique(yy[keep])) < 2:  # one label only: a constant head
        p = float(np.clip(np.average(y, weights=w), 1e-6, 1 - 1e-6))
        return LinearHead(feats, tuple(0.0 for _ in feats), 0.0, math.log(p / (1 - p)))
    clf = LogisticRegression(C=1.0, max_iter=500)
    clf.fit(ZZ[keep], yy[keep], sample_weight=ww[keep])
    coef = clf.coef_[0] / sd
    bias = float(clf.intercept_[0] - np.sum(clf.coef_[0] * mu / sd))
    return LinearHead(feats, tuple(float(c) for c in coef[:-1]), float(coef[-1]), bias)


def _sample_rows(n: int, max_rows: int, seed: int = 0) -> np.ndarray:
    if n <= max_rows:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=max_rows, replace=False))


class _HeadRule(StopRule):
    """A stop rule driven by a :class:`LinearHead` over the signals of the spec."""

    def __init__(self, spec: ObservationSpec, head: LinearHead, threshold: float):
        self.head = head
        self.threshold = float(threshold)
        self.needs = head.features or ("q",)
        super().__init__(spec)


class SpecDecPP(_HeadRule):
    """SpecDec++: an acceptance-prediction head; stop once P(some drafted token so far is rejected) > threshold.

    Source: K. Huang, X. Guo, M. Wang, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate
    Lengths", 2024, arXiv:2405.19715. A head predicts, for each drafted token j, the probability
    ``p_j`` that it is accepted given that tokens 1..j-1 were; drafting stops after the token where the
    predicted probability that at least one candidate so far is rejected exceeds the threshold h ::

        1 - prod_{i <= j} p_i > h

    (their stopping rule, Eq. (3) of the paper, with the threshold chosen on held-in data). Here the head
    is a logistic regression on the token's observable signals (q, and entropy and margin where the
    observation shows them) and its depth j, fitted on the train split with label rho_{t,j} and weight
    P(a >= j-1) (:meth:`fit`); h is chosen on train by the exact expected speedup (:func:`fit_peers`).

    Args:
        spec: Observation layout (lookahead >= 1, with the head's signals).
        head: The acceptance head.
        threshold: h.
    """

    def __init__(self, spec: ObservationSpec, head: LinearHead, threshold: float = 0.5):
        self.name = f"specdec++-{float(threshold):g}"
        super().__init__(spec, head, threshold)

    def stops(self, sig: Signals) -> np.ndarray:
        """Stop where ``1 - prod_{i<=j} p_i > h``."""
        return 1.0 - np.cumprod(self.head.prob(sig), axis=1) > self.threshold

    @staticmethod
    def fit(train: PositionArrays, signals: Sequence[str], max_rows: int = 8000, seed: int = 0) -> LinearHead:
        """The acceptance head on the train positions: P(draft j accepted | 1..j-1 accepted).

        One sample per (position, depth j), label rho_{t,j}, weight P(a >= j-1) (the chance that depth j
        is reached), on at most ``max_rows`` positions drawn with ``seed``.
        """
        rows = _sample_rows(len(train.q), max_rows, seed)
        sig = {s: v[rows] for s, v in array_signals(train, signals).items()}
        rho = np.asarray(train.rho[rows], dtype=np.float64)
        surv = np.asarray(train.survival()[rows], dtype=np.float64)
        reach = np.concatenate([np.ones((len(rows), 1)), surv[:, :-1]], axis=1)
        n, h = rho.shape
        depth = np.broadcast_to(np.arange(1, h + 1), (n, h))
        return _fit_head({s: v.ravel() for s, v in sig.items()}, depth.ravel(), rho.ravel(), reach.ravel())


class DISCO(_HeadRule):
    """DISCO: a classifier on the draft's confidence features decides, after each token, to continue or stop.

    Source: J. Mamou, O. Pereg, D. Korat, M. Berchansky, N. Timor, M. Wasserblat, R. Schwartz, "Dynamic
    Speculation Lookahead Accelerates Speculative Decoding of Large Language Models", 2024,
    arXiv:2405.04304. After drafting token j, a classifier over the draft's features at that token (its
    top probabilities, entropy and the token index) predicts whether speculation should continue, with
    the oracle speculation lookahead as label: continue iff the oracle would draft beyond j, i.e. iff
    the number of accepted drafts a_t > j. Drafting stops after the first token where ::

        P_continue(x_j, j) < threshold

    with the threshold tuned on held-in data. Here the classifier is a logistic regression on the
    token's observable signals (q, and entropy and margin where the observation shows them: margin
    carries the top-2 probability) and j, fitted on the train split with soft label P(a_t > j)
    (:meth:`fit`); the threshold is chosen on train by the exact expected speedup (:func:`fit_peers`).
    The paper's classifier is a small feed-forward network; a linear one stands in for it.

    Args:
        spec: Observation layout (lookahead >= 1, with the classifier's signals).
        head: The classifier.
        threshold: Stop below this probability of continuing.
    """

    def __init__(self, spec: ObservationSpec, head: LinearHead, threshold: float = 0.5):
        self.name = f"disco-{float(threshold):g}"
        super().__init__(spec, head, threshold)

    def stops(self, sig: Signals) -> np.ndarray:
        """Stop where ``P_continue(x_j, j) < threshold``."""
        return self.head.prob(sig) < self.threshold

    @staticmethod
    def fit(train: PositionArrays, signals: Sequence[str], max_rows: int = 8000, seed: int = 0) -> LinearHead:
        """The continue classifier on the train positions: label P(a_t > j) for the features of token j.

        One sample per (position, depth j = 1..kmax), unit weight (the oracle labels every drafted token),
        on at most ``max_rows`` positions drawn with ``seed``.
        """
        rows = _sample_rows(len(train.q), max_rows, seed)
        sig = {s: v[rows] for s, v in array_signals(train, signals).items()}
        surv = np.asarray(train.survival()[rows], dtype=np.float64)  # P(a >= i), i = 1..kmax
        n, h = surv.shape
        label = np.concatenate([surv[:, 1:], np.zeros((n, 1))], axis=1)  # P(a > j) = P(a >= j+1)
        depth = np.broadcast_to(np.arange(1, h + 1), (n, h))
        return _fit_head({s: v.ravel() for s, v in sig.items()}, depth.ravel(), label.ravel(), np.ones(n * h))


# --------------------------------------------------------------------------------------------------
# vLLM's rules
# --------------------------------------------------------------------------------------------------
class VLLMAdaptiveVerification(Policy):
    """vLLM's adaptive verification (DSpark) at batch 1: admit drafts while the expected goodput grows.

    Source: vLLM 0.32, ``AdaptiveVerificationManager.get_num_tokens`` in
    ``vllm/v1/worker/gpu/spec_decode/adaptive_verification.py``. The drafter proposes
    ``num_speculative_tokens`` drafts (h = kmax here) with a confidence c_j each; the survival
    probability of slot n is the running product ``S_n = prod_{j<=n} c_j``; the scores are sorted (at
    batch 1 this is the prefix order) and the draft budget is ::

        k = argmax_{n=0..h} (1 + sum_{j<=n} S_j) / (T_draft + T_verify(n))

    (``num_tokens_to_estimated_accepted_tokens / costs``; the first maximum wins). ``T_draft`` is the
    drafter's cost, constant in n (it already drafted h tokens), ``T_verify(n)`` vLLM's profiled verify
    curve by token count. Here the confidences are the draft's q, ``T_draft = T_D(h)``, and the verify
    curve is the server's cost model ``T_T(n, U(n), L)`` with U(n) the train mean per budget. The
    drafts are proposed before the budget is chosen, so the row is charged in drafting mode ``block``
    with h = kmax.

    vLLM computes the budget from *stale* confidences: the CPU copy of the previous step's confidences
    (two D2H slots, ``_stale_confidences``), reset to 1.0 for a new request. ``stale=True`` (the
    default) reproduces that: the rule uses the confidences the previous round's observation showed (all
    1 on a generation's first round); ``stale=False`` uses this round's.

    Args:
        spec: Observation layout (lookahead >= 1).
        cost_model: The server's cost model.
        u_prior: U(n) per budget (kmax+1,), e.g. the train means; default the cost model's power law.
        stale: Use the previous round's confidences, as vLLM 0.32 does.
    """

    def __init__(
        self, spec: ObservationSpec, cost_model: CostModel, u_prior: np.ndarray | None = None, stale: bool = True
    ):
        if spec.lookahead < 1:
            raise ValueError("VLLMAdaptiveVerification needs an observation with lookahead >= 1")
        from specenv.engines.base import u_prior as power_law

        h = spec.lookahead
        ks = np.arange(h + 1)
        self.cost_model = cost_model
        self.u = power_law(ks, cost_model.top_k, spec.n_experts) if u_prior is None else np.asarray(u_prior, float)
        self.u = np.asarray(self.u[: h + 1], dtype=np.float64)
        self.u[0] = cost_model.top_k
        self.stale = bool(stale)
        self.name = "vllm-adaptive-verification" + ("" if stale else "-fresh")
        self._ks = ks
        self._draft_ms = float(cost_model.draft_ms(h))
        super().__init__(spec)

    def _reset_state(self) -> None:
        self.prev_conf = np.ones(self.spec.lookahead)

    def budget(self, conf: np.ndarray, L: float) -> int:
        """The draft budget for confidences c_1..h at context length L (the rule above)."""
        surv = np.cumprod(np.asarray(conf, dtype=np.float64))
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(surv)])
        costs = self._draft_ms + self.cost_model.target_ms(self._ks, self.u, L)
        return int(np.argmax(tokens / costs))

    def _act(self, obs: np.ndarray) -> int:
        conf = self.view.conf(obs)
        used = self.prev_conf if self.stale else conf
        self.prev_conf = conf
        return self.budget(used, self.view.L(obs))


def parse_schedule(schedule: str | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """A vLLM ``num_speculative_tokens_per_batch_size`` schedule: ``[(start, end, k), ...]``.

    Accepts the list form or the text form ``"start-end:k;..."`` (e.g. ``"1-4:5;5-64:3"``; ``;`` because the
    registry's parameter list is comma-separated). Checked as vLLM
    0.32 checks it (``validate_and_normalize_dynamic_sd_schedule``): positive inclusive ranges, sorted,
    not overlapping, the first starting at 1, k >= 0.

    Raises:
        ValueError: Naming the bad entry.
    """
    if isinstance(schedule, str):
        entries = []
        for item in schedule.replace(",", ";").split(";"):
            rng, sep, k = item.partition(":")
            lo, dash, hi = rng.partition("-")
            if not sep:
                raise ValueError(f"schedule entry {item!r}: expected start-end:k")
            try:
                entries.append((int(lo), int(hi if dash else lo), int(k)))
            except ValueError:
                raise ValueError(f"schedule entry {item!r}: expected start-end:k with integers") from None
    else:
        entries = [tuple(int(v) for v in e) for e in schedule]  # type: ignore[misc]
    if not entries:
        raise ValueError("schedule: must not be empty")
    parsed = sorted(entries, key=lambda e: e[0])
    prev = 0
    for e in parsed:
        if len(e) != 3:
            raise ValueError(f"schedule entry {e!r}: expected (start, end, k)")
        lo, hi, k = e
        if lo <= 0 or hi <= 0 or lo > hi or k < 0:
            raise ValueError(f"schedule entry {e!r}: need 1 <= start <= end and k >= 0")
        if lo <= prev:
            raise ValueError("schedule: batch-size ranges must not overlap")
        prev = hi
    if parsed[0][0] != 1:
        raise ValueError("schedule: the first range must start at batch size 1")
    return parsed  # type: ignore[return-value]


class VLLMDSDTable(Policy):
    """vLLM's dynamic speculative decoding table: the budget is a function of the batch size only.

    Source: vLLM 0.32, ``SpeculativeConfig.num_speculative_tokens_per_batch_size`` and
    ``build_dynamic_sd_schedule_lookup`` in ``vllm/v1/spec_decode/dynamic/utils.py``: a list of inclusive
    batch-size ranges ``(start, end, k)``; the scheduler looks up k for the running batch size (gaps
    carry the previous range's k forward; k is capped at ``num_speculative_tokens``, here kmax). At
    batch 1, the setting of these environments, it is a constant budget chosen before drafting
    (drafting mode ``none``): the row "what users run today". The table is fitted offline on the
    train split (:func:`fit_peers`: at batch 1 the best fixed k of the train generations).

    Args:
        spec: Observation layout.
        k: The budget at batch 1 (shorthand for the schedule ``[(1, 1, k)]``).
        schedule: The schedule (list or ``"start-end:k;..."`` text), instead of ``k``.
        batch_size: The batch size to look up (1 here).
    """

    stateless = True

    def __init__(
        self,
        spec: ObservationSpec,
        k: int | None = None,
        schedule: str | Sequence[Sequence[int]] | None = None,
        batch_size: int = 1,
    ):
        if schedule is None:
            if k is None:
                raise ValueError("VLLMDSDTable needs k or a schedule")
            schedule = [(1, 1, int(k))]
        elif k is not None:  # one of them would be ignored
            raise ValueError(f"k={k!r} and schedule={schedule!r}: give one (k is the schedule 1-1:k)")
        self.schedule = parse_schedule(schedule)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        self.batch_size = int(batch_size)
        self.k = min(self.lookup(self.batch_size), spec.kmax)
        self.name = f"vllm-dsd-k{self.k}"
        super().__init__(spec)

    def lookup(self, batch_size: int) -> int:
        """K for a batch size, as vLLM's dense lookup fills it (gaps and the tail carry the last k)."""
        k = self.schedule[0][2]
        for lo, _hi, kk in self.schedule:
            if lo > batch_size:
                break
            k = kk
        return k

    def _act(self, obs: np.ndarray) -> int:
        return self.k

    def _act_rows(self, obs: np.ndarray) -> np.ndarray:
        return np.full(len(obs), self.k, dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# Fitting on the train split
# --------------------------------------------------------------------------------------------------
@dataclass
class PeerFit:
    """Everything the peers fit on the train split (:func:`fit_peers`).

    Attributes:
        kmax: Largest budget.
        signals: The signals the classifiers read (those the train table has).
        adaedl_lam: AdaEDL's lambda (None without entropy).
        adaedl_gamma: AdaEDL's gamma (the paper's 0.2).
        svip_h: SVIP's threshold on sqrt(entropy) (None without entropy).
        specdecpp: SpecDec++'s acceptance head.
        specdecpp_threshold: Its stop threshold.
        disco: DISCO's continue classifier.
        disco_threshold: Its threshold.
        dsd_k: The DSD table's budget at batch 1 (best fixed k on train).
        train_speedup: Exact expected pooled speedup on train of each fitted rule.
    """

    kmax: int
    signals: tuple[str, ...]
    adaedl_lam: float | None
    adaedl_gamma: float
    svip_h: float | None
    specdecpp: LinearHead
    specdecpp_threshold: float
    disco: LinearHead
    disco_threshold: float
    dsd_k: int
    train_speedup: dict[str, float] = field(default_factory=dict)


def best_threshold(
    train: PositionArrays,
    cost_model: CostModel,
    budgets: Callable[[float], np.ndarray],
    grid: Sequence[float],
) -> tuple[float, float]:
    """The grid value whose position-indexed budgets give the highest exact pooled speedup on ``train``.

    Each candidate is scored by :func:`oracle.dp.evaluate_policy` in drafting mode ``sequential`` with
    h = kmax (how the stop rules are charged); the first maximum wins.

    Returns:
        ``(threshold, speedup)``.
    """
    from oracle.dp import evaluate_policy

    best, best_s = float(grid[0]), -math.inf
    for thr in grid:
        k = budgets(float(thr))
        s = evaluate_policy(train, cost_model, k, lookahead=train.kmax, drafting="sequential").speedup_pooled
        if s > best_s + 1e-12:
            best, best_s = float(thr), float(s)
    return best, best_s


def fit_peers(
    train: PositionArrays,
    cost_model: CostModel,
    signals: Sequence[str] | None = None,
    best_fixed_k: int | None = None,
    gamma: float = 0.2,
    grid_size: int = 25,
) -> PeerFit:
    """Fit every peer's quantities on the **train** positions only.

    Args:
        train: The train split's positions (nothing of the test split enters).
        cost_model: The cost model the thresholds are scored with (the benchmark's train fit).
        signals: Signals the classifiers may read (default: all the table has, of :data:`SIGNALS`).
        best_fixed_k: The best fixed k on train, if already known (else computed exactly).
        gamma: AdaEDL's gamma.
        grid_size: Candidates per threshold.
    """
    from oracle.dp import evaluate_policy

    have = ("q", "ent", "margin") if train.has_signals else ("q",)
    sig_names = tuple(s for s in SIGNALS if s in (have if signals is None else signals) and s in have)
    kmax = train.kmax
    sig = array_signals(train, sig_names)
    fit: dict[str, Any] = {}
    speed: dict[str, float] = {}
    if "ent" in sig_names:
        ent = sig["ent"]
        lam_grid = np.linspace(0.0, 1.0, grid_size)
        fit["adaedl_lam"], speed["adaedl"] = best_threshold(
            train, cost_model, lambda x: first_stop(1.0 - np.sqrt(gamma * np.maximum(ent, 0.0)) < x), lam_grid
        )
        root = np.sqrt(np.maximum(ent, 0.0))
        h_grid = np.unique(np.quantile(root, np.linspace(0.02, 0.98, grid_size)))
        fit["svip_h"], speed["svip"] = best_threshold(train, cost_model, lambda x: first_stop(root > x), h_grid)
    p_grid = np.linspace(0.02, 0.98, grid_size)
    head = SpecDecPP.fit(train, sig_names)
    prob_pp = head.prob(sig)
    fit["specdecpp_threshold"], speed["specdec++"] = best_threshold(
        train, cost_model, lambda x: first_stop(1.0 - np.cumprod(prob_pp, axis=1) > x), p_grid
    )
    disco = DISCO.fit(train, sig_names)
    prob_d = disco.prob(sig)
    fit["disco_threshold"], speed["disco"] = best_threshold(train, cost_model, lambda x: first_stop(prob_d < x), p_grid)
    if best_fixed_k is None:
        fixed = [evaluate_policy(train, cost_model, k).speedup_pooled for k in range(kmax + 1)]
        best_fixed_k = int(np.argmax(fixed))
    return PeerFit(
        kmax=kmax,
        signals=sig_names,
        adaedl_lam=fit.get("adaedl_lam"),
        adaedl_gamma=gamma,
        svip_h=fit.get("svip_h"),
        specdecpp=head,
        specdecpp_threshold=fit["specdecpp_threshold"],
        disco=disco,
        disco_threshold=fit["disco_threshold"],
        dsd_k=int(best_fixed_k),
        train_speedup=speed,
    )


def spec_for(kmax: int, signals: Sequence[str]) -> ObservationSpec:
    """A minimal observation spec with lookahead kmax showing ``signals`` (for arithmetic on arrays)."""
    return _spec(kmax, kmax, tuple(signals))


def _spec(kmax: int, lookahead: int, signals: tuple[str, ...]) -> ObservationSpec:
    sig = tuple(s for s in SIGNALS if s in signals or s == "q")
    return ObservationSpec(kmax, lookahead, signals=sig)


# --------------------------------------------------------------------------------------------------
# Registry factories (entry-point group ``specenv.policies``)
# --------------------------------------------------------------------------------------------------
def _train_fit(spec: ObservationSpec, dataset: str, cost_model: str) -> tuple[PositionArrays, CostModel]:
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    ts = load_dataset(dataset)
    return select_positions(ts, spec.kmax, "train"), cost_model_for(ts, cost_model)


def _need_lookahead(spec: ObservationSpec, cls: type) -> None:
    """A stop rule reads the draft's signals: refuse a spec without them before anything is fitted."""
    if spec.lookahead < 1:
        raise ValueError(f"{cls.__name__} needs an observation with lookahead >= 1 (drafting mode sequential or block)")


@declare(lam=PROBABILITY, gamma=Param(float, 0.0, open_lo=True), dataset=TEXT, cost_model=TEXT)
def make_adaedl(
    spec: ObservationSpec,
    lam: float | None = None,
    gamma: float = 0.2,
    dataset: str = DEFAULT_FIT_DATASET,
    cost_model: str = "fit-train",
) -> AdaEDL:
    """``adaedl[:lam=..,gamma=..]``: lambda as given, else fitted on ``dataset``'s train split."""
    _need_lookahead(spec, AdaEDL)
    if lam is None:
        train, model = _train_fit(spec, dataset, cost_model)
        lam = fit_peers(train, model, ("q", "ent"), best_fixed_k=0, gamma=gamma).adaedl_lam
    return AdaEDL(spec, lam=float(lam), gamma=gamma)  # type: ignore[arg-type]


@declare(h=NONNEGATIVE, dataset=TEXT, cost_model=TEXT)
def make_svip(
    spec: ObservationSpec, h: float | None = None, dataset: str = DEFAULT_FIT_DATASET, cost_model: str = "fit-train"
) -> SVIP:
    """``svip[:h=..]``: h as given, else fitted on ``dataset``'s train split."""
    _need_lookahead(spec, SVIP)
    if h is None:
        train, model = _train_fit(spec, dataset, cost_model)
        h = fit_peers(train, model, ("q", "ent"), best_fixed_k=0).svip_h
    return SVIP(spec, h=float(h))  # type: ignore[arg-type]


def _head_factory(kind: str) -> Callable[..., StopRule]:
    cls: type[SpecDecPP] | type[DISCO] = SpecDecPP if kind == "specdec++" else DISCO

    def make(
        spec: ObservationSpec,
        threshold: float | None = None,
        dataset: str = DEFAULT_FIT_DATASET,
        cost_model: str = "fit-train",
        **weights: float,
    ) -> StopRule:
        bad = [w for w in weights if w not in ("w_q", "w_ent", "w_margin", "w_depth", "bias")]
        if bad:
            raise ValueError(f"unknown parameter(s) {', '.join(bad)}")
        _need_lookahead(spec, cls)
        shown = spec_signals(spec)
        if weights:  # a head given by its weights
            feats = tuple(s for s in SIGNALS if f"w_{s}" in weights)
            head = LinearHead.from_params(feats, weights)
            return cls(spec, head, 0.5 if threshold is None else float(threshold))
        train, model = _train_fit(spec, dataset, cost_model)
        pf = fit_peers(train, model, shown, best_fixed_k=0)
        head = pf.specdecpp if kind == "specdec++" else pf.disco
        thr = pf.specdecpp_threshold if kind == "specdec++" else pf.disco_threshold
        return cls(spec, head, thr if threshold is None else float(threshold))

    make.__doc__ = (
        f"``{kind}[:threshold=..,dataset=..]`` or ``{kind}:w_q=..,w_depth=..,bias=..,threshold=..``: "
        "the head fitted on the data set's train split with the signals the spec shows, or given by its weights."
    )
    return make


_HEAD_PARAMS = dict(
    threshold=PROBABILITY, dataset=TEXT, cost_model=TEXT, w_q=REAL, w_ent=REAL, w_margin=REAL, w_depth=REAL, bias=REAL
)
make_specdecpp = declare(**_HEAD_PARAMS)(_head_factory("specdec++"))
make_disco = declare(**_HEAD_PARAMS)(_head_factory("disco"))


@declare(stale=FLAG, dataset=TEXT, cost_model=TEXT)
def make_vllm_adaptive(
    spec: ObservationSpec, stale: bool = True, dataset: str = DEFAULT_FIT_DATASET, cost_model: str = "fit-train"
) -> VLLMAdaptiveVerification:
    """``vllm-adaptive-verification[:stale=..,dataset=..]``: the server's cost model and train U(k) of ``dataset``."""
    train, model = _train_fit(spec, dataset, cost_model)
    return VLLMAdaptiveVerification(spec, model, u_prior=train.U.mean(axis=0), stale=stale)


@declare(("k", "schedule"), k=BUDGET, schedule=TEXT, batch_size=COUNT, dataset=TEXT, cost_model=TEXT)
def make_vllm_dsd(
    spec: ObservationSpec,
    k: int | None = None,
    schedule: str | None = None,
    batch_size: int = 1,
    dataset: str = DEFAULT_FIT_DATASET,
    cost_model: str = "fit-train",
) -> VLLMDSDTable:
    """``vllm-dsd-table[:k=..|schedule=..]``: as given, else k = the best fixed k on ``dataset``'s train split."""
    if k is None and schedule is None:
        from oracle.dp import evaluate_policy

        train, model = _train_fit(spec, dataset, cost_model)
        k = int(np.argmax([evaluate_policy(train, model, kk).speedup_pooled for kk in range(spec.kmax + 1)]))
    return VLLMDSDTable(spec, k=k, schedule=schedule, batch_size=batch_size)
