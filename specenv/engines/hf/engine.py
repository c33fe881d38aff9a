"""Real speculative decoding on CPU with transformers: draft, verify in one target pass, roll back.

:class:`LiveEngine` runs one generation at a time (batch 1) on the shipped small models
(:func:`specenv.engines.hf.models.load_models`): a dense Qwen3 draft proposes tokens, the Qwen3-MoE target
verifies the last committed token plus k drafts in **one** forward pass with its KV cache, the
accepted prefix is committed and both ``DynamicCache`` objects are cropped back. k = 0 is plain
autoregressive decoding through the same path (m = 1, no draft call).

Round protocol. With n tokens committed (prompt + generated), the target cache
holds the first n-1 of them (the last committed token is always fed again), so every verification
feeds exactly m = k+1 tokens:

1. draft (timed as ``T_D``): the draft feeds whatever committed tokens its cache lacks, then proposes
   greedily (or samples, temperature > 0) one token per forward, k forwards in all, recording its
   probability q of every drafted token and the entropy and top-1/top-2 margin of the distribution
   it drew it from (:func:`draft_signals`; trace schema v2);
2. verify (timed as ``T_T``): one target forward over ``[last, d_1..d_k]``; greedy: accept the
   longest prefix of drafts equal to the target's argmax, then commit the target's own next token;
   temperature > 0: standard speculative rejection sampling (accept d_j with probability
   min(1, p/q), else resample from normalise(max(p - q, 0)); bonus token from p when all pass),
   which leaves the target's sampling distribution unchanged;
3. roll back: crop the target cache by k - a and the draft cache to the accepted prefix.

Routing: a forward hook on every MoE router (``layer.mlp.gate``, a ``Qwen3MoeTopKRouter`` whose
forward returns ``(router_logits, top_k_weights, top_k_indices)``) copies the top-k expert ids of the
verified positions into a preallocated ``(n_layers, kmax+1, top_k)`` buffer; hooks are inactive
during prefill. ``U_r`` = mean over layers of the number of unique experts across the m positions,
``E_max`` = mean over layers of the largest number of the m positions routed to one expert.

Expert cap (``expert_cap=B``, off by default; MoE-Spec's verification-time budget). In a
verification pass with k >= 1 drafts, the same router hook rewrites each MoE layer's routing before
the experts run: over the m = k+1 verified positions, every expert is scored by its summed routing
weight (the top-k weights of the positions that selected it), the B best are kept (ties: the lower
expert id), and each position keeps those of its own top-k experts that survive, their weights
rescaled to the row's original total (1 with ``norm_topk_prob``). A position whose top-k experts are
all dropped uses the kept experts instead: its router logits restricted to the kept set, the top
``min(top_k, B)`` of them by probability, rescaled the same way. Freed slots point at one of the
position's kept experts with weight 0 (no extra expert is loaded, the output is unchanged by them).
When the union already has at most B experts, the routing is left untouched bit for bit. Plain
decoding (k = 0), prefill and the counterfactual :meth:`LiveEngine.sweep` are never capped. The
recorded routing, hence ``U_r`` and ``E_max``, is the capped one: the experts actually loaded, so
``U_r <= B``. A capped pass changes the target's logits: **capped engines are not lossless** (the
output may differ from plain greedy), and every lossless test runs with the cap off.

Timing: ``time.perf_counter`` around each phase, including the model's Python overhead and the
cache crop of that model (what a real server pays); ``T_T_ms``/``T_D_ms`` are these wall-clock
times. The CPU time of the calling thread (``time.thread_time``) is recorded alongside
(``T_T_cpu_ms``/``T_D_cpu_ms``): with one torch thread it is the same work minus the time the
process was descheduled, i.e. robust to other processes on the machine. ``torch.set_num_threads(threads)`` is applied at
construction (a process-wide setting; default 1 thread: these models are so small that every op is
dominated by dispatch overhead, a second thread only adds synchronisation, and one thread is far
less disturbed by other processes on a 2-core machine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specenv.engines.base import RoundResult, prefix_expert_stats, run_fixed_k
from specenv.engines.hf.models import SmallModels, load_models


def draft_signals(probs: Any) -> tuple[float, float]:
    """Entropy (nats) and top-1 minus top-2 probability of one draft distribution (trace schema v2).

    Computed in float64 from the distribution the token was drawn from (the softmax of the logits
    when greedy, of the tempered logits when sampling). For any token of probability q in it the
    margin is >= 2q - 1 and the entropy is >= the binary entropy of q.

    Args:
        probs: ``(vocab,)`` torch tensor of probabilities.

    Returns:
        ``(entropy, margin)``: entropy in [0, log(vocab)], margin in [0, 1].
    """
    import torch

    p = probs.double()
    ent = float(torch.special.entr(p).sum())
    top = torch.topk(p, 2).values.tolist() if p.numel() > 1 else [float(p[0]), 0.0]
    return max(ent, 0.0), min(max(top[0] - top[1], 0.0), 1.0)


def cap_routing(logits: Any, weights: Any, idx: Any, cap: int) -> tuple[Any, Any] | None:
    """The routing of one MoE layer under a verification-time expert cap (module docstring).

    Args:
        logits: ``(m, n_experts)`` router logits of the verified positions.
        weights: ``(m, top_k)`` routing weights the router chose.
        idx: ``(m, top_k)`` expert ids the router chose.
        cap: Experts kept, B >= 1.

    Returns:
        ``(weights, idx)`` of the same shapes and dtypes, or None when the union of ``idx`` has at
        most ``cap`` experts (nothing to drop).
    """
    import torch

    n_experts = logits.shape[-1]
    score = torch.zeros(n_experts, dtype=torch.float64)
    score.index_add_(0, idx.reshape(-1), weights.reshape(-1).double())
    if int(torch.unique(idx).numel()) <= cap:
        return None
    # stable sort on -score: ties go to the lower expert id
    kept = torch.sort(-score, stable=True).indices[:cap]
    keep = torch.zeros(n_experts, dtype=torch.bool)
    keep[kept] = True
    w = torch.where(keep[idx], weights, torch.zeros_like(weights))
    empty = w.sum(-1) == 0
    if bool(empty.any()):  # all of a position's experts dropped: its logits restricted to the kept set
        probs = torch.softmax(logits[empty].float().masked_fill(~keep, float("-inf")), -1)
        top_v, top_i = torch.topk(probs, min(idx.shape[1], cap), dim=-1)
        fill_w = torch.zeros((top_v.shape[0], idx.shape[1]), dtype=weights.dtype)
        fill_i = idx[empty].clone()
        fill_w[:, : top_v.shape[1]] = top_v.to(weights.dtype)
        fill_i[:, : top_i.shape[1]] = top_i
        w = w.clone()
        idx = idx.clone()
        w[empty] = fill_w
        idx[empty] = fill_i
    order = torch.sort(-w, dim=-1, stable=True).indices  # kept experts first
    w = torch.gather(w, 1, order)
    idx = torch.gather(idx, 1, order)
    idx = torch.where(w > 0, idx, idx[:, :1])  # freed slots: the position's first kept expert, weight 0
    w = w * (weights.sum(-1, keepdim=True) / w.sum(-1, keepdim=True))
    return w.to(weights.dtype), idx


class RoutingRecorder:
    """Forward hooks on the target's MoE routers, writing top-k ids into a preallocated buffer.

    The same hooks apply the verification-time expert cap (:func:`cap_routing`) while ``capping``.

    Attributes:
        buf: ``(n_layers, capacity, top_k)`` int64 tensor on the target's device; row ``[l, i]`` = experts of position i
            of the last recorded forward in MoE layer l (after the cap, when one applied).
        n: Positions of the last recorded forward.
        active: Record only while True.
        cap: Expert cap B per layer (None = off).
        capping: Apply ``cap`` to the routing of the current forward (only while also ``active``).
        uncapped: ``(n_layers,)`` union size per layer before the cap, of the last capped forward.
    """

    def __init__(self, target: Any, capacity: int, cap: int | None = None):
        import torch

        self.gates = [layer.mlp.gate for layer in target.model.layers if hasattr(layer.mlp, "gate")]
        if not self.gates:
            raise ValueError("target has no MoE router modules (layer.mlp.gate)")
        self.top_k = int(self.gates[0].top_k)
        self.n_experts = int(self.gates[0].num_experts)
        if cap is not None and not 1 <= int(cap) <= self.n_experts:
            raise ValueError(f"expert_cap={cap}: must be None or in 1..{self.n_experts}")
        self.cap = None if cap is None else int(cap)
        self.capping = False
        self.uncapped = np.zeros(len(self.gates), dtype=np.float64)
        # on the target's device: the hook's copy is then a device copy (also inside a CUDA graph)
        device = next(target.parameters()).device
        self.buf = torch.zeros((len(self.gates), capacity, self.top_k), dtype=torch.int64, device=device)
        self.n = 0
        self.active = False
        self._handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, output: Any) -> Any:
            if not self.active:
                return None
            idx = output[2]  # (tokens, top_k) expert ids
            if self.capping and self.cap is not None:
                import torch

                self.uncapped[layer] = float(torch.unique(idx).numel())
                capped = cap_routing(output[0], output[1], idx, self.cap)
                if capped is not None:
                    output = (output[0], capped[0], capped[1])
                    idx = capped[1]
            n = idx.shape[0]
            self.buf[layer, :n].copy_(idx)
            self.n = n
            return output

        return hook

    def routing(self) -> np.ndarray:
        """``(n_layers, n, top_k)`` expert ids of the last recorded forward (a copy)."""
        return self.buf[:, : self.n].cpu().numpy().copy()

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class _State:
    ids: list[int] = field(default_factory=list)  # committed tokens, prompt included
    prompt_len: int = 0
    t_len: int = 0  # tokens in the target cache
    d_len: int = 0  # tokens in the draft cache
    drafts: list[int] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    ent: list[float] = field(default_factory=list)  # entropy of each drafted token's distribution
    margin: list[float] = field(default_factory=list)  # its top-1 minus top-2 probability
    dists: list[Any] = field(default_factory=list)  # full draft distributions (sampling only)
    draft_ms: float = 0.0
    draft_cpu_ms: float = 0.0
    done: bool = True


class LiveEngine:
    """Speculative decoding of one generation at a time on the shipped small models.

    Args:
        models: Loaded models (default: :func:`load_models` of the shipped set).
        kmax: Largest draft budget (sizes the routing buffer).
        max_new_tokens: Generation cap.
        temperature: 0 = greedy (exact-match verification, lossless); > 0 = sampling with
            speculative rejection sampling.
        seed: Seed of the sampling generator (unused when greedy).
        threads: ``torch.set_num_threads`` (process-wide; :meth:`close` restores the previous value).
            None leaves it unchanged.
        stop_at_eos: End a generation after the end-of-text token.
        expert_cap: Verification-time expert cap B per MoE layer (module docstring); None = off,
            the only lossless setting.

    Example:
        >>> eng = LiveEngine(kmax=8)
        >>> eng.start(eng.models.encode("def add(a, b):"))
        >>> while not eng.done:
        ...     r = eng.step(4)
    """

    def __init__(
        self,
        models: SmallModels | None = None,
        kmax: int = 8,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        seed: int = 0,
        threads: int | None = 1,
        stop_at_eos: bool = True,
        expert_cap: int | None = None,
    ):
        import torch

        if kmax < 1:
            raise ValueError(f"kmax={kmax}: must be >= 1")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        if temperature < 0:
            raise ValueError(f"temperature={temperature}: must be >= 0")
        self._torch = torch
        self._prev_threads = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(int(threads))
        self.models = models if models is not None else load_models()
        self.kmax = int(kmax)
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.stop_at_eos = stop_at_eos
        self.threads = torch.get_num_threads()
        self.target = self.models.target
        self.draft = self.models.draft
        max_pos = int(self.target.config.max_position_embeddings)
        self.max_prompt = max_pos - self.max_new_tokens - self.kmax - 2
        self.recorder = RoutingRecorder(self.target, self.kmax + 1, cap=expert_cap)
        self.expert_cap = self.recorder.cap
        self.n_layers = len(self.recorder.gates)
        self.n_experts = self.recorder.n_experts
        self.top_k = self.recorder.top_k
        self._gen = torch.Generator().manual_seed(int(seed))
        self._s = _State()
        self._t_cache: Any = None
        self._d_cache: Any = None
        self.last_routing: np.ndarray | None = None
        #: U_r the last round would have had without the cap (equals its ``U_r`` when uncapped).
        self.last_uncapped_U: float | None = None

    # ------------------------------------------------------------------ state
    @property
    def done(self) -> bool:
        """True when the current generation is finished (or none was started)."""
        return self._s.done

    @property
    def t(self) -> int:
        """Generated tokens so far."""
        return len(self._s.ids) - self._s.prompt_len

    @property
    def L(self) -> int:
        """Context length: prompt + generated tokens."""
        return len(self._s.ids)

    @property
    def prompt_len(self) -> int:
        """Prompt length P."""
        return self._s.prompt_len

    @property
    def generated(self) -> list[int]:
        """Tokens generated so far."""
        return self._s.ids[self._s.prompt_len :]

    @property
    def draft_q(self) -> list[float]:
        """Draft probabilities q of the tokens proposed so far in the current round."""
        return list(self._s.q)

    @property
    def draft_entropy(self) -> list[float]:
        """Entropy (nats) of the draft's distribution at each token proposed so far in the current round."""
        return list(self._s.ent)

    @property
    def draft_margin(self) -> list[float]:
        """Top-1 minus top-2 probability of the draft's distribution at each token proposed so far."""
        return list(self._s.margin)

    def set_expert_cap(self, cap: int | None) -> None:
        """Change the verification-time expert cap B for the following rounds (None = off; module docstring).

        Raises:
            ValueError: If ``cap`` is not None and outside 1..n_experts.
        """
        if cap is not None and (isinstance(cap, bool) or not 1 <= int(cap) <= self.n_experts):
            raise ValueError(f"expert_cap={cap}: must be None or in 1..{self.n_experts}")
        self.recorder.cap = None if cap is None else int(cap)
        self.expert_cap = self.recorder.cap

    def seed(self, seed: int) -> None:
        """Reseed the sampling generator."""
        self._gen.manual_seed(int(seed))

    def close(self) -> None:
        """Detach the routing hooks and restore the torch thread count (the engine is unusable afterwards)."""
        if self.recorder._handles and self._torch.get_num_threads() != self._prev_threads:
            self._torch.set_num_threads(self._prev_threads)
        self.recorder.remove()
        self._t_cache = self._d_cache = None
        self._s = _State()

    # ------------------------------------------------------------------ generation
    def start(self, prompt_ids: list[int]) -> None:
        """Start a generation: prefill both caches with all prompt tokens but the last.

        Raises:
            ValueError: If the prompt is empty or too long for the models' context.
        """
        torch = self._torch
        from transformers.cache_utils import DynamicCache

        ids = [int(x) for x in prompt_ids]
        if not ids:
            raise ValueError("prompt_ids: empty prompt")
        if len(ids) > self.max_prompt:
            raise ValueError(f"prompt_ids: {len(ids)} tokens, at most {self.max_prompt} fit the context")
        self._s = _State(ids=ids, prompt_len=len(ids), done=False)
        self._t_cache = DynamicCache(config=self.target.config)
        self._d_cache = DynamicCache(config=self.draft.config)
        self.recorder.active = False
        if len(ids) > 1:
            x = torch.tensor([ids[:-1]], dtype=torch.long)
            with torch.inference_mode():
                self.target(input_ids=x, past_key_values=self._t_cache, use_cache=True, logits_to_keep=1)
                self.draft(input_ids=x, past_key_values=self._d_cache, use_cache=True, logits_to_keep=1)
        self._s.t_len = self._s.d_len = len(ids) - 1

    def propose(self, n: int) -> list[float]:
        """Extend the current round's draft chain to ``n`` tokens (no-op if already that long).

        Used for lookahead (confidences shown before the budget is chosen); :meth:`step` calls it.

        Returns:
            The draft probabilities q of the chain so far (entropies and margins:
            :attr:`draft_entropy`, :attr:`draft_margin`).
        """
        s = self._s
        if s.done:
            raise RuntimeError("propose() called with no generation running; call start()")
        if n > self.kmax:
            raise ValueError(f"propose({n}): more than kmax={self.kmax}")
        torch = self._torch
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.inference_mode():
            while len(s.drafts) < n:
                seq_len = len(s.ids) + len(s.drafts)
                feed = (s.ids + s.drafts)[s.d_len : seq_len]
                out = self.draft(
                    input_ids=torch.tensor([feed], dtype=torch.long),
                    past_key_values=self._d_cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                s.d_len = seq_len
                logits = out.logits[0, -1]
                if self.temperature == 0.0:
                    tok = int(torch.argmax(logits))
                    probs = torch.softmax(logits, -1)
                    q = float(probs[tok])
                    ent, margin = draft_signals(torch.softmax(logits.double(), -1))
                else:
                    dist = torch.softmax(logits / self.temperature, -1)
                    tok = int(torch.multinomial(dist, 1, generator=self._gen))
                    q = float(dist[tok])
                    ent, margin = draft_signals(dist)
                    s.dists.append(dist)
                s.drafts.append(tok)
                s.q.append(q)
                s.ent.append(ent)
                s.margin.append(margin)
        s.draft_ms += (time.perf_counter() - t0) * 1e3
        s.draft_cpu_ms += (time.thread_time() - c0) * 1e3
        return list(s.q)

    def step(self, k: int) -> RoundResult:
        """Execute one round with budget ``k``: draft k tokens, verify k+1 positions, commit.

        Raises:
            ValueError: If k is outside 0..kmax.
            RuntimeError: If no generation is running.
        """
        s = self._s
        if s.done:
            raise RuntimeError("step() called with no generation running; call start()")
        k = int(k)
        if not 0 <= k <= self.kmax:
            raise ValueError(f"k={k}: outside 0..{self.kmax}")
        n0 = len(s.ids)
        t_before = n0 - s.prompt_len
        if k:
            self.propose(k)
        a, new, t_target, c_target = self._verify(s.drafts[:k])
        t_draft, c_draft = self._roll_back_draft(n0 + a, timed=bool(k or s.drafts))
        routing = self.recorder.buf[:, : k + 1].numpy()
        U, E = prefix_expert_stats(routing, self.n_experts)
        self.last_routing = routing.copy()
        self.last_uncapped_U = (
            float(self.recorder.uncapped.mean()) if k and self.expert_cap is not None else float(U[-1])
        )
        q, drafted, ent, margin = tuple(s.q), tuple(s.drafts), tuple(s.ent), tuple(s.margin)
        new = self._commit(new, t_before, n0 + a)
        return RoundResult(
            k=k,
            m=k + 1,
            accepted=len(new) - 1,
            committed=tuple(new),
            U_r=float(U[-1]),
            E_max=float(E[-1]),
            T_T_ms=t_target,
            T_D_ms=t_draft,
            L=n0,
            t=t_before,
            q=q,
            done=s.done,
            drafted=drafted,
            T_T_cpu_ms=c_target,
            T_D_cpu_ms=c_draft,
            ent=ent,
            margin=margin,
        )

    def _verify(self, drafts: list[int]) -> tuple[int, list[int], float, float]:
        """One target forward over ``[last, d_1..d_k]`` (routing recorded); the target cache keeps the accepted prefix.

        Returns:
            ``(a, new, T_T_ms, T_T_cpu_ms)``: accepted drafts, the tokens to commit (the accepted
            drafts and the target's own token) and the wall and CPU time of the verification.
        """
        torch = self._torch
        s = self._s
        k = len(drafts)
        t0, c0 = time.perf_counter(), time.thread_time()
        self.recorder.active = True
        self.recorder.capping = k > 0  # plain decoding is never capped
        try:
            with torch.inference_mode():
                x = torch.tensor([[s.ids[-1], *drafts]], dtype=torch.long)
                logits = self.target(input_ids=x, past_key_values=self._t_cache, use_cache=True).logits[0]
        finally:
            self.recorder.active = self.recorder.capping = False
        with torch.inference_mode():
            if self.temperature == 0.0:
                g = logits.argmax(-1).tolist()
                a = 0
                while a < k and drafts[a] == g[a]:
                    a += 1
                new = [*drafts[:a], g[a]]
            else:
                a, new = self._reject_sample(logits, drafts)
            if k - a:
                self._t_cache.crop(-(k - a))
        return a, new, (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3

    def _roll_back_draft(self, valid: int, timed: bool) -> tuple[float, float]:
        """Crop the draft cache to the first ``valid`` tokens (the committed context and the accepted drafts).

        Args:
            valid: Tokens the draft cache may keep.
            timed: Whether the round drafted (then the crop is charged to the draft time).

        Returns:
            ``(T_D_ms, T_D_cpu_ms)``: the round's draft wall and CPU time, crop included.
        """
        s = self._s
        t1, c1 = time.perf_counter(), time.thread_time()
        if s.d_len > valid:
            self._d_cache.crop(-(s.d_len - valid))
            s.d_len = valid
        t_draft = s.draft_ms + ((time.perf_counter() - t1) * 1e3 if timed else 0.0)
        c_draft = s.draft_cpu_ms + ((time.thread_time() - c1) * 1e3 if timed else 0.0)
        return t_draft, c_draft

    def _commit(self, new: list[int], t_before: int, t_len: int) -> list[int]:
        """Append ``new`` (capped at max_new_tokens and after end-of-text), clear the round, update ``done``.

        Returns:
            The tokens committed.
        """
        s = self._s
        room = self.max_new_tokens - t_before
        new = new[:room]
        if self.stop_at_eos and self.models.eos_id in new:
            new = new[: new.index(self.models.eos_id) + 1]
        s.ids.extend(new)
        s.t_len = t_len
        s.drafts, s.q, s.ent, s.margin, s.dists, s.draft_ms, s.draft_cpu_ms = [], [], [], [], [], 0.0, 0.0
        s.done = len(s.ids) - s.prompt_len >= self.max_new_tokens or (
            self.stop_at_eos and bool(new) and new[-1] == self.models.eos_id
        )
        return new

    def _reject_sample(self, logits: Any, drafts: list[int]) -> tuple[int, list[int]]:
        torch = self._torch
        s = self._s
        p = torch.softmax(logits / self.temperature, -1)
        for j, d in enumerate(drafts):
            qd = s.dists[j][d]
            if float(torch.rand((), generator=self._gen)) < min(1.0, float(p[j, d] / qd)):
                continue
            resid = torch.clamp(p[j] - s.dists[j], min=0.0)
            total = float(resid.sum())
            resid = resid / total if total > 0 else p[j]
            return j, [*drafts[:j], int(torch.multinomial(resid, 1, generator=self._gen))]
        k = len(drafts)
        return k, [*drafts, int(torch.multinomial(p[k], 1, generator=self._gen))]

    def generate(self, prompt_ids: list[int], k: int) -> tuple[list[int], list[RoundResult]]:
        """Run a whole generation with a fixed budget ``k``; returns the new tokens and the rounds."""
        return run_fixed_k(self, prompt_ids, k)

    # ------------------------------------------------------------------ counterfactual sweep
    def sweep(
        self, prompt_ids: list[int], reference: list[int], kmax: int | None = None, caps: tuple[int, ...] = ()
    ) -> dict[str, np.ndarray]:
        """The counterfactual positions table of one generation (greedy).

        At every position t of the reference output y (the target's greedy output), the draft's
        greedy chain of ``kmax`` tokens from context ``prompt + y_<t`` is verified teacher-forced by
        one target pass over ``[last, d_1..d_kmax]``.

        With ``caps`` (B_1 < ... < B_C), the same chain is also verified by the capped target, one
        pass over ``[last, d_1..d_k]`` per (cap, k = 1..kmax), each with the cap applied over its own
        k+1 verified positions (:func:`cap_routing`), before the uncapped pass and from the same
        cache, so the uncapped outputs are those of a sweep without caps. Per pass: ``acc`` (the
        leading drafts equal to the capped argmax), ``U`` (capped unique experts, mean over layers),
        ``mis`` (of the committed tokens ``d_1..d_acc`` and the capped target's own next token, those at
        reference positions <= N, how many differ from y there) and ``lpgap`` (mean over the k+1
        positions of the uncapped log-probability of the uncapped argmax minus the capped
        log-probability of the same token; log-softmax of the float32 logits, taken in float64).

        Returns:
            ``rho`` (N, kmax) in {0, 1}: d_j equals the target's argmax after ``d_1..d_{j-1}``;
            ``q`` (N, kmax): the draft's probability of d_j; ``ent``, ``margin`` (N, kmax): entropy
            (nats) and top-1 minus top-2 probability of the draft's distribution at d_j; ``U``
            (N, kmax+1): unique experts of the chain prefix of every length (U[:, 0] = top_k); ``E``
            (N, kmax+1): largest expert load; ``L`` (N,): context length P + t; ``T_T_ms`` (N,): time of
            the verification pass; ``layer_union`` (N, n_layers): the uncapped union of every MoE
            layer over the kmax+1 positions. With ``caps``: ``acc_cap``, ``mis_cap`` (C, kmax+1, N)
            int32, ``U_cap``, ``lpgap_cap`` (C, kmax+1, N) float32, index k = 0 the uncapped AR round
            (0, top_k, 0, 0), and ``T_T_cap_ms`` (N,) the time of all capped passes at t.
        """
        torch = self._torch
        kmax = self.kmax if kmax is None else int(kmax)
        if not 1 <= kmax <= self.kmax:
            raise ValueError(f"kmax={kmax}: outside 1..{self.kmax}")
        caps = tuple(int(b) for b in caps)
        if any(not 1 <= b <= self.n_experts for b in caps):
            raise ValueError(f"caps={caps}: every cap must be in 1..{self.n_experts}")
        self.start(prompt_ids)
        P = len(prompt_ids)
        seq = [*map(int, prompt_ids), *map(int, reference)]
        N = len(reference)
        rho = np.zeros((N, kmax), dtype=np.float32)
        qs = np.zeros((N, kmax), dtype=np.float32)
        ents = np.zeros((N, kmax), dtype=np.float32)
        margins = np.zeros((N, kmax), dtype=np.float32)
        U = np.zeros((N, kmax + 1), dtype=np.float32)
        E = np.zeros((N, kmax + 1), dtype=np.float32)
        tt = np.zeros(N, dtype=np.float32)
        layer_union = np.zeros((N, self.n_layers), dtype=np.int32)
        C = len(caps)
        acc_c = np.zeros((C, kmax + 1, N), dtype=np.int32)
        mis_c = np.zeros((C, kmax + 1, N), dtype=np.int32)
        U_c = np.full((C, kmax + 1, N), float(self.top_k), dtype=np.float32)
        lp_c = np.zeros((C, kmax + 1, N), dtype=np.float32)
        tt_c = np.zeros(N, dtype=np.float32)
        with torch.inference_mode():
            for t in range(N):
                n = P + t  # committed tokens; both caches hold n - 1
                chain: list[int] = []
                feed = [seq[n - 1]]
                for j in range(kmax):
                    out = self.draft(
                        input_ids=torch.tensor([feed], dtype=torch.long),
                        past_key_values=self._d_cache,
                        use_cache=True,
                        logits_to_keep=1,
                    )
                    lg = out.logits[0, -1]
                    d = int(lg.argmax())
                    qs[t, j] = float(torch.softmax(lg, -1)[d])
                    ents[t, j], margins[t, j] = draft_signals(torch.softmax(lg.double(), -1))
                    chain.append(d)
                    feed = [d]
                self._d_cache.crop(-(kmax - 1))  # keep context + seq[n-1]
                t0 = time.perf_counter()
                capped = self._capped_passes(seq[n - 1], chain, caps) if caps else []
                tt_c[t] = (time.perf_counter() - t0) * 1e3
                t0 = time.perf_counter()
                self.recorder.active = True
                logits = self.target(
                    input_ids=torch.tensor([[seq[n - 1], *chain]], dtype=torch.long),
                    past_key_values=self._t_cache,
                    use_cache=True,
                ).logits[0]
                self.recorder.active = False
                g = logits.argmax(-1).tolist()
                self._t_cache.crop(-kmax)
                tt[t] = (time.perf_counter() - t0) * 1e3
                rho[t] = np.asarray([chain[j] == g[j] for j in range(kmax)], dtype=np.float32)
                routing = self.recorder.buf[:, : kmax + 1].numpy()
                u, e = prefix_expert_stats(routing, self.n_experts)
                U[t], E[t] = u, e
                layer_union[t] = [len(np.unique(routing[layer])) for layer in range(self.n_layers)]
                if caps:
                    lp_ref = torch.log_softmax(logits.double(), -1)
                    g_t = torch.tensor(g)
                    ref_lp = lp_ref[torch.arange(kmax + 1), g_t]
                    for c, k, cap_lp, cap_g, cap_u in capped:
                        a = 0
                        while a < k and chain[a] == cap_g[a]:
                            a += 1
                        committed = [*chain[:a], cap_g[a]]
                        acc_c[c, k, t] = a
                        mis_c[c, k, t] = sum(tok != reference[t + j] for j, tok in enumerate(committed) if t + j < N)
                        U_c[c, k, t] = cap_u
                        lp_c[c, k, t] = float((ref_lp[: k + 1] - cap_lp[torch.arange(k + 1), g_t[: k + 1]]).mean())
        self._s.done = True
        out = {
            "rho": rho,
            "q": qs,
            "ent": ents,
            "margin": margins,
            "U": U,
            "E": E,
            "L": np.arange(P, P + N, dtype=np.int32),
            "T_T_ms": tt,
            "layer_union": layer_union,
        }
        if caps:
            out.update(acc_cap=acc_c, mis_cap=mis_c, U_cap=U_c, lpgap_cap=lp_c, T_T_cap_ms=tt_c)
        return out

    def _capped_passes(self, last: int, chain: list[int], caps: tuple[int, ...]) -> list[tuple[Any, ...]]:
        """The capped verification passes of one sweep position: one per (cap, k = 1..len(chain)).

        Each pass feeds ``[last, d_1..d_k]`` with the cap over those k+1 positions and crops the
        target cache back (it holds the context before ``last`` on entry and on return).

        Returns:
            ``(c, k, log_softmax (k+1, vocab) float64, argmax list, capped U)`` per pass.
        """
        torch = self._torch
        rec = self.recorder
        saved = rec.cap
        out = []
        try:
            for c, B in enumerate(caps):
                rec.cap = B
                for k in range(1, len(chain) + 1):
                    rec.active = rec.capping = True
                    try:
                        logits = self.target(
                            input_ids=torch.tensor([[last, *chain[:k]]], dtype=torch.long),
                            past_key_values=self._t_cache,
                            use_cache=True,
                        ).logits[0]
                    finally:
                        rec.active = rec.capping = False
                    self._t_cache.crop(-(k + 1))
                    routing = rec.buf[:, : k + 1].numpy()
                    u = float(np.mean([len(np.unique(routing[layer])) for layer in range(routing.shape[0])]))
                    out.append((c, k, torch.log_softmax(logits.double(), -1), logits.argmax(-1).tolist(), u))
        finally:
            rec.cap = saved
        return out
