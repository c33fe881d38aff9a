"""vLLM-ready folders for a model set (the shipped ``small-moe-v1`` or a folder of the same layout).

vLLM loads a model from one folder holding ``config.json``, the safetensors and the tokenizer files
(``tokenizer.json`` plus ``tokenizer_config.json`` for ``transformers``' fast tokenizer). The shipped
set keeps one ``tokenizer.json`` beside ``target/`` and ``draft/`` (see
:mod:`specenv.engines.hf.models`), so :func:`vllm_model_dirs` builds a *view*: a folder in the user's cache
(:func:`specenv.io.cache_dir`, never inside the package) with symbolic links to the
weights and configs and the two tokenizer files, keyed by the sha256 of the set's manifest and the
view's format (:data:`VIEW_FORMAT`: a change of the written files rebuilds old views). The
``tokenizer_config.json`` written there carries a ChatML-style chat template (:data:`CHAT_TEMPLATE`),
so that vLLM's ``/v1/chat/completions`` works with the shipped tokenizer (which has none). Folders
that are already vLLM-ready (``target/tokenizer_config.json`` present, e.g. from
:func:`specenv.engines.vllm.tinymodels.build_tiny_models`) are returned as they are.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specenv.io import atomic_dir, atomic_write_json, cache_dir

EOS = "<|endoftext|>"
#: Format of the view's files; part of the view's folder key (2: the chat template was added).
VIEW_FORMAT = 2
#: ChatML-style template of the shipped tokenizer (its markers are plain text to the byte-level BPE).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class VLLMModelDirs:
    """Folders to pass to vLLM.

    Attributes:
        target: ``model=`` (and ``tokenizer=``) of the engine.
        draft: ``speculative_config["model"]`` for the draft-model method.
        max_model_len: The target's ``max_position_embeddings``.
        source: The model set the view was made from.
    """

    @property
    def name(self) -> str:
        """The model set's id (its folder's name, e.g. ``small-moe-v1``): the served model name."""
        return self.source.name

    target: Path
    draft: Path
    max_model_len: int
    source: Path


def _max_len(target: Path) -> int:
    """The ``max_position_embeddings`` of a model folder's ``config.json`` (2048 when absent).

    Raises:
        ValueError: One line naming the file when it is not a JSON object or the field not a positive integer.
    """
    from specenv.validation import read_json

    path = target / "config.json"
    cfg = read_json(path, what="model config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    n = cfg.get("max_position_embeddings", 2048)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{path}: max_position_embeddings must be a positive integer, got {n!r}")
    return n


def _is_ready(p: Path) -> bool:
    return (p / "target" / "tokenizer_config.json").is_file() and (p / "draft" / "config.json").is_file()


def check_model_set(name_or_path: str | os.PathLike[str] = "small-moe-v1") -> Path:
    """Check a model set as :func:`vllm_model_dirs` would, writing nothing; returns its target folder.

    Raises:
        ValueError: If the set is missing, lacks a part, or its manifest or a config is malformed.
    """
    p = Path(os.fspath(name_or_path))
    if _is_ready(p):
        _max_len(p / "target")
        return p / "target"
    from specenv.engines.hf.models import model_dir, read_model_manifest

    src = model_dir(name_or_path)
    for part in ("target/config.json", "draft/config.json", "tokenizer.json", "manifest.json"):
        if not (src / part).is_file():
            raise ValueError(f"{src}: model set lacks {part}")
    read_model_manifest(src)
    _max_len(src / "target")
    _max_len(src / "draft")
    return src / "target"


def vllm_model_dirs(name_or_path: str | os.PathLike[str] = "small-moe-v1") -> VLLMModelDirs:
    """vLLM-ready target and draft folders of a model set.

    Args:
        name_or_path: Shipped model-set name or folder (with ``target/`` and ``draft/``).

    Raises:
        ValueError: If the set is missing, lacks a part, or its manifest or a config is malformed (all
            checked before anything is written: :func:`check_model_set`).
    """
    src = check_model_set(name_or_path).parent
    max_len = _max_len(src / "target")
    if _is_ready(src):
        return VLLMModelDirs(src / "target", src / "draft", max_len, src)
    # the source folder is part of the key: the view links into it, and another checkout (or a removed
    # one) of the same set must not share, or break, this view
    key = f"specenv.vllm-view/{VIEW_FORMAT}\n{src.resolve()}\n".encode() + (src / "manifest.json").read_bytes()
    digest = hashlib.sha256(key).hexdigest()[:16]
    base = cache_dir()
    if base is None:  # disk cache disabled: a private temporary folder for this process
        base = Path(tempfile.mkdtemp(prefix="specenv-"))
    view = base / "vllm-models" / f"{src.name}-{digest}"
    # a view whose links dangle (its source folder moved or was deleted, e.g. another checkout) is rebuilt
    intact = all((view / sub / f).exists() for sub in ("target", "draft") for f in ("config.json", "tokenizer.json"))
    if not (view / "draft" / "tokenizer_config.json").is_file() or not intact:
        view.parent.mkdir(parents=True, exist_ok=True)
        with atomic_dir(view, replace=True) as tmp:
            cfg = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": EOS,
                "model_max_length": max_len,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            }
            for sub in ("target", "draft"):
                (tmp / sub).mkdir()
                for f in (src / sub).iterdir():
                    if f.is_file():
                        (tmp / sub / f.name).symlink_to(f.resolve())
                (tmp / sub / "tokenizer.json").symlink_to((src / "tokenizer.json").resolve())
                atomic_write_json(tmp / sub / "tokenizer_config.json", cfg)
    return VLLMModelDirs(view / "target", view / "draft", max_len, src)
