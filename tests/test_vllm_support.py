"""The (model runner x speculative method) table of the vLLM controller: every combination supported or refused.

No vLLM needed: :mod:`specenv.engines.vllm.support` reads a config's ``use_v2_model_runner`` and
``speculative_config.method``; fakes stand in for ``VllmConfig``. The expectations are what vLLM 0.32's
source does on each runner (see the module docstring), written out here one combination at a time.
"""

from __future__ import annotations

from itertools import product
from types import SimpleNamespace

import pytest

from specenv.engines.vllm.settings import SpecenvSettings
from specenv.engines.vllm.support import (
    METHODS,
    RUNNERS,
    SUPPORT,
    collect_refusal,
    runner_of,
    signals_refusal,
    start_refusal,
)


def _config(runner: str, method: str | None):
    spec = None if method is None else SimpleNamespace(method=method)
    return SimpleNamespace(use_v2_model_runner=runner == "V2", speculative_config=spec)


def test_the_table_has_every_combination():
    assert set(SUPPORT) == set(product(RUNNERS, METHODS))
    assert runner_of(_config("V1", "draft_model")) == "V1"
    assert runner_of(_config("V2", "eagle3")) == "V2"
    assert runner_of(SimpleNamespace()) == "V1"  # a config without the property (older vLLM): V1


# (runner, method) -> (signals served, policy horizon served, drafted token ids served)
EXPECTED = {
    ("V1", "draft_model"): (True, True, True),
    ("V1", "eagle3"): (True, True, True),
    ("V2", "draft_model"): (False, False, False),
    ("V2", "eagle3"): (False, False, False),
}


@pytest.mark.parametrize(("runner", "method"), sorted(EXPECTED))
def test_each_combination_supports_or_refuses_in_one_line(runner, method):
    signals, horizon, tokens = EXPECTED[(runner, method)]
    cfg = _config(runner, method)
    why = signals_refusal(runner, method)
    assert (why is None) == signals
    if why is not None:
        assert "\n" not in why and "V2" in why
    assert start_refusal(cfg, SpecenvSettings()) is None  # per-request k with the defaults: everywhere
    line = start_refusal(cfg, SpecenvSettings(draft_horizon="policy"))
    assert (line is None) == horizon
    if line is not None:
        assert "\n" not in line and f"{runner} model runner + {method}" in line and "draft_horizon" in line
    line = start_refusal(cfg, SpecenvSettings(record_tokens=True))
    assert (line is None) == tokens
    if line is not None:
        assert "\n" not in line and "record_tokens" in line and "placeholder" in line


def test_methods_outside_the_table():
    assert start_refusal(_config("V2", "ngram"), SpecenvSettings(draft_horizon="policy", record_tokens=True)) is None
    assert "ngram" in signals_refusal("V1", "ngram")
    assert signals_refusal("V1", None) == "the server does not speculate"
    assert start_refusal(_config("V1", None), SpecenvSettings(record_tokens=True)) is None


@pytest.mark.parametrize(("runner", "method"), list(product(RUNNERS, METHODS)))
def test_the_collector_runs_on_v1_only(runner, method):
    """The collector needs a per-step draft length, the draft ids and their signals: V1 gives all three."""
    line = collect_refusal(runner, method)
    assert (line is None) == (runner == "V1")
    if line is not None:
        assert "\n" not in line and f"{runner} model runner + {method}" in line and "VLLM_USE_V2_MODEL_RUNNER=0" in line
    assert "ngram" in collect_refusal(runner, "ngram")
