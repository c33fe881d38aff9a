"""The live environment: every step executes a real speculative-decoding round on an engine.

``gymnasium.make("specenv/MoESpecLive-v1", ...)`` mirrors the replay environment
(:class:`specenv.envs.replay.MoESpecEnv`, ``specenv/MoESpec-v1``) exactly in its spaces, observation, reward
unit and info keys, but instead of replaying a recorded generation it runs an engine (by default the
shipped small Qwen3-MoE target and dense draft on transformers) on a prompt: the budget k
chosen by the agent is drafted, verified in one target pass and committed, and the round's accepted
count, routing (U_r) and times are real. Registered with ``nondeterministic=True``: measured times
differ between runs (greedy decoding itself is deterministic).

Needs the extra of the chosen engine: ``live`` (transformers, tokenizers, safetensors) for ``backend="hf"``,
``vllm`` for ``backend="vllm"``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gymnasium import spaces

from specenv.cost.model import drafted_tokens
from specenv.envs.common import DEFAULT_REWARD, RoundEnv, check_reward, reset_generation_id
from specenv.envs.registration import LIVE_ID
from specenv.envs.render import RENDER_MODES, RoundStrip, check_render_mode
from specenv.observation.single import ScalarObservation
from specenv.replay.tables import replay_data
from specenv.traces.datasets import load_dataset

LIVE_ENV_ID = LIVE_ID
#: Where the round cost comes from: the measured times, or the cost model at the measured routing.
COST_SOURCES = ("measured", "model")
CLOCKS = ("cpu", "wall")


def _check_options(
    backend: str, render_mode: str | None, reward: str, cost_source: str, clock: str, threads: int | None
) -> bool:
    """Check the live environment's options (in this order: the first bad one is reported).

    Returns:
        Whether the reward is ``"savings"``.

    Raises:
        ValueError: Naming the first bad option.
    """
    from specenv.engines import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {tuple(BACKENDS)}")
    check_render_mode(render_mode)
    savings = check_reward(reward)
    if cost_source not in COST_SOURCES:
        raise ValueError(f"cost_source={cost_source!r}: expected one of {COST_SOURCES}")
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {CLOCKS}")
    if clock == "cpu" and threads != 1:
        raise ValueError(f"clock='cpu' measures the calling thread only: it needs threads=1 (got {threads!r})")
    return savings


def _episode_prompts(prompts: str, data: Any, split: str) -> list[Any]:
    """The prompts of ``prompts`` whose ids are generations of the replay data, in the prompt set's order.

    Raises:
        ValueError: If the prompt set holds none of them.
    """
    from specenv.engines.hf.models import load_prompts

    wanted = {int(g) for g in data.generation_ids}
    kept = [p for p in load_prompts(prompts) if p.id in wanted]
    if not kept:
        raise ValueError(
            f"prompts={os.fspath(prompts)!r}: holds none of the generations of dataset '{data.name}' (split '{split}')"
        )
    return kept


class MoESpecLiveEnv(RoundEnv):
    """Live speculative decoding; the agent picks the draft budget k of every round.

    ## Description

    The replay environment's task (:class:`specenv.envs.replay.MoESpecEnv`) on a real engine:
    every step drafts ``k`` tokens with the draft model, verifies them in one pass of the MoE
    target and commits the accepted prefix plus the target's next token; the round's accepted
    count, routing (``U_r``) and times are measured, not replayed. One episode is one generation:
    a prompt of the live prompt set, generated greedily (or sampled, ``temperature > 0``) for
    ``max_new_tokens`` tokens or until end-of-text. The episodes are the generations of
    ``dataset`` (by default ``live-cpu``, recorded from the same prompts and models) that fall in
    ``split`` (the split rule of :mod:`specenv.traces.splits`), so the replay environment on ``live-cpu``
    and this one run the same generations. The engine is chosen by name (``backend``, see
    :func:`specenv.engines.make_backend`).

    ## Action Space

    ``Discrete(kmax + 1)``: the budget k (0 = plain autoregressive step).

    ## Observation Space

    The replay environment's: same shape, features, scaling and arithmetic (the table in
    :class:`specenv.envs.replay.MoESpecEnv`, names in order
    :attr:`specenv.observation.single.ObservationSpec.names`), with measured values: ``prev_U`` is the
    round's measured U_r, ``prev_cost`` its cost (see Rewards) in AR units. With
    ``lookahead = h > 0`` the draft proposes h tokens *before* the decision and their confidences
    are the last h entries (``conf_1..conf_h``); that drafting is part of the next round's draft
    time.

    ## Rewards

    As in the replay environment, in the same AR-step units: ``reward="savings"`` (default) gives
    ``committed - cost / ar_unit_ms``, ``reward="cost"`` (the default of ``specenv/MoESpecLive-v0``)
    gives ``-cost / ar_unit_ms``. The two episode returns differ by the generated length, which the
    budgets do not change under greedy decoding (lossless), so they have the same optimal policy.
    ``ar_unit_ms`` is the replay environment's unit for the same ``dataset``/``split``/
    ``cost_model`` (mean model AR step cost). The round's ``cost`` comes from ``cost_source``:

    * ``"measured"`` (default): the measured ``T_T + T_D`` of the round in ms, by ``clock``:
      ``"cpu"`` (default; thread CPU time, as in the shipped ``live-cpu`` rounds, unaffected by
      other processes on the machine) or ``"wall"`` (``time.perf_counter``);
    * ``"model"``: the cost model at the round's measured U_r and context,
      ``T_T(k, U_r, L) + T_D(n)`` with n the drafted tokens of the drafting mode (``max(k, h)`` in
      ``"block"``, k in ``"none"`` and ``"sequential"``).

    ## Starting State

    :meth:`reset` picks a prompt with ``np_random`` (or ``options["generation_id"]``), seeds the
    engine's sampling from ``np_random`` and prefills the prompt; no round played yet.

    ## Episode End

    * Termination: the generation ends (``max_new_tokens`` reached or end-of-text).
    * Truncation: never.

    ``info`` of :meth:`step`: the replay environment's keys (``k``, ``accepted``, ``committed``,
    ``cost_ms``, ``U_r``, ``L``, ``t``, ``generation_id``, ``category``) plus the measured
    ``T_T_ms``, ``T_D_ms`` (wall clock), ``T_T_cpu_ms``, ``T_D_cpu_ms`` (thread CPU time) and
    ``E_max``; on the terminating step also ``speedup`` (model AR cost of the generated length /
    episode cost), ``episode_cost_ms``, ``ar_cost_ms`` (sum over the generated positions of the
    cost model's AR step C(t, 0)) and ``rounds``. Registered with ``nondeterministic=True``:
    measured times differ between runs (greedy decoding itself is deterministic).

    ## Arguments

    ```python
    gymnasium.make("specenv/MoESpecLive-v1", dataset="live-cpu", kmax=None, split="train",
                   cost_model="fit", lookahead=None, cost_source="measured", clock="cpu",
                   prompts="stdlib-code-v1", models="small-moe-v1", max_new_tokens=None,
                   temperature=0.0, threads=1, render_mode=None, backend="hf", reward="savings",
                   drafting=None)
    ```

    Args:
        dataset: Trace set that defines the episodes, the cost model and the reward unit.
        kmax: Largest budget; default the trace set's Kmax (at most that).
        split: ``"train"`` (default), ``"test"`` or ``"all"``.
        cost_model: ``"fit"`` (fitted on the set's rounds), ``"profile"`` or a cost-model JSON path.
        lookahead: Draft confidences exposed before each decision (0..kmax; None: the default of the
            drafting mode, 0 for none, kmax for block and sequential).
        cost_source: ``"measured"`` (default) or ``"model"`` (see Rewards).
        clock: Clock of the measured cost: ``"cpu"`` (default; needs ``threads=1``) or ``"wall"``.
        prompts: Prompt set (shipped name or JSON path) holding the dataset's generation ids.
        models: Model set (shipped name or folder).
        max_new_tokens: Generation cap; default the trace set's ``max_new_tokens``.
        temperature: 0 = greedy (lossless); > 0 = sampling with speculative rejection sampling
            (seeded from ``np_random`` at reset).
        threads: Torch threads (process-wide setting).
        render_mode: None, ``"ansi"`` (the last round as one line) or ``"rgb_array"`` (a
            ``(64, 128, 3)`` uint8 bar strip of the last 32 rounds, as in the replay environment).
        backend: Engine name, a key of :data:`specenv.engines.BACKENDS`: ``"hf"`` (default): the
            transformers engine (:class:`specenv.engines.hf.engine.LiveEngine`, ``live`` extra);
            ``"vllm"``: an in-process vLLM engine stepped one round at a time
            (:class:`specenv.engines.vllm.live.VLLMBackend`, ``vllm`` extra; lookahead shows the q of
            the drafts vLLM proposed, captured from the draft's logits; vLLM's prefill samples the
            first token; the drafter proposes ``kmax`` tokens ahead of each round).
        reward: ``"savings"`` (default) or ``"cost"`` (see Rewards).
        drafting: ``"none"``, ``"block"`` or ``"sequential"``, checked with ``lookahead`` by
            :func:`specenv.cost.model.check_drafting` as in the replay environment (None: block for
            lookahead > 0, else none). ``"sequential"`` shows ``conf_1..h`` (the engine drafts them
            before the decision) for a stop rule that reads ``conf_1..k`` only, and needs
            ``cost_source="model"``: it charges ``T_D(k)``, the drafts a sequential drafter makes.

    Raises:
        ValueError: Naming the argument, for a bad dataset, kmax, split, cost model, lookahead,
            drafting, reward, cost source, clock, backend or render mode, or a prompt set without the
            dataset's generations.

    ## Version History

    * v1: the default reward is ``"savings"`` (was ``"cost"``), as in the replay environment's v1.
      ``specenv/MoESpecLive-v0`` stays registered: the same class with ``reward="cost"``.
    * v0: initial version. The measured/model switch, first named ``reward``, is now
      ``cost_source``; ``reward`` is the cost|savings option of the replay environment;
      ``render_mode="rgb_array"`` added.

    Examples:
        >>> import gymnasium as gym
        >>> import specenv
        >>> env = gym.make("specenv/MoESpecLive-v1", max_new_tokens=8, split="all")
        >>> env.action_space
        Discrete(9)
        >>> obs, info = env.reset(seed=0)
        >>> obs.shape
        (18,)
        >>> obs, reward, terminated, truncated, info = env.step(3)
        >>> units = info["cost_ms"] / env.unwrapped.ar_unit_ms
        >>> reward == info["committed"] - units, info["committed"] == info["accepted"] + 1, info["T_T_ms"] > 0
        (True, True, True)
        >>> env.close()
    """

    metadata = {"render_modes": list(RENDER_MODES), "render_fps": 4}
    env_id = LIVE_ENV_ID

    def __init__(
        self,
        dataset: str = "live-cpu",
        kmax: int | None = None,
        split: str = "train",
        cost_model: str = "fit",
        lookahead: int | None = None,
        cost_source: str = "measured",
        clock: str = "cpu",
        prompts: str = "stdlib-code-v1",
        models: str = "small-moe-v1",
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        threads: int | None = 1,
        render_mode: str | None = None,
        backend: str = "hf",
        reward: str = DEFAULT_REWARD,
        drafting: str | None = None,
    ):
        from specenv.engines import BackendConfig, make_backend

        self._savings = _check_options(backend, render_mode, reward, cost_source, clock, threads)
        if drafting == "sequential" and cost_source == "measured":
            raise ValueError(
                "drafting='sequential': the engine drafts the shown tokens before the decision, so its measured "
                "draft time would charge drafts a stop rule never made; use cost_source='model' (T_D(k) charged)"
            )
        self.render_mode = render_mode
        self.reward = reward
        self.cost_source = cost_source
        self.clock = clock
        self.data = replay_data(dataset, kmax, split, cost_model, lookahead, drafting)
        self.kmax = self.data.kmax
        self.lookahead = self.data.lookahead
        self.drafting = self.data.drafting
        self.ar_unit_ms = self.data.ar_unit_ms
        self.cost_model = self.data.cost_model
        if max_new_tokens is None:
            max_new_tokens = int(load_dataset(dataset).manifest.max_new_tokens)
        self.prompts = _episode_prompts(prompts, self.data, split)
        config = BackendConfig(self.kmax, int(max_new_tokens), temperature, threads, self.lookahead)
        self.engine = make_backend(backend, models, config)
        self.models = self.engine.models
        self._ids = [self.models.encode(p.text) for p in self.prompts]
        self.action_space = spaces.Discrete(self.kmax + 1)
        self.observation_space = self.data.spec.space()
        self._obs = ScalarObservation(self.data.spec)
        self._done = True
        self._line = ""
        self._strip = RoundStrip(self.kmax) if render_mode == "rgb_array" else None
        self._closed = False

    # ------------------------------------------------------------------ episode
    def _conf(self) -> list[float] | None:
        if not self.lookahead:
            return None
        return self.engine.propose(self.lookahead)[: self.lookahead]

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start a generation: a prompt picked with ``np_random`` or ``options["generation_id"]``.

        Raises:
            ValueError: If ``options`` has an unknown key or names a generation not in the split.
        """
        super().reset(seed=seed)
        gid = reset_generation_id(options)
        rng = self.np_random
        if gid is None:
            g = int(rng.integers(len(self.prompts)))
        else:
            hits = [i for i, p in enumerate(self.prompts) if p.id == gid]
            if not hits:
                raise ValueError(
                    f"options['generation_id']={gid!r}: not in the '{self.data.split}' split of "
                    f"dataset '{self.data.name}' ({len(self.prompts)} generations)"
                )
            g = hits[0]
        self.engine.seed(int(rng.integers(2**31)))
        p = self.prompts[g]
        self._gid, self._cat = int(p.id), p.category
        self.engine.start(self._ids[g])
        self._L0 = self.engine.L
        self._round = 0
        self._ep_cost = 0.0
        self._ar_cost = 0.0
        self._done = False
        self._obs.reset()
        self._line = f"gen {self._gid} [{self._cat}] t=0"
        if self._strip is not None:
            self._strip.clear()
        return self._obs.build(self._L0, 0, self._conf()), {"generation_id": self._gid, "category": self._cat}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Execute one real verification round with budget ``action``.

        Raises:
            ValueError: If ``action`` is not an integer in 0..kmax.
            RuntimeError: If called before :meth:`reset` or after the episode ended.
        """
        k = self._check_action(action)
        r = self.engine.step(k)
        cm = self.cost_model
        if self.cost_source == "measured":
            cost = float(r.T_T_cpu_ms + r.T_D_cpu_ms) if self.clock == "cpu" else float(r.T_T_ms + r.T_D_ms)
        else:
            cost = float(cm.charged_ms(k, r.U_r, r.L, drafted=drafted_tokens(k, self.lookahead, self.drafting)))
        committed = len(r.committed)
        t_new = r.t + committed
        Ls = np.arange(r.L, r.L + committed, dtype=np.float64)
        self._ar_cost += float(np.sum(cm.ar_ms(Ls)))
        units = cost / self.ar_unit_ms
        self._ep_cost += cost
        self._round += 1
        self._obs.update(k, r.accepted, r.U_r, cost / float(cm.ar_ms(float(r.L))), committed)
        terminated = bool(r.done)
        info: dict[str, Any] = {
            "k": k,
            "accepted": r.accepted,
            "committed": committed,
            "cost_ms": cost,
            "U_r": r.U_r,
            "L": r.L,
            "t": t_new,
            "generation_id": self._gid,
            "category": self._cat,
            "T_T_ms": r.T_T_ms,
            "T_D_ms": r.T_D_ms,
            "T_T_cpu_ms": r.T_T_cpu_ms,
            "T_D_cpu_ms": r.T_D_cpu_ms,
            "E_max": r.E_max,
        }
        if terminated:
            self._done = True
            info["speedup"] = self._ar_cost / self._ep_cost
            info["episode_cost_ms"] = self._ep_cost
            info["ar_cost_ms"] = self._ar_cost
            info["rounds"] = self._round
            conf = [0.0] * self.lookahead if self.lookahead else None
        else:
            conf = self._conf()
        if self._strip is not None:
            self._strip.push(k, r.accepted)
        elif self.render_mode == "ansi":
            self._line = (
                f"gen {self._gid} [{self._cat}] round {self._round - 1}: t={r.t} k={k} "
                f"accepted={r.accepted} +{committed} cost={cost:.3f}ms U_r={r.U_r:.2f}"
                + (" (done)" if terminated else "")
            )
        reward = committed - units if self._savings else -units
        return self._obs.build(self._L0 + t_new, t_new, conf), reward, terminated, False, info

    def close(self) -> None:
        """Detach the engine's routing hooks from the (shared) target model; idempotent."""
        if not self._closed:
            self.engine.close()
            self._closed = True
            self._done = True
