"""The batch model's odd-query term and its pooled union predictor, on hand-built inputs.

Every expectation is computed here from the formulas written out in the test (not from the code under
test): counts of odd queries by hand, unions from the pooled formula, a synthetic recording whose steps
were generated with a known odd-query cost and a known pool.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from policies.batch.goodput import BatchGoodput
from specenv.cost.batch import BatchCostModel, odd_queries, union_pooled
from specenv.cost.batchfit import STEPS_FORMAT, check_steps, fit_batch_cost
from specenv.observation.single import ObservationSpec

FACTS = {"n_layers": 6, "n_experts": 64, "top_k": 4}
TRUE = {"b0": 3.0, "b_pos": 0.4, "alpha": 0.9, "c": 0.002, "b_odd": 1.5, "d0": 1.0, "d_step": 0.6, "d_tok": 0.1}
POOL, THETA = 30.0, 0.6


def _linear(**extra) -> BatchCostModel:
    return BatchCostModel.linear(
        b0=2.0, b_pos=0.5, alpha=1.0, c=0.001, b_req=0.25, d0=1.0, d_step=0.5, d_tok=0.1,
        kmax=8, max_batch=8, top_k=4, n_experts=64, n_layers=6, **extra,
    )  # fmt: skip


def test_odd_queries_counts_even_budgets_of_two_or_more() -> None:
    # k + 1 verified positions: odd and longer than one token for k = 2, 4, 6, 8 only
    assert odd_queries([0, 1, 2, 3, 4, 5, 6, 7, 8]) == 4
    assert odd_queries([0, 0, 1]) == 0
    np.testing.assert_array_equal(odd_queries(np.array([[2, 2, 3], [1, 0, 8], [4, 6, 0]])), [2, 1, 2])


def test_verify_charges_each_odd_query_once() -> None:
    plain, odd = _linear(), _linear(b_odd_query=1.5)
    u, L = np.array([9.0, 11.0]), np.array([100.0, 200.0])
    for k, n_odd in (([1, 3], 0), ([2, 3], 1), ([4, 6], 2), ([0, 8], 1)):
        assert odd.verify_ms(np.array(k), u, L) - plain.verify_ms(np.array(k), u, L) == pytest.approx(1.5 * n_odd)
    # the step time and the totals form agree with it; the AR step (every k = 0) pays none
    k = np.array([2, 4])
    assert odd.step_ms(k, np.array([4, 4]), u, L) - plain.step_ms(k, np.array([4, 4]), u, L) == pytest.approx(3.0)
    assert odd.ar_ms(L) == plain.ar_ms(L)
    assert float(odd.verify_from_totals(8, 2, 20.0, 300.0, 2)) - float(
        plain.verify_from_totals(8, 2, 20.0, 300.0)
    ) == pytest.approx(3.0)


def test_pooled_union_by_hand() -> None:
    # two requests of 10 and 6 experts from a pool of 30: 30 (1 - (1 - 10/30) (1 - 6/30)^0.6)
    want = 30.0 * (1.0 - (1.0 - 10.0 / 30.0) * (1.0 - 6.0 / 30.0) ** 0.6)
    assert float(union_pooled(np.array([6.0, 10.0]), 30.0, 0.6)) == pytest.approx(want, rel=1e-12)
    # a request larger than the pool is never priced below its own experts; one request is its own union
    assert float(union_pooled(np.array([40.0, 5.0]), 30.0, 0.6)) == 40.0
    assert float(union_pooled(np.array([12.0]), 30.0, 0.6)) == pytest.approx(12.0)
    # many steps at once, absent requests (0) add nothing
    got = union_pooled(np.array([[10.0, 0.0, 0.0], [10.0, 6.0, 0.0]]), 30.0, 0.6)
    np.testing.assert_allclose(got, [10.0, want], rtol=1e-12)
    m = _linear().replace(predictor="pooled", u_theta=0.6, u_pool=30.0)
    assert m.predict_u_batch(np.array([6.0, 10.0])) == pytest.approx(want, rel=1e-12)


def test_model_json_round_trip_and_refusals(tmp_path) -> None:
    m = _linear(b_odd_query=1.25).replace(predictor="pooled", u_theta=0.5, u_pool=33.5)
    back = BatchCostModel.load(m.save(tmp_path / "bc.json"))
    assert (back.b_odd_query, back.predictor, back.u_theta, back.u_pool) == (1.25, "pooled", 0.5, 33.5)
    assert "b_odd_query" not in _linear().to_json()["verify"]  # a linear-form model's file is as before
    assert "u_pool" not in _linear().to_json()["u_batch"]
    with pytest.raises(ValueError, match="b_odd_query"):
        _linear(b_odd_query=-0.1)
    for pool in (3.0, 65.0):  # below top_k, above the experts per layer
        with pytest.raises(ValueError, match="u_pool"):
            _linear().replace(u_pool=pool)
    obj = m.to_json()
    obj["verify"]["b_odd_query"] = -1.0
    with pytest.raises(ValueError, match=r"bc\.json.*b_odd_query"):
        BatchCostModel.from_json(obj, "bc.json")
    obj = m.to_json()
    obj["u_batch"]["u_pool"] = 99.0
    with pytest.raises(ValueError, match=r"bc\.json.*u_pool"):
        BatchCostModel.from_json(obj, "bc.json")


def _recording(seed: int = 0, groups: int = 40) -> tuple[pd.DataFrame, dict]:
    """Steps generated with a known odd-query cost and a pooled union (pool 30 of 64, theta 0.6)."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        B0 = int(rng.integers(1, 9))
        L = rng.integers(50, 400, size=B0)
        fixed = g % 2 == 0  # half the groups serve one k for every request (as a fixed-k arm does)
        k_fixed = int(rng.integers(1, 9))
        for step in range(25):
            B = max(1, B0 - step // 10)
            k = np.full(B, k_fixed) if fixed else rng.integers(0, 9, size=B)
            U = np.clip(4 * (k + 1) ** 0.62 * rng.uniform(0.9, 1.1, size=B), 4, 26)
            U[k == 0] = 4.0
            top = U.max()
            rest = np.sum(np.log1p(-U / POOL)) - math.log1p(-top / POOL)
            ub = POOL * (1.0 - (1.0 - top / POOL) * math.exp(THETA * rest))
            ub = float(np.clip(ub + rng.normal(0, 0.3), top, min(64, U.sum())))
            n_odd = int(np.sum((k >= 2) & (k % 2 == 0)))
            P, sL, n = int(np.sum(k + 1)), int(L[:B].sum() + B * step), int(k.max())
            t = TRUE["b0"] + TRUE["b_pos"] * P + TRUE["alpha"] * ub + TRUE["c"] * sL + TRUE["b_odd"] * n_odd
            d = TRUE["d0"] + TRUE["d_step"] * n + TRUE["d_tok"] * n * B if n else 0.0
            t, d = t * rng.lognormal(0, 0.02), d * rng.lognormal(0, 0.02)
            rows.append(
                {
                    "run": "syn", "batch": B0, "group": g, "step": step, "B": B, "positions": P, "context_sum": sL,
                    "U_batch": ub, "T_T_ms": t, "T_D_ms": d, "T_T_cpu_ms": t, "T_D_cpu_ms": d, "draft_calls": n,
                    "step_ms": t + d + 2.0, "drafted": n, "committed": B, "k": k.tolist(), "U": U.tolist(),
                    "L": (L[:B] + step).tolist(), "accepted": [0] * B, "U_batch_layer": [ub] * 6,
                }
            )  # fmt: skip
    manifest = {"format": STEPS_FORMAT, "name": "syn", "model": FACTS, "kmax": 8, "max_batch": 8}
    return pd.DataFrame(rows), manifest


def test_parity_form_and_pooled_union_are_recovered() -> None:
    steps, manifest = _recording()
    check_steps(steps, manifest)
    rep = fit_batch_cost(
        steps, manifest, timing="wall", verify_form="parity", predictors=("independent", "shared", "pooled")
    )
    m = rep.model
    assert m.b_odd_query == pytest.approx(TRUE["b_odd"], rel=0.1)
    assert m.beta0[9] - m.beta0[8] == pytest.approx(TRUE["b_pos"], rel=0.1)  # b_pos: the step per position
    assert float(m.alpha[0]) == pytest.approx(TRUE["alpha"], rel=0.1)
    assert (m.predictor, m.source["verify_form"]) == ("pooled", "parity")
    assert m.u_pool == pytest.approx(POOL, rel=0.1) and m.u_theta == pytest.approx(THETA, abs=0.1)
    forms = rep.forms.set_index("form")["oos_mape_pct"]
    assert forms["P + U_batch + sumL + (B-1) + odd"] < forms["P + U_batch + sumL + (B-1)"]
    pred = rep.predictors.set_index("predictor")["U_batch_mape_pct"]
    assert pred["pooled"] < pred["shared"] < pred["independent"]
    # the default fit keeps the linear form and the two older predictors (as every recording before)
    default = fit_batch_cost(steps, manifest, timing="wall").model
    assert default.b_odd_query == 0.0 and default.predictor in ("independent", "shared")
    assert "verify_form" not in default.source and "predictors" not in default.source
    with pytest.raises(ValueError, match="verify_form"):
        fit_batch_cost(steps, manifest, verify_form="quadratic")
    with pytest.raises(ValueError, match="predictors"):
        fit_batch_cost(steps, manifest, predictors=("exact",))


@pytest.mark.parametrize("pooled", [False, True])
def test_goodput_prices_candidates_as_the_model_does(pooled: bool) -> None:
    """BatchGoodput's own vectorised pricing equals BatchCostModel.step_ms for every candidate row."""
    m = _linear(b_odd_query=1.5)
    if pooled:
        m = m.replace(predictor="pooled", u_theta=0.6, u_pool=30.0)
    spec = ObservationSpec(8, 0, 128, 64)
    u_prior = np.minimum(64, 4 * (np.arange(9) + 1.0) ** 0.62)
    pol = BatchGoodput(spec, m, u_prior=u_prior)
    rng = np.random.default_rng(1)
    for B in (1, 3, 5):
        cand = rng.integers(0, 9, size=(12, B))
        gain = np.concatenate([np.ones((B, 1)), 1.0 + np.cumsum(rng.uniform(0.3, 0.9, size=(B, 8)), axis=1)], axis=1)
        ctx = 150.0 * B
        got = pol._goodput(cand, gain, ctx)
        for row, g in zip(cand, got, strict=True):
            top = max(int(row.max()), pol.min_draft_steps)
            step = m.verify_ms(row, pol.u_prior[row], np.full(B, ctx / B)) + m.draft_ms(np.full(B, top))
            tokens = sum(gain[i, row[i]] for i in range(B))
            assert g == pytest.approx(tokens / step, rel=1e-9)
    # one request: the tabulated path answers what the priced candidates' best is
    obs = np.zeros((1, spec.dim), dtype=np.float32)
    k1 = int(pol.act(obs)[0])
    cand = np.arange(9)[:, None]
    rho = np.clip(obs[:, pol.view.depth_slice].astype(np.float64), 0, 1)
    gain = np.concatenate([np.ones((1, 1)), 1.0 + np.cumsum(np.cumprod(rho, axis=1), axis=1)], axis=1)
    assert k1 == int(np.argmax(pol._goodput(cand, gain, 0.0)))


def test_on_the_shipped_wide_recording_both_terms_fit_better_out_of_sample() -> None:
    """live-vllm-wide-batch-v6 (shipped with the linear form): the odd-query term and the pooled union, GroupKFold."""
    from specenv.cost.batchfit import load_steps

    steps, manifest = load_steps("live-vllm-wide-batch-v6")
    linear = fit_batch_cost(steps, manifest, timing="step")
    both = fit_batch_cost(
        steps, manifest, timing="step", verify_form="parity", predictors=("independent", "shared", "pooled")
    )
    coef = both.coefficients.set_index("term")
    assert coef.loc["b_odd_query", "value"] > 0 and coef.loc["b_odd_query", "p"] < 1e-3
    forms = both.forms.set_index("form")["oos_mape_pct"]
    assert forms["P + U_batch + sumL + (B-1) + odd"] < 0.75 * forms["P + U_batch + sumL + (B-1)"]
    pred = both.predictors.set_index("predictor")["U_batch_mape_pct"]
    assert pred["pooled"] < pred["shared"] / 2
    assert both.model.predictor == "pooled" and both.model.top_k < both.model.u_pool < both.model.n_experts
    # what a user waits for, out of sample: the whole engine step
    assert both.summary["engine_step"]["oos_mape_pct"] < linear.summary["engine_step"]["oos_mape_pct"] - 1.0
