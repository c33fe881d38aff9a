"""Live CPU engine: losslessness, routing capture, collection, the live-cpu trace set and its fit."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from specenv.cli import app  # noqa: E402
from specenv.engines.base import prefix_expert_stats as expert_stats  # noqa: E402
from specenv.engines.hf import LiveEngine, load_models, load_prompts  # noqa: E402
from specenv.engines.hf.models import model_dir  # noqa: E402

KMAX = 8


@pytest.fixture(scope="module")
def models():
    return load_models()


@pytest.fixture(scope="module")
def engine(models):
    eng = LiveEngine(models, kmax=KMAX, max_new_tokens=40)
    yield eng
    eng.close()


def prompt_ids(models, i):
    return models.encode(load_prompts()[i].text)


# ------------------------------------------------------------------------------------------- models
@pytest.mark.slow
def test_shipped_models_offline_and_small(models):
    root = model_dir()
    files = [p for p in root.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 25 * 2**20
    assert not any(p.suffix in (".bin", ".pt", ".pth", ".pkl") for p in files)  # safetensors only
    man = json.loads((root / "manifest.json").read_text())
    assert set(man["files"]) >= {"tokenizer.json", "target/model.safetensors", "draft/model.safetensors"}
    assert models.target.config._experts_implementation == "eager"
    assert type(models.target.model.layers[0].mlp.gate).__name__ == "Qwen3MoeTopKRouter"
    assert models.n_experts == man["target"]["config"]["num_local_experts"]
    assert sum(p.numel() for p in models.draft.parameters()) * 5 < sum(p.numel() for p in models.target.parameters())
    assert models.decode(models.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"


def test_prompt_set():
    prompts = load_prompts()
    assert len(prompts) >= 64
    assert [p.id for p in prompts] == list(range(len(prompts)))
    cats = {p.category for p in prompts[:64]}
    assert cats == {"function_body", "class_method", "docstring", "test_code"}


# ----------------------------------------------------------------------------------------- lossless
@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1, 2, 3])
def test_speculative_equals_plain_greedy(engine, models, i):
    ids = prompt_ids(models, i)
    ref, rounds0 = engine.generate(ids, 0)
    assert all(r.k == 0 and r.m == 1 and r.T_D_ms == 0 and r.U_r == models.top_k for r in rounds0)
    # independent reference: transformers' own greedy generate on the target alone
    with torch.inference_mode():
        out = models.target.generate(
            torch.tensor([ids]), max_new_tokens=len(ref), do_sample=False, pad_token_id=models.eos_id, eos_token_id=None
        )
    hf = out[0, len(ids) :].tolist()
    n = len(ref) - (1 if ref and ref[-1] == models.eos_id else 0)
    assert ref[:n] == hf[:n]
    for k in range(1, KMAX + 1):
        toks, rounds = engine.generate(ids, k)
        assert toks == ref, f"k={k}"
        assert sum(len(r.committed) for r in rounds) == len(ref)
        for r in rounds:
            assert r.m == k + 1 and 0 <= r.accepted <= k and len(r.q) == k
            assert models.top_k <= r.U_r <= min(models.n_experts, r.m * models.top_k)
            assert 1 <= r.E_max <= r.m and r.T_T_ms > 0 and r.T_D_ms > 0


@pytest.mark.slow
def test_lookahead_and_mixed_budgets_are_lossless(engine, models):
    ids = prompt_ids(models, 5)
    ref, _ = engine.generate(ids, 0)
    engine.start(ids)
    rng = np.random.default_rng(0)
    while not engine.done:
        engine.propose(3)  # confidences drafted before the decision
        engine.step(int(rng.integers(0, KMAX + 1)))
    assert engine.generated == ref


@pytest.mark.slow
def test_sampling_runs_and_is_seeded(models):
    eng = LiveEngine(models, kmax=4, max_new_tokens=24, temperature=0.8, seed=3)
    ids = prompt_ids(models, 2)
    a, ra = eng.generate(ids, 4)
    eng.seed(3)
    b, _ = eng.generate(ids, 4)
    eng.close()
    assert a == b and len(a) >= 1
    assert all(0 < q <= 1 for r in ra for q in r.q)


# ------------------------------------------------------------------------------------------ routing
@pytest.mark.slow
def test_routing_equals_router_logits_topk(engine, models):
    ids = prompt_ids(models, 7)
    engine.start(ids)
    for k in (0, 3, KMAX, 5):
        if engine.done:
            break
        ctx = list(engine._s.ids)
        r = engine.step(k)
        verified = [ctx[-1], *r.drafted[:k]]
        full = torch.tensor([ctx[:-1] + verified])
        with torch.inference_mode():
            out = models.target(input_ids=full, output_router_logits=True)
        ref = np.stack([lg[-(k + 1) :].topk(models.top_k, dim=-1).indices.numpy() for lg in out.router_logits])
        got = engine.last_routing
        assert got.shape == ref.shape == (models.n_layers, k + 1, models.top_k)
        assert np.array_equal(np.sort(got, axis=-1), np.sort(ref, axis=-1))
        U, E = expert_stats(got, models.n_experts)
        assert r.U_r == pytest.approx(U[-1]) and r.E_max == pytest.approx(E[-1])
        per_layer = [len(np.unique(ref[li])) for li in range(models.n_layers)]
        assert r.U_r == pytest.approx(np.mean(per_layer))


def test_expert_stats_prefixes():
    routing = np.array([[[0, 1], [1, 2], [0, 1]], [[3, 4], [5, 6], [7, 3]]])  # 2 layers, 3 positions, top-2
    U, E = expert_stats(routing, 8)
    assert U.tolist() == [2.0, 3.5, 4.0]
    assert E.tolist() == [1.0, 1.5, 2.5]


@pytest.mark.slow
def test_sweep_is_consistent_with_rounds(engine, models):
    ids = prompt_ids(models, 9)
    ref, _ = engine.generate(ids, 0)
    sw = engine.sweep(ids, ref, KMAX)
    N = len(ref)
    assert sw["rho"].shape == (N, KMAX) and sw["U"].shape == (N, KMAX + 1)
    assert np.all(sw["U"][:, 0] == models.top_k) and np.all(np.diff(sw["U"], axis=1) >= -1e-6)
    # the accepted count of a greedy round at t equals the run of ones in rho_t
    for k in (2, KMAX):
        engine.start(ids)
        while not engine.done:
            r = engine.step(k)
            run = int(np.cumprod(sw["rho"][r.t, :k]).sum())
            assert min(run, N - r.t - 1) == r.accepted
            assert r.U_r == pytest.approx(sw["U"][r.t, k], abs=1e-5)


# ------------------------------------------------------------------------------- collection and CLI
@pytest.mark.slow
def test_collect_cli_writes_valid_set(tmp_path):
    from specenv.traces.datasets import load_dataset

    out = tmp_path / "live"
    res = CliRunner().invoke(
        app,
        ["collect", "--engine", "hf", "-n", "2", "--kmax", "2", "--max-new-tokens", "12", "--out", str(out), "--json"],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["lossless_mismatches"] == 0
    ts = load_dataset(out, cache=False)
    assert ts.manifest.source == "hf" and ts.manifest.greedy and ts.kmax == 2
    assert sorted(ts.rounds["K"].unique().tolist()) == [0, 1, 2]
    assert ts.positions.groupby("generation_id").size().tolist() == [12, 12]


def test_collect_cli_errors(tmp_path):
    res = CliRunner().invoke(app, ["collect", "--engine", "sglang", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2
    assert res.stderr.strip().count("\n") == 0 and "--engine" in res.stderr and "hf, vllm" in res.stderr


def test_collect_cli_vllm_needs_the_extra(tmp_path):
    try:
        import vllm.v1.engine  # noqa: F401 - tests/vllm is also importable as "vllm" here
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here (tests/vllm/test_vllm_collect.py runs the collection)")
    res = CliRunner().invoke(app, ["collect", "--engine", "vllm", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2
    assert res.stderr.strip().count("\n") == 0 and "make venv-vllm" in res.stderr and "--engine vllm" in res.stderr


def test_live_vllm_set_validates_and_measures_the_ar_step():
    from specenv.cost.source import cost_model_for
    from specenv.traces.datasets import load_dataset

    ts = load_dataset("live-vllm")
    m = ts.manifest
    assert m.source == "vllm" and m.greedy and m.kmax == 8 and m.schema_version == 2 and ts.has_positions
    assert (m.model.n_layers, m.model.n_experts, m.model.top_k) == (6, 64, 4)
    assert sorted(ts.rounds["K"].unique().tolist()) == list(range(9))  # K = 0 rounds: the AR step measured
    assert m.extra["lossless"]["mismatched_runs"] == 0
    assert cost_model_for(ts, "fit").ar_extrapolated is False


def test_live_cpu_set_validates():
    from specenv.traces.datasets import find_dataset, load_dataset

    assert find_dataset("live-cpu") is not None
    ts = load_dataset("live-cpu")
    m = ts.manifest
    assert m.source == "hf" and m.greedy and m.counts["generations"] >= 64
    assert (m.model.n_layers, m.model.n_experts, m.model.top_k) == (6, 64, 4)
    assert m.extra["lossless"]["mismatched_runs"] == 0
    assert sorted(ts.rounds["K"].unique().tolist()) == list(range(m.kmax + 1))
    res = CliRunner().invoke(app, ["validate", "live-cpu"])
    assert res.exit_code == 0, res.output


def test_fit_live_cpu_alpha_significant():
    res = CliRunner().invoke(app, ["fit", "live-cpu", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    per_k = {r["K"]: r for r in rep["per_k"]}
    kmax = max(per_k)
    assert sorted(per_k) == list(range(1, kmax + 1))
    for K, r in per_k.items():
        assert r["alpha"] > 0, K
        assert r["alpha_p"] < 1e-3, (K, r["alpha_p"])
    assert rep["ar"]["extrapolated"] is False  # K = 0 rounds are measured


# ------------------------------------------------------------------------------------- environment
@pytest.mark.slow
def test_live_env_checkers_no_warnings():
    import warnings

    import gymnasium as gym
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make("specenv/MoESpecLive-v1", max_new_tokens=16)
        assert env.spec.nondeterministic is True
        check_env(env.unwrapped)
        try:
            from stable_baselines3.common.env_checker import check_env as sb3_check_env
        except ImportError:
            pass
        else:
            sb3_check_env(env)
        env.close()
    assert [str(w.message) for w in caught] == []


@pytest.mark.slow
@pytest.mark.parametrize("cost_source", ["measured", "model"])
def test_live_env_episode_matches_replay_contract(cost_source, models):
    import gymnasium as gym

    import specenv  # noqa: F401

    env = gym.make("specenv/MoESpecLive-v0", cost_source=cost_source, lookahead=2, max_new_tokens=24, split="all")
    replay = gym.make("specenv/MoESpec-v0", dataset="live-cpu", lookahead=2, split="all")
    assert env.observation_space == replay.observation_space and env.action_space == replay.action_space
    assert env.unwrapped.ar_unit_ms == replay.unwrapped.ar_unit_ms
    eng = LiveEngine(models, kmax=KMAX, max_new_tokens=24)
    ref, _ = eng.generate(prompt_ids(models, 3), 0)
    eng.close()
    obs, info = env.reset(seed=0, options={"generation_id": 3})
    _, rinfo = replay.reset(seed=0, options={"generation_id": 3})
    assert info == rinfo
    assert obs in env.observation_space
    total, t, ks = 0.0, 0, [4, 0, 8, 2]
    for i in range(1000):
        obs, rew, term, trunc, info = env.step(ks[i % 4])
        assert obs in env.observation_space and isinstance(rew, float) and rew < 0
        assert trunc is False and info["t"] > t
        t = info["t"]
        total += rew
        if term:
            break
    assert term and t == len(ref)
    assert set(rinfo) | {"k", "accepted", "committed", "cost_ms", "U_r", "L", "t", "T_T_ms", "T_D_ms"} <= set(info)
    assert info["speedup"] > 0 and info["episode_cost_ms"] == pytest.approx(-total * env.unwrapped.ar_unit_ms)
    assert env.unwrapped.engine.generated == ref  # the live env decodes losslessly
    env.close()
    env.close()  # idempotent
