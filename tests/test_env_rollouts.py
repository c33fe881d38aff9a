"""Recorded rollouts of the replay environments: every observation, reward, flag and info, bit for bit.

``tests/env_rollouts.npz`` holds, for each configuration of :data:`VECTOR_CASES` and
:data:`SINGLE_CASES` (shipped ``paper-default`` set), one 32-bit digest per step of each of the
step's outputs (:data:`FIELDS`): the observation, reward, terminated, truncated, the whole info dict
(every key, its mask, its dtype and Python type) and the render output. The digests were recorded
from the code *before* the speed work of issue 28 (main at eeb7668) with::

    PYTHONPATH=. python tests/test_env_rollouts.py --record

so a later optimisation of ``step`` / the observation builder that changes any bit (a float's
rounding, an info value at a masked-off entry, a dtype, a Python type) fails here, naming the case,
the step and the field. The vector cases run twice: as the env runs by default (its compiled step
when numba is installed, :mod:`specenv.envs.vector_kernel`) and on its numpy path. Re-record only
for an intended change of the environment's results.

The cases that run on the default cost model (``cost_model="fit"``) get the fit pinned:
``tests/env_rollouts_cost.json`` is that fit, saved when the digests were recorded, and those cases
run on it (``cost_model=<that file>``). The fit is an OLS solved by the installed LAPACK, whose last
bits move between numpy/OpenBLAS builds (the CI run after stop 31: those cases' rewards off in the
last bits, the code unchanged); the env's code is what this file pins bit for bit, so its input is pinned too, and
:func:`test_pinned_fit_is_todays_fit` checks the pinned fit against today's within the golden
figures' tolerance (``tests/golden.json``), so a real change of the fit still fails. The digests were
re-recorded with the pinned fit from the same pre-speed-work code (eeb7668, a worktree on
``PYTHONPATH``) and then reproduced by main.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import specenv  # noqa: F401  (registers the ids)
from specenv.envs.registration import REPLAY_ID
from specenv.envs.vector import MoESpecVectorEnv

FIXTURE = Path(__file__).with_name("env_rollouts.npz")
#: the default cost model's fit as it was when the digests were recorded (see the module docstring)
COST_FIXTURE = Path(__file__).with_name("env_rollouts_cost.json")
GOLDEN = Path(__file__).with_name("golden.json")
FIELDS = ("obs", "reward", "terminated", "truncated", "info", "render")

#: name -> (constructor kwargs, num_envs, steps, seed)
VECTOR_CASES: dict[str, tuple[dict[str, Any], int, int, int]] = {
    "vec_default": ({}, 16, 1200, 3),
    "vec_block_cost_test": (
        {"split": "test", "lookahead": 10, "drafting": "block", "reward": "cost"},
        8,
        800,
        11,
    ),
    "vec_seq_signals_ansi": (
        {
            "kmax": 6,
            "cost_model": "profile",
            "lookahead": 3,
            "drafting": "sequential",
            "signals": ["q", "ent", "margin"],
            "render_mode": "ansi",
        },
        6,
        700,
        5,
    ),
}
#: name -> (make kwargs, steps, seed)
SINGLE_CASES: dict[str, tuple[dict[str, Any], int, int]] = {
    "single_default": ({}, 3000, 7),
    "single_block_cost_test": ({"split": "test", "lookahead": 10, "drafting": "block", "reward": "cost"}, 2000, 2),
    "single_seq_signals_ansi": (
        {
            "kmax": 6,
            "cost_model": "profile",
            "lookahead": 3,
            "drafting": "sequential",
            "signals": ["q", "ent", "margin"],
            "render_mode": "ansi",
        },
        2000,
        4,
    ),
}


def _feed(h: Any, x: Any) -> None:
    """Hash a value with its type: arrays by dtype, shape and bytes (object arrays by repr)."""
    if isinstance(x, np.ndarray):
        h.update(f"nd:{x.dtype.str}:{x.shape}:".encode())
        h.update(repr(x.tolist()).encode() if x.dtype == object else np.ascontiguousarray(x).tobytes())
    elif isinstance(x, dict):
        h.update(b"dict:")
        for key in sorted(x):
            h.update(f"{key}=".encode())
            _feed(h, x[key])
            h.update(b";")
    elif isinstance(x, tuple | list):
        h.update(f"{type(x).__name__}:{len(x)}:".encode())
        for item in x:
            _feed(h, item)
    else:  # Python or numpy scalars, str, None: the type and the exact repr (floats round-trip)
        h.update(f"{type(x).__module__}.{type(x).__name__}:{x!r};".encode())


def _digest(x: Any) -> int:
    h = hashlib.blake2b(digest_size=4)
    _feed(h, x)
    return int.from_bytes(h.digest(), "little")


def _row(obs: Any, reward: Any, terminated: Any, truncated: Any, info: Any, render: Any) -> list[int]:
    return [_digest(v) for v in (obs, reward, terminated, truncated, info, render)]


def _kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A case's constructor keywords, the default cost model replaced by its pinned fit."""
    kw = dict(kwargs)
    if "signals" in kw:
        kw["signals"] = tuple(kw["signals"])
    kw.setdefault("cost_model", str(COST_FIXTURE))
    return kw


def vector_rollout(kwargs: dict[str, Any], n: int, steps: int, seed: int) -> np.ndarray:
    """(steps + 2, len(FIELDS)) digests: the reset, ``steps`` random steps, a masked reset at mid-way."""
    kw = _kwargs(kwargs)
    env = MoESpecVectorEnv(num_envs=n, **kw)
    obs, info = env.reset(seed=seed)
    rows = [_row(obs, None, None, None, info, env.render() if env.render_mode else None)]
    rng = np.random.default_rng(seed + 1000)
    for step in range(steps):
        if step == steps // 2:  # the SB3 adapter's path: reset some sub-environments now
            mask = rng.random(n) < 0.5
            mask[0] = True
            obs, info = env.reset(options={"reset_mask": mask})
            rows.append(_row(obs, None, None, None, info, env.render() if env.render_mode else None))
        actions = rng.integers(0, env.kmax + 1, n)
        obs, reward, terminated, truncated, info = env.step(actions)
        rows.append(_row(obs, reward, terminated, truncated, info, env.render() if env.render_mode else None))
    return np.array(rows, dtype=np.uint32)


def single_rollout(kwargs: dict[str, Any], steps: int, seed: int) -> np.ndarray:
    """(steps + resets, len(FIELDS)) digests of ``gymnasium.make`` (default wrappers), reset at each end."""
    kw = _kwargs(kwargs)
    env = gym.make(REPLAY_ID, **kw)
    render = env.unwrapped.render_mode is not None
    obs, info = env.reset(seed=seed)
    rows = [_row(obs, None, None, None, info, env.render() if render else None)]
    rng = np.random.default_rng(seed + 2000)
    kmax = env.unwrapped.kmax
    for _ in range(steps):
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(0, kmax + 1)))
        rows.append(_row(obs, reward, terminated, truncated, info, env.render() if render else None))
        if terminated:
            obs, info = env.reset()
            rows.append(_row(obs, None, None, None, info, env.render() if render else None))
    return np.array(rows, dtype=np.uint32)


def _rollout(name: str) -> np.ndarray:
    if name in VECTOR_CASES:
        return vector_rollout(*VECTOR_CASES[name])
    return single_rollout(*SINGLE_CASES[name])


def _cases_json() -> str:
    return json.dumps({"vector": VECTOR_CASES, "single": SINGLE_CASES}, sort_keys=True)


@pytest.fixture(scope="module")
def recorded() -> dict[str, np.ndarray]:
    with np.load(FIXTURE, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    # the cases must be the ones recorded (a changed case list would compare other rollouts)
    assert str(data.pop("cases")) == _cases_json()
    return data


@pytest.mark.parametrize(
    "name, numpy_only",
    [*((name, False) for name in [*VECTOR_CASES, *SINGLE_CASES]), *((name, True) for name in VECTOR_CASES)],
)
def test_rollout_matches_recording(recorded, monkeypatch, name, numpy_only):
    """Each case as recorded; the vector cases also on the vector env's numpy path (``SPECENV_NUMBA=0``)."""
    if numpy_only:
        monkeypatch.setenv("SPECENV_NUMBA", "0")
    want = recorded[name]
    got = _rollout(name)
    assert got.shape == want.shape, f"{name}: {got.shape[0]} rows, recorded {want.shape[0]}"
    bad = np.argwhere(got != want)
    if len(bad):
        row, col = bad[0]
        pytest.fail(f"{name}: row {row} (0 = the reset), field {FIELDS[col]!r} differs from the recording")


def test_recording_is_not_degenerate(recorded):
    """The recorded rollouts do reach terminations and autoresets (the digests of distinct steps differ)."""
    for name in VECTOR_CASES:
        obs = recorded[name][:, FIELDS.index("obs")]
        assert len(np.unique(obs)) == len(obs), name
    for name, (_, steps, _) in SINGLE_CASES.items():
        assert recorded[name].shape[0] > steps + 3, name  # at least 3 episodes ended (a reset row each)


def _todays_fit() -> Any:
    from specenv.cost.source import cost_model_for
    from specenv.traces.datasets import load_dataset

    return cost_model_for(load_dataset("paper-default"), "fit")


def test_pinned_fit_is_todays_fit():
    """The pinned cost model is today's default fit up to BLAS last bits (the golden figures' tolerance)."""
    from specenv.cost.model import CostModel

    rel = json.loads(GOLDEN.read_text())["rel_tolerance"]
    pinned, today = CostModel.load(COST_FIXTURE), _todays_fit()
    assert pinned.kmax == today.kmax and pinned.top_k == today.top_k
    for name in ("beta0", "alpha", "c"):
        np.testing.assert_allclose(getattr(pinned, name), getattr(today, name), rtol=rel, atol=0, err_msg=name)
    np.testing.assert_allclose([pinned.d1, pinned.d0], [today.d1, today.d0], rtol=rel, atol=0, err_msg="draft")


def record() -> None:
    _todays_fit().save(COST_FIXTURE)
    arrays = {name: _rollout(name) for name in [*VECTOR_CASES, *SINGLE_CASES]}
    np.savez_compressed(FIXTURE, cases=np.array(_cases_json()), **arrays)
    print(f"wrote {FIXTURE}: " + ", ".join(f"{k} {v.shape[0]}" for k, v in arrays.items()))


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_env_rollouts.py --record")
    record()
