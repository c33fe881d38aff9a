"""The replay environment specenv/MoESpec-v0: checkers, dynamics, costs, no-leak, splits, bad arguments."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from gymnasium.utils.env_match import check_environments_match

import specenv
from specenv.cost.model import CostModel
from specenv.envs.registration import LIVE_V0_ID, REPLAY_ID, REPLAY_V0_ID, register_envs
from specenv.envs.replay import MoESpecEnv
from specenv.observation.single import ObservationSpec, ObservationState, ScalarObservation
from specenv.replay.tables import replay_data
from specenv.traces.schema import (
    binary_entropy,
    ent_columns,
    has_signals,
    margin_columns,
    q_columns,
    rho_columns,
    u_columns,
)
from specenv.traces.splits import SPLITS, held_out_ids, n_test, select_split, split_ids, split_mask
from specenv.traces.traceset import TraceSet

SPECENV_IDS = sorted(env_id for env_id in gym.registry if env_id.startswith("specenv/"))


def run_episode(env: gym.Env, actions, seed=None, options=None, max_steps=100_000):
    """Step until termination; actions is an int or a callable(step_index) -> int."""
    obs, info = env.reset(seed=seed, options=options)
    out = {"obs": [obs], "rewards": [], "infos": [info], "t": [0]}
    for i in range(max_steps):
        k = actions(i) if callable(actions) else actions
        obs, reward, terminated, truncated, info = env.step(k)
        out["obs"].append(obs)
        out["rewards"].append(reward)
        out["infos"].append(info)
        out["t"].append(info["t"])
        assert truncated is False
        if terminated:
            return out
    raise AssertionError("episode did not terminate")


# ------------------------------------------------------------------------------------------ checkers
def test_replay_id_registered():
    assert REPLAY_ID in SPECENV_IDS
    spec = gym.spec(REPLAY_ID)
    assert spec.vector_entry_point == "specenv.envs.vector:MoESpecVectorEnv"
    json.loads(spec.to_json())  # kwargs JSON-serialisable (Minari stores EnvSpec.to_json)
    assert register_envs() == []  # idempotent
    gym.register_envs(specenv)


def _needs_live_engine() -> None:
    """Skip, naming what is missing, unless the live engine's optional parts are here: its extra and the models."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from specenv.engines.hf.models import model_dir

    try:
        model_dir("small-moe-v1")
    except ValueError as exc:
        pytest.skip(f"the shipped small-moe-v1 models are absent: {exc}")


@pytest.mark.parametrize(
    "env_id",
    # the live environments (nondeterministic: they run a real engine) are slow
    [pytest.param(i, marks=pytest.mark.slow) if gym.spec(i).nondeterministic else i for i in SPECENV_IDS],
)
def test_checkers_no_warnings(env_id):
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if gym.spec(env_id).nondeterministic:
            _needs_live_engine()
        env = gym.make(env_id)
        gym_check_env(env.unwrapped)
        sb3_check_env(env)
        env.close()
    messages = [str(w.message) for w in caught]
    if env_id in (REPLAY_V0_ID, LIVE_V0_ID):  # kept for old code: Gymnasium's one notice names the newer version
        assert sum("is out of date" in m and "`v1`" in m for m in messages) == 1, messages
        messages = [m for m in messages if "is out of date" not in m]
    assert messages == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lookahead": 2, "render_mode": "ansi", "split": "all"},
        {"kmax": 3, "cost_model": "profile", "split": "all"},
    ],
)
def test_checkers_variants_no_warnings(small_traces, kwargs):
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(REPLAY_ID, dataset=str(small_traces), **kwargs)
        gym_check_env(env.unwrapped)
        sb3_check_env(env)
    assert [str(w.message) for w in caught] == []


def test_import_does_not_pull_sb3_or_torch():
    code = (
        "import sys, specenv, gymnasium as gym; "
        "assert 'specenv/MoESpec-v0' in gym.registry; "
        "bad = [m for m in ('stable_baselines3', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_make_with_module_prefix():
    env = gym.make("specenv:specenv/MoESpec-v0", cost_model="profile")
    assert isinstance(env.unwrapped, MoESpecEnv)


# ------------------------------------------------------------------------------------------ episodes
def test_spaces_and_types(small_traces):
    env = MoESpecEnv(dataset=str(small_traces), split="all", lookahead=2)
    spec = ObservationSpec(kmax=6, lookahead=2, max_new_tokens=env.data.spec.max_new_tokens, n_experts=128)
    assert env.action_space == gym.spaces.Discrete(7)
    assert env.observation_space == spec.space()
    obs, info = env.reset(seed=0)
    assert obs.dtype == np.float32 and obs.shape == (spec.dim,)
    assert set(info) == {"generation_id", "category"}
    obs, reward, terminated, truncated, info = env.step(np.int64(3))
    assert type(reward) is float and type(terminated) is bool and type(truncated) is bool
    assert {"k", "accepted", "committed", "cost_ms", "U_r", "L", "t", "generation_id", "category"} <= set(info)
    assert obs in env.observation_space


def test_same_seed_same_episode(small_traces):
    a = MoESpecEnv(dataset=str(small_traces), split="all")
    b = MoESpecEnv(dataset=str(small_traces), split="all")
    acts = np.random.default_rng(1).integers(0, 7, 5000)
    ra = run_episode(a, lambda i: int(acts[i]), seed=42)
    rb = run_episode(b, lambda i: int(acts[i]), seed=42)
    assert ra["rewards"] == rb["rewards"] and ra["infos"] == rb["infos"]
    assert all(np.array_equal(x, y) for x, y in zip(ra["obs"], rb["obs"], strict=True))
    # reset() without a seed continues the generator: the next episode is the same for both too
    assert run_episode(a, 2)["infos"] == run_episode(b, 2)["infos"]


def test_environments_match_json_cost_model(small_traces, tmp_path):
    """cost_model given as a JSON path behaves exactly like the object it was saved from."""
    ts = TraceSet.load(small_traces)
    path = CostModel.paper_profile(ts.kmax).save(tmp_path / "profile.json")
    env_a = MoESpecEnv(dataset=str(small_traces), split="all", cost_model="profile", render_mode="ansi")
    env_b = MoESpecEnv(dataset=str(small_traces), split="all", cost_model=str(path), render_mode="ansi")
    check_environments_match(env_a, env_b, num_steps=300, seed=3)


def test_generation_option(small_traces):
    env = MoESpecEnv(dataset=str(small_traces), split="all")
    for gid in env.data.generation_ids.tolist():
        _, info = env.reset(seed=0, options={"generation_id": gid})
        assert info["generation_id"] == gid


def test_fixed_k_total_cost_by_hand(small_greedy_traces):
    """Greedy trace: the env's episode cost equals the path computed from the table and CostModel."""
    ts = TraceSet.load(small_greedy_traces)
    model = CostModel.paper_profile(ts.kmax)
    pos = ts.positions
    for kmax, k in [(6, 6), (6, 3), (4, 4), (6, 0)]:
        env = MoESpecEnv(dataset=str(small_greedy_traces), split="all", cost_model="profile", kmax=kmax, reward="cost")
        for gid in pos["generation_id"].unique()[:3].tolist():
            g = pos[pos["generation_id"] == gid].reset_index(drop=True)
            N = len(g)
            rho = g[rho_columns(ts.kmax)].to_numpy(np.float64)
            U = g[u_columns(ts.kmax)].to_numpy(np.float64)
            L = g["L"].to_numpy(np.float64)
            t, expected, path = 0, 0.0, []
            while t < N:
                a = 0
                while a < k and rho[t, a] == 1.0:  # greedy: accepted = leading ones of rho_{t,1..k}
                    a += 1
                committed = min(a + 1, N - t)
                cost = float(model.round_ms(k, U[t, k], L[t]))
                expected += cost
                path.append((t, committed - 1, committed))
                t += committed
            ar = float(sum(model.ar_ms(L)))
            res = run_episode(env, k, seed=7, options={"generation_id": gid})
            got = [(i["t"] - i["committed"], i["accepted"], i["committed"]) for i in res["infos"][1:]]
            assert got == path
            last = res["infos"][-1]
            assert last["episode_cost_ms"] == pytest.approx(expected, rel=1e-12)
            assert sum(i["cost_ms"] for i in res["infos"][1:]) == pytest.approx(expected, rel=1e-12)
            assert -sum(res["rewards"]) * env.ar_unit_ms == pytest.approx(expected, rel=1e-12)
            assert last["ar_cost_ms"] == pytest.approx(ar, rel=1e-12)
            assert last["speedup"] == pytest.approx(ar / expected, rel=1e-12)
            assert last["rounds"] == len(path)


def test_reward_unit_is_mean_ar_cost_of_split(small_traces):
    ts = TraceSet.load(small_traces)
    model = CostModel.paper_profile(ts.kmax)
    for split in SPLITS:
        env = MoESpecEnv(dataset=str(small_traces), split=split, cost_model="profile", reward="cost")
        arr = select_split(ts.arrays(), split)
        assert env.ar_unit_ms == pytest.approx(float(np.mean(model.ar_ms(arr.L))), rel=1e-12)
        res = run_episode(env, 0, seed=1)  # plain AR: the return is minus N in units of this generation
        ar = res["infos"][-1]["ar_cost_ms"]
        assert -sum(res["rewards"]) == pytest.approx(ar / env.ar_unit_ms, rel=1e-9)
        assert res["infos"][-1]["speedup"] == pytest.approx(1.0, rel=1e-12)


def test_lookahead_charges_draft_of_max_k_h(small_traces):
    h = 3
    env0 = MoESpecEnv(dataset=str(small_traces), split="all", cost_model="profile")
    envh = MoESpecEnv(dataset=str(small_traces), split="all", cost_model="profile", lookahead=h)
    model = envh.data.cost_model
    for k in range(env0.kmax + 1):
        r0 = run_episode(env0, k, seed=5)
        rh = run_episode(envh, k, seed=5)
        extra = float(model.draft_ms(max(k, h)) - model.draft_ms(k))
        for i0, ih in zip(r0["infos"][1:], rh["infos"][1:], strict=True):
            assert ih["accepted"] == i0["accepted"]
            assert ih["cost_ms"] == pytest.approx(i0["cost_ms"] + extra, rel=1e-12)
        # the reward unit is the plain AR step in both cases
        assert envh.ar_unit_ms == env0.ar_unit_ms


def test_stochastic_acceptance_follows_rho(small_traces):
    """P(a >= i) = prod_{j<=i} rho_{0,j}, estimated over many seeded first rounds."""
    env = MoESpecEnv(dataset=str(small_traces), split="all", cost_model="profile")
    d = env.data
    gid = int(d.generation_ids[0])
    surv = d.survival[d.offsets[0], : env.kmax]
    n = 4000
    counts = np.zeros(env.kmax + 1)
    for s in range(n):
        env.reset(seed=s, options={"generation_id": gid})
        counts[env.step(env.kmax)[4]["accepted"]] += 1
    emp_surv = counts[::-1].cumsum()[::-1][1:] / n
    assert np.all(np.abs(emp_surv - surv) < 4 * np.sqrt(surv * (1 - surv) / n) + 1e-9)


def test_render_ansi(small_traces):
    env = gym.make(REPLAY_ID, dataset=str(small_traces), split="all", render_mode="ansi")
    _, info = env.reset(seed=0)
    assert env.render() == f"gen {info['generation_id']} [{info['category']}] t=0"
    env.step(2)
    line = env.render()
    assert isinstance(line, str) and "\n" not in line and "k=2" in line and "round 0" in line


def test_step_after_end_raises(small_traces):
    env = MoESpecEnv(dataset=str(small_traces), split="all")
    with pytest.raises(RuntimeError):
        env.step(0)
    run_episode(env, 6, seed=0)
    with pytest.raises(RuntimeError):
        env.step(0)


# ------------------------------------------------------------------------------------------ observation
def test_scalar_observation_matches_observation_state():
    """The single env's scalar mirror builds bit-identical vectors to ObservationState."""
    rng = np.random.default_rng(0)
    for kmax, h in [(6, 0), (10, 4)]:
        spec = ObservationSpec(kmax=kmax, lookahead=h, max_new_tokens=1000, n_experts=128)
        ref = ObservationState(spec, 1)
        mine = ScalarObservation(spec)
        for step in range(400):
            if step % 57 == 0:
                ref.reset()
                mine.reset()
            k = int(rng.integers(0, kmax + 1))
            a = int(rng.integers(0, k + 1))
            committed = int(min(a + 1, rng.integers(1, 12)))
            U = float(rng.uniform(8, 130))  # may exceed n_experts: clipping must agree too
            units = float(rng.uniform(-0.5, 40))
            ref.update(np.array([k]), np.array([a]), np.array([U]), np.array([units]), np.array([committed]))
            mine.update(k, a, U, units, committed)
            L, t = int(rng.integers(1, 300_000)), int(rng.integers(0, 2000))
            conf = rng.random(h)
            want = ref.build(np.array([L]), np.array([t]), conf[None, :] if h else None)[0]
            got = mine.build(L, t, conf.tolist() if h else None)
            assert got.dtype == np.float32 and np.array_equal(got, want), (step, got, want)


def _modify_future(ts: TraceSet, gid: int, t_cut: int, lookahead: int, n_extra: int, seed: int) -> TraceSet:
    """Copy of ts where everything of generation gid a policy must not see at t_cut is changed.

    Row t_cut keeps L, U_0 and its first ``lookahead`` confidences (visible) but gets new rho, U_1..
    and later confidences; rows after t_cut get new rho, q, U; ``n_extra`` rows are appended (N grows).
    The generation must be the last block of the table.
    """
    rng = np.random.default_rng(seed)
    kmax, top_k, greedy = ts.kmax, ts.facts.top_k, ts.manifest.greedy
    pos = ts.positions.copy()
    assert pos["generation_id"].iloc[-1] == gid
    last = pos.iloc[[-1]]
    extra = last.loc[last.index.repeat(n_extra)].reset_index(drop=True)
    extra["t"] = last["t"].iloc[0] + 1 + np.arange(n_extra)
    extra["L"] = last["L"].iloc[0] + 1 + np.arange(n_extra)
    pos = pd.concat([pos, extra], ignore_index=True)
    sel = (pos["generation_id"] == gid) & (pos["t"] >= t_cut)
    n = int(sel.sum())
    rho = rng.integers(0, 2, (n, kmax)).astype(np.float64) if greedy else rng.random((n, kmax))
    U = np.cumsum(np.concatenate([np.full((n, 1), float(top_k)), rng.uniform(0, top_k, (n, kmax))], axis=1), axis=1)
    q = rng.random((n, kmax))
    current = (pos.loc[sel, "t"] == t_cut).to_numpy()
    q[current, :lookahead] = pos.loc[sel, q_columns(kmax)].to_numpy()[current, :lookahead]
    pos.loc[sel, rho_columns(kmax)] = rho.astype(np.float32)
    pos.loc[sel, u_columns(kmax)] = np.minimum(U, ts.facts.n_experts).astype(np.float32)
    pos.loc[sel, q_columns(kmax)] = q.astype(np.float32)
    if has_signals(list(pos.columns), kmax):  # schema v2: new entropies and margins, consistent with the new q
        ent = binary_entropy(q) + (1 - q) * rng.uniform(0, 3, q.shape)
        floor = np.maximum(2 * q - 1, 0)
        margin = floor + (1 - floor) * rng.random(q.shape)
        for cols, new in ((ent_columns(kmax), ent), (margin_columns(kmax), margin)):
            new[current, :lookahead] = pos.loc[sel, cols].to_numpy()[current, :lookahead]
            pos.loc[sel, cols] = new.astype(np.float32)
    return TraceSet(copy.deepcopy(ts.manifest), pos, ts.rounds)


@pytest.mark.parametrize("fixture, lookahead", [("small_traces", 2), ("small_greedy_traces", 0)])
def test_no_leak_of_future_rows_or_length(request, tmp_path, fixture, lookahead):
    """Changing what comes after t (and N) leaves every observation up to t unchanged."""
    src = request.getfixturevalue(fixture)
    ts = TraceSet.load(src)
    gid = int(ts.positions["generation_id"].iloc[-1])
    # constant AR step cost (c_0 = 0, alpha_0 = 0) so that appending rows keeps the reward unit exact
    model = CostModel.paper_profile(ts.kmax)
    model.beta0[0], model.alpha[0], model.c[0] = 6.5, 0.0, 0.0
    cm = str(model.save(tmp_path / "flat_ar.json"))
    kw = {"split": "all", "cost_model": cm, "lookahead": lookahead}
    acts = np.random.default_rng(3).integers(0, ts.kmax + 1, 10_000)
    base = run_episode(
        MoESpecEnv(dataset=str(src), **kw), lambda i: int(acts[i]), seed=9, options={"generation_id": gid}
    )
    n_rounds = len(base["rewards"])
    assert n_rounds > 4
    for i in (0, 1, n_rounds // 2, n_rounds - 1):  # observation i is taken at position t_i
        t_i = base["t"][i]
        mod = _modify_future(ts, gid, t_i, lookahead, n_extra=25, seed=i)
        path = mod.save(tmp_path / f"mod-{i}")
        env = MoESpecEnv(dataset=str(path), **kw)
        assert env.ar_unit_ms == 6.5
        obs, _ = env.reset(seed=9, options={"generation_id": gid})
        seen = [obs]
        for j in range(i):
            seen.append(env.step(int(acts[j]))[0])
        for j, (a, b) in enumerate(zip(base["obs"][: i + 1], seen, strict=True)):
            assert np.array_equal(a, b), f"observation {j} (t={base['t'][j]}) changed with rows >= {t_i}"
        # and the change is real: the full episode differs (longer N, new rho/U)
        assert run_episode(env, lambda j: int(acts[j]), seed=9, options={"generation_id": gid})["t"][-1] > base["t"][-1]


# ------------------------------------------------------------------------------------------ splits
def test_split_rule_pinned_and_exact():
    ids = np.arange(128)
    assert sorted(held_out_ids(ids)) == [
        5,
        17,
        20,
        23,
        29,
        31,
        34,
        37,
        38,
        51,
        56,
        59,
        64,
        65,
        68,
        75,
        78,
        80,
        83,
        84,
        92,
        109,
        113,
        121,
        122,
        125,
    ]
    assert n_test(128) == 26 and n_test(6) == 1 and n_test(1) == 0
    train, test = split_mask(ids, "train"), split_mask(ids, "test")
    assert not np.any(train & test) and np.all(train | test) and split_mask(ids, "all").all()
    # independent of order and of duplicates (rows of the same generation)
    shuffled = np.random.default_rng(0).permutation(np.repeat(ids, 3))
    assert set(split_ids(shuffled, "test").tolist()) == held_out_ids(ids)


def test_env_split_uses_split_module(small_traces):
    ts = TraceSet.load(small_traces)
    ids = ts.arrays().generation_ids
    for split in SPLITS:
        env = MoESpecEnv(dataset=str(small_traces), split=split)
        assert env.data.generation_ids.tolist() == split_ids(ids, split).tolist()
    test_gid = int(split_ids(ids, "test")[0])
    with pytest.raises(ValueError, match=f"generation_id.*{test_gid}.*'train'"):
        MoESpecEnv(dataset=str(small_traces), split="train").reset(options={"generation_id": test_gid})


# ------------------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"kmax": 7}, "kmax"),
        ({"kmax": 0}, "kmax"),
        ({"kmax": 2.0}, "kmax"),
        ({"lookahead": 4, "kmax": 3}, "lookahead"),
        ({"lookahead": -1}, "lookahead"),
        ({"split": "validation"}, "split"),
        ({"cost_model": "nope"}, "cost_model"),
        ({"render_mode": "depth_array"}, "render_mode"),  # "human" is gymnasium's HumanRendering over rgb_array
    ],
)
def test_bad_arguments(small_traces, kwargs, name):
    with pytest.raises(ValueError, match=name):
        MoESpecEnv(dataset=str(small_traces), **kwargs)
    with pytest.raises(ValueError, match=name), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gym.make warns about an unknown render mode before we raise
        gym.make(REPLAY_ID, dataset=str(small_traces), **kwargs)


def test_bad_dataset(tmp_path):
    with pytest.raises(ValueError, match="dataset"):
        MoESpecEnv(dataset="no-such-dataset")
    with pytest.raises(ValueError, match="dataset"):
        MoESpecEnv(dataset=str(tmp_path / "missing"))


@pytest.mark.parametrize("action", [7, -1, 2.0, np.float32(1), np.array([1]), "3"])
def test_bad_action(small_traces, action):
    env = MoESpecEnv(dataset=str(small_traces), split="all")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step(action)


def test_bad_reset_options(small_traces):
    env = MoESpecEnv(dataset=str(small_traces), split="all")
    with pytest.raises(ValueError, match="generation_id.*123456"):
        env.reset(options={"generation_id": 123456})
    with pytest.raises(ValueError, match="options"):
        env.reset(options={"generation": 0})


def test_replay_data_is_shared_and_read_only(small_traces):
    a = replay_data(str(small_traces), None, "all", "profile", 0)
    b = replay_data(str(small_traces), None, "all", "profile", 0)
    assert a is b
    with pytest.raises(ValueError):
        a.cost[0, 0] = 1.0


def test_paper_default_test_split_loads():
    env = MoESpecEnv(split="test", cost_model="profile")
    assert env.data.n_generations == 26
    assert env.data.dataset == "paper-default"


@pytest.mark.parametrize("lookahead", [0, 2])
def test_unclipped_observations_equal_clipped_ones_where_the_data_stay_in_the_box(lookahead):
    """Where the tables keep every feature in range the envs skip the clip: the same vectors, bit for bit."""
    import dataclasses

    from specenv.envs.vector import MoESpecVectorEnv

    data = replay_data("paper-default", None, "test", "fit", lookahead, None, ("q",))
    assert data.within_box
    # a set whose generations run past max_new_tokens is not in the Box (progress would be clipped)
    short = dataclasses.replace(data, spec=dataclasses.replace(data.spec, max_new_tokens=int(data.max_len) - 1))
    assert not short.within_box
    fast, ref = (MoESpecEnv(split="test", lookahead=lookahead) for _ in range(2))
    assert not fast._obs.clip
    ref._obs.clip = True
    vfast, vref = (MoESpecVectorEnv(num_envs=5, split="test", lookahead=lookahead) for _ in range(2))
    assert not vfast._obs_state.clip
    vref._obs_state.clip = True
    rng = np.random.default_rng(1)
    for env_pair, vec in (((fast, ref), False), ((vfast, vref), True)):
        a, b = env_pair
        oa, _ = a.reset(seed=3)
        ob, _ = b.reset(seed=3)
        for _ in range(600):
            assert oa.dtype == np.float32 and oa.tobytes() == ob.tobytes()
            act = rng.integers(0, a.kmax + 1, size=5) if vec else int(rng.integers(0, a.kmax + 1))
            oa, _, term, _, _ = a.step(act)
            ob, _, _, _, _ = b.step(act)
            if not vec and term:
                oa, _ = a.reset()
                ob, _ = b.reset()
