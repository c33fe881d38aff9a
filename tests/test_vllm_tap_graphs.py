"""The recording tap under CUDA graphs, on CPU with mocks: no device synchronisation while a stream is
captured, phase times from CUDA events, the all-zero routing buffer and the monolithic MoE kernel refused.

No vLLM needed: :mod:`specenv.engines.vllm.tap` imports vLLM only to bind to a loaded model.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from specenv.engines.vllm import tap as tapmod
from specenv.engines.vllm.bookkeeping import StepClock
from specenv.engines.vllm.tap import PhaseClock, RoutingMissing, RoutingTap, graph_mode_name, monolithic_kernel


class FakeEvent:
    """A CUDA timing event stand-in: records the fake device time at which it was recorded."""

    now = 0.0  # the fake device clock (ms)

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at: float | None = None
        self.records = 0

    def record(self, stream=None):
        self.at = FakeEvent.now
        self.records += 1

    def synchronize(self):
        assert self.at is not None, "synchronize on an event never recorded"

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


def _no_sync(*args, **kwargs):
    raise AssertionError("a device synchronisation was called")


@pytest.fixture
def cuda_mocks():
    """torch.cuda as a capturing-aware fake: events, capture flag; every synchronize raises."""
    state = {"capturing": False}
    with (
        mock.patch.object(torch.cuda, "Event", FakeEvent),
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"]),
        mock.patch.object(torch.cuda, "synchronize", _no_sync),
        mock.patch.object(torch.accelerator, "synchronize", _no_sync),
    ):
        yield state


def test_cpu_clock_is_the_wall_clock_and_never_synchronises():
    clock = PhaseClock.for_device(np.zeros(5), "cpu")
    assert clock.sync is None and clock.events is None and clock.timing == "hooks"
    with mock.patch.object(torch.accelerator, "synchronize", _no_sync):
        clock.pre(None, ())
        clock.post(None, (), None)
    assert clock.calls == 1 and clock.ms >= 0.0 and clock.mode is None


def test_no_synchronisation_and_no_stamp_while_a_stream_is_captured(cuda_mocks):
    clock = PhaseClock.for_device(np.zeros(5), "cuda")
    assert clock.timing == "events" and clock.sync is None
    cuda_mocks["capturing"] = True  # vLLM capturing a FULL graph runs the module (and its hooks) once
    clock.pre(None, ())
    clock.post(None, (), None)
    assert clock.calls == 0 and clock.ms == 0.0
    assert clock.events.start.records == 0 and clock.events.end.records == 0  # nothing recorded into the graph


def test_phase_time_from_cuda_events_read_after_the_step(cuda_mocks):
    clock = PhaseClock.for_device(np.zeros(5), "cuda")
    FakeEvent.now = 10.0
    clock.pre(None, ())  # first forward of the step: its start
    FakeEvent.now = 12.5
    clock.post(None, (), None)
    FakeEvent.now = 13.0
    clock.pre(None, ())  # a second forward (e.g. a draft step) does not move the start
    FakeEvent.now = 14.25
    clock.post(None, (), None)
    assert clock.calls == 2
    assert clock.ms == pytest.approx(4.25)  # device time from the first start to the last end
    assert clock.events.start.records == 1 and clock.events.end.records == 2
    clock.reset()
    assert clock.calls == 0 and clock.ms == 0.0 and clock.mode is None


def test_the_graph_mode_the_first_forward_ran_in(cuda_mocks):
    modes = iter(["PIECEWISE", "NONE"])
    clock = PhaseClock(np.zeros(5), events=tapmod.CudaEvents(), capturing=lambda: False, mode=lambda: next(modes))
    clock.pre(None, ())
    clock.post(None, (), None)
    clock.pre(None, ())
    assert clock.mode == "PIECEWISE"  # the step's first forward's, read once
    assert graph_mode_name("CUDAGraphMode.FULL") == "FULL"  # vLLM's CUDAGraphStat.runtime_mode is str(mode)
    assert graph_mode_name(SimpleNamespace(name="PIECEWISE")) == "PIECEWISE"
    assert graph_mode_name(None) is None


def test_step_clock_timing_values():
    assert StepClock(1.0, 1.0, 0.0, 0.0, 0.0, "hooks").hooked
    assert StepClock(1.0, 1.0, 0.0, 0.0, 0.0, "events:PIECEWISE").hooked
    assert not StepClock(1.0, 1.0, 0.0, 0.0, 0.0, "step").hooked
    assert not StepClock(1.0, 1.0, 0.0, 0.0, 0.0, "step:FULL").hooked


def _tap(buf: np.ndarray) -> RoutingTap:
    header = np.zeros(24)
    return RoutingTap(
        buf=buf,
        n_layers=buf.shape[0],
        n_experts=8,
        top_k=buf.shape[2],
        capacity=buf.shape[1],
        target_clock=PhaseClock(header[5:10]),
        draft_clock=PhaseClock(header[10:15]),
        header=header,
    )


def test_an_all_zero_routing_buffer_is_refused():
    tap = _tap(np.zeros((3, 16, 2), dtype=np.int32))
    with pytest.raises(RoutingMissing, match="all zero for the step's 5 tokens") as err:
        tap.routing(5)
    assert "\n" not in str(err.value)


def test_a_written_routing_buffer_is_returned_as_a_copy():
    buf = np.zeros((3, 16, 2), dtype=np.int32)
    buf[:, :5] = [0, 3]  # expert 0 is a valid id: only an all-zero slice is refused
    tap = _tap(buf)
    out = tap.routing(5)
    assert out.shape == (3, 5, 2) and (out[..., 1] == 3).all()
    out[:] = 7
    assert (buf[:, :5, 1] == 3).all()


def test_routing_in_place_is_a_view_of_the_host_buffer():
    buf = np.zeros((3, 16, 2), dtype=np.int32)
    buf[:, :5] = [1, 3]
    tap = _tap(buf)
    out = tap.routing(5, copy=False)
    buf[0, 0, 0] = 9  # the next forward's capture writes the buffer: a view sees it
    assert out.shape == (3, 5, 2) and out[0, 0, 0] == 9
    tap.buf = torch.from_numpy(buf)
    assert tap.routing(5, copy=False)[0, 0, 0] == 9
    buf[0, 0, 0] = 4
    assert tap.routing(5, copy=False)[0, 0, 0] == 4 and tap.routing(5)[0, 0, 0] == 4
    copied = tap.routing(5)
    buf[0, 0, 0] = 5
    assert copied[0, 0, 0] == 4


def test_torch_routing_buffer_checked_too():
    tap = _tap(np.zeros((2, 8, 2), dtype=np.int32))
    tap.buf = torch.zeros((2, 8, 2), dtype=torch.int32)
    with pytest.raises(RoutingMissing):
        tap.routing(4)


class _Method:
    def __init__(self, monolithic: bool):
        self.is_monolithic = monolithic


class _Layer(torch.nn.Module):
    """A MoE layer as vLLM's MoE runner shows it: a router and a quantisation method."""

    def __init__(self, monolithic: bool):
        super().__init__()
        self.router = object()
        self._quant_method = _Method(monolithic)


def test_a_monolithic_moe_kernel_is_named():
    modular = torch.nn.Sequential(_Layer(False), _Layer(False), torch.nn.Linear(2, 2))
    assert monolithic_kernel(modular) is None
    mixed = torch.nn.Sequential(_Layer(False), _Layer(True))
    assert monolithic_kernel(mixed) == "_Method"


def test_draft_signals_are_not_captured_into_a_graph():
    header = np.zeros(24)
    header[16], header[17], header[20], header[23] = 2, 3, 1, 1  # 2 steps x 3 rows, bound, wanted
    capturing = {"on": True}
    tap = _tap(np.zeros((1, 4, 2), dtype=np.int32))
    tap.header = header
    tap.sig = torch.zeros((2, 3, 4))
    tap.draft_clock = PhaseClock(header[10:15], capturing=lambda: capturing["on"])
    model = SimpleNamespace(compute_logits=lambda h: h)
    assert tapmod.bind_signals(model, tap)
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    model.compute_logits(logits)  # inside a capture: a replay would not run this code, so nothing is kept
    assert header[18] == 0 and tap.captured_steps == 0 and not tap.sig.any()
    capturing["on"] = False
    model.compute_logits(logits)
    sig = tap.draft_signals()
    assert sig.shape == (1, 2, 4) and list(sig[0, :, 3]) == [0.0, 2.0]


def test_bind_target_refuses_a_monolithic_kernel_in_one_line(monkeypatch):
    model = torch.nn.Sequential(_Layer(True), torch.nn.Linear(2, 2))
    monkeypatch.setattr(tapmod, "_routers", lambda m: [SimpleNamespace(top_k=2, global_num_experts=8)])
    before = list(tapmod.TAPS)
    with pytest.raises(ValueError, match="monolithic kernel _Method") as err:
        tapmod.bind_target(model, SimpleNamespace())
    assert "\n" not in str(err.value) and tapmod.TAPS == before  # nothing bound
