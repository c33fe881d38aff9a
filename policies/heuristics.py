"""Published budget-selection heuristics, each a faithful reimplementation of its source's rule.

All of them act on observations only (see :mod:`specenv.policy.base`). Costs are read from the cost model
a server would have fitted (:class:`specenv.cost.model.CostModel`), never from the trace.
"""

from __future__ import annotations

import math

import numpy as np

from specenv.cost.model import CostModel
from specenv.engines.base import u_prior
from specenv.observation.single import ObservationSpec
from specenv.policy.base import Policy
from specenv.policy.registry import BUDGET, BUDGETS, COUNT, FLAG, NONNEGATIVE, PROBABILITY, declare


@declare(k=BUDGET)
class FixedK(Policy):
    """Always verify k drafts (vLLM's ``num_speculative_tokens``; k = 0 is plain decoding).

    Args:
        spec: Observation layout.
        k: The budget.
    """

    #: The same k for every stream: a server may ask it for its whole batch at once.
    stateless = True
    #: Reads no observation (the protocol's ``observes``): a server need not build any.
    observes = False

    def __init__(self, spec: ObservationSpec, k: int):
        if not 0 <= k <= spec.kmax:
            raise ValueError(f"k={k} outside 0..{spec.kmax}")
        self.k = k
        self.name = f"fixed-k{k}"
        super().__init__(spec)

    def _act(self, obs: np.ndarray) -> int:
        return self.k

    def _act_rows(self, obs: np.ndarray) -> np.ndarray:
        return np.full(len(obs), self.k, dtype=np.int64)


@declare(start=COUNT)
class TransformersHeuristic(Policy):
    """transformers' assisted-generation ``num_assistant_tokens_schedule="heuristic"``.

    Source: ``AssistedCandidateGenerator.update_candidate_strategy`` in
    ``transformers/generation/candidate_generator.py``: if every candidate was accepted,
    ``num_assistant_tokens += 2``, else ``num_assistant_tokens = max(1, num_assistant_tokens - 1)``;
    the schedule starts at ``num_assistant_tokens`` (default 20), here capped at kmax.

    Args:
        spec: Observation layout.
        start: Initial number of assistant tokens.
    """

    name = "transformers-heuristic"

    def __init__(self, spec: ObservationSpec, start: int = 20):
        self.start = start
        super().__init__(spec)

    def _reset_state(self) -> None:
        self.n = float(self.start)

    def _act(self, obs: np.ndarray) -> int:
        if not self.view.first_round(obs):
            k, a = self.view.prev_k(obs), self.view.prev_accepted(obs)
            if k >= 1 and a == k:
                self.n += 2.0
            else:
                self.n = max(1.0, self.n - 1.0)
        return int(min(self.n, self.spec.kmax))


def roc_threshold(labels: np.ndarray | list[int], scores: np.ndarray | list[float], fn_weight: float = 3.0) -> float:
    """The ROC threshold minimising ``fpr + fn_weight * fnr``, as scikit-learn's ``roc_curve`` finds it.

    The same computation as ``fpr, tpr, thr = sklearn.metrics.roc_curve(labels, scores)`` followed by
    ``thr[argmin(fpr + fn_weight * (1 - tpr))]`` (transformers' ``update_candidate_strategy``),
    in numpy without scikit-learn's validation, bit for bit: the ROC points at the distinct scores
    in decreasing order, the collinear points dropped as ``drop_intermediate=True`` does, the
    point (0, 0) with threshold +inf in front, and the first minimum wins ties.

    Args:
        labels: 0/1 labels (1 = the drafted token was accepted); both values must occur.
        scores: The scores (draft confidences), one per label.
        fn_weight: Weight of the false-negative rate.

    Returns:
        The chosen threshold (``inf`` when the best point is (0, 0)).
    """
    y = np.asarray(labels, dtype=np.float64)
    x = np.asarray(scores, dtype=np.float64)
    order = np.argsort(x, kind="stable")[::-1]
    x, y = x[order], y[order]
    # the last index of each run of equal scores, and of the array
    idx = np.append(np.flatnonzero(np.diff(x)), x.size - 1)
    tps = np.cumsum(y)[idx]
    fps = 1.0 + idx.astype(np.float64) - tps
    thr = x[idx]
    if len(fps) > 2:
        keep = np.flatnonzero(np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True])
        fps, tps, thr = fps[keep], tps[keep], thr[keep]
    fpr = np.append(0.0, fps) / fps[-1]
    tpr = np.append(0.0, tps) / tps[-1]
    i = int(np.argmin(fpr + fn_weight * (1.0 - tpr)))
    return math.inf if i == 0 else float(thr[i - 1])


@declare(threshold=PROBABILITY, adaptive=FLAG)
class ConfidenceThreshold(Policy):
    """Stop drafting when the draft's probability of its token falls below a threshold.

    Source: transformers' ``assistant_confidence_threshold`` (default 0.4) with its
    ``ConfidenceCriteria`` stopping rule: drafting stops after the first token whose probability is
    below the threshold (that token is still proposed). With ``adaptive=True`` the threshold is refit
    after every round as in ``update_candidate_strategy``: the drafted tokens' probabilities and
    match labels are kept, and once there are more than 5 samples with both labels present, the ROC
    curve gives the threshold minimising ``fpr + 3*fnr`` (:func:`roc_threshold`: scikit-learn's
    ``roc_curve`` choice, computed in numpy).

    Needs an environment with ``lookahead >= 1`` (the confidences are in the observation).

    Args:
        spec: Observation layout (lookahead > 0).
        threshold: Initial threshold.
        adaptive: Refit the threshold by ROC.
    """

    def __init__(self, spec: ObservationSpec, threshold: float = 0.4, adaptive: bool = False):
        if spec.lookahead < 1:
            raise ValueError("ConfidenceThreshold needs an observation with lookahead >= 1")
        self.threshold0 = threshold
        self.adaptive = adaptive
        self.name = "confidence-roc" if adaptive else f"confidence-{threshold:g}"
        super().__init__(spec)

    def _reset_state(self) -> None:
        self.threshold = self.threshold0
        self.probs: list[float] = []
        self.matches: list[int] = []
        self._pending: list[float] = []

    def _act(self, obs: np.ndarray) -> int:
        if self.adaptive and not self.view.first_round(obs) and self._pending:
            a = self.view.prev_accepted(obs)
            self.probs.extend(self._pending)
            self.matches.extend([1] * a)
            if len(self._pending) > a:
                self.matches.append(0)
            del self.probs[len(self.matches) :]
            if len(self.probs) > 5 and {0, 1} <= set(self.matches):
                self.threshold = min(roc_threshold(self.matches, self.probs), 1.0)
        conf = self.view.conf(obs)
        k = len(conf)
        for j, q in enumerate(conf, start=1):
            if q < self.threshold:
                k = j
                break
        k = min(k, self.spec.kmax)
        self._pending = [float(x) for x in conf[:k]]
        return k


class UPredictor:
    """Predicted unique experts U(k) from running per-k means of observed U.

    Before k has been observed in the generation, U(k) is the prior (``prior[k]``) scaled by the
    mean ratio observed/prior over the budgets already seen. The prior defaults to the concave
    power law ``top_k * (k+1)**0.62`` (close to the paper's Table 4) and is usually replaced by the
    per-k mean of U on the train split.
    """

    def __init__(self, kmax: int, top_k: int, n_experts: int, prior: np.ndarray | None = None):
        ks = np.arange(kmax + 1)
        self.prior = u_prior(ks, top_k, n_experts) if prior is None else np.asarray(prior, float)
        self.prior[0] = top_k
        self.reset()

    def reset(self) -> None:
        """Forget observations."""
        self.sum = np.zeros_like(self.prior)
        self.n = np.zeros_like(self.prior)

    def observe(self, k: int, U: float) -> None:
        """Record the unique experts of a round with budget k."""
        self.sum[k] += U
        self.n[k] += 1

    def predict(self) -> np.ndarray:
        """(kmax+1,) predicted U for every budget."""
        seen = self.n > 0
        pred = self.prior.copy()
        if seen[1:].any():
            r = (self.sum[seen] / self.n[seen]) / self.prior[seen]
            ratio = r.sum() / r.size  # np.mean's own arithmetic, without its Python wrapper
            pred = pred * ratio
            pred[seen] = self.sum[seen] / self.n[seen]
        pred[0] = self.prior[0]
        return pred


class AcceptanceEstimator:
    """Per-depth conditional acceptance rho_hat_j with a prior and exponential forgetting.

    After a round with budget k and a accepted drafts, depth j was *reached* when k >= j and
    a >= j-1, and *accepted* when a >= j. rho_hat_j = (s_j + n0 * prior_j) / (n_j + n0) with
    s_j, n_j the forgetting-weighted successes and trials. Evidence ages every round, also in k = 0
    rounds that carry no information, so after a bad stretch the estimate drifts back to the prior
    and the policy speculates again instead of staying at k = 0 for lack of data.

    Args:
        kmax: Largest depth.
        prior: (kmax,) prior conditional acceptance per depth (e.g. train-split means of rho).
        strength: Prior weight n0 in pseudo-rounds.
        forget: Weight of the past per round (1 = no forgetting).
    """

    def __init__(self, kmax: int, prior: np.ndarray | None = None, strength: float = 2.0, forget: float = 0.9):
        self.prior = np.full(kmax, 0.7) if prior is None else np.asarray(prior, dtype=float)[:kmax].copy()
        self.strength = strength
        self.forget = forget
        self.j = np.arange(1, kmax + 1)
        self._j1 = self.j - 1
        self.reset()

    def reset(self) -> None:
        """Forget observations."""
        self.s = np.zeros_like(self.prior)
        self.n = np.zeros_like(self.prior)

    def observe(self, k: int, a: int) -> None:
        """Fold in one round (evidence of every depth ages by ``forget`` each round, k = 0 included)."""
        self.s *= self.forget
        self.n *= self.forget
        reached = (k >= self.j) & (a >= self._j1)
        self.s += reached & (a >= self.j)
        self.n += reached

    def rho(self) -> np.ndarray:
        """(kmax,) current estimates."""
        return (self.s + self.strength * self.prior) / (self.n + self.strength)

    def pooled(self) -> float:
        """The per-token acceptance rate pooled over depths, with the prior's mean as prior.

        ``(sum_j s_j + n0 * mean(prior)) / (sum_j n_j + n0)``: accepted drafts over drafts that reached
        verification, summed over depths (the acceptance rate alpha of the goodput rules).
        """
        return float((self.s.sum() + self.strength * self.prior.mean()) / (self.n.sum() + self.strength))


class _CostAware(Policy):
    """Shared plumbing: a cost model and a U predictor fed from the observations."""

    def __init__(self, spec: ObservationSpec, cost_model: CostModel, u_prior: np.ndarray | None = None):
        self.cost_model = cost_model
        self.u_prior = u_prior
        self.ks = np.arange(spec.kmax + 1)
        super().__init__(spec)
        self._round_terms = self._price_terms()  # on the policy object: every stream shares it

    def _reset_state(self) -> None:
        self.upred = UPredictor(self.spec.kmax, self.cost_model.top_k, self.spec.n_experts, self.u_prior)

    def _price_terms(self) -> tuple[CostModel, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The cost model's terms of every budget 0..kmax (:meth:`_round_ms`): its own, and its own arithmetic."""
        cm, ks = self.cost_model, self.ks
        over = cm.overhead[ks] if cm.overhead.any() else None
        return cm, cm.beta0[ks], cm.alpha[ks], cm.c[ks], cm.draft_ms(ks), over

    def _observe(self, obs: np.ndarray) -> None:
        if not self.view.first_round(obs):
            self.upred.observe(self.view.prev_k(obs), self.view.prev_U(obs))

    def _round_ms(self, obs: np.ndarray) -> np.ndarray:
        """``cost_model.round_ms(ks, U(k), L)`` for every budget: its terms per k taken once, its sums in its order."""
        terms = self._round_terms
        if terms[0] is not self.cost_model:  # the cost model was replaced
            terms = self._round_terms = self._price_terms()
        _, b0, al, c, td, over = terms
        cost = b0 + al * self.upred.predict() + c * self.view.L(obs) + td  # CostModel.charged_ms, k drafted
        return cost if over is None else cost + over


class GoodputRule(_CostAware):
    """SmartSpec / TurboSpec goodput rule.

    Source: Liu et al., "Optimizing Speculative Decoding for Serving Large Language Models Using
    Goodput" (SmartSpec, 2024) and TurboSpec (2025): estimate the token acceptance rate alpha as a
    moving average of accepted/proposed, predict the tokens a round of k commits as
    ``(1 - alpha**(k+1)) / (1 - alpha)``, predict the round time from the fitted cost model, and pick
    the k with the largest goodput (tokens per ms). Here the cost model is the paper's per-K MoE
    form, with U(k) from running per-k means of observed U.

    The acceptance rate is the pooled per-token rate of
    :class:`AcceptanceEstimator` (the delta rule's estimator): accepted drafts over drafts that
    reached verification, summed over depths, with the estimator's prior and forgetting. Its
    evidence ages every round, k = 0 rounds included, so a run of k = 0 (which shows no acceptance)
    drifts alpha back to the prior and the rule speculates again; a moving average updated only on
    k >= 1 rounds (the observation's ``acc_rate``) would stay at k = 0 for good once it got there.

    Args:
        spec: Observation layout.
        cost_model: The server's cost model.
        u_prior: Prior U(k) per budget (e.g. train-split means).
        rho_prior: Prior conditional acceptance per depth (e.g. train-split means of rho); its mean
            is the prior of alpha.
        forget: Weight of the past acceptance evidence per round.
    """

    name = "goodput"

    def __init__(
        self,
        spec: ObservationSpec,
        cost_model: CostModel,
        u_prior: np.ndarray | None = None,
        rho_prior: np.ndarray | None = None,
        forget: float = 0.9,
    ):
        self.rho_prior = rho_prior
        self.forget = forget
        super().__init__(spec, cost_model, u_prior)

    def _reset_state(self) -> None:
        super()._reset_state()
        self.acc = AcceptanceEstimator(self.spec.kmax, self.rho_prior, forget=self.forget)

    def alpha(self) -> float:
        """Current per-token acceptance rate (pooled over depths, with the prior's mean as prior)."""
        return self.acc.pooled()

    def _act(self, obs: np.ndarray) -> int:
        self._observe(obs)
        if not self.view.first_round(obs):
            self.acc.observe(self.view.prev_k(obs), self.view.prev_accepted(obs))
        alpha = min(max(self.alpha(), 1e-6), 1 - 1e-6)
        tokens = (1.0 - alpha ** (self.ks + 1)) / (1.0 - alpha)
        return int(np.argmax(tokens / self._round_ms(obs)))


@declare(candidates=BUDGETS, test_rounds=COUNT, set_rounds=COUNT)
class CascadeUtility(Policy):
    """Cascade-style utility controller with test and set phases.

    Source: the utility-driven speculation control of "Cascade" (dynamic speculation for MoE serving,
    2025): alternate a *test phase*, which tries each candidate k for a few rounds and measures its
    utility (tokens committed per unit cost, relative to plain decoding), and a *set phase*, which keeps
    the best k; speculation is turned off (k = 0) for the set phase when the best utility is < 1.
    Utility uses the observed round cost in AR-step units, so utility 1 equals plain decoding.

    Args:
        spec: Observation layout.
        candidates: Budgets tried in a test phase.
        test_rounds: Rounds per candidate in a test phase.
        set_rounds: Rounds of a set phase.
    """

    name = "cascade"

    def __init__(
        self,
        spec: ObservationSpec,
        candidates: tuple[int, ...] = (1, 2, 4, 6, 8),
        test_rounds: int = 2,
        set_rounds: int = 24,
    ):
        self.candidates = tuple(k for k in candidates if k <= spec.kmax)
        if (
            not self.candidates
        ):  # it could not act: refused when built (a server's pre-start check), not at its first round
            raise ValueError(f"candidates={tuple(candidates)}: none is <= kmax={spec.kmax}")
        self.test_rounds = test_rounds
        self.set_rounds = set_rounds
        super().__init__(spec)

    def _reset_state(self) -> None:
        self.schedule = [k for k in self.candidates for _ in range(self.test_rounds)]
        self.tokens = {k: 0.0 for k in self.candidates}
        self.cost = {k: 0.0 for k in self.candidates}
        self.pos = 0
        self.best = self.candidates[0]
        self.in_test = True

    def _act(self, obs: np.ndarray) -> int:
        if not self.view.first_round(obs) and self.in_test and self.pos > 0:
            k = self.schedule[self.pos - 1]
            self.tokens[k] += self.view.prev_accepted(obs) + 1
            self.cost[k] += self.view.prev_cost(obs)
        if self.in_test and self.pos >= len(self.schedule):
            util = {k: self.tokens[k] / self.cost[k] for k in self.candidates if self.cost[k] > 0}
            best = max(util, key=util.get)
            self.best = best if util[best] >= 1.0 else 0
            self.in_test, self.pos = False, 0
        if not self.in_test:
            self.pos += 1
            if self.pos >= self.set_rounds:
                self.in_test, self.pos = True, 0
                self.tokens = {k: 0.0 for k in self.candidates}
                self.cost = {k: 0.0 for k in self.candidates}
            return self.best
        k = self.schedule[self.pos]
        self.pos += 1
        return k


@declare(arms=BUDGETS, c=NONNEGATIVE)
class UCBBandit(Policy):
    """UCB1 bandit over the budget (BanditSpec's UCBSpec).

    Source: Hou et al., "BanditSpec: Adaptive Speculative Decoding via Bandit Algorithms" (2025),
    UCBSpec: each arm is a speculation configuration (here a budget k), the reward of a round is
    its throughput (tokens committed per unit time, here per AR-step unit so rewards are O(1)), and
    the arm maximising ``mean + c * sqrt(2 ln n / n_k)`` is played, every arm once first.

    Args:
        spec: Observation layout.
        arms: Budgets to choose from (default 0..kmax).
        c: Exploration constant.
    """

    name = "ucb"

    def __init__(self, spec: ObservationSpec, arms: tuple[int, ...] | None = None, c: float = 0.5):
        self.arms = tuple(range(spec.kmax + 1)) if arms is None else tuple(arms)
        if not self.arms or max(self.arms) > spec.kmax:
            raise ValueError(f"arms={self.arms}: every arm is a budget in 0..kmax={spec.kmax}")
        self.c = c
        super().__init__(spec)

    def _reset_state(self) -> None:
        self.sum = np.zeros(len(self.arms))
        self.n = np.zeros(len(self.arms))
        self.last: int | None = None

    def _act(self, obs: np.ndarray) -> int:
        if not self.view.first_round(obs) and self.last is not None:
            reward = (self.view.prev_accepted(obs) + 1) / max(self.view.prev_cost(obs), 1e-9)
            self.sum[self.last] += reward
            self.n[self.last] += 1
        untried = np.flatnonzero(self.n == 0)
        if untried.size:
            i = int(untried[0])
        else:
            total = self.n.sum()
            ucb = self.sum / self.n + self.c * np.sqrt(2.0 * math.log(total) / self.n)
            i = int(np.argmax(ucb))
        self.last = i
        return self.arms[i]
