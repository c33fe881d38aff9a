"""The factory of the transformers engine (``backend="hf"``, see :func:`specenv.engines.base.make_backend`)."""

from __future__ import annotations

import os

from specenv.engines.base import BackendConfig
from specenv.engines.hf.engine import LiveEngine
from specenv.engines.hf.models import load_models


def make(models: str | os.PathLike[str], config: BackendConfig) -> LiveEngine:
    """A :class:`specenv.engines.hf.engine.LiveEngine` on a model set (shipped name or folder).

    ``config.lookahead`` needs nothing here: the engine drafts ahead in :meth:`LiveEngine.propose`.
    """
    return LiveEngine(
        load_models(models),
        kmax=config.kmax,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        threads=config.threads,
        expert_cap=config.expert_cap,
    )
