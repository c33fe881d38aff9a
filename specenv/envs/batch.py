"""The batch environment: choose the speculation length of every request of a batched verification step.

``gymnasium.make("specenv/MoESpecBatch-v0", dataset=..., batch_size=4, n_requests=16, ...)`` replays
B concurrent requests from any positions table and prices each step with the batch cost model
(:mod:`specenv.cost.batch`); ``specenv/MoESpecBatchBudget-v0`` takes one global token budget instead
of one k per request. DESIGN.md section 3 ("batch environment") is the contract; see
:class:`MoESpecBatchEnv`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from specenv.cost.batch import BatchCostModel, odd_queries
from specenv.cost.model import drafted_tokens
from specenv.envs.common import DEFAULT_REWARD, check_reward
from specenv.observation.batch import BatchObservationSpec
from specenv.observation.single import ScalarObservation
from specenv.replay.batch import allocate_budget, ar_schedule_ms, batch_cost_for, request_seeds
from specenv.replay.episode import Episode, RoundTables
from specenv.replay.tables import replay_data
from specenv.traces.datasets import DEFAULT_DATASET, load_dataset

__all__ = ["BATCH_ID", "BUDGET_ID", "MoESpecBatchBudgetEnv", "MoESpecBatchEnv"]

BATCH_ID = "specenv/MoESpecBatch-v0"
BUDGET_ID = "specenv/MoESpecBatchBudget-v0"
#: Default slots and requests per episode (R = 4 B unless given).
DEFAULT_BATCH = 4


class MoESpecBatchEnv(gym.Env[np.ndarray, np.ndarray]):
    """B concurrent replayed requests, one speculation length per request and step.

    ## Description

    Each episode serves ``n_requests`` (R) requests through ``batch_size`` (B) slots. A request is
    one generation of the split replayed exactly as one episode of ``specenv/MoESpec-v1`` (same
    round model, same acceptance draw: each request is a :class:`specenv.replay.episode.Episode` and
    :meth:`~specenv.replay.episode.Episode.play` runs its round). Request r has its own seed, drawn at
    ``reset`` from ``np_random`` (:func:`specenv.replay.batch.request_seeds`): it replays the single
    environment's episode of that seed, whatever the other requests do. When a request finishes, the
    lowest free slot takes the next request at the next step; when fewer than B requests remain, the
    tail slots are idle; the episode terminates when all R have finished.

    ## Cost

    One step verifies every active request at once and costs
    :meth:`specenv.cost.batch.BatchCostModel.step_ms`: request i verifies ``k_i + 1`` positions with
    its own unique experts ``U_{t,k_i}`` (the positions table), the expert union ``U_batch`` is
    predicted from those by the model's predictor, and the draft term follows the drafting mode
    (``none``: request i drafts k_i tokens; ``block``: every active request drafts ``max(k_i, h)``,
    as vLLM's drafter runs ``num_speculative_tokens`` steps for the whole batch; ``sequential``:
    k_i). The batch cost model is ``batch_cost`` (:func:`specenv.replay.batch.batch_cost_for`:
    ``"auto"`` = the vLLM batch fit when it was measured on the set's engine and models
    (:func:`specenv.replay.batch.fitted_batch_cost`: ``live-vllm``), else the scaled form of the set's
    single-request model ``cost_model``).

    ## Spaces

    * action: ``MultiDiscrete([kmax+1] * B)``, the budget of the request in each slot; the entries of
      idle slots are ignored (any value in range is accepted);
    * observation: :class:`specenv.observation.batch.BatchObservationSpec` (B slot blocks ``[active,
      per-request observation]`` + ``n_active``, ``queue``, ``prev_U_batch``, ``prev_step_cost``).

    ## Rewards

    In AR-step units, as the single environment: the unit ``ar_unit_ms`` is the plain AR step of a
    full batch per request, ``mean_t BatchCostModel.ar_ms([L_t] * B) / B`` over the split's positions
    (a constant). ``reward="savings"`` (default): tokens committed by the step (all requests) minus
    ``step_ms / ar_unit_ms``; ``"cost"``: minus that cost. The returns differ by the constant total
    length of the R requests: same optimum.

    ## Info

    ``step_ms``, ``U_batch``, ``k`` / ``accepted`` / ``committed`` per slot (-1 / -1 / 0 for idle
    slots), ``active``, ``served`` (requests finished); at termination ``speedup`` = AR / episode
    cost, where AR is the same requests decoded without speculation under the same schedule
    (:func:`specenv.replay.batch.ar_schedule_ms`), ``episode_cost_ms``, ``ar_cost_ms``, ``steps``,
    ``generation_ids`` and ``seeds`` of the R requests.

    Args:
        dataset: Registry name or folder of a trace set with a positions table.
        batch_size: B, slots (1..64).
        n_requests: R, requests per episode (default 4 B).
        kmax: Largest budget (default the set's Kmax).
        split: ``"train"``, ``"test"`` or ``"all"``.
        cost_model: The set's single-request cost model (``"fit"``, ``"profile"``, a JSON path).
        batch_cost: ``"auto"``, ``"scaled"`` or a batch-cost JSON path.
        lookahead: Draft confidences per request (as the single environment).
        drafting: ``"none"``, ``"block"`` or ``"sequential"`` (as the single environment).
        signals: Draft signals of the lookahead block.
        reward: ``"savings"`` or ``"cost"``.
        render_mode: None or ``"ansi"`` (one line per step).

    Raises:
        ValueError: Naming the argument (as the single environment, plus ``batch_size``,
            ``n_requests`` and ``batch_cost``).

    ## Version History

    * v0: initial version (batch observation contract 1, :data:`specenv.observation.batch.BATCH_OBSERVATION_VERSION`).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}
    env_id = BATCH_ID

    def __init__(
        self,
        dataset: str = DEFAULT_DATASET,
        batch_size: int = DEFAULT_BATCH,
        n_requests: int | None = None,
        kmax: int | None = None,
        split: str = "train",
        cost_model: str = "fit",
        batch_cost: str = "auto",
        lookahead: int | None = None,
        drafting: str | None = None,
        signals: Any = ("q",),
        reward: str = DEFAULT_REWARD,
        render_mode: str | None = None,
    ):
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode={render_mode!r}: expected None or one of {self.metadata['render_modes']}")
        self.render_mode = render_mode
        self.B = _check_count("batch_size", batch_size, 64)
        self.R = self.B * 4 if n_requests is None else _check_count("n_requests", n_requests, 1_000_000)
        self._savings = check_reward(reward)
        self.reward = reward
        self.data = replay_data(dataset, kmax, split, cost_model, lookahead, drafting, signals)
        self.kmax = self.data.kmax
        self.lookahead = self.data.lookahead
        self.drafting = self.data.drafting
        self.batch_cost: BatchCostModel = batch_cost_for(
            load_dataset(dataset), self.data.cost_model, self.B, batch_cost
        )
        self.spec_batch = BatchObservationSpec(self.data.spec, self.B)
        ctx = self._contexts()
        u_ar = self.batch_cost.predict_u_batch(np.full(self.B, float(self.batch_cost.top_k)))
        per_req = self.batch_cost.verify_from_totals(np.full(len(ctx), self.B), self.B, u_ar, self.B * ctx) / self.B
        self.ar_unit_ms = float(np.mean(per_req))
        # U_batch of a plain AR step of n requests (every U_i = top_k), n = 0..B
        tk = float(self.batch_cost.top_k)
        self._u_ar = [0.0] + [self.batch_cost.predict_u_batch(np.full(n, tk)) for n in range(1, self.B + 1)]
        self.action_space = spaces.MultiDiscrete(np.full(self.B, self.kmax + 1, dtype=np.int64))
        self.observation_space = self.spec_batch.space()
        self._tables = RoundTables.of(self.data)
        # slot s: its request's episode (None when idle) and observation state
        self._episodes: list[Episode | None] = [None] * self.B
        self._slot_obs = [ScalarObservation(self.data.spec) for _ in range(self.B)]
        self._active = np.zeros(self.B, dtype=bool)
        self._done = True
        self._line = ""

    def _contexts(self) -> np.ndarray:
        """Context length L_t of every row of the split."""
        d = self.data
        t = np.arange(len(d.ar_ms)) - np.repeat(d.offsets[:-1], d.lengths)
        return np.repeat(d.L0, d.lengths).astype(np.float64) + t

    # ------------------------------------------------------------------ episode
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Draw the R request seeds and fill the slots with the first requests.

        Args:
            seed: Seeds ``np_random`` (gymnasium semantics).
            options: ``{"seeds": [...]}`` to serve requests of given seeds (R of them, each >= 0).

        Raises:
            ValueError: For an unknown option or a bad seed list.
        """
        super().reset(seed=seed)
        seeds = None
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"options={options!r}: must be a dict (supported key: 'seeds')")
        if options:
            unknown = set(options) - {"seeds"}
            if unknown:
                raise ValueError(f"options: unknown key(s) {sorted(unknown)} (supported: 'seeds')")
            seeds = options.get("seeds")
        if seeds is None:
            self._seeds = request_seeds(self.np_random, self.R)
        else:
            arr = np.asarray(seeds)
            if (
                arr.ndim != 1
                or len(arr) != self.R
                or not np.issubdtype(arr.dtype, np.integer)
                or (arr < 0).any()
                or (arr > np.iinfo(np.int64).max).any()  # a uint64 seed would wrap negative in int64
            ):
                raise ValueError(f"options['seeds']: expected {self.R} integers in 0..2**63-1 (n_requests)")
            self._seeds = arr.astype(np.int64)
        self._next = 0
        self._served = 0
        self._steps = 0
        self._ep_cost = 0.0
        self._gens = np.full(self.R, -1, dtype=np.int64)
        self._active[:] = False
        self._prev = np.zeros(2)
        self._done = False
        self._refill()
        self._line = f"reset: {self.R} requests, {int(self._active.sum())} active"
        return self._observation(), {"seeds": [int(s) for s in self._seeds]}

    def _refill(self) -> None:
        """Give every free slot the next request (lowest slot first)."""
        for s in range(self.B):
            if not self._active[s] and self._next < self.R:
                rng = np.random.default_rng(int(self._seeds[self._next]))
                ep = self._episodes[s] = Episode.start(self.data, rng, tables=self._tables)
                self._slot_obs[s].reset()
                self._gens[self._next] = ep.generation
                self._next += 1
                self._active[s] = True

    def _observation(self) -> np.ndarray:
        d = self.data
        reqs = np.zeros((self.B, d.spec.dim), dtype=np.float32)
        for s in np.flatnonzero(self._active):
            ep = self._episodes[s]
            conf = d.conf[ep.row].tolist() if self.lookahead else None
            reqs[s] = self._slot_obs[s].build(ep.L0 + ep.t, ep.t, conf)
        feats = np.array(
            [
                self._active.sum() / self.B,
                (self.R - self._next) / self.R,
                self._prev[0] / self.batch_cost.n_experts,
                self._prev[1] / (self.kmax + 1),
            ]
        )
        return self.spec_batch.assemble(self._active, reqs, feats)

    def _check_action(self, action: Any) -> np.ndarray:
        try:
            k = np.asarray(action)
        except Exception:  # pragma: no cover - numpy accepts nearly anything
            k = None
        if k is None or k.shape != (self.B,) or not np.issubdtype(k.dtype, np.integer):
            raise ValueError(f"action={action!r}: expected {self.B} integers in 0..{self.kmax} (one per slot)")
        if k.min() < 0 or k.max() > self.kmax:
            raise ValueError(f"action={k.tolist()}: every budget must be in 0..{self.kmax}")
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset()")
        return k.astype(np.int64)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One batched verification step with budget ``action[i]`` for the request in slot i.

        Raises:
            ValueError: If ``action`` is not B integers in 0..kmax.
            RuntimeError: If called before :meth:`reset` or after the episode ended.
        """
        return self._step_budgets(self._check_action(action))

    def _step_budgets(self, k: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        d = self.data
        slots = np.flatnonzero(self._active)
        ks = k[slots]
        episodes = [self._episodes[s] for s in slots]
        rows = np.array([ep.row for ep in episodes], dtype=np.int64)
        u = d.U[rows, ks]
        ctx = np.array([ep.L0 + ep.t for ep in episodes], dtype=np.float64)
        drafted = drafted_tokens(ks, self.lookahead, self.drafting)
        bc = self.batch_cost
        n = len(slots)
        # BatchCostModel.step_ms / ar_ms through their vectorised parts (no per-call validation)
        u_batch = float(bc.predict_u_batch_many(u[None, :])[0])
        ctx_sum = float(ctx.sum())
        step_ms = float(bc.verify_from_totals(int(ks.sum()) + n, n, u_batch, ctx_sum, odd_queries(ks))) + bc.draft_ms(
            drafted
        )
        batch_ar = float(bc.verify_from_totals(n, n, self._u_ar[n], ctx_sum))
        k_info = [-1] * self.B
        acc_info = [-1] * self.B
        com_info = [0] * self.B
        committed = 0
        step_units = step_ms / batch_ar  # every request's prev_cost: the step's cost in batch AR steps
        for s, ep, kk in zip(slots, episodes, ks, strict=True):
            r = ep.play(int(kk))  # the request's round (its draw and commit; the step is priced above)
            self._slot_obs[s].update(r.k, r.accepted, r.U_r, step_units, r.committed)
            k_info[s], acc_info[s], com_info[s] = r.k, r.accepted, r.committed
            committed += r.committed
            if r.terminated:
                self._active[s] = False
                self._served += 1
        self._steps += 1
        self._ep_cost += step_ms
        self._prev = np.array([u_batch, step_ms / batch_ar])
        self._refill()
        units = step_ms / self.ar_unit_ms
        reward = float(committed - units) if self._savings else float(-units)
        terminated = self._served >= self.R
        info: dict[str, Any] = {
            "step_ms": float(step_ms),
            "U_batch": float(u_batch),
            "k": k_info,
            "accepted": acc_info,
            "committed": com_info,
            "active": len(slots),
            "served": self._served,
        }
        if terminated:
            self._done = True
            ar = ar_schedule_ms(bc, self._gens, d.lengths, d.L0, self.B)
            info |= {
                "speedup": ar / self._ep_cost,
                "episode_cost_ms": self._ep_cost,
                "ar_cost_ms": ar,
                "steps": self._steps,
                "generation_ids": [int(d.generation_ids[g]) for g in self._gens],
                "seeds": [int(s) for s in self._seeds],
            }
        self._line = (
            f"step {self._steps}: k={k_info} accepted={acc_info} cost={step_ms:.3f}ms U_batch={u_batch:.2f} "
            f"served {self._served}/{self.R}" + (" (done)" if terminated else "")
        )
        return self._observation(), reward, bool(terminated), False, info

    def rows(self) -> np.ndarray:
        """(B,) position row (``data`` table index ``offsets[g] + t``) of each slot's request, -1 when idle.

        For labelling visited states (imitation of the bound); a policy never sees it.
        """
        out = np.full(self.B, -1, dtype=np.int64)
        for s in np.flatnonzero(self._active):
            out[s] = self._episodes[s].row
        return out

    def remaining(self) -> np.ndarray:
        """(B,) tokens left ``N - t`` of each slot's request, 0 when idle (a policy never sees it)."""
        out = np.zeros(self.B, dtype=np.int64)
        for s in np.flatnonzero(self._active):
            ep = self._episodes[s]
            out[s] = ep.N - ep.t
        return out

    def render(self) -> str | None:
        """The last step as one line of text (``render_mode="ansi"``); None without a render mode."""
        if self.render_mode is None:
            gym.logger.warn(
                "You are calling render method without specifying any render mode. "
                f'Create the environment with render_mode="ansi", e.g. gym.make("{self.env_id}", render_mode="ansi")'
            )
            return None
        return self._line


class MoESpecBatchBudgetEnv(MoESpecBatchEnv):
    """:class:`MoESpecBatchEnv` whose action is one token budget for the whole batch.

    The action b in ``0..B*h`` is the number of drafted tokens the step verifies in all. The drafter
    has proposed h = ``lookahead`` tokens for every active request (drafting mode ``block``, as vLLM);
    the tokens are ranked by the draft's survival estimate ``prod_{i<=j} q_{r,i}`` and the b best are
    verified (:func:`specenv.replay.batch.allocate_budget`, vLLM adaptive verification's ranking), which
    gives each request a prefix k_r. A budget above the active requests' drafts verifies all of them.
    Everything else (observation, cost, reward, info) is :class:`MoESpecBatchEnv`'s.

    Args:
        lookahead: Drafts per request, h (default kmax); ``drafting`` must be ``"block"`` (default).
        **kwargs: As :class:`MoESpecBatchEnv`.

    ## Version History

    * v0: initial version.
    """

    env_id = BUDGET_ID

    def __init__(self, lookahead: int | None = None, drafting: str | None = "block", **kwargs: Any):
        if drafting != "block":
            raise ValueError(f"drafting={drafting!r}: the budget environment drafts h tokens per request ('block')")
        super().__init__(lookahead=lookahead, drafting="block", **kwargs)
        self.action_space = spaces.Discrete(self.B * self.lookahead + 1)

    def budgets(self, budget: int) -> np.ndarray:
        """The per-slot budgets the ranking rule gives a global ``budget`` at the current step."""
        d = self.data
        h = self.lookahead
        scores = np.full((self.B, h), -np.inf)
        for s in np.flatnonzero(self._active):
            scores[s] = np.cumprod(d.conf[self._episodes[s].row, :h])
        return allocate_budget(scores, budget)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One batched step that verifies the ``action`` best drafted tokens of the batch.

        Raises:
            ValueError: If ``action`` is not an integer in 0..B*h.
            RuntimeError: If called before :meth:`reset` or after the episode ended.
        """
        try:
            b = action.__index__()
        except (AttributeError, TypeError):
            raise ValueError(f"action={action!r}: must be an integer in 0..{self.B * self.lookahead}") from None
        if not 0 <= b <= self.B * self.lookahead:
            raise ValueError(f"action={b}: outside 0..{self.B * self.lookahead}")
        if self._done:
            raise RuntimeError("step() called before reset() or after the episode ended; call reset()")
        obs, reward, terminated, truncated, info = self._step_budgets(self.budgets(b))
        info["budget"] = int(b)
        return obs, reward, terminated, truncated, info


def _check_count(name: str, value: Any, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= high:
        raise ValueError(f"{name}={value!r}: must be an integer in 1..{high}")
    return int(value)
