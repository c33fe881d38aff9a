"""Worker side of the recorder: expert routing and phase timings, bound when vLLM loads the models.

The ``specenv`` load format (:class:`SpecenvModelLoader`, a :class:`DefaultModelLoader` registered
with vLLM's public ``register_model_loader``; registration runs from the ``vllm.general_plugins``
entry point :func:`register`) loads the weights exactly as the default loader does, then

* on the **target** model: binds a capture callback to every MoE router through
  ``BaseRouter.set_capture_fn`` (the hook vLLM's own routed-experts capture uses). The callback
  copies the logical top-k expert ids of every token of the forward pass into one preallocated
  ``(n_moe_layers, max_num_batched_tokens, top_k)`` int32 buffer on the model's device. Binding
  happens at load time, i.e. before vLLM captures any CUDA graph, so a captured graph replays the
  copy too; nothing is allocated per step;
* on the target and on the **draft** model: forward pre/post hooks (plain PyTorch module hooks)
  giving the target's verification time and the draft's proposal time of each step
  (:class:`PhaseClock`): on CPU ``time.perf_counter()`` and the forward thread's CPU time; on CUDA a
  pair of timing events (the first forward's start, the last forward's end) recorded on the current
  stream and read by the scheduler after the step's own output synchronisation -- the hooks never
  synchronise the device. While the current stream is being captured into a CUDA graph
  (``torch.cuda.is_current_stream_capturing()``: vLLM's ``CUDAGraphWrapper`` and the V2 runner's graph
  managers run the model's forward inside ``torch.cuda.graph``) the hooks do nothing. A replayed FULL
  graph does not call the module, so its hooks do not fire: the recorder then reports the step's
  wall time as ``T_T_ms`` and ``T_D_ms = 0`` (``timing = "step"``; schema v1: "timing missing"). On
  an accelerator the graph mode of the step (vLLM's ``cudagraph_stats.runtime_mode`` when
  ``--cudagraph-metrics`` is on, else the forward context the target's hook saw) is appended to the
  ``timing`` column (``events:PIECEWISE``, ``step:FULL``); on CPU the column is unchanged;
* a target whose MoE layers run a monolithic kernel (``quant_method.is_monolithic``: the kernel
  selects the experts itself, e.g. FlashInfer TRT-LLM, and never calls the router, so the capture
  callback would never run) is refused at load time with one line; a routing buffer that is still all
  zero when a step's routing is read (the capture did not run) raises :class:`RoutingMissing`;
* on the **draft** model: a wrapper around its ``compute_logits`` (called by vLLM's proposer once per
  draft step on the ``(batch, vocab)`` logits of the tokens it is about to draft, outside any CUDA
  graph) that writes, per request and draft step, the softmax probability of the top-1 token (the
  drafted token q under vLLM's default greedy drafting, ``draft_sample_method="greedy"``), the
  entropy in nats, the top-1 minus top-2 probability and the top-1 token id into a preallocated
  ``(num_speculative_tokens, max_num_seqs, 4)`` float32 buffer (:data:`SIGNAL_FIELDS`), while the
  scheduler asks for them (a policy with a lookahead block: about 0.1 ms per draft step on this CPU
  with the shipped models, so it is off otherwise). The scheduler reads it after the step
  (:meth:`RoutingTap.draft_signals`) and checks the token ids against the drafts it receives.
  This is how draft confidences reach the controller: in vLLM 0.32 the draft's probabilities
  otherwise stay inside the worker (and exist only for probabilistic drafting).

Where the scheduler finds the tap (:func:`current_tap`):

* same process (vLLM's single-process executor ``distributed_executor_backend="uni"``, e.g. the
  in-process engine with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or one GPU): the tap object itself;
* worker processes (``"mp"``, which vLLM forces on CPU when the engine core runs in its own process,
  e.g. ``vllm serve``): on a CPU worker the routing buffer, the draft signals and the clocks live in a
  POSIX shared-memory segment named after the engine-core process (``specenv-tap-<pid>``), which the scheduler attaches
  to. The worker writes it during ``execute_model``; with synchronous scheduling the scheduler reads
  it only after that call has returned. (An accelerator worker in another process is not supported:
  its buffer is device memory; use ``--distributed-executor-backend uni``.)
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specenv.engines.vllm.hugepages import advise_model

#: The load format name the recorder uses (``--load-format specenv``).
LOAD_FORMAT = "specenv"
_MAGIC = 7101.0
_HEADER = 25  # float64 slots, see _H_* below
_OFFSET = _HEADER * 8
# header slots: 0 magic, 1 n_layers, 2 capacity, 3 top_k, 4 n_experts, 5-9 target clock, 10-14 draft clock,
# 15 has_draft, then the draft-signal capture:
_H_SIG_STEPS = 16  # draft steps per engine step the signal buffer holds (num_speculative_tokens)
_H_SIG_ROWS = 17  # requests per draft step it holds (max_num_seqs)
_H_SIG_CALLS = 18  # draft steps captured in the current engine step
_H_SIG_N = 19  # rows of the last captured draft step
_H_HAS_SIG = 20  # 1 once the draft's compute_logits is wrapped
_H_SIG_MS = 21  # total wall ms spent in the capture (all steps; on an accelerator: launch time)
_H_SIG_TOTAL = 22  # total draft steps captured
_H_SIG_WANT = 23  # 1 while a consumer (the controller's lookahead policy) wants the signals captured
_H_ROUTE_OFF = 24  # 1 while no consumer reads the routing (the controller's blind path): the capture is skipped
#: Per drafted token: q (softmax probability of the top-1 token, the drafted one under greedy drafting),
#: entropy (nats), top-1 minus top-2 probability, top-1 token id.
SIGNAL_FIELDS = ("q", "ent", "margin", "token")

#: Taps of the models loaded in this process, newest last (normally one target per engine).
TAPS: list[RoutingTap] = []


def shm_name(owner_pid: int) -> str:
    """Name of the shared-memory segment of the engine-core process ``owner_pid``."""
    return f"specenv-tap-{owner_pid}"


def _stream_capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (False without CUDA)."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class CudaEvents:
    """The two timing events of one phase on CUDA: the first forward's start and the last forward's end.

    Recording an event is asynchronous (no host synchronisation); :meth:`elapsed_ms` is read by the
    scheduler after the step's output was synchronised, when both events have completed (it waits for
    the end event, which is then done already).
    """

    def __init__(self) -> None:
        import torch

        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self) -> float:
        """Milliseconds between the two events."""
        self.end.synchronize()
        return float(self.start.elapsed_time(self.end))


class PhaseClock:
    """First-start / last-end stamps of a model's forward passes within one engine step.

    Wall clock (``time.perf_counter``) and the CPU time of the forward's thread (``time.thread_time``:
    with one torch thread the same work without the time the process was descheduled, i.e. robust to
    other processes on a shared machine). On CUDA the span (:attr:`ms`) comes from timing events
    (:class:`CudaEvents`) instead; nothing synchronises the device. While the current stream is
    being captured into a CUDA graph (``capturing()`` true) the hooks do nothing.

    Args:
        slots: A float64 array of 5 slots (start, end, calls, cpu start, cpu end), possibly in
            shared memory.
        sync: Device synchronisation called before each stamp (None on CPU and CUDA: only other
            accelerators, which have no events here, synchronise).
        events: The CUDA timing events (None: wall clock).
        capturing: Whether a graph capture is in progress (None: never).
        mode: Returns the CUDA-graph mode of the current forward, or None (the hooks keep the first
            forward's of the step in :attr:`mode`).
    """

    def __init__(
        self,
        slots: np.ndarray | None = None,
        sync: Any = None,
        events: CudaEvents | None = None,
        capturing: Any = None,
        mode: Any = None,
    ):
        self.slots = np.zeros(5) if slots is None else slots
        self.sync = sync
        self.events = events
        self.capturing = capturing
        self.mode_fn = mode
        #: The CUDA-graph mode the first forward of the step ran in (None when unknown).
        self.mode: str | None = None

    @classmethod
    def for_device(cls, slots: np.ndarray | None, device: Any) -> PhaseClock:
        """The clock of a model on ``device``: wall clocks on CPU, timing events on CUDA, a sync elsewhere."""
        import torch

        kind = torch.device(device).type
        if kind == "cpu":
            return cls(slots)
        if kind == "cuda":
            return cls(slots, events=CudaEvents(), capturing=_stream_capturing, mode=_forward_graph_mode)
        return cls(slots, sync=torch.accelerator.synchronize, mode=_forward_graph_mode)

    @property
    def timing(self) -> str:
        """How :attr:`ms` is measured: ``hooks`` (wall clock in the hooks) or ``events`` (CUDA events)."""
        return "hooks" if self.events is None else "events"

    def reset(self) -> None:
        """Forget the current step."""
        self.slots[:] = 0.0
        self.mode = None

    def pre(self, module: Any, args: Any) -> None:
        """Forward pre-hook."""
        if self.capturing is not None and self.capturing():
            return
        if self.sync is not None:
            self.sync()
        if self.slots[2] == 0:
            self.slots[0] = time.perf_counter()
            self.slots[3] = time.thread_time()
            if self.events is not None:
                self.events.start.record()
            if self.mode_fn is not None:
                self.mode = self.mode_fn()
        self.slots[2] += 1

    def post(self, module: Any, args: Any, output: Any) -> None:
        """Forward hook."""
        if self.capturing is not None and self.capturing():
            return
        if self.sync is not None:
            self.sync()
        if self.events is not None:
            self.events.end.record()
        self.slots[1] = time.perf_counter()
        self.slots[4] = time.thread_time()

    @property
    def calls(self) -> int:
        """Forward passes in the current step."""
        return int(self.slots[2])

    @property
    def ms(self) -> float:
        """Milliseconds from the first forward's start to the last forward's end (0 if none ran).

        On CUDA the time between the two events (read it after the step's output synchronisation).
        """
        if not self.slots[2]:
            return 0.0
        if self.events is not None:
            return self.events.elapsed_ms()
        return float(self.slots[1] - self.slots[0]) * 1e3

    @property
    def cpu_ms(self) -> float:
        """CPU time of the forwards' thread over the same span (0 if none ran)."""
        return float(self.slots[4] - self.slots[3]) * 1e3 if self.slots[2] else 0.0


def _forward_graph_mode() -> str | None:
    """The CUDA-graph mode of vLLM's current forward context (``NONE``, ``PIECEWISE``...), or None."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:  # pragma: no cover - only without vLLM
        return None
    if not is_forward_context_available():
        return None
    return graph_mode_name(get_forward_context().cudagraph_runtime_mode)


def graph_mode_name(mode: Any) -> str | None:
    """``FULL``/``PIECEWISE``/``NONE`` from a vLLM ``CUDAGraphMode`` or its ``str`` (``CUDAGraphMode.FULL``)."""
    if mode is None:
        return None
    name = getattr(mode, "name", None) or str(mode)
    return name.rsplit(".", 1)[-1] or None


class RoutingMissing(RuntimeError):
    """The routing buffer holds no routing for a step that ran the target (the capture did not run)."""


@dataclass
class RoutingTap:
    """Routing buffer and phase clocks of one target (and its draft).

    Attributes:
        buf: ``(n_layers, capacity, top_k)`` int32 tensor (worker side) or array (attached side)
            holding the expert ids of the last forward pass.
        n_layers: MoE layers bound.
        n_experts: Experts per MoE layer (logical).
        top_k: Experts per token.
        capacity: Tokens the buffer holds (``max_num_batched_tokens`` + margin).
        target_clock: Timing of the target's forward passes.
        draft_clock: Timing of the draft model's forward passes.
        header: The float64 header (shared when ``shm`` is set).
        sig: ``(sig_steps, sig_rows, 4)`` float32 tensor (worker side) or array (attached side): the
            draft signals (:data:`SIGNAL_FIELDS`) of each draft step of the current engine step.
        shm: The shared-memory segment (None when the tap is process-local only).
    """

    buf: Any
    n_layers: int
    n_experts: int
    top_k: int
    capacity: int
    target_clock: PhaseClock
    draft_clock: PhaseClock
    header: np.ndarray
    sig: Any = None
    shm: Any = None
    handles: list[Any] = field(default_factory=list)

    @property
    def has_draft(self) -> bool:
        """Whether a draft model's hooks are bound."""
        return bool(self.header[15])

    @property
    def has_signals(self) -> bool:
        """Whether the draft's logits are captured (draft confidences available to the scheduler)."""
        return bool(self.header[_H_HAS_SIG]) and self.sig is not None

    @property
    def sig_steps(self) -> int:
        """Draft steps per engine step the signal buffer holds (the engine's ``num_speculative_tokens``)."""
        return int(self.header[_H_SIG_STEPS])

    @property
    def capture_ms(self) -> float:
        """Wall time spent in the signal capture so far (ms, all steps; on an accelerator the launch time only)."""
        return float(self.header[_H_SIG_MS])

    @property
    def captured_steps(self) -> int:
        """Draft steps captured so far."""
        return int(self.header[_H_SIG_TOTAL])

    @property
    def wants_signals(self) -> bool:
        """Whether the capture is on (:meth:`want_signals`): only then can a step hold draft signals."""
        return bool(self.header[_H_SIG_WANT]) and self.has_signals

    def want_signals(self, on: bool) -> None:
        """Switch the capture on or off (off by default: it costs a softmax over the vocabulary per draft step)."""
        self.header[_H_SIG_WANT] = 1.0 if on else 0.0

    @property
    def capturing(self) -> bool:
        """Whether the routing capture is on (:meth:`capture_routing`; on by default)."""
        return not self.header[_H_ROUTE_OFF]

    def capture_routing(self, on: bool) -> None:
        """Switch the routing capture on or off (off: :meth:`routing` keeps the last captured forward's).

        Off only while nothing reads the routing: the controller's blind path (a policy that
        ``observes`` nothing, no recording, no callback) switches it off and back on.
        """
        self.header[_H_ROUTE_OFF] = 0.0 if on else 1.0

    def reset_step(self) -> None:
        """Clear both clocks and the step's draft signals (called by the controller when a step is scheduled)."""
        self.target_clock.reset()
        self.draft_clock.reset()
        self.header[_H_SIG_CALLS] = 0.0
        self.header[_H_SIG_N] = 0.0

    def draft_signals(self) -> np.ndarray | None:
        """``(draft steps, requests, 4)`` float32 copy of the current step's draft signals, or None.

        Row j of axis 1 is the j-th request of the drafter's batch (vLLM's input-batch order, the
        order of ``DraftTokenIds.req_ids``); the last axis is :data:`SIGNAL_FIELDS`. None when no draft
        step was captured since :meth:`reset_step`.
        """
        if not self.has_signals:
            return None
        calls, n = int(self.header[_H_SIG_CALLS]), int(self.header[_H_SIG_N])
        if calls <= 0 or n <= 0:
            return None
        b = self.sig[:calls, :n]
        return b.cpu().numpy().copy() if hasattr(b, "cpu") else np.array(b)

    def routing(self, n_tokens: int, copy: bool = True) -> np.ndarray:
        """``(n_layers, n_tokens, top_k)`` int32 copy of the last forward's routing.

        With ``copy=False`` a buffer on the host is returned in place (no copy): valid until the next
        forward, for a reader that is done with it within the step (the controller's statistics). A
        buffer on an accelerator is always copied to the host.

        Raises:
            RoutingMissing: When the copy is all zero: no capture callback wrote it (a token's top-k
                experts are distinct, so real routing is never all expert 0 with top_k >= 2, and
                practically never with top-1 over every layer and token).
        """
        host = self._host()
        if host is not None:  # a numpy view of a host buffer: slicing it costs no torch call
            out = host[:, :n_tokens]
            if copy:
                out = out.copy()
        else:  # on an accelerator
            out = self.buf[:, :n_tokens].cpu().numpy()
        # (a token's first experts, when not both 0, already show the buffer was written: no full reduction)
        if out.size and (self.top_k < 2 or not (out[0, 0, 0] or out[0, 0, 1])) and not out.any():
            raise RoutingMissing(
                f"specenv routing tap: the target's routing buffer is all zero for the step's {n_tokens} tokens "
                f"({self.n_layers} MoE layers): the routers' capture did not run, so U_r cannot be recorded"
            )
        return out

    def _host(self) -> np.ndarray | None:
        """A numpy view of :attr:`buf` when it lives on the host (kept while ``buf`` is the same object)."""
        buf = self.buf
        cached = self.__dict__.get("_host_view")
        if cached is not None and cached[0] is buf:
            return cached[1]
        if isinstance(buf, np.ndarray):
            view = buf
        elif buf.device.type == "cpu":
            view = buf.numpy()
        else:
            return None
        self.__dict__["_host_view"] = (buf, view)
        return view


def _layout(n_layers: int, capacity: int, top_k: int, sig_steps: int = 0, sig_rows: int = 0) -> int:
    return _OFFSET + 4 * n_layers * capacity * top_k + 4 * sig_steps * sig_rows * len(SIGNAL_FIELDS)


def _views(
    buffer: Any, n_layers: int, capacity: int, top_k: int, sig_steps: int = 0, sig_rows: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    header = np.ndarray((_HEADER,), dtype=np.float64, buffer=buffer)
    routing = np.ndarray((n_layers, capacity, top_k), dtype=np.int32, buffer=buffer, offset=_OFFSET)
    sig = np.ndarray(
        (sig_steps, sig_rows, len(SIGNAL_FIELDS)),
        dtype=np.float32,
        buffer=buffer,
        offset=_OFFSET + 4 * n_layers * capacity * top_k,
    )
    return header, routing, sig


def _routers(model: Any) -> list[Any]:
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    seen: set[int] = set()
    out = []
    for module in model.modules():
        router = getattr(module, "router", None)
        if isinstance(router, BaseRouter) and id(router) not in seen:
            seen.add(id(router))
            out.append(router)
    return out


def monolithic_kernel(model: Any) -> str | None:
    """The kernel name of the first MoE layer of ``model`` whose kernel skips the router, or None.

    A layer with a router (``module.router``) whose quantisation method is monolithic
    (``module._quant_method.is_monolithic``, as vLLM's MoE runner checks before calling
    ``forward_monolithic`` instead of ``router.select_experts``) never calls the router's capture
    callback.
    """
    for module in model.modules():
        if getattr(module, "router", None) is None:
            continue
        try:
            method = module._quant_method
        except AttributeError:
            continue
        if getattr(method, "is_monolithic", False):
            kernel = getattr(getattr(getattr(method, "moe_kernel", None), "impl", None), "fused_experts", None)
            return type(kernel if kernel is not None else method).__name__
    return None


def bind_target(model: Any, vllm_config: Any) -> RoutingTap | None:
    """Bind the routing capture and timing hooks on a freshly loaded target model.

    Returns:
        The tap, or None when the model has no MoE router (nothing to record).
    """
    import torch

    routers = _routers(model)
    if not routers:
        return None
    kernel = monolithic_kernel(model)
    if kernel is not None:
        raise ValueError(
            f"specenv routing tap: the target's MoE layers run the monolithic kernel {kernel}, which selects "
            "the experts without the router, so the routing capture would record nothing; serve it with a "
            "modular MoE backend (e.g. --moe-backend triton) or without --load-format specenv"
        )
    top_k = int(routers[0].top_k)
    n_experts = int(routers[0].global_num_experts)
    n_layers = len(routers)
    capacity = int(vllm_config.scheduler_config.max_num_batched_tokens) + 64
    spec = vllm_config.speculative_config
    sig_steps = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    sig_rows = int(vllm_config.scheduler_config.max_num_seqs) if sig_steps else 0
    device = next(model.parameters()).device
    shm = None
    if vllm_config.parallel_config.distributed_executor_backend == "mp" and device.type == "cpu":
        from multiprocessing import shared_memory

        name = shm_name(os.getppid())  # the engine-core process spawned this worker
        try:
            shared_memory.SharedMemory(name=name).unlink()  # left over by a killed run with the same pid
        except FileNotFoundError:
            pass
        size = _layout(n_layers, capacity, top_k, sig_steps, sig_rows)
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        header, routing, sig_np = _views(shm.buf, n_layers, capacity, top_k, sig_steps, sig_rows)
        header[:] = 0.0
        buf = torch.from_numpy(routing)
        sig = torch.from_numpy(sig_np)
    else:
        header = np.zeros(_HEADER)
        buf = torch.zeros((n_layers, capacity, top_k), dtype=torch.int32, device=device)
        sig = torch.zeros((sig_steps, sig_rows, len(SIGNAL_FIELDS)), dtype=torch.float32, device=device)
    header[:5] = (_MAGIC, n_layers, capacity, top_k, n_experts)
    header[_H_SIG_STEPS], header[_H_SIG_ROWS] = sig_steps, sig_rows

    def make_capture(layer: int):
        row = buf[layer]

        def capture(topk_ids: Any) -> None:
            if header[_H_ROUTE_OFF]:  # RoutingTap.capture_routing(False): nothing reads this step's routing
                return
            row[: topk_ids.shape[0]].copy_(topk_ids)

        return capture

    for i, r in enumerate(routers):
        r.set_capture_fn(make_capture(i))
    tap = RoutingTap(
        buf=buf,
        n_layers=n_layers,
        n_experts=n_experts,
        top_k=top_k,
        capacity=capacity,
        target_clock=PhaseClock.for_device(header[5:10], device),
        draft_clock=PhaseClock.for_device(header[10:15], device),
        header=header,
        sig=sig,
        shm=shm,
    )
    tap.handles += [
        model.register_forward_pre_hook(tap.target_clock.pre),
        model.register_forward_hook(tap.target_clock.post),
    ]
    TAPS.append(tap)
    return tap


def bind_draft(model: Any) -> None:
    """Attach the draft timing hooks to the newest tap's draft clock, and the signal capture (:func:`bind_signals`)."""
    if not TAPS:
        return
    tap = TAPS[-1]
    tap.draft_clock = PhaseClock.for_device(tap.draft_clock.slots, next(model.parameters()).device)
    tap.handles += [
        model.register_forward_pre_hook(tap.draft_clock.pre),
        model.register_forward_hook(tap.draft_clock.post),
    ]
    tap.header[15] = 1.0
    bind_signals(model, tap)


def bind_signals(model: Any, tap: RoutingTap) -> bool:
    """Wrap the draft model's ``compute_logits`` so that each draft step's signals land in ``tap.sig``.

    vLLM's proposer calls ``compute_logits`` once per draft step on the ``(batch, vocab)`` logits of the
    token each request drafts next (the drafter's batch order). The wrapper computes, in float32 on the
    model's device, the softmax's top-1 probability, entropy (nats), top-1 minus top-2 probability and
    top-1 id, and copies them into row ``calls`` of the buffer (no allocation in the buffer, no host
    sync on accelerators); a call beyond the buffer (more draft steps or requests than it holds, e.g.
    a warm-up pass) is not captured, nor is any while a CUDA graph is being captured (its replay would
    not run this code: the V2 runner captures the draft's ``compute_logits`` in its FULL draft graphs;
    :mod:`specenv.engines.vllm.support` refuses signals there), nor is any while no consumer wants the signals
    (:meth:`RoutingTap.want_signals`, set by the controller for a lookahead policy). Its wall time is
    summed in the header (:attr:`RoutingTap.capture_ms`).

    Returns:
        Whether the capture is bound (False when the model has no ``compute_logits`` or the engine
        does not speculate).
    """
    import torch

    orig = getattr(model, "compute_logits", None)
    if orig is None or tap.sig is None or tap.sig_steps == 0:
        return False
    header, sig = tap.header, tap.sig
    steps, rows = int(sig.shape[0]), int(sig.shape[1])
    capturing = tap.draft_clock.capturing  # a graph replay would not run this Python: never capture it

    def compute_logits(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        logits = orig(hidden_states, *args, **kwargs)
        if not header[_H_SIG_WANT] or (capturing is not None and capturing()):
            return logits
        j = int(header[_H_SIG_CALLS])
        if logits is None or logits.dim() != 2 or j >= steps or logits.shape[0] > rows:
            return logits
        t0 = time.perf_counter()
        n = int(logits.shape[0])
        with torch.no_grad():
            logp = torch.log_softmax(logits.float(), dim=-1)
            p = logp.exp()
            top = torch.topk(p, 2, dim=-1)
            out = sig[j, :n]
            out[:, 0] = top.values[:, 0]
            out[:, 1] = torch.special.entr(p).sum(dim=-1)
            out[:, 2] = top.values[:, 0] - top.values[:, 1]
            out[:, 3] = top.indices[:, 0].float()
        header[_H_SIG_CALLS] = j + 1
        header[_H_SIG_N] = n
        header[_H_SIG_TOTAL] += 1
        header[_H_SIG_MS] += (time.perf_counter() - t0) * 1e3
        return logits

    model.compute_logits = compute_logits
    header[_H_HAS_SIG] = 1.0
    return True


def attach(owner_pid: int | None = None) -> RoutingTap | None:
    """Attach to the shared-memory tap of a worker process of this engine core (None if absent)."""
    from multiprocessing import shared_memory

    try:
        shm = shared_memory.SharedMemory(name=shm_name(os.getpid() if owner_pid is None else owner_pid))
    except FileNotFoundError:
        return None
    try:  # the worker owns (and unlinks) the segment; do not let this process's tracker unlink it too
        from multiprocessing import resource_tracker

        resource_tracker.unregister("/" + shm.name, "shared_memory")
    except Exception:  # pragma: no cover - tracker internals differ across Python versions
        pass
    head = np.ndarray((_HEADER,), dtype=np.float64, buffer=shm.buf)
    if head[0] != _MAGIC:
        shm.close()
        return None
    n_layers, capacity, top_k, n_experts = (int(x) for x in head[1:5])
    sig_steps, sig_rows = int(head[_H_SIG_STEPS]), int(head[_H_SIG_ROWS])
    header, routing, sig = _views(shm.buf, n_layers, capacity, top_k, sig_steps, sig_rows)
    return RoutingTap(
        buf=routing,
        n_layers=n_layers,
        n_experts=n_experts,
        top_k=top_k,
        capacity=capacity,
        target_clock=PhaseClock(header[5:10]),
        draft_clock=PhaseClock(header[10:15]),
        header=header,
        sig=sig,
        shm=shm,
    )


def current_tap() -> RoutingTap | None:
    """The tap the scheduler of this process reads: in-process if bound here, else a worker's shared one."""
    return TAPS[-1] if TAPS else attach()


def _make_loader_cls() -> type:
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class SpecenvModelLoader(DefaultModelLoader):
        """The default loader plus the specenv routing/timing taps (``--load-format specenv``).

        The draft is told apart from the target by the prefix vLLM's draft-model proposer loads it
        with (``draft_model``) or by its model config (the speculative config's
        ``draft_model_config``).
        """

        def __init__(self, load_config: Any):
            # Read the files as "auto" would; only the post-load binding differs.
            super().__init__(dataclasses.replace(load_config, load_format="auto"))

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            model = super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            spec = vllm_config.speculative_config
            is_draft = prefix.startswith("draft") or (
                spec is not None
                and model_config is getattr(spec, "draft_model_config", None)
                and model_config is not vllm_config.model_config
            )
            if is_draft:
                bind_draft(model)
            else:
                bind_target(model, vllm_config)
            advise_model(model)  # the weights on huge pages: step times alike from engine to engine
            return model

    return SpecenvModelLoader


_REGISTERED = False


def register() -> None:
    """``vllm.general_plugins`` entry point: register the ``specenv`` load format (idempotent).

    Inert unless a server is started with ``--load-format specenv``; safe to run in every vLLM
    process.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_make_loader_cls())
    _REGISTERED = True
