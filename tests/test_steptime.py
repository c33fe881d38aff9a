"""The step-time cost model (specenv.cost.steptime) on a hand-built recording.

The recording is a generated set whose rounds get step times built here: each step is its two forwards
plus a known per-budget overhead, and a plain engine's line ``a + c L`` is written into the manifest, as
the vLLM collector writes them. Every expectation is computed in the test from those numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import oracle
from specenv.cost.model import CostModel
from specenv.cost.source import fresh_fit
from specenv.cost.steptime import ablate, fit_step_model, has_step_times, step_overhead
from specenv.envs.replay import ENV_ID
from specenv.generator import generate_paper
from specenv.traces.traceset import TraceSet

KMAX = 4
A_MS, C_MS = 9.5, 2e-3  # the plain engine's step: a + c * L


def overhead_of(K: np.ndarray) -> np.ndarray:
    """The per-step overhead the recording is built with: 3 ms + 0.25 ms per verified draft."""
    return 3.0 + 0.25 * np.asarray(K, dtype=np.float64)


def recorded(tmp_path: Path, name: str = "steps", base: TraceSet | None = None) -> Path:
    """A set with step times: T_step = T_T + T_D + overhead(K) (+ symmetric noise of zero mean per K).

    ``base``: the generated set to add them to (default: 10 stochastic generations, Kmax 4).
    """
    ts = base if base is not None else generate_paper(10, kmax=KMAX, seed=11, name=name)
    r = ts.rounds.copy()
    r["T_T_wall_ms"] = r["T_T_ms"].astype(np.float64)
    r["T_D_wall_ms"] = r["T_D_ms"].astype(np.float64)
    noise = np.zeros(len(r))
    for _, idx in r.groupby("K").groups.items():  # +0.2, -0.2, +0.2, ... (an odd group's last row 0)
        idx = np.asarray(list(idx))
        even = len(idx) - len(idx) % 2
        noise[idx[:even]] = np.where(np.arange(even) % 2 == 0, 0.2, -0.2)
    r["T_step_ms"] = r["T_T_wall_ms"] + r["T_D_wall_ms"] + overhead_of(r["K"]) + noise
    ts.rounds = r
    ts.manifest.extra = dict(ts.manifest.extra) | {
        "ar_reference": {"engine": "hand-built", "steps": 100, "mean_ms": 10.0, "a_ms": A_MS, "c_ms_per_token": C_MS}
    }
    path = tmp_path / name
    ts.save(path)
    return path


def test_step_model_terms_come_from_the_recording(tmp_path: Path) -> None:
    ts = TraceSet.load(recorded(tmp_path))
    assert has_step_times(ts.rounds, ts.manifest.extra)
    model = fresh_fit(ts)
    assert model.source["kind"] == "fit-step"
    want = overhead_of(np.arange(KMAX + 1))
    assert not (ts.rounds["K"] == 0).any()  # the generator records K >= 1: K = 0 gets the mean of the others
    want[0] = want[1:].mean()
    np.testing.assert_allclose(model.overhead, want, rtol=0, atol=1e-5)
    assert model.ar_step == (A_MS, C_MS)
    # the speedup reference is the plain engine's step, not the speculating engine's k = 0 step
    L = np.array([10.0, 500.0, 2000.0])
    np.testing.assert_allclose(model.ar_ms(L), A_MS + C_MS * L, rtol=1e-12)
    assert not model.plain_is_k0
    # a round costs its two forwards and the overhead of its budget
    for k in range(KMAX + 1):
        U, Lk = 12.0, 300.0
        target = model.beta0[k] + model.alpha[k] * U + model.c[k] * Lk
        draft = model.d1 * k + model.d0 if k else model.d_floor
        assert float(model.charged_ms(k, U, Lk)) == pytest.approx(target + draft + want[k], rel=1e-9)


def test_env_and_oracle_use_the_plain_engine_as_reference(tmp_path: Path) -> None:
    path = recorded(tmp_path)
    ts = TraceSet.load(path)
    arr = ts.arrays()
    env = gym.make(ENV_ID, dataset=str(path), split="all", cost_model="fit")
    gid = int(arr.generation_ids[0])
    env.reset(seed=0, options={"generation_id": gid})
    done, info = False, {}
    while not done:
        _, _, term, trunc, info = env.step(0)
        done = term or trunc
    rows = slice(int(arr.offsets[0]), int(arr.offsets[1]))
    want_ar = float(np.sum(A_MS + C_MS * arr.L[rows]))
    assert info["ar_cost_ms"] == pytest.approx(want_ar, rel=1e-9)
    # k = 0 in the speculating engine pays its forwards, its draft floor and its step overhead
    model = fresh_fit(ts)
    U0, L0 = arr.U[rows, 0].astype(np.float64), arr.L[rows].astype(np.float64)
    want_k0 = np.sum(model.beta0[0] + model.alpha[0] * U0 + model.c[0] * L0 + model.d_floor + model.overhead[0])
    assert info["episode_cost_ms"] == pytest.approx(float(want_k0), rel=1e-9)
    res = oracle.solve(arr, model)
    np.testing.assert_allclose(res.ar[0], want_ar, rtol=1e-9)  # the oracle's reference is the plain engine too
    assert np.all(res.cost <= res.ar * 10) and np.all(res.cost > 0)


def test_clocks_that_disagree_are_refused(tmp_path: Path) -> None:
    ts = TraceSet.load(recorded(tmp_path))
    r = ts.rounds.copy()
    r.loc[r["K"] == 2, "T_step_ms"] = r.loc[r["K"] == 2, "T_T_wall_ms"] * 0.5
    with pytest.raises(ValueError, match=r"T_step_ms: at K=2"):
        step_overhead(r, KMAX)


def test_sets_without_step_times_keep_the_forward_model(small_set: TraceSet) -> None:
    assert not has_step_times(small_set.rounds, small_set.manifest.extra)
    model = fresh_fit(small_set)
    assert model.source["kind"] == "fit" and model.ar_step is None and not model.overhead.any()
    doc = model.to_json()
    assert "ar_step" not in doc and all("overhead" not in row for row in doc["target"].values())


def test_json_round_trip_keeps_both_terms(tmp_path: Path) -> None:
    ts = TraceSet.load(recorded(tmp_path))
    model = fresh_fit(ts)
    back = CostModel.from_json(json.loads(json.dumps(model.to_json())))
    np.testing.assert_array_equal(back.overhead, model.overhead)
    assert back.ar_step == model.ar_step
    bad = model.to_json()
    bad["ar_step"] = {"a": -1.0, "c": 0.0}
    with pytest.raises(ValueError, match="ar_step"):
        CostModel.from_json(bad, "m.json")


def test_ablations_remove_one_term_each(tmp_path: Path) -> None:
    ts = TraceSet.load(recorded(tmp_path))
    r = ts.rounds
    extra = ts.manifest.extra["ar_reference"]
    model = fit_step_model(r, KMAX, ts.facts.top_k, extra)
    no_u = ablate(model, r, "U_r")
    assert not no_u.alpha.any()
    for k in range(1, KMAX + 1):  # the mean cost at each budget is kept
        sel = r[r["K"] == k]
        full = model.charged_ms(k, sel["U_r"].to_numpy(), sel["L"].to_numpy()).mean()
        flat = no_u.charged_ms(k, sel["U_r"].to_numpy(), sel["L"].to_numpy()).mean()
        assert flat == pytest.approx(full, rel=1e-6)  # U_r is stored as float32
    no_over = ablate(model, r, "overhead")
    assert not no_over.overhead.any()
    assert float(model.charged_ms(3, 10.0, 100.0) - no_over.charged_ms(3, 10.0, 100.0)) == pytest.approx(
        overhead_of(3), abs=1e-5
    )
    with pytest.raises(ValueError, match="without"):
        ablate(model, r, "draft")


@pytest.mark.parametrize("variant", ["paper", "floor", "overhead", "plain step"])
def test_round_units_is_the_array_charge_in_scalars(variant: str) -> None:
    """``CostModel.round_units`` (the controller's per-round price) equals charged_ms / ar_ms bit for bit."""
    m = CostModel.paper_profile(kmax=6)
    if variant == "floor":
        m.d_floor = 1.26
    if variant == "overhead":
        m.overhead = 3.0 + 0.25 * np.arange(m.kmax + 1, dtype=np.float64)
    if variant == "plain step":
        m.overhead = 3.0 + 0.25 * np.arange(m.kmax + 1, dtype=np.float64)
        m.ar_step = (A_MS, C_MS)
    pricer = m.pricer()
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(0, m.kmax + 1))
        drafted = max(k, int(rng.integers(0, m.kmax + 1)) if rng.random() < 0.5 else 0)
        U = float(rng.uniform(4, 64))
        L = int(rng.integers(1, 4096))
        want = float(m.charged_ms(k, U, L, drafted=drafted) / m.ar_ms(L))
        assert m.round_units(k, U, L, drafted) == want
        assert pricer(k, U, L, drafted) == want  # the controller's snapshot in Python floats
    # each variant's term is priced: a k = 0 round differs from the paper profile's (1.0 there: the AR step)
    u0 = float(m.top_k)
    base = CostModel.paper_profile(kmax=6).round_units(0, u0, 100, 0)
    assert base == pytest.approx(1.0)
    if variant != "paper":
        assert m.round_units(0, u0, 100, 0) != pytest.approx(base)
