"""An expert-aware batch policy: all k of a step chosen jointly to maximise expected tokens per millisecond.

A batch policy (:class:`specenv.policy.base.BatchPolicyProtocol`): the vLLM controller calls
:meth:`BatchGoodput.act_step` once per engine step with the stacked observations of every request.
For a candidate budget vector k of the step it evaluates

    goodput(k) = sum_i E[committed_i(k_i)] / step_ms(k)

* ``E[committed_i(k)] = 1 + sum_{j<=k} prod_{l<=j} rho_hat_{i,l}``, with ``rho_hat`` the request's running
  conditional acceptance per draft depth (the observation's ``acc_depth_*``, prior 0.5);
* ``step_ms(k)`` from the batch cost model (:class:`specenv.batchcost.BatchCostModel`): the verification
  of ``P = sum (k_i + 1)`` positions over the predicted expert union of the requests' ``U(k_i)`` (the
  model's U_batch predictor) at their contexts, plus the draft of ``max(k)`` tokens for every request
  (vLLM's drafter runs one loop for the whole batch; with ``draft_horizon="policy"`` the controller asks
  this policy for that horizon), at least ``min_draft_steps`` forwards (vLLM drafts once even at k = 0).

Search: the best common k (every request the same), then coordinate ascent (each request's k over
0..kmax with the others fixed, sweeps until nothing changes, at most ``sweeps``). Every candidate set
is priced in one vectorised call. Stateless: the decision depends on the observations only.

``U(k)`` of one request: ``u_prior[k]`` when given (e.g. the train split's mean ``U_{t,k}``), else
``min(n, top_k * (k+1) ** 0.62)`` (the prior of :func:`specenv.engines.base.u_prior`'s shape).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from specenv.batchcost import BatchCostModel
from specenv.observation import ObservationSpec, ObsView

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
    """

    batch_policy = True
    stateless = True

    def __init__(
        self,
        spec: ObservationSpec,
        model: BatchCostModel,
        u_prior: np.ndarray | None = None,
        sweeps: int = 3,
        min_draft_steps: int = 1,
    ):
        if spec.kmax > model.kmax:
            raise ValueError(f"policy kmax={spec.kmax} exceeds the batch cost model's kmax={model.kmax}")
        self.spec, self.model, self.sweeps, self.min_draft_steps = spec, model, int(sweeps), int(min_draft_steps)
        self.view = ObsView(spec)
        ks = np.arange(spec.kmax + 1)
        if u_prior is None:
            u_prior = np.minimum(model.n_experts, model.top_k * (ks + 1.0) ** 0.62)
        u_prior = np.asarray(u_prior, dtype=np.float64)[: spec.kmax + 1]
        if u_prior.shape != (spec.kmax + 1,) or not np.all(np.isfinite(u_prior)):
            raise ValueError(f"u_prior: expected {spec.kmax + 1} finite values (k = 0..kmax)")
        self.u_prior = np.clip(u_prior, model.top_k, model.n_experts)
        self.name = "batch-goodput"

    # -- the protocol
    def reset(self) -> None:
        """Nothing to forget (stateless)."""

    def act(self, obs: np.ndarray) -> int:
        """One request alone (a batch of one)."""
        return int(self.act_step(np.asarray(obs)[None, :], [0])[0])

    def act_batch(self, obs: np.ndarray) -> np.ndarray:
        """The rows as one batched step."""
        obs = np.atleast_2d(obs)
        return self.act_step(obs, list(range(len(obs))))

    def act_step(self, obs: np.ndarray, streams: Sequence[Hashable]) -> np.ndarray:
        """Budgets of one step's requests (module docstring for the search)."""
        obs = np.atleast_2d(np.asarray(obs, dtype=np.float64))
        B = len(obs)
        if B == 0:
            return np.zeros(0, dtype=np.int64)
        if B > self.model.max_batch:  # beyond the model: price it in chunks of max_batch
            m = self.model.max_batch
            return np.concatenate([self.act_step(obs[i : i + m], streams[i : i + m]) for i in range(0, B, m)])
        kmax = self.spec.kmax
        rho = np.clip(obs[:, self.view.depth_slice], 0.0, 1.0)  # (B, kmax)
        gain = np.concatenate([np.ones((B, 1)), 1.0 + np.cumsum(np.cumprod(rho, axis=1), axis=1)], axis=1)
        context_sum = float(np.sum(obs[:, self.view.i_context] * self.spec.context_scale))
        # start: the best common k
        cand = np.repeat(np.arange(kmax + 1)[:, None], B, axis=1)
        scores = self._goodput(cand, gain, context_sum)
        k = cand[int(np.argmax(scores))].copy()
        best = float(scores.max())
        for _ in range(self.sweeps):
            changed = False
            for i in range(B):
                cand = np.repeat(k[None, :], kmax + 1, axis=0)
                cand[:, i] = np.arange(kmax + 1)
                scores = self._goodput(cand, gain, context_sum)
                j = int(np.argmax(scores))
                if scores[j] > best * (1 + 1e-12) and j != k[i]:
                    k[i], best, changed = j, float(scores[j]), True
            if not changed:
                break
        return k.astype(np.int64)

    def _goodput(self, cand: np.ndarray, gain: np.ndarray, context_sum: float) -> np.ndarray:
        """Expected committed tokens per ms of every candidate row (c, B) of budgets."""
        m = self.model
        B = cand.shape[1]
        tokens = np.take_along_axis(gain, cand.T, axis=1).sum(axis=0)  # (c,)
        u_b = m.predict_u_batch_many(self.u_prior[cand])
        verify = m.verify_from_totals(cand.sum(axis=1) + B, B, u_b, context_sum)
        top = np.maximum(cand.max(axis=1), self.min_draft_steps)
        draft = np.where(top > 0, m.d0 + m.d_step * top + m.d_tok * top * B, 0.0)
        return tokens / (verify + draft)
