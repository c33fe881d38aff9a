"""Batch replay: the request schedule of a batch episode, the batch cost model a set uses, the budget rule.

A batch episode (``specenv/MoESpecBatch-v0``, :mod:`specenv.envs.batch`; DESIGN.md section 3,
"batch environment") serves a fixed number R of requests with B concurrent slots. This module owns
what the environment, the batch bound (:mod:`oracle.batch`) and the batch benchmark share about
such an episode, so that all three see the same requests, the same acceptance draws and the same
plain-decoding reference:

* **requests and their randomness** (:func:`request_seeds`, :func:`request_draws`): at ``reset`` the
  environment draws R 63-bit seeds from its ``np_random``. Request r gets its own generator
  ``numpy.random.default_rng(seed_r)`` (the generator Gymnasium's ``reset(seed=seed_r)`` builds)
  and draws from it exactly what one episode of the single environment draws
  (:func:`specenv.replay.episode.draw`): its generation with ``integers(G)``, then its N
  acceptance uniforms with ``random(N)``, one per round. So request r replays the single
  environment's episode of seed ``seed_r`` round for round, and the sequence of generations does
  not depend on the policy;
* **the schedule**: slots are filled in order with requests 0..R-1; when a request finishes, the
  lowest free slot takes the next request at the next step; the episode ends when all R have
  finished (when fewer than B remain the tail slots are idle);
* **the plain-decoding reference** (:func:`ar_schedule_ms`): the same R requests decoded without
  speculation under the same schedule (every step commits one token per active request and costs
  :meth:`specenv.cost.batch.BatchCostModel.ar_ms` of the active contexts). It depends on the
  requests only, so every policy is compared with the same number: speedup = AR / policy cost;
* **the batch cost model of a set** (:func:`batch_cost_for`): ``"auto"`` is the batch model fitted
  on vLLM batch timings when they were measured on the set's engine and models
  (:func:`fitted_batch_cost`: the shipped ``live-vllm-batch-v1`` fit prices ``live-vllm``), else the scaled form
  :meth:`specenv.cost.batch.BatchCostModel.from_cost_model` of the set's single-request model
  (``"scaled"`` forces it; a path loads a batch-cost JSON);
* **the global token budget rule** (:func:`allocate_budget`, every budget at once:
  :func:`allocate_budgets`): vLLM adaptive verification's ranking of (request, draft position) pairs
  by the draft's survival estimate, spending one budget for the whole batch (the action of
  ``specenv/MoESpecBatchBudget-v0`` and the batch adaptive-verification baseline);
* **episodes at one fixed budget** (:class:`FixedBudgetEpisodes`): when every request verifies the
  same k at every step, a request's rounds do not depend on the others, so its positions are
  computed once per (request, k) for many requests at once, the schedule from the rounds' counts,
  and every step priced in one call per number of active requests. The figures are the
  environment's own (the same numbers in the same operations; tests/test_batch_fixed_replay.py
  compares them with stepping ``specenv/MoESpecBatch-v0``), at a small share of its cost: the
  dynamic-SD table's fit (:func:`policies.batch.controllers.fit_dsd_table`) prices every fixed k at
  every batch size 1..B on train episodes.
"""

from __future__ import annotations

import heapq
import os
from pathlib import Path
from typing import Any

import numpy as np

from specenv.cost.batch import SHIPPED, BatchCostModel, load_batch_cost_model, odd_queries
from specenv.cost.model import CostModel, drafted_tokens
from specenv.io import package_data
from specenv.replay.episode import draw
from specenv.validation import read_json

__all__ = [
    "BATCH_COSTS",
    "SEED_HIGH",
    "FixedBudgetEpisodes",
    "allocate_budget",
    "allocate_budgets",
    "ar_schedule_ms",
    "batch_cost_for",
    "fitted_batch_cost",
    "request_draws",
    "request_seeds",
    "step_time_recording",
]

#: Seeds of the requests are drawn in ``[0, SEED_HIGH)``.
SEED_HIGH = 2**63 - 1
#: Names ``batch_cost`` accepts besides a JSON path.
BATCH_COSTS = ("auto", "scaled")


def request_seeds(rng: np.random.Generator, n_requests: int) -> np.ndarray:
    """The R request seeds of an episode, drawn from the environment's generator (int64)."""
    return rng.integers(0, SEED_HIGH, size=int(n_requests), dtype=np.int64)


def request_draws(seed: int, lengths: np.ndarray) -> tuple[int, np.ndarray]:
    """Generation index and acceptance uniforms of a request: the single env's draws for ``reset(seed)``.

    Args:
        seed: The request's seed.
        lengths: (G,) positions N of each generation of the split.

    Returns:
        ``(g, u)``: the generation index (``integers(G)``) and its N uniforms (``random(N)``), round
        r of the request accepting ``#{i <= k : u[r] < P(a >= i)}`` drafts.
    """
    return draw(np.random.default_rng(int(seed)), lengths)


def ar_schedule_ms(
    model: BatchCostModel, generations: np.ndarray, lengths: np.ndarray, L0: np.ndarray, batch_size: int
) -> float:
    """Cost of decoding the requests without speculation under the batch schedule (module docstring).

    Args:
        model: The batch cost model.
        generations: (R,) generation index of each request, in arrival order.
        lengths: (G,) positions N of each generation.
        L0: (G,) prompt lengths.
        batch_size: B, the number of slots.

    Returns:
        Total ms: the sum over steps of ``model.ar_ms(contexts of the active requests)``.
    """
    gens = np.asarray(generations, dtype=np.int64)
    n = np.asarray(lengths, dtype=np.int64)[gens]
    start = np.asarray(L0, dtype=np.int64)[gens]
    slot_req = np.full(batch_size, -1, dtype=np.int64)
    slot_t = np.zeros(batch_size, dtype=np.int64)
    nxt = 0
    total = 0.0
    while True:
        for s in range(batch_size):  # refill free slots in order
            if slot_req[s] < 0 and nxt < len(gens):
                slot_req[s] = nxt
                slot_t[s] = 0
                nxt += 1
        active = slot_req >= 0
        if not active.any():
            return total
        req = slot_req[active]
        m = len(req)
        # every step until the first active request finishes has the same shape: price them at once
        steps = int((n[req] - slot_t[active]).min())
        ctx_sum = float((start[req] + slot_t[active]).sum()) + m * np.arange(steps, dtype=np.float64)
        u_batch = model.predict_u_batch(np.full(m, float(model.top_k)))
        total += float(model.verify_from_totals(np.full(steps, m), m, u_batch, ctx_sum).sum())
        slot_t[active] += steps
        for s in np.flatnonzero(active):
            if slot_t[s] >= n[slot_req[s]]:
                slot_req[s] = -1


def batch_cost_for(
    traces: Any, cost_model: CostModel, batch_size: int, which: str | os.PathLike[str] = "auto"
) -> BatchCostModel:
    """The batch cost model an environment uses for a trace set (module docstring).

    Args:
        traces: The loaded :class:`specenv.traces.traceset.TraceSet`.
        cost_model: Its single-request cost model (:func:`specenv.cost.source.cost_model_for`).
        batch_size: B; the model must price batches of B requests.
        which: ``"auto"``, ``"scaled"`` or a path to a batch-cost JSON
            (:meth:`specenv.cost.batch.BatchCostModel.load`).

    Raises:
        ValueError: One line naming ``batch_cost`` when the file is bad, or the model covers fewer
            than B requests or a smaller Kmax than the single model.
    """
    model: BatchCostModel | None = None
    if isinstance(which, str) and which in BATCH_COSTS:
        if which == "auto":
            model = fitted_batch_cost(traces, batch_size)
        if model is None:
            model = BatchCostModel.from_cost_model(cost_model, traces.facts, max_batch=max(int(batch_size), 1))
    else:
        try:
            model = load_batch_cost_model(which)
        except (OSError, ValueError) as exc:
            raise ValueError(f"batch_cost={os.fspath(which)!r}: {exc}") from None
    if model.max_batch < batch_size:
        raise ValueError(
            f"batch_cost: the batch cost model covers at most {model.max_batch} requests per step, "
            f"batch_size={batch_size}"
        )
    if model.kmax < cost_model.kmax:
        raise ValueError(f"batch_cost: the batch cost model covers k <= {model.kmax}, the set needs {cost_model.kmax}")
    return model


#: The shipped batch recordings (vLLM 0.32 on CPU): the small models' (forward CPU times) and
#: ``wide-moe-v1``'s (the step-time model: forwards, per-step overhead by B, the plain engine's step),
#: newest first: a model set's first recording here is the one :func:`step_time_recording` gives (v6: v5's
#: recipe on the VM of the session-26 A/B, its plain step charged per batch size (``ar_by_batch``); v5: v4's
#: recipe on the VM of the session-22 A/B, whose prefill ran at about half v4's; v4: half its
#: groups at a fixed k, the plain step's union form and its raw steps; v3, recorded on the machine of the
#: session-21 A/B; v2's machine ran the same plain step 1.6-1.9x slower, see README).
RECORDINGS = (
    SHIPPED,
    "live-vllm-wide-batch-v6",
    "live-vllm-wide-batch-v5",
    "live-vllm-wide-batch-v4",
    "live-vllm-wide-batch-v3",
    "live-vllm-wide-batch-v2",
)


def recording_manifest(where: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a batch recording: a shipped name, its folder, or a file in that folder (``batchcost.json``).

    None when there is no ``manifest.json`` there (a lone batch-cost JSON).

    Raises:
        ValueError: One line naming the manifest, when it is there but not a readable JSON object.
    """
    path = Path(where)
    if not path.exists() and os.sep not in str(where) and "/" not in str(where):
        path = package_data(str(where))  # a shipped recording's name
    manifest = (path if path.is_dir() else path.parent) / "manifest.json"
    if not manifest.is_file():
        return None
    info = read_json(manifest, what="batch recording manifest")
    if not isinstance(info, dict):
        raise ValueError(f"{manifest}: not a batch recording manifest (a JSON object)")
    return info


def _recording_models(name: str) -> tuple[str, dict[str, Any]] | None:
    try:
        info = recording_manifest(name)
    except (OSError, ValueError):
        return None
    if info is None:
        return None
    return str(info.get("extra", {}).get("models", "")), info


def step_time_recording(models: str) -> str | None:
    """The shipped batch recording of a model set whose fit is a step-time model (``timing="step"``), else None.

    ``specenv abtest`` predicts its batch sizes with it (:func:`specenv.abtest.predict_batch`).
    """
    for name in RECORDINGS:
        found = _recording_models(name)
        if found is not None and found[0] == models and load_batch_cost_model(name).ar_step is not None:
            return name
    return None


def fitted_batch_cost(traces: Any, batch_size: int) -> BatchCostModel | None:
    """The shipped batch fit measured on the engine and models of this set, else None.

    A shipped recording (:data:`RECORDINGS`: vLLM 0.32 on CPU, the shipped small models and
    ``wide-moe-v1``) prices a set recorded by vLLM (manifest ``source == "vllm"``) on the same models
    (its ``profile`` names them, e.g. ``small-moe-v1``; same experts, layers and top-k), when B is
    within the recording's batch sizes. Any other set is priced by the scaled form.
    """
    facts = traces.facts
    for name in RECORDINGS:
        found = _recording_models(name)
        if found is None:
            continue
        models, info = found
        same = (
            traces.manifest.source == "vllm"
            and models
            and str(traces.manifest.profile).startswith(models)
            and info.get("model") == {"n_layers": facts.n_layers, "n_experts": facts.n_experts, "top_k": facts.top_k}
        )
        if same:
            model = load_batch_cost_model(package_data(name))
            return model if model.max_batch >= batch_size and model.kmax >= traces.kmax else None
    return None


def allocate_budget(scores: np.ndarray, budget: int) -> np.ndarray:
    """Spend one token budget over a batch: the ``budget`` best (request, depth) pairs by score.

    vLLM adaptive verification ranks every drafted token of the batch by its survival estimate
    ``S_{r,j} = prod_{i<=j} q_{r,i}`` and verifies the best ones. Scores that are non-increasing in
    depth (such products are) make the selection a prefix of each request's chain, so it is a budget
    k_r per request. Ties go to the lower slot, then the lower depth (a stable order).

    Args:
        scores: (B, h) scores; ``-inf`` (or NaN) marks tokens that cannot be verified (idle slots).
        budget: Tokens to verify in all (capped at the number of finite scores).

    Returns:
        (B,) int64 budgets k_r (the number of tokens selected in row r, a prefix of the row).
    """
    s = np.asarray(scores, dtype=np.float64)
    B, h = s.shape
    flat = np.where(np.isfinite(s), s, -np.inf).ravel()
    # enforce the prefix property even for scores that rise with depth: running minimum along depth
    flat = np.minimum.accumulate(flat.reshape(B, h), axis=1).ravel()
    usable = int(np.isfinite(flat).sum())
    take = min(max(int(budget), 0), usable)
    order = np.argsort(-flat, kind="stable")[:take]
    k = np.zeros(B, dtype=np.int64)
    np.add.at(k, order // h, 1)
    return k


def allocate_budgets(scores: np.ndarray) -> np.ndarray:
    """:func:`allocate_budget` of every budget ``0..B*h`` at once: row b is ``allocate_budget(scores, b)``.

    The same ranking (one stable sort of the same running-minimum scores), so the same budgets; a
    budget above the finite scores verifies all of them, as there.

    Returns:
        (B*h + 1, B) int64.
    """
    s = np.asarray(scores, dtype=np.float64)
    B, h = s.shape
    flat = np.where(np.isfinite(s), s, -np.inf).ravel()
    flat = np.minimum.accumulate(flat.reshape(B, h), axis=1).ravel()
    usable = int(np.isfinite(flat).sum())
    order = np.argsort(-flat, kind="stable")[:usable]
    steps = np.zeros((B * h + 1, B), dtype=np.int64)
    steps[np.arange(1, usable + 1), order // h] = 1
    return np.cumsum(steps, axis=0)


class FixedBudgetEpisodes:
    """Episodes of ``specenv/MoESpecBatch-v0`` where every request verifies the same k (module docstring).

    Built on the environment's replay tables (``env.data``); :meth:`episode` takes what else the
    environment holds: its batch cost model, B, drafting mode and lookahead, and the R request seeds
    of the episode (``reset``'s ``info["seeds"]``). The rounds of each (request seed, k) are computed
    once and kept, so the episodes of many batch sizes that serve the same requests share them.

    Args:
        data: The replay tables (:class:`specenv.replay.tables.ReplayData`).
    """

    def __init__(self, data: Any):
        self.data = data
        self._draws: dict[int, tuple[int, np.ndarray]] = {}
        #: (seed, k) -> the positions t of the request's rounds
        self._rounds: dict[tuple[int, int], np.ndarray] = {}

    def _draw(self, seed: int) -> tuple[int, np.ndarray]:
        d = self._draws.get(seed)
        if d is None:
            d = self._draws[seed] = request_draws(seed, self.data.lengths)
        return d

    def prepare(self, seeds: Any, k: int) -> None:
        """Compute the rounds of every request seed in ``seeds`` (an iterable of ints) at budget ``k``, all at once.

        Round r of a request at position t accepts the leading run of ``u_r < P(a >= j | t)``,
        ``j = 1..k`` (``Episode.play``), and commits ``min(a + 1, N - t)``.
        """
        k = int(k)
        todo = sorted({int(s) for s in seeds if (int(s), k) not in self._rounds})
        if not todo:
            return
        d = self.data
        draws = [self._draw(s) for s in todo]
        g = np.array([gg for gg, _ in draws], dtype=np.int64)
        N = np.asarray(d.lengths, dtype=np.int64)[g]
        if k == 0:  # one token a round
            for s, n in zip(todo, N.tolist(), strict=True):
                self._rounds[(s, 0)] = np.arange(n, dtype=np.int64)
            return
        row0 = np.asarray(d.offsets, dtype=np.int64)[g]
        u = np.zeros((len(todo), int(N.max())))
        for i, (_, uu) in enumerate(draws):
            u[i, : len(uu)] = uu
        surv = np.asarray(d.survival)[:, :k]
        t = np.zeros(len(todo), dtype=np.int64)
        alive = np.flatnonzero(N > 0)
        visited: list[tuple[np.ndarray, np.ndarray]] = []  # per round: (requests alive, their t)
        r = 0
        while len(alive):
            ta = t[alive]
            passes = u[alive, r][:, None] < surv[row0[alive] + ta]
            lead = np.cumprod(passes, axis=1).sum(axis=1)
            visited.append((alive, ta))
            t[alive] = ta + np.minimum(lead + 1, N[alive] - ta)
            alive = alive[t[alive] < N[alive]]
            r += 1
        counts = np.zeros(len(todo), dtype=np.int64)
        for idx, _ in visited:
            counts[idx] += 1
        ts = np.zeros((len(todo), int(counts.max(initial=0))), dtype=np.int64)
        for j, (idx, ta) in enumerate(visited):
            ts[idx, j] = ta
        for i, s in enumerate(todo):
            self._rounds[(s, k)] = ts[i, : counts[i]]

    def episode(
        self,
        model: BatchCostModel,
        batch_size: int,
        seeds: Any,
        k: int,
        lookahead: int = 0,
        drafting: str | None = "none",
    ) -> tuple[float, int]:
        """One episode with budget ``k`` for every request: ``(cost ms, steps)``, as the environment's info.

        The episode's AR reference does not depend on k: :meth:`ar_ms`.

        Args:
            model: The environment's batch cost model.
            batch_size: B, the slots.
            seeds: (R,) the request seeds, in arrival order.
            k: The budget of every request at every step.
            lookahead: The environment's lookahead (the draft term of mode ``block``).
            drafting: The environment's drafting mode.
        """
        d = self.data
        seeds = [int(s) for s in np.asarray(seeds).ravel()]
        self.prepare(seeds, k)
        B = int(batch_size)
        rounds = [self._rounds[(s, k)] for s in seeds]
        gens = np.array([self._draw(s)[0] for s in seeds], dtype=np.int64)
        # the schedule: a request starts at the step after its slot's last one ended, lowest free slot first
        free = [(0, s) for s in range(min(B, len(seeds)))]
        start = np.empty(len(seeds), dtype=np.int64)
        slot = np.empty(len(seeds), dtype=np.int64)
        for r, ts in enumerate(rounds):
            step, s = heapq.heappop(free)
            start[r], slot[r] = step, s
            heapq.heappush(free, (step + len(ts), s))
        n_steps = int(max(start[r] + len(ts) for r, ts in enumerate(rounds)))
        U = np.zeros((n_steps, B))
        ctx = np.zeros((n_steps, B), dtype=np.int64)
        active = np.zeros((n_steps, B), dtype=bool)
        Ucol = np.asarray(d.U)[:, k]
        offsets = np.asarray(d.offsets, dtype=np.int64)
        L0 = np.asarray(d.L0, dtype=np.int64)
        for r, ts in enumerate(rounds):
            a, s, g = int(start[r]), int(slot[r]), int(gens[r])
            U[a : a + len(ts), s] = Ucol[offsets[g] + ts]
            ctx[a : a + len(ts), s] = L0[g] + ts
            active[a : a + len(ts), s] = True
        m = active.sum(axis=1)
        ctx_sum = ctx.sum(axis=1).astype(np.float64)
        step_ms = np.empty(n_steps)
        for n in np.unique(m).tolist():
            sel = np.flatnonzero(m == n)
            u_rows = U[sel][active[sel]].reshape(len(sel), n)  # the active slots' U, in slot order
            u_batch = model.predict_u_batch_many(u_rows)
            odd = odd_queries(np.full(n, k))  # every request verifies k
            verify = model.verify_from_totals(np.full(len(sel), n * (k + 1)), n, u_batch, ctx_sum[sel], odd)
            step_ms[sel] = verify + model.draft_ms(drafted_tokens(np.full(n, k), lookahead, drafting))
        cost = 0.0
        for x in step_ms.tolist():  # the environment's running sum, step by step
            cost += x
        return cost, n_steps

    def ar_ms(self, model: BatchCostModel, batch_size: int, seeds: Any) -> float:
        """The episode's plain-decoding reference (the environment's ``info["ar_cost_ms"]``, :func:`ar_schedule_ms`)."""
        gens = np.array([self._draw(int(s))[0] for s in seeds], dtype=np.int64)
        return ar_schedule_ms(model, gens, self.data.lengths, self.data.L0, int(batch_size))
