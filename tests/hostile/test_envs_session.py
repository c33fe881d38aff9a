"""Hostile ``reset(options=...)``, seeds and cost files of the session's environments.

``options`` is a dict in Gymnasium's API: anything else was read as a list of keys (``"x"`` became
the unknown key ``'x'``, ``[]`` was accepted); a uint64 request seed above 2**63-1 wrapped to a
negative int64 and failed inside numpy with a message naming nothing; an unknown batch-cost name
was reported as a path inside the installed package.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import specenv  # noqa: F401  (registers the environments)
from specenv.cost.batch import load_batch_cost_model


@pytest.mark.parametrize(
    ("env_id", "kwargs", "key"),
    [
        ("specenv/MoESpec-v1", {"dataset": "live-vllm"}, "generation_id"),
        ("specenv/MoESpecCap-v0", {}, "generation_id"),
        ("specenv/MoESpecBatch-v0", {"dataset": "live-vllm", "batch_size": 2}, "seeds"),
    ],
)
@pytest.mark.parametrize("options", [[1], "generation_id", ("seeds",), []])
def test_reset_options_must_be_a_dict(env_id, kwargs, key, options):
    env = gym.make(env_id, **kwargs)
    with pytest.raises(ValueError, match=rf"options=.*must be a dict \(supported key: '{key}'\)"):
        env.reset(seed=0, options=options)
    obs, _ = env.reset(seed=0, options={})  # an empty dict is no option, as before
    assert env.observation_space.contains(obs)


def test_batch_request_seeds_beyond_int64_are_refused_by_name():
    env = gym.make("specenv/MoESpecBatch-v0", dataset="live-vllm", batch_size=2)
    n = env.unwrapped.R
    for bad in (np.full(n, 2**63, np.uint64), [2**64 - 1] * n):
        with pytest.raises(ValueError, match=r"options\['seeds'\]: expected .* integers in 0\.\.2\*\*63-1"):
            env.reset(seed=0, options={"seeds": bad})
    top = np.full(n, 2**63 - 1, np.uint64)  # the largest seed still plays
    _, info = env.reset(seed=0, options={"seeds": top})
    assert info["seeds"] == [2**63 - 1] * n


def test_unknown_batch_cost_name_names_what_was_given():
    with pytest.raises(ValueError, match=r"^no-such-fit: no such file or folder, nor a shipped recording"):
        load_batch_cost_model("no-such-fit")
    with pytest.raises(ValueError, match=r"batch_cost='no-such-fit': no-such-fit: no such file"):
        gym.make("specenv/MoESpecBatch-v0", dataset="live-vllm", batch_size=2, batch_cost="no-such-fit")


def _all_pairs_splits(model, B, K, full):  # noqa: ANN001, ANN202
    """The enumeration before the hull filter: every pair of steps' constraints (the reference)."""
    from oracle.batch.split import _step_intercepts

    n, P, g = _step_intercepts(model, B, K, full)
    i, j = np.triu_indices(len(n), k=1)
    det = n[i] * P[j] - n[j] * P[i]
    keep = det != 0
    i, j, det = i[keep], j[keep], det[keep]
    a = (g[i] * P[j] - g[j] * P[i]) / det
    b = (n[i] * g[j] - n[j] * g[i]) / det
    slack = np.max(n[None, :] * a[:, None] + P[None, :] * b[:, None] - g[None, :], axis=1)
    feas = slack <= 1e-9 * (1.0 + np.abs(g).max())
    a, b, slack = a[feas], b[feas], slack[feas]
    a = a - np.maximum(slack, 0.0)
    out = []
    for m in np.linspace(1.0, K + 1.0, 4 * (K + 1) + 1):
        best = int(np.argmax(a + b * m))
        if (float(a[best]), float(b[best])) not in out:
            out.append((float(a[best]), float(b[best])))
    return out


def test_intercept_splits_equal_all_pairs_and_run_at_batch_64():
    """``bench --batch 64`` died after minutes asking numpy for 7 TiB (every pair x every step).

    Only points near the lower hull can form a vertex: the splits are the same as the all-pairs
    enumeration's, and B = 64 is computed in seconds.
    """
    from oracle.batch import intercept_splits
    from specenv.cost.batch import BatchCostModel
    from specenv.cost.model import CostModel
    from specenv.traces.schema import ModelFacts

    shipped = load_batch_cost_model()
    for B in range(1, 9):
        for full in (False, True):
            assert intercept_splits(shipped, B, 8, full) == _all_pairs_splits(shipped, B, 8, full), (B, full)
    big = BatchCostModel.from_cost_model(CostModel.paper_profile(6), ModelFacts(48, 128, 8), max_batch=64)
    for B in (5, 12):
        assert intercept_splits(big, B, 6) == _all_pairs_splits(big, B, 6, False), B
    splits = intercept_splits(big, 64, 6)
    assert splits and all(np.isfinite(s).all() for s in splits)


@pytest.mark.parametrize("n", [10**8, 2**20 + 1, 0, -3])
def test_vector_env_size_is_bounded_before_allocation(n: int) -> None:
    """``make_vec(num_envs=10**8)`` allocated 22 GB with no exception: now one line, under 1 GiB of address space."""
    from tests.hostile.harness import run_python_limited

    code = (
        "import gymnasium as gym, specenv\n"
        "try:\n"
        f"    gym.make_vec('specenv/MoESpec-v1', num_envs={n}, vectorization_mode='vector_entry_point',"
        " dataset='paper-default', split='test')\n"
        "except ValueError as e:\n"
        "    print('REFUSED', e)\n"
    )
    out = run_python_limited(code, memory_bytes=3 << 30, seconds=120)
    assert out.exit_code == 0 and "REFUSED" in out.stdout, out.stderr[-800:]
    assert f"num_envs={n}" in out.stdout and "1..1048576" in out.stdout
