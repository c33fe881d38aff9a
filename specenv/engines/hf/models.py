"""The shipped small models of the live CPU engine, and the shipped prompt set.

``specenv/data/models/small-moe-v1/`` (package data, built by ``scripts/train_small_models.py``) holds a
byte-level BPE tokenizer, a Qwen3-MoE target and a dense Qwen3 draft as safetensors (bf16 on disk,
loaded as float32), plus a ``manifest.json`` with the sha256 of every file, checked on load. Loading
never touches the network (``local_files_only=True``) and never unpickles (``use_safetensors=True``).

``specenv/data/prompts/stdlib-code-v1.json`` (built by ``scripts/make_live_prompts.py``) holds code
prompts cut from held-out standard-library files, with a category each.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specenv.engines.hf.manifest import check_files, read_model_manifest
from specenv.io import not_regular, package_data

MODEL_NAME = "small-moe-v1"
PROMPT_SET = "stdlib-code-v1"
EOS_TOKEN = "<|endoftext|>"


def _shipped_ids() -> list[str]:
    """Ids (folder names, ``NAME-vN``) of the shipped model sets, sorted."""
    root = package_data("models")
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "manifest.json").is_file())


def _version_of(set_id: str, name: str) -> int | None:
    """N of ``NAME-vN``, else None."""
    rest = set_id[len(name) :]
    if set_id.startswith(name) and rest.startswith("-v") and rest[2:].isdigit():
        return int(rest[2:])
    return None


def _all_ids() -> list[str]:
    """Ids of the shipped model sets and of the derived ones (built from a shipped recipe), sorted."""
    from specenv.engines.hf.widen import derived_ids

    return sorted({*_shipped_ids(), *derived_ids()})


def model_dir(name_or_path: str | os.PathLike[str] = MODEL_NAME) -> Path:
    """Folder of a model set: a shipped id, a shipped name (its newest version) or a folder path.

    ``small-moe-v1`` names that version; ``small-moe`` the newest shipped ``small-moe-vN``. A derived set
    (``wide-moe-v1``: a recipe is shipped, the weights are built by ``specenv models --build``) resolves
    to its folder in the cache once built (:mod:`specenv.engines.hf.widen`).

    Raises:
        ValueError: If it is neither, or a derived set that is not built yet (the line says how).
    """
    key = os.fspath(name_or_path)
    if key and "/" not in key and "\\" not in key and key not in (".", ".."):
        ids = _all_ids()
        if key not in ids:
            versions = [(v, i) for i in ids if (v := _version_of(i, key)) is not None]
            key = max(versions)[1] if versions else key
        if key in _shipped_ids():
            return package_data("models", key)
        if key in ids:
            from specenv.engines.hf.widen import derived_dir, is_built, read_recipe

            if not is_built(key):
                size = (read_recipe(key) or {}).get("build_note", "")
                raise ValueError(
                    f"models={key!r}: derived model set not built yet; run `specenv models --build {key}`{size}"
                )
            return derived_dir(key)
    path = Path(key)
    if key and (path / "manifest.json").is_file():
        return path
    known = ", ".join(_all_ids()) or "none"
    raise ValueError(f"models={key!r}: not a shipped model set ({known}) nor a folder with manifest.json")


@dataclass(frozen=True)
class ModelSetInfo:
    """What ``specenv models`` lists about a model set (read from its manifest and configs, no torch).

    Attributes:
        id: Folder name (``small-moe-v1``), the name to pass to ``--models``.
        name: Manifest name (``small-moe``: resolves to the newest version).
        version: Manifest version.
        description: One line for people.
        target: ``layers``, ``experts``, ``top_k``, ``params`` and ``class`` of the target.
        draft: ``layers``, ``params`` and ``class`` of the draft.
        sha256: ``"ok"`` when every file matches the manifest, else the first problem
            (``"mismatch: FILE"`` or ``"missing: FILE"``).
        path: The folder.
    """

    id: str
    name: str
    version: int | None
    description: str
    target: dict[str, Any]
    draft: dict[str, Any]
    sha256: str
    path: Path

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return {
            "id": self.id,
            "name": self.name,
            "version": self.version,
            "description": self.description,
            "target": self.target,
            "draft": self.draft,
            "sha256": self.sha256,
            "path": str(self.path),
        }


def _part_info(path: Path, part: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Sizes of ``target`` or ``draft`` from its ``config.json`` (and the manifest's parameter count)."""
    from specenv.validation import read_json

    cfg = read_json(path / part / "config.json", what="model config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path / part / 'config.json'}: not a JSON object")
    ent = manifest.get(part) if isinstance(manifest.get(part), dict) else {}
    info: dict[str, Any] = {
        "class": (cfg.get("architectures") or [ent.get("class")])[0],
        "layers": cfg.get("num_hidden_layers"),
    }
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is not None:
        info["experts"] = experts
        info["top_k"] = cfg.get("num_experts_per_tok")
    info["params"] = ent.get("params")
    return info


def model_set_info(name_or_path: str | os.PathLike[str] = MODEL_NAME, verify: bool = True) -> ModelSetInfo:
    """Sizes and integrity of a model set (manifest and configs only: no torch, no weights loaded).

    Args:
        name_or_path: Shipped model-set id or name, or folder.
        verify: Check every file's sha256 against the manifest (else ``sha256="not checked"``).

    Raises:
        ValueError: Unknown set, or a malformed manifest or config (one line naming the file).
    """
    path = model_dir(name_or_path)
    manifest = read_model_manifest(path)
    status = (check_files(path, manifest) or "ok") if verify else "not checked"
    version = manifest.get("version")
    return ModelSetInfo(
        id=path.name,
        name=str(manifest.get("name") or path.name),
        version=version if isinstance(version, int) else None,
        description=str(manifest.get("description") or ""),
        target=_part_info(path, "target", manifest),
        draft=_part_info(path, "draft", manifest),
        sha256=status,
        path=path,
    )


def list_model_sets(verify: bool = True) -> list[ModelSetInfo]:
    """The shipped model sets and the derived sets already built (``specenv models``), sorted by id."""
    from specenv.engines.hf.widen import derived_ids, is_built

    ids = [*_shipped_ids(), *(i for i in derived_ids() if is_built(i))]
    return [model_set_info(i, verify=verify) for i in sorted(ids)]


@dataclass
class SmallModels:
    """Tokenizer, target and draft of the live engine, loaded for inference (eval, float32).

    Attributes:
        tokenizer: A ``tokenizers.Tokenizer`` (byte-level BPE).
        target: ``Qwen3MoeForCausalLM`` with ``config._experts_implementation == "eager"``.
        draft: ``Qwen3ForCausalLM``.
        manifest: The model set's manifest (recipe, metrics, file hashes).
        path: Folder it was loaded from.
        eos_id: Id of ``<|endoftext|>``.
    """

    tokenizer: Any
    target: Any
    draft: Any
    manifest: dict[str, Any]
    path: Path
    eos_id: int

    @property
    def n_layers(self) -> int:
        """MoE layers of the target."""
        return int(self.target.config.num_hidden_layers)

    @property
    def n_experts(self) -> int:
        """Experts per MoE layer."""
        return int(self.target.config.num_experts)

    @property
    def top_k(self) -> int:
        """Experts per token per layer."""
        return int(self.target.config.num_experts_per_tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of a text."""
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(list(ids))


_MODEL_CACHE: dict[str, SmallModels] = {}


def load_models(
    name_or_path: str | os.PathLike[str] = MODEL_NAME, verify: bool = True, cache: bool = True
) -> SmallModels:
    """Load the tokenizer, target and draft (offline, safetensors only).

    The target runs the "eager" experts implementation (a Python loop over the experts that the batch
    touches), so its time grows with the number of unique experts. It is set through
    ``config._experts_implementation``, the attribute the MoE forward dispatches on
    (``transformers.integrations.moe.use_experts_implementation``); this is checked after loading.

    Args:
        name_or_path: Shipped model-set name or folder.
        verify: Check every file's sha256 against the manifest.
        cache: Reuse an already loaded set (shared and read-only: the engines never modify weights).

    Raises:
        ValueError: Unknown name, missing file or hash mismatch.
        ImportError: If transformers/tokenizers are not installed (``pip install specenv[live]``).
    """
    path = model_dir(name_or_path)
    key = str(path.resolve())
    if cache and key in _MODEL_CACHE:
        return _MODEL_CACHE[key]
    manifest = read_model_manifest(path)  # checked before torch and transformers load (seconds)
    problem = check_files(path, manifest) if verify else None
    if problem is not None:
        kind, _, rel = problem.partition(": ")
        if kind == "missing":
            raise ValueError(f"{path / rel}: file named in the model manifest is missing")
        raise ValueError(f"{path / rel}: sha256 does not match the model manifest")
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = tok.token_to_id(EOS_TOKEN)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        common = dict(dtype=torch.float32, local_files_only=True, use_safetensors=True)
        target = Qwen3MoeForCausalLM.from_pretrained(path / "target", experts_implementation="eager", **common)
        draft = Qwen3ForCausalLM.from_pretrained(path / "draft", **common)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    target.config._experts_implementation = "eager"
    if target.config._experts_implementation != "eager":  # pragma: no cover - transformers API drift
        raise RuntimeError("could not select the eager experts implementation on the target")
    target.config.output_router_logits = False
    target.eval()
    draft.eval()
    for p in list(target.parameters()) + list(draft.parameters()):
        p.requires_grad_(False)
    models = SmallModels(tok, target, draft, manifest, path, int(eos) if eos is not None else -1)
    if cache:
        _MODEL_CACHE[key] = models
    return models


@dataclass(frozen=True)
class Prompt:
    """One prompt of the live prompt set.

    Attributes:
        id: Index in the set (used as the generation id).
        category: ``function_body``, ``class_method``, ``docstring`` or ``test_code``.
        text: The prompt text.
        file: Standard-library file it was cut from.
        line: Line of the function it was cut at.
    """

    id: int
    category: str
    text: str
    file: str = ""
    line: int = 0


def load_prompts(name_or_path: str | os.PathLike[str] = PROMPT_SET) -> list[Prompt]:
    """The prompts of a shipped prompt set (``stdlib-code-v1``) or of a JSON file of the same form.

    Raises:
        ValueError: Unknown name or malformed file (one line naming the file and the field:
            :mod:`specenv.validation` ``PromptSetJSON``; ids must be distinct).
    """
    key = os.fspath(name_or_path)
    path = Path(key)
    if (path.exists() or path.is_symlink()) and not path.is_dir():
        why = not_regular(path)  # a FIFO, device or dangling link where the prompts' JSON is named
        if why is not None:
            raise ValueError(f"prompts={key!r}: {path} {why}")
    if not path.is_file() and not path.is_dir():
        path = package_data("prompts", key if key.endswith(".json") else key + ".json")
        if not path.is_file():
            raise ValueError(f"prompts={key!r}: not a shipped prompt set ({PROMPT_SET}) nor a JSON file")
    from specenv.validation import check, read_json

    doc = check("PromptSetJSON", read_json(path, what="prompt set"), str(path))
    return [Prompt(p.id, p.category, p.text, p.file, p.line) for p in doc.prompts]


def copy_models(dest: Path, name_or_path: str | os.PathLike[str] = MODEL_NAME) -> Path:
    """Copy a model set folder to ``dest`` (for users who want to edit or retrain it)."""
    src = model_dir(name_or_path)
    shutil.copytree(src, dest)
    return dest
