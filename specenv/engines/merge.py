"""Merging the trace sets that shards of one collection wrote (one engine per GPU or per Ray actor).

A collection split over several engines (``scripts/collect_vllm_gpu.py --ray``, one vLLM engine per GPU
over a prompt shard each) leaves one set or recording per shard. :func:`merge_sets` concatenates their
tables into one set:

* **generation ids without collision**: shard i's ids are shifted by ``offsets[i]`` when given (a
  recorder numbers the requests of its engine 0, 1, ..., so a shard's offset is the index of its first
  prompt: the merged ids are then the prompt indices, as one engine would have numbered them); without
  ``offsets`` a shard keeps its ids unless one of them is already taken, and then all of them move past
  the largest id so far (a set built from prompt ids, e.g. ``specenv collect``, keeps its ids);
* **one manifest**: the first shard's, with the counts of the merged tables, the per-generation
  entries of ``extra`` (``prompts``, ``reference_tokens``) renumbered and joined, the lossless checks
  summed, and ``extra["shards"]``: per shard its generations, id offset and run provenance
  (``wall_seconds``, ``machine``).

The shards must describe the same collection: the same source, model facts, Kmax, greedy flag,
``max_new_tokens`` and, for sets with positions, the same schema; anything else is refused with a
line naming the shard and the field. The merged set is validated when saved
(:meth:`specenv.traces.traceset.TraceSet.save`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from specenv.traces.traceset import TraceSet

#: Manifest fields that must agree between the shards of one collection.
SAME = ("source", "model", "kmax", "greedy", "max_new_tokens")
#: Fields of ``extra`` every shard must share (a sampled collection's temperature and seed).
SAME_EXTRA = ("temperature", "seed")


def merge_sets(shards: Sequence[TraceSet], name: str | None = None, offsets: Sequence[int] | None = None) -> TraceSet:
    """One in-memory trace set from the sets of the shards of a collection (see the module docstring).

    Args:
        shards: The shards' sets, in prompt order.
        name: Name of the merged set (default: the first shard's).
        offsets: Added to each shard's generation ids (None: shift only on a collision).

    Returns:
        The merged :class:`TraceSet` (rounds and positions, as the shards have them).

    Raises:
        ValueError: No shard, ``offsets`` of another length, shards of different collections, or ids that
            still collide after the given offsets (one line naming the shard).
    """
    import pandas as pd

    if not shards:
        raise ValueError("merge_sets: no shard to merge")
    if offsets is not None and len(offsets) != len(shards):
        raise ValueError(f"offsets: {len(offsets)} offsets for {len(shards)} shards")
    first = shards[0].manifest
    for i, ts in enumerate(shards[1:], start=1):
        for f in SAME:
            if getattr(ts.manifest, f) != getattr(first, f):
                raise ValueError(
                    f"shard {i} ({ts.manifest.name}): {f} = {getattr(ts.manifest, f)!r} differs from shard 0's "
                    f"{getattr(first, f)!r} (not the same collection)"
                )
        for key in SAME_EXTRA:  # a sampled collection: the same temperature and seed in every shard
            if ts.manifest.extra.get(key) != first.extra.get(key):
                raise ValueError(
                    f"shard {i} ({ts.manifest.name}): extra.{key} = {ts.manifest.extra.get(key)!r} differs from "
                    f"shard 0's {first.extra.get(key)!r} (not the same collection)"
                )
        if ts.has_positions != shards[0].has_positions or ts.has_rounds != shards[0].has_rounds:
            raise ValueError(f"shard {i} ({ts.manifest.name}): has other tables than shard 0")
    taken: set[int] = set()
    rounds, positions, shard_info = [], [], []
    extra: dict[str, Any] = copy.deepcopy(first.extra)
    prompts: list[Any] = []
    refs: dict[str, Any] = {}
    lossless = {"runs_checked": 0, "mismatched_runs": 0, "mismatches": []}
    for i, ts in enumerate(shards):
        ids = _ids(ts)
        if offsets is not None:
            shift = int(offsets[i])
        else:
            shift = 0 if not ids & taken else max(taken) + 1 - min(ids)
        moved = {g + shift for g in ids}
        if moved & taken:
            raise ValueError(f"shard {i} ({ts.manifest.name}): generation ids {sorted(moved & taken)[:5]} collide")
        taken |= moved
        for table, out in ((ts.rounds, rounds), (ts.positions, positions)):
            if table is not None:
                t = table.copy()
                t["generation_id"] = t["generation_id"].astype("int64") + shift
                out.append(t)
        ex = ts.manifest.extra
        prompts += [p + shift if isinstance(p, int) else p for p in ex.get("prompts", [])]
        refs |= {str(int(g) + shift): v for g, v in ex.get("reference_tokens", {}).items()}
        ll = ex.get("lossless", {})
        lossless["runs_checked"] += int(ll.get("runs_checked", 0))
        lossless["mismatched_runs"] += int(ll.get("mismatched_runs", 0))
        lossless["mismatches"] += [
            m | {"generation_id": int(m["generation_id"]) + shift}
            for m in ll.get("mismatches", [])
            if isinstance(m, dict)
        ]
        shard_info.append(
            {
                "shard": i,
                "name": ts.manifest.name,
                "generations": len(ids),
                "id_offset": shift,
                "wall_seconds": ex.get("wall_seconds"),
                "machine": ex.get("machine"),
            }
        )
    if "prompts" in extra:
        extra["prompts"] = prompts
    if "reference_tokens" in extra:
        extra["reference_tokens"] = refs
    if "lossless" in extra:
        extra["lossless"] = extra["lossless"] | lossless | {"mismatches": lossless["mismatches"][:50]}
    extra.pop("wall_seconds", None)
    extra.pop("machine", None)
    extra["shards"] = shard_info
    extra["merged"] = f"{len(shards)} shards merged by specenv.engines.merge.merge_sets"
    manifest = copy.deepcopy(first)
    manifest.name = name or first.name
    manifest.extra = extra
    manifest.counts, manifest.files = {}, {}
    manifest.description = (first.description + f" Merged from {len(shards)} shards.").strip()
    return TraceSet(
        manifest,
        positions=pd.concat(positions, ignore_index=True) if positions else None,
        rounds=pd.concat(rounds, ignore_index=True) if rounds else None,
    )


def _ids(ts: TraceSet) -> set[int]:
    """The generation ids of a set (positions and rounds together)."""
    out: set[int] = set()
    for table in (ts.positions, ts.rounds):
        if table is not None:
            out |= {int(g) for g in table["generation_id"].unique()}
    return out
