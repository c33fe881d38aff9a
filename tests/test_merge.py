"""Merging the shards of a collection (specenv/engines/merge.py): ids without collision, one manifest."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest

from specenv.engines.merge import merge_sets
from specenv.traces.datasets import load_dataset
from specenv.traces.traceset import TraceSet


def _shard(ts: TraceSet, ids: list[int], shift: int = 0) -> TraceSet:
    """The generations ``ids`` of ``ts`` with their ids moved by ``-shift`` (a recorder numbering from 0)."""
    man = copy.deepcopy(ts.manifest)
    man.extra = {"prompts": [g - shift for g in ids], "wall_seconds": 1.0, "machine": {"cpus": 2}}
    tabs = {}
    for tab in ("positions", "rounds"):
        df = getattr(ts, tab)
        df = df[df["generation_id"].isin(ids)].copy()
        df["generation_id"] -= shift
        tabs[tab] = df.reset_index(drop=True)
    return TraceSet(man, **tabs)


def test_merge_of_shards_is_the_whole_set(tmp_path) -> None:
    full = load_dataset("paper-default")
    gids = list(dict.fromkeys(full.positions["generation_id"].tolist()))[:12]
    ts = _shard(full, gids)  # a small whole set: 12 generations
    cut = len(gids) // 3
    # two shards numbered by their recorders from 0: the offsets are the shards' first prompt index
    a, b = _shard(ts, gids[:cut], shift=gids[0]), _shard(ts, gids[cut:], shift=gids[cut])
    assert a.positions["generation_id"].min() == b.positions["generation_id"].min() == 0  # they collide as recorded
    merged = merge_sets([a, b], name="merged", offsets=[gids[0], gids[cut]])
    out = merged.save(tmp_path / "merged")
    back = TraceSet.load(out)
    for tab in ("positions", "rounds"):
        pd.testing.assert_frame_equal(
            getattr(back, tab).reset_index(drop=True),
            getattr(ts, tab).reset_index(drop=True),
            check_dtype=False,
            check_categorical=False,
        )
    m = back.manifest
    assert m.name == "merged" and m.counts["generations"] == len(gids)
    assert m.extra["prompts"] == gids and [s["id_offset"] for s in m.extra["shards"]] == [gids[0], gids[cut]]
    assert [s["generations"] for s in m.extra["shards"]] == [cut, len(gids) - cut]
    assert "wall_seconds" not in m.extra


def test_merge_without_offsets_moves_only_colliding_ids() -> None:
    ts = load_dataset("paper-default")
    gids = list(dict.fromkeys(ts.positions["generation_id"].tolist()))
    a, b = _shard(ts, gids[:3]), _shard(ts, gids[3:6])
    kept = merge_sets([a, b])
    assert sorted(kept.positions["generation_id"].unique()) == sorted(gids[:6])  # disjoint ids are kept
    c = _shard(ts, gids[:3])
    moved = merge_sets([a, c])
    ids = moved.positions["generation_id"].unique()
    assert len(ids) == 6 and len(set(ids.tolist())) == 6 and min(ids[3:]) > max(gids[:3])
    np.testing.assert_array_equal(
        moved.positions["rho_1"].to_numpy(), np.concatenate([a.positions["rho_1"], c.positions["rho_1"]])
    )


def test_merge_refuses_shards_of_other_collections() -> None:
    ts = load_dataset("paper-default")
    gids = list(dict.fromkeys(ts.positions["generation_id"].tolist()))
    a, b = _shard(ts, gids[:3]), _shard(ts, gids[3:6])
    b.manifest.kmax = 4
    with pytest.raises(ValueError, match=r"shard 1 .*kmax"):
        merge_sets([a, b])
    with pytest.raises(ValueError, match="offsets"):
        merge_sets([a], offsets=[0, 1])
    with pytest.raises(ValueError, match="collide"):
        merge_sets([a, _shard(ts, gids[:3])], offsets=[0, 0])


def test_merge_refuses_shards_sampled_at_another_temperature_or_seed() -> None:
    ts = load_dataset("live-vllm-t07")
    gids = list(dict.fromkeys(ts.positions["generation_id"].tolist()))
    a, b = _shard(ts, gids[:3]), _shard(ts, gids[3:6])
    for s in (a, b):
        s.manifest.extra |= {"temperature": 0.7, "seed": 0}
    assert merge_sets([a, b]).manifest.extra["seed"] == 0
    b.manifest.extra["seed"] = 1
    with pytest.raises(ValueError, match=r"shard 1 .*extra.seed"):
        merge_sets([a, b])
    b.manifest.extra |= {"seed": 0, "temperature": 1.0}
    with pytest.raises(ValueError, match=r"shard 1 .*extra.temperature"):
        merge_sets([a, b])
