"""The one policy protocol on a joint batch decision: the expert-aware batch policy (policies/batch_goodput.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from policies.batch_goodput import BatchGoodput
from specenv.batchcost import load_batch_cost_model
from specenv.observation import ObservationSpec, ObservationState
from specenv.policy.base import PolicyProtocol

KMAX = 4


@pytest.fixture(scope="module")
def policy() -> BatchGoodput:
    spec = ObservationSpec(KMAX, 0, 128, 64)
    return BatchGoodput(spec, load_batch_cost_model())


def _obs(policy: BatchGoodput, rates: list[float], L: float = 200.0) -> np.ndarray:
    """Observations of requests whose every round so far accepted ``rate`` of the drafts at every depth."""
    st = ObservationState(policy.spec, len(rates))
    rates = np.asarray(rates)
    for _ in range(30):  # converge the running statistics
        k = np.full(len(rates), KMAX, dtype=np.float64)
        acc = np.floor(rates * KMAX)
        st.update(k, acc, np.full(len(rates), 10.0), np.ones(len(rates)), acc + 1)
    return st.build(np.full(len(rates), L), np.full(len(rates), 40.0))


def test_protocol(policy):
    assert isinstance(policy, PolicyProtocol) and policy.stateless
    assert not isinstance(object(), PolicyProtocol)


def test_acceptance_raises_k(policy):
    k = policy.act(_obs(policy, [0.0, 1.0]), ["a", "b"])
    assert k[1] > k[0]
    assert policy.act(_obs(policy, [1.0] * 4), list("abcd")).min() >= 1
    assert policy.act(_obs(policy, [0.0] * 4), list("abcd")).max() == 0


def test_act_matches_a_batch_of_one(policy):
    obs = _obs(policy, [0.6])
    assert policy.act(obs[0]) == int(policy.act(obs, ["x"])[0])
    np.testing.assert_array_equal(policy.act(obs), policy.act(obs, ["x"]))


def test_search_finds_the_brute_force_optimum_on_small_batches(policy):
    rng = np.random.default_rng(0)
    gaps = []
    for _ in range(12):
        B = int(rng.integers(2, 4))
        obs = _obs(policy, list(rng.uniform(0, 1, size=B)), L=float(rng.integers(50, 800)))
        k = policy.act(obs, list(range(B)))
        rho = np.clip(obs[:, policy.view.depth_slice], 0, 1)
        gain = np.concatenate([np.ones((B, 1)), 1 + np.cumsum(np.cumprod(rho, axis=1), axis=1)], axis=1)
        ctx = float(np.sum(obs[:, policy.view.i_context] * policy.spec.context_scale))
        allk = np.array(list(itertools.product(range(KMAX + 1), repeat=B)))
        brute = policy._goodput(allk, gain, ctx).max()
        found = policy._goodput(k[None, :], gain, ctx)[0]
        assert found <= brute + 1e-12
        gaps.append(1 - found / brute)
    assert max(gaps) < 0.01  # coordinate ascent from the best common k: within 1% of the joint optimum


def test_union_shortcut_is_the_models_predictor(policy):
    rng = np.random.default_rng(1)
    cand = rng.integers(0, KMAX + 1, size=(50, 5))
    gain = np.ones((5, KMAX + 1))
    m = policy.model
    fast = policy._goodput(cand, gain, 1000.0)
    u_b = m.predict_u_batch_many(policy.u_prior[cand])
    top = np.maximum(cand.max(axis=1), 1)
    slow = 5 / (m.verify_from_totals(cand.sum(axis=1) + 5, 5, u_b, 1000.0) + m.d0 + m.d_step * top + m.d_tok * top * 5)
    np.testing.assert_allclose(fast, slow, rtol=1e-10)
