"""The shipped live-vllm-t07 set (vLLM at T = 0.7 on small-moe-v1): sampled; it backs every env, the oracle, the bench.

Expectations come from the set's own recorded columns (rho, q, the sampled chains), not from the code
under test; that rho = min(1, p/q) of the two models is tested against transformers in
``tests/vllm/test_vllm_collect_sampled.py``.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import oracle
import specenv  # noqa: F401  (registers the environments)
from specenv.cost.source import cost_model_for
from specenv.envs.registration import REPLAY_ID, SEQ_ID
from specenv.traces.datasets import load_dataset
from specenv.traces.schema import q_columns, rho_columns
from specenv.traces.splits import select_split

NAME = "live-vllm-t07"


@pytest.fixture(scope="module")
def ts():
    return load_dataset(NAME)


def test_the_set_is_sampled_at_T(ts) -> None:
    m = ts.manifest
    assert m.greedy is False and m.source == "vllm"
    assert m.extra["temperature"] == 0.7 and m.extra["seed"] == 0
    rho = ts.positions[rho_columns(m.kmax)].to_numpy(np.float64)
    q = ts.positions[q_columns(m.kmax)].to_numpy(np.float64)
    assert ((rho > 0.01) & (rho < 0.99)).mean() > 0.1  # probabilities, not verdicts
    assert (q > 0).all()
    # rho = min(1, p/q) <= 1/q: a drafted token is never accepted more surely than its draft was sure
    assert np.all(rho * q <= 1.0 + 1e-6)
    chains = ts.positions[[f"draft_{j}" for j in range(1, m.kmax + 1)]].to_numpy()
    assert chains.dtype.kind == "i" and chains.min() >= 0 and chains.max() < m.vocab_size
    assert m.extra["ar_reference"]["mismatches"] == 0  # the plain engine sampled y with the same seed
    assert sorted(np.unique(ts.rounds["K"])) == list(range(m.kmax + 1))


@pytest.mark.parametrize("env_id, kwargs", [(REPLAY_ID, {}), (REPLAY_ID, {"lookahead": 3}), (SEQ_ID, {})])
def test_every_env_runs_on_the_set(env_id: str, kwargs: dict) -> None:
    env = gym.make(env_id, dataset=NAME, split="test", **kwargs)
    check_env(env.unwrapped, skip_render_check=True)
    env.reset(seed=0)
    done, steps = False, 0
    while not done and steps < 10_000:
        _, reward, term, trunc, _ = env.step(env.action_space.sample())
        assert np.isfinite(reward)
        done, steps = term or trunc, steps + 1
    assert done
    env.close()


def test_oracle_bounds_every_fixed_k(ts) -> None:
    arr = select_split(ts.arrays(), "test")
    assert not arr.greedy
    cm = cost_model_for(ts, "fit-train")
    best = oracle.solve(arr, cm)
    fixed = [oracle.evaluate_policy(arr, cm, k) for k in range(ts.kmax + 1)]
    assert np.all(best.cost <= np.min([f.cost for f in fixed], axis=0) * (1 + 1e-12))
    # stochastic acceptance: the bound's expected accepted drafts per round is not a whole number
    assert 0 < best.mean_accepted and best.mean_accepted != round(best.mean_accepted)


def test_bench_runs_on_the_set(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from specenv.cli import app

    res = CliRunner().invoke(
        app, ["bench", NAME, "--episodes", "1", "--only", "fixed k", "--out", str(tmp_path / "b"), "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["oracle"] and any(r["policy"] == "fixed k=1" for r in doc["policies"])
