"""How far the batch bound can be from the joint optimum: the bound beside feasible clairvoyant batch policies.

The joint optimum of a batch episode is not computable at B = 4 or 8, but every policy that runs in
the environment is feasible, so its speedup is a lower end for the optimum's. On a greedy trace set
(rho in {0, 1}) a controller that knows each request's accepted drafts (read from the replay state:
clairvoyant on purpose, no real controller can) is a strong feasible policy. This script runs, on the
episodes of ``specenv bench --batch B`` (test split, episode e reset with seed e):

* per request: k* of the bound's full-batch charge (:func:`oracle.batch.lagrangian_costs`) and of
  :class:`oracle.batch.FairShare`, the position's own optimum under those charges;
* coordinated (greedy sets): every step a common cap c, ``k_i = min(accepted_i, c)``, with c
  maximising the step's committed tokens (+ ``bias``) per ms of the step;

and prints their pooled speedups beside the bound's (both methods). The optimum lies between the best
feasible speedup and the bound.

Usage::

    python scripts/batch_bound_gap.py live-vllm 4
"""

from __future__ import annotations

import argparse

import numpy as np

from oracle.batch import FairShare, batch_bound, lagrangian_costs
from oracle.dp import solve
from specenv.envs.batch import MoESpecBatchEnv
from specenv.replay.batch import request_draws
from specenv.replay.tables import select_positions
from specenv.traces.datasets import load_dataset


def _run(env: MoESpecBatchEnv, seeds: list[int], choose) -> float:
    """Pooled speedup of a rule ``choose(rows, left) -> k`` over the active slots' table rows."""
    ar = cost = 0.0
    for s in seeds:
        env.reset(seed=s)
        done = False
        info: dict = {}
        while not done:
            act = np.zeros(env.B, dtype=np.int64)
            rows = env.rows()
            idx = np.flatnonzero(rows >= 0)
            act[idx] = choose(rows[idx], env.remaining()[idx])
            _, _, done, _, info = env.step(act)
        ar += info["ar_cost_ms"]
        cost += info["episode_cost_ms"]
    return ar / cost


def main() -> None:
    """Command line: dataset, B, episodes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dataset")
    ap.add_argument("batch_size", type=int)
    ap.add_argument("--episodes", type=int, default=8)
    args = ap.parse_args()
    B = args.batch_size
    env = MoESpecBatchEnv(args.dataset, batch_size=B, split="test", cost_model="fit-train")
    arrays = select_positions(load_dataset(args.dataset), env.kmax, "test")
    seeds = list(range(args.episodes))
    req = np.array([env.reset(seed=s)[1]["seeds"] for s in seeds])
    gens = np.vectorize(lambda s: request_draws(int(s), arrays.lengths)[0])(req)
    _, full, _ = lagrangian_costs(arrays, env.batch_cost, B, gens)
    out: dict[str, float] = {}
    for name, charge in (("k* of the bound's charge", full), ("k* of the fair share", FairShare(env.batch_cost, B))):
        kk = solve(arrays, charge).k
        out[name] = _run(env, seeds, lambda rows, left, kk=kk: kk[rows])
    if arrays.greedy:
        acc = np.cumprod(arrays.survival() >= 1.0, axis=1).sum(axis=1)
        m = env.batch_cost
        for bias in (0.0, 0.5, 1.0):

            def coordinated(rows, left, bias=bias):
                rates = []
                for c in range(env.kmax + 1):
                    k = np.minimum(acc[rows], c)
                    step = m.step_ms(k, k, arrays.U[rows, k], arrays.L[rows])
                    rates.append((np.minimum(k + 1, left).sum() + bias) / step)
                return np.minimum(acc[rows], int(np.argmax(rates)))

            out[f"coordinated clairvoyant cap (bias {bias})"] = _run(env, seeds, coordinated)
    for method in ("linear", "lagrangian"):
        bb = batch_bound(arrays, env.data.L0, env.batch_cost, B, req, pathwise=False, method=method)
        out[f"bound ({method})"] = bb.summary()["speedup_pooled_expected"]
    for name, v in out.items():
        print(f"{args.dataset} B={B}: {name}: {v:.3f}")


if __name__ == "__main__":
    main()
