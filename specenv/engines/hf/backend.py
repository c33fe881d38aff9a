"""The factory of the transformers engine (``backend="hf"``, see :func:`specenv.engines.base.make_backend`)."""

from __future__ import annotations

import os

from specenv.engines.hf.engine import LiveEngine
from specenv.engines.hf.models import load_models


def make(
    models: str | os.PathLike[str],
    *,
    kmax: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    threads: int | None = 1,
    lookahead: int = 0,
) -> LiveEngine:
    """A :class:`specenv.engines.hf.engine.LiveEngine` on a model set (shipped name or folder).

    ``lookahead`` needs nothing here: the engine drafts ahead in :meth:`LiveEngine.propose`.
    """
    del lookahead
    return LiveEngine(
        load_models(models),
        kmax=kmax,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        threads=threads,
    )
