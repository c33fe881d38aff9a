"""vLLM-ready folders for a model set (the shipped ``small-moe-v1`` or a folder of the same layout).

vLLM loads a model from one folder holding ``config.json``, the safetensors and the tokenizer files
(``tokenizer.json`` plus ``tokenizer_config.json`` for ``transformers``' fast tokenizer). The shipped
set keeps one ``tokenizer.json`` beside ``target/`` and ``draft/`` (see
:mod:`specenv.engines.hf.models`), so :func:`vllm_model_dirs` builds a *view*: a folder in the user's cache
(:func:`specenv.io.cache_dir`, never inside the package) with symbolic links to the
weights and configs and the two tokenizer files, keyed by the sha256 of the set's manifest. Folders
that are already vLLM-ready (``target/tokenizer_config.json`` present, e.g. from
:func:`specenv.engines.vllm.tinymodels.build_tiny_models`) are returned as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specenv.io import atomic_dir, atomic_write_json, cache_dir

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class VLLMModelDirs:
    """Folders to pass to vLLM.

    Attributes:
        target: ``model=`` (and ``tokenizer=``) of the engine.
        draft: ``speculative_config["model"]`` for the draft-model method.
        max_model_len: The target's ``max_position_embeddings``.
        source: The model set the view was made from.
    """

    target: Path
    draft: Path
    max_model_len: int
    source: Path


def _max_len(target: Path) -> int:
    cfg = json.loads((target / "config.json").read_text(encoding="utf-8"))
    return int(cfg.get("max_position_embeddings", 2048))


def vllm_model_dirs(name_or_path: str | os.PathLike[str] = "small-moe-v1") -> VLLMModelDirs:
    """vLLM-ready target and draft folders of a model set.

    Args:
        name_or_path: Shipped model-set name or folder (with ``target/`` and ``draft/``).

    Raises:
        ValueError: If the set is missing or lacks a part.
    """
    p = Path(os.fspath(name_or_path))
    if (p / "target" / "tokenizer_config.json").is_file() and (p / "draft" / "config.json").is_file():
        return VLLMModelDirs(p / "target", p / "draft", _max_len(p / "target"), p)
    from specenv.engines.hf.models import model_dir

    src = model_dir(name_or_path)
    for part in ("target/config.json", "draft/config.json", "tokenizer.json", "manifest.json"):
        if not (src / part).is_file():
            raise ValueError(f"{src}: model set lacks {part}")
    digest = hashlib.sha256((src / "manifest.json").read_bytes()).hexdigest()[:16]
    base = cache_dir()
    if base is None:  # disk cache disabled: a private temporary folder for this process
        base = Path(tempfile.mkdtemp(prefix="specenv-"))
    view = base / "vllm-models" / f"{src.name}-{digest}"
    if not (view / "draft" / "tokenizer_config.json").is_file():
        view.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(view, replace=True) as tmp:
            cfg = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "model_max_length": _max_len(src / "target"),
                "clean_up_tokenization_spaces": False,
            }
            for sub in ("target", "draft"):
                (tmp / sub).mkdir()
                for f in (src / sub).iterdir():
                    if f.is_file():
                        (tmp / sub / f.name).symlink_to(f.resolve())
                (tmp / sub / "tokenizer.json").symlink_to((src / "tokenizer.json").resolve())
                atomic_write_json(tmp / sub / "tokenizer_config.json", cfg)
    return VLLMModelDirs(view / "target", view / "draft", _max_len(src / "target"), src)
