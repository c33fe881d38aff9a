"""Live CPU engine: real speculative decoding with transformers on the shipped small MoE models.

Needs the ``live`` extra (``pip install specenv[live]``: transformers, tokenizers, safetensors; torch
installed first as ``torch==2.13.0``). See :mod:`specenv.engines.hf.engine` for the round protocol,
:mod:`specenv.engines.hf.models` for the shipped models and prompts and :mod:`specenv.engines.hf.collect` for
trace collection (``specenv collect --engine hf``).
"""

from specenv.engines.base import RoundResult
from specenv.engines.hf.engine import LiveEngine, RoutingRecorder
from specenv.engines.hf.models import MODEL_NAME, PROMPT_SET, Prompt, SmallModels, load_models, load_prompts

__all__ = [
    "MODEL_NAME",
    "PROMPT_SET",
    "LiveEngine",
    "Prompt",
    "RoundResult",
    "RoutingRecorder",
    "SmallModels",
    "load_models",
    "load_prompts",
]
