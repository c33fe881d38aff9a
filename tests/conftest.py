"""Shared fixtures: small generated trace sets written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specenv.generator import generate_paper
from specenv.traces.traceset import TraceSet

# The suite never writes to the user's cache folder (fitted cost models, vLLM model views): it uses the
# checkout's own ignored `.test-cache/` unless the caller chose one (subprocesses inherit it). Entries are
# keyed by content and verified on read, so a warm cache changes no result, only the time.
os.environ.setdefault("SPECENV_CACHE", str(Path(__file__).resolve().parents[1] / ".test-cache"))


@pytest.fixture(scope="session")
def small_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small stochastic paper-profile set (both tables) on disk."""
    path = tmp_path_factory.mktemp("traces") / "small"
    generate_paper(8, kmax=6, seed=3, name="small").save(path)
    return path


@pytest.fixture(scope="session")
def small_greedy_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small greedy (rho in {0,1}) paper-profile set on disk."""
    path = tmp_path_factory.mktemp("traces") / "small-greedy"
    generate_paper(6, kmax=6, seed=5, greedy=True, name="small-greedy").save(path)
    return path


@pytest.fixture(scope="session")
def small_set(small_traces: Path) -> TraceSet:
    """The small stochastic set, loaded."""
    return TraceSet.load(small_traces)
