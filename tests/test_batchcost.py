"""The batch cost model (specenv/cost/batch.py): B = 1 consistency, monotonicity, U_batch predictors, JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specenv.cost.batch import PREDICTORS, BatchCostModel, BatchShape, load_batch_cost_model, union_independent
from specenv.cost.model import CostModel
from specenv.traces.schema import ModelFacts

PAPER = ModelFacts(n_layers=48, n_experts=128, top_k=8)


@pytest.fixture(scope="module")
def scaled() -> BatchCostModel:
    return BatchCostModel.from_cost_model(CostModel.paper_profile(), PAPER, max_batch=8)


def _linear(**kw) -> BatchCostModel:
    base = dict(
        b0=2.0, b_pos=0.3, alpha=0.05, c=0.001, b_req=0.4, d0=0.1, d_step=0.5, d_tok=0.05,
        kmax=4, max_batch=8, top_k=4, n_experts=64, n_layers=6,
    )  # fmt: skip
    return BatchCostModel.linear(**(base | kw))


def test_b1_is_the_single_request_model(scaled):
    cm = CostModel.paper_profile()
    rng = np.random.default_rng(0)
    for k in range(cm.kmax + 1):
        U = float(rng.uniform(8, min(128, 8 * (k + 1))))
        L = int(rng.integers(1, 4000))
        assert scaled.verify_ms([k], [U], [L]) == pytest.approx(float(cm.target_ms(k, U, L)), rel=1e-12)
        assert scaled.ar_ms(np.array([L])) == pytest.approx(float(cm.ar_ms(L)), rel=1e-12)
        if k:
            assert scaled.draft_ms([k]) == pytest.approx(float(cm.draft_ms(k)), rel=1e-12)
    assert scaled.draft_ms([0]) == 0.0


def test_step_is_draft_plus_verify(scaled):
    k, d, u, L = np.array([3, 0, 5]), np.array([5, 5, 5]), np.array([20.0, 8.0, 30.0]), np.array([100, 900, 40])
    assert scaled.step_ms(k, d, u, L) == pytest.approx(scaled.draft_ms(d) + scaled.verify_ms(k, u, L))
    # vLLM's drafter runs max(drafted) steps for the batch: one more request drafting adds only d_tok work
    assert scaled.draft_ms([5, 5, 5, 5]) - scaled.draft_ms([5, 5, 5]) == pytest.approx(5 * scaled.d_tok)


def test_monotone_in_union_positions_context_and_requests(scaled):
    L = np.array([300, 300, 300])
    u = np.array([20.0, 20.0, 20.0])
    base = scaled.verify_ms([2, 2, 2], u, L, u_batch=40.0)
    assert scaled.verify_ms([2, 2, 2], u, L, u_batch=50.0) > base
    assert scaled.verify_ms([2, 2, 3], u, L, u_batch=40.0) > base
    assert scaled.verify_ms([2, 2, 2], u, L + 10, u_batch=40.0) > base
    # same positions split over more requests: one more request overhead and its own context
    assert scaled.verify_ms([2, 2, 1, 0], np.r_[u, 8.0], np.r_[L, 1], u_batch=40.0) > base
    # beyond one request's kmax+1 positions the scaled table grows with every position
    P = np.arange(scaled.kmax + 1, scaled.max_positions + 1)
    assert np.all(np.diff(scaled.verify_from_totals(P, 2, 60.0, 1000.0)) > 0)
    lin = _linear()
    P = np.arange(1, lin.max_positions + 1)
    assert np.all(np.diff(lin.verify_from_totals(P, 1, 60.0, 1000.0)) > 0)


def test_bigger_batch_costs_more_but_less_than_separate_steps(scaled):
    L = np.full(8, 500)
    measured = load_batch_cost_model()
    ar = [measured.ar_ms(L[:b]) for b in range(1, 9)]
    assert np.all(np.diff(ar) > 0)
    assert ar[-1] < 8 * ar[0]  # the point of batching: shared weights, shared experts
    # the scaled paper profile inherits Table A4's per-K shape (beta0 drops and alpha triples at m = 5, so
    # a step of 5 positions can cost less than one of 4): not monotone in B below kmax+1, but still cheaper
    # than separate steps
    ar = [scaled.ar_ms(L[:b]) for b in range(1, 9)]
    assert all(ar[b - 1] < b * ar[0] for b in range(2, 9))


@pytest.mark.parametrize("predictor", PREDICTORS)
def test_predictor_bounds(predictor):
    m = _linear(predictor=predictor, u_theta=0.5 if predictor == "shared" else 1.0)
    rng = np.random.default_rng(1)
    for _ in range(200):
        B = int(rng.integers(1, 9))
        u = rng.uniform(4, 20, size=B)
        ub = m.predict_u_batch(u)
        assert u.max() - 1e-9 <= ub <= min(64, u.sum()) + 1e-9
    assert m.predict_u_batch([12.0]) == pytest.approx(12.0)
    # saturation: many requests that each touch most experts cover (nearly) all of them
    assert m.predict_u_batch(np.full(8, 60.0)) == pytest.approx(64.0, abs=1e-3)


def test_independent_union_matches_simulation():
    rng = np.random.default_rng(2)
    n, sizes = 64, [6, 10, 17]
    sims = [len(set().union(*(rng.choice(n, s, replace=False) for s in sizes))) for _ in range(4000)]
    assert np.mean(sims) == pytest.approx(float(union_independent(np.array(sizes), n)), rel=0.01)


def test_shared_predictor_is_smaller_and_monotone_in_ratio():
    u = np.array([10.0, 12.0, 9.0, 15.0])
    preds = [_linear(predictor="shared", u_theta=r).predict_u_batch(u) for r in (0.3, 0.6, 1.0)]
    assert preds[0] < preds[1] < preds[2]
    assert preds[2] == pytest.approx(_linear().predict_u_batch(u))
    # n_experts override: a bigger pool means less overlap
    assert _linear().predict_u_batch(u, n_experts=128) > _linear().predict_u_batch(u)


def test_batch_input_errors(scaled):
    with pytest.raises(ValueError, match="max_batch=8"):
        scaled.verify_ms(np.zeros(9, int), np.full(9, 8.0), np.full(9, 10))
    with pytest.raises(ValueError, match="kmax=10"):
        scaled.verify_ms([11], [8.0], [10])
    with pytest.raises(ValueError, match="one entry per request"):
        scaled.verify_ms([1, 2], [8.0], [10, 10])
    with pytest.raises(ValueError, match="non-empty"):
        scaled.ar_ms(np.array([]))


def test_json_round_trip(tmp_path, scaled):
    m = scaled.replace(predictor="shared", u_theta=0.7, diagnostics={"note": "x"})
    path = m.save(tmp_path / "batch.json")
    back = BatchCostModel.load(path)
    assert back.to_json() == m.to_json()
    args = (np.array([1, 4, 0]), np.array([12.0, 30.0, 8.0]), np.array([10, 2000, 77]))
    assert back.verify_ms(*args) == m.verify_ms(*args)
    assert back.predict_u_batch(args[1]) == m.predict_u_batch(args[1])


def _hostile(m: BatchCostModel) -> list[tuple[str, dict]]:
    good = m.to_json()

    def edit(fn) -> dict:
        obj = json.loads(json.dumps(good))
        fn(obj)
        return obj

    return [
        ("format", edit(lambda o: o.update(format="specenv.costmodel/1"))),
        ("beta0", edit(lambda o: o["verify"]["beta0"].pop())),
        ("verify", edit(lambda o: o["verify"].update(beta0=[-1e6] * len(o["verify"]["beta0"])))),
        ("b_req", edit(lambda o: o["verify"].update(b_req="1"))),
        ("draft", edit(lambda o: o["draft"].update(d0=-100.0))),
        ("predictor", edit(lambda o: o["u_batch"].update(predictor="magic"))),
        ("u_theta", edit(lambda o: o["u_batch"].update(u_theta=1.5))),
        ("max_batch", edit(lambda o: o.update(max_batch=True))),
        ("top_k", edit(lambda o: o["model"].update(top_k=1000))),
        ("unknown", edit(lambda o: o.update(extra_field=1))),
    ]


def test_hostile_json_is_one_line(tmp_path, scaled):
    for what, obj in _hostile(scaled):
        path = tmp_path / f"{what}.json"
        path.write_text(json.dumps(obj))
        with pytest.raises(ValueError) as err:
            BatchCostModel.load(path)
        msg = str(err.value)
        assert "\n" not in msg and str(path) in msg, what
    (tmp_path / "nan.json").write_text(json.dumps(scaled.to_json()).replace('"b_req": ', '"b_req": NaN, "x": ', 1))
    with pytest.raises(ValueError, match="nan.json"):
        BatchCostModel.load(tmp_path / "nan.json")
    with pytest.raises(ValueError, match="no such file"):
        BatchCostModel.load(tmp_path / "missing.json")


def test_shape_round_trip_through_scaling():
    """The factors measured from a model, applied to a B = 1 model, reproduce the model's own ratios."""
    measured = _linear(predictor="shared", u_theta=0.6)
    shape = BatchShape.of_model(measured, context_ref=300.0)
    ar = measured.ar_ms(np.array([300.0]))
    assert shape.pos_rel * ar == pytest.approx(0.3)
    assert shape.req_rel * ar == pytest.approx(0.4)
    assert shape.tok_share == pytest.approx(0.05 / 0.55)
    cm = CostModel.paper_profile()
    scaled = BatchCostModel.from_cost_model(cm, PAPER, shape=shape, max_batch=4, context_ref=300.0)
    assert scaled.b_req / float(cm.ar_ms(300.0)) == pytest.approx(shape.req_rel)
    assert scaled.predictor == "shared" and scaled.u_theta == 0.6
    step = scaled.beta0[cm.kmax + 2] - scaled.beta0[cm.kmax + 1]
    assert step / float(cm.ar_ms(300.0)) == pytest.approx(shape.pos_rel)


@pytest.mark.parametrize("name", ["paper-default", "live-cpu", "live-vllm"])
def test_every_shipped_set_can_be_priced(name):
    from specenv.cost.source import cost_model_for
    from specenv.traces.datasets import load_dataset

    ts = load_dataset(name)
    cm = cost_model_for(ts, "fit-train")
    m = BatchCostModel.from_cost_model(cm, ts.facts, max_batch=16)
    back = BatchCostModel.from_json(m.to_json(), name)  # the validator's positivity check over the whole domain
    assert back.max_positions == 16 * (cm.kmax + 1)
    L = np.full(16, 300)
    assert back.verify_ms([2], [float(ts.facts.top_k) * 2], [300]) == pytest.approx(
        float(cm.target_ms(2, ts.facts.top_k * 2, 300))
    )
    assert back.ar_ms(L[:1]) < back.ar_ms(L) < 16 * back.ar_ms(L[:1])
