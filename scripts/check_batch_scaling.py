"""How well the scaled batch model (BatchCostModel.from_cost_model) prices the recorded vLLM batch steps.

Prices every step of a steps recording (default the shipped ``live-vllm-batch-v1``) three ways and
prints, per batch size B, the median ratio of predicted to measured step time (target + draft, the
recording's CPU times by default):

* ``fit``: the batch model fitted on the recording itself (``batchcost.json``);
* ``scaled``: the B = 1 cost model of a trace set (default ``live-vllm``, fitted on its rounds table)
  scaled to batches by :meth:`specenv.cost.batch.BatchCostModel.from_cost_model` with the shipped
  shape factors; its absolute level is the B = 1 recording's (another run, another load), so the
  script also prints its MAPE after one level factor (the median ratio at B = 1). A ratio that stays
  flat over B means the batch shape carries over.

The shape factors are measured on the same recording, so this checks the scaling rule in sample.

    python scripts/check_batch_scaling.py [--recording live-vllm-batch-v1] [--traces live-vllm] [--timing cpu]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recording", default="live-vllm-batch-v1")
    ap.add_argument("--traces", default="live-vllm", help="trace set whose B = 1 fit is scaled")
    ap.add_argument("--timing", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args(argv)

    from specenv.cost.batch import BatchCostModel, load_batch_cost_model
    from specenv.cost.batchfit import TIMINGS, load_steps
    from specenv.cost.source import cost_model_for
    from specenv.traces.datasets import load_dataset

    try:
        steps, _ = load_steps(args.recording)
        fitted = load_batch_cost_model(args.recording)
        ts = load_dataset(args.traces)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    context = float(np.mean(np.concatenate([np.asarray(x, float) for x in steps["L"]])))
    scaled = BatchCostModel.from_cost_model(
        cost_model_for(ts, "fit"), ts.facts, max_batch=fitted.max_batch, context_ref=context
    )

    def price(m: BatchCostModel) -> np.ndarray:
        return np.array(
            [
                m.step_ms(np.asarray(r.k), np.full(r.B, r.drafted), np.asarray(r.U), np.asarray(r.L))
                for r in steps.itertuples()
            ]
        )

    col_t, col_d = TIMINGS[args.timing]
    y = (steps[col_t] + steps[col_d]).to_numpy(np.float64)
    p_fit, p_scaled = price(fitted), price(scaled)
    B = steps["B"].to_numpy()
    level = float(np.median(p_scaled[B == 1] / y[B == 1]))
    mape = lambda p: 100.0 * float(np.mean(np.abs(p - y) / y))  # noqa: E731
    print(f"{args.recording}: {len(steps)} steps, {args.timing} times; scaled from {args.traces}'s B = 1 fit")
    print(f"{'B':>2} {'steps':>6} {'fit/meas':>9} {'scaled/meas':>12}")
    for b in sorted(set(B)):
        s = B == b
        print(f"{b:>2} {int(s.sum()):>6} {np.median(p_fit[s] / y[s]):>9.3f} {np.median(p_scaled[s] / y[s]):>12.3f}")
    print(
        f"MAPE: fit {mape(p_fit):.1f}%, scaled {mape(p_scaled):.1f}%, "
        f"scaled after the B = 1 level factor {level:.3f}: {mape(p_scaled / level):.1f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
