"""Requests replayed as the vLLM controller serves a policy: the draft horizon, and the budgets capped at it.

The replay environment (``specenv/MoESpec-v1``) lets a round draft exactly the k it verifies, chosen
knowing the previous round's outcome. The vLLM controller cannot (:mod:`specenv.engines.vllm.controller`,
``draft_horizon="policy"``): vLLM drafts a request's next tokens in the same engine step that verifies its
current round, and how many it drafts is fixed when that step is *scheduled*, before the round's outcome
is known. So the controller asks the policy, at ``schedule``, what it would pick after the round now
verifying **if every draft of it were accepted** (the horizon: the what-if observation of
:meth:`specenv.engines.vllm.bookkeeping.ObsSlots.what_if`, asked with a peek that leaves the policy as it
was, :meth:`specenv.engines.vllm.served.ServedPolicy.peek`); the drafter proposes the largest horizon of
the step's requests for every one of them; and once the outcome is known the next round verifies the
policy's answer on the real observation, **capped at what was drafted** (the controller's
``stats["capped"]``). A served policy therefore pays ``T_D(h)`` for a round that verifies ``min(k, h)``:
after a rejection the policy may want more drafts than the optimistic horizon asked for (capped), and
after a full acceptance it may want fewer (drafts paid and thrown away).

A policy with a lookahead block (``spec.lookahead = h``) reads the signals of the h drafts the drafter
proposes at once: in the steps it reads, h drafts are proposed and its k is capped at h
(:func:`drafts_block`: a gated policy's shut gate drafts nothing).

:class:`ServedGroup` replays one group of requests that way, in lockstep (one round of every running
request per engine step, a finished request leaving the step), each request in its own replay
environment: the same acceptances and unique experts as the environment, the budgets and the drafts of
the controller. ``specenv abtest`` prices its steps (:func:`specenv.abtest.predict_batch`,
:func:`specenv.abtest.predicted_speedup`).

The what-if row's unknowns are filled as the controller fills them: U_r the request's last observed
U_r at that K, else the prior ``u_prior(K, top_k, n_experts)``; the round's cost its last cost (1 before
one). The first round's horizon is its own budget (the controller peeks on the first observation).
With ``draft_horizon="outcome"`` the controller asks once the target has verified, on each request's
observation after the round (its outcome, its U_r from the tap's routing, its cost): the replay asks on
the environment's observation after the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specenv.engines.base import u_prior
from specenv.engines.vllm.served import ServedPolicy
from specenv.observation.single import ScalarObservation
from specenv.policy.base import policy_spec

__all__ = ["ServedGroup", "ServedStep", "drafts_block", "what_if"]


def drafts_block(policy: Any, n: int) -> bool:
    """Whether a lookahead policy's block is drafted in a step of n requests, as the controller decides it.

    Everywhere, except where an observing policy's optional ``observes_at(n)`` (:mod:`specenv.policy.base`)
    is False: a gated policy's shut gate, every k 0 (:meth:`SpecControlScheduler._horizon`).
    """
    at = getattr(policy, "observes_at", None)
    return at is None or not getattr(policy, "observes", True) or bool(at(int(n)))


def what_if(env: Any, K: int, U: float, accepted: int | None = None, cost: float | None = None) -> np.ndarray:
    """The observation of ``env``'s request after a round of ``K`` drafts, all accepted, before it is played.

    The controller's what-if row (:meth:`specenv.engines.vllm.bookkeeping.ObsSlots.what_if`): the running
    statistics folded with ``K`` accepted of ``K`` (``K + 1`` committed), ``U`` unique experts and the last
    round's cost (1 before one), built at context ``L + K + 1`` after ``t + K + 1`` tokens. The environment
    is not changed.

    Args:
        env: A ``specenv/MoESpec-v1`` environment mid-episode (or its wrapper).
        K: Budget of the round now verifying.
        U: Its unique experts (the controller: the last observed at K, else the prior).
        accepted: Its accepted drafts instead of all K (the outcome known).
        cost: Its cost in AR steps instead of the last one (known once the target verified).
    """
    e = env.unwrapped
    spec = e.data.spec
    obs = ScalarObservation(spec)  # clips, as the controller's ObservationState does
    obs.values = e.observation_statistics.tolist()
    if cost is None:
        cost = obs.values[3] * (spec.kmax + 1)  # prev_cost in AR steps (stored / (kmax + 1))
        cost = cost if cost > 0 else 1.0
    a = int(K) if accepted is None else int(accepted)
    obs.update(int(K), a, float(U), float(cost), a + 1)
    t = int(e.episode.t) + a + 1
    return obs.build(float(e.episode.L0 + t), t, None)


@dataclass(frozen=True)
class ServedStep:
    """One engine step of a :class:`ServedGroup`.

    Attributes:
        rows: The group's requests in the step (their places in the group).
        wanted: The policy's budgets, before the cap.
        k: The budgets verified: ``wanted`` capped at ``drafted``.
        drafted: Drafts proposed for each request of the step (the step's horizon, or a lookahead block).
        infos: The environments' step infos, in ``rows`` order.
    """

    rows: list[int]
    wanted: np.ndarray
    k: np.ndarray
    drafted: int
    infos: list[dict[str, Any]]

    @property
    def capped(self) -> int:
        """Requests of the step that wanted more drafts than were proposed."""
        return int(np.sum(self.wanted > self.k))


class ServedGroup:
    """A group of requests replayed in lockstep as the controller serves a policy (module docstring).

    Args:
        envs: One ``specenv/MoESpec-v1`` environment per request slot (at least the group's size).
        make_policy: Builds one fresh policy.
        joint: A batch policy: one policy for the group, asked once per step with the stacked observations
            of the step's requests (``ids``: their places in the group), as the controller serves it;
            False: one policy per request, asked with its own observation.
        top_k: Experts per token of the served model (the prior U of a budget not yet observed).
        draft_horizon: How the controller sets the step's drafts (its setting of the same name):
            ``"policy"``, the horizon asked before the previous round's outcome (a full acceptance);
            ``"outcome"``, the most any request's policy would ask for once the previous round's outcome is
            known (on the observation after it: its U_r and cost read, as the controller reads them from the
            tap's routing), each request's k capped at it (a request-wise policy is never capped); None: the
            replay environment's drafting instead of the controller's (every request verifies the k it asked
            for, the step drafts its largest k or the policy's block), for comparison. A lookahead policy
            drafts its block under either setting.
    """

    HORIZONS = ("policy", "outcome")

    def __init__(
        self,
        envs: Sequence[Any],
        make_policy: Callable[[], Any],
        joint: bool = False,
        top_k: int = 1,
        draft_horizon: str | None = "policy",
    ):
        if draft_horizon is not None and draft_horizon not in self.HORIZONS:
            raise ValueError(f"draft_horizon={draft_horizon!r}: expected one of {self.HORIZONS} or None")
        self.envs = list(envs)
        self.make_policy = make_policy
        self.joint = bool(joint)
        self.draft_horizon = draft_horizon
        spec = self.envs[0].unwrapped.data.spec
        self.kmax = int(spec.kmax)
        self._prior = [float(u_prior(k, max(int(top_k), 1), int(spec.n_experts))) for k in range(self.kmax + 1)]
        self.pols: list[Any] = []
        self.obs: list[np.ndarray] = []
        self.live: list[bool] = []
        self.n_tok: list[int] = []
        self._last_U: list[dict[int, float]] = []
        self._h: int | None = None  # the drafts proposed for the next step (None: its first)
        self._served: list[ServedPolicy] = []  # the peeks' wrappers of self.pols (made at reset)
        self.lookahead = 0

    def reset(self, gids: Sequence[int], max_tokens: int | None = None) -> None:
        """Start the group's requests on generations ``gids`` (each stops at ``max_tokens`` tokens, None: its end)."""
        if len(gids) > len(self.envs):
            raise ValueError(f"ServedGroup: {len(gids)} requests for {len(self.envs)} environments")
        n = len(gids)
        self.pols = [self.make_policy()] if self.joint else [self.make_policy() for _ in range(n)]
        for pol in self.pols:
            pol.reset()
        spec = policy_spec(self.pols[0])
        self.lookahead = int(getattr(spec, "lookahead", 0) or 0)
        self._served = [ServedPolicy(p, spec or self.envs[0].unwrapped.data.spec, n) for p in self.pols]
        self.obs, self.live, self.n_tok, self._last_U = [], [], [], []
        data = self.envs[0].unwrapped.data
        for env, g in zip(self.envs, gids, strict=False):
            o, _ = env.reset(seed=0, options={"generation_id": int(g)})
            self.obs.append(o)
            self.live.append(True)
            length = int(data.lengths[data.index_of(int(g))])
            self.n_tok.append(length if max_tokens is None else min(int(max_tokens), length))
            self._last_U.append({})
        self._h = None

    @property
    def running(self) -> bool:
        """Whether a request of the group still runs."""
        return any(self.live)

    def _ask(self, idx: list[int], rows: list[np.ndarray], peek: bool) -> np.ndarray:
        """The policy's budgets on ``rows`` (one per request of ``idx``); ``peek``: leaving the policy as it was."""
        if self.joint:
            x = np.stack(rows)
            return (self._served[0].peek(x, idx, None) if peek else np.asarray(self.pols[0].act(x, ids=idx))).reshape(
                -1
            )
        if peek:
            return np.array(
                [int(self._served[i].peek(r[None, :], [None], None)[0]) for i, r in zip(idx, rows, strict=True)]
            )
        return np.array([int(self.pols[i].act(r)) for i, r in zip(idx, rows, strict=True)])

    def step(self) -> ServedStep:
        """One engine step: every running request's round, with the controller's budgets and drafts."""
        idx = [i for i, a in enumerate(self.live) if a]
        if not idx:
            raise RuntimeError("ServedGroup.step: no request runs (reset first)")
        wanted = np.clip(self._ask(idx, [self.obs[i] for i in idx], peek=False).astype(np.int64), 0, self.kmax)
        h = self.lookahead
        block = h if h and drafts_block(self.pols[0], len(idx)) else 0  # (a shut gate: no block, every k 0)
        mode = self.draft_horizon
        if mode is None:  # the environment's drafting: the k asked, the step's largest k (or the block)
            k = wanted
            drafted = max(int(k.max()), block)
        elif h:  # the block, where the policy reads the step; k capped at it
            drafted = block
            k = np.minimum(wanted, drafted)
        elif self._h is not None:
            drafted = self._h
            k = np.minimum(wanted, drafted)
        else:  # the first step (the controller peeks on the first observations: their own budgets)
            k = wanted
            drafted = int(k.max())
        if mode == "policy" and not h:  # the next step's horizon, asked before this round's outcome
            # the U_r it takes for this round: the request's last observed at that K, else the prior
            U_hz = [self._last_U[i].get(int(ki), self._prior[int(ki)]) for i, ki in zip(idx, k, strict=True)]
            rows = [what_if(self.envs[i], int(ki), u) for i, ki, u in zip(idx, k, U_hz, strict=True)]
            self._h = int(np.clip(self._ask(idx, rows, peek=True), 0, self.kmax).max())
        infos = []
        for i, ki in zip(idx, k, strict=True):
            o, _, done, _, info = self.envs[i].step(int(ki))
            self.obs[i] = o
            self._last_U[i][int(info["k"])] = float(info["U_r"])
            infos.append(info)
            if done or info["t"] >= self.n_tok[i]:
                self.live[i] = False
        if mode == "outcome" and not h:  # the next step's drafts, asked once this round's outcome is known:
            # on the observations after it (its U_r and cost read, as the controller reads them from the tap)
            self._h = int(np.clip(self._ask(idx, [self.obs[i] for i in idx], peek=True), 0, self.kmax).max())
        return ServedStep(idx, wanted, k, int(drafted), infos)
