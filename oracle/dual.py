"""An information-relaxation dual bound for online budget controllers, on instances whose acceptance law is known.

The SSP bound of :mod:`oracle.dp` is clairvoyant: it knows every position's acceptance
probabilities ``rho[t, j]`` before it chooses, which no controller does. Brown, Smith & Sun
(Operations Research 58(4), 2010) turn such a relaxation into a bound that holds for every
*non-anticipative* policy: let the relaxed decision maker see the hidden information, but charge it
a penalty that has mean zero for every policy that does not use it. Then, for every
non-anticipative policy pi,

    E[cost(pi)] = E[cost(pi) - Z(pi)] >= E[ min over relaxed policies of E[cost - Z | hidden] ],

and the right-hand side is a lower bound on the cost (an upper bound on the speedup) of the best
online controller. With ``Z = 0`` it is the clairvoyant bound; with the penalty built from the
optimal online value function it is exact (strong duality); any other value function ``W`` gives a
valid bound in between or below. The penalty of a round is the *martingale difference*

    z = W(x') - E_F[W(x') | x, k],

with ``x`` the controller's information state (the position t and its posterior of the hidden
state), ``k`` the budget, ``x'`` the next information state, and ``E_F`` the expectation under the
true law given only what the controller knows: its mean is zero under every non-anticipative policy,
whatever ``W`` is. The relaxed problem pays ``C(k) + E_F[W(x')|x,k] - W(x')`` per round.

**The instances** (:class:`HiddenRegime`): N positions; a hidden regime per position, a Markov
chain moving one step per committed token (``trans``); every draft at a position of regime m is
accepted with conditional probability ``accept[m]`` (so ``rho[t, j] = accept[h_t]`` at every depth);
before each round the controller sees a signal of the current regime (``signal[m, s]``: a draft
confidence's part of the information); a round with budget k costs ``cost[k]`` and commits
``min(a + 1, N - t)`` tokens, with ``P(a >= i) = accept^i`` (i <= k), as in :mod:`oracle.dp`. The
relaxation reveals the whole regime path ``h`` (the clairvoyant bound's information: ``rho`` at every
position), not the acceptance outcomes; the relaxed problem given ``h`` is solved exactly by
backward induction over the controller's information states (its reachable posteriors, memoised),
and the bound is its average over the ``M^N`` regime paths (:func:`dual_bound`). The penalty's
value function is the belief model's: ``W(t, b) = sum_m b[m] V_MDP(t, m)``, the value of the MDP
that sees the current regime (:func:`regime_mdp_values`), averaged over the posterior ``b``; scaled
versions ``lambda W`` are penalties too, and the bound reported is the best of ``lambda`` in
:data:`LAMBDAS` (0 included: never looser than the clairvoyant bound).

**Why not on the shipped sets.** The penalty's zero mean needs ``E_F[W(x') | x, k]``: the
expectation of the next information state under the *true* law of the acceptances given everything
the controller has seen. On a synthetic instance that law is part of the instance. On the shipped
sets it is not available:

* recorded sets (``live-cpu``, ``live-vllm``, ``live-vllm-wide``) are greedy traces: each position
  holds one outcome (``rho`` in {0, 1}), never the law of the acceptances given the draft's signals
  and the generation's history; a penalty computed from a fitted model (:mod:`oracle.belief`) has
  mean zero only if the model *is* that law, so the "bound" would hold for the model, not for the
  traces;
* generated sets (``paper-default``) have a known law, but not a tractable one: the controller's
  posterior of ``rho`` runs through the generator's latent segment process (segment openings,
  per-token draftability, one latent uniform per token shared by every chain that reaches it)
  observed through logit-noisy confidences and sampled acceptances (:mod:`specenv.generator`); the
  conditional expectation the penalty needs has no closed form, and estimating it (by sampling the
  posterior) makes the bound statistical, not provable.

Penalties whose conditional expectation needs no posterior (``W`` a function of the position alone)
still need ``P(a | history)``, the same posterior. So the provable online bound here covers the
synthetic instances; on the shipped sets the benchmark reports the clairvoyant bound and the belief
oracle (:mod:`oracle.belief`), a reference, not a bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["LAMBDAS", "DualBound", "HiddenRegime", "belief_value", "dual_bound", "regime_mdp_values", "round_law"]

#: Penalty scales tried by :func:`dual_bound` (every one gives a valid bound; 0 is the clairvoyant bound).
LAMBDAS = (0.0, 0.25, 0.5, 0.75, 1.0)

#: Posteriors equal to this many decimals share one memo entry of the relaxed problem.
_DECIMALS = 12


@dataclass(frozen=True)
class HiddenRegime:
    """A small partially observed instance: hidden regimes, their acceptance law and signals, round costs.

    Attributes:
        n: Positions N (tokens to commit).
        init: (M,) law of the regime at position 0.
        trans: (M, M) regime transition per committed token (rows sum to 1).
        accept: (M,) conditional acceptance of every draft at a position of the regime.
        signal: (M, S) law of the signal the controller sees before each round (S = 1: none).
        cost: (K + 1,) cost of a round with budget k = 0..K (ms).
    """

    n: int
    init: np.ndarray
    trans: np.ndarray
    accept: np.ndarray
    signal: np.ndarray
    cost: np.ndarray

    def __post_init__(self) -> None:
        M = len(self.init)
        if self.n < 1 or self.trans.shape != (M, M) or self.accept.shape != (M,) or self.signal.shape[0] != M:
            raise ValueError("HiddenRegime: n >= 1, init (M,), trans (M, M), accept (M,), signal (M, S)")
        for name, law in (("init", self.init[None, :]), ("trans", self.trans), ("signal", self.signal)):
            if np.any(law < 0.0) or not np.allclose(law.sum(axis=1), 1.0):
                raise ValueError(f"HiddenRegime: {name} rows must be probability laws")
        if np.any(self.accept < 0.0) or np.any(self.accept > 1.0) or np.any(self.cost < 0.0):
            raise ValueError("HiddenRegime: accept in [0, 1], cost >= 0")

    @property
    def kmax(self) -> int:
        """Largest budget K."""
        return len(self.cost) - 1

    @property
    def ar_cost(self) -> float:
        """Cost of autoregressive decoding (k = 0 at every position): the speedup's numerator."""
        return float(self.n * self.cost[0])

    def paths(self) -> list[tuple[tuple[int, ...], float]]:
        """Every regime path h_0..h_{N-1} with its probability (M^N of them: small instances only)."""
        M = len(self.init)
        out = []
        for h in itertools.product(range(M), repeat=self.n):
            p = float(self.init[h[0]]) * float(np.prod([self.trans[a, b] for a, b in itertools.pairwise(h)]))
            if p > 0.0:
                out.append((h, p))
        return out


def round_law(accept: float | np.ndarray, k: int) -> np.ndarray:
    """P(a accepted drafts), a = 0..k, with every draft accepted with conditional probability ``accept``.

    ``P(a) = accept^a (1 - accept)`` for a < k and ``accept^k`` for a = k; vectorised over ``accept``
    (shape (..., k + 1)).
    """
    r = np.asarray(accept, dtype=np.float64)[..., None]
    a = np.arange(k + 1)
    p = r**a * (1.0 - r)
    p[..., k] = r[..., 0] ** k
    return p


def regime_mdp_values(inst: HiddenRegime) -> np.ndarray:
    """(N + 1, M) optimal cost-to-go of the MDP that sees the current regime (not the future ones).

    ``V(t, m) = min_k cost[k] + sum_a P(a | accept[m], k) sum_m' trans^(a+1)[m, m'] V(t', m')``,
    ``t' = min(t + a + 1, N)``, ``V(N, .) = 0``.
    """
    N, M, K = inst.n, len(inst.init), inst.kmax
    powers = [np.linalg.matrix_power(inst.trans, a + 1) for a in range(K + 1)]
    V = np.zeros((N + 1, M))
    for t in range(N - 1, -1, -1):
        best = np.full(M, np.inf)
        for k in range(K + 1):
            law = round_law(inst.accept, k)  # (M, k + 1)
            nxt = np.array([powers[a] @ V[min(t + a + 1, N)] for a in range(k + 1)]).T  # (M, k + 1)
            best = np.minimum(best, inst.cost[k] + (law * nxt).sum(axis=1))
        V[t] = best
    return V


def belief_value(inst: HiddenRegime) -> Callable[[int, np.ndarray], float]:
    """The belief model's value function ``W(t, b) = b . V_MDP(t, :)`` (:func:`regime_mdp_values`)."""
    V = regime_mdp_values(inst)
    return lambda t, b: float(np.dot(b, V[t]))


@dataclass(frozen=True)
class DualBound:
    """The dual bounds of an instance (expected costs, ms; speedups = AR cost / cost).

    Attributes:
        clairvoyant: The zero-penalty bound: the SSP that knows the regime path (``lambda = 0``).
        by_lambda: ``{lambda: bound}`` with penalty ``lambda W``: each one a valid lower bound on cost.
        bound: The largest of them (the tightest valid bound).
        ar: The autoregressive cost.
    """

    clairvoyant: float
    by_lambda: dict[float, float]
    bound: float
    ar: float

    @property
    def speedup(self) -> float:
        """Upper bound on the speedup of every non-anticipative controller."""
        return self.ar / self.bound

    @property
    def clairvoyant_speedup(self) -> float:
        """The clairvoyant bound's speedup."""
        return self.ar / self.clairvoyant


def _post(prior: np.ndarray, like: np.ndarray) -> np.ndarray:
    p = prior * like
    s = p.sum()
    return p / s if s > 0.0 else prior


def relaxed_value(inst: HiddenRegime, h: tuple[int, ...], W: Callable[[int, np.ndarray], float] | None) -> float:
    """Expected optimal relaxed cost given the regime path ``h``, with the penalty of ``W`` (None: no penalty).

    The relaxed decision maker knows ``h`` and its information state ``(t, b)`` (``b`` its posterior of
    the regime at t after the round's signal); per round it pays ``cost[k] + E_F[W(x') | x, k] - W(x')``,
    the outcome ``a`` drawn from the true regime ``accept[h_t]`` and the next signal from ``signal[h_t']``.
    Averaged over the first signal.
    """
    N, K = inst.n, inst.kmax
    powers = [np.linalg.matrix_power(inst.trans, a + 1) for a in range(K + 1)]
    laws = [round_law(inst.accept, k) for k in range(K + 1)]  # (M, k + 1) per budget
    memo: dict[tuple[int, tuple[float, ...]], float] = {}
    wmemo: dict[tuple[int, tuple[float, ...]], float] = {}

    def w(t: int, b: np.ndarray) -> float:
        if W is None or t >= N:
            return 0.0
        key = (t, tuple(np.round(b, _DECIMALS)))
        if key not in wmemo:
            wmemo[key] = W(t, b)
        return wmemo[key]

    def successors(t: int, b: np.ndarray, k: int, a: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(t', prior of h_t' given the controller's information, law of the next signal under it)."""
        t2 = min(t + a + 1, N)
        post_a = _post(b, laws[k][:, a])
        prior2 = post_a @ powers[a]
        return t2, prior2, prior2 @ inst.signal

    def value(t: int, b: np.ndarray) -> float:
        if t >= N:
            return 0.0
        key = (t, tuple(np.round(b, _DECIMALS)))
        if key in memo:
            return memo[key]
        true_law = [law[h[t]] for law in laws]
        believed = [b @ law for law in laws]
        best = np.inf
        for k in range(K + 1):
            expect_w = 0.0  # E_F[W(x') | x, k]: the controller's law of the outcome and the next signal
            relaxed = 0.0  # E[D(x') - W(x') | h, x, k]: the true law given the regime path
            for a in range(k + 1):
                t2, prior2, sig_f = successors(t, b, k, a)
                for s in range(inst.signal.shape[1]):
                    b2 = _post(prior2, inst.signal[:, s]) if t2 < N else prior2
                    wv = w(t2, b2)
                    expect_w += believed[k][a] * sig_f[s] * wv
                    if true_law[k][a] > 0.0:
                        p_sig = inst.signal[h[t2], s] if t2 < N else (1.0 if s == 0 else 0.0)
                        if p_sig > 0.0:
                            relaxed += true_law[k][a] * p_sig * (value(t2, b2) - wv)
                    if t2 >= N:
                        break  # no signal after the end: one terminal state
            best = min(best, float(inst.cost[k]) + expect_w + relaxed)
        memo[key] = best
        return best

    total = 0.0
    for s in range(inst.signal.shape[1]):
        p = inst.signal[h[0], s]
        if p > 0.0:
            total += p * value(0, _post(inst.init, inst.signal[:, s]))
    return total


def dual_bound(
    inst: HiddenRegime,
    W: Callable[[int, np.ndarray], float] | None = None,
    lambdas: tuple[float, ...] = LAMBDAS,
) -> DualBound:
    """The information-relaxation dual bound of ``inst`` (expected cost over the regime paths).

    Args:
        inst: The instance.
        W: The penalty's value function ``W(t, b)``, ``b`` the posterior of the current regime after
            the round's signal; default the belief model's (:func:`belief_value`).
        lambdas: Penalty scales: the bound of each ``lambda W`` (0: the clairvoyant bound) is computed.

    Returns:
        The :class:`DualBound`: every ``lambda``'s bound, the clairvoyant bound and the largest.
    """
    W = belief_value(inst) if W is None else W
    paths = inst.paths()
    by = {}
    for lam in dict.fromkeys((0.0, *lambdas)):
        pen = None if lam == 0.0 else (lambda t, b, lam=lam: lam * W(t, b))
        by[float(lam)] = float(sum(p * relaxed_value(inst, h, pen) for h, p in paths))
    return DualBound(by[0.0], by, max(by.values()), inst.ar_cost)
