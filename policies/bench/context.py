"""What every benchmark family fits on the train split, once per run: the :class:`Context`.

The trace set is loaded once (:func:`build_context` takes a loaded :class:`~specenv.traces.traceset.TraceSet`
or a name or folder, loaded here); the cost model is built once from it and every row of the run is
charged by that one object. Everything fitted here uses the **train** split only: the cost model
(``cost_model="fit-train"``, the default), the best fixed k (exact evaluation), the delta-space lambda
(oracle boundary slope), the U(k) and acceptance priors (train means) and, on first use, the peers'
thresholds and classifiers (:attr:`Context.peers`).

The peers' fit (:func:`policies.peers.fit_peers`: a hundred exact evaluations of thresholds and two
logistic heads on the train positions) is remembered like the cost model's fit
(:mod:`specenv.cost.source`): in the process and on disk in specenv's cache folder
(:func:`specenv.io.cache_dir`, sub-folder ``peerfits``), as JSON that round-trips every float
exactly. An entry is keyed by the sha256 of the positions file (verified when the set was loaded),
the split and its rule, Kmax, the cost model's content, the best fixed k, the versions of the
libraries the fit runs on and :data:`PEERS_FIT_VERSION`; it is used only when its stored key equals
the wanted key, otherwise refitted and rewritten atomically. Sets not loaded from verified files are
fitted every time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from policies.peers import LinearHead, PeerFit, fit_peers
from specenv.cost.model import CostModel
from specenv.io import atomic_write_text, cache_dir
from specenv.observation.single import ObservationSpec
from specenv.traces.traceset import PositionArrays, TraceSet

__all__ = [
    "DEFAULT_COST_MODEL",
    "N_BOOT",
    "PEERS_FIT_VERSION",
    "Context",
    "build_context",
    "cached_peers",
    "load_traces",
    "peers_cache_key",
    "peers_from_json",
    "peers_to_json",
    "train_priors",
]

#: The benchmark's default cost model: fitted on the train split's rounds only.
DEFAULT_COST_MODEL = "fit-train"
#: Bootstrap resamples of the generations behind every Monte-Carlo row's intervals.
N_BOOT = 2000
#: Bump when :func:`policies.peers.fit_peers` changes what it fits, so that every cached fit is refitted.
PEERS_FIT_VERSION = 1
#: ``format`` field of a disk-cache entry of the peers' fit, and its sub-folder of the cache folder.
PEERS_CACHE_FORMAT = "specenv.peerfit/1"
PEERS_CACHE_SUBDIR = "peerfits"
#: Distributions whose versions key the peers' cache (the logistic heads: scikit-learn on scipy).
PEERS_LIBRARIES = ("numpy", "scipy", "scikit-learn")

_PEERS: dict[str, PeerFit] = {}


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
            self._peers = cached_peers(self)
        return self._peers


def peers_cache_key(ctx: Context) -> dict[str, Any] | None:
    """The cache key of a run's peers' fit, or None for a set whose positions file was not verified."""
    from importlib.metadata import PackageNotFoundError, version

    from specenv.traces.splits import SALT

    ts = ctx.traces
    positions = ts.verified_sha256("positions") if ts is not None and ts.has_positions else None
    if positions is None:
        return None
    libraries = {}
    for name in PEERS_LIBRARIES:
        try:
            libraries[name] = version(name)
        except PackageNotFoundError:
            libraries[name] = "absent"
    return {
        "peers_fit_version": PEERS_FIT_VERSION,
        "traces": ts.manifest.name,  # type: ignore[union-attr]
        "positions_sha256": positions,
        "split": "train",
        "split_rule": SALT,
        "kmax": int(ctx.kmax),
        "cost_model_sha256": _sha256(ctx.cost_model.to_json()),
        "best_fixed_k": int(ctx.best_fixed_k),
        "libraries": libraries,
    }


def cached_peers(ctx: Context) -> PeerFit:
    """:func:`policies.peers.fit_peers` on the run's train split, from the process or disk cache when it holds it."""
    key = peers_cache_key(ctx)
    if key is None:
        return fit_peers(ctx.train, ctx.cost_model, best_fixed_k=ctx.best_fixed_k)
    digest = _sha256(key)
    if digest in _PEERS:
        return _PEERS[digest]
    root = cache_dir()
    path = None if root is None else root / PEERS_CACHE_SUBDIR / f"peers-{digest}.json"
    fit = _read_peers(path, key) if path is not None else None
    if fit is None:
        fit = fit_peers(ctx.train, ctx.cost_model, best_fixed_k=ctx.best_fixed_k)
        if path is not None:
            _write_peers(path, key, fit)
    _PEERS[digest] = fit
    return fit


def _sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def peers_to_json(fit: PeerFit) -> dict[str, Any]:
    """A :class:`~policies.peers.PeerFit` as plain JSON (every float exactly: ``json`` writes ``repr``)."""
    return json.loads(json.dumps(dataclasses.asdict(fit)))


def peers_from_json(obj: dict[str, Any]) -> PeerFit:
    """The :class:`~policies.peers.PeerFit` of :func:`peers_to_json` (a KeyError/TypeError/ValueError if malformed)."""

    def head(h: dict[str, Any]) -> LinearHead:
        weights = tuple(float(w) for w in h["weights"])
        return LinearHead(tuple(str(f) for f in h["features"]), weights, float(h["w_depth"]), float(h["bias"]))

    def opt(x: Any) -> float | None:
        return None if x is None else float(x)

    return PeerFit(
        kmax=int(obj["kmax"]),
        signals=tuple(str(x) for x in obj["signals"]),
        adaedl_lam=opt(obj["adaedl_lam"]),
        adaedl_gamma=float(obj["adaedl_gamma"]),
        svip_h=opt(obj["svip_h"]),
        specdecpp=head(obj["specdecpp"]),
        specdecpp_threshold=float(obj["specdecpp_threshold"]),
        disco=head(obj["disco"]),
        disco_threshold=float(obj["disco_threshold"]),
        dsd_k=int(obj["dsd_k"]),
        train_speedup={str(k): float(v) for k, v in obj["train_speedup"].items()},
    )


def _read_peers(path: Path, key: dict[str, Any]) -> PeerFit | None:
    """The cached fit at ``path`` if the entry is intact and was written for ``key``; else None."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if entry.get("format") != PEERS_CACHE_FORMAT or entry.get("key") != key:
            return None
        if entry.get("fit_sha256") != _sha256(entry["fit"]):
            return None
        return peers_from_json(entry["fit"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_peers(path: Path, key: dict[str, Any], fit: PeerFit) -> None:
    """Store ``fit`` under ``key`` atomically, if it round-trips exactly; a cache that cannot be written is skipped."""
    try:
        obj = peers_to_json(fit)
    except (TypeError, ValueError):  # a value JSON cannot hold: not cached
        return
    if peers_from_json(obj) != fit:  # never store what would load as a different fit
        return
    entry = {"format": PEERS_CACHE_FORMAT, "key": key, "fit_sha256": _sha256(obj), "fit": obj}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(entry, indent=1) + "\n")
    except OSError:
        pass


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
