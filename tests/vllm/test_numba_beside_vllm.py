"""vLLM's CPU worker start after specenv's compiled kernels loaded numba in the same process.

vLLM's ``_rebind_kernels`` (run by ``register_triton_kernel_overrides`` in every worker's start) scans
every loaded module; with numba's llvmlite loaded and unguarded it died on llvmlite's ffi wrapper
(:mod:`specenv.numba_support`). The scan itself runs here, in a fresh interpreter per case.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm.triton_utils.dispatcher")
pytest.importorskip("numba")

REBIND = "from vllm.triton_utils.dispatcher import _rebind_kernels\n_rebind_kernels([])\nprint('rebind ok')\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_vllms_rebind_fails_on_bare_numba():
    out = _run("import numba\n" + REBIND)  # the premise of the guard: vLLM's own scan meets llvmlite
    assert out.returncode != 0 and "_lib_fn_wrapper" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize(
    "importer", ["import oracle.kernels", "from specenv.envs.vector_kernel import kernels; kernels()"]
)
def test_vllms_rebind_passes_after_specenv_loaded_numba(importer):
    out = _run(importer + "\n" + REBIND)
    assert out.returncode == 0 and "rebind ok" in out.stdout, out.stderr[-2000:]
