"""The batch controllers of policies/batch/controllers.py against what their docstrings claim, on known answers.

Every expected budget comes from :mod:`batch_reference` (the cost model's formula written out again)
by enumeration, or is derived by hand below; no expectation calls the controller's own pricing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from batch_reference import batch_obs, draft_ms, union, verify_ms

from policies.batch.controllers import (
    AdaptiveVerificationBatch,
    DSDBatch,
    GoodputBatch,
    TetrisBatch,
    fit_dsd_table,
)
from specenv.cost.batch import BatchCostModel, load_batch_cost_model
from specenv.observation.batch import BatchObservationSpec
from specenv.observation.single import ObservationSpec

SCALE = 4096.0  # ObservationSpec's default context_scale: L / SCALE is exact in float32 for integer L


def decide(policy, obs: np.ndarray) -> np.ndarray:
    """The one call to a batch policy (the protocol's method name lives here only)."""
    return np.asarray(policy.act(obs), dtype=np.int64)


def f32(x) -> np.ndarray:
    """What a value becomes in the float32 observation vector."""
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def hand_model(**over) -> BatchCostModel:
    """A small linear model whose prices are easy to work out by hand."""
    kw = dict(b0=1.0, b_pos=0.25, alpha=0.5, c=0.0, b_req=0.0, d0=0.5, d_step=0.25, d_tok=0.0)
    kw |= over
    return BatchCostModel.linear(**kw, kmax=3, max_batch=3, top_k=1, n_experts=4, n_layers=1)


@pytest.fixture(scope="module")
def shipped() -> BatchCostModel:
    return load_batch_cost_model()


# ------------------------------------------------------------------ the reference itself
def test_reference_prices_a_hand_computed_step():
    m = hand_model()
    # k = (1, 0): P = 3 positions, U = (2, 1) of 4 experts -> union 4 * (1 - (1/2)(3/4)) = 2.5
    assert union([2.0, 1.0], 4, 1.0) == pytest.approx(2.5)
    assert verify_ms(m, [1, 0], [2.0, 1.0], [0.0, 0.0]) == pytest.approx(1.0 + 0.25 * 3 + 0.5 * 2.5)
    assert draft_ms(m, [1, 0]) == pytest.approx(0.5 + 0.25 * 1)
    assert draft_ms(m, [0, 0]) == 0.0
    assert m.step_ms(np.array([1, 0]), np.array([1, 0]), np.array([2.0, 1.0]), np.array([0.0, 0.0])) == pytest.approx(
        3.75
    )


def test_reference_is_the_cost_models_formula(shipped):
    """Two implementations of one formula agree (so the references below price what the model prices)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        B = int(rng.integers(1, shipped.max_batch + 1))
        k = rng.integers(0, shipped.kmax + 1, size=B)
        d = k + rng.integers(0, 3, size=B)
        u = rng.uniform(shipped.top_k, shipped.n_experts, size=B)
        L = rng.uniform(10, 3000, size=B)
        ref = verify_ms(shipped, k, u, L) + draft_ms(shipped, d)
        assert shipped.step_ms(k, d, u, L) == pytest.approx(ref, rel=1e-12)


# ------------------------------------------------------------------ GoodputBatch
def _goodput_common_k(m, alpha, u_prior, ctx, kmax) -> int:
    """SmartSpec's batch goodput by enumeration: the first common k of best tokens/ms."""
    best, arg = -1.0, -1
    for k in range(kmax + 1):
        tokens = sum((1 - a ** (k + 1)) / (1 - a) for a in alpha)
        ks = [k] * len(alpha)
        g = tokens / (verify_ms(m, ks, [u_prior[k]] * len(alpha), ctx) + draft_ms(m, ks))
        if g > best:
            best, arg = g, k
    return arg


def test_goodput_batch_is_the_best_common_k_of_the_running_acceptance(shipped):
    rng = np.random.default_rng(1)
    kmax, B = 6, 3
    spec = BatchObservationSpec(ObservationSpec(kmax, 0, 128, 64), B)
    seen = set()
    for _ in range(20):
        prior = rng.uniform(0.05, 0.98, size=kmax)
        u_prior = np.sort(rng.uniform(4, 40, size=kmax + 1))
        L = rng.integers(50, 3000, size=B)
        pol = GoodputBatch(spec, shipped, u_prior, rho_prior=prior)
        first = [{"context": x / SCALE, "first_round": 1.0} for x in L]
        got = decide(pol, batch_obs(spec, first))
        # a new request's running acceptance is the prior's mean
        want = _goodput_common_k(shipped, [prior.mean()] * B, u_prior, f32(L / SCALE) * SCALE, kmax)
        np.testing.assert_array_equal(got, [want] * B)
        seen.add(want)
    assert len(seen) >= 3  # the cases span several answers


# (prev_k, prev_accepted) of a request's previous round -> its running acceptance, by hand: the prior is
# (0.9, 0.7), mean 0.8, with the estimator's strength of 2 pseudo-rounds; depth j is reached when
# k >= j and a >= j - 1, accepted when a >= j; rate = (accepted + 2 * 0.8) / (reached + 2)
HAND_RATES = {(2, 2): (2 + 1.6) / 4, (2, 1): (1 + 1.6) / 4, (2, 0): 1.6 / 3, (0, 0): 1.6 / 2}


@pytest.mark.parametrize(
    "rounds",
    [[(2, 2)] * 3, [(2, 1)] * 3, [(2, 0)] * 3, [(0, 0)] * 3, [(2, 2), (2, 1), (0, 0)], [(2, 0), (2, 2), (2, 0)]],
)
def test_goodput_batch_folds_the_previous_round_into_each_requests_rate(rounds):
    m = hand_model(alpha=0.0, b_pos=0.2, d0=0.0, d_step=0.02)
    kmax = 2
    spec = BatchObservationSpec(ObservationSpec(kmax, 0, 128, 4), 3)
    pol = GoodputBatch(spec, m, np.ones(kmax + 1), rho_prior=np.array([0.9, 0.7]))
    decide(pol, batch_obs(spec, [{"first_round": 1.0}] * 3))
    rows = [{"prev_k": k / kmax, "prev_accepted": a / kmax} for k, a in rounds]
    got = decide(pol, batch_obs(spec, rows))
    want = _goodput_common_k(m, [HAND_RATES[r] for r in rounds], np.ones(kmax + 1), [0.0] * 3, kmax)
    np.testing.assert_array_equal(got, [want] * 3)


def test_the_rate_cases_have_different_answers():
    """The cases above tell a controller that ignores the previous round from one that reads it."""
    m = hand_model(alpha=0.0, b_pos=0.2, d0=0.0, d_step=0.02)
    answers = {_goodput_common_k(m, [r] * 3, np.ones(3), [0.0] * 3, 2) for r in HAND_RATES.values()}
    assert answers == {1, 2}


def test_goodput_batch_extremes():
    m = hand_model()
    spec = BatchObservationSpec(ObservationSpec(3, 0, 128, 4), 2)
    u = np.array([1.0, 1.5, 2.0, 2.5])
    sure = GoodputBatch(spec, hand_model(alpha=0.0, d0=0.0, d_step=0.01), u, rho_prior=np.full(3, 0.999))
    np.testing.assert_array_equal(decide(sure, batch_obs(spec, [{"first_round": 1.0}] * 2)), [3, 3])
    hopeless = GoodputBatch(spec, m, u, rho_prior=np.full(3, 1e-4))
    np.testing.assert_array_equal(decide(hopeless, batch_obs(spec, [{"first_round": 1.0}, None])), [0, 0])


# ------------------------------------------------------------------ TetrisBatch
def _tetris_value(m, k, surv, u_prior, ctx, h) -> float:
    n = len(k)
    tokens = n + sum(float(np.sum(surv[r, : k[r]])) for r in range(n))
    return tokens / (verify_ms(m, k, [u_prior[x] for x in k], ctx) + draft_ms(m, [h] * n))


def _tetris_case(rng, spec, h):
    n = spec.batch_size
    conf = f32(rng.uniform(0.2, 1.0, size=(n, h)))
    L = rng.integers(50, 2000, size=n)
    rows = [{"context": L[r] / SCALE, **{f"conf_{j + 1}": conf[r, j] for j in range(h)}} for r in range(n)]
    return batch_obs(spec, rows), np.cumprod(conf, axis=1), f32(L / SCALE) * SCALE


def test_tetris_is_the_joint_optimum_when_a_token_costs_the_same_wherever_it_goes():
    """alpha = 0 and a linear beta0: every token adds the same cost, so the best selection is the most
    promising tokens (TETRIS) and greedy growth stops at the best count: the brute-force optimum."""
    h, n = 3, 3
    m = hand_model(alpha=0.0, b_pos=0.3, c=0.001)
    spec = BatchObservationSpec(ObservationSpec(3, h, 128, 4), n)
    u_prior = np.array([1.0, 2.0, 3.0, 3.5])
    rng = np.random.default_rng(2)
    totals = set()
    for _ in range(25):
        obs, surv, ctx = _tetris_case(rng, spec, h)
        got = decide(TetrisBatch(spec, m, u_prior), obs)
        allk = list(itertools.product(range(h + 1), repeat=n))
        vals = [_tetris_value(m, k, surv, u_prior, ctx, h) for k in allk]
        np.testing.assert_array_equal(got, allk[int(np.argmax(vals))])
        totals.add(int(got.sum()))
    assert len(totals) >= 3


def test_tetris_stops_where_no_further_token_raises_the_goodput(shipped):
    h, n = 4, 3
    spec = BatchObservationSpec(ObservationSpec(4, h, 128, 64), n)
    u_prior = np.array([4.0, 6.5, 8.5, 10.0, 11.5])
    rng = np.random.default_rng(3)
    for _ in range(25):
        obs, surv, ctx = _tetris_case(rng, spec, h)
        got = decide(TetrisBatch(spec, shipped, u_prior), obs)
        val = _tetris_value(shipped, got, surv, u_prior, ctx, h)
        assert val >= _tetris_value(shipped, np.zeros(n, np.int64), surv, u_prior, ctx, h)
        for r in np.flatnonzero(got < h):
            more = got.copy()
            more[r] += 1
            assert _tetris_value(shipped, more, surv, u_prior, ctx, h) <= val * (1 + 1e-12)


def test_tetris_leaves_idle_slots_at_zero():
    h = 2
    m = hand_model(alpha=0.0, b_pos=0.01, d0=0.0, d_step=0.0)
    spec = BatchObservationSpec(ObservationSpec(3, h, 128, 4), 3)
    obs = batch_obs(spec, [None, {"conf_1": 1.0, "conf_2": 1.0}, None])
    # one sure request and nearly free tokens: it verifies both drafted tokens, the idle slots none
    np.testing.assert_array_equal(decide(TetrisBatch(spec, m, np.ones(4)), obs), [0, 2, 0])


# ------------------------------------------------------------------ AdaptiveVerificationBatch
def _adaptive_reference(m, used, u_prior, ctx, h) -> np.ndarray:
    """vLLM adaptive verification by enumeration: the best b of the b best survival scores."""
    n = len(used)
    scores = np.cumprod(used, axis=1)
    order = sorted((-scores[r, j], r, j) for r in range(n) for j in range(h))
    best, arg = -1.0, None
    for b in range(n * h + 1):
        k = np.zeros(n, dtype=np.int64)
        for _s, r, _j in order[:b]:
            k[r] += 1
        gain = n + sum(-s for s, _r, _j in order[:b])
        v = gain / (verify_ms(m, k, [u_prior[x] for x in k], ctx) + draft_ms(m, [h] * n))
        if v > best:
            best, arg = v, k
    return arg


def _adaptive_obs(spec, conf, L, first):
    h = spec.request.lookahead
    rows = [
        None
        if c is None
        else {"context": L / SCALE, "first_round": float(f), **{f"conf_{j + 1}": c[j] for j in range(h)}}
        for c, f in zip(conf, first, strict=True)
    ]
    return batch_obs(spec, rows)


def test_adaptive_verification_spends_the_best_budget_on_the_best_scores(shipped):
    h, n = 3, 3
    spec = BatchObservationSpec(ObservationSpec(4, h, 128, 64), n)
    u_prior = np.array([4.0, 6.5, 8.5, 10.0, 11.5])
    rng = np.random.default_rng(4)
    ctx = [f32(300 / SCALE) * SCALE] * n
    totals = set()
    for _ in range(15):
        c1, c2 = (f32(rng.uniform(0.05, 1.0, size=(n, h))) for _ in range(2))
        fresh = AdaptiveVerificationBatch(spec, shipped, u_prior, stale=False)
        decide(fresh, _adaptive_obs(spec, c1, 300, [1] * n))
        got = decide(fresh, _adaptive_obs(spec, c2, 300, [0] * n))
        np.testing.assert_array_equal(got, _adaptive_reference(shipped, c2, u_prior, ctx, h))
        totals.add(int(got.sum()))
        # vLLM's stale copy: the step is chosen on the previous step's confidences
        stale = AdaptiveVerificationBatch(spec, shipped, u_prior)
        decide(stale, _adaptive_obs(spec, c1, 300, [1] * n))
        got = decide(stale, _adaptive_obs(spec, c2, 300, [0] * n))
        np.testing.assert_array_equal(got, _adaptive_reference(shipped, c1, u_prior, ctx, h))
    assert len(totals) >= 3


def test_adaptive_verification_scores_a_new_request_as_sure():
    h = 2
    m = hand_model(b_pos=0.05, alpha=0.01)
    spec = BatchObservationSpec(ObservationSpec(3, h, 128, 4), 3)
    pol = AdaptiveVerificationBatch(spec, m, np.ones(4))
    low = [np.array([0.01, 0.01])] * 2 + [None]
    # first step of both requests: stale confidences are 1.0, every token is worth one; cheap positions -> all
    np.testing.assert_array_equal(decide(pol, _adaptive_obs(spec, low, 100, [1, 1, 0])), [2, 2, 0])
    # next step: the low confidences of the first step are what it now sees; request 1 is new again
    got = decide(pol, _adaptive_obs(spec, low, 100, [0, 1, 0]))
    used = np.array([f32([0.01, 0.01]), [1.0, 1.0]])
    want = _adaptive_reference(m, used, np.ones(4), [f32(100 / SCALE) * SCALE] * 2, h)
    np.testing.assert_array_equal(got, [*want, 0])
    assert got[1] == 2 and got[0] < 2


# ------------------------------------------------------------------ DSDBatch / fit_dsd_table
def test_fit_dsd_table_picks_each_sizes_best_k_and_merges_runs():
    target = {1: 3, 2: 3, 3: 1, 4: 0, 5: 0}
    table = fit_dsd_table(lambda n, k: -((k - target[n]) ** 2), 5, 4)
    assert table == [(1, 2, 3), (3, 3, 1), (4, 5, 0)]
    # ties go to the smaller k; one size only
    assert fit_dsd_table(lambda n, k: 1.0, 1, 4) == [(1, 1, 0)]


def test_dsd_batch_looks_up_the_number_of_running_requests():
    spec = BatchObservationSpec(ObservationSpec(4, 0, 128, 64), 8)
    pol = DSDBatch(spec, "1-1:2;3-3:6;5-6:1")
    # a gap or the tail carries the last row's k; a k above kmax 4 is capped
    want = {1: 2, 2: 2, 3: 4, 4: 4, 5: 1, 6: 1, 7: 1, 8: 1}
    for m, k in want.items():
        slots = [{} if s < m else None for s in range(8)]
        np.testing.assert_array_equal(decide(pol, batch_obs(spec, slots)), [k] * m + [0] * (8 - m))
    pol = DSDBatch(spec, [(1, 2, 3), (3, 8, 0)])
    np.testing.assert_array_equal(decide(pol, batch_obs(spec, [{}, None, {}, None, {}] + [None] * 3)), [0] * 8)
    np.testing.assert_array_equal(
        decide(pol, batch_obs(spec, [None, {}, None, {}] + [None] * 4)), [0, 3, 0, 3] + [0] * 4
    )


# ------------------------------------------------------------------ a per-request policy gated by the batch size
class _Recorder:
    """A per-request policy of the protocol that answers 5 - row index and remembers what it was asked."""

    name, stateless = "recorder", True

    def __init__(self, spec: ObservationSpec):
        self.spec = spec
        self.calls: list[tuple[int, list, object]] = []

    def reset(self) -> None:
        pass

    def act(self, obs, ids=None, step=None):
        self.calls.append((len(obs), list(ids), step))
        return np.array([5 - i for i in range(len(obs))], dtype=np.int64)


def test_table_gated_asks_the_policy_only_where_the_table_speculates():
    from policies.batch.controllers import TableGated
    from specenv.policy.base import BatchStep

    req = ObservationSpec(kmax=6, lookahead=0, max_new_tokens=64, n_experts=8)
    inner = _Recorder(req)
    # k = 2 at one request, 0 at 2-3, 1 at 4 and more (vLLM's lookup: the tail keeps the last k)
    gated = TableGated(BatchObservationSpec(req, 8), inner, [(1, 1, 2), (2, 3, 0), (4, 4, 1)])
    rows = np.zeros((8, req.dim), dtype=np.float32)
    step = BatchStep(n_active=0.25)
    for n, want in ((1, [5]), (2, [0, 0]), (3, [0, 0, 0]), (4, [5, 4, 3, 2]), (6, [5, 4, 3, 2, 1, 0])):
        inner.calls.clear()
        got = gated.act(rows[:n], [f"r{i}" for i in range(n)], step).tolist()
        assert got == want, n  # the policy's own budgets, not capped at the table's k (5 > 2 at n = 1)
        if want == [0] * n:
            assert inner.calls == []  # a closed gate does not ask the policy
        else:
            assert inner.calls == [(n, [f"r{i}" for i in range(n)], step)]  # rows, ids and step passed on
    # the contract, drafting mode and the policy a server checks are the wrapped policy's
    from specenv.policy.base import policy_drafting, policy_spec

    assert policy_spec(gated) is req and policy_drafting(gated) == "none" and gated.wrapped is inner
    # the protocol's observes: the wrapped policy's (a fixed k reads nothing, so its gated row may run blind)
    from policies.heuristics import FixedK

    assert gated.observes and not TableGated(BatchObservationSpec(req, 8), FixedK(req, 2), "1-8:2").observes
    block = ObservationSpec(kmax=6, lookahead=3, max_new_tokens=64, n_experts=8)
    assert policy_drafting(TableGated(BatchObservationSpec(block, 8), _Recorder(block), "1-8:2")) == "block"
    with pytest.raises(ValueError, match="contract"):
        TableGated(BatchObservationSpec(block, 8), inner, "1-8:2")


def test_a_gated_mlp_is_refused_for_what_refuses_the_mlp():
    from policies.batch.controllers import TableGated
    from specenv.engines.vllm.settings import policy_refusal
    from specenv.policy.mlp import MLPPolicy

    req = ObservationSpec(kmax=4, lookahead=0, max_new_tokens=64, n_experts=16)
    rng = np.random.default_rng(0)
    layers = [(rng.normal(size=(req.dim, 8)), np.zeros(8)), (rng.normal(size=(8, 5)), np.zeros(5))]
    mlp = MLPPolicy(req, layers, name="tiny")
    gated = TableGated(BatchObservationSpec(req, 8), mlp, "1-1:2;2-8:0")
    assert policy_refusal(gated, num_spec_tokens=4, n_experts=16, max_num_seqs=8) is None
    why = policy_refusal(gated, num_spec_tokens=4, n_experts=64, max_num_seqs=8)
    assert why is not None and "trained for 16 experts" in why  # the wrapped MLP's contract
    why = policy_refusal(gated, num_spec_tokens=4, n_experts=16, max_num_seqs=16)
    assert why is not None and "at most 8 requests" in why  # the batch row's own size


def test_abtest_builds_the_gated_arm_from_an_exported_mlp():
    """``specenv abtest``'s gated arm: the folder's MLP under the table, as the engine and the replay build it."""
    from pathlib import Path

    from policies.batch.controllers import TableGated
    from specenv.abtest import make_policy, replay_policy
    from specenv.policy.mlp import MLPPolicy

    folder = Path(__file__).resolve().parents[1] / "policies" / "shipped" / "live-vllm-wide-v1" / "ppo"
    mlp = MLPPolicy.load(folder)
    desc = {"kind": "table-gated", "folder": str(folder), "schedule": [[1, 1, 2], [2, 8, 0]], "batch_size": 8}

    class _Ctl:
        n_experts = mlp.spec.n_experts

    served = make_policy({**desc, "kmax": mlp.spec.kmax, "max_new_tokens": 128}, _Ctl())
    replayed = replay_policy(desc, mlp.spec)
    rows = np.random.default_rng(1).uniform(0, 1, size=(3, mlp.spec.dim)).astype(np.float32)
    for pol in (served, replayed):
        assert isinstance(pol, TableGated) and pol.spec.batch_size == 8 and pol.spec.request == mlp.spec
        assert pol.act(rows[:1]).tolist() == mlp.act(rows[:1], [0]).tolist()  # n = 1: the MLP's k
        assert pol.act(rows).tolist() == [0, 0, 0]  # n = 3: the table says 0
