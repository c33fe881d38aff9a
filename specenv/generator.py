"""Paper-profile trace generator: synthetic generations calibrated to "The Limits of Speculation".

The generative model (documented with every calibration choice in ``traces/README.md``):

1. **Text as segments.** Each generation's reference output is a sequence of segments (a code line,
   a sentence, a formula...). Every token may open a new segment; openings are *minor* (structural:
   the new segment keeps part of the previous expert pool) or *major* (language/script or topic
   change: a fresh pool). Rates depend on the category (Tables A3/A5).
2. **Routing.** Per MoE layer, experts have a global popularity; each segment has a pool of
   preferred experts. A token's top-k experts are the top-k of popularity + pool affinity + Gumbel
   noise (Gumbel-top-k = sampling k experts without replacement). Off-reference draft tokens (the
   draft's wrong continuation) route through a separate pool, so a mismatch brings unused experts.
3. **Acceptance.** Token s has a draftability pi_s (high inside a segment, low at a segment opening,
   lower still at a major one); draft j of the chain at t is accepted with conditional probability
   rho_{t,j} = pi_{t+j} * delta^(j-1). One latent uniform per token decides where the draft chain
   leaves the reference (the same hard token is hard from every start), which fixes the routing of
   the chain; greedy traces take rho from the same uniforms (0/1).
   Transitions therefore end acceptance runs *and* bring new experts (paper Figs. B3-B5).
4. **Confidences.** q_{t,j} = sigmoid(logit(rho_{t,j}) + noise): the draft's own probability,
   informative but noisy. The rest of the draft's distribution (trace schema v2: its entropy and
   top-1/top-2 margin) is a geometric tail: the other tokens get (1 - q)(1 - theta) theta^(i-1),
   i = 1, 2, ..., with logit(theta) = tail_logit0 - tail_slope * logit(p) + noise, so a chain the
   target is likely to accept has a concentrated draft (:func:`draft_signals`). Greedy sets keep the
   drafted token on top (theta >= 1 - q/(1-q)).
5. **Rounds.** Fixed-K runs K = 1..Kmax over the same generations; T_T from the profile's per-K
   coefficients plus Gaussian noise sized to Table A4's out-of-sample MAPE; T_D = 0.459K + 0.073 ms
   plus noise.

Everything is drawn from one ``numpy.random.Generator`` per generation, seeded from (seed, index),
so the output is deterministic given the seed and independent of the number of generations. The
tails of step 4 come from a second generator seeded from (seed, index, SIGNAL_STREAM), so adding
them left every other column bit-identical to the schema-v1 sets of the same seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from specenv.cost.model import CostModel
from specenv.traces import paper
from specenv.traces.schema import ModelFacts, ent_columns, margin_columns, q_columns, rho_columns, u_columns
from specenv.traces.traceset import Manifest, TraceSet, survival_table


@dataclass(frozen=True)
class CategoryProfile:
    """Text statistics of one prompt category.

    Attributes:
        p_in: Mean draftability of a token inside a segment.
        hazard: Probability that a token opens a new segment.
        major_share: Share of segment openings that are major (fresh expert pool).
    """

    p_in: float
    hazard: float
    major_share: float


#: Category text profiles (calibration: accept length ~5 on code, ~3.5 on chat at long drafts).
CATEGORIES: dict[str, CategoryProfile] = {
    "code_math": CategoryProfile(p_in=0.95, hazard=0.085, major_share=0.15),
    "coding": CategoryProfile(p_in=0.95, hazard=0.080, major_share=0.15),
    "math_reasoning": CategoryProfile(p_in=0.93, hazard=0.10, major_share=0.2),
    "stem": CategoryProfile(p_in=0.89, hazard=0.13, major_share=0.25),
    "qa": CategoryProfile(p_in=0.89, hazard=0.14, major_share=0.25),
    "rag": CategoryProfile(p_in=0.89, hazard=0.13, major_share=0.25),
    "extraction": CategoryProfile(p_in=0.90, hazard=0.12, major_share=0.2),
    "translation": CategoryProfile(p_in=0.89, hazard=0.13, major_share=0.45),
}


@dataclass(frozen=True)
class PaperProfile:
    """All knobs of the paper-profile generator (defaults are the calibrated values).

    Attributes:
        n_layers: MoE layers.
        n_experts: Experts per layer.
        top_k: Experts per token per layer.
        pool_size: Preferred experts of a segment per layer.
        pool_affinity: Logit bonus of pool experts.
        popularity_sd: SD of the per-layer global expert popularity logits.
        minor_keep: Logit bonus that keeps the previous pool's experts at a minor opening.
        alt_keep: Logit bonus of the segment's pool in the pool of off-reference draft tokens.
        p_minor: Draftability of a token opening a minor segment.
        p_major: Draftability of a token opening a major segment.
        depth_decay: delta, the per-depth decay of conditional acceptance.
        token_sd: SD of per-token draftability noise on the logit scale.
        segment_sd: SD of per-segment draftability shift on the logit scale.
        conf_sd: SD of the draft-confidence noise on the logit scale.
        prompt_median: Median prompt length P.
        prompt_sd: Log-SD of P.
        cap_share: Share of generations that run to max_new_tokens.
        out_median: Median output length of the others.
        out_sd: Log-SD of their output length.
        max_new_tokens: Generation cap.
        mape_pct: OOS MAPE (%) per K that the target-time noise is sized to (Table A4; 0.30 beyond K=6).
        draft_noise_ms: SD of the draft-time noise.
        quantum: rho, q, entropy and margin are stored as multiples of 1/quantum.
        vocab_size: The draft's vocabulary (Qwen3's), written to the manifest.
        tail_logit0: Intercept of logit(theta), the ratio of the draft's geometric tail.
        tail_slope: How much a likely acceptance concentrates the tail (logit(theta) falls by this
            much per unit of logit(p)).
        tail_sd: SD of the tail's logit noise (independent of the confidence noise).
        tail_max: Largest theta (bounds the entropy, far below log(vocab_size)).
    """

    n_layers: int = paper.N_LAYERS
    n_experts: int = paper.N_EXPERTS
    top_k: int = paper.TOP_K
    pool_size: int = 14
    pool_affinity: float = 3.1
    popularity_sd: float = 0.9
    minor_keep: float = 1.5
    alt_keep: float = 3.0
    p_minor: float = 0.35
    p_major: float = 0.12
    depth_decay: float = 0.985
    token_sd: float = 0.9
    segment_sd: float = 0.5
    conf_sd: float = 0.6
    prompt_median: float = 260.0
    prompt_sd: float = 0.45
    cap_share: float = 0.3
    out_median: float = 480.0
    out_sd: float = 0.55
    max_new_tokens: int = paper.MAX_NEW_TOKENS
    mape_pct: dict[int, float] = field(default_factory=lambda: {1: 0.44, 2: 0.51, 3: 0.59, 4: 0.33, 5: 0.32, 6: 0.30})
    draft_noise_ms: float = 0.02
    quantum: int = 1024
    vocab_size: int = 151936
    tail_logit0: float = 1.0
    tail_slope: float = 0.5
    tail_sd: float = 0.8
    tail_max: float = 0.995


#: The third seed word of the generator of the draft's tails (schema-v2 entropy and margin).
SIGNAL_STREAM = 0x5167


@dataclass
class Generation:
    """One synthetic generation's positions (and the routing-derived E_max used by the rounds)."""

    generation_id: int
    category: str
    prompt_len: int
    L: np.ndarray  # (N,)
    rho: np.ndarray  # (N, kmax)
    q: np.ndarray  # (N, kmax)
    U: np.ndarray  # (N, kmax+1)
    E: np.ndarray | None  # (N, kmax+1) mean over layers of the per-layer max expert load
    ent: np.ndarray | None = None  # (N, kmax) entropy of the draft's distribution (nats)
    margin: np.ndarray | None = None  # (N, kmax) its top-1 minus top-2 probability


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p) - np.log1p(-p)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _gumbel(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard Gumbel noise in float32."""
    u = rng.random(shape, dtype=np.float32)
    np.maximum(u, np.float32(1e-30), out=u)
    return -np.log(-np.log(u))


def _bitmask(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """(..., k) expert ids -> (..., words) uint64 bitsets."""
    words = (n_experts + 63) // 64
    out = np.zeros(ids.shape[:-1] + (words,), dtype=np.uint64)
    for w in range(words):
        local = ids - 64 * w
        inside = (local >= 0) & (local < 64)
        bits = np.where(inside, np.left_shift(np.uint64(1), np.clip(local, 0, 63).astype(np.uint64)), np.uint64(0))
        out[..., w] = np.bitwise_or.reduce(bits, axis=-1)
    return out


def _chain_union(
    Y: np.ndarray, Z: np.ndarray, D: np.ndarray, N: int, kmax: int, n_experts: int, with_load: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """U[t, j] (and E_max[t, j]) of the chain [y_t, d_{t,1..j}] for every t < N, j <= kmax.

    Draft j of the chain at t is the reference token t+j while j < D[t], else the off-reference
    token at t+j. U is the mean over layers of the union size; E_max the mean over layers of the
    largest number of chain positions routed to one expert.
    """
    yb, zb = _bitmask(Y, n_experts), _bitmask(Z, n_experts)
    n_layers, top_k = Y.shape[1], Y.shape[2]
    U = np.empty((N, kmax + 1))
    acc = yb[:N].copy()
    U[:, 0] = top_k
    Emax = None
    if with_load:
        Emax = np.empty((N, kmax + 1))
        Emax[:, 0] = 1.0
        counts = np.zeros((N, n_layers, n_experts), dtype=np.uint8)
        rows = np.arange(N)[:, None, None]
        lays = np.arange(n_layers)[None, :, None]
        counts[rows, lays, Y[:N]] = 1
    for j in range(1, kmax + 1):
        on_ref = (j < D)[:, None, None]
        acc |= np.where(on_ref, yb[j : N + j], zb[j : N + j])
        U[:, j] = np.bitwise_count(acc).sum(axis=2).mean(axis=1)
        if with_load:
            ids = np.where(on_ref, Y[j : N + j], Z[j : N + j])
            _add_ids(counts, ids)
            Emax[:, j] = counts.max(axis=2).mean(axis=1)
    return U, Emax


def _add_ids(counts: np.ndarray, ids: np.ndarray) -> None:
    """counts[t, l, ids[t, l, :]] += 1 (ids are distinct along the last axis)."""
    n, n_layers, k = ids.shape
    flat = counts.reshape(-1)
    base = (np.arange(n)[:, None, None] * n_layers + np.arange(n_layers)[None, :, None]) * counts.shape[2]
    flat[(base + ids).reshape(-1)] += 1


def _topk_onehot(scores: np.ndarray, k: int) -> np.ndarray:
    """One-hot (uint8) of the top-k entries along the last axis."""
    idx = np.argpartition(-scores, k - 1, axis=-1)[..., :k]
    out = np.zeros(scores.shape, dtype=np.uint8)
    np.put_along_axis(out, idx, 1, axis=-1)
    return out


def _category_list(n: int, rng: np.random.Generator) -> list[str]:
    names = list(paper.CATEGORY_ROUNDS)
    w = np.array([paper.CATEGORY_ROUNDS[c] for c in names], dtype=float)
    w /= w.sum()
    # at least two generations per category when there is room, the rest by the paper's weights
    base = np.minimum(2, n // len(names)) if n >= len(names) else 0
    counts = np.full(len(names), base)
    rest = n - counts.sum()
    counts += np.floor(w * rest).astype(int)
    order = np.argsort(-(w * rest - np.floor(w * rest)))
    for i in order[: n - counts.sum()]:
        counts[i] += 1
    cats = [c for c, k in zip(names, counts, strict=True) for _ in range(k)]
    rng.shuffle(cats)
    return cats


def generate_generation(
    gen_id: int,
    category: str,
    kmax: int,
    profile: PaperProfile,
    rng: np.random.Generator,
    greedy: bool,
    with_load: bool = True,
    signal_rng: np.random.Generator | None = None,
) -> Generation:
    """Draw one generation's positions table (see the module docstring for the model).

    The draws come from ``rng`` in a fixed order (lengths, segments, routing, acceptance), so the
    output is a function of the generator's state. The draft's entropy and margin are drawn from
    ``signal_rng`` (none when it is None), which leaves ``rng``'s draws unchanged.
    """
    cp = CATEGORIES[category]
    P, N = _draw_lengths(profile, rng)
    n_tok = N + kmax + 1  # the chain at t reaches token t + kmax
    kind, seg = _draw_segments(cp, rng, n_tok)
    Y, Z = _draw_routing(profile, rng, kind, seg)
    rho, q, D, p_chain = _draw_acceptance(profile, cp, rng, kind, seg, N, kmax, greedy)
    U, Emax = _chain_union(Y, Z, D, N, kmax, profile.n_experts, with_load)
    ent = margin = None
    if signal_rng is not None:
        ent, margin = _draw_signals(profile, signal_rng, p_chain, q, greedy)
    return Generation(gen_id, category, P, P + np.arange(N), rho, q, U, Emax, ent, margin)


def _draw_lengths(pr: PaperProfile, rng: np.random.Generator) -> tuple[int, int]:
    """Prompt length P and output length N (a share ``cap_share`` runs to ``max_new_tokens``)."""
    P = int(np.clip(round(rng.lognormal(np.log(pr.prompt_median), pr.prompt_sd)), 16, 3000))
    if rng.random() < pr.cap_share:
        N = pr.max_new_tokens
    else:
        N = int(np.clip(round(rng.lognormal(np.log(pr.out_median), pr.out_sd)), 32, pr.max_new_tokens))
    return P, N


def _draw_segments(cp: CategoryProfile, rng: np.random.Generator, n_tok: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment openings of ``n_tok`` tokens (step 1 of the module docstring).

    Returns:
        ``(kind, seg)``: (n_tok,) kind of every token (0 = continue, 1 = minor opening, 2 = major
        opening; token 0 opens a major segment) and (n_tok,) its segment index.
    """
    opens = rng.random(n_tok) < cp.hazard
    major = rng.random(n_tok) < cp.major_share
    kind = np.where(opens, np.where(major, 2, 1), 0)
    kind[0] = 2
    seg = np.cumsum(kind > 0) - 1
    return kind, seg


def _draw_routing(
    pr: PaperProfile, rng: np.random.Generator, kind: np.ndarray, seg: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k expert ids of every token, reference and off-reference (step 2 of the module docstring).

    Returns:
        ``(Y, Z)``: (n_tok, n_layers, top_k) expert ids of the reference tokens and of the draft's
        off-reference tokens.
    """
    n_tok, n_seg = len(kind), int(seg[-1]) + 1
    Ly, E, S = pr.n_layers, pr.n_experts, pr.top_k
    pop = rng.normal(0.0, pr.popularity_sd, size=(Ly, E)).astype(np.float32)
    starts = np.flatnonzero(kind > 0)
    pools = np.zeros((n_seg, Ly, E), dtype=bool)
    for i, s in enumerate(starts):
        score = pop + _gumbel(rng, (Ly, E))
        if kind[s] == 1 and i > 0:
            score[pools[i - 1]] += pr.minor_keep
        pools[i] = _topk_onehot(score, pr.pool_size).astype(bool)
    alt_scores = pop + _gumbel(rng, (n_seg, Ly, E))
    alt_scores[pools] += pr.alt_keep
    alt_pools = _topk_onehot(alt_scores, pr.pool_size).astype(bool)

    def route(seg_pools: np.ndarray) -> np.ndarray:
        scores = _gumbel(rng, (n_tok, Ly, E))
        scores += pop
        scores[seg_pools[seg]] += pr.pool_affinity
        return np.argpartition(-scores, S - 1, axis=-1)[..., :S]

    Y = route(pools)
    Z = route(alt_pools)
    return Y, Z


def _draw_acceptance(
    pr: PaperProfile,
    cp: CategoryProfile,
    rng: np.random.Generator,
    kind: np.ndarray,
    seg: np.ndarray,
    N: int,
    kmax: int,
    greedy: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Acceptance and draft confidences of every chain (steps 3 and 4 of the module docstring).

    Returns:
        ``(rho, q, D, p)``: (N, kmax) conditional acceptance and confidences (quantised), (N,) the
        first draft j (1-based) where the chain at t leaves the reference (kmax + 1 if it never does),
        and (N, kmax) the acceptance probabilities p_{t,j} behind both (not quantised).
    """
    n_tok, n_seg = len(kind), int(seg[-1]) + 1
    seg_shift = rng.normal(0.0, pr.segment_sd, size=n_seg)
    base = np.where(kind == 0, cp.p_in, np.where(kind == 1, pr.p_minor, pr.p_major))
    pi = _sigmoid(_logit(base) + seg_shift[seg] + rng.normal(0.0, pr.token_sd, size=n_tok))
    u = rng.random(n_tok)
    j_idx = np.arange(1, kmax + 1)
    tok = np.arange(N)[:, None] + j_idx[None, :]  # (N, kmax) token index of draft j
    p_chain = pi[tok] * pr.depth_decay ** (j_idx - 1)
    match = u[tok] < p_chain
    miss = ~match
    D = np.where(miss.any(axis=1), miss.argmax(axis=1) + 1, kmax + 1)
    if greedy:
        rho = (j_idx[None, :] < D[:, None]).astype(np.float64)
    else:
        rho = p_chain
    q = _sigmoid(_logit(p_chain) + rng.normal(0.0, pr.conf_sd, size=p_chain.shape))
    rho = np.round(rho * pr.quantum) / pr.quantum
    q = np.clip(np.round(q * pr.quantum) / pr.quantum, 0.0, 1.0)
    return rho, q, D, p_chain


def draft_signals(q: np.ndarray, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entropy (nats) and top-1 minus top-2 probability of a draft distribution with a geometric tail.

    The drafted token has probability q; the other tokens have (1 - q)(1 - theta) theta^(i-1),
    i = 1, 2, ... (the vocabulary is taken as unbounded: theta <= 0.995 leaves no mass past a few
    thousand tokens). The entropy is h(q) + (1 - q) H_geom(theta) >= h(q), and the margin is >= 2q - 1.

    Args:
        q: Probabilities of the drafted tokens, in [0, 1].
        theta: Tail ratios, in [0, 1).

    Returns:
        ``(entropy, margin)``, arrays of q's shape.
    """
    q = np.asarray(q, dtype=np.float64)
    theta = np.asarray(theta, dtype=np.float64)
    r = 1.0 - q

    def xlogx(x: np.ndarray) -> np.ndarray:
        return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)

    tail = (-xlogx(1.0 - theta) - xlogx(theta)) / (1.0 - theta)  # entropy of the geometric tail
    ent = -xlogx(q) - xlogx(r) + r * tail
    p2, p3 = r * (1.0 - theta), r * (1.0 - theta) * theta
    top1 = np.maximum(q, p2)
    top2 = np.maximum(np.minimum(q, p2), p3)
    return np.maximum(ent, 0.0), np.clip(top1 - top2, 0.0, 1.0)


def _draw_signals(
    pr: PaperProfile, rng: np.random.Generator, p_chain: np.ndarray, q: np.ndarray, greedy: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The draft's entropy and margin at every drafted token (step 4 of the module docstring), quantised.

    ``rng`` is the generation's signal stream: nothing else draws from it.
    """
    z = pr.tail_logit0 - pr.tail_slope * _logit(p_chain) + rng.normal(0.0, pr.tail_sd, size=p_chain.shape)
    theta = np.minimum(_sigmoid(z), pr.tail_max)
    if greedy:  # the drafted token is the draft's argmax: the second token's (1-q)(1-theta) <= q
        r = 1.0 - q
        need = np.where(r > 0, 1.0 - q / np.where(r > 0, r, 1.0), 0.0)
        theta = np.clip(np.maximum(theta, need), 0.0, pr.tail_max)
    ent, margin = draft_signals(q, theta)
    return np.round(ent * pr.quantum) / pr.quantum, np.clip(np.round(margin * pr.quantum) / pr.quantum, 0.0, 1.0)


def simulate_rounds(
    gen: Generation, model: CostModel, profile: PaperProfile, ks: range, rng: np.random.Generator
) -> pd.DataFrame:
    """Fixed-K runs over one generation: the rounds an engine would log.

    Accepted counts are drawn from rho (P(a >= i) = prod_{j<=i} rho_j), the round commits a+1 tokens,
    and timings come from the profile cost model plus noise.
    """
    N = len(gen.L)
    rows: list[tuple[int, int, int, int, int, float, float]] = []
    for K in ks:
        t, r = 0, 0
        surv = survival_table(gen.rho[:, :K], axis=1)  # P(a >= i), i = 1..K
        while t < N:
            a = int(np.count_nonzero(rng.random() < surv[t])) if K else 0
            a = min(a, N - t - 1)
            rows.append((K, r, a, int(gen.L[t]), t, float(gen.U[t, K]), float(gen.E[t, K])))
            t += a + 1
            r += 1
    arr = np.array([x[:5] for x in rows], dtype=np.int64)
    U = np.array([x[5] for x in rows])
    Em = np.array([x[6] for x in rows])
    K = arr[:, 0]
    mape = np.array([profile.mape_pct.get(int(k), 0.30) for k in range(model.kmax + 1)])
    tt_clean = model.target_ms(K, U, arr[:, 3])
    # Gaussian noise with SD such that E|e|/T = MAPE: SD = MAPE * T * sqrt(pi/2)
    sd = mape[K] / 100.0 * tt_clean * np.sqrt(np.pi / 2.0)
    tt = tt_clean + rng.normal(0.0, 1.0, size=len(K)) * sd
    td = np.maximum(model.draft_ms(K) + rng.normal(0.0, profile.draft_noise_ms, size=len(K)), 0.0)
    td[K == 0] = 0.0
    return pd.DataFrame(
        {
            "generation_id": gen.generation_id,
            "category": gen.category,
            "round": arr[:, 1].astype(np.int32),
            "K": K.astype(np.int32),
            "m": (K + 1).astype(np.int32),
            "accepted": arr[:, 2].astype(np.int32),
            "L": arr[:, 3].astype(np.int32),
            "U_r": U.astype(np.float32),
            "E_max": Em.astype(np.float32),
            "T_T_ms": tt.astype(np.float32),
            "T_D_ms": td.astype(np.float32),
            "run": [f"fixed-K{k}" for k in K],
        }
    )


def generate_paper(
    n_generations: int = 128,
    kmax: int = 10,
    seed: int = 0,
    greedy: bool = False,
    with_rounds: bool = True,
    profile: PaperProfile | None = None,
    name: str = "paper-generated",
    progress: Callable[[int, int], None] | None = None,
) -> TraceSet:
    """Generate a paper-profile trace set in memory.

    Args:
        n_generations: Number of generations G.
        kmax: Longest draft chain (budgets 0..kmax).
        seed: Master seed; generation i uses ``np.random.default_rng([seed, i])``.
        greedy: Greedy decoding (rho in {0, 1}) instead of the paper's T = 0.7 sampling.
        with_rounds: Also simulate fixed-K runs K = 1..kmax into a rounds table.
        profile: Generator knobs (default: the calibrated paper profile).
        name: Name written to the manifest.
        progress: Called as progress(done, total) after each generation.

    Returns:
        An in-memory :class:`TraceSet` (use :meth:`TraceSet.save` to write it).
    """
    if n_generations < 1:
        raise ValueError("n_generations must be >= 1")
    if not 1 <= kmax <= 16:
        raise ValueError("kmax must be in 1..16")
    pr = profile or PaperProfile()
    model = CostModel.paper_profile(kmax)
    cats = _category_list(n_generations, np.random.default_rng([seed, 2**31 - 1]))
    pos_frames, round_frames = [], []
    for i, cat in enumerate(cats):
        rng = np.random.default_rng([seed, i])
        g = generate_generation(
            i, cat, kmax, pr, rng, greedy, signal_rng=np.random.default_rng([seed, i, SIGNAL_STREAM])
        )
        cols: dict[str, np.ndarray | int | str] = {
            "generation_id": np.full(len(g.L), i, dtype=np.int64),
            "category": cat,
            "t": np.arange(len(g.L), dtype=np.int32),
            "L": g.L.astype(np.int32),
        }
        for j, c in enumerate(rho_columns(kmax)):
            cols[c] = g.rho[:, j].astype(np.float32)
        for j, c in enumerate(q_columns(kmax)):
            cols[c] = g.q[:, j].astype(np.float32)
        for j, c in enumerate(u_columns(kmax)):
            cols[c] = g.U[:, j].astype(np.float32)
        for j, c in enumerate(ent_columns(kmax)):
            cols[c] = g.ent[:, j].astype(np.float32)
        for j, c in enumerate(margin_columns(kmax)):
            cols[c] = g.margin[:, j].astype(np.float32)
        pos_frames.append(pd.DataFrame(cols))
        if with_rounds:
            round_frames.append(simulate_rounds(g, model, pr, range(1, kmax + 1), rng))
        if progress:
            progress(i + 1, n_generations)
    manifest = Manifest(
        name=name,
        source="generator",
        profile="paper",
        model=ModelFacts(pr.n_layers, pr.n_experts, pr.top_k),
        kmax=kmax,
        greedy=greedy,
        description=(
            "Synthetic generations calibrated to 'The Limits of Speculation' (Qwen3-Coder-30B-A3B + "
            "EAGLE-3, A100): Table 4 U-vs-m, Table A4 per-K costs, T_D = 0.459K + 0.073 ms."
        ),
        max_new_tokens=pr.max_new_tokens,
        vocab_size=pr.vocab_size,
        extra={
            "generator": "specenv.generator.generate_paper",
            "signal_stream": SIGNAL_STREAM,
            "seed": seed,
            "n_generations": n_generations,
            "profile": {k: v for k, v in asdict(pr).items() if k != "mape_pct"}
            | {"mape_pct": {str(k): v for k, v in pr.mape_pct.items()}},
            "categories": {c: asdict(p) for c, p in CATEGORIES.items()},
        },
    )
    positions = pd.concat(pos_frames, ignore_index=True)
    rounds = pd.concat(round_frames, ignore_index=True) if with_rounds else None
    return TraceSet(manifest, positions, rounds)
