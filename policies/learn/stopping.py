"""Stop-policy learners of the sequential drafting mode, and the round-level form of a stop rule.

A *stop rule* is a policy of the per-token environment ``specenv/MoESpecSeq-v0``
(:mod:`specenv.envs.sequential`): after each draft it sees the per-token observation (the round-level
observation without lookahead, then the confidence of the draft just drafted, the number drafted and
the product of the round's confidences) and plays 0 = stop and verify or 1 = draft one more. Its
deployable form is an :class:`specenv.policy.mlp.MLPPolicy` with a per-token contract (two scores).

:class:`StopRulePolicy` runs a stop rule in the round-level environments in drafting mode
``"sequential"`` (lookahead = kmax): given the round observation, whose ``conf_1..kmax`` are the
confidences of the drafts the drafter *would* produce, it builds the per-token observation of every
draft n = 0..kmax-1 exactly as the per-token environment does (the same float operations) and
returns the first n at which the rule stops (kmax if it never does). The rule reads ``conf_j`` only
for j <= the k it returns, so the round-level charge T_D(k) is exact, and the per-token environment
and the wrapper give the same k on the same data (tested).

Learners:

* :func:`train_stop_dagger`: DAgger imitation of the oracle's k*(t) with cost-sensitive labels. The
  mixture (oracle k* with probability beta, else the current rule) is rolled out in the round-level
  replay environment on the train split (mode sequential); each visited round gives per-token states
  n = 0..max(k played, k*) (capped at kmax-1), labelled with the regrets of the two actions under the
  oracle's action values Q(t, k) (sequential charge): stopping at n costs ``Q(t, n) - min_{k>=n} Q``,
  continuing costs ``min_{k>n} Q - min_{k>=n} Q`` (one of them is 0: "continue iff n < k*(t)" when
  the rule can see everything). The network minimises the expected regret, as
  :mod:`policies.learn.imitation` does, so a rule that cannot see rho learns what is best on average.
* :func:`policies.learn.rl.train_sb3` with ``drafting="sequential"``: PPO or DQN on the per-token env.

Sources: SpecDec++ (Huang et al., 2024) and AdaEDL (Agrawal et al., 2024) frame the stop decision
per drafted token; DAgger: Ross, Gordon & Bagnell (AISTATS 2011).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from policies.learn.dagger import (
    DaggerResult,
    RegretMLP,
    ReplayEpisodes,
    TableExpert,
    Visits,
    dagger_meta,
    expert_arrays,
    run_dagger,
)
from specenv.observation.single import TOKEN_FEATURES, ObservationSpec, token_feature_names
from specenv.policy.base import Policy
from specenv.policy.mlp import MLPPolicy

#: Actions of the per-token environment.
STOP, DRAFT = 0, 1


def round_spec(stop_spec: ObservationSpec) -> ObservationSpec:
    """The round-level contract a stop rule runs on: its own without the per-token block, lookahead kmax."""
    return replace(stop_spec, per_token=False, lookahead=stop_spec.kmax)


def token_spec(spec: ObservationSpec) -> ObservationSpec:
    """The per-token contract of a round-level contract (no lookahead, the per-token block)."""
    return replace(spec, per_token=True, lookahead=0)


class StopRulePolicy(Policy):
    """A per-token stop rule played in a round-level environment of drafting mode ``"sequential"``.

    Args:
        rule: The stop rule (an MLP policy with a per-token contract: scores of stop and draft).
        name: Display name (default the rule's).

    The observation it reads is :func:`round_spec` of the rule's contract: the round features and
    ``conf_1..kmax``. Stateless: a batch is one batch of ``kmax`` per-token observations per row.
    """

    stateless = True

    def __init__(self, rule: MLPPolicy, name: str | None = None):
        if not rule.spec.per_token:
            raise ValueError(f"policy '{rule.name}': not a stop rule (its contract has no per-token features)")
        self.rule = rule
        self.name = name or rule.name
        self.meta = dict(rule.meta)
        spec = round_spec(rule.spec)
        super().__init__(spec)
        names = spec.names
        tnames = rule.spec.names
        token = set(token_feature_names(rule.spec.signals))
        self._base = np.array([names.index(n) for n in tnames if n not in token], dtype=np.int64)
        self._keep = np.array([tnames.index(n) for n in tnames if n not in token], dtype=np.int64)
        self._conf = np.array([names.index(f"conf_{j}") for j in range(1, spec.kmax + 1)], dtype=np.int64)
        self._tok = np.array([tnames.index(n) for n in TOKEN_FEATURES], dtype=np.int64)
        # the other signals of the draft just drafted: draft_<sig> <- <sig>_n of the round's lookahead block
        self._sig = [
            (tnames.index(f"draft_{sig}"), np.array([names.index(f"{sig}_{j}") for j in range(1, spec.kmax + 1)]))
            for sig in rule.spec.signals
            if sig != "q"
        ]

    def token_observations(self, obs: np.ndarray) -> np.ndarray:
        """(B, kmax, dim) per-token observations of drafts n = 0..kmax-1 for a batch of round observations.

        The per-token features of draft n are the per-token environment's
        (:class:`specenv.observation.single.ScalarObservation`): the confidence of draft n (0 at n = 0), n / kmax,
        the float64 product of the float32 q_1..q_n (1 at n = 0), cast to float32, and the entropy /
        margin of draft n for those signals (0 at n = 0).
        """
        x = np.atleast_2d(np.asarray(obs, dtype=np.float32))
        B, K = len(x), self.spec.kmax
        q = x[:, self._conf].astype(np.float64)  # the float32 confidences, exactly
        prod = np.ones((B, K))
        prod[:, 1:] = np.cumprod(q[:, : K - 1], axis=1)  # sequential products, as the env multiplies
        last = np.zeros((B, K))
        last[:, 1:] = q[:, : K - 1]
        n = np.arange(K, dtype=np.float64) / K
        out = np.empty((B, K, self.rule.spec.dim), dtype=np.float32)
        out[:, :, self._keep] = x[:, None, self._base]
        out[:, :, self._tok[0]] = last
        out[:, :, self._tok[1]] = n[None, :]
        out[:, :, self._tok[2]] = prod
        for col, src in self._sig:
            out[:, :, col] = 0.0
            out[:, 1:, col] = x[:, src[: K - 1]]
        return out

    def _act_rows(self, obs: np.ndarray) -> np.ndarray:
        """The budget k of each round: the first draft count n at which the rule stops, else kmax."""
        tok = self.token_observations(obs)
        B, K, d = tok.shape
        acts = self.rule.act(tok.reshape(B * K, d)).reshape(B, K)
        stop = acts != DRAFT  # -1 (non-finite scores) stops: never draft on garbage
        k = np.where(stop.any(axis=1), stop.argmax(axis=1), K)
        return k.astype(np.int64)

    def _act(self, obs: np.ndarray) -> int:
        return int(self._act_rows(obs)[0])


def load_stop_rule(folder: Any, expect: ObservationSpec | None = None) -> StopRulePolicy:
    """Load a stop rule saved by :meth:`MLPPolicy.save` and wrap it for the round-level environments.

    Args:
        folder: Folder with ``policy.json`` and ``weights.npz`` (a per-token contract).
        expect: The round-level contract of the environment (lookahead kmax); None accepts any.

    Raises:
        ValueError: One line, for a file that is not a stop rule or a contract that differs.
    """
    rule = MLPPolicy.load(folder, expect=None if expect is None else token_spec(expect))
    return StopRulePolicy(rule)


def train_stop_dagger(
    dataset: str,
    kmax: int | None = None,
    cost_model: str = "fit-train",
    iterations: int = 6,
    hidden: tuple[int, ...] = (64, 64),
    epochs: int = 8,
    lr: float = 3e-3,
    batch_size: int = 4096,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    signals: Any = ("q",),
    split: str = "train",
    expert: str = "oracle",
) -> DaggerResult:
    """Train a stop rule by DAgger on the oracle's k* (train split of ``dataset``).

    Args:
        dataset: Registry name or folder.
        kmax: Largest budget (default: the trace set's Kmax).
        cost_model: ``"fit-train"`` (the train split's fit, the default), ``"fit"``, ``"profile"`` or a JSON
            path (as for the environment).
        iterations: DAgger iterations (beta = 1 at the first, then 0.5**i).
        hidden: Hidden layer sizes.
        epochs: Passes over the aggregate per iteration.
        lr: Adam learning rate.
        batch_size: Minibatch size.
        seed: Seed of torch, the rollouts and the mixture.
        log: Called with one line per iteration.
        signals: Draft signals the rule sees per drafted token (``("q",)``; add ``"ent"``, ``"margin"``).
        split: The generations trained on: ``"train"`` (default) or ``"train-fit"`` (train minus the
            validation carve of :mod:`specenv.traces.splits`, for a hyper-parameter search).
        expert: ``"oracle"`` (the clairvoyant oracle's k* and action values) or ``"belief"`` (the belief
            oracle's on the draft's confidence, calibrated on the same split: :func:`expert_arrays`).
            (``"rollout"``, the learner's own cost-to-go, labels budgets of a round-level learner,
            :func:`policies.learn.imitation.train_dagger`, not a stop rule's per-token decisions.)

    Returns:
        The stop rule in numpy form (per-token contract), per-iteration statistics and the training
        time in seconds.

    Raises:
        ValueError: For ``expert="rollout"`` (one line).
    """
    if expert == "rollout":
        raise ValueError("expert 'rollout' trains round-level budgets (drafting none or block), not a stop rule")
    import gymnasium as gym

    from oracle.dp import action_values, solve
    from policies.learn.imitation import split_arrays
    from specenv.envs.replay import ENV_ID

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    env = gym.make(
        ENV_ID,
        dataset=dataset,
        kmax=kmax,
        split=split,
        cost_model=cost_model,
        drafting="sequential",
        signals=signals,
    )
    data = env.unwrapped.data
    spec = token_spec(data.spec)
    split_table = split_arrays(dataset, data.kmax, split)
    arrays, expert_meta, belief = expert_arrays(split_table, expert, data.kmax)
    sol = solve(arrays, data.cost_model, lookahead=data.lookahead, drafting="sequential")
    unit = env.unwrapped.ar_unit_ms
    K = data.kmax
    learner = RegretMLP(spec, hidden, n_out=2, lr=lr, epochs=epochs, batch_size=batch_size, seed=seed)
    tokens = StopRulePolicy(learner.snapshot(name="stop-rule"))  # its per-token observations (weights unused)
    if belief is not None:
        expert_meta["labels"] = "per drafted token n: the belief having seen the confidences of the n drafts"

    def values(rows: np.ndarray, n: int) -> np.ndarray:
        """Q(t, k) of the per-token state n: the oracle's, or under what the rule believes after n drafts."""
        rho = None if belief is None else belief.predict(split_table, rows, n)
        return action_values(arrays, data.cost_model, sol.value, rows, lookahead=K, drafting="sequential", rho=rho)

    def label(roll: Visits) -> tuple[np.ndarray, np.ndarray]:
        """Per-token states n = 0..max(k played, k*) (capped at kmax-1) of each visited round, two regrets."""
        tok = tokens.token_observations(roll.obs)  # (n, K, dim)
        reach = np.minimum(np.maximum(roll.k, sol.k[roll.rows]), K - 1)
        sel = np.arange(K)[None, :] <= reach[:, None]
        r_stop = np.empty((len(roll.rows), K))
        r_draft = np.empty((len(roll.rows), K))
        for n in range(K if belief is not None else 1):
            Q = values(roll.rows, n)
            m = np.minimum.accumulate(Q[:, ::-1], axis=1)[:, ::-1]  # m[:, n] = min_{k >= n} Q(t, k)
            if belief is None:  # one belief for every n: the oracle's table
                r_stop[:], r_draft[:] = Q[:, :K] - m[:, :K], m[:, 1:] - m[:, :K]
            else:
                r_stop[:, n], r_draft[:, n] = Q[:, n] - m[:, n], m[:, n + 1] - m[:, n]
        return tok[sel], (np.stack([r_stop[sel], r_draft[sel]], axis=1) / unit).astype(np.float32)

    source = ReplayEpisodes(env, arrays, lambda lrn: StopRulePolicy(lrn.snapshot(name="stop-rule")), record_k=True)
    history = run_dagger(source, TableExpert(sol.k, label), learner, iterations, rng, log=log, label="stop-dagger")
    env.close()
    meta = dagger_meta(
        "stop-dagger",
        learner,
        history,
        f"expected regret + 0.05 cross-entropy to the {expert}'s action",
        seed,
        drafting="sequential",
        **expert_meta,
    )
    return DaggerResult(learner.snapshot(name="imitation-seq", meta=meta), history, time.perf_counter() - t0)
