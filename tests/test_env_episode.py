"""The one round model (specenv.replay.episode): the charge/commit rule shared by the scalar and vector replays."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import specenv  # noqa: F401  (registers the ids)
import specenv.envs.vector as vector_module
import specenv.replay.episode as episode_module
from specenv.cost.model import Charge, CostModel
from specenv.replay.episode import Episode, Round, RoundTables, draw, settle
from specenv.replay.tables import replay_data


def _tiny_tables(accepted=None):
    """One generation of 3 positions, kmax = 3, hand-made tables."""
    cost = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
    U = cost + 100.0
    ctx = np.array([2.0, 4.0, 8.0])
    surv = None
    if accepted is None:  # P(a >= 1..3) = 0.9, 0.5, 0.1, then the 0 sentinel
        surv = np.tile([0.9, 0.5, 0.1, 0.0], (3, 1))
    return RoundTables(cost=cost, U=U, ar_ctx=ctx, survival=surv, accepted=accepted)


class _Data:
    """The fields of a ReplayData an Episode reads, for one generation of 3 positions."""

    generation_ids = np.array([42])
    categories = np.array(["x"], dtype=object)
    offsets = np.array([0, 3])
    lengths = np.array([3])
    L0 = np.array([100])
    ar_total_ms = np.array([30.0])
    ar_unit_ms = 2.0


def test_settle_hand_computed_scalar():
    c, U, x = _tiny_tables().cost, _tiny_tables().U, _tiny_tables().ar_ctx
    # 3 drafts accepted of k = 3 with 2 tokens left: 2 committed, 1 accepted, charged C(row 1, k 3) = 8
    r = settle(3, 1, 3, 3, 1, 4, c.item, U.item, x.item, 2.0)
    assert r == Round(3, 1, 1, 2, 3, 8.0, 108.0, 4.0, 2.0, True)
    # far from the end: a + 1 committed, the charge does not depend on a
    r = settle(2, 0, 1, 3, 0, 4, c.item, U.item, x.item, 2.0)
    assert r == Round(2, 0, 1, 2, 2, 3.0, 103.0, 1.5, 1.5, False)
    assert type(r.committed) is int and type(r.cost_ms) is float


def test_settle_on_arrays_is_settle_on_each_scalar_bit_for_bit():
    d = replay_data("paper-default", None, "test")
    rng = np.random.default_rng(3)
    n = 500
    g = rng.integers(d.n_generations, size=n)
    t = (rng.random(n) * d.lengths[g]).astype(np.int64)
    rows = d.offsets[g] + t
    k = rng.integers(0, d.kmax + 1, size=n)
    a = np.minimum(rng.integers(0, d.kmax + 1, size=n), k)
    N = d.lengths[g]
    width = d.kmax + 1
    vec = settle(
        k, t, a, N, rows, width, d.cost.ravel().take, d.U.ravel().take, d.ar_ctx_ms.take, d.ar_unit_ms, np.minimum
    )
    for i in range(n):
        one = settle(
            int(k[i]), int(t[i]), int(a[i]), int(N[i]), int(rows[i]), width, d.cost.item, d.U.item, d.ar_ctx_ms.item,
            d.ar_unit_ms,
        )  # fmt: skip
        for name, x, y in zip(Round._fields, one, vec, strict=True):
            assert x == y[i], (name, i)
    assert (vec.committed >= 1).all() and (vec.t_next <= N).all()
    assert np.array_equal(vec.terminated, vec.t_next >= N)


def test_single_and_vector_env_call_the_one_rule(monkeypatch):
    """Both round paths go through specenv.replay.episode.settle: a spy sees scalar calls and array calls."""
    calls = {"scalar": 0, "array": 0}
    real = episode_module.settle

    def spy(k, *args):
        calls["array" if isinstance(k, np.ndarray) else "scalar"] += 1
        return real(k, *args)

    monkeypatch.setattr(episode_module, "settle", spy)
    monkeypatch.setattr(vector_module, "settle", spy)
    env = gym.make("specenv/MoESpec-v1", split="test").unwrapped
    env.reset(seed=0)
    for _ in range(5):
        env.step(2)
    # the numpy step (the compiled one, specenv.envs.vector_kernel, is tested equal to it bit for bit)
    monkeypatch.setenv("SPECENV_NUMBA", "0")
    venv = vector_module.MoESpecVectorEnv(num_envs=3, split="test")
    venv.reset(seed=0)
    for _ in range(4):
        venv.step(np.full(3, 2))
    assert calls == {"scalar": 5, "array": 4}


def test_episode_play_draws_and_totals():
    data = _Data()
    tables = _tiny_tables()
    u = np.array([0.95, 0.3, 0.05])  # round 0: nothing accepted; round 1: 2 of k = 3 (0.3 < 0.9, 0.5; > 0.1)
    ep = Episode(data, 0, u, tables)
    assert (ep.generation_id, ep.category, ep.row0, ep.N, ep.L0, ep.t) == (42, "x", 0, 3, 100, 0)
    r0 = ep.play(3)
    assert (r0.accepted, r0.committed, r0.cost_ms, r0.units, r0.ctx_units) == (0, 1, 4.0, 2.0, 2.0)
    assert (ep.t, ep.row, ep.rounds, ep.cost_ms, ep.done) == (1, 1, 1, 4.0, False)
    r1 = ep.play(3)  # 2 accepted, 2 tokens left: both committed, accepted capped to 1
    assert (r1.t, r1.accepted, r1.committed, r1.cost_ms, r1.terminated) == (1, 1, 2, 8.0, True)
    info = ep.info(r1)
    assert info["L"] == 101 and info["t"] == 3 and info["rounds"] == 2
    assert info["episode_cost_ms"] == 12.0 and info["speedup"] == 30.0 / 12.0
    with pytest.raises(RuntimeError, match="done"):
        ep.play(0)


def test_episode_play_with_a_recorded_verdict_ignores_the_uniform():
    data = _Data()
    acc = np.array([[0, 1, 1, 3], [0, 0, 2, 2], [0, 1, 1, 1]])
    capped = _tiny_tables(accepted=acc)
    ep = Episode(data, 0, np.array([0.99, 0.99, 0.99]), _tiny_tables())
    r = ep.play(3, capped)  # the verdict says 3 accepted at (row 0, k 3): 3 tokens left, all committed
    assert (r.accepted, r.committed, r.cost_ms, r.terminated) == (2, 3, 4.0, True)
    with pytest.raises(ValueError, match="exactly one"):
        RoundTables(cost=capped.cost, U=capped.U, ar_ctx=capped.ar_ctx)


def test_draw_is_the_single_envs_reset_draws():
    env = gym.make("specenv/MoESpec-v1", split="test").unwrapped
    env.reset(seed=11)
    g, u = draw(np.random.default_rng(11), env.data.lengths)
    assert env.episode.generation == g and len(u) == env.episode.N


def test_charges_implement_the_charge_protocol():
    from oracle.batch import FairShare, SplitCharge
    from specenv.cost.batch import BatchCostModel
    from specenv.traces.schema import ModelFacts

    cm = CostModel.paper_profile()
    bm = BatchCostModel.from_cost_model(cm, ModelFacts(48, 128, 8), max_batch=4)
    z = np.zeros(cm.kmax + 1)
    charges = [cm, FairShare(bm, 4), SplitCharge(z + 1.0, z, z + 0.5, z, z + 0.01, 128, 8)]
    L = np.array([100.0, 200.0, 300.0])
    for ch in charges:
        assert isinstance(ch, Charge)
        ar = ch.ar_ms(L)
        assert isinstance(ar, np.ndarray) and ar.shape == L.shape
    assert not isinstance(bm, Charge)  # a step model: BatchCostModel.ar_ms prices one batch step (a float)
    assert isinstance(bm.ar_ms(L), float)
