"""Drafting modes (none, block, sequential): charging, the oracle's bounds, the per-token environment."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

import oracle
import specenv  # noqa: F401  (registers the ids)
from specenv.cost.model import CostModel, charged_lookahead, check_drafting, drafted_tokens
from specenv.envs.registration import REPLAY_ID, SEQ_ID
from specenv.envs.sequential import DRAFT, STOP, MoESpecSeqEnv
from specenv.observation.single import ObservationSpec
from specenv.replay.tables import replay_data, select_positions
from specenv.traces.traceset import TraceSet

PROFILE = CostModel.paper_profile(10)


# ------------------------------------------------------------------------------ the charge per mode
def _by_hand(k: int, U: float, L: float, drafted: int) -> float:
    """C = beta0[k] + alpha[k] U + c[k] L + (d1 * drafted + d0 if drafted else 0), written out."""
    m = PROFILE
    draft = m.d1 * drafted + m.d0 if drafted else 0.0
    return m.beta0[k] + m.alpha[k] * U + m.c[k] * L + draft


@pytest.mark.parametrize("k", [0, 1, 2, 5, 10])
@pytest.mark.parametrize("h", [1, 3, 10])
def test_charge_per_mode_matches_hand_computation(k, h):
    U = np.full((1, 11), 20.0)
    L = np.array([600.0])
    table = {mode: PROFILE.charged_table(U, L, 10, h, mode)[0, k] for mode in ("block", "sequential")}
    table["none"] = PROFILE.charged_table(U, L, 10, 0, "none")[0, k]
    assert table["none"] == pytest.approx(_by_hand(k, 20.0, 600.0, k), rel=1e-12)
    assert table["sequential"] == pytest.approx(_by_hand(k, 20.0, 600.0, k), rel=1e-12)
    assert table["block"] == pytest.approx(_by_hand(k, 20.0, 600.0, max(k, h)), rel=1e-12)
    # sequential pays exactly what it drafts: the same as none, bit for bit
    assert table["sequential"] == table["none"]
    if k < h:  # a block drafter pays the tokens it trimmed away
        assert table["block"] - table["none"] == pytest.approx(PROFILE.d1 * (h - k) + (PROFILE.d0 if k == 0 else 0))


def test_drafted_tokens_and_legacy_lookahead():
    ks = np.arange(6)
    assert drafted_tokens(ks, 3).tolist() == [3, 3, 3, 3, 4, 5]  # lookahead alone = block, as before
    assert drafted_tokens(ks, 3, "block").tolist() == [3, 3, 3, 3, 4, 5]
    assert drafted_tokens(ks, 3, "sequential").tolist() == ks.tolist()
    assert drafted_tokens(ks, 0, "none").tolist() == ks.tolist()
    assert charged_lookahead(4) == 4 and charged_lookahead(4, "sequential") == 0 and charged_lookahead(0) == 0


@pytest.mark.parametrize(
    "drafting, lookahead, expected",
    [
        (None, None, ("none", 0)),
        (None, 0, ("none", 0)),
        (None, 3, ("block", 3)),
        ("none", None, ("none", 0)),
        ("block", None, ("block", 10)),
        ("block", 2, ("block", 2)),
        ("sequential", None, ("sequential", 10)),
        ("sequential", 4, ("sequential", 4)),
    ],
)
def test_check_drafting_defaults(drafting, lookahead, expected):
    assert check_drafting(drafting, lookahead, 10) == expected


@pytest.mark.parametrize(
    "drafting, lookahead, word",
    [
        ("greedy", None, "drafting"),
        ("none", 2, "lookahead"),
        ("block", 0, "lookahead"),
        ("sequential", 0, "lookahead"),
        ("block", 11, "lookahead"),
        (None, -1, "lookahead"),
        ("sequential", 2.5, "lookahead"),
    ],
)
def test_check_drafting_rejects(drafting, lookahead, word):
    with pytest.raises(ValueError, match=word):
        check_drafting(drafting, lookahead, 10)


# ------------------------------------------------------------------------------ the replay tables
def test_replay_tables_per_mode(small_traces):
    none = replay_data(str(small_traces), None, "all", "profile", None, None)
    seq = replay_data(str(small_traces), None, "all", "profile", None, "sequential")
    block = replay_data(str(small_traces), None, "all", "profile", 2, "block")
    legacy = replay_data(str(small_traces), None, "all", "profile", 2)
    assert (none.drafting, seq.drafting, block.drafting, legacy.drafting) == ("none", "sequential", "block", "block")
    assert seq.lookahead == seq.kmax and seq.conf.shape[1] == seq.kmax
    np.testing.assert_array_equal(seq.cost, none.cost)  # T_D(k) in both
    np.testing.assert_array_equal(block.cost, legacy.cost)
    assert (block.cost[:, :2] > none.cost[:, :2]).all()  # k < h pays the block
    np.testing.assert_array_equal(block.cost[:, 2:], none.cost[:, 2:])
    np.testing.assert_array_equal(seq.ar_ms, none.ar_ms)
    np.testing.assert_array_equal(block.ar_ms, none.ar_ms)
    assert seq.ar_unit_ms == none.ar_unit_ms == block.ar_unit_ms
    with pytest.raises(ValueError, match="drafting"):
        replay_data(str(small_traces), None, "all", "profile", None, "eager")


# ------------------------------------------------------------------------------ the oracle
def test_oracle_bound_none_equals_sequential_and_block_is_lower(small_traces):
    ts = TraceSet.load(small_traces)
    arr = select_positions(ts, None, "all")
    none = oracle.solve(arr, PROFILE)
    seq = oracle.solve(arr, PROFILE, lookahead=arr.kmax, drafting="sequential")
    assert seq.drafting == "sequential" and none.drafting == "none"
    np.testing.assert_array_equal(seq.cost, none.cost)
    np.testing.assert_array_equal(seq.k, none.k)
    prev = none.speedup_pooled
    for h in range(1, arr.kmax + 1):  # block: the bound falls with the block size
        block = oracle.solve(arr, PROFILE, lookahead=h, drafting="block")
        legacy = oracle.solve(arr, PROFILE, lookahead=h)
        assert block.drafting == legacy.drafting == "block"
        np.testing.assert_array_equal(block.cost, legacy.cost)
        assert block.speedup_pooled <= prev + 1e-12
        prev = block.speedup_pooled
        # the block bound is the exact optimum under its own charge: no fixed k beats it
        for k in range(arr.kmax + 1):
            ev = oracle.evaluate_policy(arr, PROFILE, k, lookahead=h, drafting="block")
            assert (block.cost <= ev.cost + 1e-9).all()


def test_oracle_block_bound_by_hand_on_one_generation():
    """A one-position generation: V = min_k C(0, k) with the block charge, checked by hand."""
    from specenv.traces.traceset import PositionArrays

    kmax = 3
    U = np.array([[8.0, 12.0, 15.0, 17.0]])
    L = np.array([100.0])
    arrays = PositionArrays(
        generation_ids=np.array([7]),
        categories=np.array(["qa"], dtype=object),
        offsets=np.array([0, 1]),
        L=L,
        rho=np.full((1, kmax), 0.5),
        q=np.full((1, kmax), 0.5),
        U=U,
        greedy=False,
    )
    model = CostModel.paper_profile(kmax)
    for mode, h in (("none", 0), ("sequential", 3), ("block", 2)):
        res = oracle.solve(arrays, model, lookahead=h, drafting=mode)
        costs = [_hand(model, k, U[0, k], L[0], max(k, h) if mode == "block" else k) for k in range(kmax + 1)]
        assert res.cost[0] == pytest.approx(min(costs), rel=1e-12)
        assert int(res.k[0]) == int(np.argmin(costs))


def _hand(m: CostModel, k: int, U: float, L: float, drafted: int) -> float:
    return m.beta0[k] + m.alpha[k] * U + m.c[k] * L + (m.d1 * drafted + m.d0 if drafted else 0.0)


def test_oracle_cli_drafting_modes(small_traces):
    import json

    from typer.testing import CliRunner

    from specenv.cli import app

    runner = CliRunner()
    outs = {}
    for args in (["--drafting", "none"], ["--drafting", "sequential"], ["--drafting", "block", "--lookahead", "2"]):
        r = runner.invoke(app, ["oracle", str(small_traces), "--episodes", "0", "--json", *args])
        assert r.exit_code == 0, r.output
        outs[args[1]] = json.loads(r.stdout)
    assert outs["none"]["s_max_pooled"] == outs["sequential"]["s_max_pooled"]
    assert outs["block"]["s_max_pooled"] < outs["none"]["s_max_pooled"]
    assert "bound of none" in outs["sequential"]["drafting_note"]
    assert outs["block"]["drafting"] == "block" and outs["sequential"]["drafting"] == "sequential"
    default = json.loads(runner.invoke(app, ["oracle", str(small_traces), "--episodes", "0", "--json"]).stdout)
    assert default["drafting"] == "none" and default["s_max_pooled"] == outs["none"]["s_max_pooled"]
    text = runner.invoke(app, ["oracle", str(small_traces), "--episodes", "0", "--drafting", "sequential"])
    assert "this bound is the bound of none" in " ".join(text.stdout.split())


# ------------------------------------------------------------------------------ the round-level envs
def _episode(env, policy, seed):
    obs, _ = env.reset(seed=seed)
    total, ret, ks = 0.0, 0.0, []
    while True:
        k = policy(obs)
        obs, r, term, _, info = env.step(k)
        total += info["cost_ms"]
        ret += r
        ks.append(info["k"])
        if term:
            return total, ret, ks, info


@pytest.mark.parametrize("k", [0, 2, 5])
def test_replay_env_fixed_k_cost_per_mode(k):
    none = gym.make(REPLAY_ID, split="test", drafting="none")
    seq = gym.make(REPLAY_ID, split="test", drafting="sequential")
    block = gym.make(REPLAY_ID, split="test", drafting="block", lookahead=4)
    c_none, *_ = _episode(none, lambda o: k, 3)
    c_seq, *_ = _episode(seq, lambda o: k, 3)
    c_block, _, ks, info = _episode(block, lambda o: k, 3)
    assert c_seq == c_none
    d = block.unwrapped.data.cost_model
    extra = len(ks) * (d.draft_ms(max(k, 4)) - d.draft_ms(k))
    assert c_block == pytest.approx(c_none + extra, rel=1e-9)
    assert seq.observation_space.shape == (30,) and none.observation_space.shape == (20,)


def test_vector_env_takes_the_mode():
    envs = gym.make_vec(
        REPLAY_ID, num_envs=3, vectorization_mode="vector_entry_point", split="test", drafting="sequential"
    )
    assert envs.unwrapped.drafting == "sequential" and envs.single_observation_space.shape == (30,)
    obs, _ = envs.reset(seed=5)
    single = gym.make(REPLAY_ID, split="test", drafting="sequential")
    for i in range(3):
        o, _ = single.reset(seed=5 + i)
        np.testing.assert_array_equal(obs[i], o)
    _, _, _, _, info = envs.step(np.array([4, 4, 4]))
    o, _, _, _, inf1 = single.step(4)
    assert info["cost_ms"][2] == inf1["cost_ms"]
    envs.close()


# ------------------------------------------------------------------------------ the per-token env
def _seq_episode(env, stop, seed=None, options=None):
    """Run the per-token env; ``stop(obs, view)`` says when to stop drafting. Returns rounds and totals."""
    obs, _ = env.reset(seed=seed, options=options)
    spec = env.unwrapped.obs_spec
    base = spec.dim - 3
    rounds, total, ret, starts = [], 0.0, 0.0, [obs[:base].copy()]
    while True:
        n = int(round(float(obs[spec.index("drafted")]) * spec.kmax))
        action = STOP if stop(obs, n) else DRAFT
        obs, r, term, trunc, info = env.step(action)
        assert trunc is False
        ret += r
        if info["verified"]:
            rounds.append((info["k"], info["accepted"], info["cost_ms"]))
            total += info["cost_ms"]
            starts.append(obs[:base].copy())
            assert obs[spec.index("drafted")] == 0 and obs[spec.index("draft_conf_prod")] == 1
        else:
            assert r == 0.0
        if term:
            return rounds, total, ret, starts, info


@pytest.mark.parametrize("k", [0, 1, 3, 10])
@pytest.mark.parametrize("reward", ["cost", "savings"])
def test_per_token_env_fixed_k_equals_replay_env(k, reward):
    seq = gym.make(SEQ_ID, split="test", reward=reward)
    replay = gym.make(REPLAY_ID, split="test", reward=reward, drafting="sequential")
    for seed in (0, 11):
        rounds, total, ret, starts, info = _seq_episode(seq, lambda obs, n: n >= k, seed=seed)
        obs, _ = replay.reset(seed=seed)
        r_total, r_ret, r_obs = 0.0, 0.0, [obs[:20]]
        for kk, a, c in rounds:
            assert kk == k
            obs, r, term, _, rinfo = replay.step(k)
            assert (rinfo["accepted"], rinfo["cost_ms"]) == (a, c)
            r_total += c
            r_ret += r
            r_obs.append(obs[:20])
        assert term
        assert total == r_total == rinfo["episode_cost_ms"] == info["episode_cost_ms"]
        assert ret == pytest.approx(r_ret, rel=1e-12, abs=1e-9)
        assert info["speedup"] == rinfo["speedup"]
        # the round-level features at every round start are the replay env's (without its confidences)
        for a_obs, b_obs in zip(starts, r_obs, strict=True):
            np.testing.assert_array_equal(a_obs, b_obs)


def test_confidence_stop_in_per_token_env_equals_threshold_in_sequential_replay():
    """The confidence rule drafts what it verifies: the per-token env pays the round env's sequential charge."""
    from policies.heuristics import ConfidenceThreshold

    seq = gym.make(SEQ_ID, split="test")
    replay = gym.make(REPLAY_ID, split="test", drafting="sequential")
    kmax = seq.unwrapped.kmax
    i_q = seq.unwrapped.obs_spec.index("draft_conf")
    for seed in (1, 2):
        rounds, total, *_ = _seq_episode(seq, lambda obs, n: n == kmax or (n >= 1 and obs[i_q] < 0.4), seed=seed)
        pol = ConfidenceThreshold(replay.unwrapped.data.spec, 0.4)
        pol.reset()
        r_total, _, ks, _ = _episode(replay, pol.act, seed)
        assert [r[0] for r in rounds] == ks
        assert total == r_total


def test_per_token_env_optimum_is_the_sequential_bound():
    """A stop rule following the oracle's k*(t) realises (in expectation) the sequential bound."""
    env = MoESpecSeqEnv(split="test", cost_model="profile")
    d = env.data
    from specenv.traces.datasets import load_dataset

    arr = select_positions(load_dataset("paper-default"), None, "test")
    sol = oracle.solve(arr, d.cost_model, drafting="sequential")
    g = 0
    kstar = sol.k_of(g)
    costs = []
    for seed in range(8):
        env.reset(seed=seed, options={"generation_id": int(d.generation_ids[g])})
        total = 0.0
        while True:
            k = int(kstar[env.episode.t])
            action = STOP if env._n >= k else DRAFT
            _, _, term, _, info = env.step(action)
            if info["verified"]:
                total += info["cost_ms"]
            if term:
                break
        costs.append(total)
    ev = oracle.evaluate_policy(arr, d.cost_model, sol.k, drafting="sequential")
    assert ev.cost[g] == pytest.approx(sol.cost[g], rel=1e-12)
    # greedy or not, the mean of 8 episodes lies within a few percent of the exact bound
    assert np.mean(costs) == pytest.approx(sol.cost[g], rel=0.05)


def test_per_token_env_observation_and_info():
    env = gym.make(SEQ_ID, split="test", kmax=4, reward="cost")
    spec = env.unwrapped.obs_spec
    assert spec == ObservationSpec(4, 0, spec.max_new_tokens, spec.n_experts, per_token=True)
    assert spec.names[-3:] == ["draft_conf", "drafted", "draft_conf_prod"]
    assert env.observation_space.shape == (17,)
    obs, _ = env.reset(seed=0)
    q = env.unwrapped.data.conf
    row = env.unwrapped.episode.row0
    prod = 1.0
    for n in range(1, 4):
        obs, r, term, _, info = env.step(1)
        prod *= q[row, n - 1]
        assert info == {
            "drafted": n,
            "conf": q[row, n - 1],
            "verified": False,
            "generation_id": info["generation_id"],
            "category": info["category"],
        }
        assert obs[spec.index("draft_conf")] == np.float32(q[row, n - 1])
        assert obs[spec.index("drafted")] == np.float32(n / 4)
        assert obs[spec.index("draft_conf_prod")] == np.float32(prod)
    obs, r, term, _, info = env.step(1)  # the 4th draft is verified at once
    assert info["verified"] and info["k"] == 4 and info["drafted"] == 4 and r < 0
    assert spec.to_json()["per_token"] is True and "per_token" not in ObservationSpec(4).to_json()
    assert ObservationSpec.from_json(spec.to_json()) == spec
    assert ObservationSpec(4).mismatch(spec) is not None


@pytest.mark.parametrize("action", [2, -1, 1.0, "1"])
def test_per_token_env_rejects_bad_actions(action):
    env = gym.make(SEQ_ID, split="test").unwrapped
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step(action)


def test_per_token_env_step_before_reset():
    env = MoESpecSeqEnv(split="test")
    with pytest.raises(RuntimeError):
        env.step(0)


@pytest.mark.parametrize("kwargs", [{"render_mode": "ansi", "split": "all", "kmax": 3}, {"reward": "savings"}])
def test_per_token_env_checkers_no_warnings(small_traces, kwargs):
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(SEQ_ID, dataset=str(small_traces), **kwargs)
        gym_check_env(env.unwrapped)
        sb3_check_env(env)
        env.reset(seed=0)
        env.step(1)
        if kwargs.get("render_mode") == "ansi":
            assert "drafted 1" in env.render()
    assert [str(w.message) for w in caught] == []


def test_per_token_env_doctest():
    import doctest

    import specenv.envs.sequential as mod

    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.attempted >= 5 and res.failed == 0


# ------------------------------------------------------------------------------ the benchmark
@pytest.mark.slow  # seconds of work; the full suite runs it
def test_benchmark_charges_each_row_by_its_mode():
    from policies.bench.context import build_context
    from policies.bench.single import ORACLE_ROW, default_entries, run_benchmark
    from policies.bench.tables import markdown_table

    ctx = build_context("paper-default", None, "fit-train", None)
    modes = {e.name: (e.mode, e.lookahead) for e in default_entries(ctx)}
    assert modes["confidence 0.4"] == ("sequential", ctx.kmax)
    assert modes["confidence ROC"] == ("sequential", ctx.kmax)
    assert modes["delta-space + confidences (h=3)"] == ("block", 3)
    # the peers' stop rules are sequential, vLLM's adaptive verification trims a kmax block (tests/test_peers.py)
    peers = {"AdaEDL (entropy bound)", "SVIP (entropy)", "SpecDec++ (acceptance head)", "DISCO (stop classifier)"}
    assert {modes[n] for n in peers if n in modes} == {("sequential", ctx.kmax)}
    assert modes["vLLM adaptive verification"] == ("block", ctx.kmax)
    others = {n: m for n, m in modes.items() if "confidence" not in n and n not in peers and "adaptive verif" not in n}
    assert set(others.values()) == {("none", 0)}
    res = run_benchmark("paper-default", episodes=1, only=["confidence 0.4", "fixed k=4"], n_boot=50)
    s = res.summary.set_index("policy")
    assert s.loc["confidence 0.4", "drafting"] == "sequential"
    assert s.loc["fixed k=4", "drafting"] == "none" and s.loc[ORACLE_ROW, "drafting"] == "none"
    assert "| confidence 0.4 | sequential |" in markdown_table(res)
    assert all("drafting" in p for p in res.to_json()["policies"])
    # the sequential charge: the same rounds (same seeds, same budgets) as under the old kmax-block
    # charge, each cheaper by d1 * (kmax - k): the rule drafts at least one token, so T_D(k) = d1 k + d0
    from dataclasses import replace

    from policies.bench.single import run_policy

    entry = next(e for e in default_entries(ctx) if e.name == "confidence 0.4")
    seq, _ = run_policy(entry, ctx, 1, 0)
    blk, _ = run_policy(replace(entry, drafting="block"), ctx, 1, 0)
    np.testing.assert_array_equal(seq["k_sum"], blk["k_sum"])
    np.testing.assert_array_equal(seq["rounds"], blk["rounds"])
    saved = ctx.cost_model.d1 * (ctx.kmax * seq["rounds"] - seq["k_sum"])
    np.testing.assert_allclose(blk["cost_ms"] - seq["cost_ms"], saved, rtol=1e-9)
    assert (saved > 0).all()
    ep = res.episodes[res.episodes["policy"] == "confidence 0.4"]
    np.testing.assert_allclose(ep["cost_ms"].to_numpy(), seq["cost_ms"].to_numpy(), rtol=0)
