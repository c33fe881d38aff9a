"""Train the small models of the live CPU engine: a Qwen3-MoE target and a dense Qwen3 draft.

Everything is trained on this machine's CPU from the Python standard library's own source
(``sysconfig.get_paths()["stdlib"]``, every ``*.py`` file outside ``site-packages``, sorted; files that
are not UTF-8 are skipped), with a byte-level BPE tokenizer (vocab 2048) trained here too. Nothing is
downloaded. The output goes to ``specenv/data/models/small-moe-v1/``:

    tokenizer.json               byte-level BPE, vocab 2048, ``<|endoftext|>`` = id 0
    target/config.json, target/model.safetensors   Qwen3MoeForCausalLM (bf16 on disk)
    draft/config.json,  draft/model.safetensors    Qwen3ForCausalLM    (bf16 on disk)
    manifest.json                config, recipe, seed, sha256 per file, val losses, throughput

Recipe (all knobs are arguments and land in the manifest):

1. Split: a file is validation when ``int(sha256(relpath)[:8], 16) % 20 == 0`` (about 5 %). The live
   prompt set (``scripts/make_live_prompts.py``) is cut from validation files only.
2. Tokenizer: byte-level BPE (``tokenizers``), trained on the training files.
3. Target: next-token cross-entropy + the Switch load-balancing loss (coefficient 0.01) on random
   256-token windows, AdamW, warm-up then cosine decay, fixed number of steps.
4. The target is rounded to bf16 (what ships) before anything else uses it.
5. Distillation data: target greedy continuations (128 tokens) of 64-token windows of the training
   stream.
6. Draft: embedding (tied with its LM head) and final norm initialised from the target's, then trained
   with KL(target || draft) on the target's logits, alternating stdlib windows and the distillation
   sequences, so that it agrees with the target's greedy choice as often as possible (high acceptance).

Run: ``python scripts/train_small_models.py`` (about 10 minutes on 2 cores; run it in the background).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "specenv" / "data" / "models" / "small-moe-v1"
EOS = "<|endoftext|>"


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def sha256_file(p: Path) -> str:
    return sha256_bytes(p.read_bytes())


def stdlib_files() -> tuple[Path, list[tuple[str, str]]]:
    """Sorted (relpath, text) of the stdlib's UTF-8 *.py files outside site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in p.parts or "__pycache__" in p.parts:
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel, text))
    return root, out


def is_val(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 20 == 0


def train_tokenizer(texts: list[str], vocab: int):
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
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int16 if max(ids) < 32768 else np.int32)


def target_config(a):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab,
        hidden_size=a.d_model,
        num_hidden_layers=a.target_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=a.d_model // 4,
        intermediate_size=a.expert_ffn,
        moe_intermediate_size=a.expert_ffn,
        num_experts=a.experts,
        num_experts_per_tok=a.top_k,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        router_aux_loss_coef=a.aux_coef,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    # The attribute the MoE dispatch reads (transformers.integrations.moe.use_experts_implementation); a plain
    # ``experts_implementation`` attribute is ignored. Training uses grouped_mm (several times faster than the
    # per-expert loop on big batches); the live engine runs "eager" (see specenv.engines.hf.engine).
    cfg._experts_implementation = a.train_experts_impl
    return cfg


def draft_config(a):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.d_model,
        num_hidden_layers=a.draft_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=a.d_model // 4,
        intermediate_size=a.draft_ffn,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))


def windows(stream: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def val_loss(model, stream: np.ndarray, seq: int = 256, n: int = 48) -> float:
    model.eval()
    n = min(n, (len(stream) - 1) // seq)
    tot, cnt = 0.0, 0
    for i in range(0, n, 8):
        x = torch.stack(
            [torch.from_numpy(stream[j * seq : j * seq + seq + 1].astype(np.int64)) for j in range(i, min(n, i + 8))]
        )
        logits = model(input_ids=x[:, :-1]).logits
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def to_bf16_and_back(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def train_target(a, train: np.ndarray, val: np.ndarray, rec: dict):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(a.seed)
    model = Qwen3MoeForCausalLM(target_config(a))
    model.train()
    rng = np.random.default_rng([a.seed, 1])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0 = time.perf_counter()
    losses = []
    for step in range(a.target_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.target_steps, a.lr, a.warmup)
        x = windows(train, rng, a.batch, a.seq)
        out = model(input_ids=x[:, :-1], output_router_logits=True)
        logits = out.logits
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss = ce + a.aux_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(ce.item())
        if step % 50 == 0 or step == a.target_steps - 1:
            el = time.perf_counter() - t0
            log(
                f"target step {step} ce {np.mean(losses[-50:]):.3f} aux {out.aux_loss.item():.3f} "
                f"{(step + 1) * a.batch * a.seq / el:.0f} tok/s"
            )
    el = time.perf_counter() - t0
    rec["target_train_seconds"] = round(el, 1)
    rec["target_train_tokens"] = a.target_steps * a.batch * a.seq
    rec["target_train_tok_per_s"] = round(rec["target_train_tokens"] / el, 1)
    rec["target_final_train_ce"] = round(float(np.mean(losses[-50:])), 4)
    model.eval()
    model.config.output_router_logits = False
    return model


@torch.no_grad()
def distill_data(a, target, train: np.ndarray) -> np.ndarray:
    """Target greedy continuations of random 64-token windows of the training stream."""
    rng = np.random.default_rng([a.seed, 2])
    seqs = []
    t0 = time.perf_counter()
    for b in range(a.distill_batches):
        x = windows(train, rng, 64, 63)
        out = target.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=128,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        seqs.append(out.numpy())
        log(f"distill batch {b + 1}/{a.distill_batches} ({time.perf_counter() - t0:.0f}s)")
    return np.concatenate(seqs)


def train_draft(a, target, train: np.ndarray, gen: np.ndarray, val: np.ndarray, rec: dict):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(a.seed + 1)
    draft = Qwen3ForCausalLM(draft_config(a))
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
    draft.train()
    rng = np.random.default_rng([a.seed, 3])
    opt = torch.optim.AdamW(draft.parameters(), lr=a.draft_lr, betas=(0.9, 0.95), weight_decay=0.05)
    t0 = time.perf_counter()
    hist = []
    for step in range(a.draft_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.draft_steps, a.draft_lr, a.warmup)
        if step % 2 == 0:
            x = windows(train, rng, a.batch, a.seq)[:, :-1]
        else:
            x = torch.from_numpy(gen[rng.integers(0, len(gen), size=a.batch)].astype(np.int64))
        with torch.no_grad():
            tlog = target(input_ids=x).logits
        dlog = draft(input_ids=x).logits
        tp = F.log_softmax(tlog, -1)
        loss = F.kl_div(
            F.log_softmax(dlog, -1).reshape(-1, a.vocab),
            tp.reshape(-1, a.vocab),
            log_target=True,
            reduction="batchmean",
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        agree = (dlog.argmax(-1) == tlog.argmax(-1)).float().mean().item()
        hist.append((loss.item(), agree))
        if step % 50 == 0 or step == a.draft_steps - 1:
            h = np.array(hist[-50:])
            log(
                f"draft step {step} kl {h[:, 0].mean():.3f} top1-agree {h[:, 1].mean():.3f} "
                f"({time.perf_counter() - t0:.0f}s)"
            )
    rec["draft_train_seconds"] = round(time.perf_counter() - t0, 1)
    rec["draft_final_kl"] = round(float(np.mean([h[0] for h in hist[-50:]])), 4)
    draft.eval()
    return draft


@torch.no_grad()
def agreement(target, draft, seqs: np.ndarray) -> float:
    x = torch.from_numpy(seqs.astype(np.int64))
    return float((target(input_ids=x).logits.argmax(-1) == draft(input_ids=x).logits.argmax(-1))[:, 63:].float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared 2-core machine)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--target-layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-ffn", type=int, default=64)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-ffn", type=int, default=512)
    ap.add_argument("--train-experts-impl", default="grouped_mm", help="experts implementation while training")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--target-steps", type=int, default=500)
    ap.add_argument("--distill-batches", type=int, default=6)
    ap.add_argument("--draft-steps", type=int, default=200)
    ap.add_argument("--tokenizer-chars", type=int, default=12_000_000, help="chars of training text for BPE")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    rec: dict = {}
    t_all = time.perf_counter()
    root, files = stdlib_files()
    train_f = [(r, t) for r, t in files if not is_val(r)]
    val_f = [(r, t) for r, t in files if is_val(r)]
    listing = "\n".join(r for r, _ in files).encode()
    log(f"stdlib {root}: {len(files)} files ({len(train_f)} train, {len(val_f)} val)")

    # tokenizer on a deterministic prefix of the (sorted) training files
    tok_texts, n = [], 0
    for _, t in train_f:
        if n >= a.tokenizer_chars:
            break
        tok_texts.append(t)
        n += len(t)
    tok = train_tokenizer(tok_texts, a.vocab)
    assert tok.token_to_id(EOS) == 0 and tok.get_vocab_size() == a.vocab, tok.get_vocab_size()
    train = encode_stream(tok, [t for _, t in train_f])
    val = encode_stream(tok, [t for _, t in val_f])
    log(
        f"tokens: train {len(train)}, val {len(val)} ({sum(len(t) for _, t in files) / (len(train) + len(val)):.2f}"
        " chars/token)"
    )

    target = train_target(a, train, val, rec)
    rec["target_val_loss_fp32"] = round(val_loss(target, val), 4)
    to_bf16_and_back(target)
    rec["target_val_loss"] = round(val_loss(target, val), 4)
    log(f"target val loss {rec['target_val_loss']} (fp32 {rec['target_val_loss_fp32']})")

    gen = distill_data(a, target, train)
    draft = train_draft(a, target, train, gen, val, rec)
    to_bf16_and_back(draft)
    rec["draft_val_loss"] = round(val_loss(draft, val), 4)
    vgen = distill_data(argparse.Namespace(**{**vars(a), "distill_batches": 1, "seed": a.seed + 100}), target, val)
    rec["draft_target_greedy_agreement_val"] = round(agreement(target, draft, vgen), 4)
    log(
        f"draft val loss {rec['draft_val_loss']}, "
        f"agreement on target greedy text {rec['draft_target_greedy_agreement_val']}"
    )

    # ---- write the model folder (bf16 safetensors, no pickle)
    out: Path = a.out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    for name, m in (("target", target), ("draft", draft)):
        m.to(torch.bfloat16).save_pretrained(tmp / name, safe_serialization=True)
        m.to(torch.float32)
    files_meta = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            files_meta[p.relative_to(tmp).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    n_t = sum(p.numel() for p in target.parameters())
    n_d = sum(p.numel() for p in draft.parameters())
    manifest = {
        "name": "small-moe",
        "version": 1,
        "description": "Small Qwen3-MoE target and dense Qwen3 draft trained on CPU on the Python stdlib source "
        "by scripts/train_small_models.py; for the live CPU engine (specenv.engines.hf).",
        "seed": a.seed,
        "recipe": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "data": {
            "source": "Python standard library *.py (sysconfig stdlib path, site-packages excluded, UTF-8 only)",
            "python": platform.python_version(),
            "files": len(files),
            "train_files": len(train_f),
            "val_files": len(val_f),
            "file_list_sha256": sha256_bytes(listing),
            "split": "val iff int(sha256(relpath)[:8], 16) % 20 == 0",
            "train_tokens": int(len(train)),
            "val_tokens": int(len(val)),
        },
        "target": {
            "class": "Qwen3MoeForCausalLM",
            "params": n_t,
            "experts_implementation": "eager (inference)",
            "config": json.loads((tmp / "target" / "config.json").read_text()),
        },
        "draft": {
            "class": "Qwen3ForCausalLM",
            "params": n_d,
            "config": json.loads((tmp / "draft" / "config.json").read_text()),
        },
        "metrics": rec,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "files": files_meta,
        "total_seconds": round(time.perf_counter() - t_all, 1),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"wrote {out} ({size / 1e6:.2f} MB); target {n_t / 1e6:.2f}M params, draft {n_d / 1e6:.2f}M params")
    log(json.dumps(rec))


if __name__ == "__main__":
    sys.exit(main())
