"""Minari datasets (policies/learn/offline.py) and behaviour cloning (policies/learn/bc.py): round trip, BC, refusals.

Every dataset goes to a tmp_path root (``--root``); nothing touches ``~/.minari`` or the user's cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

minari = pytest.importorskip("minari")

from specenv.cli import app  # noqa: E402

ENV_ID = "specenv/MoESpec-v1"


def _cli(*args: str):  # noqa: ANN202
    return CliRunner().invoke(app, list(args))


def _one_line_error(res) -> str:  # noqa: ANN001
    assert res.exit_code == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specenv: error: "), res.stderr
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _load(root: Path, ident: str):  # noqa: ANN202
    from policies.learn.offline import minari_root

    with minari_root(root):
        return minari.load_dataset(ident)


@pytest.fixture(scope="module")
def exported(small_traces: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The oracle's train-split episodes of the small set, two per generation, in a fresh root."""
    root = tmp_path_factory.mktemp("minari")
    res = _cli(
        "export", "minari", "--dataset", str(small_traces), "--policy", "oracle", "--episodes", "2", "--root", str(root)
    )
    assert res.exit_code == 0, res.stderr
    return root, "specenv/small/oracle-v0"


# ---------------------------------------------------------------- round trip


def test_export_round_trips_what_the_env_produced(exported: tuple[Path, str], small_traces: Path) -> None:
    import gymnasium as gym

    import specenv  # noqa: F401
    from policies.learn.expert import OracleExpert
    from specenv.io import sha256_file

    root, ident = exported
    ds = _load(root, ident)
    env = gym.make(ENV_ID, dataset=str(small_traces.resolve()), split="train", cost_model="fit-train")
    assert ds.observation_space == env.observation_space and ds.action_space == env.action_space
    expert = OracleExpert.for_env(env)
    n_gen = len(env.unwrapped.data.generation_ids)
    assert ds.total_episodes == 2 * n_gen
    seen = set()
    for ep in ds.iterate_episodes():
        meta = next(iter(ds.storage.get_episode_metadata([ep.id])))
        gid, seed = int(meta["options"]["generation_id"]), int(meta["seed"])
        seen.add((gid, seed))
        obs, _ = env.reset(seed=seed, options={"generation_id": gid})
        obs_l, act_l, rew_l, t, done = [obs], [], [], 0, False
        while not done:
            k = expert.act_state(gid, t)
            obs, r, term, trunc, info = env.step(k)
            obs_l.append(obs), act_l.append(k), rew_l.append(r)
            t, done = info["t"], term or trunc
        np.testing.assert_array_equal(ep.observations, np.asarray(obs_l))
        np.testing.assert_array_equal(ep.actions, np.asarray(act_l))
        np.testing.assert_array_equal(ep.rewards, np.asarray(rew_l))
        assert bool(ep.terminations[-1]) and not ep.truncations.any()
    assert len(seen) == 2 * n_gen  # every (generation, episode) has its own seed
    # the recovered environment is ours, with the recorded arguments, and replays the first episode
    rec = ds.recover_environment()
    assert rec.spec.id == ENV_ID and rec.unwrapped.data.spec == env.unwrapped.data.spec
    ep0 = next(ds.iterate_episodes([0]))
    meta0 = next(iter(ds.storage.get_episode_metadata([0])))
    first, _ = rec.reset(seed=int(meta0["seed"]), options={"generation_id": int(meta0["options"]["generation_id"])})
    np.testing.assert_array_equal(first, ep0.observations[0])
    block = ds.storage.metadata["specenv"]
    assert block["trace_set"]["manifest_sha256"] == sha256_file(small_traces / "manifest.json")
    assert block["split"] == "train" and block["observation_version"] == env.unwrapped.data.spec.version
    assert block["policy"]["oracle_table_sha256"] == expert.table_sha256
    assert block["observation"] == env.unwrapped.data.spec.to_json()
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # the staging folder is gone
    rec.close(), env.close()


def test_export_of_a_policy_folder_records_its_files_and_mode(tmp_path: Path) -> None:
    from policies import shipped_policy_dir
    from specenv.io import sha256_file

    folder = shipped_policy_dir("paper-default") / "imitation-h3"
    res = _cli("export", "minari", "--policy", str(folder), "--split", "test", "--root", str(tmp_path), "--json", "-q")
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["dataset_id"] == "specenv/paper-default/imitation-h3-v0"
    meta = out["metadata"]
    assert meta["drafting"] == "block" and meta["lookahead"] == 3 and meta["split"] == "test"
    assert meta["policy"]["files_sha256"] == {f: sha256_file(folder / f) for f in ("policy.json", "weights.npz")}
    ds = _load(tmp_path, out["dataset_id"])
    assert ds.total_steps == out["steps"] and ds.observation_space.shape == (10 + 10 + 3,)


def test_dataset_ids_name_the_mode_of_the_oracle_and_registered_policies(small_traces: Path) -> None:
    from policies.learn.offline import dataset_id, plan_policy

    s = str(small_traces)
    assert dataset_id(s, "oracle", plan=plan_policy("oracle", s, 6)) == "specenv/small/oracle-v0"
    assert dataset_id(s, "oracle", plan=plan_policy("oracle", s, 6, "block", 3)) == "specenv/small/oracle-h3-v0"
    seq = plan_policy("confidence-threshold:threshold=0.5", s, 6, "sequential")
    assert (seq.drafting, seq.lookahead) == ("sequential", 6)
    assert dataset_id(s, seq.name, plan=seq) == "specenv/small/confidence-threshold-threshold-0-5-seq-v0"


# ---------------------------------------------------------------- behaviour cloning


def test_bc_clones_a_fixed_budget_and_its_policy_runs_in_the_env(small_traces: Path, tmp_path: Path) -> None:
    import gymnasium as gym

    from specenv.envs.rollout import evaluate_in_env
    from specenv.policy.mlp import MLPPolicy

    root = tmp_path / "m"
    res = _cli("export", "minari", "--dataset", str(small_traces), "--policy", "fixed-k:k=3", "--root", str(root))
    assert res.exit_code == 0, res.stderr
    ident = "specenv/small/fixed-k-k-3-v0"
    res = _cli("train", "--algo", "bc", "--dataset", ident, "--root", str(root), "--out", str(tmp_path / "runs"))
    assert res.exit_code == 0, res.stderr
    env = gym.make(ENV_ID, dataset=str(small_traces), split="test", cost_model="fit-train")
    pol = MLPPolicy.load(tmp_path / "runs" / "bc-seed0" / "policy", expect=env.unwrapped.data.spec)
    assert pol.meta["algo"] == "bc" and pol.meta["minari"]["dataset_id"] == ident
    assert pol.meta["drafting"] == "none" and pol.meta["trace_set"]["split"] == "train"
    ev = evaluate_in_env(pol, env=env, episodes=1)  # the held-out generations: states it never saw
    assert (ev.k_min == 3).all() and (ev.k_max == 3).all()
    env.close()


def test_bc_from_the_oracle_trains_and_exports(exported: tuple[Path, str], tmp_path: Path) -> None:
    root, ident = exported
    res = _cli(
        "train", "--algo", "bc", "--dataset", ident, "--root", str(root), "--out", str(tmp_path), "--epochs", "3",
        "--json", "-q",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    meta = json.loads(res.stdout)["meta"]
    hist = meta["history"]
    assert len(hist) == 3 and hist[-1]["loss"] < hist[0]["loss"]
    assert meta["minari"]["recorded_policy"]["kind"] == "oracle" and meta["observation_version"] == 2


# ---------------------------------------------------------------- refusals


def test_unknown_or_malformed_dataset_id_is_one_line(exported: tuple[Path, str], tmp_path: Path) -> None:
    root, _ = exported
    for ident, words in (
        ("specenv/small/nothing-v0", "no Minari dataset"),
        ("specenv/small/oracle", "ends with its version"),
        ("bad id!-v0", "malformed"),
    ):
        line = _one_line_error(
            _cli("train", "--algo", "bc", "--dataset", ident, "--root", str(root), "--out", str(tmp_path))
        )
        assert "--dataset" in line and words in line, line
    line = _one_line_error(_cli("train", "--algo", "ppo", "--dataset", "specenv/small/oracle-v0", "--root", str(root)))
    assert "only --algo bc" in line
    assert not list(tmp_path.iterdir())  # nothing written


def _copy_with_metadata(root: Path, ident: str, dest_root: Path, edit) -> str:  # noqa: ANN001
    import shutil

    from policies.learn.offline import dataset_path

    shutil.copytree(root, dest_root)
    meta_file = dataset_path(dest_root, ident) / "data" / "metadata.json"
    doc = json.loads(meta_file.read_text())
    edit(doc)
    meta_file.write_text(json.dumps(doc))
    return ident


def test_wrong_contract_or_env_is_refused(exported: tuple[Path, str], tmp_path: Path) -> None:
    root, ident = exported

    def other_contract(doc: dict) -> None:
        doc["specenv"]["observation"]["ema"] = 0.5

    def other_env(doc: dict) -> None:
        doc["env_spec"] = doc["env_spec"].replace(ENV_ID, "CartPole-v1")

    def not_ours(doc: dict) -> None:
        del doc["specenv"]

    for i, (edit, words) in enumerate(
        ((other_contract, "observation contract differs"), (other_env, "CartPole-v1"), (not_ours, "not exported"))
    ):
        r = _copy_with_metadata(root, ident, tmp_path / f"r{i}", edit)
        line = _one_line_error(
            _cli("train", "--algo", "bc", "--dataset", r, "--root", str(tmp_path / f"r{i}"), "--out", str(tmp_path))
        )
        assert words in line, line


def test_bc_refuses_a_test_split_dataset(small_traces: Path, tmp_path: Path) -> None:
    root = tmp_path / "m"
    args = ("export", "minari", "--dataset", str(small_traces), "--policy", "fixed-k:k=2", "--split", "test")
    assert _cli(*args, "--root", str(root)).exit_code == 0
    line = _one_line_error(
        _cli(
            "train",
            "--algo",
            "bc",
            "--dataset",
            "specenv/small/fixed-k-k-2-v0",
            "--root",
            str(root),
            "--out",
            str(tmp_path / "x"),
        )
    )
    assert "train split only" in line and not (tmp_path / "x").exists()


def test_export_refuses_to_overwrite_and_replaces_only_its_own(small_traces: Path, tmp_path: Path) -> None:
    root = tmp_path / "m"
    args = ("export", "minari", "--dataset", str(small_traces), "--policy", "fixed-k:k=1", "--root", str(root))
    assert _cli(*args).exit_code == 0
    before = _tree(root)
    line = _one_line_error(_cli(*args))
    assert "already exists" in line and "--overwrite" in line
    assert _tree(root) == before  # untouched
    res = _cli(*args, "--overwrite", "--seed", "7")
    assert res.exit_code == 0, res.stderr
    after = _tree(root)
    assert after.keys() == before.keys() and after != before  # replaced (other seeds), nothing else left
    assert _load(root, "specenv/small/fixed-k-k-1-v0").storage.metadata["specenv"]["seed"] == 7
    # a folder specenv did not write at a dataset's place is never replaced, --overwrite or not
    theirs = root / "specenv" / "small" / "fixed-k-k-2-v0"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    args2 = ("export", "minari", "--dataset", str(small_traces), "--policy", "fixed-k:k=2", "--root", str(root))
    line = _one_line_error(_cli(*args2, "--overwrite"))
    assert "not a Minari dataset exported by specenv" in line
    assert (theirs / "notes.txt").read_text() == "mine" and sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]


def test_a_killed_exports_staging_folder_is_removed_by_the_next(small_traces: Path, tmp_path: Path) -> None:
    root = tmp_path / "m"
    dead = root / ".specenv-staging.999999999.0123abcd"  # no process has this pid
    (dead / "specenv").mkdir(parents=True)
    alive = root / f".specenv-staging.{os.getpid()}.0123abcd"  # a running export's (this process)
    alive.mkdir()
    other = root / ".my-notes"
    other.mkdir()
    args = ("export", "minari", "--dataset", str(small_traces), "--policy", "fixed-k:k=1", "--root", str(root))
    assert _cli(*args).exit_code == 0
    assert not dead.exists() and alive.is_dir() and other.is_dir()


def test_bad_policy_or_settings_write_nothing(small_traces: Path, tmp_path: Path) -> None:
    root = tmp_path / "m"
    base = ("export", "minari", "--dataset", str(small_traces), "--root", str(root))
    for extra, words in (
        (("--policy", "no-such-policy"), "--policy"),
        (("--policy", "oracle", "--split", "validation"), "--split"),
        (("--policy", "oracle", "--signals", "q,ent"), "--signals"),
        (("--policy", "oracle", "--drafting", "none", "--lookahead", "2"), "--lookahead"),
        (("parquet",), "FORMAT"),
    ):
        args = (*base, *extra) if extra[0] != "parquet" else ("export", "parquet", "--policy", "oracle")
        assert words in _one_line_error(_cli(*args))
    assert not root.exists()


def test_minari_stays_optional() -> None:
    code = "import sys, specenv, specenv.cli, policies.bench.single; print('minari' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr
