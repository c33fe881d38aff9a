"""The environment docstrings: Gymnasium's CartPole sections, the observation table, runnable examples."""

from __future__ import annotations

import doctest
import importlib
import re

import numpy as np
import pytest

from specenv.envs.caps import MoESpecCapEnv
from specenv.envs.live import MoESpecLiveEnv
from specenv.envs.replay import MoESpecEnv
from specenv.envs.vector import MoESpecVectorEnv
from specenv.observation.single import ObservationSpec

SECTIONS = (
    "## Description",
    "## Action Space",
    "## Observation Space",
    "## Rewards",
    "## Starting State",
    "## Episode End",
    "## Arguments",
    "## Version History",
)


@pytest.mark.parametrize("cls", [MoESpecEnv, MoESpecVectorEnv, MoESpecLiveEnv, MoESpecCapEnv])
def test_cartpole_sections_in_order(cls):
    doc = cls.__doc__
    pos = [doc.find(s) for s in SECTIONS]
    assert all(p >= 0 for p in pos), [s for s, p in zip(SECTIONS, pos, strict=True) if p < 0]
    assert pos == sorted(pos)
    assert ">>> " in doc  # examples, run by test_examples_run_as_doctests


def _table(doc: str) -> list[tuple[str, str, str]]:
    """(name, meaning, range) rows of the table in the Observation Space section."""
    section = doc.split("## Observation Space", 1)[1].split("\n    ## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.strip().startswith("|") and len(cells) == 3 and cells[0] not in ("Name", "---"):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


@pytest.mark.parametrize(
    "kmax, lookahead, signals",
    [
        (1, 0, ("q",)),
        (4, 2, ("q",)),
        (10, 0, ("q",)),
        (8, 8, ("q",)),
        (4, 3, ("q", "ent", "margin")),
        (2, 2, ("q", "margin")),
    ],
)
def test_observation_table_names_every_feature_in_order(kmax, lookahead, signals):
    spec = ObservationSpec(kmax=kmax, lookahead=lookahead, signals=signals)
    rows = _table(MoESpecEnv.__doc__)
    keys = [r[0] for r in rows]
    assert len(keys) == len(set(keys)) == 14
    # every feature name maps onto a row: literally, or acc_depth_j / conf_j for the indexed ones
    expanded = [re.sub(r"_\d+$", "_j", name) for name in spec.names]
    missing = [n for n, e in zip(spec.names, expanded, strict=True) if e not in keys]
    assert not missing, f"features without a row in the table: {missing}"
    # same order as the vector, and no stale row (conf_j only matters with lookahead)
    order = list(dict.fromkeys(expanded))
    assert order == [k for k in keys if k in order]
    assert set(keys) - set(order) <= {"conf_j", "ent_j", "margin_j"}
    # the range column is the Box's [0, high]
    hi = spec.high()
    for i, e in enumerate(expanded):
        rng = rows[keys.index(e)][2]
        assert rng == f"[0, {float(hi[i]):g}]", (e, rng)
    # the indexed rows say which j
    meaning = dict((r[0], r[1]) for r in rows)
    assert "1..kmax" in meaning["acc_depth_j"] and "1..lookahead" in meaning["conf_j"]


def test_vector_and_live_refer_to_the_table():
    for cls in (MoESpecVectorEnv, MoESpecLiveEnv):
        section = cls.__doc__.split("## Observation Space", 1)[1].split("## Rewards", 1)[0]
        assert "specenv.envs.replay.MoESpecEnv" in section and "ObservationSpec.names" in section


def test_docstrings_do_not_cite_files_outside_the_package():
    modules = (
        "specenv.envs.replay",
        "specenv.envs.vector",
        "specenv.envs.live",
        "specenv.envs.render",
        "specenv.envs.caps",
    )
    for name in modules:
        src = importlib.import_module(name).__doc__ or ""
        assert "DESIGN section" not in src and "DESIGN.md" not in src
    for cls in (MoESpecEnv, MoESpecVectorEnv, MoESpecLiveEnv, MoESpecCapEnv):
        assert "DESIGN" not in cls.__doc__


@pytest.mark.parametrize(
    "module",
    [
        "specenv.envs.replay",
        "specenv.envs.vector",
        "specenv.envs.render",
        "specenv.envs.caps",
        pytest.param("specenv.envs.live", marks=pytest.mark.slow),
    ],
)
def test_examples_run_as_doctests(module):
    if module == "specenv.envs.live":
        pytest.importorskip("transformers")
        pytest.importorskip("tokenizers")
    mod = importlib.import_module(module)
    printopts = np.get_printoptions()
    try:
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    finally:
        np.set_printoptions(**printopts)
    assert res.failed == 0
    assert res.attempted >= (3 if module in ("specenv.envs.render", "specenv.envs.caps") else 5)
