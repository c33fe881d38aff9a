"""Speculative sampling at T > 0 as the collectors record it (:mod:`specenv.engines.sampling`).

Expectations are computed here with numpy from the logits, not with the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from specenv.engines.sampling import acceptance, draft_uniforms, generation_seed, tempered_draw  # noqa: E402


def _softmax_t(logits: np.ndarray, T: float) -> np.ndarray:
    z = logits.astype(np.float64) / T
    z -= z.max()
    e = np.exp(z)
    return e / e.sum()


def test_draw_follows_the_tempered_distribution():
    """On a grid of M uniforms each token is drawn about p_T(x) * M times (inverse transform: within one)."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2.0, 17).astype(np.float32)
    T = 0.7
    p = _softmax_t(logits, T)
    M = 4000
    counts = np.zeros(len(p))
    t = torch.from_numpy(logits)
    for i in range(M):
        x, q, _, _ = tempered_draw(t, T, (i + 0.5) / M)
        counts[x] += 1
        assert q == pytest.approx(p[x], rel=1e-12)
    assert np.all(np.abs(counts - p * M) <= 1.0 + 1e-9)


def test_draw_signals_are_those_of_the_tempered_distribution():
    logits = np.array([3.0, 2.5, -1.0, 0.0, 1.0], dtype=np.float32)
    for T in (0.3, 0.7, 1.0, 2.0):
        p = _softmax_t(logits, T)
        x, q, ent, margin = tempered_draw(torch.from_numpy(logits), T, 0.999)
        assert q == pytest.approx(p[x], rel=1e-12)
        assert ent == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
        top = np.sort(p)[::-1]
        assert margin == pytest.approx(float(top[0] - top[1]), rel=1e-12)
    # u at the top of the range still gives a token of positive probability
    x, q, _, _ = tempered_draw(torch.tensor([0.0, 0.0, -1e4]), 1.0, np.nextafter(1.0, 0.0))
    assert x in (0, 1) and q > 0


def test_draw_refuses_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        tempered_draw(torch.zeros(3), 0.0, 0.5)
    with pytest.raises(ValueError, match="u="):
        tempered_draw(torch.zeros(3), 0.7, 1.0)


def test_acceptance_is_min_one_p_over_q():
    p = np.array([0.0, 0.2, 0.5, 0.9, 1.0])
    q = np.array([0.1, 0.4, 0.5, 0.3, 1.0])
    assert np.array_equal(acceptance(p, q), np.array([0.0, 0.5, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="q > 0"):
        acceptance([0.5], [0.0])
    with pytest.raises(ValueError, match="probability"):
        acceptance([1.5], [0.5])


def test_expected_acceptance_is_one_minus_total_variation():
    """E_{x~q}[min(1, p/q)] = sum_x min(p, q) = 1 - TV(p, q): the classical identity, on drawn tokens."""
    rng = np.random.default_rng(0)
    lp, lq = rng.normal(0, 1.5, 12), rng.normal(0, 1.5, 12)
    p, q = _softmax_t(lp, 0.7), _softmax_t(lq, 0.7)
    M = 20000
    xs = [tempered_draw(torch.from_numpy(lq), 0.7, (i + 0.5) / M)[0] for i in range(M)]
    mean = float(acceptance(p[xs], q[xs]).mean())
    assert mean == pytest.approx(float(np.minimum(p, q).sum()), abs=2e-3)


def test_seeds_are_reproducible_and_independent_per_generation():
    assert generation_seed(0, 5) == generation_seed(0, 5)
    assert len({generation_seed(0, g) for g in range(50)}) == 50
    assert generation_seed(1, 5) != generation_seed(0, 5)
    a, b = draft_uniforms(0, 5, 10, 4), draft_uniforms(0, 5, 10, 4)
    assert a.shape == (10, 4) and np.array_equal(a, b)
    assert ((a >= 0) & (a < 1)).all()
    assert not np.array_equal(a, draft_uniforms(0, 6, 10, 4))
    assert not np.array_equal(a, draft_uniforms(1, 5, 10, 4))


def _sampled_copy(tmp_path):
    """live-vllm-v1 made into a sampled set: fractional rho, ``greedy: false``, T and seed, sampled chain columns.

    Data that obeys the schema of a ``--temperature`` collection (not a model of the engine): rho is
    moved off {0, 1} deterministically, the chain columns are arbitrary token ids.
    """
    import dataclasses

    from specenv.traces.datasets import load_dataset
    from specenv.traces.schema import rho_columns
    from specenv.traces.traceset import TraceSet

    ts = load_dataset("live-vllm-v1")
    m = ts.manifest
    pos = ts.positions.copy()
    rng = np.random.default_rng(0)
    for c in rho_columns(m.kmax):
        r = pos[c].to_numpy(dtype=np.float64)
        pos[c] = np.where(r > 0.5, 1.0 - 0.3 * rng.random(len(r)), 0.3 * rng.random(len(r))).astype(np.float32)
    for j in range(1, m.kmax + 1):
        pos[f"draft_{j}"] = rng.integers(0, 1000, len(pos)).astype(np.int32)
    extra = {**m.extra, "temperature": 0.7, "seed": 0, "sampling": "synthetic"}
    out = tmp_path / "sampled"
    TraceSet(dataclasses.replace(m, greedy=False, extra=extra), pos, ts.rounds).save(out)
    return out


def test_a_sampled_vllm_set_backs_env_oracle_and_bench(tmp_path):
    """The schema's stochastic rho (as on paper-default) on a vLLM-shaped set: the readers take it as it is."""
    import gymnasium
    from typer.testing import CliRunner

    import oracle
    import specenv  # noqa: F401 - registers the environments
    from specenv.cli import app
    from specenv.cost.source import cost_model_for
    from specenv.replay.tables import select_positions
    from specenv.traces.traceset import TraceSet

    out = _sampled_copy(tmp_path)
    res = CliRunner().invoke(app, ["validate", str(out)])
    assert res.exit_code == 0, res.output
    ts = TraceSet.load(out)
    arrays = select_positions(ts, None, "all")
    assert not arrays.greedy and 0 < arrays.rho.min() < 0.3 and 0.7 < arrays.rho.max() <= 1.0
    env = gymnasium.make("specenv/MoESpec-v1", dataset=str(out))
    env.reset(seed=0)
    done = False
    while not done:
        _, _, term, trunc, info = env.step(3)
        done = term or trunc
    assert info["speedup"] > 0
    cm = cost_model_for(ts, "fit")
    bound = oracle.solve(arrays, cm)
    fixed = [oracle.evaluate_policy(arrays, cm, k).speedup_pooled for k in range(arrays.kmax + 1)]
    assert bound.speedup_pooled >= max(fixed) - 1e-9
    res = CliRunner().invoke(
        app, ["bench", str(out), "--episodes", "1", "--only", "fixed k", "--out", str(tmp_path / "b")]
    )
    assert res.exit_code == 0, res.output
    assert "oracle bound (SSP)" in res.output


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--engine", "hf", "--temperature", "0.7"], "collected by --engine vllm only"),
        (["--engine", "vllm", "--temperature", "0.7", "--caps", "auto"], "collect them at --temperature 0"),
    ],
)
def test_collect_refuses_what_sampling_cannot_record(tmp_path, args, msg):
    """Refused in one line before any engine starts (exit 2)."""
    from typer.testing import CliRunner

    from specenv.cli import app

    res = CliRunner().invoke(app, ["collect", "--out", str(tmp_path / "x"), *args])
    assert res.exit_code == 2 and msg in res.output, res.output
    assert not (tmp_path / "x").exists()
