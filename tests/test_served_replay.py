"""Requests replayed as the vLLM controller serves a policy (:mod:`specenv.envs.served`): the draft horizon
asked before a round's outcome, the budgets capped at it, and the draft time of what was drafted.

The expectations are derived here: the controller's own what-if rows (:class:`ObsSlots`, another
implementation of the same observation), policies whose horizon is known by construction (the what-if
round is fully accepted), and rounds walked in the replay environment directly.
"""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import specenv  # noqa: F401  (registers the environments)
from specenv.abtest import predicted_speedup, replay_policy
from specenv.engines.vllm.bookkeeping import ObsSlots
from specenv.envs.served import ServedGroup, what_if
from specenv.observation.single import ObservationSpec
from specenv.policy.base import Policy
from specenv.traces.datasets import load_dataset
from specenv.traces.splits import select_split
from tests.test_steptime import KMAX, recorded


@pytest.fixture(scope="module")
def greedy_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specenv.generator import generate_paper

    ts = generate_paper(12, kmax=KMAX, seed=4, greedy=True, name="served-greedy")
    return recorded(tmp_path_factory.mktemp("served"), "served-greedy", base=ts)


def _env(path: Path, **kw):
    return gym.make("specenv/MoESpec-v1", dataset=str(path), kmax=KMAX, split="test", cost_model="fit-train", **kw)


class AfterFull(Policy):
    """k = ``full`` after a fully accepted round (and in the first), ``short`` after a rejection."""

    stateless = True

    def __init__(self, spec: ObservationSpec, full: int, short: int):
        super().__init__(spec)
        self.full, self.short = full, short
        self.name = f"after-full-{full}-{short}"

    def _act(self, obs: np.ndarray) -> int:
        v = self.view
        whole = v.first_round(obs) or v.prev_accepted(obs) == v.prev_k(obs)
        return self.full if whole else self.short


class HashOfTheRound(Policy):
    """k from a hash of the last round's U_r and cost: any approximation of either changes the answer."""

    stateless = True

    def __init__(self, spec: ObservationSpec):
        super().__init__(spec)
        self.name = "hash-of-the-round"

    def _act(self, obs: np.ndarray) -> int:
        v = self.view
        return 1 + int(1000.0 * (v.prev_U(obs) + v.prev_cost(obs))) % KMAX


def test_what_if_row_is_the_controllers(greedy_set: Path) -> None:
    """The replay's what-if row equals the controller's (ObsSlots.what_if) after the same rounds."""
    env = _env(greedy_set)
    spec = env.unwrapped.data.spec
    slots = ObsSlots(spec, 4)
    slot = slots.alloc()
    env.reset(seed=0, options={"generation_id": int(env.unwrapped.data.generation_ids[0])})
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(12):
        k = int(rng.integers(0, KMAX + 1))
        _, _, done, _, info = env.step(k)
        if done:
            break
        # fold the same round into the controller's slot: its cost in AR steps is what the env showed
        cost = float(env.unwrapped.observation_statistics[3]) * (KMAX + 1)
        slots.update([slot], [info["k"]], [info["accepted"]], [info["U_r"]], [cost])
        for K in range(KMAX + 1):
            U = 3.0 + K
            t = env.unwrapped.episode.t
            L = env.unwrapped.episode.L0 + t
            theirs = slots.what_if([slot], np.array([float(K)]), [U], np.array([L + K + 1.0]), np.array([t + K + 1.0]))
            np.testing.assert_array_equal(what_if(env, K, U), theirs[0])
            for a in range(K):  # the outcome known (draft_horizon="outcome"): a of K accepted, and its cost
                for cost in (None, 0.5 + a):
                    theirs = slots.what_if(
                        [slot],
                        np.array([float(K)]),
                        [U],
                        np.array([L + a + 1.0]),
                        np.array([t + a + 1.0]),
                        accepted=np.array([float(a)]),
                        cost=None if cost is None else np.array([cost]),
                    )
                    np.testing.assert_array_equal(what_if(env, K, U, accepted=a, cost=cost), theirs[0])
            checked += 1
    assert checked >= 5 * (KMAX + 1)
    # the environment is not changed by a what-if
    before = env.unwrapped.observation_statistics
    what_if(env, 2, 5.0)
    np.testing.assert_array_equal(env.unwrapped.observation_statistics, before)


def test_the_outcome_row_with_the_rounds_own_U_and_cost_is_the_next_observation(greedy_set: Path) -> None:
    """The controller's outcome row, its U_r and cost known, equals the environment's observation after the round.

    ``draft_horizon="outcome"`` asks the policy on :meth:`ObsSlots.what_if` with the round's outcome, U_r
    (from the tap) and cost; the replay asks on the environment's observation after the step. Both must be
    the same row, round for round, or the replay predicts another policy.
    """
    env = _env(greedy_set)
    spec = env.unwrapped.data.spec
    slots = ObsSlots(spec, 4)
    rng = np.random.default_rng(7)
    checked = 0
    for g in env.unwrapped.data.generation_ids[:3]:
        slot = slots.alloc()
        env.reset(seed=0, options={"generation_id": int(g)})
        done = False
        while not done:
            k = int(rng.integers(0, KMAX + 1))
            o, _, done, _, info = env.step(k)
            t = env.unwrapped.episode.t
            L = env.unwrapped.episode.L0 + t
            cost = float(env.unwrapped.observation_statistics[3]) * (KMAX + 1)
            row = slots.what_if(
                [slot],
                np.array([float(info["k"])]),
                [info["U_r"]],
                np.array([float(L)]),
                np.array([float(t)]),
                accepted=np.array([float(info["accepted"])]),
                cost=np.array([cost]),
            )
            np.testing.assert_allclose(row[0], o, rtol=0, atol=1e-6)
            slots.update([slot], [info["k"]], [info["accepted"]], [info["U_r"]], [cost])
            checked += 1
        slots.release(slot)
    assert checked >= 20


def test_an_optimistic_horizon_caps_the_budget_after_a_rejection(greedy_set: Path) -> None:
    """k = 1 after a full acceptance, 4 after a rejection: the horizon (a full acceptance) is always 1.

    Served, every round verifies 1 (the 4 it wants after a rejection was never drafted): exactly fixed k = 1.
    The environment's drafting lets it verify 4 there: another figure.
    """
    spec = _env(greedy_set).unwrapped.data.spec
    gids = [int(g) for g in select_split(load_dataset(greedy_set).arrays(), "test").generation_ids]
    pol = AfterFull(spec, full=1, short=4)
    served = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, pol, 40)
    fixed1 = predicted_speedup(
        str(greedy_set), "fit-train", KMAX, gids, replay_policy({"kind": "fixed", "k": 1}, spec), 40
    )
    env_drafting = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, pol, 40, draft_horizon=None)
    assert served == pytest.approx(fixed1, rel=1e-12)
    assert env_drafting != pytest.approx(fixed1, rel=1e-3)  # the set has rejections after which it verifies 4

    envs = [_env(greedy_set)]
    group = ServedGroup(envs, lambda: AfterFull(spec, full=1, short=4), top_k=2)
    group.reset([gids[0]], 40)
    wanted_4 = capped = 0
    while group.running:
        st = group.step()
        assert st.drafted == 1 and int(st.k[0]) == 1
        wanted_4 += int(st.wanted[0]) == 4
        capped += st.capped
    assert capped == wanted_4 > 0


def test_a_pessimistic_policy_pays_for_the_horizon_it_asked(greedy_set: Path) -> None:
    """k = 4 after a full acceptance, 1 after a rejection: the horizon is always 4, so every round drafts 4.

    Walked here in the environment: the same rounds as the environment's drafting (k never exceeds what was
    drafted), each paying T_D(4) in place of T_D(k).
    """
    env = _env(greedy_set)
    data = env.unwrapped.data
    spec, cm = data.spec, data.cost_model
    arr = select_split(load_dataset(greedy_set).arrays(), "test")
    gids = [int(g) for g in arr.generation_ids]
    pol = AfterFull(spec, full=KMAX, short=1)
    cost = ar = 0.0
    row_of = {int(g): i for i, g in enumerate(data.generation_ids)}
    for g in gids:
        obs, _ = env.reset(seed=0, options={"generation_id": g})
        done = False
        while not done:
            obs, _, done, _, info = env.step(int(pol.act(obs)))
            cost += info["cost_ms"] - float(cm.draft_ms(info["k"])) + float(cm.draft_ms(KMAX))
            done = done or info["t"] >= 40
        i = row_of[g]
        ar += float(np.sum(data.ar_ms[data.offsets[i] : data.offsets[i] + min(40, int(data.lengths[i]))]))
    served = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, pol, 40)
    assert served == pytest.approx(ar / cost, rel=1e-12)
    assert served < predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, pol, 40, draft_horizon=None)


def test_fixed_k_is_served_as_the_environment_drafts_it(greedy_set: Path) -> None:
    spec = _env(greedy_set).unwrapped.data.spec
    gids = [int(g) for g in select_split(load_dataset(greedy_set).arrays(), "test").generation_ids]
    for k in (0, 2, KMAX):
        pol = replay_policy({"kind": "fixed", "k": k}, spec)
        a = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, pol, 40)
        b = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, pol, 40, draft_horizon=None)
        assert a == pytest.approx(b, rel=1e-12), k


class Always(Policy):
    stateless = True

    def __init__(self, spec: ObservationSpec, k: int):
        super().__init__(spec)
        self.k, self.name = k, f"always-{k}"

    def _act(self, obs: np.ndarray) -> int:
        return self.k


def test_a_lookahead_policy_verifies_at_most_its_block(greedy_set: Path) -> None:
    """A policy with a block of h = 2 that always asks for 4 verifies 2: the controller drafts the block, no more."""
    base = _env(greedy_set).unwrapped.data.spec
    spec = ObservationSpec(KMAX, 2, base.max_new_tokens, base.n_experts)
    envs = [_env(greedy_set, lookahead=2, drafting="block")]
    gids = [int(g) for g in envs[0].unwrapped.data.generation_ids]
    group = ServedGroup(envs, lambda: Always(spec, 4), top_k=2)
    group.reset([gids[0]], 40)
    steps = 0
    while group.running:
        st = group.step()
        assert (st.drafted, int(st.k[0]), int(st.wanted[0]), st.capped) == (2, 2, 4, 1)
        steps += 1
    assert steps > 3
    four = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, Always(spec, 4), 40)
    two = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, Always(spec, 2), 40)
    assert four == pytest.approx(two, rel=1e-12)
    assert predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, Always(spec, 4), 40, draft_horizon=None) != (
        pytest.approx(two, rel=1e-3)
    )


@pytest.mark.parametrize("make", [lambda s: AfterFull(s, 1, 4), lambda s: AfterFull(s, 4, 1), HashOfTheRound])
def test_drafting_after_the_outcome_is_the_environments_drafting(greedy_set: Path, make) -> None:
    """Asked once the outcome is known, a request-wise policy drafts exactly the k it then verifies.

    The drafts of ``draft_horizon="outcome"`` are its answer on the observation after the round (its
    outcome, U_r and cost), so nothing is capped and nothing is drafted in vain: the environment's own
    drafting, round for round -- where the ``"policy"`` horizon is capped (k = 1 after a full acceptance)
    or pays drafts it throws away (k = 4 after one), and a policy of the round's U_r and cost is neither
    served right by the horizon nor by the last U_r and cost.
    """
    spec = _env(greedy_set).unwrapped.data.spec
    gids = [int(g) for g in select_split(load_dataset(greedy_set).arrays(), "test").generation_ids]
    pol = make(spec)
    outcome = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, pol, 40, draft_horizon="outcome")
    env_drafting = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, pol, 40, draft_horizon=None)
    horizon = predicted_speedup(str(greedy_set), "fit-train", KMAX, gids, pol, 40)
    assert outcome == pytest.approx(env_drafting, rel=1e-12)
    assert horizon != pytest.approx(outcome, rel=1e-3)
    group = ServedGroup([_env(greedy_set)], lambda: make(spec), top_k=2, draft_horizon="outcome")
    for g in gids:
        group.reset([g], 40)
        while group.running:
            st = group.step()
            assert st.capped == 0 and st.drafted == int(st.k[0])


def test_an_unknown_draft_horizon_is_refused(greedy_set: Path) -> None:
    with pytest.raises(ValueError, match="draft_horizon='later'"):
        ServedGroup([_env(greedy_set)], lambda: None, draft_horizon="later")
