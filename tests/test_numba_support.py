"""specenv.numba_support: one import of numba, the SPECENV_NUMBA switch, llvmlite guarded for vLLM's module scan."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specenv import numba_support

pytest.importorskip("numba")

# vLLM 0.32's vllm.triton_utils.dispatcher._rebind_kernels, the part that met llvmlite: every attribute of
# every loaded module that has a __dict__ is read with vars(value).get("kernel")
SCAN = """
import sys
for module in list(sys.modules.values()):
    namespace = getattr(module, "__dict__", None)
    if not namespace:
        continue
    for attr, value in list(namespace.items()):
        if hasattr(value, "__dict__"):
            vars(value).get("kernel")
print("scan ok")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_numba_alone_breaks_the_scan_this_guard_is_for():
    # the premise: without the guard, llvmlite's ffi wrapper hands out a non-dict for __dict__
    out = _run("import numba\n" + SCAN)
    assert out.returncode != 0 and "'_lib_fn_wrapper' object has no attribute 'get'" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "importer",
    [
        "from specenv.numba_support import numba_module; assert numba_module() is not None",
        "import oracle.kernels",
        "from specenv.envs.vector_kernel import kernels; assert kernels() is not None",
        "import numba\nfrom specenv.engines.vllm.settings import engine_kwargs; engine_kwargs(tap=False)",
    ],
    ids=["numba_module", "oracle-kernels", "vector-kernel", "engine_kwargs-after-user-import"],
)
def test_every_way_specenv_loads_numba_leaves_the_scan_passing(importer):
    out = _run(importer + "\n" + SCAN)
    assert out.returncode == 0 and "scan ok" in out.stdout, out.stderr[-2000:]


def test_guarded_llvmlite_still_works():
    # llvmlite asks its wrapper for LLVMPY_* functions only: compiling and running a kernel still works
    out = _run(
        "from specenv.numba_support import numba_module\n"
        "nb = numba_module()\n"
        "f = nb.njit(lambda x: x * 2 + 1)\n"
        "assert f(20) == 41\n"
        "import llvmlite.binding.ffi as ffi\n"
        "assert not hasattr(ffi.lib, '__dict__') and callable(ffi.lib.LLVMPY_GetProcessTriple)\n"
        "print('ok')"
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_switch_off(monkeypatch):
    monkeypatch.setenv(numba_support.ENV, "0")
    assert numba_support.numba_module() is None and not numba_support.enabled()
    monkeypatch.setenv(numba_support.ENV, "1")
    assert numba_support.enabled()
