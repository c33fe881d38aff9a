"""The information-relaxation dual bound (oracle/dual.py) against brute force on small partially observed instances.

Every expectation here is computed independently of the module: the online optimum by enumerating
the controller's histories (its posterior recomputed from scratch over every regime path at each
history), the clairvoyant bound by the SSP of each regime path, weighted by the path's probability.
"""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest

from oracle.dual import DualBound, HiddenRegime, dual_bound

TOL = 1e-9


def _instance(n: int, signal: list[list[float]], stick: float = 0.8, cost=(1.0, 1.25, 1.45)) -> HiddenRegime:  # noqa: ANN001
    return HiddenRegime(
        n=n,
        init=np.array([0.5, 0.5]),
        trans=np.array([[stick, 1.0 - stick], [1.0 - stick, stick]]),
        accept=np.array([0.9, 0.2]),
        signal=np.array(signal),
        cost=np.array(cost),
    )


INSTANCES = {
    "no signal, N=5": _instance(5, [[1.0], [1.0]]),
    "noisy signal, N=4": _instance(4, [[0.75, 0.25], [0.3, 0.7]]),
    "sharp signal, N=4, sticky": _instance(4, [[0.9, 0.1], [0.1, 0.9]], stick=0.95, cost=(1.0, 1.1, 1.3)),
}


def _p_accepted(r: float, k: int, a: int) -> float:
    """P(exactly a of k drafts accepted), every draft accepted with conditional probability r."""
    return r**a * (1.0 - r) if a < k else r**k


def brute_force(inst: HiddenRegime) -> tuple[float, dict[tuple[int, tuple[float, ...]], float]]:
    """The optimal expected cost of a non-anticipative controller, by enumerating its histories.

    A history is the tuple of (position, signal, budget, accepted) of its rounds plus the current
    position and signal; the likelihood of a history under a regime path is the product of its
    signals' and outcomes' probabilities, so P(regime path | history) is recomputed from scratch.
    Returns the optimum and the value of every post-signal state keyed by (t, posterior of h_t).
    """
    N, M, K = inst.n, len(inst.init), inst.kmax
    paths = [
        (h, inst.init[h[0]] * np.prod([inst.trans[x, y] for x, y in zip(h[:-1], h[1:], strict=True)]))
        for h in itertools.product(range(M), repeat=N)
    ]
    values: dict[tuple[int, tuple[float, ...]], float] = {}
    H = np.array([h for h, _ in paths])  # (P, N) regime paths
    prior = np.array([p for _, p in paths], dtype=np.float64)
    R = inst.accept[H]  # (P, N) acceptance at every position of every path

    def weights(hist: tuple, t: int, s: int | None) -> np.ndarray:
        """Unnormalised P(path, history): the prior times every signal's and outcome's probability."""
        w = prior.copy()
        for tt, ss, kk, aa in hist:
            r = R[:, tt]
            w *= inst.signal[H[:, tt], ss] * (r**aa * (1.0 - r) if aa < kk else r**kk)
        if s is not None:
            w *= inst.signal[H[:, t], s]
        return w

    @cache
    def after_signal(hist: tuple, t: int, s: int) -> float:
        w = weights(hist, t, s)
        w = w / w.sum()
        best = np.inf
        for k in range(K + 1):
            q = 0.0
            for a in range(k + 1):
                pa = float(np.dot(w, [_p_accepted(r, k, a) for r in R[:, t]]))
                if pa > 0.0:
                    q += pa * before_signal((*hist, (t, s, k, a)), min(t + a + 1, N))
            best = min(best, inst.cost[k] + q)
        belief = np.array([w[H[:, t] == m].sum() for m in range(M)])
        values[(t, tuple(np.round(belief, 12)))] = best
        return best

    @cache
    def before_signal(hist: tuple, t: int) -> float:
        if t >= N:
            return 0.0
        w = weights(hist, t, None)
        w = w / w.sum()
        total = 0.0
        for s in range(inst.signal.shape[1]):
            ps = float(np.dot(w, inst.signal[H[:, t], s]))
            if ps > 0.0:
                total += ps * after_signal(hist, t, s)
        return total

    return before_signal((), 0), values


def _path_average(inst: HiddenRegime, budgets: range | list[int]) -> float:
    """E over regime paths of the SSP that knows the path (rho[t] = accept[h_t]), choosing among ``budgets``."""
    N = inst.n
    total = 0.0
    for h in itertools.product(range(len(inst.init)), repeat=N):
        p = inst.init[h[0]] * np.prod([inst.trans[x, y] for x, y in zip(h[:-1], h[1:], strict=True)])
        V = np.zeros(N + 1)
        for t in range(N - 1, -1, -1):
            r = inst.accept[h[t]]
            V[t] = min(
                inst.cost[k] + sum(_p_accepted(r, k, a) * V[min(t + a + 1, N)] for a in range(k + 1)) for k in budgets
            )
        total += p * V[0]
    return total


def clairvoyant(inst: HiddenRegime) -> float:
    """The clairvoyant bound: the SSP of each regime path, every budget allowed, averaged over the paths."""
    return _path_average(inst, range(inst.kmax + 1))


def fixed_k_cost(inst: HiddenRegime, k: int) -> float:
    """Exact expected cost of the fixed budget k (a non-anticipative policy): the path average with k alone."""
    return _path_average(inst, [k])


@pytest.fixture(scope="module", params=list(INSTANCES), ids=list(INSTANCES))
def case(request: pytest.FixtureRequest) -> tuple[HiddenRegime, float, dict, float, DualBound]:
    """The instance, its brute-force online optimum and values, its clairvoyant bound, its dual bound."""
    inst = INSTANCES[request.param]
    opt, values = brute_force(inst)
    return inst, opt, values, clairvoyant(inst), dual_bound(inst)


def test_zero_penalty_is_the_clairvoyant_bound(case: tuple) -> None:
    inst, _, _, clair, _ = case
    d = dual_bound(inst, lambdas=(0.0,))
    assert d.clairvoyant == pytest.approx(clair, rel=TOL) and d.bound == pytest.approx(clair, rel=TOL)


def test_dual_bound_is_a_bound_on_every_online_controller_and_no_looser_than_the_clairvoyant(case: tuple) -> None:
    inst, opt, _, clair, d = case
    # costs: clairvoyant <= dual <= online optimum <= every fixed k (speedups the other way round)
    assert clair <= opt + TOL  # the brute force is sane
    for lam, b in d.by_lambda.items():
        assert b <= opt * (1 + TOL), (lam, b, opt)  # every penalty scale gives a valid bound
    assert clair * (1 - TOL) <= d.bound <= opt * (1 + TOL)
    assert d.speedup >= inst.ar_cost / opt * (1 - TOL) and d.speedup <= d.clairvoyant_speedup * (1 + TOL)
    for k in range(inst.kmax + 1):
        assert d.bound <= fixed_k_cost(inst, k) * (1 + TOL)


def test_belief_penalty_tightens_the_clairvoyant_bound(case: tuple) -> None:
    """On these instances the belief model's penalty closes part of the gap between clairvoyant and online optimum."""
    inst, opt, _, clair, d = case
    assert opt - clair > 1e-3  # information matters here
    assert d.bound > clair + 0.05 * (opt - clair), (clair, d.by_lambda, opt)


def test_penalty_of_the_optimal_online_value_is_exact(case: tuple) -> None:
    """Strong duality (Brown, Smith & Sun 2010): with W the online optimum's value the bound is the optimum."""
    inst, opt, values, _, _ = case

    def W(t: int, b: np.ndarray) -> float:
        return values[(t, tuple(np.round(b, 12)))]

    d = dual_bound(inst, W=W, lambdas=(1.0,))
    assert d.by_lambda[1.0] == pytest.approx(opt, rel=1e-9)


def test_refuses_an_instance_that_is_not_a_law() -> None:
    with pytest.raises(ValueError, match="probability laws"):
        HiddenRegime(3, np.array([0.6, 0.6]), np.eye(2), np.array([0.5, 0.5]), np.ones((2, 1)), np.array([1.0, 1.2]))
