"""An exact upper bound on the speedup of any batch controller.

The batch episode (DESIGN.md section 3, "batch environment"; :mod:`specenv.replay.batch`): R requests
served through B slots, one verification step for all active requests at a time, priced by a
:class:`specenv.cost.batch.BatchCostModel`::

    T_step = beta0(P) + alpha(P) * U_batch + c(P) * sum_i L_i + b_req * (n - 1)
             + [any drafted] * (d0 + d_step * max_i d_i + d_tok * sum_i d_i)

with n <= B active requests, P = sum_i (k_i + 1) and d_i the tokens request i drafted (d_i >= k_i in
every drafting mode). The exact joint optimum is an SSP over the joint state of B requests
(the tests solve it by brute force on tiny cases, tests/batch_bruteforce.py).

**The split rule** (:func:`share_model`). Each request i is charged

    l(k_i, U_i, L_i) = h(m_i) + a(m_i) * U_i + g(m_i) * L_i + D(k_i),      m_i = k_i + 1,

and for every step the sum of the charges of its requests is at most the step's cost:

* intercept: ``h(m) = min { beta0(P) + b_req * (n-1) : P >= m, 1 <= n <= B, n <= P <= n (kmax+1) } / B``
  (>= 0 terms only; a negative minimum is kept undivided). Each request of the step has m_i <= P,
  so h(m_i) <= (beta0(P) + b_req (n-1)) / B and the n <= B requests sum to at most the step's term;
* experts: ``a(m) = min_{P >= m} alpha(P) / B`` when that minimum is >= 0. Then
  ``sum_i a(m_i) U_i <= alpha(P) * sum_i U_i / B <= alpha(P) * max_i U_i <= alpha(P) * U_batch``,
  because the batch union is at least every request's own set (``U_batch >= max_i U_i``, which every
  predictor of :mod:`specenv.cost.batch` satisfies) and n <= B. A negative minimum is charged in full
  (``U_batch <= sum_i U_i``);
* context: ``g(m) = min_{P >= m} c(P)``: ``sum_i g(m_i) L_i <= c(P) * sum_i L_i`` (L_i >= 0);
* draft, with d_i = k_i (the least any mode drafts): ``D(k) = (d0 + d_step * k) / B + d_tok * k`` for
  k >= 1 and D(0) = 0, since ``max_i d_i >= sum_i d_i / B`` and at most B requests share the d0 of
  the step (a negative coefficient is charged in full instead of divided).

**Full steps and the tail.** Every step before an episode's tail holds exactly B requests (a finished
request's slot is refilled at the next step while requests wait), so in such a step each request's
m_i satisfies ``m_i + B - 1 <= P <= m_i + (B-1)(kmax+1)``: the full-batch charges (``full=True``)
take every minimum over that range only and divide by exactly B, which is much tighter. At most B-1
requests are still running when the tail (steps of fewer than B requests) begins; they are charged
the coefficient-wise minimum of both charges (:func:`tail_model`) for their whole life. Which
requests those are depends on the policy, so the bound subtracts the B-1 largest differences
between a request's full-batch and tail optima (:func:`expected_costs`).

So the cost of every step is at least the sum of its requests' charges, and the cost of the whole
episode is at least the sum over requests of the charges of that request's own rounds. Those
rounds form a single-request policy (one that may look at the other requests, i.e. a randomised
history-dependent policy of the single-request SSP), whose expected cost is at least the optimum
V_r(0) of the single-request SSP with round cost l: the exact oracle of :mod:`oracle.dp` run with
``share_model`` (a :class:`specenv.cost.model.CostModel` whose ``charged_table`` is l). Hence

* **expected bound**: ``E[episode cost] >= sum_r V_{g_r}(0)`` for every policy, and the speedup
  AR / E[cost] is at most ``AR / sum_r V_{g_r}(0)`` (AR, the same requests decoded without
  speculation under the same schedule, depends on the requests only:
  :func:`specenv.replay.batch.ar_schedule_ms`);
* **pathwise bound** (:func:`pathwise_costs`): with the request's acceptance uniforms fixed (round
  j of request r uses its j-th uniform, :func:`specenv.replay.batch.request_draws`), the least total
  charge over all budget sequences is a deterministic shortest path over (position, round); every
  policy's realised cost of that episode is at least the sum of these, so the bound holds episode by
  episode, for stochastic traces too. For greedy traces (rho in {0, 1}) the two coincide.

Both bound every drafting mode (a mode that drafts more pays more). The split rule is loose where the
split is: the intercept and the expert cost are shared by n <= B requests but charged as if every
step were full, and the batch union is charged as the mean of the requests' own sets. The tests
measure the gap to the brute-force joint optimum on small cases.

**The Lagrangian bound** (``method="lagrangian"``, the default of :func:`batch_bound`; the split rule
above is ``method="linear"``). The same argument with three tighter charges (DESIGN.md section 4):

* the step's intercept and draft terms are split as ``x[k_i]``, one number per budget, under the exact
  constraint ``sum_i x[k_i] <= beta0(P) + b_req (n-1) + d0 + d_step max_i k_i + d_tok sum_i k_i`` for
  every budget multiset of a step (:func:`_multisets`); the best x for the episodes' requests
  maximises a concave function (the summed single-request optima) and is found by Kelley's cutting
  planes (:func:`lagrangian_split`); every iterate is a valid split;
* the expert term by the chord of the concave lower bound ``n (1 - exp(-theta sum_i w(U_i)))`` of the
  predicted union (:func:`expert_share`), when it charges more than the split rule's ``U_i / B``;
* the tail split need only hold on steps of 1..B-1 requests, and a request running when the tail
  begins is charged the full-batch split until then (:func:`switch_costs`: the least charge over every
  switching time).

Per episode the larger of the two bounds is kept, so the Lagrangian bound is never looser.

The package, by concept: :mod:`oracle.batch.split` (the split rule: its charges, the tail charge and
the expected costs of an episode's requests), :mod:`oracle.batch.lagrangian` (the Lagrangian charges)
and :mod:`oracle.batch.bound` (the pathwise costs, :class:`BatchBound` and :func:`batch_bound`, which
keeps the larger of the two per episode).
"""

from oracle.batch.bound import METHODS, BatchBound, batch_bound, pathwise_costs
from oracle.batch.lagrangian import (
    MAX_MULTISETS,
    SplitCharge,
    check_enumerable,
    expert_share,
    lagrangian_costs,
    lagrangian_split,
    switch_costs,
)
from oracle.batch.split import (
    FairShare,
    expected_costs,
    intercept_splits,
    share_model,
    tail_model,
)

__all__ = [
    "MAX_MULTISETS",
    "METHODS",
    "BatchBound",
    "FairShare",
    "SplitCharge",
    "batch_bound",
    "check_enumerable",
    "expected_costs",
    "intercept_splits",
    "expert_share",
    "lagrangian_costs",
    "lagrangian_split",
    "switch_costs",
    "pathwise_costs",
    "share_model",
    "tail_model",
]
