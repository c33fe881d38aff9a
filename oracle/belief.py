"""The belief oracle: the exact SSP on the acceptance probabilities a calibrated train-split model predicts.

The SSP bound of :mod:`oracle.dp` is clairvoyant: on greedy traces its ``rho`` is 0/1, so it knows
which drafts will be accepted, which no controller can. The belief oracle replaces every
``rho[t, j]`` by what a model fitted on the *train* split predicts from what a controller can
observe of the draft (:class:`AcceptanceBelief`: the conditional acceptance rate of depth j in a
bin of its confidence ``q[t, j]``, or of the depth alone with ``signals=()``), solves the SSP on
those beliefs (:func:`solve` of :mod:`oracle.dp`), and evaluates the plan it finds exactly on the
true acceptances (:func:`evaluate_policy`).

**A reference, not a bound.** Neither of its two figures bounds what a non-anticipative controller
can reach: the belief plan's true cost is the cost of one particular controller (any better one
beats it), and its value under the beliefs is only an expectation under the model (a controller
with more information than the model's features, e.g. the acceptance history of the generation, or
a model that is miscalibrated on the test generations, can do better than it predicts). It also
still sees the generation's future contexts and expert counts, as the clairvoyant bound does. An
upper bound valid for every non-anticipative policy (an information-relaxation dual bound with a
penalty for using future acceptances) needs the true law of the acceptances given the observation;
greedy traces record one outcome per position, not that law, so such a bound would hold for the
fitted model, not for the traces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from oracle.dp import Evaluation, evaluate_policy, solve
from specenv.cost.model import Charge
from specenv.traces.traceset import PositionArrays, survival_table

__all__ = [
    "AcceptanceBelief",
    "BeliefOracle",
    "DraftBelief",
    "belief_oracle",
    "believed",
    "fit_belief",
    "fit_draft_belief",
]

#: Confidence bins per depth of the default belief (quantiles of the train split's confidences).
N_BINS = 16


@dataclass(frozen=True)
class AcceptanceBelief:
    """P(draft j accepted | drafts 1..j-1 accepted, the draft's confidence q_j in a bin), per depth j.

    Attributes:
        edges: (kmax, n_bins - 1) inner bin edges of ``q`` per depth (empty with ``signals=()``).
        rate: (kmax, n_bins) conditional acceptance rate per depth and bin (train-split frequencies).
        signals: ``("q",)`` (the draft's confidence) or ``()`` (the depth alone).
    """

    edges: np.ndarray
    rate: np.ndarray
    signals: tuple[str, ...]

    def predict(self, arrays: PositionArrays) -> np.ndarray:
        """(n, kmax) believed conditional acceptances of a positions table."""
        K = self.rate.shape[0]
        if arrays.kmax > K:
            raise ValueError(f"belief fitted for Kmax={K}, the positions need Kmax={arrays.kmax}")
        out = np.empty((len(arrays.L), arrays.kmax))
        for j in range(arrays.kmax):
            b = np.searchsorted(self.edges[j], arrays.q[:, j], side="right") if self.signals else 0
            out[:, j] = self.rate[j, b]
        return out


def fit_belief(train: PositionArrays, signals: tuple[str, ...] = ("q",), n_bins: int = N_BINS) -> AcceptanceBelief:
    """The calibrated belief of a train split: binned conditional acceptance frequencies per depth.

    The rate of depth j in a bin is ``sum rho_j S_{j-1} / sum S_{j-1}`` over the bin's rows, with
    ``S_{j-1}`` the probability that drafts 1..j-1 were accepted (1 at j = 1): the frequency of
    acceptance among the rounds that reached depth j, which is what ``rho_j`` is conditional on.
    A bin no round reached takes its depth's overall rate. The bins are the quantiles of ``q_j``,
    so the fit is a histogram calibration (calibrated on the train split by construction).

    Raises:
        ValueError: If ``signals`` is not ``("q",)`` or ``()``, or the split reaches some depth never.
    """
    if signals not in (("q",), ()):
        raise ValueError(f"signals={signals!r}: the belief reads ('q',) or nothing ()")
    K = train.kmax
    reach = np.ones_like(train.rho)
    reach[:, 1:] = survival_table(train.rho)[:, :-1]
    nb = n_bins if signals else 1
    edges = np.zeros((K, nb - 1))
    rate = np.zeros((K, nb))
    for j in range(K):
        w, hit = reach[:, j], train.rho[:, j] * reach[:, j]
        if w.sum() <= 0.0:
            raise ValueError(f"no train round reaches draft depth {j + 1}: the belief cannot be fitted")
        overall = hit.sum() / w.sum()
        if signals:
            edges[j] = np.quantile(train.q[:, j], np.linspace(0.0, 1.0, nb + 1)[1:-1])
        b = np.searchsorted(edges[j], train.q[:, j], side="right") if signals else np.zeros(len(w), dtype=np.int64)
        num, den = np.bincount(b, hit, minlength=nb), np.bincount(b, w, minlength=nb)
        rate[j] = np.where(den > 0.0, num / np.where(den > 0.0, den, 1.0), overall)
    return AcceptanceBelief(edges, np.clip(rate, 0.0, 1.0), tuple(signals))


@dataclass(frozen=True)
class DraftBelief:
    """What a controller can believe of a round's acceptances once it has seen its first n drafts' confidences.

    A stop rule (drafting mode sequential) decides after each draft whether to draft one more; when
    it has drafted n tokens it has seen their confidences ``q_1..q_n`` and none of the later ones. A
    controller of mode block with lookahead h decides having seen ``q_1..q_h``, one of mode none
    having seen none (n = 0). Its belief of the conditional acceptance of depth j is then:

    * j <= n: the calibration of :class:`AcceptanceBelief` on the draft's own confidence ``q_j``;
    * j > n, n >= 1: the acceptance rate of depth j (among rounds that reached it) in a bin of the
      last confidence seen, ``q_n`` (the drafts' confidences are correlated along a round);
    * j > n, n = 0: the depth's overall rate (nothing of the round seen yet).

    At n = kmax it is :class:`AcceptanceBelief`'s on ``("q",)``, at n = 0 its on ``()``.

    Every rate is a train-split frequency (:func:`fit_draft_belief`). The belief does not read the
    generation's acceptance history (a controller's own past rounds, which depend on the controller).

    Attributes:
        seen: The calibration on the draft's own confidence (depths already drafted).
        prior: (kmax,) overall conditional acceptance rate per depth (n = 0).
        edges: (kmax - 1, n_bins - 1) inner bin edges of ``q_n`` for n = 1..kmax-1 (row n - 1).
        rate: (kmax - 1, kmax, n_bins) acceptance rate of depth j given ``q_n``'s bin (row n - 1);
            only the depths j > n are read.
    """

    seen: AcceptanceBelief
    prior: np.ndarray
    edges: np.ndarray
    rate: np.ndarray

    def predict(self, arrays: PositionArrays, rows: np.ndarray, n: int) -> np.ndarray:
        """(len(rows), kmax) believed conditional acceptances at ``rows`` having seen ``n`` drafts' confidences."""
        K = arrays.kmax
        if not 0 <= n <= K or K > len(self.prior):
            raise ValueError(f"draft belief: n={n} seen is outside 0..{K} (fitted for Kmax={len(self.prior)})")
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), K))
        for j in range(n):
            b = np.searchsorted(self.seen.edges[j], arrays.q[rows, j], side="right")
            out[:, j] = self.seen.rate[j, b]
        if n == 0:
            out[:] = self.prior[None, :K]
        elif n < K:
            b = np.searchsorted(self.edges[n - 1], arrays.q[rows, n - 1], side="right")
            out[:, n:] = self.rate[n - 1, n:K, :][:, b].T
        return out


def fit_draft_belief(train: PositionArrays, n_bins: int = N_BINS) -> DraftBelief:
    """The :class:`DraftBelief` of a train split: binned acceptance frequencies, as :func:`fit_belief`'s.

    The rate of depth j given the bin of ``q_n`` is ``sum rho_j S_{j-1} / sum S_{j-1}`` over the
    rows of the bin (the frequency of acceptance among the rounds that reached depth j); an empty
    bin takes the depth's overall rate.

    Raises:
        ValueError: If the split reaches some depth never (as :func:`fit_belief`).
    """
    seen = fit_belief(train, ("q",), n_bins)
    K = train.kmax
    reach = np.ones_like(train.rho)
    reach[:, 1:] = survival_table(train.rho)[:, :-1]
    hit = train.rho * reach
    prior = hit.sum(axis=0) / reach.sum(axis=0)  # > 0 everywhere: fit_belief checked every depth is reached
    edges = np.zeros((max(K - 1, 0), n_bins - 1))
    rate = np.zeros((max(K - 1, 0), K, n_bins))
    for n in range(1, K):
        edges[n - 1] = np.quantile(train.q[:, n - 1], np.linspace(0.0, 1.0, n_bins + 1)[1:-1])
        b = np.searchsorted(edges[n - 1], train.q[:, n - 1], side="right")
        for j in range(n, K):
            num = np.bincount(b, hit[:, j], minlength=n_bins)
            den = np.bincount(b, reach[:, j], minlength=n_bins)
            rate[n - 1, j] = np.where(den > 0.0, num / np.where(den > 0.0, den, 1.0), prior[j])
    return DraftBelief(seen, np.clip(prior, 0.0, 1.0), edges, np.clip(rate, 0.0, 1.0))


@dataclass
class BeliefOracle:
    """The belief oracle on a positions table.

    Attributes:
        belief: The acceptance model the plan was solved on.
        planned: The SSP solved on the believed acceptances (its ``cost``: the expected cost under the belief).
        realised: The plan (its budget per position) evaluated exactly on the true acceptances.
    """

    belief: AcceptanceBelief
    planned: Evaluation
    realised: Evaluation


def believed(arrays: PositionArrays, belief: AcceptanceBelief) -> PositionArrays:
    """The positions table with every ``rho[t, j]`` replaced by ``belief``'s prediction (the rest unchanged)."""
    rho_hat = belief.predict(arrays)
    return replace(arrays, rho=rho_hat, greedy=bool(np.all((rho_hat == 0.0) | (rho_hat == 1.0))))


def belief_oracle(
    test: PositionArrays,
    cost_model: Charge,
    belief: AcceptanceBelief,
    lookahead: int = 0,
    drafting: str | None = None,
) -> BeliefOracle:
    """Solve the SSP on ``belief``'s acceptances of ``test``, and evaluate that plan on the true ones."""
    planned = solve(believed(test, belief), cost_model, lookahead=lookahead, drafting=drafting)
    realised = evaluate_policy(test, cost_model, planned.k, lookahead=lookahead, drafting=drafting)
    return BeliefOracle(belief, planned, realised)
