"""Record batched vLLM steps for the batch cost model (:mod:`specenv.cost.batch`, :mod:`specenv.cost.batchfit`).

One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with specenv's controller and routing tap
(:mod:`specenv.engines.vllm.controller`, :mod:`specenv.engines.vllm.tap`) serves groups of B
concurrent greedy requests (``ignore_eos``), B = 1..8. Every engine step:

* the drafter proposes ``n`` tokens for every request of the step, ``n`` drawn uniformly from
  1..kmax per step (the controller's ``draft_tokens``: vLLM's dynamic-SD field
  ``num_spec_tokens_to_schedule``), so the draft term sees many (n, B) pairs;
* a random policy (:class:`RandomK`, called once per step on the stacked observations) gives each
  request its own k, uniform in 0..n, so the verified positions P of a step range over B..B*(kmax+1);
* the controller's ``forward_callback`` hands over the step's spans and the tap's routing. A step
  whose every scheduled request ran a verification round (no prefill chunk in it: a "pure" step) is
  kept: per request k, m = k+1, context L, accepted drafts, and U_i (its own per-layer union, mean
  over layers: the ``U_{t,k}`` of the replay tables); for the step the per-layer union of the experts
  of all verified positions of all requests (``U_batch``, mean over layers, and per layer), the
  target's forward time ``T_T_ms`` and the draft's ``T_D_ms`` (the tap's forward hooks, as in the
  B = 1 recordings), the CPU time of the forwards' thread over the same spans (``T_T_cpu_ms``,
  ``T_D_cpu_ms``: with one OpenMP thread the work itself, without the time other processes of a
  shared machine took), the draft forward passes run (``draft_calls``), and the step's wall time
  ``step_ms`` (schedule to output). Steps with a prefill
  chunk are counted and dropped (their time is mostly the prefill).

The drafting timed in step s proposes the tokens verified in step s+1: ``T_D_ms`` of a row belongs
with that row's ``drafted`` (n) and ``B`` (the requests drafted for), and with ``committed`` (the
tokens the draft's first forward re-reads: sum of accepted + 1).

Importing this module does not import vLLM; :func:`record_batch_steps` does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from specenv.cost.batchfit import PLAIN_COLUMNS, PREFILL_COLUMNS

__all__ = [
    "PLAIN_COLUMNS",
    "PREFILL_COLUMNS",
    "STEP_COLUMNS",
    "RandomK",
    "record_batch_steps",
    "record_plain_steps",
    "step_row",
]

#: Columns of the steps table (one row per pure engine step).
STEP_COLUMNS = (
    "run",  # the repetition / configuration label
    "batch",  # configured concurrency (requests submitted together)
    "group",  # index of the group of requests within the run (the cluster of the fit)
    "step",  # controller step number
    "B",  # requests in the step
    "positions",  # P = sum of (k_i + 1)
    "context_sum",  # sum of L_i
    "U_batch",  # mean over layers of the per-layer union across all verified positions
    "T_T_ms",  # target forward time of the step
    "T_D_ms",  # draft forward time of the step
    "T_T_cpu_ms",  # CPU time of the target forward's thread (robust to other processes)
    "T_D_cpu_ms",  # CPU time of the draft forwards' thread
    "draft_calls",  # draft forward passes run in the step
    "step_ms",  # wall time of the step
    "drafted",  # tokens the drafter proposed per request in this step (n)
    "committed",  # sum of (accepted_i + 1)
    "k",  # list: per request budget
    "U",  # list: per request own union (mean over layers)
    "L",  # list: per request context length
    "accepted",  # list: per request accepted drafts
    "U_batch_layer",  # list: per layer union across the step
)


class RandomK:
    """Stateless random policy: each request's k uniform in 0..n, n = the drafts just proposed.

    Args:
        kmax: Largest budget (the observation spec's).
        seed: Seed of its generator.
        drafted: Called for the drafts the drafter proposed this step (default kmax).
        uniform: Every request keeps all n drafts (k = n, no draw): the steps a fixed k serves.
    """

    stateless = True
    name = "random-k"

    def __init__(self, kmax: int, seed: int = 0, drafted: Callable[[], int] | None = None, uniform: bool = False):
        self.kmax = int(kmax)
        self.rng = np.random.default_rng(seed)
        self.drafted = drafted
        self.uniform = bool(uniform)

    def reset(self) -> None:
        """Nothing to reset (stateless)."""

    def act(self, obs: np.ndarray, ids: Any = None, step: Any = None) -> Any:
        """One k per row of ``obs`` (the one policy protocol; a 1-D observation: one int)."""
        if np.ndim(obs) == 1:  # alias: a batch of one
            return int(self.act(np.asarray(obs)[None, :])[0])
        n = self.kmax if self.drafted is None else min(self.kmax, int(self.drafted()))
        if self.uniform:
            return np.full(len(obs), n, dtype=np.int64)
        return self.rng.integers(0, n + 1, size=len(obs))


def step_row(routing: np.ndarray, spans: Sequence[tuple[int, int]], n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-request and batch expert unions of one step.

    Args:
        routing: ``(n_layers, tokens, top_k)`` expert ids of the step's tokens.
        spans: ``(offset, m)`` of each request's verified positions.
        n_experts: Experts per layer.

    Returns:
        ``(U, U_batch_layer)``: per request its own per-layer union averaged over layers, and per layer
        the union over all spans.
    """
    from specenv.engines.base import span_expert_stats

    U, _ = span_expert_stats(routing, list(spans), n_experts)
    tok = np.concatenate([np.arange(o, o + m) for o, m in spans])
    sel = routing[:, tok, :].reshape(routing.shape[0], -1).astype(np.int64)
    hit = np.zeros((routing.shape[0], n_experts), dtype=bool)
    np.put_along_axis(hit, sel, True, axis=1)
    return np.asarray(U, dtype=np.float64), hit.sum(axis=1).astype(np.float64)


class _StepRecorder:
    """The controller callbacks that build the steps table."""

    def __init__(self, ctl: Any, kmax: int, rng: np.random.Generator, uniform: bool = False):
        self.ctl, self.kmax, self.rng, self.uniform = ctl, kmax, rng, uniform
        self.rows: list[dict[str, Any]] = []
        self.rounds: dict[str, dict[str, Any]] = {}
        self.dropped = 0
        self.label: dict[str, Any] = {}
        self.n_now = kmax  # what the drafter proposes in the step now running
        self.proposed = kmax  # what it proposed in the step whose drafts the policy is trimming
        self.fixed: int | None = None  # a fixed-k group's k (every step drafts it, every request keeps it)

    def drafts_proposed(self) -> int:
        """Drafts per request the drafter proposed in the step just run (what the policy may keep)."""
        return self.proposed

    def on_round(self, req_id: str, outcome: dict[str, Any]) -> None:
        self.rounds[req_id] = outcome

    def on_forward(self, spans: dict[str, tuple[int, int, int]], routing: np.ndarray | None) -> None:
        rounds, self.rounds = self.rounds, {}
        ctl = self.ctl
        tap = ctl.tap
        drafted = self.proposed = self.n_now
        if self.fixed is not None:
            self.n_now = self.fixed
        else:
            self.n_now = self.kmax if self.uniform else int(self.rng.integers(1, self.kmax + 1))
        ctl.draft_tokens = self.n_now  # the next step's drafting
        if routing is None or not spans or set(rounds) != set(spans):
            self.dropped += 1
            return
        ids = sorted(spans, key=lambda r: spans[r][0])
        outs = [rounds[r] for r in ids]
        if any(o["m"] != spans[r][2] for r, o in zip(ids, outs, strict=True)):
            self.dropped += 1
            return
        U, ub = step_row(routing, [(spans[r][0], spans[r][2]) for r in ids], ctl.n_experts)
        k = [int(o["K"]) for o in outs]
        L = [int(o["L"]) for o in outs]
        acc = [int(o["accepted"]) for o in outs]
        self.rows.append(
            {
                **self.label,
                "step": int(ctl._step),
                "B": len(ids),
                "positions": int(sum(k) + len(k)),
                "context_sum": int(sum(L)),
                "U_batch": float(ub.mean()),
                "T_T_ms": float(tap.target_clock.ms),
                "T_D_ms": float(tap.draft_clock.ms),
                "T_T_cpu_ms": float(tap.target_clock.cpu_ms),
                "T_D_cpu_ms": float(tap.draft_clock.cpu_ms),
                "draft_calls": int(tap.draft_clock.calls),
                "step_ms": float((time.perf_counter() - ctl._t_sched) * 1e3),
                "drafted": drafted,
                "committed": int(sum(acc) + len(acc)),
                "k": k,
                "U": [float(x) for x in U],
                "L": L,
                "accepted": acc,
                "U_batch_layer": [float(x) for x in ub],
            }
        )


def record_batch_steps(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    batches: Sequence[int],
    reps: int,
    max_tokens: int,
    kmax: int,
    seed: int = 0,
    progress: Callable[[int, int, str], None] | None = None,
    between: Callable[[int, int, list[list[int]]], None] | None = None,
    uniform: bool = False,
    fixed_share: float = 0.0,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Run groups of B concurrent requests on a controller engine and record its pure steps.

    Args:
        llm: An in-process ``vllm.LLM`` with specenv's controller and tap (``load_format="specenv"``),
            ``num_speculative_tokens = kmax`` and ``max_num_seqs >= max(batches)``.
        prompts: Token ids of the prompts; group g of a (rep, B) run takes B of them, cycling.
        batches: Batch sizes to run.
        reps: Repetitions of every batch size (interleaved: rep 0 of every B, then rep 1...).
        max_tokens: Tokens generated per request (``ignore_eos``).
        kmax: ``num_speculative_tokens`` of the engine.
        seed: Seed of the draft-length and k draws.
        progress: Called as ``progress(done, total, what)``.
        between: Called as ``between(rep, B, prompts)`` after every group (the collection script runs
            the same group on a plain engine there: interleaved, the same load).
        uniform: Every step drafts ``kmax`` and every request verifies all of them (k = kmax for every
            request): the steps a fixed k serves, to check a fitted model on (``scripts/check_step_model.py``);
            False: the random draft lengths and budgets a fit needs.
        fixed_share: The share of groups served as a fixed k serves them (drawn per group with the
            seed): a k uniform in 1..kmax for the whole group, every step drafting k and every request
            verifying all k. A fit on random budgets alone sees few steps where every request verifies
            the same k, which is what a fixed-k arm (and a batch-level controller) runs; ``stats
            ["fixed_groups"]`` maps each such group to its k. Ignored with ``uniform``.

    Returns:
        ``(steps, stats)``: the steps table (:data:`STEP_COLUMNS` and ``engine_step_ms``, the wall time
        of the whole ``engine.step()`` that ran the row's step) and counts (steps kept, dropped), and
        ``stats["prefill"]``: one row per group (:data:`PREFILL_COLUMNS`, engine ``"spec"``), its
        prefill phase timed.
    """
    from vllm import SamplingParams

    ctl = llm.llm_engine.engine_core.engine_core.scheduler
    if ctl.tap is None:
        raise ValueError("record_batch_steps needs the routing tap (load_format='specenv')")
    if not 0.0 <= float(fixed_share) <= 1.0:
        raise ValueError(f"fixed_share={fixed_share!r}: must be in [0, 1]")
    rng = np.random.default_rng(seed)
    group_rng = np.random.default_rng([seed, 1])  # the fixed groups and their k: apart from the step draws
    rec = _StepRecorder(ctl, kmax, rng, uniform=uniform)
    policy = RandomK(kmax, seed, drafted=rec.drafts_proposed, uniform=uniform)
    fixed_groups: dict[int, int] = {}
    # the policy runs in update_draft_token_ids, after forward_callback has drawn the next step's n:
    # it trims the drafts proposed in the step just run (rec.proposed). Whatever the engine had installed
    # (a live backend's callbacks, a policy, a draft length) is put back afterwards.
    saved = (ctl.round_callback, ctl.forward_callback, ctl.draft_tokens, ctl.policy)
    ctl.set_policy(policy)
    ctl.round_callback, ctl.forward_callback = rec.on_round, rec.on_forward
    ctl.draft_tokens = rec.n_now
    sp = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    total, done, group, cursor = reps * len(batches), 0, 0, 0
    prefill: list[dict[str, Any]] = []
    try:
        for rep in range(reps):
            for B in batches:
                if progress:
                    progress(done, total, f"rep {rep} B={B}")
                chosen = [list(prompts[(cursor + i) % len(prompts)]) for i in range(B)]
                cursor += B
                rec.label = {"run": f"rep{rep}", "batch": int(B), "group": group}
                if not uniform and fixed_share > 0 and group_rng.random() < fixed_share:
                    rec.fixed = fixed_groups[group] = int(group_rng.integers(1, kmax + 1))
                else:
                    rec.fixed = None
                policy.uniform = uniform or rec.fixed is not None
                rec.n_now = ctl.draft_tokens = rec.fixed if rec.fixed is not None else rec.n_now
                pre = _run_group(llm, chosen, sp, f"specenv-batchrec-{group}", rec.rows)
                prefill.append({"engine": "spec", **rec.label, **pre})
                if between is not None:
                    between(rep, int(B), chosen)
                group += 1
                done += 1
    finally:
        ctl.round_callback, ctl.forward_callback, ctl.draft_tokens = saved[:3]
        ctl.set_policy(saved[3])
    if progress:
        progress(total, total, "done")
    steps = pd.DataFrame(rec.rows, columns=[*STEP_COLUMNS, "engine_step_ms"])
    stats = {"steps": len(steps), "dropped_steps": rec.dropped, "groups": group, "prefill": prefill}
    if fixed_groups:
        stats["fixed_groups"] = {str(g): k for g, k in fixed_groups.items()}
    return steps, stats


class _FirstTokens:
    """Times a group's prefill phase: the steps until every request has produced a token."""

    def __init__(self, ids: Sequence[str], prompts: Sequence[Sequence[int]]):
        self.waiting = set(ids)
        self.out = {"B": len(ids), "prompt_tokens": int(sum(len(p) for p in prompts)), "prefill_ms": 0.0}
        self.out["prefill_steps"] = 0

    def step(self, outs: Any, dt_ms: float) -> None:
        if not self.waiting:
            return
        self.out["prefill_ms"] += dt_ms
        self.out["prefill_steps"] += 1
        for out in outs or ():
            if out.request_id in self.waiting and out.outputs and len(out.outputs[0].token_ids) > 0:
                self.waiting.discard(out.request_id)


def _run_group(llm: Any, prompts: list[list[int]], sp: Any, prefix: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Serve one group to the end, stepping the engine as ``LLM.generate`` does and timing every step.

    The rows the controller's callbacks appended during a step get ``engine_step_ms``: the wall time
    of the whole ``engine.step()`` (schedule, forwards, sampler, output processing), what a user of
    the engine waits for; ``step_ms`` (schedule to the forward's callback) misses the output side.

    Returns:
        The group's prefill phase: ``B``, ``prompt_tokens``, ``prefill_ms``, ``prefill_steps``
        (:data:`PREFILL_COLUMNS`).
    """
    engine = llm.llm_engine
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": list(p)}, sp)
    first = _FirstTokens(ids, prompts)
    while engine.has_unfinished_requests():
        n0 = len(rows)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = (time.perf_counter() - t0) * 1e3
        for row in rows[n0:]:
            row["engine_step_ms"] = dt
        first.step(outs, dt)
    return first.out


def step_engines(models: str, kmax: int, warm: Sequence[Sequence[int]], plain: bool = True) -> tuple[Any, Any]:
    """The engines a steps recording runs, in this process: the controller engine and the plain engine.

    The controller engine (specenv's scheduler and routing tap, ``num_speculative_tokens = kmax``: what
    :func:`record_batch_steps` needs) and, with ``plain``, an engine with no drafter loaded (the batch AR
    reference, :func:`record_plain_steps`), its weights advised onto huge pages as the controller engine's
    loader puts them and warmed up with the prompts ``warm`` served together (not kept). Both take up to
    ``len(warm)`` concurrent requests.

    Returns:
        ``(llm, plain_llm)``; ``plain_llm`` is None without ``plain``.
    """
    from specenv.engines.vllm.bench import build_llm

    top = len(warm)
    llm = build_llm({"models": models, "k": kmax, "max_num_seqs": top, "settings": {}, "tap": True})
    if not plain:
        return llm, None
    from specenv.engines.vllm.hugepages import advise_engine

    plain_llm = build_llm({"models": models, "k": 0, "max_num_seqs": top, "controller": False})
    advise_engine(plain_llm)
    record_plain_steps(plain_llm, warm, 16, "warmup", top, -1)  # not kept
    return llm, plain_llm


def record_plain_steps(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    run: str,
    batch: int,
    group: int,
    prefill: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One group of concurrent greedy requests on a *plain* engine (no drafter loaded), every decode step timed.

    The batch AR reference: the same prompts, the same ``max_tokens`` (``ignore_eos``), so every step
    after the prefill commits one token per running request. A step that runs a prefill (the first;
    a chunked prefill's later ones) is not kept: a step is kept when every running request had
    already produced a token before it.

    Returns:
        One row per decode step (:data:`PLAIN_COLUMNS`): ``B`` running requests, ``context_sum`` (sum of
        their context lengths before the step), ``engine_step_ms`` (wall time of ``engine.step()``).
        ``prefill`` (when given) gets the group's prefill phase (:data:`PREFILL_COLUMNS`, engine
        ``"plain"``).
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True, detokenize=False)
    lens = {}
    for i, p in enumerate(prompts):
        rid = f"specenv-plainrec-{group}-{i}"
        engine.add_request(rid, {"prompt_token_ids": list(p)}, sp)
        lens[rid] = [len(p), 0]  # prompt tokens, output tokens so far
    first = _FirstTokens(list(lens), prompts)
    rows: list[dict[str, Any]] = []
    while engine.has_unfinished_requests():
        running = [r for r, (_, n) in lens.items() if n >= 0]
        decode = all(lens[r][1] > 0 for r in running)
        ctx = sum(lens[r][0] + lens[r][1] for r in running)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = (time.perf_counter() - t0) * 1e3
        first.step(outs, dt)
        for out in outs:
            if out.request_id in lens:
                lens[out.request_id][1] = -1 if out.finished else len(out.outputs[0].token_ids)
        if decode and running:
            rows.append(
                {
                    "run": run,
                    "batch": int(batch),
                    "group": int(group),
                    "B": len(running),
                    "context_sum": ctx,
                    "engine_step_ms": dt,
                }
            )
    if prefill is not None:
        prefill.append({"engine": "plain", "run": run, "batch": int(batch), "group": int(group), **first.out})
    return rows
