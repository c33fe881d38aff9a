"""The ceiling of the learned-survival batch controller: its planner fed the *true* survival.

:class:`policies.batch.learn.SurvivalGoodputBatch` plans every step's budgets from estimated
survivals ``P(a >= j)``. This diagnostic gives the same planner the positions table's exact survival
of every active request's current position (clairvoyant: no policy can see it) and prints its pooled
speedup on the bench's held-out episodes (test split, episode e reset with ``seed + e``) beside
fixed k, so the gap between the learned row and this ceiling is the part the survival estimate
loses. Mode ``none``; U from the train-mean ``U(k)``, as the learner.

    python scripts/batch_survival_ceiling.py [--traces live-vllm] [--batch 4] [--episodes 8]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="live-vllm")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from policies.batch.controllers import FixedBatch
    from policies.batch.learn import SurvivalGoodputBatch
    from policies.bench.batch import _episodes
    from specenv.envs.batch import MoESpecBatchEnv
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    try:
        env = MoESpecBatchEnv(args.traces, args.batch, split="test", cost_model="fit-train")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    K = env.kmax
    u_prior = select_positions(load_dataset(args.traces), K, "train").U.mean(axis=0)

    class TrueSurvival:
        """Reads the environment's current rows (the active slots in slot order, as the planner asks)."""

        def predict(self, x: np.ndarray) -> np.ndarray:
            rows = env.rows()
            return env.data.survival[rows[rows >= 0], :K]

    seeds = [args.seed + e for e in range(args.episodes)]

    def speedup(pol) -> float:
        res = _episodes(env, pol, seeds)
        return float(res["ar"].sum() / res["cost"].sum())

    ceiling = speedup(SurvivalGoodputBatch(env.spec_batch, env.batch_cost, u_prior, TrueSurvival()))
    fixed = {k: speedup(FixedBatch(env.spec_batch, k)) for k in sorted({0, 1, min(4, K), K})}
    print(f"{args.traces} B={args.batch}, {args.episodes} test episodes: planner with the true survival {ceiling:.3f}")
    print("fixed k: " + ", ".join(f"k={k} {v:.3f}" for k, v in fixed.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
