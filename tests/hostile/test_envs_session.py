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
from specenv.batchcost import load_batch_cost_model


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
