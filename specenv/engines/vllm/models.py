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

Any other pair of Hugging Face folders (a MoE target with its tokenizer, and a draft of either
speculative method: a small model of the same vocabulary for ``draft_model``, an EAGLE-3 head for
``eagle3``) is named by :func:`vllm_pair_dirs`, which checks the pair as vLLM would need it and writes
nothing. A model set is one way of naming such a pair (``method="draft_model"``).
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
        source: The model set the view was made from (for a pair of folders: the target folder).
        method: The draft's speculative method (``speculative_config["method"]``): ``draft_model``
            (a model set's draft) or ``eagle3``.
    """

    @property
    def name(self) -> str:
        """The model set's id (its folder's name, e.g. ``small-moe-v1``): the served model name."""
        return self.source.name

    target: Path
    draft: Path
    max_model_len: int
    source: Path
    method: str = "draft_model"


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


def vllm_model_dirs(name_or_path: str | os.PathLike[str] | VLLMModelDirs = "small-moe-v1") -> VLLMModelDirs:
    """vLLM-ready target and draft folders of a model set.

    Args:
        name_or_path: Shipped model-set name or folder (with ``target/`` and ``draft/``); folders
            already resolved (:func:`vllm_pair_dirs`) are returned as they are.

    Raises:
        ValueError: If the set is missing, lacks a part, or its manifest or a config is malformed (all
            checked before anything is written: :func:`check_model_set`).
    """
    if isinstance(name_or_path, VLLMModelDirs):
        return name_or_path
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


#: Config fields that give a MoE layer's expert count (Qwen3-MoE/Mixtral, Qwen2-MoE, DeepSeek).
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
#: The tokenizer files vLLM loads from the target folder (``tokenizer=`` is the target).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _config(folder: Path, what: str) -> dict:
    """A model folder's ``config.json`` (its text part for a multimodal config), or one line naming what is wrong."""
    from specenv.validation import read_json

    if not folder.is_dir():
        raise ValueError(f"{what} {folder}: not a folder")
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{what} {folder}: no config.json (not a Hugging Face model folder)")
    cfg = read_json(path, what="model config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg


def n_experts_of(cfg: dict) -> int:
    """Experts per MoE layer of a model config (0 for a dense model)."""
    for name in EXPERT_FIELDS:
        n = cfg.get(name)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return 0


def _vocab(folder: Path) -> dict[str, int] | None:
    """The token -> id map of a folder's ``tokenizer.json`` (None when it has none)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as exc:  # tokenizers raises its own exception type on a malformed file
        raise ValueError(f"{path}: not a tokenizer file ({exc})") from None


def vllm_pair_dirs(
    target: str | os.PathLike[str], draft: str | os.PathLike[str], method: str = "draft_model"
) -> VLLMModelDirs:
    """A MoE target folder and a draft folder of a speculative method, checked for vLLM (nothing written).

    The target holds ``config.json``, its weights and its tokenizer (:data:`TOKENIZER_FILES`); its
    config names an expert count (:data:`EXPERT_FIELDS`: the routing tap records experts). The draft
    holds ``config.json`` with the target's ``vocab_size`` (an EAGLE-3 head's config keeps the
    target's vocabulary size beside its own ``draft_vocab_size``); a draft folder with its own
    ``tokenizer.json`` must map every token to the target's id.

    Args:
        target: The target model's folder.
        draft: The draft model's (``draft_model``) or EAGLE-3 head's (``eagle3``) folder.
        method: ``draft_model`` or ``eagle3``.

    Raises:
        ValueError: One line naming the folder or file: a missing folder, config or tokenizer file, a
            dense target, a draft of another vocabulary, an unknown method.
    """
    from specenv.engines.vllm.support import METHODS

    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {', '.join(METHODS)}")
    t, d = Path(os.fspath(target)), Path(os.fspath(draft))
    tcfg, dcfg = _config(t, "target"), _config(d, "draft")
    if not n_experts_of(tcfg):
        raise ValueError(
            f"target {t}: config.json names no experts ({'/'.join(EXPERT_FIELDS)}): not a mixture-of-experts model"
        )
    for f in TOKENIZER_FILES:
        if not (t / f).is_file():
            raise ValueError(f"target {t}: no {f} (vLLM loads the tokenizer from the target folder)")
    tv, dv = tcfg.get("vocab_size"), dcfg.get("vocab_size")
    if tv != dv:
        raise ValueError(f"draft {d}: vocab_size {dv!r}, the target's is {tv!r} (the draft must share its vocabulary)")
    dvocab = _vocab(d)
    if dvocab is not None and dvocab != _vocab(t):
        raise ValueError(f"draft {d}: its tokenizer.json maps tokens to other ids than the target's")
    return VLLMModelDirs(t, d, _max_len(t), t, method)
