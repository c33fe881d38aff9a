"""Exact Stochastic-Shortest-Path oracle for speculation-length control.

* :func:`solve`: backward induction over positions, vectorised across generations: V(0), k*(t),
  S_max per generation and pooled, mean k* and mean accepted along the optimal path (exact, from
  occupancy probabilities; optional seeded Monte-Carlo check);
* :func:`evaluate_policy`: exact expected cost of any position-indexed (e.g. fixed-k) policy;
  :func:`simulate`: seeded Monte-Carlo episodes of one;
* :func:`kmax_sweep`: the bound against Kmax (paper Figure 2);
* :func:`delta_analysis` and :func:`boundary_slope`: the delta space of rejected candidates and the
  slope lambda the delta-space heuristic uses (paper Figure 3).

The oracle is numpy only (its sweeps compiled by numba where installed, :mod:`oracle.kernels`): it
never imports Gymnasium or the environments. Costs and survival
probabilities come from their single owners, :meth:`specenv.cost.model.CostModel.charged_table` and
:meth:`specenv.traces.traceset.PositionArrays.survival`. Online policies are played through the
environment by :mod:`specenv.envs.rollout`.
"""

from oracle.delta import DeltaAnalysis, boundary_slope, delta_analysis, delta_rule_policy, plot_delta
from oracle.dp import (
    Evaluation,
    Simulation,
    action_values,
    ar_costs,
    cost_table,
    evaluate_policy,
    expected_accepted,
    simulate,
    solve,
    survival,
)
from oracle.sweep import kmax_sweep, plot_kmax_sweep

__all__ = [
    "DeltaAnalysis",
    "Evaluation",
    "Simulation",
    "action_values",
    "ar_costs",
    "boundary_slope",
    "cost_table",
    "delta_analysis",
    "delta_rule_policy",
    "evaluate_policy",
    "expected_accepted",
    "kmax_sweep",
    "plot_delta",
    "plot_kmax_sweep",
    "simulate",
    "solve",
    "survival",
]
