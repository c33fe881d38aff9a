"""Live CPU engine: real speculative decoding with transformers on the shipped small MoE models.

Needs the ``live`` extra (``pip install specenv[live]``: transformers, tokenizers, safetensors; torch
installed first as ``torch==2.13.0``). See :mod:`specenv.live.engine` for the round protocol,
:mod:`specenv.live.models` for the shipped models and prompts and :mod:`specenv.live.collect` for
trace collection (``specenv collect --engine hf``).
"""

from specenv.live.engine import LiveEngine, RoundResult, RoutingRecorder, expert_stats
from specenv.live.models import MODEL_NAME, PROMPT_SET, Prompt, SmallModels, load_models, load_prompts

__all__ = [
    "MODEL_NAME",
    "PROMPT_SET",
    "LiveEngine",
    "Prompt",
    "RoundResult",
    "RoutingRecorder",
    "SmallModels",
    "expert_stats",
    "load_models",
    "load_prompts",
]
