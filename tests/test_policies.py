"""Each baseline's rule on hand-made observation sequences."""

from __future__ import annotations

import numpy as np
import pytest

from policies.delta import DeltaSpaceRule
from policies.heuristics import (
    AcceptanceEstimator,
    CascadeUtility,
    ConfidenceThreshold,
    FixedK,
    GoodputRule,
    TransformersHeuristic,
    UCBBandit,
    UPredictor,
)
from specenv.cost.model import CostModel
from specenv.observation.single import ObservationSpec, ObservationState
from specenv.policy.base import ObsView

SPEC = ObservationSpec(kmax=10, lookahead=0)
SPEC_H = ObservationSpec(kmax=10, lookahead=10)
CM = CostModel.paper_profile(10)


class Stream:
    """Builds the observations a policy would see after a chosen sequence of rounds."""

    def __init__(self, spec: ObservationSpec = SPEC, L0: float = 600.0):
        self.spec = spec
        self.state = ObservationState(spec, 1)
        self.L = L0
        self.t = 0

    def obs(self, conf: list[float] | None = None) -> np.ndarray:
        c = None if conf is None else np.array([conf], dtype=np.float64)
        return self.state.build(np.array([self.L]), np.array([self.t]), c)[0]

    def round(self, k: int, a: int, U: float = 16.0, cost: float = 1.5) -> None:
        self.state.update(np.array([k]), np.array([a]), np.array([U]), np.array([cost]), np.array([a + 1]))
        self.t += a + 1
        self.L += a + 1


def test_obsview_decodes_what_the_state_encodes() -> None:
    s = Stream()
    s.round(4, 3, U=20.5, cost=1.25)
    v = ObsView(SPEC)
    o = s.obs()
    assert v.prev_k(o) == 4 and v.prev_accepted(o) == 3
    assert v.prev_U(o) == pytest.approx(20.5, rel=1e-5)
    assert v.prev_cost(o) == pytest.approx(1.25, rel=1e-5)
    assert v.L(o) == pytest.approx(604.0, rel=1e-5)
    assert not v.first_round(o)


def test_fixed_k() -> None:
    p = FixedK(SPEC, 3)
    assert p.act(Stream().obs()) == 3
    assert list(p.act_batch(np.stack([Stream().obs()] * 4))) == [3] * 4
    with pytest.raises(ValueError):
        FixedK(SPEC, 11)


def test_transformers_heuristic_plus_two_minus_one_floor_one() -> None:
    p = TransformersHeuristic(SPEC, start=5)
    s = Stream()
    assert p.act(s.obs()) == 5
    s.round(5, 5)  # all accepted -> +2
    assert p.act(s.obs()) == 7
    s.round(7, 2)  # not all -> -1
    assert p.act(s.obs()) == 6
    for _ in range(10):
        s.round(6, 0)
        k = p.act(s.obs())
    assert k == 1  # floor at 1
    # default start 20 is capped at kmax
    assert TransformersHeuristic(SPEC).act(Stream().obs()) == 10


def test_confidence_threshold_stops_after_first_low_token() -> None:
    p = ConfidenceThreshold(SPEC_H, threshold=0.4)
    conf = [0.9, 0.8, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    assert p.act(Stream(SPEC_H).obs(conf)) == 3
    assert p.act(Stream(SPEC_H).obs([0.9] * 10)) == 10
    assert p.act(Stream(SPEC_H).obs([0.1] + [0.9] * 9)) == 1
    with pytest.raises(ValueError):
        ConfidenceThreshold(SPEC)


def test_confidence_roc_refit_moves_threshold_between_classes() -> None:
    p = ConfidenceThreshold(SPEC_H, threshold=0.05, adaptive=True)
    s = Stream(SPEC_H)
    # drafts with confidence 0.8 are accepted, the first one at 0.3 is rejected
    conf = [0.8, 0.8, 0.3, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8]
    for _ in range(4):
        k = p.act(s.obs([0.8, 0.8, 0.8, 0.3] + [0.8] * 6))
        assert k == (10 if p.threshold <= 0.3 else 4)
        s.round(k, 3)
    assert (
        0.3 < p.threshold <= 0.8 + 1e-6
    )  # (float32 confidences) ROC optimum separates 0.3 (rejected) from 0.8 (accepted)
    assert p.act(s.obs(conf)) == 3


def test_acceptance_estimator_pooled_rate_by_hand() -> None:
    """The pooled rate (sum s + n0 mean prior) / (sum n + n0), worked out by hand for two rounds."""
    est = AcceptanceEstimator(3, np.array([0.5, 0.6, 0.7]), strength=2.0, forget=0.5)
    assert est.pooled() == pytest.approx(0.6, rel=1e-12)  # no evidence: the prior's mean
    est.observe(2, 1)  # depths 1, 2 reached, depth 1 accepted: s = (1, 0, 0), n = (1, 1, 0)
    assert est.pooled() == pytest.approx((1 + 2 * 0.6) / (2 + 2), rel=1e-12)
    est.observe(3, 3)  # aged by 0.5, then every depth reached and accepted: s = (1.5, 1, 1), n = (1.5, 1.5, 1)
    assert est.pooled() == pytest.approx((3.5 + 1.2) / (4 + 2), rel=1e-12)


def test_goodput_alpha_is_the_estimators_pooled_rate() -> None:
    s = Stream()
    p = GoodputRule(SPEC, CM, rho_prior=np.full(10, 0.5))
    for k, a in ((4, 2), (6, 6), (3, 0)):
        p.act(s.obs())
        s.round(k, a)
    p.act(s.obs())
    # rounds seen by the rule: (4, 2), (6, 6), (3, 0), forget 0.9, prior 0.5 with weight 2
    w = np.array([0.81, 0.9, 1.0])
    acc = w @ np.array([2, 6, 0])
    tried = w @ np.array([3, 6, 1])  # depths reached: a + 1 (capped at k)
    assert p.alpha() == pytest.approx((acc + 2 * 0.5) / (tried + 2), rel=1e-12)


def test_goodput_prefers_longer_drafts_when_acceptance_is_high() -> None:
    hi, lo = Stream(), Stream()
    for _ in range(15):
        hi.round(6, 6, U=24.0)
        lo.round(6, 0, U=24.0)
    k_hi = GoodputRule(SPEC, CM).act(hi.obs())
    k_lo = GoodputRule(SPEC, CM).act(lo.obs())
    assert k_hi >= 6 and k_lo <= 1


def test_cascade_tests_then_sets_best_and_turns_off_when_utility_below_one() -> None:
    p = CascadeUtility(SPEC, candidates=(1, 4), test_rounds=2, set_rounds=3)
    s = Stream()
    played = []
    for _ in range(4):  # test phase: 1, 1, 4, 4
        k = p.act(s.obs())
        played.append(k)
        s.round(k, k, cost=1.0 + 0.1 * k)  # everything accepted: utility (k+1)/(1+0.1k) > 1
    assert played == [1, 1, 4, 4]
    assert p.act(s.obs()) == 4  # set phase keeps the best (utility 5/1.4 > 2/1.1)
    q = CascadeUtility(SPEC, candidates=(1, 4), test_rounds=1, set_rounds=3)
    s = Stream()
    for _ in range(2):
        k = q.act(s.obs())
        s.round(k, 0, cost=2.0)  # nothing accepted and expensive: utility 0.5 < 1
    assert q.act(s.obs()) == 0


def test_ucb_plays_each_arm_once_then_exploits() -> None:
    p = UCBBandit(SPEC, arms=(0, 2, 5), c=0.1)
    s = Stream()
    first = []
    for _ in range(3):
        k = p.act(s.obs())
        first.append(k)
        s.round(k, k if k == 5 else 0, cost=1.0 + 0.1 * k)
    assert first == [0, 2, 5]
    assert p.act(s.obs()) == 5  # arm 5 gave 6 tokens / 1.5 units


def test_delta_space_limits() -> None:
    s = Stream()
    for _ in range(20):
        s.round(8, 8, U=28.0)
    o = s.obs()
    assert DeltaSpaceRule(SPEC, CM, lam_ms=1e6).act(o) == 10  # progress is all that counts
    assert DeltaSpaceRule(SPEC, CM, lam_ms=1e-6).act(o) == 0  # cost is all that counts
    with pytest.raises(ValueError):
        DeltaSpaceRule(SPEC, CM)


def test_delta_space_matches_marginal_condition() -> None:
    s = Stream()
    for _ in range(10):
        s.round(5, 3, U=22.0)
    o = s.obs()
    rule = DeltaSpaceRule(SPEC, CM, lam_ms=4.0)
    ea = rule.expected_accepted(o)
    cost = CM.round_ms(np.arange(11), rule.upred.predict(), 600.0 + s.t)
    assert rule.act(o) == int(np.argmax(4.0 * ea - cost))
    assert np.all(np.diff(ea) >= 0)


def test_cost_aware_round_prices_are_the_cost_models_to_the_bit() -> None:
    """The rules price every budget from the cost model's terms taken once: the same floats as round_ms."""
    rng = np.random.default_rng(4)
    with_overhead = CostModel(beta0=np.linspace(5, 9, 11), alpha=np.full(11, 0.05), c=np.full(11, 1e-4), d0=0.3,
                              d1=0.6, top_k=8, overhead=np.linspace(1.0, 2.0, 11), d_floor=0.2)  # fmt: skip
    for cm in (CM, with_overhead):
        for rule in (DeltaSpaceRule(SPEC, cm, lam_ms=4.0), GoodputRule(SPEC, cm)):
            s = Stream(L0=float(rng.integers(10, 3000)))
            for _ in range(25):
                k = int(rng.integers(0, 11))
                s.round(k, int(rng.integers(0, k + 1)), U=float(rng.uniform(8, 90)))
                o = s.obs()
                rule.act(o)
                expect = cm.round_ms(np.arange(11), rule.upred.predict(), rule.view.L(o))
                assert np.array_equal(rule._round_ms(o), expect)
        rule.cost_model = with_overhead if cm is CM else CM  # a model swapped in is priced, not the cached one
        assert np.array_equal(
            rule._round_ms(o), rule.cost_model.round_ms(np.arange(11), rule.upred.predict(), rule.view.L(o))
        )


def test_delta_space_adaptive_lambda_tracks_cost_per_token() -> None:
    rule = DeltaSpaceRule(SPEC, CM, adaptive=True)
    s = Stream()
    o = s.obs()
    assert rule.lam(o) == pytest.approx(float(CM.ar_ms(600.0)))
    rule.act(o)
    s.round(4, 3, U=20.0)
    rule.act(s.obs())
    expect = float(CM.round_ms(4, 20.0, 600.0)) / 4.0
    assert rule.lam(s.obs()) == pytest.approx(expect, rel=1e-4)


def test_u_predictor_uses_observed_means_and_scales_prior() -> None:
    up = UPredictor(10, 8, 128)
    up.observe(2, up.prior[2] * 1.2)
    pred = up.predict()
    assert pred[2] == pytest.approx(up.prior[2] * 1.2)
    assert pred[5] == pytest.approx(up.prior[5] * 1.2)
    assert pred[0] == 8


def test_batched_policies_keep_separate_memory() -> None:
    p = TransformersHeuristic(SPEC, start=5)
    a, b = Stream(), Stream()
    assert list(p.act_batch(np.stack([a.obs(), b.obs()]))) == [5, 5]
    a.round(5, 5)
    b.round(5, 1)
    assert list(p.act_batch(np.stack([a.obs(), b.obs()]))) == [7, 4]


def _sklearn_roc_choice(labels, scores, fn_weight: float = 3.0) -> float:
    """The threshold transformers' ``update_candidate_strategy`` picks with scikit-learn's roc_curve."""
    from sklearn.metrics import roc_curve

    fpr, tpr, thr = roc_curve(labels, scores)
    return float(thr[int(np.argmin(fpr + fn_weight * (1.0 - tpr)))])


def _random_roc_case(rng: np.random.Generator) -> tuple[list[int], list[float]]:
    """Labels with both classes and scores: continuous, float32, or a few levels (many ties)."""
    n = int(rng.integers(2, 400))
    labels = (rng.random(n) < rng.uniform(0.05, 0.95)).astype(int)
    labels[rng.choice(n, 2, replace=False)] = [0, 1]
    kind = rng.integers(3)
    if kind == 0:
        scores = rng.random(n)
    elif kind == 1:  # what the observation carries, with higher scores for accepted drafts
        scores = np.clip(rng.normal(0.4 + 0.3 * labels, 0.2), 0, 1).astype(np.float32).astype(np.float64)
    else:
        scores = rng.integers(0, int(rng.integers(1, 6)), n) / 4.0
    return labels.tolist(), scores.tolist()


def test_roc_threshold_equals_sklearn_roc_curve_choice_bit_for_bit() -> None:
    pytest.importorskip("sklearn")
    from policies.heuristics import roc_threshold

    rng = np.random.default_rng(2024)
    chosen = set()
    for _ in range(600):
        labels, scores = _random_roc_case(rng)
        for w in (3.0, 1.0, 0.25):
            got, want = roc_threshold(labels, scores, w), _sklearn_roc_choice(labels, scores, w)
            assert got == want or (np.isinf(got) and np.isinf(want)), (labels, scores, w, got, want)
            chosen.add(np.isinf(want))
    assert chosen == {True, False}  # both the (0, 0) point and a data threshold were chosen
    # hand-made: perfectly separated classes pick the lowest accepted score
    assert roc_threshold([0, 0, 1, 1, 1], [0.1, 0.3, 0.5, 0.7, 0.9]) == 0.5
    # one class at a single score with the other: ties merge into one ROC point
    assert roc_threshold([1, 0, 1, 0], [0.5, 0.5, 0.5, 0.2]) == _sklearn_roc_choice([1, 0, 1, 0], [0.5, 0.5, 0.5, 0.2])


def test_confidence_roc_refit_equals_the_sklearn_refit() -> None:
    """Over a long stream, the adaptive policy's threshold is the scikit-learn choice after every round."""
    pytest.importorskip("sklearn")
    rng = np.random.default_rng(7)
    p = ConfidenceThreshold(SPEC_H, adaptive=True)
    s = Stream(SPEC_H)
    refits = set()
    for _ in range(150):
        conf = np.clip(rng.normal(0.6, 0.25, SPEC_H.lookahead), 0.0, 1.0).round(2).tolist()
        k = p.act(s.obs(conf))
        if len(p.probs) > 5 and {0, 1} <= set(p.matches):
            assert p.threshold == min(_sklearn_roc_choice(p.matches, p.probs), 1.0)
            refits.add(p.threshold)
        s.round(k, int(rng.integers(0, k + 1)))
    assert len(refits) > 3  # the threshold moved
