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

__all__ = ["AcceptanceBelief", "BeliefOracle", "belief_oracle", "fit_belief"]

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


def belief_oracle(
    test: PositionArrays,
    cost_model: Charge,
    belief: AcceptanceBelief,
    lookahead: int = 0,
    drafting: str | None = None,
) -> BeliefOracle:
    """Solve the SSP on ``belief``'s acceptances of ``test``, and evaluate that plan on the true ones."""
    rho_hat = belief.predict(test)
    believed = replace(test, rho=rho_hat, greedy=bool(np.all((rho_hat == 0.0) | (rho_hat == 1.0))))
    planned = solve(believed, cost_model, lookahead=lookahead, drafting=drafting)
    realised = evaluate_policy(test, cost_model, planned.k, lookahead=lookahead, drafting=drafting)
    return BeliefOracle(belief, planned, realised)
