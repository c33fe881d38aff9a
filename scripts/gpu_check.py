"""GPU check of the cost model: verification passes of a Qwen3-30B-A3B-shaped MoE timed under CUDA graphs.

For a GPU machine with torch and transformers only (no vLLM, no network, no download): the target is
``Qwen3MoeForCausalLM`` built from a config of Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8,
hidden 2048, moe_intermediate 768, 32 query / 4 KV heads of 128, vocabulary 151,936) with random
bf16 weights, its experts run by transformers' ``grouped_mm`` implementation (no host synchronisation,
so the forward can be captured). The expert routing of every pass is read by the transformers engine's
router hooks (:class:`specenv.engines.hf.engine.RoutingRecorder`, its buffer on the GPU) and
``U_r`` computed as everywhere (:func:`specenv.engines.base.span_expert_stats`).

One cell per (K, context): a static KV cache holding ``context`` tokens (its content does not change
the work), the m = K + 1 verified positions behind it (the last committed token and K drafts; ``L``
= context + 1 committed tokens), one CUDA graph of the whole verification forward (routing, attention
over the cache, experts, logits) captured with ``torch.cuda.graph`` and replayed ``--reps`` times on
fresh random tokens (a random number of distinct ids among the m, so that ``U_r`` spreads at fixed
K), each replay timed by CUDA events. The rounds are fitted with the project's own per-K fit
(:func:`specenv.cost.fit.fit_per_k`: ``T_T = beta0 + alpha * U_r + c * L`` per K, clustered SEs, p values,
GroupKFold errors). ``alpha`` is ms per unit of ``U_r`` (the mean over layers of the experts loaded),
i.e. per ``n_layers`` expert-layers; the physical floor is one expert's weights (3 x hidden x
moe_intermediate x 2 bytes = 9.4 MB) at the HBM bandwidth (``--bandwidth-tbs``, 4.8 TB/s on an H200):
about 2 us per expert-layer. The JSON printed at the end (and written to ``--out``) has both.

``--tiny --device cpu`` runs the same code on a tiny model of the same family on CPU, with wall-clock
times and no graphs (CUDA graphs need CUDA); the test suite runs it end to end. On CUDA, if the
capture fails, the passes are timed without graphs and the JSON says so (``graphs: false`` and
``graph_error``).

    python scripts/gpu_check.py --out gpu_check.json                 # H200: a few minutes
    python scripts/gpu_check.py --tiny --device cpu --out /tmp/t.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: Qwen3-30B-A3B's shape (its config.json), without its weights.
FULL_SHAPE: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
#: A tiny model of the same family (CPU test).
TINY_SHAPE: dict[str, Any] = dict(
    FULL_SHAPE,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=1024,
)
FULL = {"ks": "0,1,2,3,4,5,6,7,8", "contexts": "512,1024,2048,4096", "reps": 40}
TINY = {"ks": "0,1,2,3", "contexts": "8,24", "reps": 6}


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{name}: {text!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 0:
        raise SystemExit(f"--{name}: {text!r}: need one or more integers >= 0")
    return sorted(set(out))


def build_target(shape: dict[str, Any], device: Any, dtype: Any, seed: int) -> Any:
    """``Qwen3MoeForCausalLM`` of ``shape`` with random weights, created on ``device`` (nothing is downloaded)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**shape)
    config._experts_implementation = "grouped_mm"  # no data-dependent host sync: capturable
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # created in bf16 on the device: 61 GB, never an fp32 copy
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def experts_implementation(model: Any) -> str | None:
    """The experts implementation transformers runs (``grouped_mm`` asked for; None on releases without the choice).

    Any other one loops over the experts hit with a host synchronisation, so its capture fails and the
    passes are timed without graphs (``graph_error``). On CPU ``aten::_grouped_mm`` itself reads the
    offsets on the host (no graphs there).
    """
    return getattr(model.config, "_experts_implementation", None)


class Cell:
    """One verification shape: m = K + 1 positions behind ``context`` cached tokens, optionally one CUDA graph."""

    def __init__(self, model: Any, K: int, context: int, graphs: bool):
        import torch
        from transformers import StaticCache

        self.model, self.m, self.context = model, K + 1, context
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.device = dev
        self.cache = StaticCache(config=model.config, max_cache_len=context + self.m)
        self.ids = torch.zeros((1, self.m), dtype=torch.long, device=dev)
        pos = torch.arange(context, context + self.m, device=dev)
        self.pos, self.cpos = pos[None, :].clone(), pos.clone()
        keys = torch.arange(context + self.m, device=dev)
        allowed = keys[None, :] <= pos[:, None]  # causal over the cache and the m new positions
        self.mask = torch.zeros((1, 1, self.m, context + self.m), dtype=dtype, device=dev)
        self.mask.masked_fill_(~allowed[None, None], torch.finfo(dtype).min)
        self.graph = None
        if graphs:
            self._capture()

    def rewind(self) -> None:
        """Put the cache's write position back at ``context`` (transformers' static cache advances a device
        counter on every update, also on a graph replay)."""
        for layer in self.cache.layers:
            length = getattr(layer, "cumulative_length", None)
            if length is not None:
                length.fill_(self.context)

    def forward(self) -> Any:
        import torch

        self.rewind()
        with torch.inference_mode():
            return self.model(
                input_ids=self.ids,
                position_ids=self.pos,
                cache_position=self.cpos,
                attention_mask=self.mask,
                past_key_values=self.cache,
                use_cache=True,
            ).logits

    def _capture(self) -> None:
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up (lazy cache and kernel initialisation) outside the capture
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.forward()
        self.graph = graph

    def run(self, tokens: np.ndarray, recorder: Any) -> tuple[np.ndarray, np.ndarray]:
        """Time one pass per row of ``tokens`` ``(reps, m)``; returns ``(ms, routing (reps, layers, m, top_k))``."""
        import torch

        reps = len(tokens)
        dev_tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        routing = torch.zeros((reps, *recorder.buf[:, : self.m].shape), dtype=recorder.buf.dtype, device=self.device)
        ms = np.zeros(reps)
        cuda = self.device.type == "cuda"
        if cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        if self.graph is None:
            self.forward()  # warm-up
        with torch.inference_mode():  # the cache's tensors are inference tensors
            self._loop(dev_tokens, routing, ms, events if cuda else None, recorder)
        if cuda:
            torch.cuda.synchronize()
            ms = np.array([a.elapsed_time(b) for a, b in events])
        return ms, routing.cpu().numpy()

    def _loop(self, dev_tokens: Any, routing: Any, ms: np.ndarray, events: Any, recorder: Any) -> None:
        cuda = events is not None
        for r in range(len(dev_tokens)):
            self.ids.copy_(dev_tokens[r : r + 1])
            if self.graph is not None:
                self.rewind()
            t0 = time.perf_counter()
            if cuda:
                events[r][0].record()
            if self.graph is not None:
                self.graph.replay()
            else:
                self.forward()
            if cuda:
                events[r][1].record()
            else:
                ms[r] = (time.perf_counter() - t0) * 1e3
            routing[r].copy_(recorder.buf[:, : self.m])


def draw_tokens(rng: np.random.Generator, reps: int, m: int, vocab: int) -> np.ndarray:
    """``(reps, m)`` token ids: per pass a random number of distinct ids (1..m) spread over the m positions."""
    out = np.empty((reps, m), dtype=np.int64)
    for r in range(reps):
        distinct = rng.choice(vocab, size=int(rng.integers(1, m + 1)), replace=False)
        out[r] = rng.choice(distinct, size=m)
    return out


def physical_floor_us(shape: dict[str, Any], bandwidth_tbs: float, dtype_bytes: int) -> float:
    """Microseconds to read one expert's weights (gate, up, down) at ``bandwidth_tbs``."""
    return 3 * shape["hidden_size"] * shape["moe_intermediate_size"] * dtype_bytes / (bandwidth_tbs * 1e12) * 1e6


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """Build the target, time every cell, fit; the JSON report."""
    import pandas as pd
    import torch
    import transformers

    from specenv.cost.fit import fit_per_k
    from specenv.engines.base import span_expert_stats
    from specenv.engines.hf.engine import RoutingRecorder

    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu with --tiny)")
    preset = TINY if args.tiny else FULL
    shape = TINY_SHAPE if args.tiny else FULL_SHAPE
    ks = _ints(args.ks or preset["ks"], "ks")
    contexts = _ints(args.contexts or preset["contexts"], "contexts")
    reps = int(args.reps or preset["reps"])
    if len(contexts) < 2:
        raise SystemExit("--contexts: the fit needs two or more context lengths")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_target(shape, device, dtype, args.seed)
    t_built = time.perf_counter()
    recorder = RoutingRecorder(model, max(ks) + 1)
    recorder.active = True
    n_layers, n_experts, top_k = len(recorder.gates), recorder.n_experts, recorder.top_k
    graphs = device.type == "cuda" and not args.no_graphs
    graph_error = None
    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, Any]] = []
    skipped: list[list[int]] = []
    for context in contexts:
        for K in ks:
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append([K, context])
                continue
            try:
                cell = Cell(model, K, context, graphs)
            except Exception as exc:  # a capture that fails: time without graphs, and say so
                if not graphs:
                    raise
                graphs, graph_error = False, f"{type(exc).__name__}: {exc}".splitlines()[0]
                print(f"gpu_check: CUDA graph capture failed ({graph_error}); timing without graphs", file=sys.stderr)
                torch.cuda.synchronize()
                cell = Cell(model, K, context, graphs)
            tokens = draw_tokens(rng, reps, K + 1, shape["vocab_size"])
            ms, routing = cell.run(tokens, recorder)
            print(
                f"gpu_check: K={K} context={context}: {np.median(ms):.3f} ms median of {reps}"
                f" ({'graph' if cell.graph is not None else 'eager'}, {time.perf_counter() - t_start:.0f} s)",
                file=sys.stderr,
            )
            U = [float(span_expert_stats(routing[r], [(0, K + 1)], n_experts)[0][0]) for r in range(reps)]
            for r in range(reps):
                rows.append({"generation_id": len(rows), "K": K, "L": context + 1, "U_r": U[r], "T_T_ms": float(ms[r])})
            del cell
    rounds = pd.DataFrame(rows)
    per_k = fit_per_k(rounds)
    floor = physical_floor_us(shape, args.bandwidth_tbs, 2)
    fits = []
    for rec in per_k.to_dict(orient="records"):
        alpha_us = float(rec["alpha"]) * 1e3 / n_layers  # ms per unit U_r = per n_layers expert-layers
        fits.append(
            {
                **{k: (v.item() if isinstance(v, np.generic) else v) for k, v in rec.items()},
                "alpha_us_per_expert_layer": alpha_us,
                "alpha_over_floor": alpha_us / floor,
            }
        )
    means = rounds.groupby("K").agg(T_T_ms=("T_T_ms", "mean"), U_r=("U_r", "mean"), N=("T_T_ms", "size"))
    return {
        "check": "gpu_check",
        "tiny": bool(args.tiny),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {k: shape[k] for k in ("num_hidden_layers", "num_experts", "num_experts_per_tok", "hidden_size")}
        | {"moe_intermediate_size": shape["moe_intermediate_size"], "vocab_size": shape["vocab_size"]},
        "experts_implementation": experts_implementation(model),
        "graphs": graphs,
        "graph_error": graph_error,
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
        "ks": ks,
        "contexts": contexts,
        "reps": reps,
        "rows": len(rows),
        "skipped_cells": skipped,
        "mean_by_K": {
            str(int(k)): {c: float(v[c]) for c in ("T_T_ms", "U_r")} | {"N": int(v["N"])} for k, v in means.iterrows()
        },
        "per_k": fits,
        "bandwidth_tbs": args.bandwidth_tbs,
        "floor_us_per_expert_layer": floor,
        "n_layers": n_layers,
        "top_k": top_k,
        "build_s": t_built - t_start,
        "wall_s": time.perf_counter() - t_start,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Command line: run the check, print its JSON, write it to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="Where to write the JSON report.")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny).")
    ap.add_argument("--tiny", action="store_true", help="A tiny model of the same family (CPU test).")
    ap.add_argument("--ks", default=None, help=f"Budgets K (default {FULL['ks']}; tiny {TINY['ks']}).")
    ap.add_argument(
        "--contexts", default=None, help=f"Cached tokens (default {FULL['contexts']}; tiny {TINY['contexts']})."
    )
    ap.add_argument(
        "--reps", type=int, default=None, help=f"Passes per cell (default {FULL['reps']}; tiny {TINY['reps']})."
    )
    ap.add_argument("--no-graphs", action="store_true", help="Time the passes without CUDA graphs.")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8).")
    ap.add_argument("--budget-s", type=float, default=480.0, help="Skip the remaining cells after this many seconds.")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.reps is not None and args.reps < 5:
        raise SystemExit(f"--reps {args.reps}: the per-K fit needs 5 or more passes per cell")
    report = run_check(args)
    from specenv.io import atomic_write_json

    atomic_write_json(Path(args.out), report)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
