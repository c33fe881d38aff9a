"""The benchmark's statistics and speed: exact fixed-k rows, independent common random numbers per
(generation, episode), bootstrap intervals over generations, the train-only cost model, the vector
rollout, both policy layouts, constant learned policies, and goodput leaving k = 0."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from policies import shipped_policy_dir
from policies.bench.context import build_context, train_priors
from policies.bench.single import default_entries, find_policies, run_benchmark
from policies.bench.tables import markdown_table
from policies.heuristics import GoodputRule
from specenv.envs.replay import ENV_ID
from specenv.envs.rollout import episode_seeds, rollout, rollout_vector
from specenv.policy.mlp import MLPPolicy
from specenv.stats import bootstrap_indices, bootstrap_ratio_ci
from specenv.traces.traceset import TraceSet

_FIELDS = ("generation_ids", "seeds", "cost", "ar", "rounds", "k_sum", "accepted_sum", "returns", "k_min", "k_max")


@pytest.fixture(scope="module")
def bench_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stochastic set with 6 test generations (Kmax 6)."""
    from specenv.generator import generate_paper

    path = tmp_path_factory.mktemp("bench-stats") / "set"
    generate_paper(30, kmax=6, seed=31, name="bench-stats").save(path)
    return path


# ----------------------------------------------------------------------------- bootstrap (specenv.stats)
def test_bootstrap_interval_is_seeded_vectorised_and_brackets_the_estimate() -> None:
    rng = np.random.default_rng(0)
    ar = rng.uniform(100, 200, 30)
    cost = ar / rng.uniform(1.5, 2.5, 30)
    a = bootstrap_ratio_ci(ar, cost, n_boot=2000, seed=4)
    b = bootstrap_ratio_ci(ar, cost, indices=bootstrap_indices(30, 2000, 4))
    assert a == b  # the same resamples from the same seed
    for est, value in (("pooled", ar.sum() / cost.sum()), ("mean", (ar / cost).mean())):
        assert a[est]["value"] == pytest.approx(value, rel=1e-12)
        assert a[est]["low"] < value < a[est]["high"]
    # the pooled ratio of units that all have the same ratio has no spread
    flat = bootstrap_ratio_ci(ar, ar / 2.0, n_boot=500, seed=1)
    assert flat["pooled"]["low"] == pytest.approx(2.0) and flat["pooled"]["high"] == pytest.approx(2.0)
    # more units, narrower interval (about 1/sqrt(n))
    wide = bootstrap_ratio_ci(ar[:8], cost[:8], seed=2)["pooled"]
    assert a["pooled"]["high"] - a["pooled"]["low"] < wide["high"] - wide["low"]
    with pytest.raises(ValueError):
        bootstrap_ratio_ci(ar, cost[:-1])
    with pytest.raises(ValueError):
        bootstrap_ratio_ci(ar, cost, indices=np.zeros((10, 5), dtype=int))


# ----------------------------------------------------------------------------- seeds
def test_episode_seeds_are_independent_per_generation_and_episode_and_common_to_policies() -> None:
    gids = np.repeat(np.arange(50), 4)
    eps = np.tile(np.arange(4), 50)
    s = episode_seeds(7, gids, eps)
    assert len(np.unique(s)) == len(s)  # every (generation, episode) its own stream
    # a pair's seed depends on nothing but (seed, generation, episode): not on the other pairs
    np.testing.assert_array_equal(episode_seeds(7, gids[::-1], eps[::-1]), s[::-1])
    assert int(episode_seeds(7, [3], [1])[0]) == int(s[3 * 4 + 1])
    # no "seed + r" shared across generations: generation g's episode 0 differs from g+1's
    assert len(np.unique(s[eps == 0])) == 50
    assert not np.array_equal(episode_seeds(8, gids, eps), s)
    with pytest.raises(ValueError):
        episode_seeds(-1, [0], [0])


# ----------------------------------------------------------------------------- vector rollout
@pytest.mark.slow  # runs whole benchmarks (the full suite runs it)
def test_vector_rollout_equals_the_single_env_rollout_for_every_policy(small_traces: Path) -> None:
    """Every benchmark policy (stateful ones per stream), every generation of a set, two episodes each."""
    ctx = build_context(str(small_traces), None, "fit-train", None)
    kw = {"dataset": str(small_traces), "split": "all", "cost_model": "fit-train"}
    gids = [int(g) for g in gym.make(ENV_ID, **kw).unwrapped.data.generation_ids]
    pairs = [(g, int(episode_seeds(3, [g], [r])[0])) for g in gids for r in range(2)]
    for entry in default_entries(ctx):
        sig = {"signals": entry.signals}  # what the row's rule reads
        env = gym.make(ENV_ID, lookahead=entry.lookahead, **kw, **sig)
        envs = gym.make_vec(
            ENV_ID,
            num_envs=len(pairs),
            vectorization_mode="vector_entry_point",
            lookahead=entry.lookahead,
            **kw,
            **sig,
        )
        spec = env.unwrapped.data.spec
        one = rollout(env, entry.make(spec), pairs)
        many = rollout_vector(envs, entry.make(spec), pairs)
        for name in _FIELDS:
            np.testing.assert_array_equal(getattr(many, name), getattr(one, name), err_msg=f"{entry.name}: {name}")
        assert list(many.categories) == list(one.categories)
        assert len(set(one.rounds.tolist())) > 1  # episodes of different lengths: streams end at different steps
        env.close()
        envs.close()


# ----------------------------------------------------------------------------- the benchmark's figures
@pytest.fixture(scope="module")
def two_seeds(bench_set: Path) -> tuple:
    return (
        run_benchmark(str(bench_set), episodes=2, seed=0, policy_dir=None),
        run_benchmark(str(bench_set), episodes=2, seed=1, policy_dir=None),
    )


@pytest.mark.slow  # runs whole benchmarks (the full suite runs it)
def test_fixed_k_rows_are_the_exact_evaluation(bench_set: Path, two_seeds: tuple) -> None:
    from oracle.dp import evaluate_policy
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    res = two_seeds[0]
    ts = load_dataset(str(bench_set))
    test, model = select_positions(ts, None, "test"), cost_model_for(ts, "fit-train")
    rows = res.summary.set_index("policy")
    best = res.context["best_fixed_k_train"]
    for name, k in (("autoregressive (k=0)", 0), ("fixed k=1", 1), ("fixed k=4", 4), ("fixed k=6", 6)):
        ev = evaluate_policy(test, model, k)
        r = rows.loc[name]
        assert r["evaluation"] == "exact"
        assert r["speedup_pooled"] == ev.speedup_pooled and r["speedup_mean"] == ev.speedup_mean
        assert r["mean_k"] == ev.mean_k and r["mean_accepted"] == ev.mean_accepted
        assert r["ci95_low"] == r["ci95_high"] == r["speedup_mean"]
        assert r["pooled_ci95_low"] == r["pooled_ci95_high"] == r["speedup_pooled"]
    assert (
        rows.loc[f"best fixed k={best} (train)", "speedup_pooled"] == evaluate_policy(test, model, best).speedup_pooled
    )
    # exact rows do not move with the seed; their table cells say "exact"
    other = two_seeds[1].summary.set_index("policy")
    assert (
        rows.loc[rows["evaluation"] == "exact", "speedup_pooled"]
        == other.loc[rows["evaluation"] == "exact", "speedup_pooled"]
    ).all()
    assert "1.000 (exact)" in markdown_table(res)


@pytest.mark.slow  # runs whole benchmarks (the full suite runs it)
def test_two_seeds_move_no_pooled_figure_by_more_than_its_ci(two_seeds: tuple) -> None:
    a, b = (r.summary.set_index("policy") for r in two_seeds)
    mc = a.index[a["evaluation"] == "monte-carlo"]
    assert len(mc) >= 9
    moved = 0
    for name in mc:
        for x, y in ((a.loc[name], b.loc[name]), (b.loc[name], a.loc[name])):
            assert x["pooled_ci95_low"] <= y["speedup_pooled"] <= x["pooled_ci95_high"], name
            assert x["ci95_low"] <= y["speedup_mean"] <= x["ci95_high"], name
            assert x["pooled_ci95_low"] < x["speedup_pooled"] < x["pooled_ci95_high"], name
        moved += a.loc[name, "speedup_pooled"] != b.loc[name, "speedup_pooled"]
    assert moved >= 1  # the seed really changes the Monte-Carlo draws


@pytest.mark.slow  # runs whole benchmarks (the full suite runs it)
def test_common_random_numbers_across_policies(two_seeds: tuple) -> None:
    ep = two_seeds[0].episodes
    seeds = ep.groupby(["generation_id", "episode"])["seed"].nunique()
    assert (seeds == 1).all()  # every policy saw the same stream on the same (generation, episode)
    assert ep.groupby("policy")["seed"].nunique().min() == ep[["generation_id", "episode"]].drop_duplicates().shape[0]


@pytest.mark.slow  # runs whole benchmarks (the full suite runs it)
def test_cost_model_and_everything_fitted_come_from_the_train_split(bench_set: Path, two_seeds: tuple) -> None:
    from specenv.cost.fit import fit_replay_model
    from specenv.cost.source import cost_model_for, fresh_fit, split_rounds
    from specenv.traces.datasets import load_dataset

    ctx = two_seeds[0].context
    assert ctx["cost_model"] == "fit-train" and ctx["cost_model_fitted_on"] == "train split"
    ts = load_dataset(str(bench_set))
    train = split_rounds(ts, "train")
    test_ids = set(ts.arrays().generation_ids.tolist()) - set(train["generation_id"].unique().tolist())
    assert len(test_ids) == ctx["test_generations"] and not set(train["generation_id"]) & test_ids
    model = cost_model_for(ts, "fit-train")
    assert model.source["split"] == "train"
    ref = fit_replay_model(train, ts.kmax, ts.facts.top_k)
    np.testing.assert_array_equal(model.alpha, ref.alpha)
    assert not np.array_equal(model.alpha, cost_model_for(ts, "fit").alpha)  # "fit" still fits every round
    # the test generations' rounds do not enter the fit: change their timings, same model
    mine = TraceSet.load(bench_set)  # a private copy: the registry's loaded set stays untouched
    mine.rounds = mine.rounds.assign(
        T_T_ms=np.where(mine.rounds["generation_id"].isin(test_ids), 3.0 * mine.rounds["T_T_ms"], mine.rounds["T_T_ms"])
    )
    np.testing.assert_array_equal(fresh_fit(mine, "train").alpha, model.alpha)
    assert not np.array_equal(fresh_fit(mine, "all").alpha, cost_model_for(ts, "fit").alpha)


# ----------------------------------------------------------------------------- policies found and flagged
def _mlp(spec, first_k: int, later_k: int) -> MLPPolicy:  # noqa: ANN001
    """A one-layer policy: ``first_k`` on a generation's first round, ``later_k`` afterwards."""
    W = np.zeros((spec.dim, spec.kmax + 1))
    b = np.zeros(spec.kmax + 1)
    b[later_k] = 1.0
    W[list(spec.names).index("first_round"), first_k] = 2.0
    return MLPPolicy(spec, [(W, b)], name="t")


@pytest.mark.slow  # seconds of work; the full suite runs it
def test_policies_found_in_both_layouts_constant_flagged_and_unrunnable_listed(bench_set: Path, tmp_path: Path) -> None:
    ctx = build_context(str(bench_set), None, "fit-train", None)
    runs = tmp_path / "runs"
    _mlp(ctx.spec, 2, 2).save(runs / "flat" / "policy")  # what `specenv train --out runs` writes
    _mlp(ctx.spec, 1, 3).save(runs / "varied")  # the shipped layout
    # Kmax 10: cannot run on Kmax 6
    shutil.copytree(shipped_policy_dir("paper-default") / "ppo", runs / "ppo-k10" / "policy")
    (runs / "broken" / "policy").mkdir(parents=True)
    (runs / "broken" / "policy" / "policy.json").write_text("{not json")
    assert set(find_policies(runs)) == {"flat", "varied", "ppo-k10", "broken"}
    res = run_benchmark(str(bench_set), episodes=1, policy_dir=runs, only=["flat", "varied", "ppo-k10", "broken"])
    rows = res.summary.set_index("policy")
    assert "flat (constant k=2)" in rows.index and bool(rows.loc["flat (constant k=2)", "constant"])
    assert rows.loc["flat (constant k=2)", "mean_k"] == 2.0 and bool(rows.loc["flat (constant k=2)", "learned"])
    assert "varied (learned)" in rows.index and not bool(rows.loc["varied (learned)", "constant"])
    skipped = {s["policy"]: s["reason"] for s in res.skipped}
    assert set(skipped) == {"ppo-k10", "broken"} and all(skipped.values())
    obj = json.loads(json.dumps(res.to_json(), default=float))
    flat = next(p for p in obj["policies"] if p["policy"] == "flat (constant k=2)")
    assert flat["constant"] is True and flat["constant_k"] == 2 and isinstance(flat["constant_k"], int)
    table = markdown_table(res)
    assert "ppo-k10 (not run:" in table and "broken (not run:" in table


@pytest.mark.slow  # seconds of work; the full suite runs it
def test_shipped_policies_constant_ones_are_flagged() -> None:
    """No shipped learned policy is constant on paper-default's test states (issue 11: a learned row earns it)."""
    res = run_benchmark("paper-default", episodes=1, only=["(learned)"])
    rows = res.summary[~res.summary["policy"].str.startswith("oracle bound")]
    shipped = set(find_policies(shipped_policy_dir("paper-default")))
    assert len(rows) == len(shipped)
    constant = {r.policy for r in rows.itertuples() if r.constant}
    for r in rows.itertuples():  # a constant row is named so, and only a constant row
        assert r.constant == ("(constant k=" in r.policy) and r.constant != ("(learned)" in r.policy)
    assert not constant, f"constant shipped policies: {sorted(constant)}"


# ----------------------------------------------------------------------------- goodput leaves k = 0
def _old_goodput_act(self: GoodputRule, obs: np.ndarray) -> int:
    """The goodput rule before: alpha = the observation's acc_rate (updated only on rounds with k >= 1)."""
    self._observe(obs)
    alpha = min(max(self.view.acc_rate(obs), 1e-6), 1 - 1e-6)
    tokens = (1.0 - alpha ** (self.ks + 1)) / (1.0 - alpha)
    return int(np.argmax(tokens / self._round_ms(obs)))


@pytest.mark.slow  # runs whole benchmarks (the full suite runs it)
def test_goodput_recovers_from_k0(tmp_path: Path) -> None:
    from specenv.generator import generate_paper
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    path = tmp_path / "greedy"
    generate_paper(20, kmax=6, seed=3, greedy=True, name="greedy-goodput").save(path)
    env = gym.make(ENV_ID, dataset=str(path), split="all", cost_model="profile")
    d = env.unwrapped.data
    up, rp = train_priors(select_positions(load_dataset(str(path)), None, "train"))

    def stuck(act) -> tuple[int, float]:  # noqa: ANN001
        """Generations ending in a run of k = 0 over more than half their rounds; share of k = 0 rounds."""
        n_stuck, zeros, total = 0, 0, 0
        for gid in d.generation_ids:
            pol = GoodputRule(d.spec, d.cost_model, up, rp)
            obs, _ = env.reset(seed=0, options={"generation_id": int(gid)})
            ks, done = [], False
            while not done:
                ks.append(act(pol, obs))
                obs, _, done, _, _ = env.step(ks[-1])
            ks = np.array(ks)
            nz = np.flatnonzero(ks > 0)
            tail = len(ks) - (nz[-1] + 1 if len(nz) else 0)
            n_stuck += tail > len(ks) / 2
            zeros, total = zeros + int((ks == 0).sum()), total + len(ks)
        return n_stuck, zeros / total

    old_stuck, old_zeros = stuck(_old_goodput_act)
    new_stuck, new_zeros = stuck(GoodputRule.act)
    assert old_stuck >= 3  # the set where the old rule got stuck at k = 0
    assert new_stuck == 0 and new_zeros < 0.5 * old_zeros
    env.close()


def test_train_fit_is_cached_on_disk_beside_the_full_fit(bench_set: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specenv.cost import source as costsource
    from specenv.traces.datasets import load_dataset

    ts = load_dataset(str(bench_set))
    first = costsource.cost_model_for(ts, "fit-train")
    key = costsource.fit_cache_key(ts, "train")
    assert key is not None and key != costsource.fit_cache_key(ts) and key["split"] == "train"
    assert costsource.fit_cache_path(key).is_file()
    monkeypatch.setattr(costsource, "_FIT_CACHE", {})
    calls: list[str] = []
    monkeypatch.setattr(costsource, "fresh_fit", lambda traces, split="all": calls.append(split))
    again = costsource.cost_model_for(ts, "fit-train")  # from the disk entry: no fit
    assert calls == [] and again is not first
    np.testing.assert_array_equal(again.alpha, first.alpha)
    np.testing.assert_array_equal(again.beta0, first.beta0)
