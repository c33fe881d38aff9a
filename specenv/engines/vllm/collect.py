"""Record a trace set (schema v2) with vLLM itself: executed fixed-K rounds and the counterfactual table.

The vLLM counterpart of :mod:`specenv.engines.hf.collect` (``specenv collect --engine vllm``); the
tables are built by the same code (:mod:`specenv.engines.counterfactual`). Two in-process engines
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the shipped small models (or any model set of that layout):

* the **speculative engine**: the MoE target with the draft model as vLLM's ``draft_model`` drafter
  (``num_speculative_tokens = kmax``), specenv's controller and routing tap (``load_format
  specenv``), prefix caching off (cached tokens are not routed);
* the **draft engine**: the draft model alone (no speculation), with a forward pre-hook on its
  sampler.

For every prompt:

1. **Fixed-K runs** K = 0..kmax at batch 1 through :class:`specenv.engines.vllm.live.VLLMBackend`
   (one engine step per round). The drafter proposes K tokens per step (vLLM's dynamic-SD field
   ``num_spec_tokens_to_schedule``, set by the controller's ``draft_tokens``), so ``T_D_ms`` is the
   measured drafting of K tokens; at K = 0 vLLM still runs one draft forward to keep the draft's KV
   cache in sync, and ``T_D_ms`` says so. The K = 0 run is plain greedy decoding: its output is the
   reference y (vLLM's prefill samples y_0; the rounds commit the rest). Greedy speculative decoding
   is lossless, so every other run must reproduce y; mismatches are counted (``extra.lossless``).
2. **Draft chains**: at every position t of y, the draft engine decodes ``kmax`` tokens greedily
   from ``prompt + y_<t`` (``ignore_eos``; many positions per engine step). The sampler hook sees
   the draft's logits of every decoding step: q (probability of the drafted token), the entropy
   and the top-1/top-2 margin are computed from them in float64 (exact, like
   :func:`specenv.engines.hf.engine.draft_signals`; no top-20 logprob approximation).
3. **Verdicts and routing**: every chain is verified teacher-forced by the speculative engine's
   target: the prompt ``prompt + y_<t + d_1..d_kmax`` with ``prompt_logprobs=2`` and
   ``max_tokens=1``. ``rho_{t,j} = 1`` iff d_j is the target's argmax after ``d_<j`` (its log-prob
   is the largest), the target's top-1/top-2 log-prob gap is kept to count near-ties
   (``target_gap_min``: the smallest gap over the chain up to its first rejection). The routing
   tap's capture of each prefill step (read through the controller's ``forward_callback``) gives
   the top-k experts of the verified positions ``[y_{t-1}, d_1..d_kmax]`` (m = kmax+1), hence
   ``U_{t,0..kmax}`` (:func:`specenv.engines.base.prefix_expert_stats`). The chain passes are full
   prefills (prefix caching is off), batched many per step.

The positions table equals the transformers engine's on the same reference up to argmax near-ties
between the two engines' kernels (tested in ``tests/vllm/test_vllm_collect.py``).
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from specenv.engines.base import prefix_expert_stats
from specenv.engines.counterfactual import (
    CLOCKS,
    first_difference,
    lossless_summary,
    positions_frame,
    rounds_frame,
    run_provenance,
)
from specenv.engines.hf.models import PROMPT_SET, Prompt, load_prompts
from specenv.engines.vllm.hugepages import advise_engine, backing
from specenv.traces.schema import ModelFacts
from specenv.traces.traceset import Manifest, TraceSet

__all__ = ["collect_vllm", "draft_chains", "verify_chains"]

#: Requests per engine step in the batched passes (chains and verdicts).
BATCH = 32
#: Token budget of one engine step of the speculative engine (also sizes the routing buffer).
BATCH_TOKENS = 4096


def collect_vllm(
    models: str | os.PathLike[str] = "small-moe-v1",
    prompts: Sequence[Prompt] | None = None,
    n_prompts: int = 8,
    kmax: int = 8,
    max_new_tokens: int = 128,
    name: str = "live-vllm",
    prompt_set: str = PROMPT_SET,
    progress: Callable[[int, int], None] | None = None,
    clock: str = "cpu",
    threads: int = 1,
    batch: int = BATCH,
    plain: bool = True,
) -> TraceSet:
    """Run both vLLM engines over a prompt set and build an in-memory trace set (``source="vllm"``).

    Args:
        models: Model set: shipped name or folder.
        prompts: Prompts (default: the first ``n_prompts`` of ``prompt_set``).
        n_prompts: Number of prompts when ``prompts`` is None.
        kmax: Largest budget: fixed-K runs K = 0..kmax, chain length of the sweep.
        max_new_tokens: Tokens generated per prompt (fewer if the target emits end-of-text).
        name: Name written to the manifest.
        prompt_set: Name or path of the prompt set (when ``prompts`` is None).
        progress: Called as progress(done, total) after each stage of each prompt.
        clock: ``"cpu"`` (thread CPU time of the forwards) or ``"wall"`` into ``T_T_ms``/``T_D_ms``;
            both are kept as extra columns.
        threads: Torch threads (set before vLLM starts; vLLM's CPU worker then forbids changing it).
        batch: Requests per engine step in the chain and verdict passes.
        plain: Also decode every prompt with a plain engine (no drafter loaded) and keep its measured
            step times as the speedup reference (``manifest.extra.ar_reference``,
            :func:`plain_reference`).

    Returns:
        A :class:`TraceSet` with both tables.

    Raises:
        ValueError: On bad arguments or prompts that do not fit the model's context.
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {CLOCKS}")
    if kmax < 1 or max_new_tokens < 2:
        raise ValueError(f"kmax={kmax}, max_new_tokens={max_new_tokens}: need kmax >= 1 and max_new_tokens >= 2")
    if prompts is None:
        prompts = load_prompts(prompt_set)[:n_prompts]
    if not prompts:
        raise ValueError("no prompts to run")
    _quiet_cpu_defaults(threads)
    from specenv.engines.vllm.models import vllm_model_dirs

    dirs = vllm_model_dirs(models)
    wall0 = time.perf_counter()
    load_before = os.getloadavg()
    be, draft = _engines(dirs, models, kmax, max_new_tokens, batch)
    plain_llm = _plain_llm(dirs) if plain else None
    total = 3 * len(prompts)
    done = 0
    try:
        encoded = [be.models.encode(p.text) for p in prompts]
        limit = dirs.max_model_len - max_new_tokens - kmax - 2
        for p, ids in zip(prompts, encoded, strict=True):
            if len(ids) > limit:
                raise ValueError(f"prompt {p.id}: {len(ids)} tokens, at most {limit} fit the context")
        gc_was = gc.isenabled()
        gc.collect()
        gc.disable()  # no collector pauses inside timed rounds
        try:
            _warm_up(be, encoded[0], kmax)
            if plain_llm is not None:
                plain_steps(plain_llm, encoded[0], encoded[0][:8] or [0, 0])  # warm-up, not kept
            round_frames: list[pd.DataFrame] = []
            references: list[list[int]] = []
            mismatches: list[dict[str, int]] = []
            plain_runs: list[tuple[list[int], list[float], bool]] = []
            for p, ids in zip(prompts, encoded, strict=True):
                frames, ref = _fixed_k_runs(be, p, ids, kmax, clock, mismatches)
                round_frames += frames
                references.append(ref)
                if plain_llm is not None:  # interleaved with the fixed-K runs: the same load
                    plain_runs.append(plain_steps(plain_llm, ids, ref))
                done += 1
                if progress:
                    progress(done, total)
        finally:
            be.controller.draft_tokens = None
            if gc_was:
                gc.enable()
        chains = []
        for ids, ref in zip(encoded, references, strict=True):
            chains.append(draft_chains(draft, ids, ref, kmax))
            done += 1
            if progress:
                progress(done, total)
        pos_frames, ties = [], {"target_near_ties": 0, "draft_near_ties": 0, "draft_argmax_mismatch": 0}
        for p, ids, ref, ch in zip(prompts, encoded, references, chains, strict=True):
            sw = verify_chains(be, ids, ref, ch["tokens"], kmax)
            sw |= {k: ch[k] for k in ("q", "ent", "margin")}
            ties["target_near_ties"] += int(np.sum(sw["target_gap_min"] < NEAR_TIE))
            ties["draft_near_ties"] += int(np.sum(ch["margin"] < NEAR_TIE))
            ties["draft_argmax_mismatch"] += int(ch["mismatch"])
            pos_frames.append(
                positions_frame(p.id, p.category, sw, kmax, extra={"target_gap_min": sw["target_gap_min"]})
            )
            done += 1
            if progress:
                progress(done, total)
        facts = ModelFacts(be.controller.tap.n_layers, be.controller.tap.n_experts, be.controller.tap.top_k)
        ar_reference = summarize_plain(plain_runs) if plain_llm is not None else None
    finally:
        be.abort()
        be.controller.draft_tokens = None
        be.controller.forward_callback = None
    manifest = _manifest(
        dirs,
        prompts,
        facts,
        name=name,
        kmax=kmax,
        max_new_tokens=max_new_tokens,
        prompt_set=prompt_set,
        clock=clock,
        threads=threads,
        mismatches=mismatches,
        ties=ties,
        references=references,
        load_before=load_before,
        wall=time.perf_counter() - wall0,
    )
    if ar_reference is not None:
        manifest.extra["ar_reference"] = ar_reference
    return TraceSet(manifest, pd.concat(pos_frames, ignore_index=True), pd.concat(round_frames, ignore_index=True))


#: A top-1/top-2 gap (target: log-prob; draft: probability margin) below this counts as a near-tie.
NEAR_TIE = 1e-4


#: The engines of this process, by (model set, kmax, batch): vLLM's in-process engines cannot be shut
#: down one by one (shutting one down tears down the process-wide distributed state the others use,
#: and so does garbage-collecting it), so they live as long as the process, like
#: :meth:`specenv.engines.vllm.live.VLLMBackend.shared`.
_ENGINES: dict[tuple[str, int, int], tuple[Any, Any]] = {}


def _engines(dirs: Any, models: Any, kmax: int, max_new_tokens: int, batch: int) -> tuple[Any, Any]:
    """The speculative engine (a VLLMBackend, prefix caching off) and the draft engine of this process."""
    from specenv.engines.vllm.live import VLLMBackend

    key = (str(dirs.target.resolve()), int(kmax), int(batch))
    if key not in _ENGINES:
        be = VLLMBackend(
            models,
            kmax=kmax,
            max_new_tokens=max_new_tokens,
            stop_at_eos=True,
            enable_prefix_caching=False,
            max_num_seqs=batch,
            max_num_batched_tokens=BATCH_TOKENS,
        )
        _ENGINES[key] = (be, _draft_llm(dirs, batch))
    be, draft = _ENGINES[key]
    be.abort()
    be.max_new_tokens = int(max_new_tokens)
    return be, draft


def _quiet_cpu_defaults(threads: int) -> None:
    """One torch thread (set before vLLM's CPU worker forbids changing it) and no core pinning."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(int(threads))


def _warm_up(be: Any, ids: list[int], kmax: int) -> None:
    """Let the kernels and caches see every budget once before anything is timed."""
    for K in range(kmax + 1):
        be.controller.draft_tokens = K
        be.start(ids)
        for _ in range(3):
            if not be.done:
                be.step(K)
    be.abort()


def _fixed_k_runs(
    be: Any, p: Prompt, ids: list[int], kmax: int, clock: str, mismatches: list[dict[str, int]]
) -> tuple[list[pd.DataFrame], list[int]]:
    """The fixed-K runs K = 0..kmax of one prompt (rounds frames) and the reference output (K = 0)."""
    frames = []
    reference: list[int] = []
    for K in range(kmax + 1):
        be.controller.draft_tokens = K
        out, rounds = be.generate(ids, K)
        if K == 0:
            reference = list(out)
        elif (first := first_difference(out, reference)) is not None:
            mismatches.append({"generation_id": p.id, "K": K, "first_diff": int(first)})
        frames.append(rounds_frame(p.id, p.category, K, rounds, clock))
    return frames, reference


# ---------------------------------------------------------------------- the plain engine (AR reference)
def _plain_llm(dirs: Any) -> Any:
    """The target alone in an in-process engine, no speculative config: plain decoding, batch 1."""
    from vllm import LLM

    key = ("plain", str(dirs.target.resolve()))
    if key not in _PLAIN:
        _PLAIN[key] = LLM(
            model=str(dirs.target),
            tokenizer=str(dirs.target),
            dtype="float32",
            enforce_eager=True,
            max_model_len=dirs.max_model_len,
            max_num_seqs=1,
            seed=0,
            enable_prefix_caching=False,
            async_scheduling=False,
        )
        advise_engine(_PLAIN[key])  # huge pages, as the speculative engine's loader does
    return _PLAIN[key]


_PLAIN: dict[tuple[str, str], Any] = {}


def plain_steps(llm: Any, ids: list[int], ref: list[int]) -> tuple[list[int], list[float], bool]:
    """Decode one prompt with the plain engine for ``len(ref)`` tokens, timing each engine step.

    One engine step commits one token; the prefill step is not kept.

    Returns:
        (context length before each timed step, its wall time in ms, whether the output equals ``ref``).
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=max(len(ref), 1), ignore_eos=True, detokenize=False)
    engine.add_request(f"specenv-plain-{next(_PLAIN_IDS)}", {"prompt_token_ids": list(ids)}, sp)
    tokens: list[int] = []
    L: list[int] = []
    ms: list[float] = []
    first = True
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = (time.perf_counter() - t0) * 1e3
        before = len(tokens)
        for out in outs:
            tokens = list(out.outputs[0].token_ids)
        if not first and len(tokens) > before:
            L.append(len(ids) + before)
            ms.append(dt)
        first = False
    return L, ms, tokens == list(ref)


_PLAIN_IDS = itertools.count()


def summarize_plain(runs: Sequence[tuple[list[int], list[float], bool]]) -> dict[str, Any]:
    """The AR reference of a collection: the plain engine's step times, and their OLS line in L.

    ``step_ms = a + c * L`` is the speedup reference of the step-time cost model
    (:mod:`specenv.cost.steptime`), fitted by OLS with ``c >= 0`` (a step never gets cheaper with
    context: a negative free slope, ``c_unconstrained``, is noise, and then ``c = 0``, ``a`` = the mean).

    Returns:
        ``engine``, ``steps``, ``mean_ms``, ``median_ms``, ``a_ms``, ``c_ms_per_token``, ``r2`` and
        ``mismatches`` (prompts whose plain output differs from the speculative engine's K = 0 output:
        0 for a lossless engine).
    """
    L = np.asarray([x for r in runs for x in r[0]], dtype=np.float64)
    y = np.asarray([x for r in runs for x in r[1]], dtype=np.float64)
    if len(y) < 3:
        raise ValueError(f"the plain engine timed {len(y)} steps: too few for the AR reference")
    X = np.column_stack([np.ones_like(L), L])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    free_c = float(coef[1])
    if free_c < 0:  # a step never gets cheaper with context: a negative slope is noise; c = 0, a = the mean
        coef = np.array([float(y.mean()), 0.0])
    resid = y - X @ coef
    tss = float(((y - y.mean()) ** 2).sum())
    return {
        "engine": "vLLM, the target alone (no speculative config), batch 1, greedy",
        "steps": int(len(y)),
        "mean_ms": float(y.mean()),
        "median_ms": float(np.median(y)),
        "a_ms": float(coef[0]),
        "c_ms_per_token": float(coef[1]),
        "r2": float(1.0 - float(resid @ resid) / tss) if tss > 0 else 0.0,
        "c_unconstrained": free_c,
        "mismatches": int(sum(not r[2] for r in runs)),
    }


# ---------------------------------------------------------------------- draft chains
def _draft_llm(dirs: Any, batch: int) -> Any:
    """The draft model alone in an in-process engine (prefix caching on: the contexts share prefixes)."""
    from vllm import LLM

    llm = LLM(
        model=str(dirs.draft),
        tokenizer=str(dirs.draft),
        dtype="float32",
        enforce_eager=True,
        max_model_len=dirs.max_model_len,
        max_num_seqs=batch,
        seed=0,
        enable_prefix_caching=True,
    )
    advise_engine(llm)
    return llm


def _model_runner(llm: Any) -> Any:
    """The model runner of an in-process engine (single-process executor)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


class _SignalHook:
    """Forward pre-hook on a model runner's sampler: per request, the drafted token and q, entropy, margin.

    The logits reaching the sampler are the draft's raw logits (greedy: no processor applies), one row
    per request of the runner's input batch, in its order. Signals are computed in float64.
    """

    def __init__(self, runner: Any):
        self.runner = runner
        self.rows: dict[str, list[tuple[int, float, float, float]]] = {}
        self.handle = runner.sampler.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        import torch

        logits = kwargs["logits"] if "logits" in kwargs else args[0]
        req_ids = self.runner.input_batch.req_ids[: logits.shape[0]]
        lg = logits.detach().to(torch.float32)
        tok = lg.argmax(-1)
        p = torch.softmax(lg.double(), -1)
        q = p.gather(1, tok[:, None])[:, 0]
        ent = torch.special.entr(p).sum(-1)
        top = torch.topk(p, 2, dim=-1).values
        margin = top[:, 0] - top[:, 1]
        for i, r in enumerate(req_ids):
            if r is not None:
                self.rows.setdefault(r, []).append((int(tok[i]), float(q[i]), float(ent[i]), float(margin[i])))

    def remove(self) -> None:
        self.handle.remove()


def _run_requests(llm: Any, prompts: list[list[int]], params: Any) -> tuple[list[str], dict[str, Any]]:
    """Add every prompt to an in-process engine, step until all finish; internal ids and final outputs."""
    engine = llm.llm_engine
    base = f"specenv-cf-{time.monotonic_ns()}"
    ids = [engine.add_request(f"{base}-{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(prompts)]
    ext = {f"{base}-{i}": r for i, r in enumerate(ids)}
    outs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[ext.get(o.request_id, o.request_id)] = o
    return ids, outs


def draft_chains(llm: Any, prompt_ids: list[int], reference: list[int], kmax: int) -> dict[str, Any]:
    """The draft's greedy chain of ``kmax`` tokens at every position of a reference, with exact signals.

    Args:
        llm: The draft engine (``vllm.LLM`` of the draft model, in process).
        prompt_ids: The prompt.
        reference: The reference output y (N tokens).
        kmax: Chain length.

    Returns:
        ``tokens`` (N, kmax) int64, ``q``, ``ent``, ``margin`` (N, kmax) float32, and ``mismatch``:
        positions where a hooked argmax differs from the token vLLM returned (expected 0).
    """
    from vllm import SamplingParams

    N = len(reference)
    params = SamplingParams(temperature=0.0, max_tokens=kmax, ignore_eos=True, detokenize=False)
    hook = _SignalHook(_model_runner(llm))
    try:
        ctx = [list(prompt_ids) + list(reference[:t]) for t in range(N)]
        req_ids, outs = _run_requests(llm, ctx, params)
    finally:
        hook.remove()
    tokens = np.zeros((N, kmax), dtype=np.int64)
    sig = np.zeros((3, N, kmax), dtype=np.float32)
    mismatch = 0
    for t, r in enumerate(req_ids):
        got = list(outs[r].outputs[0].token_ids)
        rows = hook.rows.get(r, [])[-kmax:]
        if len(got) != kmax or len(rows) != kmax:
            raise RuntimeError(f"draft chain at t={t}: {len(got)} tokens, {len(rows)} hooked samples (need {kmax})")
        tokens[t] = got
        mismatch += int(any(row[0] != g for row, g in zip(rows, got, strict=True)))
        sig[:, t] = np.array([row[1:] for row in rows], dtype=np.float64).T
    return {"tokens": tokens, "q": sig[0], "ent": sig[1], "margin": sig[2], "mismatch": mismatch}


# ---------------------------------------------------------------------- verdicts and routing
class _RoutingSpans:
    """``forward_callback`` of the controller: the routing of each request's verified positions."""

    def __init__(self, n_layers: int, top_k: int):
        self.n_layers, self.top_k = n_layers, top_k
        self.want: dict[str, tuple[int, np.ndarray, np.ndarray]] = {}  # req -> (first position, buf, filled)

    def expect(self, req_id: str, first: int, m: int) -> None:
        buf = np.full((self.n_layers, m, self.top_k), -1, dtype=np.int64)
        self.want[req_id] = (first, buf, np.zeros(m, dtype=bool))

    def __call__(self, spans: dict[str, tuple[int, int, int]], routing: np.ndarray | None) -> None:
        for req_id, (offset, first, n) in spans.items():
            ent = self.want.get(req_id)
            if ent is None:
                continue
            if routing is None:
                raise RuntimeError("the routing tap did not capture the step (batch larger than its buffer?)")
            lo, buf, filled = ent
            a, b = max(first, lo), min(first + n, lo + buf.shape[1])
            if a < b:
                buf[:, a - lo : b - lo] = routing[:, offset + a - first : offset + b - first]
                filled[a - lo : b - lo] = True


def verify_chains(
    be: Any, prompt_ids: list[int], reference: list[int], chains: np.ndarray, kmax: int
) -> dict[str, Any]:
    """Teacher-forced verification of every chain by the target: rho, U and the target's near-ties.

    Args:
        be: The speculative engine (:class:`specenv.engines.vllm.live.VLLMBackend`, prefix caching off).
        prompt_ids: The prompt (P tokens).
        reference: The reference output y (N tokens).
        chains: ``(N, kmax)`` draft chains (:func:`draft_chains`).
        kmax: Chain length.

    Returns:
        ``rho`` (N, kmax) float32 in {0, 1}; ``U`` (N, kmax+1) float32; ``L`` (N,) = P + t;
        ``target_gap_min`` (N,) float32: the target's smallest top-1 minus top-2 log-prob over the
        chain up to and including its first rejected draft.
    """
    from vllm import SamplingParams

    ctl = be.controller
    tap = ctl.tap
    P, N = len(prompt_ids), len(reference)
    seq = [*map(int, prompt_ids), *map(int, reference)]
    prompts = [seq[: P + t] + [int(x) for x in chains[t]] for t in range(N)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, ignore_eos=True, detokenize=False)
    spans = _RoutingSpans(tap.n_layers, tap.top_k)
    be.abort()
    engine = be.engine
    base = f"specenv-verify-{time.monotonic_ns()}"
    ctl.forward_callback = spans
    ctl.draft_tokens = 0  # the drafter's proposals are not used: one draft forward per step
    outs: dict[str, Any] = {}
    try:
        ids = []
        for t, pr in enumerate(prompts):
            r = engine.add_request(f"{base}-{t}", {"prompt_token_ids": pr}, params)
            spans.expect(r, P + t - 1, kmax + 1)
            ids.append(r)
        ext = {f"{base}-{t}": r for t, r in enumerate(ids)}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[ext.get(o.request_id, o.request_id)] = o
    finally:
        ctl.forward_callback = None
        ctl.draft_tokens = None
    rho = np.zeros((N, kmax), dtype=np.float32)
    U = np.zeros((N, kmax + 1), dtype=np.float32)
    gap_min = np.zeros(N, dtype=np.float32)
    for t, r in enumerate(ids):
        plp = outs[r].prompt_logprobs
        n = P + t
        gaps = []
        for j in range(kmax):
            entry = plp[n + j]  # log-probs at the position of d_{j+1}, given seq[:n] + d_1..d_j
            d = int(chains[t, j])
            lps = sorted((lp.logprob for lp in entry.values()), reverse=True)
            rho[t, j] = float(entry[d].logprob >= lps[0])
            gaps.append(lps[0] - lps[1] if len(lps) > 1 else np.inf)
        first_rej = next((j for j in range(kmax) if rho[t, j] == 0), kmax - 1)
        gap_min[t] = min(gaps[: first_rej + 1])
        _, buf, filled = spans.want[r]
        if not filled.all():
            raise RuntimeError(f"verification at t={t}: the routing of {int((~filled).sum())} positions was not seen")
        U[t] = prefix_expert_stats(buf, tap.n_experts)[0]
    return {"rho": rho, "U": U, "L": np.arange(P, P + N, dtype=np.int32), "target_gap_min": gap_min}


def _manifest(
    dirs: Any,
    prompts: Sequence[Prompt],
    facts: ModelFacts,
    *,
    name: str,
    kmax: int,
    max_new_tokens: int,
    prompt_set: str,
    clock: str,
    threads: int,
    mismatches: list[dict[str, int]],
    ties: dict[str, int],
    references: list[list[int]],
    load_before: tuple[float, float, float],
    wall: float,
) -> Manifest:
    """The trace set's manifest: models, prompts, engines, clocks, machine, lossless check and near-ties."""
    import torch
    import vllm

    from specenv.validation import read_json

    mpath = dirs.source / "manifest.json"
    mm = read_json(mpath, what="model manifest") if mpath.is_file() else {}
    cfg = read_json(dirs.draft / "config.json", what="model config")
    n_runs = len(prompts) * kmax
    return Manifest(
        name=name,
        source="vllm",
        profile=f"{mm.get('name', dirs.name)}-v{mm.get('version', 1)} (vLLM {vllm.__version__}, CPU)",
        model=facts,
        kmax=kmax,
        greedy=True,
        description=(
            f"vLLM {vllm.__version__} on CPU: {len(prompts)} prompts x up to {max_new_tokens} greedy tokens on the "
            f"Qwen3-MoE target of {dirs.name} ({facts.n_experts} experts, top-{facts.top_k}, {facts.n_layers} "
            f"layers) with its draft as vLLM's draft_model drafter; fixed-K rounds K=0..{kmax} at batch 1 with "
            "measured times and routing (routing tap); counterfactual positions from a draft engine's greedy chains "
            "verified teacher-forced by the target (prompt log-probs, routing tap)."
        ),
        max_new_tokens=max_new_tokens,
        vocab_size=int(cfg.get("vocab_size", 0)) or None,
        extra={
            "engine": "specenv.engines.vllm.live.VLLMBackend (fixed-K rounds, verification) + draft-only vllm.LLM",
            "collector": "specenv.engines.vllm.collect.collect_vllm",
            "models": {"name": mm.get("name", dirs.name), "version": mm.get("version")},
            "prompt_set": prompt_set if isinstance(prompt_set, str) else str(prompt_set),
            "prompts": [p.id for p in prompts],
            "threads": threads,
            "clock": clock,
            "timing": (
                "T_T_ms/T_D_ms are thread CPU times of the forwards (routing tap's forward hooks, time.thread_time)"
                if clock == "cpu"
                else "T_T_ms/T_D_ms are wall-clock times of the forwards (time.perf_counter)"
            ),
            "draft_at_K0": "vLLM runs one draft forward at K=0 (keeps the draft's KV cache in sync): T_D_ms > 0",
            "temperature": 0.0,
            "stop_at_eos": True,
            "prefix_caching": False,
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            **run_provenance(load_before, wall),
            "pages": backing(),  # after every engine loaded: its AnonHugePages say the weights' pages
            "lossless_note": "every fixed-K run compared with the K=0 output (the reference y)",
            "lossless": lossless_summary(n_runs, mismatches),
            "near_ties": {"threshold": NEAR_TIE, **ties},
            "reference_tokens": {str(p.id): [int(x) for x in ref] for p, ref in zip(prompts, references, strict=True)},
            "extra_columns": {
                "rounds.run": "fixed-K{K}",
                "rounds.T_T_wall_ms, rounds.T_D_wall_ms": "wall-clock time of the forwards (time.perf_counter)",
                "rounds.T_T_cpu_ms, rounds.T_D_cpu_ms": "thread CPU time of the same forwards (time.thread_time)",
                "positions.target_gap_min": "the target's smallest top-1 minus top-2 log-prob over the chain up "
                "to its first rejected draft (near-ties of the verdicts)",
            },
            "signals": "q_j, ent_j, margin_j: the draft's probability of d_j, entropy (nats) and top-1 minus top-2 "
            "probability of its softmax at d_j, from the draft engine's logits (sampler pre-hook, float64): exact",
        },
    )
