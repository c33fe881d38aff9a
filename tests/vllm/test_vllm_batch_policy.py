"""A policy that decides a step jointly through the controller: one act(obs, ids, step) per step (the one protocol)."""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import PROMPTS, controller_of, greedy  # noqa: E402


class Recording:
    """A stateful batch policy that records what it is given and answers k = 2 for every row."""

    name = "recording-batch"

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[tuple[int, ...], list[str]]] = []
        self.released: list[str] = []
        self.fail = fail

    def reset(self) -> None:
        self.calls.clear()

    def act(self, obs, streams=None, step=None):  # noqa: ANN001, ANN201
        self.calls.append((np.shape(obs), list(streams)))
        if self.fail:
            return np.zeros(len(streams) + 1, dtype=np.int64)  # wrong shape: every request gets the fallback
        return np.full(len(streams), 2)

    def release(self, streams) -> None:  # noqa: ANN001
        self.released += list(streams)


def test_batch_policy_gets_the_whole_step(engine, plain_reference):
    ctl = controller_of(engine)
    pol = Recording()
    ctl.set_policy(pol)
    seen: list[int] = []
    prev = ctl.round_callback  # the shared backend's own callback: put back afterwards

    def on_round(rid, out):  # noqa: ANN001, ANN202
        seen.append(out["K"])
        if prev is not None:
            prev(rid, out)

    ctl.round_callback = on_round
    try:
        outs = engine.generate(PROMPTS[:4], greedy(24), use_tqdm=False)
    finally:
        ctl.round_callback = prev
        ctl.set_policy(None)
    assert pol.calls, "act was never called"
    ids = {rid for _, streams in pol.calls for rid in streams}
    assert len(ids) == 4  # one stable id per request
    for shape, streams in pol.calls:
        assert shape[0] == len(streams) == len(set(streams)) and shape[1] == ctl.spec.dim
    assert max(len(s) for _, s in pol.calls) == 4  # the whole batch in one call
    assert sorted(pol.released) == sorted(ids)  # every finished request released
    rounds = [k for k in seen]
    assert rounds and set(rounds) <= {2} | set(range(0, 2))  # k = 2 (fewer only when fewer drafts existed)
    assert rounds.count(2) > len(rounds) // 2
    # greedy speculative decoding stays lossless
    for p, o in zip(PROMPTS[:4], outs, strict=True):
        assert list(o.outputs[0].token_ids) == plain_reference[p]["token_ids"][:24]


def test_batch_policy_wrong_shape_falls_back(engine):
    ctl = controller_of(engine)
    before, errors = ctl.stats["fallbacks"], list(ctl.stats["errors"])
    ctl.set_policy(Recording(fail=True))
    try:
        engine.generate(PROMPTS[:2], greedy(8), use_tqdm=False)
        fell_back = ctl.stats["fallbacks"] - before
        logged = ctl.stats["errors"][len(errors) :]
    finally:
        ctl.set_policy(None)
        # the session's engine is shared: leave its counters as they were (other tests count from 0)
        ctl.stats["fallbacks"], ctl.stats["errors"] = before, errors
    assert fell_back > 0
    if len(errors) < 5:  # the controller logs its first five errors
        assert any(re.search(r"act returned shape \((\d+),\) for (\d+) observations", e) for e in logged), logged
