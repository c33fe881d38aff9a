"""Reference prices of a batched step, written from the batch cost model's formula (not its code).

The tests of the batch controllers compare a controller's budgets with the best budgets under these
prices, found by enumeration. The formula (the :class:`specenv.cost.batch.BatchCostModel` docstring):

* verification: ``beta0(P) + alpha(P) * U_batch + c(P) * sum_i L_i + b_req * (B - 1) + overhead(B)``,
  ``P = sum_i (k_i + 1)`` (``overhead(B)``: a step-time model's per-step time outside the forwards at batch
  size B, 0 for a forward-time model);
* ``U_batch`` of per-request counts ``U_i`` out of n experts, the largest first:
  ``n * (1 - (1 - U_1/n) * prod_{i>1} (1 - U_i/n) ** theta)`` (theta = 1 for the ``"independent"`` predictor);
* drafting: ``d0 + d_step * max_i n_i + d_tok * sum_i n_i``, 0 when nothing is drafted.

Plain Python loops over the requests on purpose: a second implementation, not a copy of the vectorised one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specenv.cost.batch import BatchCostModel
from specenv.observation.batch import BatchObservationSpec


def union(u: Sequence[float], n: float, theta: float) -> float:
    """The predicted expert union of requests with ``u`` unique experts each (module docstring)."""
    us = sorted((min(max(float(x), 0.0), n) for x in u), reverse=True)
    miss = 1.0 - us[0] / n
    for x in us[1:]:
        miss *= (1.0 - x / n) ** theta
    return n * (1.0 - miss)


def theta_of(model: BatchCostModel) -> float:
    """theta of the model's predictor (1 for ``"independent"``)."""
    return 1.0 if model.predictor == "independent" else model.u_theta


def verify_ms(model: BatchCostModel, k: Sequence[int], u: Sequence[float], context: Sequence[float]) -> float:
    """Verification time of budgets ``k`` with per-request experts ``u`` and contexts ``context``."""
    positions = sum(int(x) + 1 for x in k)
    i = positions - 1
    ub = union(u, model.n_experts, theta_of(model))
    return float(
        model.beta0[i]
        + model.alpha[i] * ub
        + model.c[i] * sum(float(x) for x in context)
        + model.b_req * (len(k) - 1)
        + (0.0 if model.overhead is None else float(model.overhead[len(k) - 1]))
    )


def draft_ms(model: BatchCostModel, drafted: Sequence[int]) -> float:
    """Draft time of one step of ``drafted`` tokens per request."""
    top = max(int(x) for x in drafted)
    if top == 0:
        return 0.0
    return float(model.d0 + model.d_step * top + model.d_tok * sum(int(x) for x in drafted))


def batch_obs(spec: BatchObservationSpec, slots: Sequence[dict[str, float] | None]) -> np.ndarray:
    """A batch observation: slot s active with the named per-request features ``slots[s]`` (others 0), or idle."""
    r = spec.request
    req = np.zeros((spec.batch_size, r.dim))
    active = np.zeros(spec.batch_size, dtype=bool)
    for s, row in enumerate(slots):
        if row is None:
            continue
        active[s] = True
        for name, value in row.items():
            req[s, r.index(name)] = value
    return spec.assemble(active, req, np.zeros(4))
