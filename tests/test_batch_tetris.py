"""policies.batch.tetris: the compiled search gives the reference loop's budgets, bit for bit, and is used.

The reference (:func:`policies.batch.tetris.reference`) is the greedy loop as TETRIS states it; its
own properties (joint optimum, stopping rule) are tested in tests/test_batch_controllers.py. Here
the claim is equality on many random steps (two batch cost models, U priors with ties, near-equal
survival estimates that make near-ties) and that the equality is not the fallback's: the
compiled path decides without calling the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from policies.batch import tetris
from policies.batch.controllers import TetrisBatch
from specenv.cost.batch import BatchCostModel, load_batch_cost_model
from specenv.observation.batch import BatchObservationSpec
from specenv.observation.single import ObservationSpec

pytest.importorskip("numba")  # a declared dependency; the compiled path is what is under test


def _models() -> list[BatchCostModel]:
    kw = dict(b0=3.0, b_pos=0.05, alpha=0.02, c=1e-4, b_req=0.1, d0=0.5, d_step=0.2, d_tok=0.01)
    kw |= dict(kmax=10, max_batch=64, top_k=8, n_experts=64, n_layers=4)
    shared = BatchCostModel.linear(**kw, predictor="shared", u_theta=0.7)
    return [load_batch_cost_model(), BatchCostModel.linear(**kw), shared]


def _case(rng, model: BatchCostModel, n: int, h: int):
    spec = BatchObservationSpec(ObservationSpec(model.kmax, h, 4096, model.n_experts), n)
    u_prior = np.sort(rng.uniform(model.top_k, model.n_experts * 0.6, size=model.kmax + 1))
    if rng.random() < 0.3:
        u_prior[2:5] = u_prior[2]  # ties in U
    conf = rng.uniform(0.2, 1.0, size=(n, h))
    if rng.random() < 0.3:
        conf[:] = conf[0]  # identical requests: exact ties between candidates
    surv = np.cumprod(conf, axis=1)
    ctx = rng.integers(16, 3000, size=n).astype(np.float64)
    return TetrisBatch(spec, model, u_prior), surv, ctx


@pytest.mark.parametrize("which", [0, 1, 2], ids=["shipped-fit", "linear-independent", "linear-shared"])
def test_select_is_the_reference_bit_for_bit_without_falling_back(which, monkeypatch):
    model = _models()[which]
    rng = np.random.default_rng(7 + which)
    calls, segments = [], []
    original, kernel = tetris.reference, tetris._kernel()
    monkeypatch.setattr(tetris, "reference", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(tetris, "_kernel", lambda: lambda *a: segments.append(1) or kernel(*a))
    picked = 0
    for _ in range(60):
        n = int(rng.integers(1, model.max_batch + 1))
        h = int(rng.integers(1, model.kmax + 1))
        pol, surv, ctx = _case(rng, model, n, h)
        drafted = np.full(n, h, dtype=np.int64)
        got = tetris.select(surv, h, drafted, ctx, pol.step_ms_many, model, pol.u_prior)
        want = original(surv, h, drafted, ctx, pol.step_ms_many)
        np.testing.assert_array_equal(got, want)
        picked += int(want.sum())
    assert calls == [], f"the reference ran {len(calls)} times: the compiled path fell back"
    assert picked > 100  # the steps verify drafted tokens: decisions were made, not only stops


def test_exact_ties_of_identical_requests_are_broken_as_the_reference_breaks_them(monkeypatch):
    """Identical requests tie up to rounding: the reference's exact prices break the tie by the last bits of
    its sums, the compiled search (approximate prices) may pick another; that decision is overturned and the
    search resumes from the reference's pick (a second segment), so the budgets stay the reference's."""
    segments, kernel, selects = [], tetris._kernel(), 0
    monkeypatch.setattr(tetris, "_kernel", lambda: lambda *a: segments.append(1) or kernel(*a))
    rng = np.random.default_rng(11)
    for model in _models():
        for _ in range(15):
            n, h = int(rng.integers(8, model.max_batch + 1)), int(rng.integers(2, model.kmax + 1))
            pol, surv, ctx = _case(rng, model, n, h)
            surv[:] = surv[0]
            drafted = np.full(n, h, dtype=np.int64)
            got = tetris.select(surv, h, drafted, ctx, pol.step_ms_many, model, pol.u_prior)
            np.testing.assert_array_equal(got, tetris.reference(surv, h, drafted, ctx, pol.step_ms_many))
            selects += 1
    assert len(segments) > selects  # at least one decision was overturned and resumed


def test_a_count_covering_every_expert_falls_back_to_the_reference(monkeypatch):
    model = _models()[1]
    rng = np.random.default_rng(3)
    pol, surv, ctx = _case(rng, model, 8, 4)
    pol.u_prior[3] = model.n_experts  # log1p(-1) = -inf: no O(1) update
    drafted = np.full(8, 4, dtype=np.int64)
    calls = []
    original = tetris.reference
    monkeypatch.setattr(tetris, "reference", lambda *a: calls.append(1) or original(*a))
    got = tetris.select(surv, 4, drafted, ctx, pol.step_ms_many, model, pol.u_prior)
    np.testing.assert_array_equal(got, original(surv, 4, drafted, ctx, pol.step_ms_many))
    assert calls == [1]
