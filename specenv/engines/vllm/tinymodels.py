"""Tiny randomly initialised models for testing the vLLM integration without any download.

:func:`build_tiny_models` writes, into one folder, a vLLM-ready model set:

    target/   Qwen3MoeForCausalLM (safetensors, float32) + tokenizer files
    draft/    Qwen3ForCausalLM with the same vocabulary   + tokenizer files
    tokenizer.json, tokenizer_config.json   byte-level BPE trained here on standard-library source

The weights are random but built so that speculation is neither hopeless nor trivial: target and
draft share the token embedding and an LM head that maps each token's embedding to a fixed successor
(a permutation of the vocabulary), and each model adds its own randomly scaled transformer layers on
top, so the two agree on the next token most of the time and disagree where their layers
(attention over the context, the target's routed experts) push the argmax elsewhere. The routers
are random too, so the expert routing depends on the context.

Needs torch, transformers and tokenizers (the ``live`` or ``vllm`` extra).
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"


def _stdlib_texts(max_chars: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    total = 0
    for p in sorted(root.glob("*.py")):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return out


def build_tokenizer(folder: Path, vocab: int = 512, max_chars: int = 400_000) -> Any:
    """Train a byte-level BPE tokenizer and write ``tokenizer.json`` + ``tokenizer_config.json``.

    Args:
        folder: Destination folder.
        vocab: Vocabulary size (``<|endoftext|>`` is id 0).
        max_chars: Characters of standard-library source to train on.

    Returns:
        The ``tokenizers.Tokenizer``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_texts(max_chars), trainer=trainer)
    write_tokenizer(tok, folder)
    return tok


def write_tokenizer(tok: Any, folder: Path) -> None:
    """Write a ``tokenizers.Tokenizer`` as the files ``transformers``/vLLM load (fast tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": EOS}) + "\n", encoding="utf-8"
    )


def build_tiny_models(
    folder: str | os.PathLike[str],
    vocab: int = 512,
    hidden: int = 64,
    target_layers: int = 2,
    draft_layers: int = 1,
    n_experts: int = 16,
    top_k: int = 2,
    layer_scale: float = 2.0,
    seed: int = 0,
) -> Path:
    """Build and save the tiny target/draft pair (see the module docstring).

    Args:
        folder: Destination (created).
        vocab: Vocabulary size of the tokenizer and both models.
        hidden: Hidden size of both models.
        target_layers: MoE layers of the target.
        draft_layers: Layers of the dense draft.
        n_experts: Experts per MoE layer.
        top_k: Experts per token.
        layer_scale: Scale of the layers' output projections relative to the embedding path;
            larger means more disagreement between draft and target (lower acceptance).
        seed: Torch seed.

    Returns:
        The folder.
    """
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab)
    gen = torch.Generator().manual_seed(seed)
    tcfg, dcfg = _tiny_configs(vocab, hidden, target_layers, draft_layers, n_experts, top_k)
    torch.manual_seed(seed)
    target = Qwen3MoeForCausalLM(tcfg).float().eval()
    draft = Qwen3ForCausalLM(dcfg).float().eval()
    _set_weights(target, draft, vocab, hidden, layer_scale, gen)
    manifest = {
        "name": "tiny-random-moe",
        "kind": "specenv.engines.vllm.tinymodels",
        "target": {"n_layers": target_layers, "n_experts": n_experts, "top_k": top_k, "hidden": hidden},
        "draft": {"n_layers": draft_layers},
        "vocab": vocab,
        "layer_scale": layer_scale,
        "seed": seed,
    }
    _save(out, target, draft, manifest)
    return out


def _tiny_configs(
    vocab: int, hidden: int, target_layers: int, draft_layers: int, n_experts: int, top_k: int
) -> tuple[Any, Any]:
    """The target's ``Qwen3MoeConfig`` and the draft's ``Qwen3Config`` (shared vocabulary, width and attention)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_attention_heads=max(hidden // 32, 1),
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        rms_norm_eps=1e-6,
    )
    tcfg = Qwen3MoeConfig(
        num_hidden_layers=target_layers,
        intermediate_size=4 * hidden,
        moe_intermediate_size=hidden,
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        **common,
    )
    dcfg = Qwen3Config(num_hidden_layers=draft_layers, intermediate_size=4 * hidden, **common)
    return tcfg, dcfg


def _set_weights(target: Any, draft: Any, vocab: int, hidden: int, layer_scale: float, gen: Any) -> None:
    """Overwrite both models' weights from ``gen`` (see the module docstring).

    Both share the embedding and an LM head that maps every token to a fixed successor; every other
    weight is random, the layers' output projections scaled by ``layer_scale`` (0.8 of it in the
    draft) and the MoE routers sharpened.
    """
    import torch

    emb = torch.randn(vocab, hidden, generator=gen)
    succ = torch.randperm(vocab, generator=gen)  # token t is followed by succ[t]
    head = torch.zeros(vocab, hidden)
    head[succ] = emb  # logit of succ[t] is large when the hidden state points along emb[t]
    with torch.no_grad():
        for model, scale in ((target, layer_scale), (draft, layer_scale * 0.8)):
            model.model.embed_tokens.weight.copy_(emb)
            model.lm_head.weight.copy_(head * 0.5)
            for name, p in model.named_parameters():
                if "embed_tokens" in name or "lm_head" in name or "norm" in name:
                    continue
                std = 1.0 / max(p.shape[-1], 1) ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
                if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                    p.mul_(scale)
                if name.endswith("gate.weight"):  # MoE router: sharper, context-dependent routing
                    p.mul_(4.0)


def _save(out: Path, target: Any, draft: Any, manifest: dict[str, Any]) -> None:
    """Write ``target/`` and ``draft/`` (weights and copies of the tokenizer files) and ``manifest.json``."""
    target.save_pretrained(out / "target", safe_serialization=True)
    draft.save_pretrained(out / "draft", safe_serialization=True)
    for sub in ("target", "draft"):
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (out / sub / f).write_bytes((out / f).read_bytes())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
