"""Policies: heuristics, the peers' controllers, learners, the batch and caps families, the benchmark.

:func:`shipped_policy_dir` names the folder of the policies shipped with the package (package data).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["shipped_policy_dir"]


def shipped_policy_dir(dataset: Any = None) -> Path:
    """Folder of the policies shipped with the package: ``policies/shipped``, or ``policies/shipped/<set id>``.

    Args:
        dataset: A registered trace set name (``paper-default``, ``live-cpu-v2``): the folder of the
            policies trained on its train split, ``policies/shipped/<name>-v<version>``; None: the root.
            A trace-set folder has no shipped policies (the returned folder does not exist). A loaded
            :class:`~specenv.traces.traceset.TraceSet` stands for its manifest name.
    """
    root = Path(str(resources.files("policies").joinpath("shipped")))
    if dataset is None:
        return root
    from specenv.traces.datasets import find_dataset
    from specenv.traces.traceset import TraceSet

    ds = find_dataset(str(dataset.manifest.name if isinstance(dataset, TraceSet) else dataset))
    return root / (ds.id if ds is not None else "(no shipped policies for a trace-set folder)")
