"""Speculative sampling at a temperature T > 0, as the collectors record it (trace schema v2, ``greedy: false``).

Under sampling, draft j of a chain is a token x drawn from the draft's distribution q at temperature T
(``softmax(draft logits / T)``); standard speculative sampling accepts it with probability

    rho = min(1, p(x) / q(x)),

p the target's distribution at T after the same prefix, and on rejection commits a token from
``normalise(max(p - q, 0))``, which leaves the committed text distributed as the target's own sampling
at T. A trace records rho itself, computed from the two models' full-vocabulary probabilities: the
exact conditional acceptance probability of the drafted token, with no sampling noise in it (the
environment and the oracle draw, or take the expectation over, the accept/reject events from rho).

:func:`tempered_draw` draws a token by inverse transform from a uniform the caller supplies (a
seeded generator per generation: the chain at position t does not depend on how the engine batched
its requests) and returns the draft's signals of that distribution; :func:`acceptance` gives rho.
Both are used by :mod:`specenv.engines.vllm.collect` and tested against a direct computation in
``tests/test_sampling.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["acceptance", "draft_uniforms", "generation_seed", "tempered_draw"]


def tempered_draw(logits: Any, temperature: float, u: float) -> tuple[int, float, float, float]:
    """Draw one token from ``softmax(logits / temperature)`` by inverse transform of ``u`` (float64).

    Args:
        logits: ``(vocab,)`` torch tensor of one position's logits.
        temperature: T > 0.
        u: A uniform in [0, 1).

    Returns:
        ``(x, q, entropy, margin)``: the token, its probability q(x) at T, the entropy (nats) and the
        top-1 minus top-2 probability of the distribution at T (:func:`specenv.engines.hf.engine.draft_signals`).
        q(x) > 0 always: the token is the first whose cumulative probability exceeds ``u`` times the total.

    Raises:
        ValueError: If temperature <= 0 or u is outside [0, 1).
    """
    import torch

    from specenv.engines.hf.engine import draft_signals

    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u={u}: must be in [0, 1)")
    p = torch.softmax(logits.detach().double().reshape(-1) / float(temperature), -1)
    c = torch.cumsum(p, 0)
    at = torch.tensor([float(u) * float(c[-1])], dtype=torch.float64)
    x = int(torch.searchsorted(c, at, right=True)[0])
    x = min(x, p.numel() - 1)
    while float(p[x]) <= 0.0 and x > 0:  # rounding at the very top of the cumulative sum
        x -= 1
    ent, margin = draft_signals(p)
    return x, float(p[x]), ent, margin


def acceptance(p: Any, q: Any) -> np.ndarray:
    """The acceptance probability of a drafted token, rho = min(1, p / q) elementwise (float64).

    Args:
        p: The target's probability of the drafted token at T.
        q: The draft's probability of it at T (> 0: the token was drawn from q).

    Raises:
        ValueError: If some q <= 0 or some p is outside [0, 1].
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if np.any(~(q > 0)):
        raise ValueError("acceptance: a drafted token needs q > 0 (it was drawn from q)")
    if np.any(~((p >= 0) & (p <= 1))):
        raise ValueError("acceptance: p must be a probability in [0, 1]")
    return np.minimum(1.0, p / q)


def generation_seed(seed: int, generation_id: int) -> int:
    """The engine's per-request sampling seed of one generation: independent streams per (seed, generation)."""
    return int(np.random.SeedSequence([int(seed), int(generation_id)]).generate_state(1)[0])


def draft_uniforms(seed: int, generation_id: int, n_positions: int, kmax: int) -> np.ndarray:
    """``(n_positions, kmax)`` uniforms in [0, 1) that draw the draft chains of one generation (float64).

    A stream of its own per (seed, generation), separate from :func:`generation_seed`'s.
    """
    rng = np.random.default_rng([int(seed), int(generation_id), 1])
    return rng.random((int(n_positions), int(kmax)))
