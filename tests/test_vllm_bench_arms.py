"""``scripts/vllm_bench.py overhead``: the arms it builds (no engine started)."""

from __future__ import annotations

import argparse

import pytest

from scripts.vllm_bench import _overhead_arms


def _args(arms: list[str]) -> argparse.Namespace:
    return argparse.Namespace(models="wide-moe-v1", batch=[1, 8], k=3, kmax=8, tokens=48, arms=arms, base_src=None)


def test_an_arm_and_a_number_is_another_engine_of_that_arm(tmp_path):
    got = _overhead_arms(_args(["stock", "stock3", "ctl", "ctl2", "specenv", "specenv2"]), tmp_path)
    assert list(got) == ["stock", "stock3", "ctl", "ctl2", "specenv", "specenv2"]
    assert got["stock3"] == got["stock"] and got["stock"][0]["controller"] is False
    assert got["ctl2"] == got["ctl"] and got["ctl"][0]["k"] == 3
    # a recording arm's copy records into a folder of its own, all else equal
    (cfg, pol), (cfg2, pol2) = got["specenv"], got["specenv2"]
    assert pol2 == pol and cfg2["settings"]["record"] == str(tmp_path / "rec-specenv2")
    assert cfg["settings"]["record"] == str(tmp_path / "rec")
    assert {**cfg2, "settings": {**cfg2["settings"], "record": "x"}} == {
        **cfg,
        "settings": {**cfg["settings"], "record": "x"},
    }


@pytest.mark.parametrize("arms", [["stock", "foo2"], ["stock", "2"], ["stock", "ctlx"]])
def test_an_unknown_arm_is_refused(tmp_path, arms):
    with pytest.raises(SystemExit, match="unknown arm"):
        _overhead_arms(_args(arms), tmp_path)
