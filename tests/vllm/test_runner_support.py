"""The controller's use of the runner table and of the graph-safe clocks, without starting an engine.

The controller's methods run on a stand-in ``self`` (what they read of the scheduler); the live-engine
tests (V1 runner, ``draft_model``, the only combination this CPU machine runs) are the other files here.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from policies.heuristics import ConfidenceThreshold  # noqa: E402
from specenv.engines.vllm.controller import SpecControlScheduler  # noqa: E402
from specenv.engines.vllm.settings import policy_refusal  # noqa: E402
from specenv.engines.vllm.tap import PhaseClock  # noqa: E402
from specenv.observation.single import ObservationSpec  # noqa: E402


def _ctl(runner: str, method: str, tap=None):
    sc = SimpleNamespace(method=method, draft_sample_method="greedy")
    if tap is None:
        tap = SimpleNamespace(has_signals=True)
    return SimpleNamespace(runner=runner, tap=tap, vllm_config=SimpleNamespace(speculative_config=sc))


@pytest.mark.parametrize(
    ("runner", "method", "served"),
    [("V1", "draft_model", True), ("V1", "eagle3", True), ("V2", "draft_model", False), ("V2", "eagle3", False)],
)
def test_lookahead_policy_served_or_refused_per_runner(runner, method, served):
    no_signals = SpecControlScheduler._no_signals(_ctl(runner, method))
    assert (no_signals is None) == served
    policy = ConfidenceThreshold(ObservationSpec(kmax=4, lookahead=2))
    why = policy_refusal(policy, num_spec_tokens=4, no_signals=no_signals)
    assert (why is None) == served
    if why is not None:
        assert "\n" not in why and "V2" in why


def _clock_self(target: PhaseClock, draft: PhaseClock):
    return SimpleNamespace(_t_sched=0.0, tap=SimpleNamespace(target_clock=target, draft_clock=draft))


def test_cpu_step_clock_unchanged():
    target, draft = PhaseClock(np.zeros(5)), PhaseClock(np.zeros(5))
    target.pre(None, ())
    target.post(None, (), None)
    clock = SpecControlScheduler._step_clock(_clock_self(target, draft), None)
    assert clock.timing == "hooks" and clock.hooked
    target.reset()
    clock = SpecControlScheduler._step_clock(_clock_self(target, draft), None)
    assert clock.timing == "step" and not clock.hooked and clock.t_ms == clock.step_ms and clock.d_ms == 0.0


def test_accelerator_step_clock_says_the_graph_mode():
    target = PhaseClock(np.zeros(5), mode=lambda: "PIECEWISE")
    draft = PhaseClock(np.zeros(5))
    target.pre(None, ())
    target.post(None, (), None)
    me = _clock_self(target, draft)
    assert SpecControlScheduler._step_clock(me, None).timing == "hooks:PIECEWISE"
    target.reset()  # a FULL replay: the module's hooks do not fire; vLLM's cudagraph_stats says FULL
    mro = SimpleNamespace(cudagraph_stats=SimpleNamespace(runtime_mode="CUDAGraphMode.FULL"))
    clock = SpecControlScheduler._step_clock(me, mro)
    assert clock.timing == "step:FULL" and not clock.hooked


def test_local_argmax_drafting_has_no_signals():
    me = _ctl("V1", "eagle3")
    me.vllm_config.speculative_config.use_local_argmax_reduction = True
    assert "compute_logits" in SpecControlScheduler._no_signals(me)
