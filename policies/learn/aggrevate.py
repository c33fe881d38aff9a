"""AggreVaTe with the learner's own cost-to-go: labels from branch rollouts of the current learner.

An expert of the DAgger loop (:mod:`policies.learn.dagger`) whose labels are what a controller's
own continuation makes of each action, not what an oracle's would. At every visited state s of an
iteration's roll-in (its position row and the running statistics of its observation) and for every
budget k, :func:`branch_costs` replays the episode from s: one round of budget k (in expectation
over its outcome: one branch per accepted count, weighted by the split's acceptance law at that
position), then the *continuation* policy's budgets round after round until the generation ends (or
for ``horizon`` rounds, then a tail value: the belief oracle's cost-to-go), on the replay
environment's own tables (the true acceptances of the split trained on, its charged costs) and with
the observation rebuilt round by round exactly as the environment builds it. The label of (s, k) is
that total cost, ``Q(s, k) = C(s, k) + E[cost of the continuation from where k leads]``; the regrets
are ``(Q - min_k Q) / ar_unit``.

The continuation is the roll-in expert's table (the belief oracle's budgets, :func:`expert_arrays`
with ``"belief"``) until the learner's first fit, then the current learner itself (its greedy budget
on the rebuilt observation): approximate policy iteration with rollouts, as in AggreVaTe (Ross &
Bagnell 2014) and LOLS (Chang et al. 2015, "Learning to search better than your teacher"), where the
roll-out policy is the learned one. Two properties follow:

* **Non-clairvoyant continuation, learner-consistent.** After the action, nothing knows the future
  acceptances: the continuation decides from the observation only, as the learner will at test time.
  The first round's outcome law is the true one of the visited position (on greedy traces its
  recorded verdict); states that look alike to the learner are averaged by its expected-regret loss,
  so it learns the action that is best in expectation given what it sees.
* **No k = 0 information trap.** In drafting mode none a k = 0 round brings no acceptance
  information, so after one the observation's acceptance statistics stay frozen; a learner that
  plays k = 0 there plays it again and again. Labels priced by an oracle's (or a belief's)
  continuation do not see that (they assume the oracle resumes drafting); here the continuation is
  the learner, so a k = 0 that leads to a k = 0 loop is charged the plain decoding of the rest of
  the generation, and the labels move the learner out of it.

For a trace set with acceptance probabilities (not 0/1), each continuation round draws one uniform
per visited state shared by all the state's branches (common random numbers), as the environment
draws one per round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from policies.learn.dagger import RegretMLP, Visits
from specenv.observation.single import ObservationState
from specenv.replay.episode import settle

__all__ = ["Continuation", "RolloutExpert", "branch_costs", "observation_state"]

#: ``continuation(obs, rows) -> budgets``: the policy that plays after a labelled action, on (m, dim)
#: float32 observations at position rows ``rows`` (m,).
Continuation = Callable[[np.ndarray, np.ndarray], np.ndarray]


def observation_state(spec: Any, stats: np.ndarray) -> ObservationState:
    """An :class:`ObservationState` whose streams resume from statistics in ``ScalarObservation.values`` form.

    Args:
        spec: The observation contract.
        stats: (n, 8 + kmax) ``[prev_k / kmax, prev_accepted / kmax, prev_U / n_experts, prev_cost /
            (kmax + 1), acc_rate, acc_len, cost_per_token, first_round, acc_depth_1..kmax]``
            (:attr:`specenv.envs.replay.MoESpecEnv.observation_statistics`).
    """
    stats = np.asarray(stats, dtype=np.float64)
    if stats.ndim != 2 or stats.shape[1] != 8 + spec.kmax:
        raise ValueError(f"observation statistics: shape {stats.shape}, expected (n, {8 + spec.kmax})")
    st = ObservationState(spec, len(stats))
    st.prev_k = np.rint(stats[:, 0] * spec.kmax)
    st.prev_acc = np.rint(stats[:, 1] * spec.kmax)
    st.prev_U = stats[:, 2] * spec.n_experts
    st.prev_cost = stats[:, 3] * (spec.kmax + 1)
    st.acc_rate = stats[:, 4]
    st.acc_len = stats[:, 5]
    st.cost_per_token = stats[:, 6]
    st.first = stats[:, 7]
    st.acc_depth = stats[:, 8:]
    return st


def branch_costs(
    data: Any,
    rows: np.ndarray,
    stats: np.ndarray,
    continuation: Continuation,
    rng: np.random.Generator,
    horizon: int | None = None,
    tail: np.ndarray | None = None,
) -> np.ndarray:
    """Expected cost of every first budget from every state, the continuation playing after it: (n, kmax + 1) ms.

    The first round of budget k at state i is taken in expectation over its outcome: one branch per
    number of accepted drafts a = 0..k, weighted by ``P(a | t, k)`` (the split's survival: ``P(a >= j)
    - P(a >= j + 1)``, 0/1 on greedy traces, where the zero-weight branches are dropped). From there
    each branch plays the continuation's budgets, its rounds drawn as the environment draws them (the
    leading drafts with ``u < P(a >= j)`` accepted; one uniform per state and round, shared by the
    state's branches), charged and committed by :func:`specenv.replay.episode.settle`, its observation
    rebuilt by :class:`specenv.observation.single.ObservationState` (the update after each round, then
    the vector at the new context and position, with the new position's draft signals when the
    contract has a lookahead).

    Args:
        data: The replay tables (:class:`specenv.replay.tables.ReplayData`) of the split.
        rows: (n,) position rows of the states (``offsets[g] + t``).
        stats: (n, 8 + kmax) their observations' running statistics (:func:`observation_state`).
        continuation: The policy after the first round.
        rng: Draws one uniform per state and continuation round (shared by the state's branches).
        horizon: Rounds the continuation plays before the tail takes over (None: to the end; 0: the
            tail right after the first round).
        tail: (n_rows,) cost-to-go in ms from a row, added where the horizon cuts a branch (required
            with ``horizon``).

    Returns:
        ``Q[i, k]``: the expected cost in ms of budget k at state i plus the continuation's rounds
        (plus the tail).
    """
    rows = np.asarray(rows, dtype=np.int64)
    if horizon is not None and (tail is None or horizon < 0):
        raise ValueError("branch_costs: a horizon (>= 0) needs a tail value")
    spec = data.spec
    K = data.kmax
    W = K + 1
    n = len(rows)
    g = np.searchsorted(data.offsets, rows, side="right") - 1
    # the first round's outcomes: pairs (k, a), a = 0..k, and their probabilities at each state
    kk = np.concatenate([np.full(k + 1, k) for k in range(W)])
    aa = np.concatenate([np.arange(k + 1) for k in range(W)])
    S = np.ones((n, W + 1))
    S[:, 1:W] = data.survival[rows, :K]  # S[:, j] = P(a >= j), j = 0..K
    S[:, W] = 0.0
    Snext = np.where(aa < kk, S[:, np.minimum(aa + 1, W)], 0.0)  # P(a >= a' + 1) inside the budget
    prob = S[:, aa] - Snext  # (n, pairs)
    lane_state, pair = np.nonzero(prob > 0.0)
    weight = prob[lane_state, pair]
    k = kk[pair].astype(np.int64)
    accepted = aa[pair].astype(np.int64)
    off = data.offsets[g][lane_state].astype(np.int64)
    N = data.lengths[g][lane_state].astype(np.int64)
    L0 = data.L0[g][lane_state].astype(np.int64)
    t = (rows[lane_state] - off).astype(np.int64)
    obs_state = observation_state(spec, stats).take(lane_state)
    obs_state.clip = not data.within_box
    total = np.zeros(len(lane_state))
    lanes = np.arange(len(lane_state))  # active lanes, in order
    cost_flat, U_flat, surv_flat = data.cost.ravel(), data.U.ravel(), data.survival.ravel()
    depth = np.arange(K)
    played = 0
    while lanes.size:
        row = off[lanes] + t[lanes]
        if played:  # a continuation round: drawn as the environment draws it
            u = rng.random(n)[lane_state[lanes]]
            surv = surv_flat.take(row[:, None] * W + depth[None, :])  # (m, K): P(a >= j), j = 1..K
            accepted = ((u[:, None] < surv) & (depth[None, :] < k[:, None])).sum(axis=1)
        r = settle(
            k,
            t[lanes],
            accepted,
            N[lanes],
            row,
            W,
            cost_flat.take,
            U_flat.take,
            data.ar_ctx_ms.take,
            data.ar_unit_ms,
            np.minimum,
        )
        total[lanes] += r.cost_ms
        obs_state.update(k, r.accepted, r.U_r, r.ctx_units, r.committed)
        t[lanes] = r.t_next
        played += 1
        live = ~r.terminated
        if horizon is not None and played > horizon:
            cut = lanes[live]
            total[cut] += tail[off[cut] + t[cut]]
            live[:] = False
        if not live.all():
            lanes = lanes[live]
            obs_state = obs_state.take(live)
            obs_state.clip = not data.within_box
        if not lanes.size:
            break
        nrow = off[lanes] + t[lanes]
        conf = data.conf[nrow] if spec.lookahead else None
        obs = obs_state.build(L0[lanes] + t[lanes], t[lanes], conf)
        k = np.asarray(continuation(obs, nrow), dtype=np.int64)
        if k.shape != lanes.shape or k.min() < 0 or k.max() > K:
            raise ValueError(f"continuation: budgets outside 0..{K} (or of the wrong shape)")
    Q = np.zeros(n * W)
    np.add.at(Q, lane_state * W + kk[pair], weight * total)
    return Q.reshape(n, W)


class RolloutExpert:
    """The DAgger expert of AggreVaTe with the learner's cost-to-go (module docstring).

    It plays ``k[row]`` in the roll-in mixture (the belief oracle's budgets) and labels every visited
    state with :func:`branch_costs`, the continuation being the table ``k`` until the learner's first
    fit and the current learner afterwards (:meth:`update`).

    Args:
        data: The replay tables of the split (the environment's ``unwrapped.data``).
        k: (n_rows,) the roll-in expert's budget per position row.
        learner: The learner (its greedy budget continues the branches after its first fit).
        rng: The generator of the branches' acceptance draws and of the state subsample.
        horizon: Rounds of continuation before ``tail`` (None: to the generation's end).
        tail: (n_rows,) cost-to-go in ms (with ``horizon``).
        max_states: Label at most this many visited states per iteration (a uniform subsample; None: all).
        relabel: After each fit, relabel the whole aggregate with the new learner's continuation
            (approximate policy iteration on every state seen), instead of keeping each iteration's labels.
    """

    def __init__(
        self,
        data: Any,
        k: np.ndarray,
        learner: RegretMLP,
        rng: np.random.Generator,
        horizon: int | None = None,
        tail: np.ndarray | None = None,
        max_states: int | None = None,
        relabel: bool = False,
    ):
        if not hasattr(data, "survival"):
            raise TypeError("RolloutExpert: data must be the replay tables of the split (ReplayData)")
        self.data = data
        self.k = np.asarray(k, dtype=np.int64)
        self.learner = learner
        self.rng = rng
        self.horizon = horizon
        self.tail = tail
        self.max_states = max_states
        self.relabel = relabel
        self.fitted = False
        self._keep: dict[int, np.ndarray] = {}

    def act(self, rows: Any) -> Any:
        """``k[rows]``."""
        return self.k[rows]

    def continuation(self, obs: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The learner's greedy budgets once fitted, else the table's."""
        return self.learner.greedy(obs) if self.fitted else self.k[rows]

    def examples(self, visits: Visits) -> tuple[np.ndarray, np.ndarray]:
        """The visited states' observations and regrets ``(Q - min Q) / ar_unit`` (float32)."""
        if visits.state.shape[0] != len(visits.rows):
            raise ValueError(
                "RolloutExpert: the visits carry no observation statistics (ReplayEpisodes(record_state=True))"
            )
        keep = self._keep.get(id(visits))
        if keep is None:
            n = len(visits.rows)
            keep = np.arange(n)
            if self.max_states is not None and n > self.max_states:
                keep = np.sort(self.rng.choice(n, self.max_states, replace=False))
            self._keep[id(visits)] = keep
        Q = branch_costs(
            self.data, visits.rows[keep], visits.state[keep], self.continuation, self.rng, self.horizon, self.tail
        )
        regret = (Q - Q.min(axis=1, keepdims=True)) / self.data.ar_unit_ms
        return visits.obs[keep], regret.astype(np.float32)

    def update(self, learner: RegretMLP, visits: list[Visits]) -> bool:
        """From now on the learner continues the branches; True (relabel the aggregate) with ``relabel``."""
        self.learner = learner
        self.fitted = True
        return self.relabel
