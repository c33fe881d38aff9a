"""Engines that execute real speculative-decoding rounds, behind one round-backend interface.

* :mod:`specenv.engines.base` -- the :class:`~specenv.engines.base.RoundBackend` protocol,
  :class:`~specenv.engines.base.RoundResult` and the expert statistics of a verification pass;
* :mod:`specenv.engines.recorder` -- the engine-agnostic recorder of the ``rounds`` table (atomic
  Parquet parts) and its reader;
* :mod:`specenv.engines.hf` -- the transformers engine on the shipped small models (``live`` extra);
* :mod:`specenv.engines.vllm` -- the vLLM scheduler, routing tap and backend (``vllm`` extra).

Adding an engine (e.g. SGLang) means adding one folder here that implements ``RoundBackend``.
"""
