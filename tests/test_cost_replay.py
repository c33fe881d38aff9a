"""One owner each: the charged round cost, the survival table, the kmax/split selection, the rollout loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import oracle
from oracle.dp import _Layout, _step_tables
from specenv.cost.model import DRAFTING_MODES, CostModel, drafted_tokens, drafting_mode
from specenv.envs.replay import ENV_ID
from specenv.envs.rollout import rollout
from specenv.generator import generate_paper
from specenv.replay.tables import SelectionError, replay_data, select_positions
from specenv.traces.traceset import PositionArrays, TraceSet

REPO = Path(__file__).resolve().parents[1]


def _hand_cost(model: CostModel, U: float, L: float, k: int, drafted: int) -> float:
    """T_T(k) + T_D(drafted) written out from the coefficients."""
    target = model.beta0[k] + model.alpha[k] * U + model.c[k] * L
    draft = model.d1 * drafted + model.d0 if drafted > 0 else 0.0
    return float(target + draft)


@pytest.mark.parametrize("h", [0, 1, 3, 6])
def test_charged_table_matches_hand_computation(h: int) -> None:
    model = CostModel.paper_profile(6)
    rng = np.random.default_rng(0)
    U = rng.uniform(8, 60, size=(5, 7))
    L = rng.uniform(100, 2000, size=5)
    C = model.charged_table(U, L, 6, lookahead=h)
    assert C.shape == (5, 7)
    for t in range(5):
        for k in range(7):
            want = _hand_cost(model, U[t, k], L[t], k, max(k, h))
            assert C[t, k] == want  # same formula, same order: exact
            assert float(model.charged_ms(k, U[t, k], L[t], drafted=max(k, h))) == want
    # k = 0 pays the lookahead's draft only when h > 0
    extra = C[:, 0] - model.charged_table(U, L, 6)[:, 0]
    np.testing.assert_allclose(extra, model.d1 * h + model.d0 if h else 0.0, rtol=1e-9, atol=0)


def test_charged_ms_defaults_to_drafting_k_and_modes_are_named() -> None:
    model = CostModel.paper_profile(4)
    assert DRAFTING_MODES == ("none", "block", "sequential")
    assert drafting_mode(0) == "none" and drafting_mode(2) == "block"
    for k in range(5):
        assert float(model.charged_ms(k, 20.0, 500.0)) == _hand_cost(model, 20.0, 500.0, k, k)
        # a sequential drafter that drafted one token more than it verified pays for it
        assert float(model.charged_ms(k, 20.0, 500.0, drafted=k + 1)) == _hand_cost(model, 20.0, 500.0, k, k + 1)
    np.testing.assert_array_equal(drafted_tokens(np.arange(5), 3), [3, 3, 3, 3, 4])
    with pytest.raises(ValueError, match="lookahead"):
        drafted_tokens(1, -1)
    with pytest.raises(ValueError, match="kmax=5"):
        model.charged_table(np.ones((2, 6)), np.ones(2), 5)


def test_survival_is_the_product_of_rho() -> None:
    rng = np.random.default_rng(1)
    rho = rng.uniform(-0.2, 1.2, size=(6, 4))  # out-of-range values are clipped to [0, 1]
    arr = PositionArrays(
        generation_ids=np.array([0, 1]),
        categories=np.array(["a", "b"], dtype=object),
        offsets=np.array([0, 3, 6]),
        L=np.arange(6, dtype=np.float64),
        rho=rho,
        q=rho.copy(),
        U=np.full((6, 5), 8.0),
        greedy=False,
    )
    S = arr.survival()
    assert S.shape == (6, 4)
    for t in range(6):
        p = 1.0
        for i in range(4):
            p *= min(max(rho[t, i], 0.0), 1.0)
            assert S[t, i] == p
    np.testing.assert_array_equal(oracle.survival(arr), S)


@pytest.mark.parametrize("h", [0, 2])
def test_oracle_env_and_step_tables_share_one_cost_and_survival(small_traces: Path, h: int) -> None:
    data = replay_data(str(small_traces), None, "all", "profile", h)
    arrays = select_positions(TraceSet.load(small_traces), None, "all")
    C = data.cost_model.charged_table(arrays.U, arrays.L, arrays.kmax, h)
    np.testing.assert_array_equal(data.cost, C)
    np.testing.assert_array_equal(oracle.cost_table(arrays, data.cost_model, h), C)
    np.testing.assert_array_equal(data.survival[:, :-1], arrays.survival())
    np.testing.assert_array_equal(data.survival[:, -1], 0.0)
    np.testing.assert_array_equal(data.ar_ms, data.cost_model.charged_table(arrays.U, arrays.L, 0)[:, 0])
    lay = _Layout.of(arrays)
    Ct, St = _step_tables(arrays, data.cost_model, h, lay)
    np.testing.assert_array_equal(Ct, C[lay.perm].T)
    np.testing.assert_array_equal(St, arrays.survival()[lay.perm].T)


def test_select_positions_names_the_bad_argument(small_traces: Path) -> None:
    ts = TraceSet.load(small_traces)
    for bad in (0, 7, 99, -1):
        with pytest.raises(SelectionError, match=f"kmax={bad}") as exc:
            select_positions(ts, bad, "all")
        assert exc.value.argument == "kmax"
    for bad in ("3", 2.0, True):
        with pytest.raises(ValueError, match="kmax=") as exc:
            select_positions(ts, bad, "all")
        assert exc.value.argument == "kmax"
    with pytest.raises(SelectionError, match="split='validation'") as exc:
        select_positions(ts, None, "validation")
    assert exc.value.argument == "split"
    one = generate_paper(1, kmax=3, seed=0, name="one")
    with pytest.raises(SelectionError, match="split='test'.*no generations") as exc:
        select_positions(one, None, "test")
    assert exc.value.argument == "split"


def test_select_positions_restricts_budgets_and_split(small_traces: Path) -> None:
    from specenv.traces.splits import select_split

    ts = TraceSet.load(small_traces)
    arr = select_positions(ts, 4, "train")
    want = select_split(ts.arrays().with_kmax(4), "train")
    assert arr.kmax == 4
    for name in ("generation_ids", "offsets", "L", "rho", "q", "U"):
        np.testing.assert_array_equal(getattr(arr, name), getattr(want, name))
    assert select_positions(ts, None, "all").kmax == ts.kmax


class _Cycle:
    """A stateful test policy: budgets cycle through 0..kmax, restarting at each reset."""

    name = "cycle"

    def __init__(self, kmax: int):
        self.kmax = kmax
        self.i = 0

    def reset(self) -> None:
        self.i = 0

    def act(self, obs: np.ndarray) -> int:
        self.i += 1
        return (self.i * 2) % (self.kmax + 1)


@pytest.mark.parametrize("h", [0, 2])
def test_rollout_equals_a_hand_loop(small_traces: Path, h: int) -> None:
    env = gym.make(ENV_ID, dataset=str(small_traces), split="all", cost_model="profile", lookahead=h)
    gids = [int(g) for g in env.unwrapped.data.generation_ids]
    episodes = [(g, 7 + r) for g in gids for r in range(3)]
    res = rollout(env, _Cycle(env.unwrapped.kmax), episodes)
    pol = _Cycle(env.unwrapped.kmax)
    for e, (gid, seed) in enumerate(episodes):
        obs, info0 = env.reset(seed=seed, options={"generation_id": gid})
        pol.reset()
        cost, ret, n, ks, acc, done = 0.0, 0.0, 0, 0, 0, False
        while not done:
            k = pol.act(obs)
            obs, reward, terminated, truncated, info = env.step(k)
            cost += info["cost_ms"]
            ret += reward
            n, ks, acc = n + 1, ks + k, acc + info["accepted"]
            done = terminated or truncated
        assert res.generation_ids[e] == gid and res.seeds[e] == seed
        assert res.categories[e] == info0["category"]
        assert res.cost[e] == cost == info["episode_cost_ms"]
        assert res.ar[e] == info["ar_cost_ms"]
        assert res.returns[e] == ret
        assert (res.rounds[e], res.k_sum[e], res.accepted_sum[e]) == (n, ks, acc)
    env.close()
    assert len(set(res.cost.tolist())) > 1


def test_benchmark_run_policy_uses_episode_seeds(small_traces: Path) -> None:
    from policies.bench.context import build_context
    from policies.bench.single import Entry, run_policy
    from policies.heuristics import FixedK
    from specenv.envs.rollout import episode_seeds

    ctx = build_context(str(small_traces), None, "profile", None)
    df, _ = run_policy(Entry("fixed k=3", lambda s: FixedK(s, 3)), ctx, episodes=2, seed=5)
    env = gym.make(ENV_ID, dataset=str(small_traces), split="test", cost_model="profile")
    gids = [int(g) for g in env.unwrapped.data.generation_ids]
    seeds = [int(episode_seeds(5, [g], [r])[0]) for g in gids for r in range(2)]
    res = rollout(
        env, FixedK(env.unwrapped.data.spec, 3), list(zip([g for g in gids for _ in range(2)], seeds, strict=True))
    )
    assert df["seed"].tolist() == seeds
    assert df["generation_id"].tolist() == res.generation_ids.tolist()
    assert df["episode"].tolist() == [0, 1] * len(gids)
    np.testing.assert_array_equal(df["cost_ms"].to_numpy(), res.cost)
    np.testing.assert_array_equal(df["accepted_sum"].to_numpy(), res.accepted_sum)
    env.close()


def test_oracle_does_not_import_gymnasium_or_the_envs() -> None:
    code = (
        "import sys, oracle; "
        "envs = ('gymnasium', 'specenv.envs.replay', 'specenv.envs.vector', 'specenv.envs.rollout'); "
        "bad = [m for m in sys.modules if m.startswith(envs)]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    # importing specenv still registers the environments, whichever of the two comes first
    for code in (
        "import specenv, gymnasium; gymnasium.make('specenv/MoESpec-v0', cost_model='profile')",
        "import gymnasium, specenv; gymnasium.make('specenv/MoESpec-v0', cost_model='profile')",
    ):
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_draft_floor_of_k0_is_measured_priced_and_kept_out_of_the_ar_reference(tmp_path) -> None:
    """vLLM drafts at every step (one draft forward per request even at k=0): the fit measures that floor
    on the K=0 rounds and charges it to k=0 rounds; plain decoding (ar_ms, the speedup reference) never pays it."""
    import numpy as np

    from specenv.cost.model import CostModel
    from specenv.cost.source import cost_model_for
    from specenv.traces.datasets import load_dataset

    ts = load_dataset("live-vllm")
    m = cost_model_for(ts, "fit-train")
    r = ts.rounds
    k0 = r.loc[r["K"] == 0, "T_D_ms"].to_numpy()
    assert (k0 > 0).all()
    assert m.d_floor > 0.5 and abs(m.d_floor - k0.mean()) < 0.2 * k0.mean()  # train rounds only: near, not equal
    L = np.array([100.0, 900.0])
    np.testing.assert_allclose(m.charged_ms(0, m.top_k, L), m.ar_ms(L) + m.d_floor)
    np.testing.assert_array_equal(m.ar_ms(L), m.target_ms(0, float(m.top_k), L))
    back = CostModel.from_json(m.to_json())
    assert back.d_floor == m.d_floor
    m.save(tmp_path / "cm.json")
    assert CostModel.load(tmp_path / "cm.json").d_floor == m.d_floor
    for name in ("live-cpu", "paper-default"):  # engines that draft nothing at k=0
        assert cost_model_for(load_dataset(name), "fit-train").d_floor == 0.0
    # priced in replay: k=0 rounds are slower than plain decoding, the bound does not start from k=0 for free
    from specenv.replay.tables import replay_data

    d = replay_data("live-vllm", None, "test", "fit-train")
    np.testing.assert_allclose(d.cost[:, 0], d.ar_ms + m.d_floor)
    with pytest.raises(ValueError, match="d_floor"):
        CostModel(m.beta0, m.alpha, m.c, m.d1, m.d0, m.top_k, d_floor=float("nan"))
