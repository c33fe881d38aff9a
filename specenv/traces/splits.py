"""The deterministic train/test split of generations, shared by the environment, oracle and benchmark.

Rule (version 1), for a trace set with G distinct generation ids:

1. each id gets the key ``sha256(f"specenv-split-v1:{generation_id}")`` (bytes, compared as
   big-endian integers; ties, which sha256 makes practically impossible, go to the smaller id);
2. the ``n_test = round(0.2 * G)`` ids with the smallest keys form the *test* split (at least one
   when G >= 2, none when G = 1); the others form *train*; ``"all"`` is every generation.

The validation split (rule version 1 of the validation carve, for hyper-parameter searches such as
``specenv tune``) is carved from *train* only, never from test:

3. each train id gets a second key ``sha256(f"specenv-validation-v1:{generation_id}")``;
4. the ``n_validation = round(0.2 * G_train)`` train ids with the smallest second keys (at least one
   when G_train >= 2) form ``"train-val"``; the other train ids form ``"train-fit"``.

So ``train-fit`` + ``train-val`` = ``train`` exactly, ``test`` is untouched, and a search that fits on
``train-fit`` and chooses on ``train-val`` never reads a test generation.

So the split is exactly 80/20 (up to rounding), depends only on the set of ids (not on row order,
platform, Python hash seed or any random seed) and is the same on every machine. Adding generations
to a set can move a few existing test generations to train (the ones whose keys are now beyond the
20% cut) but never a train generation to test unless the set shrinks.

Everything that reports train or test numbers (the environment's ``split=`` argument, the oracle,
the benchmark) must call :func:`split_mask` / :func:`select_split` on the same trace set.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from specenv.traces.traceset import PositionArrays

#: Names accepted wherever a split is chosen (``train-fit`` + ``train-val`` = ``train``, carved for searches).
SPLITS: tuple[str, ...] = ("train", "test", "all", "train-fit", "train-val")
#: Share of generations in the test split.
TEST_FRACTION = 0.2
#: Salt of the hash; changing it defines a different split (bump the version).
SALT = "specenv-split-v1"
#: Salt of the validation carve inside train (its own rule version).
VALIDATION_SALT = "specenv-validation-v1"
#: Share of the train generations in the validation split.
VALIDATION_FRACTION = 0.2


def split_key(generation_id: int) -> bytes:
    """The sha256 key that orders generation ids for the split."""
    return hashlib.sha256(f"{SALT}:{int(generation_id)}".encode()).digest()


def n_test(n_generations: int) -> int:
    """Number of test generations in a set of ``n_generations`` distinct ids."""
    if n_generations < 2:
        return 0
    return max(1, int(round(TEST_FRACTION * n_generations)))


def check_split(split: str) -> str:
    """Return ``split`` if it is a known split name.

    Raises:
        ValueError: Naming the ``split`` argument when it is not one of :data:`SPLITS`.
    """
    if not isinstance(split, str) or split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
    return split


def _as_ids(generation_ids: Iterable[int] | np.ndarray) -> np.ndarray:
    ids = generation_ids if isinstance(generation_ids, np.ndarray) else np.asarray(list(generation_ids))
    return ids.astype(np.int64, copy=False)


def held_out_ids(generation_ids: Iterable[int] | np.ndarray) -> set[int]:
    """The ids of the test split of a set of generation ids (duplicates count once)."""
    unique = sorted({int(g) for g in _as_ids(generation_ids).tolist()})
    ranked = sorted(unique, key=lambda g: (split_key(g), g))
    return set(ranked[: n_test(len(unique))])


def validation_ids(generation_ids: Iterable[int] | np.ndarray) -> set[int]:
    """The ids of the validation split: carved from the train ids of the set, never from test."""
    unique = sorted({int(g) for g in _as_ids(generation_ids).tolist()})
    test = held_out_ids(unique)
    train = [g for g in unique if g not in test]
    if len(train) < 2:
        return set()
    n_val = max(1, int(round(VALIDATION_FRACTION * len(train))))
    key = lambda g: (hashlib.sha256(f"{VALIDATION_SALT}:{g}".encode()).digest(), g)  # noqa: E731
    return set(sorted(train, key=key)[:n_val])


def split_mask(generation_ids: Iterable[int] | np.ndarray, split: str) -> np.ndarray:
    """Boolean mask of the generations (given by id, in any order) that belong to ``split``.

    Args:
        generation_ids: All integer generation ids of the trace set (the split is a property of
            the whole set; see the module docstring).
        split: ``"train"``, ``"test"``, ``"all"``, ``"train-fit"`` or ``"train-val"``.

    Raises:
        ValueError: If ``split`` is unknown.
    """
    check_split(split)
    ids = _as_ids(generation_ids)
    if split == "all":
        return np.ones(len(ids), dtype=bool)
    if split in ("train-fit", "train-val"):
        val = validation_ids(ids)
        in_val = np.fromiter((g in val for g in ids.tolist()), dtype=bool, count=len(ids))
        return in_val if split == "train-val" else split_mask(ids, "train") & ~in_val
    test = held_out_ids(ids)
    in_test = np.fromiter((g in test for g in ids.tolist()), dtype=bool, count=len(ids))
    return in_test if split == "test" else ~in_test


def split_ids(generation_ids: Iterable[int] | np.ndarray, split: str) -> np.ndarray:
    """The generation ids of ``split``, in the order given."""
    ids = _as_ids(generation_ids)
    return ids[split_mask(ids, split)]


def select_split(arrays: PositionArrays, split: str) -> PositionArrays:
    """The positions restricted to the generations of ``split`` (order kept).

    Args:
        arrays: Packed positions of a whole trace set.
        split: One of :data:`SPLITS`.

    Raises:
        ValueError: If ``split`` is unknown.
    """
    if check_split(split) == "all":
        return arrays
    return arrays.select(np.flatnonzero(split_mask(arrays.generation_ids, split)))
