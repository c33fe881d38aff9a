"""The round-backend interface every engine implements, and the expert statistics of a pass.

An engine executes real speculative-decoding rounds for one generation at a time:
:class:`RoundBackend` is what the live environment (:mod:`specenv.envs.live`) drives, whatever the
engine (:mod:`specenv.engines.hf`: transformers; :mod:`specenv.engines.vllm`: vLLM stepped one round
at a time). Each round yields a :class:`RoundResult`.

The routing statistics of a verification pass (``U_r``: unique experts, mean over MoE layers;
``E_max``: the largest number of verified positions routed to one expert, mean over layers) are
computed here for every engine: :func:`prefix_expert_stats` for every prefix of one chain (the
counterfactual sweep), :func:`span_expert_stats` for several passes packed in one forward (a batch), and
:class:`StepExperts`, the same figures from preallocated buffers for a server's every step.

Engines are chosen by name (:data:`BACKENDS`, :func:`make_backend`): each name maps to the factory
of one engine folder, imported only when that engine is asked for (the engines' dependencies are
optional extras). Adding an engine (e.g. SGLang) means adding its folder with a ``make`` factory
and one entry in :data:`BACKENDS`.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from specenv.engines.kernels import kernels

__all__ = [
    "BackendConfig",
    "BACKENDS",
    "RoundBackend",
    "RoundResult",
    "make_backend",
    "run_fixed_k",
    "prefix_expert_stats",
    "span_expert_stats",
    "StepExperts",
    "u_prior",
]

#: Engine name -> ``"module:function"`` of its factory (see :func:`make_backend`). Fixed here: never
#: taken from user input, so no arbitrary import path can be named through it.
BACKENDS: dict[str, str] = {
    "hf": "specenv.engines.hf.backend:make",
    "vllm": "specenv.engines.vllm.live:make",
}


@dataclass(frozen=True)
class RoundResult:
    """One executed verification round.

    Attributes:
        k: Draft budget of the round (0 = plain AR step).
        m: Verified positions (k + 1).
        accepted: Accepted drafts, capped at the end of the generation (``len(committed) - 1``).
        committed: Tokens committed by the round (accepted drafts + the target's next token),
            truncated at ``max_new_tokens`` and after an end-of-text token.
        U_r: Unique experts of the verification pass, mean over MoE layers.
        E_max: Largest number of verified positions routed to one expert, mean over layers.
        T_T_ms: Target (verification) time in ms, including its cache roll-back.
        T_D_ms: Draft time in ms (0 for k = 0 without lookahead), including its cache roll-back.
        L: Context length at the round (prompt + generated tokens before it).
        t: Generated tokens before the round.
        q: The draft's probabilities of every drafted token (length >= k with lookahead).
        done: Whether the generation is finished after this round.
        drafted: The drafted tokens (the first k were verified).
        T_T_cpu_ms: CPU time of the calling thread during verification (``time.thread_time``): with
            one torch thread it excludes time the process spent descheduled by other processes.
        T_D_cpu_ms: The same for the draft phase.
        T_step_ms: Wall time of the engine step(s) that ran the round, everything a user waits for
            (scheduling, the target's verification, sampling, the next drafts, output processing); 0
            when the engine does not measure it (the transformers engine).
        ent: Entropy (nats) of the draft's distribution at every drafted token (aligned with ``q``;
            empty when the engine does not report it).
        margin: Top-1 minus top-2 probability of that distribution (aligned with ``q``; may be empty).
    """

    k: int
    m: int
    accepted: int
    committed: tuple[int, ...]
    U_r: float
    E_max: float
    T_T_ms: float
    T_D_ms: float
    L: int
    t: int
    q: tuple[float, ...]
    done: bool
    drafted: tuple[int, ...] = ()
    T_T_cpu_ms: float = 0.0
    T_D_cpu_ms: float = 0.0
    ent: tuple[float, ...] = ()
    margin: tuple[float, ...] = ()
    T_step_ms: float = 0.0


@runtime_checkable
class RoundBackend(Protocol):
    """What the live environment needs of an engine (one generation at a time).

    Attributes:
        models: The model set's tokenizer side: ``models.encode(text) -> list[int]`` token ids of
            a prompt (and ``decode``).
    """

    models: Any

    @property
    def done(self) -> bool:
        """Whether the current generation is finished."""

    @property
    def t(self) -> int:
        """Tokens generated so far."""

    @property
    def L(self) -> int:
        """Context length (prompt + generated tokens)."""

    @property
    def generated(self) -> list[int]:
        """Token ids generated so far in the current generation."""

    def seed(self, seed: int) -> None:
        """Seed the sampling of the next generation."""

    def start(self, prompt_ids: list[int]) -> None:
        """Begin a generation from a tokenised prompt."""

    def propose(self, n: int) -> list[float]:
        """Draft (at least) n tokens ahead and return their confidences q (block drafting)."""

    def step(self, k: int) -> RoundResult:
        """Verify k drafts in one target pass and commit the accepted prefix."""

    def close(self) -> None:
        """Release hooks and resources."""


def prefix_expert_stats(routing: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Unique experts and largest expert load of every prefix of the verified positions.

    Args:
        routing: ``(n_layers, m, top_k)`` expert ids.
        n_experts: Experts per layer.

    Returns:
        ``(U, E)``, each of shape ``(m,)``: ``U[i]`` = mean over layers of the unique experts of
        positions 0..i, ``E[i]`` = mean over layers of the largest per-expert count over 0..i.
    """
    n_layers, m, _ = routing.shape
    onehot = np.zeros((n_layers, m, n_experts), dtype=np.int32)
    np.put_along_axis(onehot, routing, 1, axis=2)
    counts = np.cumsum(onehot, axis=1)  # (layers, m, experts)
    U = (counts > 0).sum(axis=2).mean(axis=0)
    E = counts.max(axis=2).mean(axis=0)
    return U.astype(np.float64), E.astype(np.float64)


def u_prior(k: int | np.ndarray, top_k: int, n_experts: int) -> np.ndarray:
    """Prior unique experts U(k) when routing is not observed: ``min(top_k * (k+1)**0.62, n_experts)``.

    A concave power law close to the paper's Table 4 (U at m = k+1 verified positions); float for a
    scalar k, an array for an array of budgets.
    """
    return np.minimum(top_k * (np.asarray(k, dtype=np.float64) + 1.0) ** 0.62, n_experts)


def span_expert_stats(routing: np.ndarray, spans: list[tuple[int, int]], n_experts: int) -> tuple[np.ndarray, ...]:
    """U_r and E_max of several verification passes of one forward (one ``bincount``).

    Args:
        routing: ``(n_layers, tokens, top_k)`` expert ids of the forward's tokens.
        spans: ``(offset, m)`` of each pass's verified positions among the tokens.
        n_experts: Experts per layer.

    Returns:
        ``(U, E)``, arrays with one value per span.
    """
    n_layers = routing.shape[0]
    lens = np.array([m for _, m in spans], dtype=np.int64)
    starts = np.array([o for o, _ in spans], dtype=np.int64)
    owner = np.repeat(np.arange(len(spans)), lens)
    tok = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens) + np.repeat(starts, lens)
    sel = routing[:, tok, :].astype(np.int64)  # (layers, tokens of the spans, top_k)
    key = (owner[None, :, None] * n_layers + np.arange(n_layers)[:, None, None]) * n_experts + sel
    counts = np.bincount(key.ravel(), minlength=len(spans) * n_layers * n_experts)
    counts = counts.reshape(len(spans), n_layers, n_experts)
    return (counts > 0).sum(axis=2).mean(axis=1), counts.max(axis=2).mean(axis=1)


class StepExperts:
    """U_r and E_max of the passes of one forward, and the forward's expert union, from preallocated buffers.

    The per-step form of :func:`span_expert_stats` for a server (the same numbers, bit for bit): one
    compiled call (:func:`specenv.engines.kernels.expert_counts`) when numba is there, else numpy: the
    routing read in place, the bincount keys written into a buffer kept across steps, and a forward
    holding one pass only (batch 1, no prefill beside it) without the token-owner map.

    Args:
        n_layers: MoE layers of the routing.
        n_experts: Experts per layer.
        top_k: Experts per token.
        capacity: Most tokens of one forward (the buffers' size; a larger forward grows them).
        compiled: Use the compiled form where numba is importable (False: numpy only, the reference).
    """

    def __init__(self, n_layers: int, n_experts: int, top_k: int, capacity: int, compiled: bool = True):
        self.n_layers, self.n_experts, self.top_k = int(n_layers), int(n_experts), int(top_k)
        self._layer_key = (np.arange(self.n_layers, dtype=np.int64) * self.n_experts)[:, None, None]
        self._alloc(int(capacity))
        ks = kernels() if compiled else None
        #: the compiled form (:func:`specenv.engines.kernels.expert_counts`), None: the numpy form
        self._kernel = ks.expert_counts if ks is not None else None
        self._counts = np.empty(0, dtype=np.int64)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self._key = np.empty(self.n_layers * capacity * self.top_k, dtype=np.int64)
        self._owner = np.empty(capacity, dtype=np.int64)

    def step(self, routing: np.ndarray, offsets: list[int], lens: list[int]) -> tuple[np.ndarray, np.ndarray, float]:
        """``(U, E, union)`` of one forward.

        Args:
            routing: ``(n_layers, tokens, top_k)`` expert ids of every token of the forward.
            offsets: Each pass's first token among them.
            lens: Each pass's number of verified positions.

        Returns:
            ``U`` and ``E`` (one value per pass, as :func:`span_expert_stats`) and the mean over layers of
            the experts any token of the forward was routed to.
        """
        L, T, k = routing.shape
        E = self.n_experts
        n = len(lens)
        kernel = self._kernel
        if kernel is not None and routing.dtype == np.int32:  # one compiled call (the same numbers)
            if self._counts.size < (n + 1) * L * E:
                self._counts = np.empty(2 * (n + 1) * L * E, dtype=np.int64)
            out = np.empty((2, n))
            spans = np.array((offsets, lens), dtype=np.int64)
            union = kernel(routing, spans[0], spans[1], E, self._counts, out)
            if union >= 0:
                return out[0], out[1], union
        if T > self.capacity:
            self._alloc(T)
        key = self._key[: L * T * k].reshape(L, T, k)
        # integer sums divided by L: the float64 of numpy's mean over the layers, bit for bit
        if n == 1 and offsets[0] == 0 and lens[0] == T:  # one pass, nothing else in the forward
            np.add(routing, self._layer_key, out=key)
            counts = np.bincount(key.ravel(), minlength=L * E).reshape(L, E)
            U = np.count_nonzero(counts) / L
            return np.array([U]), np.array([counts.max(axis=1).sum() / L]), float(U)
        owner = self._owner[:T]
        owner.fill(n * L * E)  # tokens of no pass: bucket n
        for i, (o, m) in enumerate(zip(offsets, lens, strict=True)):
            owner[o : o + m] = i * L * E
        np.add(owner[None, :, None], self._layer_key, out=key)
        key += routing
        counts = np.bincount(key.ravel(), minlength=(n + 1) * L * E).reshape(n + 1, L, E)
        union = np.count_nonzero(counts.sum(axis=0)) / L
        counts = counts[:n]
        return (counts > 0).sum(axis=(1, 2)) / L, counts.max(axis=2).sum(axis=1) / L, float(union)


@dataclass(frozen=True)
class BackendConfig:
    """What every engine factory is given (an engine ignores what does not apply to it).

    Attributes:
        kmax: Largest draft budget.
        max_new_tokens: Generation cap.
        temperature: 0 = greedy; > 0 = sampling with speculative rejection sampling.
        threads: Torch threads (process-wide; None = unchanged; vLLM sets its own).
        lookahead: Draft confidences the caller will ask for before each round
            (:meth:`RoundBackend.propose`); an engine that cannot show them raises ValueError.
        expert_cap: Verification-time expert cap B per MoE layer (None = off, the only lossless
            setting); the transformers engine only, vLLM refuses it.
    """

    kmax: int
    max_new_tokens: int
    temperature: float = 0.0
    threads: int | None = 1
    lookahead: int = 0
    expert_cap: int | None = None


def make_backend(name: str, models: str | os.PathLike[str], config: BackendConfig) -> RoundBackend:
    """Build the engine registered under ``name`` in :data:`BACKENDS`.

    Args:
        name: Engine name (``"hf"``, ``"vllm"``).
        models: Model set: shipped name or folder.
        config: Budget, generation cap, sampling and threads (:class:`BackendConfig`).

    Raises:
        ValueError: For an unknown name, or a configuration the engine cannot serve.
    """
    target = BACKENDS.get(name)
    if target is None:
        raise ValueError(f"backend={name!r}: expected one of {tuple(BACKENDS)}")
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)(models, config)


def run_fixed_k(backend: RoundBackend, prompt_ids: list[int], k: int) -> tuple[list[int], list[RoundResult]]:
    """A whole generation with a fixed budget ``k``; returns the generated tokens and the rounds."""
    backend.start(prompt_ids)
    rounds = []
    while not backend.done:
        rounds.append(backend.step(k))
    return backend.generated, rounds
