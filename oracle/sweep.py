"""The oracle bound against the speculation budget Kmax (the seed paper's Figure 2)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from oracle.dp import evaluate_policy, solve
from specenv.cost.model import CostModel
from specenv.traces.traceset import PositionArrays

if TYPE_CHECKING:  # pandas loads only when a sweep table is built (it is off the import path)
    import pandas as pd

__all__ = ["SWEEP_COLUMNS", "MapCalls", "kmax_sweep", "plot_kmax_sweep", "sweep_fixed", "sweep_solve"]

#: Columns of :func:`kmax_sweep`'s table.
SWEEP_COLUMNS = (
    "kmax",
    "s_max_pooled",
    "s_max_mean",
    "mean_k",
    "mean_accepted",
    "expected_rounds",
    "best_fixed_k",
    "best_fixed_speedup",
)


#: ``map_calls([(function, args), ...]) -> [function(*args), ...]``: how the sweep's units run (in order).
MapCalls = Callable[[list[tuple[Callable[..., Any], tuple[Any, ...]]]], list[Any]]


def sweep_solve(arrays: PositionArrays, cost_model: CostModel, km: int, lookahead: int, drafting: str | None) -> dict:
    """One unit of the sweep: the oracle with budgets 0..``km`` (its row without the best fixed k)."""
    res = solve(arrays.with_kmax(km), cost_model, lookahead=lookahead, drafting=drafting)
    return {
        "kmax": km,
        "s_max_pooled": res.speedup_pooled,
        "s_max_mean": res.speedup_mean,
        "mean_k": res.mean_k,
        "mean_accepted": res.mean_accepted,
        "expected_rounds": float(res.rounds.sum()),
    }


def sweep_fixed(
    arrays: PositionArrays, cost_model: CostModel, km: int, k: int, lookahead: int, drafting: str | None
) -> float:
    """One unit of the sweep: the exact pooled speedup of fixed budget ``k`` on the positions cut to ``km``."""
    sub = arrays.with_kmax(km)
    return evaluate_policy(sub, cost_model, k, lookahead=lookahead, drafting=drafting).speedup_pooled


def kmax_sweep(
    arrays: PositionArrays,
    cost_model: CostModel,
    kmaxes: Iterable[int] | None = None,
    lookahead: int = 0,
    drafting: str | None = None,
    map_calls: MapCalls | None = None,
) -> pd.DataFrame:
    """Solve the oracle with budgets restricted to 0..Kmax for every Kmax.

    The sweep is a set of independent units (:func:`sweep_solve` per Kmax, :func:`sweep_fixed` per
    fixed budget k, evaluated on the positions cut to the first swept Kmax >= k), so ``map_calls`` may
    run them anywhere (``specenv oracle --ray``, :mod:`policies.distributed`) and the table is the same.

    Args:
        arrays: Positions table.
        cost_model: Cost model covering ``arrays.kmax``.
        kmaxes: Budgets to sweep (default 1..``arrays.kmax``).
        lookahead: Draft lookahead h (in mode ``"block"`` it is charged even where it exceeds Kmax).
        drafting: The drafting mode (as in :func:`oracle.dp.solve`).
        map_calls: Runs the units and returns their results in order (default: here, one after another).

    Returns:
        One row per Kmax with columns :data:`SWEEP_COLUMNS`: the pooled and mean S_max, the mean
        k* and mean accepted drafts per round on the optimal path (pooled over rounds), the
        expected number of rounds, and the best fixed budget k <= Kmax with its pooled speedup.
    """
    ks = list(range(1, arrays.kmax + 1)) if kmaxes is None else [int(k) for k in kmaxes]
    first_km: dict[int, int] = {}  # fixed budget k -> the first swept Kmax that allows it
    for km in ks:
        for k in range(km + 1):
            first_km.setdefault(k, km)
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (sweep_solve, (arrays, cost_model, km, lookahead, drafting)) for km in ks
    ]
    calls += [(sweep_fixed, (arrays, cost_model, km, k, lookahead, drafting)) for k, km in first_km.items()]
    results = map_calls(calls) if map_calls is not None else [f(*a) for f, a in calls]
    fixed = dict(zip(first_km, results[len(ks) :], strict=True))
    rows = []
    for km, row in zip(ks, results[: len(ks)], strict=True):
        best = max(range(km + 1), key=lambda k: fixed[k])
        rows.append(row | {"best_fixed_k": best, "best_fixed_speedup": fixed[best]})
    import pandas as pd

    return pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))


def plot_kmax_sweep(table: pd.DataFrame, path: str | BinaryIO, title: str = "") -> str:
    """Three titled panels against Kmax; writes ``path`` (a file name, or a binary stream: PNG).

    Left: the oracle's speedup bound S_max over autoregressive (AR, k = 0) decoding, pooled and mean
    over generations, beside the best fixed budget k <= Kmax. Middle: the mean budget k* the oracle
    picks per round. Right: the mean drafts it gets accepted per round. Kmax, the largest budget
    allowed, is a number of draft tokens.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = table["kmax"].to_numpy()
    xlabel = "Kmax: largest budget allowed (draft tokens per round)"
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.4))
    ax = axes[0]
    ax.plot(x, table["s_max_pooled"], "o-", label="oracle S_max (pooled)")
    ax.plot(x, table["s_max_mean"], "s--", ms=4, label="oracle S_max (mean over generations)")
    ax.plot(x, table["best_fixed_speedup"], "^:", label="best fixed k <= Kmax (pooled)")
    ax.set_ylabel("speedup over autoregressive decoding (x)\npooled: sum of AR cost / sum of policy cost", fontsize=9)
    ax.set_title("Speedup bound vs the speculation budget", fontsize=10)
    ax.legend(fontsize=7.5, loc="lower right")
    axes[1].plot(x, table["mean_k"], "o-", color="tab:green", label="oracle's mean k* per round")
    axes[1].plot(x, x, ":", color="0.6", label="k = Kmax (always the largest budget)")
    axes[1].set_ylabel("mean budget k* per round (draft tokens)")
    axes[1].set_title("Budget the oracle picks (mean k*)", fontsize=10)
    axes[1].legend(fontsize=7.5)
    axes[2].plot(x, table["mean_accepted"], "o-", color="tab:purple")
    axes[2].set_ylabel("mean accepted drafts per round (tokens)")
    axes[2].set_title("Drafts accepted on the optimal path", fontsize=10)
    for a in axes:
        a.set_xlabel(xlabel, fontsize=9)
        a.set_xticks(np.asarray(x))
        a.grid(alpha=0.3)
    fig.suptitle(
        "Exact SSP oracle against Kmax (AR = autoregressive decoding, k = 0)" + (f": {title}" if title else ""),
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return str(path)
