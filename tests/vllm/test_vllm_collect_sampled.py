"""``specenv collect --engine vllm --temperature 0.7``: a sampled trace set, checked against transformers.

The expectation of rho is computed here from the two models' logits with transformers (the shipped
``small-moe-v1`` target and draft, no vLLM): p = softmax(target logits / T)[d_j] and q = softmax(draft
logits / T)[d_j] after ``prompt + y_<t + d_<j``, rho = min(1, p / q). The collection reuses the
session's engines (``small_collection``'s size: kmax 4, 16 tokens), three prompts so that the
benchmark has a train split of two generations and a test split of one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from typer.testing import CliRunner  # noqa: E402
from vhelpers import COLLECT_KMAX as KMAX  # noqa: E402
from vhelpers import collect_args  # noqa: E402

from specenv.cli import app  # noqa: E402

T = 0.7
#: Prompts of the sampled collection (a test split of one generation, a train split of two).
N_PROMPTS = 3


@pytest.fixture(scope="module")
def sampled(small_collection, tmp_path_factory):
    """The sampled collection (after the session's greedy one: the same engines), as (folder, set)."""
    from specenv.traces.traceset import TraceSet

    out = tmp_path_factory.mktemp("vcollect-t07") / "set"
    args = collect_args(out, "--models", "small-moe-v1")
    args[args.index("-n") + 1] = str(N_PROMPTS)
    res = CliRunner().invoke(app, [*args, "--temperature", str(T), "--seed", "3", "--json"])
    assert res.exit_code == 0, res.output
    return out, TraceSet.load(out)


@pytest.fixture(scope="module")
def hf_probs(sampled):
    """Per generation: (p, q) of every drafted token at T, from transformers (float64 softmax of float32 logits)."""
    import torch

    from specenv.engines.hf.models import load_models, load_prompts

    _, ts = sampled
    models = load_models()
    prompts = {p.id: p for p in load_prompts(ts.manifest.extra["prompt_set"])}
    out = {}
    pos = ts.positions
    with torch.inference_mode():
        for gid, ref in ts.manifest.extra["reference_tokens"].items():
            g = pos[pos["generation_id"] == int(gid)].sort_values("t")
            chains = g[[f"draft_{j}" for j in range(1, KMAX + 1)]].to_numpy()
            ids = models.encode(prompts[int(gid)].text)
            P = len(ids)
            p = np.zeros(chains.shape)
            q = np.zeros(chains.shape)
            for t in range(len(g)):
                seq = torch.tensor([[*ids, *ref[:t], *map(int, chains[t])]], dtype=torch.long)
                n = P + t
                for model, dest in ((models.target, p), (models.draft, q)):
                    logits = model(input_ids=seq).logits[0, n - 1 : n - 1 + KMAX].double()
                    probs = torch.softmax(logits / T, -1)
                    dest[t] = probs[torch.arange(KMAX), torch.tensor(chains[t].astype(np.int64))].numpy()
            out[int(gid)] = (g, p, q)
    return out


def _cols(g, prefix: str):
    return g[[f"{prefix}{j}" for j in range(1, KMAX + 1)]].to_numpy(dtype=np.float64)


def test_rho_is_min_one_p_over_q_of_the_two_models(hf_probs):
    """Every drafted token: rho = min(1, p/q) and q = q_T(d_j), as transformers computes them (float32 kernels)."""
    rho_err = q_err = 0.0
    fractional = 0
    for g, p, q in hf_probs.values():
        rho, q_rec = _cols(g, "rho_"), _cols(g, "q_")
        expect = np.minimum(1.0, p / q)
        rho_err = max(rho_err, float(np.abs(rho - expect).max()))
        q_err = max(q_err, float(np.abs(q_rec - q).max()))
        fractional += int(((rho > 0.01) & (rho < 0.99)).sum())
    print(
        f"sampled set vs transformers: max |d rho| {rho_err:.2g}, max |d q| {q_err:.2g}, "
        f"{fractional} rho in (0.01, 0.99)"
    )
    assert rho_err < 2e-3 and q_err < 1e-3
    assert fractional > 0  # probabilities, not verdicts


def test_chains_are_draws_of_the_draft_at_T(sampled, hf_probs):
    """Drafted tokens are draws, not the argmax: some have q well below the draft's top-1 at T."""
    _, ts = sampled
    q = np.concatenate([_cols(g, "q_").ravel() for g, _, _ in hf_probs.values()])
    margin = np.concatenate([_cols(g, "margin_").ravel() for g, _, _ in hf_probs.values()])
    assert (q > 0).all()
    # a drafted token with q < 1/2 and q below (top-1 - top-2) cannot be the top-1 token
    assert np.any((q < 0.5) & (q < margin))


def test_manifest_records_temperature_and_seed(sampled):
    _, ts = sampled
    m = ts.manifest
    assert m.greedy is False
    assert m.extra["temperature"] == T and m.extra["seed"] == 3
    assert "min(1, p(d_j)/q(d_j))" in m.extra["sampling"]
    assert m.extra["lossless"]["runs_checked"] == 0
    # the plain engine sampled with the same per-request seed as the speculative engine's K = 0 run
    assert m.extra["ar_reference"]["mismatches"] == 0
    assert "T=0.7" in m.extra["ar_reference"]["engine"]


def test_greedy_collection_is_unchanged(small_collection):
    """T = 0 (the default) writes what it always wrote: greedy verdicts, no seed, no chain columns."""
    from specenv.engines.vllm.collect import _ENGINES

    _, ts = small_collection
    m = ts.manifest
    assert m.greedy is True and m.extra["temperature"] == 0.0
    assert "seed" not in m.extra and "sampling" not in m.extra
    assert not [c for c in ts.positions.columns if c.startswith("draft_")]
    rho = ts.positions[[f"rho_{j}" for j in range(1, KMAX + 1)]].to_numpy()
    assert np.isin(rho, (0.0, 1.0)).all()
    assert all(be.temperature == 0.0 for be in _ENGINES.values())  # a sampled collection leaves them greedy


def test_sampled_set_backs_env_oracle_and_bench(sampled, tmp_path):
    import gymnasium

    import oracle
    import specenv  # noqa: F401 - registers the environments
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions

    out, ts = sampled
    res = CliRunner().invoke(app, ["validate", str(out), "--json"])
    assert res.exit_code == 0, res.output
    env = gymnasium.make("specenv/MoESpec-v1", dataset=str(out))
    env.reset(seed=0)
    done = False
    while not done:
        _, _, term, trunc, info = env.step(2)
        done = term or trunc
    assert info["speedup"] > 0
    arrays, cm = select_positions(ts, None, "all"), cost_model_for(ts, "fit")
    assert not arrays.greedy
    bound = oracle.solve(arrays, cm)
    fixed = [oracle.evaluate_policy(arrays, cm, k).speedup_pooled for k in range(arrays.kmax + 1)]
    assert np.isfinite(bound.speedup_pooled) and bound.speedup_pooled >= max(fixed) - 1e-9
    # the profile's cost model: three generations of 16 tokens are too few for a per-K fit on the train split
    args = ["bench", str(out), "--episodes", "1", "--cost-model", "profile", "--out", str(tmp_path / "b"), "--json"]
    bench = CliRunner().invoke(app, args)
    assert bench.exit_code == 0, bench.output
    doc = json.loads(bench.stdout)
    names = [r["policy"] for r in doc["policies"]]
    assert f"fixed k={KMAX}" in names and len(names) == len(set(names))  # Kmax = 4: the row once
    assert doc["oracle"]
