"""Batch controllers: one budget per request of a batched verification step (``specenv/MoESpecBatch-v0``).

A batch policy reads the batch observation (:class:`specenv.batchobs.BatchObservationSpec`: B slot
blocks plus batch features) and returns the B budgets at once (:class:`BatchPolicy`); idle slots get
0. The rows (DESIGN.md section 5, "batch controllers"):

* :class:`FixedBatch`: the same k for every request (vLLM's ``num_speculative_tokens``);
* :class:`DSDBatch`: vLLM's dynamic speculative decoding table, one k per step looked up by the
  number of running requests (:class:`policies.peers.VLLMDSDTable`'s lookup), the table fitted on
  the train split (:func:`fit_dsd_table`);
* :class:`AdaptiveVerificationBatch`: vLLM adaptive verification at batch level: every drafted token
  (h = kmax per request, drafting mode ``block``) is scored by the draft's survival estimate
  ``prod_{i<=j} q_{r,i}``, one global budget b is spent on the best scores
  (:func:`specenv.batchreplay.allocate_budget`) and b maximises
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
* :class:`StepPolicy`: a batch policy of the vLLM controller's ``act_step`` protocol
  (:class:`policies.batch_goodput.BatchGoodput`) on the active slots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from policies.heuristics import AcceptanceEstimator
from policies.peers import parse_schedule
from specenv.batchcost import BatchCostModel
from specenv.batchobs import BatchObservationSpec
from specenv.batchreplay import allocate_budget
from specenv.observation import ObsView
from specenv.policy.base import Policy

__all__ = [
    "AdaptiveVerificationBatch",
    "BatchPolicy",
    "DSDBatch",
    "FixedBatch",
    "GoodputBatch",
    "PerRequest",
    "StepPolicy",
    "TetrisBatch",
]


class BatchPolicy:
    """Base of the batch controllers: ``reset()`` and ``act(obs) -> (B,) budgets``.

    Attributes:
        name: Row name.
        drafting: Drafting mode the policy runs in (``"none"``: k chosen before drafting;
            ``"block"``: the drafter proposes h = lookahead tokens per request first).

    Args:
        spec: The batch observation layout.
    """

    name = "batch-policy"
    drafting = "none"

    def __init__(self, spec: BatchObservationSpec):
        self.spec = spec
        self.view = ObsView(spec.request)
        self.kmax = spec.request.kmax

    def reset(self) -> None:
        """Forget the episode."""

    def act(self, obs: np.ndarray) -> np.ndarray:
        """(B,) budgets for the batch observation ``obs`` (0 for idle slots)."""
        active, req = self.spec.slots(obs)
        k = np.zeros(self.spec.batch_size, dtype=np.int64)
        if active.any():
            k[active] = np.clip(self._act(active, req), 0, self.kmax)[active]
        return k

    def _act(self, active: np.ndarray, req: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _contexts(self, req: np.ndarray) -> np.ndarray:
        return req[:, self.view.i_context].astype(np.float64) * self.view.scale


class FixedBatch(BatchPolicy):
    """The same budget k for every request."""

    def __init__(self, spec: BatchObservationSpec, k: int):
        super().__init__(spec)
        self.k = int(k)
        self.name = f"fixed k={self.k}"

    def _act(self, active: np.ndarray, req: np.ndarray) -> np.ndarray:
        return np.full(len(active), self.k, dtype=np.int64)


class DSDBatch(BatchPolicy):
    """vLLM's dynamic-SD table: one k per step from the number of running requests.

    Args:
        spec: Batch observation layout.
        schedule: ``[(start, end, k), ...]`` or ``"start-end:k;..."`` (:func:`policies.peers.parse_schedule`).
    """

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

    def _act(self, active: np.ndarray, req: np.ndarray) -> np.ndarray:
        return np.full(len(active), self.lookup(int(active.sum())), dtype=np.int64)


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

        The same formula as :meth:`specenv.batchcost.BatchCostModel.step_ms` (its vectorised
        ``predict_u_batch_many`` and ``verify_from_totals``), with the same draft for every candidate.
        """
        bc = self.batch_cost
        k = np.asarray(k, dtype=np.int64)
        n = k.shape[1]
        ub = bc.predict_u_batch_many(self.u_prior[k])
        verify = bc.verify_from_totals(k.sum(axis=1) + n, n, ub, float(np.sum(ctx)))
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

    def __init__(self, spec: BatchObservationSpec, batch_cost: BatchCostModel, u_prior: np.ndarray, stale: bool = True):
        if spec.request.lookahead < 1:
            raise ValueError("AdaptiveVerificationBatch needs per-request lookahead >= 1")
        super().__init__(spec, batch_cost, u_prior)
        self.stale = bool(stale)
        self.name = "vllm-adaptive-verification" + ("" if stale else "-fresh")
        self.reset()

    def reset(self) -> None:
        """Forget the stale confidences."""
        self.prev = np.ones((self.spec.batch_size, self.spec.request.lookahead))

    def _act(self, active: np.ndarray, req: np.ndarray) -> np.ndarray:
        h = self.spec.request.lookahead
        conf = req[:, self.view.conf_slice].astype(np.float64)
        first = req[:, self.view.i_first_round] >= 0.5
        self.prev[first] = 1.0
        used = self.prev.copy() if self.stale else conf
        self.prev = conf.copy()
        scores = np.where(active[:, None], np.cumprod(used, axis=1), -np.inf)
        idx = np.flatnonzero(active)
        ctx = self._contexts(req)[idx]
        drafted = np.full(len(idx), h, dtype=np.int64)
        n = len(idx)
        flat = np.sort(scores[idx].ravel())[::-1]
        gain = n + np.concatenate([[0.0], np.cumsum(flat)])
        ks = np.stack([allocate_budget(scores, b) for b in range(n * h + 1)])
        val = gain / self.step_ms_many(ks[:, idx], drafted, ctx)
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

    def _act(self, active: np.ndarray, req: np.ndarray) -> np.ndarray:
        h = self.spec.request.lookahead
        idx = np.flatnonzero(active)
        surv = np.cumprod(req[idx][:, self.view.conf_slice].astype(np.float64), axis=1)
        ctx = self._contexts(req)[idx]
        drafted = np.full(len(idx), h, dtype=np.int64)
        n = len(idx)
        k = np.zeros(n, dtype=np.int64)
        tokens = float(n)
        cost = float(self.step_ms_many(k[None, :], drafted, ctx)[0])
        eye = np.eye(n, dtype=np.int64)
        while True:
            cand = np.flatnonzero(k < h)
            if not len(cand):
                break
            c = self.step_ms_many(k[None, :] + eye[cand], drafted, ctx)
            val = (tokens + surv[cand, k[cand]]) / c
            j = int(np.argmax(val))
            if val[j] <= tokens / cost:
                break
            pick = int(cand[j])
            tokens += surv[pick, k[pick]]
            k[pick] += 1
            cost = float(c[j])
        out = np.zeros(len(active), dtype=np.int64)
        out[idx] = k
        return out


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
        """One acceptance estimator per slot."""
        self.acc = [
            AcceptanceEstimator(self.kmax, self.rho_prior, forget=self.forget) for _ in range(self.spec.batch_size)
        ]

    def _act(self, active: np.ndarray, req: np.ndarray) -> np.ndarray:
        idx = np.flatnonzero(active)
        alpha = np.empty(len(idx))
        for j, s in enumerate(idx):
            o = req[s]
            if self.view.first_round(o):
                self.acc[s].reset()
            else:
                self.acc[s].observe(self.view.prev_k(o), self.view.prev_accepted(o))
            alpha[j] = self.acc[s].pooled()
        alpha = np.clip(alpha, 1e-6, 1 - 1e-6)
        ctx = self._contexts(req)[idx]
        ks = np.arange(self.kmax + 1)
        tokens = np.sum((1.0 - alpha[None, :] ** (ks[:, None] + 1)) / (1.0 - alpha[None, :]), axis=1)
        cand = np.repeat(ks[:, None], len(idx), axis=1)
        draft = np.array([self.batch_cost.draft_ms(row) for row in cand])
        cost = self.step_ms_many(cand, np.zeros(len(idx), dtype=np.int64), ctx) + draft
        return np.full(len(active), int(np.argmax(tokens / cost)), dtype=np.int64)


class StepPolicy(BatchPolicy):
    """A batch policy of the vLLM controller's protocol (``act_step(observations, streams)``) on the active slots.

    E.g. :class:`policies.batch_goodput.BatchGoodput`. The slots are the stream ids.

    Args:
        spec: Batch observation layout.
        policy: An object with ``act_step(obs (n, dim), streams) -> (n,) budgets``.
        name: Row name (default the policy's).
    """

    def __init__(self, spec: BatchObservationSpec, policy: Any, name: str | None = None):
        super().__init__(spec)
        self.policy = policy
        self.name = name or str(getattr(policy, "name", "batch policy"))

    def reset(self) -> None:
        """Reset the wrapped policy."""
        self.policy.reset()

    def _act(self, active: np.ndarray, req: np.ndarray) -> np.ndarray:
        idx = np.flatnonzero(active)
        k = np.zeros(len(active), dtype=np.int64)
        k[idx] = self.policy.act_step(req[idx], [int(i) for i in idx])
        return k


class PerRequest(BatchPolicy):
    """A single-request policy on every slot's own observation (each slot keeps its own memory).

    Args:
        spec: Batch observation layout.
        policy: A :class:`specenv.policy.base.Policy` (or any object with ``act_batch``) for the
            per-request observation contract ``spec.request``.
        name: Row name (default the policy's).
        drafting: The drafting mode it runs in (default ``"none"``, or ``"block"`` when it reads a lookahead).
    """

    def __init__(self, spec: BatchObservationSpec, policy: Any, name: str | None = None, drafting: str | None = None):
        super().__init__(spec)
        self.policy = policy
        self.name = name or f"per-request {getattr(policy, 'name', 'policy')}"
        self.drafting = drafting or ("block" if spec.request.lookahead else "none")

    def reset(self) -> None:
        """Clear every slot's memory (a slot's first round resets it anyway)."""
        if isinstance(self.policy, Policy):
            self.policy._streams = []

    def _act(self, active: np.ndarray, req: np.ndarray) -> np.ndarray:
        return np.asarray(self.policy.act_batch(req), dtype=np.int64)
