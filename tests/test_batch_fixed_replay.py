"""Fixed-budget batch episodes without stepping (specenv.replay.batch.FixedBudgetEpisodes) and every budget at once.

The expectations come from stepping ``specenv/MoESpecBatch-v0`` itself with the same budget in every
slot: the closed form must give the environment's own figures, bit for bit (the dynamic-SD table of
``specenv bench --batch B`` is fitted on them).
"""

from __future__ import annotations

import numpy as np
import pytest

from specenv.envs.batch import MoESpecBatchEnv
from specenv.replay.batch import FixedBudgetEpisodes, allocate_budget, allocate_budgets


def _stepped(env: MoESpecBatchEnv, k: int, seed: int) -> tuple[float, float, int, list[int]]:
    _, info = env.reset(seed=seed)
    seeds = info["seeds"]
    done = False
    while not done:
        _, _, done, _, info = env.step(np.full(env.B, k, dtype=np.int64))
    return info["episode_cost_ms"], info["ar_cost_ms"], info["steps"], seeds


@pytest.mark.parametrize(
    ("B", "R", "drafting", "lookahead"),
    [(1, 3, None, None), (3, 7, None, None), (4, None, None, None), (2, 5, "block", 2), (5, 2, None, None)],
)
def test_fixed_budget_episodes_are_the_environments(small_traces, B, R, drafting, lookahead):
    env = MoESpecBatchEnv(
        str(small_traces), batch_size=B, n_requests=R, split="train", drafting=drafting, lookahead=lookahead
    )
    fixed = FixedBudgetEpisodes(env.data)
    for k in sorted({0, 1, 3, env.kmax}):
        for seed in (0, 11) if k == 1 else (7,):
            cost, ar, steps, seeds = _stepped(env, k, seed)
            got = fixed.episode(env.batch_cost, env.B, seeds, k, env.lookahead, env.drafting)
            assert got == (cost, steps), (k, seed)  # exact: the same operations on the same numbers
            assert fixed.ar_ms(env.batch_cost, env.B, seeds) == ar


def test_rounds_are_shared_across_batch_sizes(small_traces):
    """The cache is keyed by request seed: an episode of B = 3 after one of B = 2 reuses its requests."""
    env2 = MoESpecBatchEnv(str(small_traces), batch_size=2, split="train")
    env3 = MoESpecBatchEnv(str(small_traces), batch_size=3, split="train")
    fixed = FixedBudgetEpisodes(env2.data)
    s2 = env2.reset(seed=4)[1]["seeds"]
    s3 = env3.reset(seed=4)[1]["seeds"]
    fixed.prepare(s2 + s3, 2)
    cost3, ar3, steps3, _ = _stepped(env3, 2, 4)
    cost2, _, steps2, _ = _stepped(env2, 2, 4)
    assert fixed.episode(env3.batch_cost, 3, s3, 2) == (cost3, steps3)
    assert fixed.ar_ms(env3.batch_cost, 3, s3) == ar3
    assert fixed.episode(env2.batch_cost, 2, s2, 2) == (cost2, steps2)


def test_allocate_budgets_is_allocate_budget_of_every_budget():
    rng = np.random.default_rng(0)
    for trial in range(30):
        B, h = int(rng.integers(1, 7)), int(rng.integers(1, 5))
        scores = rng.choice([0.1, 0.5, 0.5, 0.9], size=(B, h)) if trial % 2 else rng.random((B, h))  # ties too
        if trial % 3 == 0:
            scores[rng.integers(B)] = -np.inf  # an idle slot
        if trial % 5 == 0:
            scores.flat[rng.integers(B * h)] = np.nan
        want = np.stack([allocate_budget(scores, b) for b in range(B * h + 1)])
        np.testing.assert_array_equal(allocate_budgets(scores), want)
