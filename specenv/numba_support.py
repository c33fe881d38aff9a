"""numba as specenv uses it: imported on first use, off with ``SPECENV_NUMBA=0``, safe beside vLLM.

:func:`numba_module` is the one import of numba for the compiled kernels (:mod:`oracle.kernels`,
:mod:`specenv.envs.vector_kernel`): None when numba is missing or ``SPECENV_NUMBA=0`` (the numpy
forms run then).

**Beside vLLM.** vLLM 0.32's CPU worker (``register_triton_kernel_overrides`` ->
``vllm.triton_utils.dispatcher._rebind_kernels``) scans every attribute of every loaded module and
calls ``vars(value).get(...)`` on each that has a ``__dict__``. llvmlite's ``llvmlite.binding.ffi.lib``
(loaded with numba) answers *any* attribute through ``__getattr__`` -- ``__dict__`` included, as a
wrapped ctypes function -- so an engine built in a process that had imported numba died in its
worker's start with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``.
:func:`guard_llvmlite` makes that wrapper refuse dunder names (AttributeError, as ctypes' own
``CDLL.__getattr__`` does), so the scan passes it by; llvmlite itself only ever asks it for its
``LLVMPY_*`` functions. Applied whenever specenv imports numba and before specenv builds an engine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

ENV = "SPECENV_NUMBA"


def enabled() -> bool:
    """False when ``SPECENV_NUMBA=0`` (the numpy forms run everywhere)."""
    return os.environ.get(ENV, "1") != "0"


def numba_module() -> Any:
    """numba, imported (and llvmlite guarded), or None: missing, or ``SPECENV_NUMBA=0``."""
    if not enabled():
        return None
    try:
        import numba
    except ImportError:
        return None
    guard_llvmlite()
    return numba


_COMPILED: dict[str, Any] = {}


def compile_once(name: str, make: Callable[[Any], Any]) -> Any:
    """``make(numba)``, built once per process and kept under ``name``; None without numba or with ``SPECENV_NUMBA=0``.

    The one lazy entry of specenv's compiled kernels (:mod:`specenv.envs.vector_kernel`,
    :mod:`specenv.engines.kernels`): numba is imported on the first call only, and ``SPECENV_NUMBA=0``
    is read at every call (the numpy forms run then, whatever was built before).
    """
    if not enabled():
        return None
    if name not in _COMPILED:
        numba = numba_module()
        _COMPILED[name] = False if numba is None else make(numba)
    return _COMPILED[name] or None


def guard_llvmlite() -> bool:
    """Make llvmlite's ``ffi.lib`` wrapper refuse dunder attributes (module docstring); True if applied.

    A no-op when llvmlite is not loaded (nothing to guard) or already guarded.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None) if ffi is not None else None
    if lib is None:
        return False
    cls = type(lib)
    if getattr(cls, "_specenv_dunder_guard", False):
        return True
    original = cls.__getattr__

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    cls.__getattr__ = __getattr__
    cls._specenv_dunder_guard = True
    return True
