"""An expert-aware batch policy: all k of a step chosen jointly to maximise expected tokens per millisecond.

A policy of the one protocol (:mod:`specenv.policy.base`) that decides a step jointly: the vLLM
controller calls :meth:`BatchGoodput.act` once per engine step with the stacked observations of every
request (the batch environment through :class:`policies.batch.controllers.StepPolicy`).
For a candidate budget vector k of the step it evaluates

    goodput(k) = sum_i E[committed_i(k_i)] / step_ms(k)

* ``E[committed_i(k)] = 1 + sum_{j<=k} prod_{l<=j} rho_hat_{i,l}``, with ``rho_hat`` the request's running
  conditional acceptance per draft depth (the observation's ``acc_depth_*``, prior 0.5);
* ``step_ms(k)`` from the batch cost model (:class:`specenv.cost.batch.BatchCostModel`): the verification
  of ``P = sum (k_i + 1)`` positions over the predicted expert union of the requests' ``U(k_i)`` (the
  model's U_batch predictor) at their contexts, plus the draft of ``max(k)`` tokens for every request
  (vLLM's drafter runs one loop for the whole batch; with ``draft_horizon="policy"`` the controller asks
  this policy for that horizon), at least ``min_draft_steps`` forwards (vLLM drafts once even at k = 0).

Search: the best common k (every request the same), then local search over single-request changes
(every request's k over 0..kmax with the others fixed, all priced in one vectorised call): all
requests move to their best responses at once when that improves the step, else the single best
change is taken, until none improves (at most ``sweeps * B`` rounds). Stateless: the decision depends
on the observations only. About 0.7 ms per step at B = 8 on this CPU. A step of one request has nothing to
search (the common k is every candidate): its score per k is ``gain[k] / (a[k] + c[k] * L)`` with ``a``
and ``c`` tabulated once from the same model terms, summed in the same order (the same floating-point
values, so the same argmax), about 70 us a call here (385 us through the search).

``U(k)`` of one request: ``u_prior[k]`` when given (e.g. the train split's mean ``U_{t,k}``; made
non-decreasing in k), else ``min(n, top_k * (k+1) ** 0.62)`` (the prior of
:func:`specenv.engines.base.u_prior`'s shape).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from specenv.cost.batch import BatchCostModel, odd_queries
from specenv.observation.single import ObservationSpec, ObsView
from specenv.policy.base import BatchStep

__all__ = ["BatchGoodput"]


class BatchGoodput:
    """Joint per-step budgets maximising expected committed tokens per ms (module docstring).

    Args:
        spec: Observation layout of the rows.
        model: The batch cost model of the served engine.
        u_prior: (kmax+1,) unique experts of one request verifying k drafts (default: a power law).
        sweeps: Most coordinate-ascent sweeps per step.
        min_draft_steps: Draft forwards a step pays even when every k is 0 (vLLM 0.32: 1, it keeps the
            draft's KV cache in sync; 0 for an engine that skips drafting).
        step_overhead_ms: Time every step pays outside the model's forwards (scheduler, sampler), added
            to the step's price: fewer, longer steps amortise it (the batch model does not charge it).
    """

    stateless = True

    def __init__(
        self,
        spec: ObservationSpec,
        model: BatchCostModel,
        u_prior: np.ndarray | None = None,
        sweeps: int = 3,
        min_draft_steps: int = 1,
        step_overhead_ms: float = 0.0,
    ):
        if spec.kmax > model.kmax:
            raise ValueError(f"policy kmax={spec.kmax} exceeds the batch cost model's kmax={model.kmax}")
        self.spec, self.model, self.sweeps, self.min_draft_steps = spec, model, int(sweeps), int(min_draft_steps)
        self.step_overhead_ms = float(step_overhead_ms)
        if not (np.isfinite(self.step_overhead_ms) and self.step_overhead_ms >= 0):
            raise ValueError(f"step_overhead_ms={step_overhead_ms!r}: must be a finite number >= 0")
        self.view = ObsView(spec)
        ks = np.arange(spec.kmax + 1)
        if u_prior is None:
            u_prior = np.minimum(model.n_experts, model.top_k * (ks + 1.0) ** 0.62)
        u_prior = np.asarray(u_prior, dtype=np.float64)[: spec.kmax + 1]
        if u_prior.shape != (spec.kmax + 1,) or not np.all(np.isfinite(u_prior)):
            raise ValueError(f"u_prior: expected {spec.kmax + 1} finite values (k = 0..kmax)")
        self.u_prior = np.maximum.accumulate(np.clip(u_prior, model.top_k, model.n_experts))
        # the model's union over its pool (n_experts, or the "pooled" predictor's effective pool)
        self._pooled = model.predictor == "pooled"
        self._pool = float(model.u_pool) if self._pooled and model.u_pool is not None else float(model.n_experts)
        self._u_in_pool = np.minimum(self.u_prior, self._pool)
        with np.errstate(divide="ignore"):
            self._log_miss = np.log1p(-self._u_in_pool / self._pool)
        self._log_miss = np.where(np.isfinite(self._log_miss), self._log_miss, -745.0)  # U = n: nothing missed
        self._theta = 1.0 if model.predictor == "independent" else model.u_theta
        self._one = self._single_request_table()
        self.name = "batch-goodput"

    def _single_request_table(self) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray, float]]:
        """One request's step price per k = 0..kmax: :meth:`_goodput`'s terms at B = 1, ``(a, c, (tail, draft, over))``.

        The price at context L is ``(((a + c * L) + tail) + draft) + over``: ``a = beta0 + alpha * U(k)``,
        ``tail = b_req * 0 + overhead[B=1]``, then the draft and the step overhead -- :meth:`_goodput`'s sums
        in its order, so the same floating-point values.
        """
        m = self.model
        assert m.overhead is not None  # BatchCostModel.__post_init__ fills it
        ks = np.arange(self.spec.kmax + 1)
        n = self._pool
        u_b = n * (1.0 - (1.0 - self._u_in_pool[ks] / n) * np.exp(self._theta * 0.0))  # one request: nothing else
        if self._pooled:
            u_b = np.maximum(u_b, self.u_prior[ks])
        a = m.beta0[ks] + m.alpha[ks] * u_b  # positions P = k + 1, index P - 1 = k
        tail = np.full(len(ks), m.b_req * 0.0 + m.overhead[0])
        if m.b_odd_query:  # verify_from_totals adds it after the step's overhead
            tail = tail + m.b_odd_query * odd_queries(ks[:, None]).astype(np.float64)
        top = np.maximum(ks, self.min_draft_steps)
        draft = np.where(top > 0, m.d0 + m.d_step * top + m.d_tok * top * 1, 0.0)
        return a, m.c[ks].copy(), (tail, draft, self.step_overhead_ms)

    # -- the protocol
    def reset(self) -> None:
        """Nothing to forget (stateless)."""

    def act(self, obs: np.ndarray, ids: Sequence[Hashable] | None = None, step: BatchStep | None = None) -> Any:
        """Budgets of one step's requests (module docstring for the search); a 1-D observation: one int.

        Stateless: ``ids`` and ``step`` are not read.
        """
        obs = np.asarray(obs, dtype=np.float64)
        if obs.ndim == 1:  # alias: one request alone is a batch of one
            return int(self.act(obs[None, :])[0])
        B = len(obs)
        if B == 0:
            return np.zeros(0, dtype=np.int64)
        if B > self.model.max_batch:  # beyond the model: price it in chunks of max_batch
            m = self.model.max_batch
            return np.concatenate([self.act(obs[i : i + m]) for i in range(0, B, m)])
        kmax = self.spec.kmax
        rho = np.clip(obs[:, self.view.depth_slice], 0.0, 1.0)  # (B, kmax)
        gain = np.concatenate([np.ones((B, 1)), 1.0 + np.cumsum(np.cumprod(rho, axis=1), axis=1)], axis=1)
        context_sum = float(np.sum(obs[:, self.view.i_context] * self.spec.context_scale))
        if B == 1:  # nothing to search: the common k is every candidate (tabulated, module docstring)
            a, c, (tail, draft, over) = self._one
            return np.array(
                [int(np.argmax(gain[0] / ((((a + c * context_sum) + tail) + draft) + over)))], dtype=np.int64
            )
        # start: the best common k; then local search over single-request changes, all priced in one call:
        # every request moves to its best response at once when that improves the step, else the single
        # best change is taken; stop when none improves
        ks = np.arange(kmax + 1)
        scores = self._goodput(np.repeat(ks[:, None], B, axis=1), gain, context_sum)
        k = np.full(B, int(np.argmax(scores)), dtype=np.int64)
        best = float(scores.max())
        rows = np.arange(B)
        for _ in range(self.sweeps * B):
            dev = np.repeat(k[None, :], B * (kmax + 1), axis=0)
            dev[np.arange(B * (kmax + 1)), np.repeat(rows, kmax + 1)] = np.tile(ks, B)
            sc = self._goodput(dev, gain, context_sum).reshape(B, kmax + 1)
            if sc.max() <= best * (1 + 1e-12):
                break
            jacobi = sc.argmax(axis=1)
            s_j = float(self._goodput(jacobi[None, :], gain, context_sum)[0])
            if s_j > best * (1 + 1e-12) and s_j >= sc.max():
                k, best = jacobi, s_j
            else:
                i, j = np.unravel_index(int(np.argmax(sc)), sc.shape)
                k = k.copy()
                k[i], best = j, float(sc[i, j])
        return k.astype(np.int64)

    def _goodput(self, cand: np.ndarray, gain: np.ndarray, context_sum: float) -> np.ndarray:
        """Expected committed tokens per ms of every candidate row (c, B) of budgets."""
        m = self.model
        B = cand.shape[1]
        tokens = gain[np.arange(B)[None, :], cand].sum(axis=1)  # (c,)
        # the model's U_batch predictor (union_shared) on U(k) = u_prior[k], non-decreasing in k: the
        # largest request is the one with the largest k; log(1 - U(k)/n) is tabulated once
        top = cand.max(axis=1)
        n = self._pool
        rest = self._log_miss[cand].sum(axis=1) - self._log_miss[top]
        u_b = n * (1.0 - (1.0 - self._u_in_pool[top] / n) * np.exp(self._theta * rest))
        if self._pooled:  # never below the largest request's own experts
            u_b = np.maximum(u_b, self.u_prior[top])
        verify = m.verify_from_totals(cand.sum(axis=1) + B, B, u_b, context_sum, odd_queries(cand))
        top = np.maximum(top, self.min_draft_steps)
        draft = np.where(top > 0, m.d0 + m.d_step * top + m.d_tok * top * B, 0.0)
        return tokens / (verify + draft + self.step_overhead_ms)
