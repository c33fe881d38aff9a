"""What every benchmark family fits on the train split, once per run: the :class:`Context`.

The trace set is loaded once (:func:`build_context` takes a loaded :class:`~specenv.traces.traceset.TraceSet`
or a name or folder, loaded here); the cost model is built once from it and every row of the run is
charged by that one object. Everything fitted here uses the **train** split only: the cost model
(``cost_model="fit-train"``, the default), the best fixed k (exact evaluation), the delta-space lambda
(oracle boundary slope), the U(k) and acceptance priors (train means) and, on first use, the peers'
thresholds and classifiers (:attr:`Context.peers`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policies.peers import PeerFit, fit_peers
from specenv.cost.model import CostModel
from specenv.observation.single import ObservationSpec
from specenv.traces.traceset import PositionArrays, TraceSet

__all__ = [
    "DEFAULT_COST_MODEL",
    "N_BOOT",
    "Context",
    "build_context",
    "load_traces",
    "train_priors",
]

#: The benchmark's default cost model: fitted on the train split's rounds only.
DEFAULT_COST_MODEL = "fit-train"
#: Bootstrap resamples of the generations behind every Monte-Carlo row's intervals.
N_BOOT = 2000


@dataclass
class Context:
    """What the policies are fitted with (train split only).

    ``dataset`` is the trace set as the run names it (the name or folder given, in every output);
    ``traces`` the loaded set; ``source`` what an environment of the run loads (``dataset``, or the
    folder of a set given loaded). ``cost_model`` is the one cost-model object of the run,
    ``cost_model_arg`` its spelling (``fit-train``, ``fit``, ``profile`` or a JSON path).
    """

    dataset: str
    kmax: int
    cost_model: CostModel
    cost_model_arg: str
    train: PositionArrays
    test: PositionArrays
    best_fixed_k: int
    lam_ms: float
    lam_ms_h3: float
    u_prior: np.ndarray
    rho_prior: np.ndarray
    spec: ObservationSpec
    policy_dir: Path | None
    notes: list[str] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # policy folders not run, with the reason
    traces: TraceSet | None = None
    source: str = ""
    _peers: PeerFit | None = None

    @property
    def peers(self) -> PeerFit:
        """The peers' fitted quantities (:func:`policies.peers.fit_peers`, train split only), fitted once."""
        if self._peers is None:
            self._peers = fit_peers(self.train, self.cost_model, best_fixed_k=self.best_fixed_k)
        return self._peers


def load_traces(dataset: Any) -> tuple[TraceSet, str, str]:
    """``(trace set, name, source)`` of a run's ``dataset``: a loaded set, or a name or folder loaded here.

    ``name`` is how the outputs name the set (the string given; a loaded set's manifest name);
    ``source`` what an environment loads (the string given; a loaded set's folder).
    """
    if isinstance(dataset, TraceSet):
        return dataset, str(dataset.manifest.name), str(dataset.root)
    from specenv.traces.datasets import load_dataset

    return load_dataset(dataset), os.fspath(dataset), os.fspath(dataset)


def train_priors(train: PositionArrays) -> tuple[np.ndarray, np.ndarray]:
    """Priors the online rules start from, fitted on the train positions.

    Returns:
        ``u_prior`` (kmax+1,): mean unique experts U_{t,k} per budget; ``rho_prior`` (kmax,): mean
        conditional acceptance per depth over the states where that depth is reached (weights
        ``P(a >= j-1)`` from :meth:`~specenv.traces.traceset.PositionArrays.survival`).
    """
    surv = train.survival()
    reach = np.concatenate([np.ones((len(surv), 1)), surv[:, :-1]], axis=1)
    rho_prior = (reach * train.rho).sum(axis=0) / np.maximum(reach.sum(axis=0), 1e-12)
    return train.U.mean(axis=0), rho_prior


def build_context(dataset: Any, kmax: int | None, cost_model: str, policy_dir: Path | None) -> Context:
    """Fit everything policies need on the train split.

    Args:
        dataset: A loaded :class:`~specenv.traces.traceset.TraceSet`, or a registry name or folder (loaded here).
        kmax: Largest budget (None: the set's Kmax).
        cost_model: ``fit-train``, ``fit``, ``profile`` or a cost-model JSON (built once, here).
        policy_dir: Folder of trained policies the roster reads (None: none).
    """
    from oracle.delta import boundary_slope
    from oracle.dp import evaluate_policy
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions

    ts, name, source = load_traces(dataset)
    train = select_positions(ts, kmax, "train")
    test = select_positions(ts, kmax, "test")
    kmax = train.kmax
    model = cost_model_for(ts, cost_model)
    speed = [evaluate_policy(train, model, k).speedup_pooled for k in range(kmax + 1)]
    best = int(np.argmax(speed))
    lam = boundary_slope(train, model)
    lam_h3 = boundary_slope(train, model, lookahead=min(3, kmax), drafting="block")
    u_prior, rho_prior = train_priors(train)
    spec = ObservationSpec(kmax, 0, int(ts.manifest.max_new_tokens), int(ts.facts.n_experts))
    return Context(
        name, kmax, model, cost_model, train, test, best, lam, lam_h3, u_prior, rho_prior, spec, policy_dir,
        traces=ts, source=source,
    )  # fmt: skip
