"""Batch controllers: one budget per request of a batched verification step (``specenv/MoESpecBatch-v0``).

A batch controller speaks the one policy protocol (:mod:`specenv.policy.base`): ``act(obs, ids, step)``
gets the stacked per-request observations of the step's requests (the active slots of
``specenv/MoESpecBatch-v0``, or the requests of a vLLM engine step), one stable id per row and the
step's batch features (:class:`specenv.policy.base.BatchStep`), and returns all their budgets at once
(:class:`BatchPolicy`). The batch environment's flat observation
(:class:`specenv.observation.batch.BatchObservationSpec`) reaches it through
:func:`specenv.policy.base.act_batch_obs` (idle slots get 0); ``act(flat observation)`` is that
adapter's alias. The rows (DESIGN.md section 5, "batch controllers"):

* :class:`FixedBatch`: the same k for every request (vLLM's ``num_speculative_tokens``);
* :class:`DSDBatch`: vLLM's dynamic speculative decoding table, one k per step looked up by the
  number of running requests (:class:`policies.peers.VLLMDSDTable`'s lookup), the table fitted on
  the train split (:func:`fit_dsd_table`);
* :class:`AdaptiveVerificationBatch`: vLLM adaptive verification at batch level: every drafted token
  (h = kmax per request, drafting mode ``block``) is scored by the draft's survival estimate
  ``prod_{i<=j} q_{r,i}``, one global budget b is spent on the best scores
  (:func:`specenv.replay.batch.allocate_budget`) and b maximises
  ``(n + sum of the selected scores) / (T_draft + T_verify(b))`` as ``get_num_tokens`` does, with the
  batch cost model as the verify curve and the confidences of the previous step (vLLM's stale copy;
  1.0 for a new request);
* :class:`TetrisBatch`: TETRIS-style greedy selection: starting from no draft, repeatedly add the
  drafted token with the largest marginal expected accepted tokens per marginal step cost (the batch
  cost model, so the marginal expert cost of the batch union is included) while that raises the
  step's goodput (expected tokens per ms); block mode, h = kmax;
* :class:`GoodputBatch`: SmartSpec's goodput at batch level: one k for the whole batch maximising
  ``sum_r (1 - alpha_r^(k+1)) / (1 - alpha_r) / step_ms(k, ..., k)`` with alpha_r each request's
  running acceptance (the estimator of :class:`policies.heuristics.GoodputRule`);
* :class:`PerRequest`: any single-request policy run on every slot's own observation (the delta rule
  :class:`policies.delta.DeltaSpaceRule`, an exported MLP...);
* :class:`StepPolicy`: any policy of the protocol that decides a step jointly
  (:class:`policies.batch.goodput.BatchGoodput`) under a row name;
* :class:`TableGated`: any policy (a per-request MLP trained at batch 1) switched on and off by the
  batch size: k = 0 for a step of n requests where the train-fitted dynamic-SD table says 0 at n
  (:class:`DSDBatch`'s lookup), the wrapped policy's budgets elsewhere, so a per-request policy does
  not draft like at batch 1 when eight requests share the step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from policies.batch import tetris
from policies.heuristics import AcceptanceEstimator
from policies.peers import parse_schedule
from specenv.cost.batch import BatchCostModel, odd_queries
from specenv.observation.batch import BatchObservationSpec
from specenv.observation.single import ObsView
from specenv.policy.base import BatchStep, act_batch_obs, policy_drafting
from specenv.replay.batch import allocate_budgets

__all__ = [
    "AdaptiveVerificationBatch",
    "BatchPolicy",
    "DSDBatch",
    "FixedBatch",
    "GoodputBatch",
    "PerRequest",
    "StepPolicy",
    "TableGated",
    "TetrisBatch",
]


class BatchPolicy:
    """Base of the batch controllers: the protocol's ``act(obs, ids, step) -> (n,)`` budgets, clipped to 0..kmax.

    Subclasses implement :meth:`_act` on the rows (n, dim) of the step's requests; a stateful one
    keys its memory by the ids and forgets them in :meth:`reset` / :meth:`release`.

    Attributes:
        name: Row name.
        drafting: Drafting mode the policy runs in (``"none"``: k chosen before drafting;
            ``"block"``: the drafter proposes h = lookahead tokens per request first).
        stateless: True when the budgets depend on the arguments of ``act`` only.

    Args:
        spec: The batch observation layout (``spec.request`` is the per-request contract of the rows).
    """

    name = "batch-policy"
    drafting = "none"
    stateless = True

    def __init__(self, spec: BatchObservationSpec):
        self.spec = spec
        self.view = ObsView(spec.request)
        self.kmax = spec.request.kmax

    def reset(self) -> None:
        """Forget the episode."""

    def release(self, ids: Sequence[Hashable]) -> None:
        """Forget finished requests (nothing kept by a stateless controller)."""

    def act(self, obs: np.ndarray, ids: Sequence[Hashable] | None = None, step: BatchStep | None = None) -> Any:
        """(n,) budgets for the rows ``obs`` (n, dim) of requests ``ids`` (default 0..n-1).

        Aliases: the batch environment's flat observation gives its (B,) budgets
        (:func:`specenv.policy.base.act_batch_obs`); one 1-D request observation gives one int.
        """
        x = np.asarray(obs, dtype=np.float32)
        if x.ndim == 1:
            return (
                act_batch_obs(self, self.spec, x) if len(x) == self.spec.dim else int(self.act(x[None], ids, step)[0])
            )
        keys = list(range(len(x))) if ids is None else list(ids)
        if not len(x):
            return np.zeros(0, dtype=np.int64)
        return np.clip(self._act(x, keys, step), 0, self.kmax).astype(np.int64)

    def _act(self, req: np.ndarray, ids: list[Hashable], step: BatchStep | None) -> np.ndarray:
        raise NotImplementedError

    def _contexts(self, req: np.ndarray) -> np.ndarray:
        return req[:, self.view.i_context].astype(np.float64) * self.view.scale


class FixedBatch(BatchPolicy):
    """The same budget k for every request."""

    observes = False  # the protocol's ``observes``: k from nothing

    def __init__(self, spec: BatchObservationSpec, k: int):
        super().__init__(spec)
        self.k = int(k)
        self.name = f"fixed k={self.k}"

    def _act(self, req: np.ndarray, ids: list[Hashable], step: BatchStep | None) -> np.ndarray:
        return np.full(len(req), self.k, dtype=np.int64)


class DSDBatch(BatchPolicy):
    """vLLM's dynamic-SD table: one k per step from the number of running requests.

    Args:
        spec: Batch observation layout.
        schedule: ``[(start, end, k), ...]`` or ``"start-end:k;..."`` (:func:`policies.peers.parse_schedule`).
    """

    observes = False  # the protocol's ``observes``: k from the number of rows only

    def __init__(self, spec: BatchObservationSpec, schedule: str | Sequence[Sequence[int]]):
        super().__init__(spec)
        self.schedule = parse_schedule(schedule)
        self.name = "vllm-dsd-table " + ";".join(f"{lo}-{hi}:{k}" for lo, hi, k in self.schedule)

    def lookup(self, n: int) -> int:
        """K for n running requests (vLLM's dense lookup: gaps and the tail carry the last k)."""
        k = self.schedule[0][2]
        for lo, _hi, kk in self.schedule:
            if lo > n:
                break
            k = kk
        return min(k, self.kmax)

    def _act(self, req: np.ndarray, ids: list[Hashable], step: BatchStep | None) -> np.ndarray:
        return np.full(len(req), self.lookup(len(req)), dtype=np.int64)


def fit_dsd_table(score: Callable[[int, int], float], batch_size: int, kmax: int) -> list[tuple[int, int, int]]:
    """The best dynamic-SD table on the train split: for each batch size n, the fixed k of best score.

    Args:
        score: ``score(n, k)``: the train speedup of fixed k at n concurrent requests (higher is better).
        batch_size: B; the table covers 1..B (the tail of an episode runs fewer requests).
        kmax: Largest budget.

    Returns:
        The schedule ``[(n, n, k_n)]`` for n = 1..B, adjacent equal budgets merged.
    """
    table: list[tuple[int, int, int]] = []
    for n in range(1, batch_size + 1):
        k = int(np.argmax([score(n, k) for k in range(kmax + 1)]))
        if table and table[-1][2] == k:
            table[-1] = (table[-1][0], n, k)
        else:
            table.append((n, n, k))
    return table


class _CostBatch(BatchPolicy):
    """Batch rules that price a step with the batch cost model and a U prior per budget."""

    def __init__(self, spec: BatchObservationSpec, batch_cost: BatchCostModel, u_prior: np.ndarray):
        super().__init__(spec)
        self.batch_cost = batch_cost
        self.u_prior = np.asarray(u_prior, dtype=np.float64)[: self.kmax + 1]

    def step_ms(self, k: np.ndarray, drafted: np.ndarray, ctx: np.ndarray) -> float:
        """Predicted step cost of budgets ``k`` (U from the prior)."""
        return float(self.batch_cost.step_ms(k, drafted, self.u_prior[k], ctx))

    def step_ms_many(self, k: np.ndarray, drafted: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """Predicted cost of many candidate steps of the same requests: ``k`` is (candidates, n).

        The same formula as :meth:`specenv.cost.batch.BatchCostModel.step_ms` (its vectorised
        ``predict_u_batch_many`` and ``verify_from_totals``), with the same draft for every candidate.
        """
        bc = self.batch_cost
        k = np.asarray(k, dtype=np.int64)
        n = k.shape[1]
        ub = bc.predict_u_batch_many(self.u_prior[k])
        verify = bc.verify_from_totals(k.sum(axis=1) + n, n, ub, float(np.sum(ctx)), odd_queries(k))
        return verify + bc.draft_ms(np.asarray(drafted, dtype=np.int64))


class AdaptiveVerificationBatch(_CostBatch):
    """vLLM adaptive verification at batch level (module docstring); drafting mode ``block``, h = lookahead.

    Args:
        spec: Batch observation layout (per-request lookahead >= 1).
        batch_cost: The server's batch cost model.
        u_prior: U(k) per budget (train means).
        stale: Use the previous step's confidences of each request, as vLLM 0.32 does.
    """

    drafting = "block"
    stateless = False

    def __init__(self, spec: BatchObservationSpec, batch_cost: BatchCostModel, u_prior: np.ndarray, stale: bool = True):
        if spec.request.lookahead < 1:
            raise ValueError("AdaptiveVerificationBatch needs per-request lookahead >= 1")
        super().__init__(spec, batch_cost, u_prior)
        self.stale = bool(stale)
        self.name = "vllm-adaptive-verification" + ("" if stale else "-fresh")
        self.reset()

    def reset(self) -> None:
        """Forget the stale confidences."""
        self.prev: dict[Hashable, np.ndarray] = {}

    def release(self, ids: Sequence[Hashable]) -> None:
        """Forget finished requests' stale confidences."""
        for i in ids:
            self.prev.pop(i, None)

    def _act(self, req: np.ndarray, ids: list[Hashable], step: BatchStep | None) -> np.ndarray:
        h = self.spec.request.lookahead
        conf = req[:, self.view.conf_slice].astype(np.float64)
        first = req[:, self.view.i_first_round] >= 0.5
        ones = np.ones(h)
        used = np.stack([ones if f else self.prev.get(i, ones) for i, f in zip(ids, first, strict=True)])
        if not self.stale:
            used = conf
        for i, c in zip(ids, conf, strict=True):
            self.prev[i] = c.copy()
        scores = np.cumprod(used, axis=1)
        ctx = self._contexts(req)
        n = len(req)
        drafted = np.full(n, h, dtype=np.int64)
        flat = np.sort(scores.ravel())[::-1]
        gain = n + np.concatenate([[0.0], np.cumsum(flat)])
        ks = allocate_budgets(scores)  # allocate_budget(scores, b) for every b = 0..n h
        val = gain / self.step_ms_many(ks, drafted, ctx)
        return ks[int(np.argmax(val))]


class TetrisBatch(_CostBatch):
    """TETRIS-style greedy draft-token selection priced by the batch cost model (module docstring).

    Args:
        spec: Batch observation layout (per-request lookahead >= 1).
        batch_cost: The server's batch cost model.
        u_prior: U(k) per budget (train means).
    """

    drafting = "block"
    name = "tetris-greedy"

    def _act(self, req: np.ndarray, ids: list[Hashable], step: BatchStep | None) -> np.ndarray:
        h = self.spec.request.lookahead
        surv = np.cumprod(req[:, self.view.conf_slice].astype(np.float64), axis=1)
        drafted = np.full(len(req), h, dtype=np.int64)
        # the greedy loop (policies.batch.tetris.reference), compiled and checked exactly: the same budgets
        return tetris.select(surv, h, drafted, self._contexts(req), self.step_ms_many, self.batch_cost, self.u_prior)


class GoodputBatch(_CostBatch):
    """SmartSpec goodput at batch level: one k for the batch from every request's acceptance rate.

    Args:
        spec: Batch observation layout.
        batch_cost: The server's batch cost model.
        u_prior: U(k) per budget (train means).
        rho_prior: Prior conditional acceptance per depth (train means), as :class:`policies.heuristics.GoodputRule`.
        forget: Weight of the past acceptance evidence per round.
    """

    name = "smartspec-goodput"
    stateless = False

    def __init__(
        self,
        spec: BatchObservationSpec,
        batch_cost: BatchCostModel,
        u_prior: np.ndarray,
        rho_prior: np.ndarray | None = None,
        forget: float = 0.9,
    ):
        super().__init__(spec, batch_cost, u_prior)
        self.rho_prior = rho_prior
        self.forget = forget
        self.reset()

    def reset(self) -> None:
        """Forget every request's acceptance estimator."""
        self.acc: dict[Hashable, AcceptanceEstimator] = {}

    def release(self, ids: Sequence[Hashable]) -> None:
        """Forget finished requests' estimators."""
        for i in ids:
            self.acc.pop(i, None)

    def _act(self, req: np.ndarray, ids: list[Hashable], step: BatchStep | None) -> np.ndarray:
        n = len(req)
        alpha = np.empty(n)
        for j, (i, o) in enumerate(zip(ids, req, strict=True)):
            a = self.acc.get(i)
            if a is None:
                a = self.acc[i] = AcceptanceEstimator(self.kmax, self.rho_prior, forget=self.forget)
            if self.view.first_round(o):
                a.reset()
            else:
                a.observe(self.view.prev_k(o), self.view.prev_accepted(o))
            alpha[j] = a.pooled()
        alpha = np.clip(alpha, 1e-6, 1 - 1e-6)
        ctx = self._contexts(req)
        ks = np.arange(self.kmax + 1)
        tokens = np.sum((1.0 - alpha[None, :] ** (ks[:, None] + 1)) / (1.0 - alpha[None, :]), axis=1)
        cand = np.repeat(ks[:, None], n, axis=1)
        draft = np.array([self.batch_cost.draft_ms(row) for row in cand])
        cost = self.step_ms_many(cand, np.zeros(n, dtype=np.int64), ctx) + draft
        return np.full(n, int(np.argmax(tokens / cost)), dtype=np.int64)


class StepPolicy(BatchPolicy):
    """Any policy of the protocol that decides a step jointly, under a row name.

    E.g. :class:`policies.batch.goodput.BatchGoodput`.

    Args:
        spec: Batch observation layout.
        policy: A policy of the protocol (``act(obs (n, dim), ids, step) -> (n,) budgets``).
        name: Row name (default the policy's).
    """

    def __init__(self, spec: BatchObservationSpec, policy: Any, name: str | None = None):
        super().__init__(spec)
        self.policy = policy
        self.name = name or str(getattr(policy, "name", "batch policy"))
        self.stateless = bool(getattr(policy, "stateless", False))
        #: the protocol's ``observes``: the wrapped policy's (a row that reads no observation may run blind)
        self.observes = bool(getattr(policy, "observes", True))

    def reset(self) -> None:
        """Reset the wrapped policy."""
        self.policy.reset()

    def release(self, ids: Sequence[Hashable]) -> None:
        """Release finished requests in the wrapped policy (when it keeps any)."""
        release = getattr(self.policy, "release", None)
        if release is not None:
            release(ids)

    @property
    def wrapped(self) -> Any:
        """The policy this row runs (what a server checks against its model: contract, experts, drafting)."""
        return self.policy

    def _act(self, req: np.ndarray, ids: list[Hashable], step: BatchStep | None) -> np.ndarray:
        return np.asarray(self.policy.act(req, ids, step), dtype=np.int64)


class PerRequest(StepPolicy):
    """A single-request policy on every request's own observation (each request keeps its own memory).

    Args:
        spec: Batch observation layout.
        policy: A :class:`specenv.policy.base.Policy` (or any policy of the protocol) for the
            per-request observation contract ``spec.request``.
        name: Row name (default the policy's).
        drafting: The drafting mode it runs in (default ``"none"``, or ``"block"`` when it reads a lookahead).
    """

    def __init__(self, spec: BatchObservationSpec, policy: Any, name: str | None = None, drafting: str | None = None):
        super().__init__(spec, policy, name or f"per-request {getattr(policy, 'name', 'policy')}")
        self.drafting = drafting or ("block" if spec.request.lookahead else "none")


class TableGated(StepPolicy):
    """A policy gated by the batch size: k = 0 where the dynamic-SD table says 0 for the step's n requests.

    The composition of a policy that knows the request (a per-request MLP, trained in single-request
    replay) with one that knows the batch (vLLM's dynamic-SD table fitted on the train split,
    :class:`DSDBatch`): for a step of n requests the table's k at n is looked up; where it is 0 the step
    verifies nothing (every budget 0, the wrapped policy is not asked), elsewhere the wrapped policy's
    budgets stand as it gives them (not capped by the table's k: the table says *whether* speculation
    pays at this batch size, the policy *how much* for each request). Its contract, drafting mode and
    draft signals are the wrapped policy's.

    Args:
        spec: Batch observation layout; ``spec.request`` must be the wrapped policy's contract.
        policy: A policy of the protocol.
        schedule: The table, ``[(start, end, k), ...]`` or ``"start-end:k;..."``.
        name: Row name (default ``"<policy> gated by <table>"``).

    Raises:
        ValueError: When ``spec.request`` is not the wrapped policy's observation contract.
    """

    def __init__(
        self,
        spec: BatchObservationSpec,
        policy: Any,
        schedule: str | Sequence[Sequence[int]],
        name: str | None = None,
    ):
        inner = getattr(policy, "spec", None)
        inner = getattr(inner, "request", inner)
        if inner is not None and inner != spec.request:
            raise ValueError("TableGated: spec.request is not the wrapped policy's observation contract")
        self.table = DSDBatch(spec, schedule)
        super().__init__(spec, policy, name or f"{getattr(policy, 'name', 'policy')} gated by {self.table.name}")
        self.drafting = policy_drafting(policy)

    def observes_at(self, n: int) -> bool:
        """The protocol's per-step ``observes``: False where the gate is shut for n requests (every k is 0)."""
        return self.observes and self.table.lookup(int(n)) > 0

    def _act(self, req: np.ndarray, ids: list[Hashable], step: BatchStep | None) -> np.ndarray:
        if self.table.lookup(len(req)) == 0:
            return np.zeros(len(req), dtype=np.int64)
        return super()._act(req, ids, step)
