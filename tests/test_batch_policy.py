"""The one policy protocol on a joint batch decision: the expert-aware batch policy (policies/batch/goodput.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from batch_reference import draft_ms, verify_ms

from policies.batch.goodput import BatchGoodput
from specenv.cost.batch import load_batch_cost_model
from specenv.observation.single import ObservationSpec, ObservationState
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


def decide(policy: BatchGoodput, obs: np.ndarray, streams: list) -> np.ndarray:
    """The one call to the policy (the protocol's method name lives here only)."""
    return np.asarray(policy.act(obs, streams), dtype=np.int64)


def _reference_goodput(policy: BatchGoodput, obs: np.ndarray, k: tuple[int, ...]) -> float:
    """The module docstring's goodput of budgets ``k``, from the cost model's formula (tests/batch_reference.py).

    Tokens: ``1 + sum_{j<=k_i} prod_{l<=j} rho_{i,l}`` per request (rho = the observation's acc_depth);
    U(k) = the default prior ``min(n, top_k (k+1)^0.62)`` made non-decreasing and clipped to [top_k, n];
    the step drafts max(max k, min_draft_steps) tokens for every request.
    """
    m, view = policy.model, policy.view
    tokens = 0.0
    for i, ki in enumerate(k):
        rho = [min(max(float(x), 0.0), 1.0) for x in obs[i, view.depth_slice]]
        tokens += 1.0 + sum(float(np.prod(rho[: j + 1])) for j in range(ki))
    u = [min(m.n_experts, m.top_k * (x + 1.0) ** 0.62) for x in range(KMAX + 1)]
    u = np.maximum.accumulate(np.clip(u, m.top_k, m.n_experts))
    L = [float(x) * policy.spec.context_scale for x in obs[:, view.i_context]]
    d = max(max(k), policy.min_draft_steps)
    step = verify_ms(m, k, [u[x] for x in k], L) + draft_ms(m, [d] * len(k)) + policy.step_overhead_ms
    return tokens / step


def test_a_single_request_gets_the_best_k_of_the_goodput(policy):
    rng = np.random.default_rng(2)
    seen = set()
    for _ in range(20):
        obs = _obs(policy, [float(rng.uniform(0, 1))], L=float(rng.integers(50, 800)))
        vals = [_reference_goodput(policy, obs, (k,)) for k in range(KMAX + 1)]
        assert decide(policy, obs, ["x"])[0] == int(np.argmax(vals))
        seen.add(int(np.argmax(vals)))
    assert len(seen) >= 3


@pytest.mark.parametrize("model", ["live-vllm-batch-v1", "live-vllm-wide-batch-v2"])
@pytest.mark.parametrize(("overhead", "min_draft"), [(0.0, 0), (5.0, 1)])
def test_the_single_request_table_prices_as_the_reference(model, overhead, min_draft):
    """A step of one request is decided from a table (no search): it still picks the reference's best k."""
    pol = BatchGoodput(
        ObservationSpec(KMAX, 0, 128, 64), load_batch_cost_model(model), step_overhead_ms=overhead,
        min_draft_steps=min_draft,
    )  # fmt: skip
    rng = np.random.default_rng(5)
    picks = set()
    for _ in range(40):
        obs = _obs(pol, [float(rng.uniform(0, 1))], L=float(rng.integers(20, 3000)))
        obs[0, pol.view.depth_slice] = rng.uniform(0, 1, KMAX)  # any acceptance profile over the depths
        vals = [_reference_goodput(pol, obs, (k,)) for k in range(KMAX + 1)]
        k = int(decide(pol, obs, ["x"])[0])
        assert vals[k] >= max(vals) * (1 - 1e-12), (k, vals)
        picks.add(k)
    assert len(picks) >= 2


@pytest.mark.parametrize("overhead", [0.0, 5.0])
def test_search_finds_the_brute_force_optimum_on_small_batches(overhead):
    spec = ObservationSpec(KMAX, 0, 128, 64)
    pol = BatchGoodput(spec, load_batch_cost_model(), step_overhead_ms=overhead)
    rng = np.random.default_rng(0)
    gaps, exact = [], 0
    for _ in range(12):
        B = int(rng.integers(2, 4))
        obs = _obs(pol, list(rng.uniform(0, 1, size=B)), L=float(rng.integers(50, 800)))
        k = tuple(int(x) for x in decide(pol, obs, list(range(B))))
        brute = max(_reference_goodput(pol, obs, c) for c in itertools.product(range(KMAX + 1), repeat=B))
        found = _reference_goodput(pol, obs, k)
        assert found <= brute * (1 + 1e-12)
        gaps.append(1 - found / brute)
        exact += found >= brute * (1 - 1e-12)
    assert max(gaps) < 0.01  # local search from the best common k: within 1% of the joint optimum
    assert exact >= 9  # and on most cases the optimum itself
