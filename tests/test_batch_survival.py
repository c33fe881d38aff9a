"""The learned-survival batch controller (policies/batch/learn.py: SurvivalGoodputBatch, train_batch_survival)."""

from __future__ import annotations

import numpy as np
import pytest

from policies.batch.controllers import FixedBatch
from policies.batch.learn import SurvivalGoodputBatch, train_batch_survival
from policies.bench.batch import _episodes
from specenv.cost.batch import BatchCostModel
from specenv.generator import generate_paper
from specenv.observation.batch import BatchObservationSpec
from specenv.observation.single import ObservationSpec
from specenv.traces.traceset import TraceSet


class _Known:
    """A 'fitted' survival model that returns fixed rows (one per request)."""

    def __init__(self, rows: np.ndarray):
        self.rows = np.asarray(rows, dtype=np.float64)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.rows[: len(x)]


def _linear_model(kmax: int) -> BatchCostModel:
    return BatchCostModel.linear(
        b0=10.0, b_pos=0.5, alpha=0.1, c=0.0, b_req=0.2, d0=0.1, d_step=0.3, d_tok=0.05,
        kmax=kmax, max_batch=4, top_k=8, n_experts=128, n_layers=4,
    )  # fmt: skip


def test_planner_speculates_only_where_the_drafts_survive():
    """A request whose drafts always survive gets a long budget, one whose drafts never survive gets 0."""
    K = 4
    spec = BatchObservationSpec(ObservationSpec(kmax=K), 2)
    pol = SurvivalGoodputBatch(spec, _linear_model(K), np.full(K + 1, 8.0), _Known([[1.0] * K, [0.0] * K]))
    k = pol.plan(pol.survival(np.zeros((2, spec.request.dim))), 1000.0)
    assert k[1] == 0 and k[0] == K
    # and the plan is at least as good as every common k (the planner's start)
    gain = np.array([[1.0 + j for j in range(K + 1)], [1.0] * (K + 1)])
    best = gain[[0, 1], k].sum() / pol.step_ms(k[None, :], 1000.0)[0]
    for c in range(K + 1):
        cand = np.array([[c, c]])
        assert best >= gain[[0, 1], [c, c]].sum() / pol.step_ms(cand, 1000.0)[0]


def test_block_mode_charges_the_drafted_horizon_for_every_request():
    K = 4
    spec = BatchObservationSpec(ObservationSpec(kmax=K, lookahead=3), 2)
    model = _linear_model(K)
    pol = SurvivalGoodputBatch(spec, model, np.full(K + 1, 8.0), _Known([[0.5] * K] * 2))
    assert pol.drafting == "block"
    cand = np.array([[0, 1]])
    want = model.step_ms(cand[0], np.array([3, 3]), np.full(2, 8.0), np.array([500.0, 500.0]))
    assert pol.step_ms(cand, 1000.0)[0] == pytest.approx(want, rel=1e-12)


@pytest.fixture(scope="module")
def two_kinds(tmp_path_factory: pytest.TempPathFactory):
    """A greedy set with two kinds of requests: every draft accepted (even ids) or none (odd ids).

    The test split (ids 4, 5, 8 of 16) holds both kinds. The right answer is known: k = kmax for the
    first kind, k = 0 for the second. No fixed k serves both; a request's kind shows in its acceptance
    history (the observation's acc_depth_*).
    """
    K = 4
    ts = generate_paper(16, kmax=K, seed=11, greedy=True, with_rounds=False, name="two-kinds")
    pos = ts.positions
    pos = pos[pos["t"] < 40].copy()  # short requests: a fast test
    good = (pos["generation_id"] % 2 == 0).to_numpy()
    for j in range(1, K + 1):
        pos[f"rho_{j}"] = np.where(good, 1.0, 0.0)
    path = tmp_path_factory.mktemp("traces") / "two-kinds"
    TraceSet(ts.manifest, positions=pos).save(path)
    return str(path)


@pytest.mark.slow
def test_learned_survival_beats_every_fixed_k_where_the_answer_is_known(two_kinds):
    from specenv.envs.batch import MoESpecBatchEnv

    surv = train_batch_survival(two_kinds, 2, iterations=2, episodes=4, cost_model="profile", seed=0)
    assert len(surv.history) == 2 and surv.history[-1]["mse"] < 0.1
    env = MoESpecBatchEnv(two_kinds, batch_size=2, split="test", cost_model="profile")
    seeds = list(range(6))

    def speedup(pol):
        res = _episodes(env, pol, seeds)
        return float(res["ar"].sum() / res["cost"].sum())

    fixed = [speedup(FixedBatch(env.spec_batch, k)) for k in range(env.kmax + 1)]
    learned = speedup(surv.policy)
    print(f"learned {learned:.3f}, fixed k 0..{env.kmax}: {np.round(fixed, 3).tolist()}")
    assert learned > max(fixed) * 1.02, (learned, fixed)


def test_cli_bench_batch_refuses_an_unknown_learner(tmp_path):
    from typer.testing import CliRunner

    from specenv.cli import app

    out = tmp_path / "x"
    res = CliRunner().invoke(
        app, ["bench", "live-vllm", "--batch", "2", "--learners", "survival,nope", "--out", str(out)]
    )
    assert res.exit_code == 2 and "--learners" in res.output
    assert not (out / "bench-batch2.json").exists()
