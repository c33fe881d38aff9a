"""The vector env's compiled step (numba) against its numpy path: the same bits, the same state, the same errors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from specenv.envs import vector_kernel
from specenv.envs.vector import MoESpecVectorEnv

numba = pytest.importorskip("numba")  # a dependency; without it the numpy path is all there is


def _pair(monkeypatch, **kwargs) -> tuple[MoESpecVectorEnv, MoESpecVectorEnv]:
    """(compiled, numpy) vector envs with the same arguments."""
    fast = MoESpecVectorEnv(**kwargs)
    monkeypatch.setenv("SPECENV_NUMBA", "0")
    ref = MoESpecVectorEnv(**kwargs)
    monkeypatch.delenv("SPECENV_NUMBA")
    assert fast._kernels is not None and ref._kernels is None
    return fast, ref


def _same(x, y, what):
    assert type(x) is type(y), what
    if isinstance(x, np.ndarray):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), what
    else:
        assert x == y, what


def _state(env: MoESpecVectorEnv) -> list[np.ndarray]:
    s = env._obs_state
    return [env._t, env._u_pos, env._ep_cost, env._gen, env._row0, env._N, env._L0, env._N1, s._P, s._E]


CASES = [
    ("small_traces", {"split": "all", "lookahead": 2}, False),
    ("small_traces", {"split": "all", "kmax": 4, "cost_model": "profile", "reward": "cost"}, True),
    ("small_greedy_traces", {"split": "all", "render_mode": "ansi"}, True),
    (None, {"split": "test", "lookahead": 3, "drafting": "sequential", "signals": ("q", "ent", "margin")}, True),
]


@pytest.mark.parametrize("fixture, kwargs, clip", CASES)
def test_compiled_step_equals_numpy_step(request, monkeypatch, fixture, kwargs, clip):
    """Every output and every piece of state, bit for bit, across autoresets and masked resets (clip on and off)."""
    if fixture is not None:
        kwargs = {"dataset": str(request.getfixturevalue(fixture)), **kwargs}
    n = 7
    fast, ref = _pair(monkeypatch, num_envs=n, **kwargs)
    fast._obs_state.clip = ref._obs_state.clip = clip or not ref.data.within_box
    rng = np.random.default_rng(4)
    (oa, ia), (ob, ib) = fast.reset(seed=9), ref.reset(seed=9)
    _same(oa, ob, "reset")
    assert ia.keys() == ib.keys() and all(np.array_equal(ia[key], ib[key]) for key in ia)
    ends = 0
    for step in range(700):
        if step % 150 == 149:
            mask = rng.random(n) < 0.4
            a, b = fast.reset(options={"reset_mask": mask}), ref.reset(options={"reset_mask": mask})
            _same(a[0], b[0], ("masked reset obs", step))
            assert a[1].keys() == b[1].keys()
            for key in a[1]:
                _same(a[1][key], b[1][key], ("masked reset info", step, key))
        actions = rng.integers(0, fast.kmax + 1, n).astype(rng.choice([np.int64, np.int32, np.uint8]))
        got, want = fast.step(actions), ref.step(actions)
        for name, x, y in zip(("obs", "reward", "terminated", "truncated"), got[:4], want[:4], strict=True):
            _same(x, y, (step, name))
        assert list(got[4]) == list(want[4]), step  # the same keys in the same order
        for key in want[4]:
            _same(got[4][key], want[4][key], (step, key))
        for i, (x, y) in enumerate(zip(_state(fast), _state(ref), strict=True)):
            _same(x, y, (step, "state", i))
        if fast.render_mode == "ansi":
            assert fast.render() == ref.render(), step
        ends += int(want[2].sum())
    assert ends >= n  # episodes ended (and autoreset) along the way


def test_out_of_range_actions_change_nothing(small_traces, monkeypatch):
    fast, ref = _pair(monkeypatch, num_envs=3, dataset=str(small_traces), split="all")
    for env in (fast, ref):
        env.reset(seed=0)
        env.step(np.array([1, 2, 3]))
    before = [x.copy() for x in _state(fast)]
    for bad in (np.array([0, 7, 1]), np.array([-1, 0, 0])):
        for env in (fast, ref):
            with pytest.raises(ValueError, match=r"actions: out of range 0\.\.6"):
                env.step(bad)
    for x, y in zip(before, _state(fast), strict=True):
        _same(x, y, "state after a refused step")
    _same(fast.step(np.array([4, 4, 4]))[0], ref.step(np.array([4, 4, 4]))[0], "the next step")


def test_switch_and_lazy_import(monkeypatch):
    """SPECENV_NUMBA=0 selects the numpy path; ``import specenv`` and ``gymnasium.make`` never load numba."""
    monkeypatch.setenv("SPECENV_NUMBA", "0")
    assert vector_kernel.kernels() is None
    monkeypatch.delenv("SPECENV_NUMBA")
    rk, bk = vector_kernel.kernels()
    assert rk.py_func is vector_kernel.round_and_update and bk.py_func is vector_kernel.build
    code = (
        "import sys, gymnasium, specenv; env = gymnasium.make('specenv/MoESpec-v1', split='test'); env.reset(seed=0); "
        "env.step(3); print('numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert out.stdout.strip() == "False"


def test_kernels_are_cached_on_disk():
    """``cache=True``: the compiled code is written to numba's cache (a new process loads it, not recompiles)."""
    MoESpecVectorEnv(num_envs=2, split="test")  # compiles (or loads) both
    rk, bk = vector_kernel.kernels()
    for fn in (rk, bk):
        assert fn.signatures, fn  # compiled by some env above (or now)
        assert fn._cache._cache_path and any(
            name.startswith(f"vector_kernel.{fn.py_func.__name__}") for name in os.listdir(fn._cache._cache_path)
        )
