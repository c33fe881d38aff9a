"""Joint (k, cap) policies: the contract's cap levels, the numpy joint MLP, FixedCap, bench-caps, the joint learner."""

from __future__ import annotations

import dataclasses
import json

import gymnasium as gym
import numpy as np
import pytest

import specenv  # noqa: F401
from policies.caps.controllers import FixedCap, JointMLP
from policies.heuristics import FixedK
from specenv.envs.registration import CAP_ID
from specenv.observation.single import ObservationSpec
from specenv.policy.mlp import MLPPolicy, n_actions
from tests.rows import SYNTHETIC_CAPS, cap_trace_set


@pytest.fixture(scope="module")
def cap_set(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cappol") / "caps-syn"
    cap_trace_set(n_generations=12, kmax=4, seed=5).save(path)
    return str(path)


def _mlp(spec: ObservationSpec, seed: int = 0) -> MLPPolicy:
    rng = np.random.default_rng(seed)
    return MLPPolicy(
        spec,
        [
            (rng.normal(size=(spec.dim, 8)).astype(np.float32), np.zeros(8, np.float32)),
            (rng.normal(size=(8, n_actions(spec))).astype(np.float32), np.zeros(n_actions(spec), np.float32)),
        ],
        name="joint-test",
    )


def test_cap_levels_are_part_of_the_policy_contract(tmp_path):
    base = ObservationSpec(kmax=4, max_new_tokens=128, n_experts=64)
    joint = dataclasses.replace(base, cap_levels=3)
    assert joint.dim == base.dim and joint.names == base.names  # the vector is the k-only one
    assert n_actions(base) == 5 and n_actions(joint) == 20
    assert "cap_levels" not in base.to_json() and joint.to_json()["cap_levels"] == 3
    assert ObservationSpec.from_json(joint.to_json()) == joint
    assert joint.mismatch(base) == "cap_levels 3 != (absent)"
    pol = _mlp(joint)
    pol.save(tmp_path / "p")
    assert MLPPolicy.load(tmp_path / "p", expect=joint).spec == joint
    with pytest.raises(ValueError, match="observation contract differs: cap_levels"):
        MLPPolicy.load(tmp_path / "p", expect=base)
    with pytest.raises(ValueError, match=r"need \(cap_levels\+1\)\*\(kmax\+1\)=20"):
        MLPPolicy(joint, [(np.zeros((joint.dim, 5), np.float32), np.zeros(5, np.float32))])
    with pytest.raises(ValueError, match="not a joint"):
        JointMLP(_mlp(base))
    with pytest.raises(ValueError, match="cap_levels"):
        ObservationSpec(kmax=4, cap_levels=-1)


def test_joint_mlp_and_fixed_cap_act_in_the_joint_env(cap_set):
    env = gym.make(CAP_ID, dataset=cap_set, split="all")
    spec = env.unwrapped.obs_spec
    pol = JointMLP(_mlp(spec, seed=3))
    obs, _ = env.reset(seed=0)
    a = pol.act(obs)
    j = int(pol.mlp.act(obs))
    assert a.tolist() == [j % (spec.kmax + 1), j // (spec.kmax + 1)]
    assert env.action_space.contains(a)
    fixed = FixedCap(FixedK(spec, 3), 2)
    assert fixed.act(obs).tolist() == [3, 2]
    done = False
    while not done:
        _, _, done, _, info = env.step(fixed.act(obs))
        assert info["cap"] == 2 and info["U_r"] <= SYNTHETIC_CAPS[1]


def test_bench_caps_cli(cap_set, tmp_path):
    from typer.testing import CliRunner

    from specenv.cli import app

    out = tmp_path / "out"
    env = gym.make(CAP_ID, dataset=cap_set, split="test")
    _mlp(env.unwrapped.obs_spec, seed=2).save(tmp_path / "joint")
    args = ["bench-caps", cap_set, "--out", str(out), "--weight", "0", "--weight", "inf", "--only", "transformers"]
    res = CliRunner().invoke(app, [*args, "--joint-policy", str(tmp_path / "joint"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "bench_caps.json").read_text())
    names = [r["policy"] for r in doc["summary"]]
    assert "k-only oracle (SSP)" in names and "joint oracle (w=0)" in names and "joint oracle (w=inf)" in names
    assert f"MoE-Spec fixed cap B={SYNTHETIC_CAPS[0]}, k=4" in names
    assert f"transformers heuristic @ cap B={SYNTHETIC_CAPS[0]}" in names
    assert not any(n.startswith("UCB") for n in names)  # --only keeps the k-policies named
    assert "joint-test (joint, loaded)" in names
    rows = {r["policy"]: r for r in doc["summary"]}
    # the joint speed bound is never below the k-only bound; its infinite-weight point changes no token
    assert rows["joint oracle (w=0)"]["speedup"] >= rows["k-only oracle (SSP)"]["speedup"]
    assert rows["joint oracle (w=inf)"]["mismatch_rate"] == 0.0
    assert all(r["speedup_lo"] <= r["speedup"] <= r["speedup_hi"] for r in doc["summary"])
    assert (out / "frontier.png").stat().st_size > 0
    assert "| weight" in (out / "bench_caps.md").read_text()
    # bad input: one line, exit 2, nothing written
    for bad, msg in (
        (["bench-caps", "paper-default", "--out", str(tmp_path / "x")], "no expert-cap columns"),
        (["bench-caps", cap_set, "--out", str(tmp_path / "y"), "--train-joint", "inf"], "--train-joint"),
        (["bench-caps", cap_set, "--out", str(tmp_path / "z"), "--joint-policy", str(tmp_path / "no")], "not a folder"),
    ):
        res = CliRunner().invoke(app, bad)
        assert res.exit_code == 2 and msg in res.output, res.output
    assert not any((tmp_path / d).exists() for d in "xyz")


@pytest.mark.slow
def test_joint_imitation_trains_fast_and_round_trips(cap_set, tmp_path):
    from oracle.caps import solve_joint
    from policies.caps.controllers import train_joint_dagger
    from specenv.envs.rollout import rollout
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    res = train_joint_dagger(cap_set, 0.5, iterations=3, epochs=20, seed=1)
    assert res.seconds < 120
    res.policy.save(tmp_path / "joint")
    env = gym.make(CAP_ID, dataset=cap_set, split="train", cost_model="fit-train")
    pol = JointMLP.load(tmp_path / "joint", expect=env.unwrapped.obs_spec)
    assert pol.mlp.meta["quality_weight"] == 0.5 and pol.mlp.meta["caps"] == list(SYNTHETIC_CAPS)
    gids = env.unwrapped.data.generation_ids
    ro = rollout(env, pol, [(int(g), 0) for g in gids])
    train = select_positions(load_dataset(cap_set), None, "train")
    bound = solve_joint(train, env.unwrapped.data.cost_model)
    speed = ro.ar.sum() / ro.cost.sum()
    assert 1.0 < speed <= bound.speedup_pooled * (1 + 1e-9)  # a working controller, never above the bound
    # with draft confidences (block drafting, h = 2): the contract records them and the env charges T_D(max(k, h))
    res = train_joint_dagger(cap_set, 0.5, iterations=2, epochs=10, seed=1, lookahead=2)
    assert res.policy.spec.lookahead == 2 and res.policy.spec.cap_levels == len(SYNTHETIC_CAPS)
    assert res.policy.meta["drafting"] == "block" and res.policy.name.endswith("-h2")
