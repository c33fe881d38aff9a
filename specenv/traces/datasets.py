"""Named, versioned trace sets (CompilerGym-style registry) and resolution of user paths.

A registry entry names a folder of package data (read through :mod:`importlib.resources`) and the
sha256 of its manifest; the manifest in turn carries the sha256 of every table, so a shipped set is
checked end to end on load. Every command also accepts a plain folder path (a user's own traces).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specenv.io import package_data, sha256_file
from specenv.traces.traceset import MANIFEST, TraceSet


@dataclass(frozen=True)
class Dataset:
    """A shipped trace set.

    Attributes:
        name: Short name (``paper-default``).
        version: Integer version; ``name-vN`` names one version exactly.
        description: One line for people.
        folder: Folder under ``specenv/data``.
        manifest_sha256: sha256 of the folder's ``manifest.json``.
    """

    name: str
    version: int
    description: str
    folder: str
    manifest_sha256: str

    @property
    def id(self) -> str:
        """``name-vN``."""
        return f"{self.name}-v{self.version}"


#: The shipped trace sets. Regenerate with ``scripts/make_default_data.py``, which prints the entry.
#: A changed set is a new version; a name alone resolves to its newest version. Version 1 of both sets
#: (trace schema v1) was replaced by version 2, which adds the draft's entropy and margin and keeps
#: every v1 column bit for bit (traces/README.md); ``name-v1`` is no longer shipped.
REGISTRY: tuple[Dataset, ...] = (
    Dataset(
        name="paper-default",
        version=2,
        description="128 paper-profile generations (Qwen3-Coder-30B-A3B + EAGLE-3 calibration), Kmax=10, T=0.7; "
        "trace schema v2 (draft entropy and margin)",
        folder="paper-default-v2",
        manifest_sha256="6bb750dc8c3d7e8229cd8556c07a8b8b6387f726a26f8815f2cde7cfee204e92",
    ),
    Dataset(
        name="live-cpu",
        version=2,
        description="64 stdlib code prompts x 128 greedy tokens on the live CPU engine (small Qwen3-MoE, 64 experts "
        "top-4, 6 layers + dense draft), Kmax=8, measured rounds K=0..8; trace schema v2 (positions re-collected)",
        folder="live-cpu-v2",
        manifest_sha256="0a2b8989f7ebf98e1eafbaf938934d3e2499932bfc0dc0dd2d3b6ee545e2c750",
    ),
    Dataset(
        name="live-vllm",
        version=1,
        description="16 stdlib code prompts x 128 greedy tokens collected with vLLM 0.32 on CPU (the shipped small "
        "Qwen3-MoE + dense draft as vLLM's draft_model), Kmax=8, measured rounds K=0..8 and the counterfactual "
        "positions from vLLM (trace schema v2)",
        folder="live-vllm-v1",
        manifest_sha256="2adeb0b98c2531666133d4e439a8ff12c6dc4156229649aefee049547a6b37dc",
    ),
    Dataset(
        name="live-vllm-wide",
        version=1,
        description="48 stdlib code prompts x 128 greedy tokens collected with vLLM 0.32 on CPU on wide-moe-v1 (the "
        "small Qwen3-MoE target with every expert widened by zeros to 3072: verification pays for the experts it "
        "reads, the paper's regime) + the dense draft, Kmax=8, measured rounds K=0..8 with whole-step wall times, a "
        "plain engine's steps as the AR reference (the step-time cost model), counterfactual positions from vLLM; "
        "every engine's weights on transparent huge pages, collected on a quiet machine (load ~1). "
        "Made by: specenv collect --engine vllm --models wide-moe-v1 -n 48 --max-new-tokens 128 --kmax 8 "
        "--name live-vllm-wide",
        folder="live-vllm-wide-v1",
        manifest_sha256="3b02a64ac8f314b06af78f895f7463d36501eecdf66b3c8b84e632fd666e1bfa",
    ),
    Dataset(
        name="live-vllm-t07",
        version=1,
        description="16 stdlib code prompts x 64 tokens sampled at T=0.7 (seed 0) with vLLM 0.32 on CPU (the shipped "
        "small Qwen3-MoE + dense draft as vLLM's draft_model), Kmax=8: reference sampled by the target alone, every "
        "draft chain drawn from the draft at T, rho = min(1, p/q) from the two models' probabilities at T (exact, no "
        "sampling noise), the sampled chains as columns draft_1..draft_8; measured rounds K=0..8 (vLLM's speculative "
        "sampling: times and routing for the cost fit; their accepted are not acceptance data) and a plain "
        "engine's steps, on a shared machine (load 4.7 before, 17 after: the times are noisy). "
        "Made by: specenv collect --engine vllm -n 16 --kmax 8 --max-new-tokens 64 --temperature 0.7 --seed 0 "
        "--name live-vllm-t07",
        folder="live-vllm-t07-v1",
        manifest_sha256="b851dab4507d7b796ab912fb404a5159d57ed72b61c5f8508c2e68230818a45b",
    ),
    Dataset(
        name="live-cpu-caps",
        version=1,
        description="32 stdlib code prompts x 64 greedy tokens on the live CPU engine with verification-time expert "
        "caps 11, 15, 18 (quartiles of the train split's per-layer union at K=8; trace extension caps-v1): capped "
        "verdict, U, token mismatches and log-prob gap per (position, k, cap); rounds K=0..8 uncapped and K=1..8 "
        "per cap. "
        "Made by: specenv collect --engine hf --caps auto -n 32 --max-new-tokens 64 --kmax 8 --name live-cpu-caps",
        folder="live-cpu-caps-v1",
        manifest_sha256="3724a1da058aa6ba4a315f82e5ac37a128226b06fffe9a6a83e26024d710cd86",
    ),
)

DEFAULT_DATASET = "paper-default"


def list_datasets() -> list[Dataset]:
    """All registered trace sets."""
    return list(REGISTRY)


def find_dataset(name: str) -> Dataset | None:
    """The registry entry for ``name`` (latest version) or ``name-vN`` (exact), else None."""
    exact = [d for d in REGISTRY if d.id == name]
    if exact:
        return exact[0]
    same = sorted((d for d in REGISTRY if d.name == name), key=lambda d: d.version)
    return same[-1] if same else None


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """Folder of a registered set (by name) or of a user's trace set (by path).

    Raises:
        ValueError: If it is neither a registered name nor an existing folder, or a shipped set's
            manifest does not match its registry hash.
    """
    key = os.fspath(name_or_path)
    ds = find_dataset(key)
    if ds is not None:
        path = package_data(ds.folder)
        got = sha256_file(path / MANIFEST)
        if got != ds.manifest_sha256:
            raise ValueError(f"dataset '{ds.id}': manifest sha256 {got[:12]}... does not match the registry")
        return path
    path = Path(key)
    if path.is_dir():
        return path
    known = ", ".join(d.id for d in REGISTRY)
    raise ValueError(f"dataset '{key}': not a registered name ({known}) nor an existing folder")


_CACHE: dict[tuple[str, str], TraceSet] = {}


def load_dataset(name_or_path: str | os.PathLike[str], cache: bool = True) -> TraceSet:
    """Load and validate a trace set by registry name or folder path.

    Loaded sets are cached by (folder, manifest sha256) so that making many environments on one data
    set reads it once; the cached object is shared and must be treated as read-only.
    """
    path = resolve(name_or_path)
    if not cache:
        return TraceSet.load(path)
    mpath = path / MANIFEST
    key = (str(path.resolve()), sha256_file(mpath) if mpath.is_file() else "")
    if key not in _CACHE:
        _CACHE[key] = TraceSet.load(path)
    return _CACHE[key]


def install_dataset_files(ts: TraceSet, dest: Path) -> str:
    """Save a set into the package-data folder ``dest`` and return its manifest sha256.

    An existing ``dest`` must be a trace set: it is replaced in one atomic exchange (:meth:`TraceSet.save`).
    """
    ts.save(dest, overwrite=os.path.lexists(dest))
    return sha256_file(dest / MANIFEST)
