"""Engines that execute real speculative-decoding rounds, behind one round-backend interface.

* :mod:`specenv.engines.base` -- the :class:`~specenv.engines.base.RoundBackend` protocol,
  :class:`~specenv.engines.base.RoundResult` and the expert statistics of a verification pass;
* :mod:`specenv.engines.recorder` -- the engine-agnostic recorder of the ``rounds`` table (atomic
  Parquet parts) and its reader;
* :mod:`specenv.engines.hf` -- the transformers engine on the shipped small models (``live`` extra);
* :mod:`specenv.engines.vllm` -- the vLLM scheduler, routing tap and backend (``vllm`` extra).

Engines are selected by name: :func:`make_backend` (``"hf"``, ``"vllm"``; the table
:data:`BACKENDS`). Adding an engine (e.g. SGLang) means adding one folder here with a ``make``
factory returning a ``RoundBackend``, and one entry in :data:`BACKENDS`. Engines never import the
environments (:mod:`specenv.envs`); the live environment drives them through this interface.
"""

from specenv.engines.base import BACKENDS, BackendConfig, RoundBackend, RoundResult, make_backend

__all__ = ["BACKENDS", "BackendConfig", "RoundBackend", "RoundResult", "make_backend"]
