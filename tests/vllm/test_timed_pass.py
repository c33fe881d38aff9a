"""bench.timed_pass on a fake in-process engine: per-request TTFT/TPOT and per-group walls (vLLM's SamplingParams)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from specenv.engines.vllm import bench  # noqa: E402


class _FakeEngine:
    """vLLM's in-process engine, as timed_pass uses it: each step returns one more token per request."""

    def __init__(self, lengths: dict[int, int]):
        self.lengths = lengths  # prompt's first token id -> tokens it generates
        self.live: dict[str, list] = {}
        self.engine_core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=object()))

    def add_request(self, rid, prompt, sp) -> None:
        self.live[rid] = [self.lengths[prompt["prompt_token_ids"][0]], []]

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        outs = []
        for rid, (n, toks) in list(self.live.items()):
            toks.append(7)
            done = len(toks) == n
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(token_ids=list(toks))]))
            if done:
                del self.live[rid]
        return outs


def test_timed_pass_times_first_and_last_token_of_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count()  # every perf_counter() call advances one second
    monkeypatch.setattr(bench.time, "perf_counter", lambda: float(next(clock)))
    llm = SimpleNamespace(llm_engine=_FakeEngine({1: 3, 2: 1, 3: 2}))
    res = bench.timed_pass(llm, [[1], [2], [3]], max_tokens=8, batch=2)
    assert res["outputs"] == [[7, 7, 7], [7], [7, 7]]
    assert [g["tokens"] for g in res["groups"]] == [4, 2]
    r0, r1, r2 = res["requests"]
    assert (r0["group"], r1["group"], r2["group"]) == (0, 0, 1)
    # group 0 starts at t=1; steps end at t=2, 3, 4 (one clock read per step): first tokens at t=2
    assert r0["ttft_ms"] == pytest.approx(1000.0) and r1["ttft_ms"] == pytest.approx(1000.0)
    assert r0["tpot_ms"] == pytest.approx((4 - 2) * 1000.0 / 2)
    assert r1["tpot_ms"] is None  # a single token has no time per output token
    assert res["tokens"] == 6
