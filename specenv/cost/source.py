"""Which cost model an environment, the oracle or the benchmark uses for a trace set: :func:`cost_model_for`.

``cost_model="fit"`` means the per-K OLS of :mod:`specenv.cost.fit` on the set's rounds table (every
round; in a set collected with expert caps, the capped rounds too, priced by their capped ``U_r``:
on ``live-cpu-caps`` a fit on the uncapped train rounds alone predicts the capped test rounds with
about the MAPE it has on uncapped ones, :func:`specenv.cost.fit.capped_transfer`);
``cost_model="fit-train"`` is the same fit on the rounds of the *train* split's generations only
(:mod:`specenv.traces.splits`, the rule the environments, the oracle and the benchmark use), so that
nothing fitted sees a held-out generation (the benchmark's default). A fit needs statsmodels
(seconds to import), so it is done once and remembered twice:

* in the process, per (set name, manifest files, Kmax, split);
* on disk, in specenv's per-user cache folder (:func:`specenv.io.cache_dir`: ``$SPECENV_CACHE``,
  else ``$XDG_CACHE_HOME/specenv``, else ``~/.cache/specenv``), as the cost model's JSON, which
  round-trips every float exactly (``json`` writes ``repr``). An entry is keyed by the sha256 of the
  rounds file (verified against the manifest when the set was loaded), the fit settings, the
  versions of the libraries the fit runs on and :data:`FIT_VERSION`; it is used only when its stored
  key equals the wanted key and the model's digest matches, otherwise it is ignored and refitted
  (and rewritten atomically). Sets that were not loaded from verified files (built in memory, or
  loaded with ``verify_hashes=False``) are never looked up on disk.

A set recorded by an engine that times whole steps (``rounds.T_step_ms`` and a plain engine's
``manifest.extra.ar_reference``: the vLLM collector) is priced by the step-time model of
:mod:`specenv.cost.steptime` instead (the same forms on wall-clock forwards, plus the engine's per-step
overhead, with the plain engine's step as the speedup reference).

Nothing heavy is imported here: :mod:`specenv.cost.fit` (statsmodels, pandas) loads only when a fit is
really computed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from specenv.cost.model import CostModel
from specenv.io import atomic_write_text, cache_dir, json_digest, not_regular

#: Bump when the fit behind ``cost_model="fit"`` changes, so that every cached model is refitted.
FIT_VERSION = 3  # 2: the draft floor of k = 0 rounds (CostModel.d_floor); 3: the step-time model (cost/steptime.py)
#: ``format`` field of a disk-cache entry.
CACHE_FORMAT = "specenv.fitcache/1"
#: Libraries whose versions key the disk cache (the fit's numbers depend on them).
FIT_LIBRARIES = ("numpy", "scipy", "statsmodels", "pandas")
#: Sub-folder of the cache folder holding fitted cost models.
CACHE_SUBDIR = "costmodels"

#: ``cost_model`` names of the fits, and the split of generations whose rounds each one fits.
FITS: dict[str, str] = {"fit": "all", "fit-train": "train"}

_FIT_CACHE: dict[tuple[str, str, int, str], CostModel] = {}


def cost_model_for(traces: Any, which: str = "fit") -> CostModel:
    """The cost model an environment or the oracle should use for a trace set.

    Args:
        traces: A loaded :class:`specenv.traces.traceset.TraceSet`.
        which: ``"fit"`` (per-K OLS on the set's rounds table, no cross-validation; cached per
            process by set and manifest hash, and on disk by rounds-file digest, see the module
            docstring), ``"fit-train"`` (the same fit on the train split's rounds only, cached the
            same way), ``"profile"`` (the paper's coefficients) or a path to a cost-model JSON
            written by ``specenv fit --out``.

    Raises:
        ValueError: If ``which`` is unknown, the set has no rounds to fit, or the JSON is bad.
    """
    kmax = traces.kmax
    if which == "profile":
        return CostModel.paper_profile(kmax)
    if which in FITS:
        if not traces.has_rounds:
            raise ValueError(
                f"cost_model={which!r}: trace set '{traces.manifest.name}' has no rounds table "
                "(use cost_model='profile' or a cost-model JSON path)"
            )
        split = FITS[which]
        key = (traces.manifest.name, json_digest(traces.manifest.files), kmax, split)
        if key not in _FIT_CACHE:
            _FIT_CACHE[key] = _fit_cached(traces, split)
        return _FIT_CACHE[key]
    path = Path(which)
    if path.suffix == ".json" and (path.exists() or path.is_symlink()):
        why = not_regular(path)  # a FIFO, device, folder or dangling link named like a cost model
        if why is not None:
            raise ValueError(f"cost_model={which!r}: {path} {why}")
    if path.suffix == ".json" and path.is_file():
        model = CostModel.load(path)
        check_model_facts(model, traces, str(path))
        return model
    raise ValueError(f"cost_model={which!r}: expected 'fit', 'fit-train', 'profile' or an existing .json file")


def check_model_facts(model: CostModel, traces: Any, file: str) -> None:
    """A cost model read from ``file`` fits the trace set: Kmax covers the set's budgets, same model facts.

    ``top_k`` must be equal; ``n_experts`` and ``n_layers`` are compared when the cost model records them.

    Raises:
        ValueError: One line naming both files and the field that differs.
    """
    where = f"trace set '{traces.manifest.name}'"
    if getattr(traces, "root", None) is not None:
        where += f" ({Path(traces.root) / 'manifest.json'})"
    if model.kmax < traces.kmax:
        raise ValueError(
            f"{file}: field 'kmax' = {model.kmax} covers K <= {model.kmax}, but {where} has kmax = {traces.kmax}"
        )
    facts = traces.facts
    for name in ("top_k", "n_experts", "n_layers"):
        mine, theirs = getattr(model, name), getattr(facts, name)
        if mine is not None and mine != theirs:
            raise ValueError(f"{file}: field '{name}' = {mine} does not match {where}: model.{name} = {theirs}")


def split_rounds(traces: Any, split: str = "all") -> Any:
    """The rounds of the generations of ``split`` (:mod:`specenv.traces.splits`), as a DataFrame.

    The split is the one of the set's positions table when it has one (the generations the
    environments and the oracle replay), else of the rounds' own generation ids.

    Raises:
        ValueError: If the split has no rounds.
    """
    from specenv.traces.splits import check_split, split_mask

    rounds = traces.rounds
    if check_split(split) == "all":
        return rounds
    ids = traces.arrays().generation_ids if traces.has_positions else np.unique(rounds["generation_id"])
    ids = np.asarray(ids, dtype=np.int64)
    keep = ids[split_mask(ids, split)]
    part = rounds[rounds["generation_id"].isin(keep)]
    if not len(part):
        raise ValueError(f"cost_model: trace set '{traces.manifest.name}' has no rounds in the {split} split")
    return part


def fresh_fit(traces: Any, split: str = "all") -> CostModel:
    """The ``"fit"`` (``split="all"``) or ``"fit-train"`` cost model of a set computed now (no cache used)."""
    from specenv.cost.fit import fit_replay_model
    from specenv.cost.steptime import fit_step_model, has_step_times

    source: dict[str, Any] = {"traces": traces.manifest.name}
    if split != "all":
        source["split"] = split
    rounds = split_rounds(traces, split)
    extra = traces.manifest.extra or {}
    if has_step_times(traces.rounds, extra):  # an engine that timed whole steps: price the step
        model = fit_step_model(rounds, traces.kmax, traces.facts.top_k, extra["ar_reference"], source)
    else:
        model = fit_replay_model(rounds, traces.kmax, traces.facts.top_k, source)
    model.n_experts, model.n_layers = traces.facts.n_experts, traces.facts.n_layers
    # what loading it would refuse (a time <= 0 or implausibly large at a corner of its domain) is refused now
    CostModel.from_json(model.to_json(), f"cost model fitted on the rounds table of '{traces.manifest.name}'")
    return model


def fit_cache_key(traces: Any, split: str = "all") -> dict[str, Any] | None:
    """The disk-cache key of a set's ``"fit"`` (or ``"fit-train"``) model, or None without a disk cache.

    Only sets whose rounds table was read from a file whose sha256 was checked against the manifest
    on load have a key. The key of a split fit also names the split (and the positions file, which
    defines the split's generations); the key of the full fit is unchanged.
    """
    digest = traces.verified_sha256("rounds")
    if digest is None:
        return None
    extra: dict[str, Any] = {}
    if split != "all":
        positions = traces.verified_sha256("positions") if traces.has_positions else "none"
        if positions is None:  # the split's generations come from an unverified positions table
            return None
        extra = {"split": split, "positions_sha256": positions}
    return extra | {
        "fit_version": FIT_VERSION,
        "traces": traces.manifest.name,
        "rounds_sha256": digest,
        "kmax": int(traces.kmax),
        "top_k": int(traces.facts.top_k),
        "n_splits": 0,
        "libraries": {name: _dist_version(name) for name in FIT_LIBRARIES},
    }


def fit_cache_path(key: dict[str, Any]) -> Path | None:
    """Where the entry of ``key`` lives, or None when the disk cache is disabled."""
    root = cache_dir()
    if root is None:
        return None
    return root / CACHE_SUBDIR / f"fit-{_digest(key)}.json"


def _fit_cached(traces: Any, split: str = "all") -> CostModel:
    key = fit_cache_key(traces, split)
    path = fit_cache_path(key) if key is not None else None
    if path is not None:
        model = _read_entry(path, key)
        if model is not None:
            return model
    model = fresh_fit(traces) if split == "all" else fresh_fit(traces, split)
    if path is not None:
        _write_entry(path, key, model)
    return model


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _read_entry(path: Path, key: dict[str, Any]) -> CostModel | None:
    """The cached model at ``path`` if the entry is intact and was written for ``key``; else None."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != CACHE_FORMAT or entry.get("key") != key:
        return None
    obj = entry.get("model")
    if not isinstance(obj, dict) or entry.get("model_sha256") != _digest(obj):
        return None
    try:
        model = CostModel.from_json(obj, str(path))
    except ValueError:
        return None
    if model.kmax != key["kmax"] or model.top_k != key["top_k"]:
        return None
    if model.n_experts is None or model.n_layers is None:  # written before the model facts were recorded
        return None
    return model


def _write_entry(path: Path, key: dict[str, Any], model: CostModel) -> None:
    """Store ``model`` under ``key`` atomically; a cache that cannot be written is skipped silently."""
    obj = model.to_json()
    entry = {"format": CACHE_FORMAT, "key": key, "model_sha256": _digest(obj), "model": obj}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(entry, indent=1) + "\n")
    except OSError:
        pass


def _dist_version(name: str) -> str:
    """Installed version of a distribution without importing it (``"absent"`` when not installed)."""
    if name == "numpy":
        return np.__version__
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    site = Path(next(iter(spec.submodule_search_locations))).parent
    try:
        found = [e.name for e in os.scandir(site) if e.name.startswith(f"{name}-") and e.name.endswith(".dist-info")]
    except OSError:
        found = []
    if len(found) == 1:
        return found[0][len(name) + 1 : -len(".dist-info")]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
