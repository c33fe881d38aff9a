"""CPU of the controller's horizon and decisions per step, one policy call against two, without an engine.

Drives a bare :class:`specenv.engines.vllm.controller.SpecControlScheduler` (no vLLM engine: the attributes
its decide and horizon paths read) through ``--steps`` engine steps of ``--batch`` decoding requests with
``draft_horizon="policy"``: per step ``_horizon`` (what ``schedule`` adds) and ``_decide`` (what
``update_draft_token_ids`` adds), thread CPU time, for ``horizon_one_call`` on and off, interleaved
``--repeats`` times. ``--policies`` (comma-separated) picks what is served:

* ``constant-mlp``: the policy of ``scripts/vllm_bench.py overhead`` (a real MLP call whose answer is
  always ``--k``, observation kmax ``--kmax``; rowwise: decisions and horizons in one call);
* ``delta``: the delta-space rule (stateful per request: the horizon is a peek on copies of the requests'
  memories), the paper's cost profile, lambda 7 ms;
* ``heuristic``: transformers' schedule (stateful per request);
* ``batch-goodput``: the expert-aware batch policy on the shipped ``live-vllm-wide-batch-v2`` model
  (a batch policy: two calls).

Every round accepts every draft. Run in the vLLM environment::

    python -m scripts.horizon_cpu --batch 1,8 --repeats 3 --policies constant-mlp,delta,batch-goodput
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import numpy as np


class _Request:
    def __init__(self, rid: str, prompt: int):
        self.request_id, self.num_tokens, self.num_output_tokens = rid, prompt + 1, 1
        self.is_prefill_chunk = False

    def is_finished(self) -> bool:
        return False


def bare_controller(policy: Any, num_spec: int, one_call: bool) -> Any:
    """A controller without an engine, ``draft_horizon="policy"``, serving ``policy``."""
    from specenv.engines.vllm import SpecenvSettings
    from specenv.engines.vllm.bookkeeping import ObsSlots
    from specenv.engines.vllm.controller import SpecControlScheduler
    from specenv.engines.vllm.served import ServedPolicy

    c = object.__new__(SpecControlScheduler)
    c.settings = SpecenvSettings(draft_horizon="policy", horizon_one_call=one_call)
    c.num_spec_tokens, c.top_k, c.n_experts = num_spec, 4, policy.spec.n_experts
    c.stats = {"decisions": 0, "fallbacks": 0, "capped": 0, "no_signals": 0, "policy_ms": 0.0, "horizon_calls": 0}
    c.stats["errors"] = []
    c._reqs, c.requests, c.waiting, c.running = {}, {}, [], []
    c._prev_batch, c.draft_tokens, c._next_gid, c._step = (0.0, 0.0), None, 0, 0
    c._blind_step = False  # the full path (schedule decides it per step; this controller has no schedule)
    c._outcome_ks = c._outcome_stats = None  # (set by outcome_drafts, which runs inside an engine's step)
    c._horizon_tables()
    c.policy, c.spec, c._signal_cols = policy, policy.spec, None
    c._served = ServedPolicy(policy, policy.spec, 8)
    c._slots = ObsSlots(policy.spec)
    return c


POLICIES = ("constant-mlp", "delta", "heuristic", "batch-goodput")


def make(kind: str, k: int, kmax: int) -> Any:
    """The served policy ``kind`` (module docstring), observation kmax ``kmax``, 64 experts."""
    from specenv.abtest import make_policy
    from specenv.observation.single import ObservationSpec

    spec = ObservationSpec(kmax, 0, 10_000, 64)
    if kind == "delta":
        from policies.delta import DeltaSpaceRule
        from specenv.cost.model import CostModel

        return DeltaSpaceRule(spec, CostModel.paper_profile(kmax), lam_ms=7.0)

    class _Ctl:
        n_experts = 64

    desc = {"kind": kind, "k": k, "kmax": kmax, "max_new_tokens": 10_000}
    if kind == "batch-goodput":
        desc["batch_cost_model"] = "live-vllm-wide-batch-v2"
    return make_policy(desc, _Ctl())


def run(
    one_call: bool, batch: int, k: int, kmax: int, steps: int, warmup: int = 50, policy: str = "constant-mlp"
) -> tuple[float, float]:
    """Mean thread-CPU microseconds per step of ``(_horizon, _decide)`` after ``warmup`` steps."""
    from vllm.v1.outputs import DraftTokenIds

    pol = make(policy, k, kmax)
    ctl = bare_controller(pol, kmax, one_call)
    ids = [f"r{i}" for i in range(batch)]
    for r in ids:
        ctl.requests[r] = _Request(r, 30)
        ctl._state(r)
    inflight = {r: [1] * k for r in ids}
    t_hz = t_dec = 0.0
    for s in range(steps + warmup):
        out = SimpleNamespace(num_scheduled_tokens={r: len(d) + 1 for r, d in inflight.items()},
                              scheduled_spec_decode_tokens=dict(inflight))  # fmt: skip
        ctl._step += 1
        c0 = time.thread_time()
        h = ctl._horizon(out)
        c1 = time.thread_time()
        # the round: every draft accepted, folded as update_from_output folds it
        Ks = [len(inflight[r]) for r in ids]
        for r, K in zip(ids, Ks, strict=True):
            ctl._reqs[r].last_U[K] = 10.0 + K
            ctl.requests[r].num_tokens += K + 1
            ctl.requests[r].num_output_tokens += K + 1
        slots = np.array([ctl._reqs[r].slot for r in ids])
        ctl._slots.update(slots, np.array(Ks), np.array(Ks), np.full(batch, 12.0), np.full(batch, 1.3))
        c2 = time.thread_time()
        dec = ctl._decide(DraftTokenIds(ids, [[1] * h for _ in ids]))
        c3 = time.thread_time()
        inflight = dict(zip(dec.req_ids, dec.draft_token_ids, strict=True))
        if s >= warmup:
            t_hz += c1 - c0
            t_dec += c3 - c2
    return t_hz / steps * 1e6, t_dec / steps * 1e6


def main() -> None:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m scripts.horizon_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--kmax", type=int, default=8)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="constant-mlp", help=f"comma-separated: {', '.join(POLICIES)}")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        ap.exit(2, f"--policies: unknown policy {bad[0] if bad else args.policies!r} (known: {', '.join(POLICIES)})\n")
    res: dict[tuple[str, int, bool], list[tuple[float, float]]] = {}
    for _ in range(args.repeats):
        for pol in policies:
            for b in args.batch:
                for one in (False, True):
                    res.setdefault((pol, b, one), []).append(run(one, b, args.k, args.kmax, args.steps, policy=pol))
    print("| policy | batch | path | horizon us/step | decide us/step | total us/step (median of repeats) |")
    print("|---|---|---|---|---|---|")
    for (pol, b, one), v in res.items():
        hz = ", ".join(f"{a:.0f}" for a, _ in v)
        de = ", ".join(f"{d:.0f}" for _, d in v)
        tot = statistics.median(a + d for a, d in v)
        print(f"| {pol} | {b} | {'one call' if one else 'two calls'} | {hz} | {de} | {tot:.0f} |")


if __name__ == "__main__":
    main()
