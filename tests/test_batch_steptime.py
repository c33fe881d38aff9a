"""The batch step-time model: the engine's per-step overhead by batch size, the plain engine's batch step,
and the A/B's prediction of a group of B requests replayed in lockstep (no engines).

Every expectation is computed here from the hand-built inputs (a recording with known overheads, a plain
engine with a known line, a greedy set whose rounds at fixed k are walked by hand).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from specenv.abtest import predict_batch, replay_policy
from specenv.cost.batch import BatchCostModel, ablate_batch
from specenv.cost.batchfit import fit_batch_cost, fit_prefill, summarize_plain_batch
from specenv.traces.datasets import load_dataset
from specenv.traces.splits import select_split
from tests.test_batchfit import FACTS, _synthetic
from tests.test_steptime import KMAX, recorded

A, B_REQ, C = 9.0, 1.25, 0.002  # the plain engine's step: a + b_req (B-1) + c sum L


def _overhead(B: np.ndarray) -> np.ndarray:
    return 2.0 + 0.5 * (np.asarray(B, dtype=np.float64) - 1.0) ** 1.2


def _plain_rows(noise: bool = False) -> pd.DataFrame:
    rng = np.random.default_rng(3)
    rows = []
    for B in (1, 2, 4, 8):
        for s in range(30):
            sL = int(B * (100 + s))
            y = A + B_REQ * (B - 1) + C * sL
            rows.append({"B": B, "context_sum": sL, "engine_step_ms": y * (rng.lognormal(0, 0.02) if noise else 1.0)})
    return pd.DataFrame(rows)


def _recording() -> tuple[pd.DataFrame, dict]:
    steps, manifest = _synthetic(theta=0.5)
    steps = steps.copy()
    steps["engine_step_ms"] = steps["T_T_ms"] + steps["T_D_ms"] + _overhead(steps["B"])
    manifest = dict(manifest)
    manifest["extra"] = dict(manifest.get("extra", {})) | {"ar_reference": summarize_plain_batch(_plain_rows())}
    return steps, manifest


def test_plain_line_is_recovered_and_a_negative_slope_is_zero() -> None:
    ref = summarize_plain_batch(_plain_rows())
    assert ref["a_ms"] == pytest.approx(A, rel=1e-9)
    assert ref["b_req_ms"] == pytest.approx(B_REQ, rel=1e-9)
    assert ref["c_ms_per_token"] == pytest.approx(C, rel=1e-9)
    assert [p["B"] for p in ref["per_batch"]] == [1, 2, 4, 8] and ref["steps"] == 120
    # a plain step that gets cheaper with more requests: noise, the slope is fixed at 0 (as the B = 1 reference)
    falling = pd.DataFrame({"B": [1, 2, 3, 4] * 5, "context_sum": [100] * 20, "engine_step_ms": [10, 9.5, 9, 8.5] * 5})
    assert summarize_plain_batch(falling)["b_req_ms"] == 0.0
    with pytest.raises(ValueError, match="too few"):
        summarize_plain_batch(falling.head(2))


def test_plain_step_by_batch_is_the_measured_mean_at_recorded_sizes(tmp_path: Path) -> None:
    """A plain step the form cannot bend to: each recorded B is charged its measured mean, others in between."""
    from specenv.cost.batchfit import plain_residual_by_batch

    # per B a known bump on top of the line: +3 ms at B = 1, 0 at 2, -2 at 4, +1 at 8 (the line fits through them)
    bump = {1: 3.0, 2: 0.0, 4: -2.0, 8: 1.0}
    rows = _plain_rows()
    rows["engine_step_ms"] = rows["engine_step_ms"] + rows["B"].map(bump)
    ref = summarize_plain_batch(rows)
    by = plain_residual_by_batch(ref, 10)
    assert by is not None and by.shape == (10,)
    kw = dict(b0=2.0, b_pos=0.1, alpha=0.3, c=0.001, b_req=0.2, d0=0.5, d_step=1.0, d_tok=0.1)
    kw |= dict(kmax=4, max_batch=10, top_k=4, n_experts=64, n_layers=6, predictor="independent")
    ar = (ref["a_ms"], ref["b_req_ms"], ref["c_ms_per_token"])
    m = BatchCostModel.linear(**kw, ar_step=ar, ar_by_batch=by)
    form = BatchCostModel.linear(**kw, ar_step=ar)
    for b, t in rows.groupby("B"):  # at a recorded B: the measured mean, at that B's mean context
        ctx = np.full(int(b), t["context_sum"].mean() / int(b))
        assert m.ar_ms(ctx) == pytest.approx(t["engine_step_ms"].mean(), rel=1e-9)
    # between recorded sizes the residual is linear in B (B = 3: halfway between B = 2 and 4), the nearest beyond
    ctx3 = np.full(3, 150.0)
    assert m.ar_ms(ctx3) - form.ar_ms(ctx3) == pytest.approx(0.5 * (by[1] + by[3]), rel=1e-9)
    assert by[9] == pytest.approx(by[7], rel=1e-12) and by[8] == pytest.approx(by[7], rel=1e-12)
    # the form alone misses the bumps: at B = 1 it is below the measured mean by more than 1 ms
    t1 = rows[rows["B"] == 1]
    assert form.ar_ms(np.full(1, t1["context_sum"].mean())) < t1["engine_step_ms"].mean() - 1.0
    # JSON round trip keeps it; a file whose correction has the wrong length is refused naming the file
    back = BatchCostModel.from_json(json.loads(json.dumps(m.to_json())))
    np.testing.assert_array_equal(back.ar_by_batch, m.ar_by_batch)
    bad = m.to_json()
    bad["ar_step"]["by_batch_ms"] = bad["ar_step"]["by_batch_ms"][:3]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"bad\.json: ar_by_batch: expected 10 finite values"):
        BatchCostModel.load(path)
    with pytest.raises(ValueError, match="plain step at B=1 would be"):
        BatchCostModel.linear(**kw, ar_step=ar, ar_by_batch=np.full(10, -1e3))
    with pytest.raises(ValueError, match="needs ar_step"):
        BatchCostModel.linear(**kw, ar_by_batch=by)
    # a manifest whose rows lack the form at each B (before v4) gives no correction
    assert plain_residual_by_batch({"per_batch": [{"B": 1, "mean_ms": 9.0}]}, 4) is None
    assert plain_residual_by_batch({}, 4) is None


U_MS = 0.8  # ms per expert of the plain step's expected union (the union form)


def _plain_union_rows() -> pd.DataFrame:
    """Plain steps on a + b_req (B-1) + c sumL + u (n (1 - (1 - k/n)^B) - k), n = 64, k = 4 (written out here)."""
    rows = []
    for B in (1, 2, 3, 4, 6, 8, 12, 16):
        union = 64.0 * (1.0 - (1.0 - 4.0 / 64.0) ** B)
        for s in range(20):
            sL = int(B * (100 + 7 * s))
            rows.append(
                {"B": B, "context_sum": sL, "engine_step_ms": A + 0.3 * (B - 1) + C * sL + U_MS * (union - 4.0)}
            )
    return pd.DataFrame(rows)


def test_plain_union_form_is_recovered_and_priced() -> None:
    rows = _plain_union_rows()
    ref = summarize_plain_batch(rows, n_experts=64, top_k=4)
    got = (ref["a_ms"], ref["b_req_ms"], ref["c_ms_per_token"], ref["u_ms_per_expert"])
    assert got == pytest.approx((A, 0.3, C, U_MS), rel=1e-7)
    assert ref["r2"] == pytest.approx(1.0) and "U_ind" in ref["form"]
    for row in ref["per_batch"]:  # the fitted form at each B's mean is that B's mean (an exact fit)
        assert row["model_ms"] == pytest.approx(row["mean_ms"], rel=1e-9)
    # the straight line misses the concave steps: its B = 1 step is above the true a, its B = 8 step below
    line = summarize_plain_batch(rows)
    assert "u_ms_per_expert" not in line and line["a_ms"] > A + 0.5
    per = {r["B"]: r for r in line["per_batch"]}
    assert per[8]["model_ms"] < per[8]["mean_ms"] - 0.5
    # the model prices it: B contexts, the expected union of B single tokens
    kw = dict(b0=2.0, b_pos=0.1, alpha=0.3, c=0.001, b_req=0.2, d0=0.5, d_step=1.0, d_tok=0.1)
    kw |= dict(kmax=4, max_batch=16, top_k=4, n_experts=64, n_layers=6, predictor="independent")
    m = BatchCostModel.linear(**kw, ar_step=got)
    ctx = np.array([120.0, 250.0, 90.0, 40.0, 300.0, 10.0])
    union6 = 64.0 * (1.0 - (60.0 / 64.0) ** 6)
    want = A + 0.3 * 5 + C * ctx.sum() + U_MS * (union6 - 4.0)
    assert m.ar_ms(ctx) == pytest.approx(want, rel=1e-7)
    assert m.ar_ms(ctx[:1]) == pytest.approx(A + C * 120.0, rel=1e-7)  # no union term at B = 1
    back = BatchCostModel.from_json(json.loads(json.dumps(m.to_json())))
    assert back.ar_step == m.ar_step and back.to_json()["ar_step"]["u_ms_per_expert"] == pytest.approx(U_MS)
    with pytest.raises(ValueError, match="ar_step"):
        BatchCostModel.linear(**kw, ar_step=(A, 0.3, C, -1.0))
    with pytest.raises(ValueError, match="ar_step"):
        BatchCostModel.linear(**kw, ar_step=(A, 0.3))


def test_step_fit_has_the_overhead_by_batch_size_and_the_plain_reference() -> None:
    steps, manifest = _recording()
    rep = fit_batch_cost(steps, manifest, timing="step")
    m = rep.model
    seen = sorted(set(steps["B"]))
    np.testing.assert_allclose(m.overhead[np.array(seen) - 1], _overhead(np.array(seen)), rtol=1e-9)
    assert m.ar_step == pytest.approx((A, B_REQ, C, 0.0), rel=1e-9)  # no union term in this reference
    ctx = np.array([120.0, 250.0, 90.0])
    assert m.ar_ms(ctx) == pytest.approx(A + B_REQ * 2 + C * ctx.sum(), rel=1e-9)
    # the overhead is a term of every verification: the step-time model is the wall model plus it, by B
    wall = fit_batch_cost(steps, manifest, timing="wall").model
    k, u, L = np.array([3, 0, 5]), np.array([9.0, 4.0, 12.0]), np.array([120.0, 300.0, 80.0])
    want = wall.verify_ms(k, u, L) + _overhead(3)
    assert m.verify_ms(k, u, L) == pytest.approx(want, rel=1e-9)
    # out of sample the whole engine step is predicted better with the overhead than without it
    eng = rep.summary["engine_step"]
    assert eng["oos_mape_pct"] < eng["oos_mape_pct_without_overhead"]
    # the JSON round trip keeps both terms
    back = BatchCostModel.from_json(json.loads(json.dumps(m.to_json())))
    np.testing.assert_array_equal(back.overhead, m.overhead)
    assert back.ar_step == m.ar_step


def test_step_fit_refuses_a_recording_without_what_it_needs() -> None:
    steps, manifest = _recording()
    with pytest.raises(ValueError, match="engine_step_ms"):
        fit_batch_cost(steps.drop(columns=["engine_step_ms"]), manifest, timing="step")
    bare = dict(manifest) | {"extra": {}}
    with pytest.raises(ValueError, match="ar_reference"):
        fit_batch_cost(steps, bare, timing="step")
    bad = steps.copy()
    bad["engine_step_ms"] = bad["T_T_ms"]  # shorter than its forwards: the clocks disagree
    with pytest.raises(ValueError, match="clocks disagree"):
        fit_batch_cost(bad, manifest, timing="step")


def test_model_checks_and_ablations() -> None:
    kw = dict(b0=2.0, b_pos=0.1, alpha=0.3, c=0.001, b_req=0.2, d0=0.5, d_step=1.0, d_tok=0.1)
    kw |= dict(kmax=4, max_batch=4, top_k=4, n_experts=64, n_layers=6, predictor="independent")
    with pytest.raises(ValueError, match="overhead"):
        BatchCostModel.linear(**kw, overhead=np.ones(3))
    with pytest.raises(ValueError, match="ar_step"):
        BatchCostModel.linear(**kw, ar_step=(0.0, 1.0, 0.0))
    m = BatchCostModel.linear(**kw, overhead=np.array([1.0, 2.0, 3.0, 4.0]), ar_step=(8.0, 1.0, 0.0))
    m = m.replace(diagnostics={"summary": {"U_batch_mean": 20.0}})
    k, L = np.array([2, 1]), np.array([100.0, 50.0])
    no_over = ablate_batch(m, "overhead")
    assert m.verify_ms(k, np.array([8.0, 6.0]), L, u_batch=13.0) - no_over.verify_ms(
        k, np.array([8.0, 6.0]), L, u_batch=13.0
    ) == pytest.approx(2.0)
    no_u = ablate_batch(m, "U_r")
    # at the recording's mean union the step costs the same; the union no longer matters
    assert no_u.verify_ms(k, np.array([8.0, 6.0]), L, u_batch=20.0) == pytest.approx(
        m.verify_ms(k, np.array([8.0, 6.0]), L, u_batch=20.0)
    )
    assert no_u.verify_ms(k, np.array([8.0, 6.0]), L, u_batch=5.0) == no_u.verify_ms(
        k, np.array([8.0, 6.0]), L, u_batch=40.0
    )
    assert no_u.ar_ms(L) == m.ar_ms(L) == 9.0 + 0.0  # the plain reference is kept
    with pytest.raises(ValueError, match="term"):
        ablate_batch(m, "c")
    # a JSON file with a bad overhead is one line naming the field
    doc = m.to_json()
    doc["overhead"] = [1.0, 2.0]
    with pytest.raises(ValueError, match="overhead"):
        BatchCostModel.from_json(doc, "bc.json")


def _hand_lockstep(
    arr,
    gids: list[int],
    k_of,
    bm: BatchCostModel,
    batch: int,
    max_tokens: int,
    drafted_of=None,
    tpot: bool = False,
    horizon: bool = False,
) -> float:
    """Fixed k on a greedy set, walked here from the tables: rounds, lockstep steps, the plain engine's steps.

    ``k_of``: the k of every request of a step, an int or a function of the step's number of requests.
    ``drafted_of``: the tokens drafted in a step of n requests (default: its k).
    ``tpot``: return the mean over requests of plain's time per output token over the mean of the arm's
    (each request's clock running over the steps it is in), instead of the groups' decoding times' ratio.
    ``horizon``: the controller's drafting for a ``k_of`` that reads only the number of requests: a step drafts
    the previous step's k (asked before a request of it ended; a group's first step: its own) and verifies at
    most that.
    """
    row_of = {int(g): i for i, g in enumerate(arr.generation_ids)}
    n_u = float(bm.n_experts)
    cost = ar = 0.0
    mine: dict[int, float] = {}  # each request's decoding time, the arm's
    plain: dict[int, float] = {}  # and the plain engine's
    for g0 in range(0, len(gids), batch):
        members = [row_of[g] for g in gids[g0 : g0 + batch]]
        t = {i: 0 for i in members}
        N = {i: int(arr.offsets[i + 1] - arr.offsets[i]) for i in members}
        stop = {i: min(N[i], max_tokens) for i in members}
        live = list(members)
        prev_k = None
        while live:
            k = k_of(len(live)) if callable(k_of) else k_of
            hz = k if prev_k is None or not horizon else prev_k
            prev_k, k = k, min(k, hz)
            ks, us, Ls = [], [], []
            inside = list(live)
            for i in list(live):
                row = int(arr.offsets[i]) + t[i]
                acc = 0
                while acc < k and arr.rho[row, acc] == 1.0:  # greedy: the leading accepted drafts
                    acc += 1
                ks.append(k)
                us.append(float(arr.U[row, k]))
                Ls.append(float(arr.L[row]))
                t[i] += min(acc + 1, N[i] - t[i])
                if t[i] >= stop[i]:
                    live.remove(i)
            u = np.array(us)
            ub = n_u * (1.0 - np.prod(1.0 - u / n_u))  # the independent union
            P, B = sum(ks) + len(ks), len(ks)
            verify = bm.beta0[P - 1] + bm.alpha[P - 1] * ub + bm.c[P - 1] * sum(Ls) + bm.b_req * (B - 1)
            d = (hz if horizon else k) if drafted_of is None else drafted_of(B)
            draft = bm.d0 + bm.d_step * d + bm.d_tok * d * B if d else 0.0
            cost += verify + bm.overhead[B - 1] + draft
            for i in inside:
                mine[i] = mine.get(i, 0.0) + verify + bm.overhead[B - 1] + draft
        L0 = np.array([float(arr.L[int(arr.offsets[i])]) for i in members])
        n = np.array([stop[i] for i in members])
        a, b_req, c, u = bm.ar_step
        assert u == 0.0  # the straight line (no union term) this walk prices
        for s in range(int(n.max())):
            on = n > s
            step = a + b_req * (on.sum() - 1) + c * float((L0[on] + s).sum())
            ar += step
            for i, o in zip(members, on, strict=True):
                plain[i] = plain.get(i, 0.0) + (step if o else 0.0)
    if tpot:
        return float(np.mean([plain[i] / stop_of for i, stop_of in _stops(arr, gids, max_tokens)])) / float(
            np.mean([mine[i] / stop_of for i, stop_of in _stops(arr, gids, max_tokens)])
        )
    return ar / cost


def _stops(arr, gids: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Each request's row and the tokens it generates (its recorded length, at most ``max_tokens``)."""
    row_of = {int(g): i for i, g in enumerate(arr.generation_ids)}
    return [(row_of[g], min(int(arr.offsets[row_of[g] + 1] - arr.offsets[row_of[g]]), max_tokens)) for g in gids]


def _lockstep_model() -> BatchCostModel:
    """The batch step model of the lockstep tests: linear, with an overhead per batch size and a plain engine."""
    return BatchCostModel.linear(
        b0=3.0, b_pos=0.4, alpha=0.05, c=0.001, b_req=0.3, d0=0.5, d_step=0.8, d_tok=0.05,
        kmax=KMAX, max_batch=4, top_k=FACTS["top_k"], n_experts=FACTS["n_experts"], n_layers=FACTS["n_layers"],
        predictor="independent", overhead=np.array([1.0, 1.5, 2.5, 4.0]), ar_step=(6.0, 0.7, 0.0005),
    )  # fmt: skip


def test_batch_prediction_of_fixed_k_is_the_hand_walked_lockstep(tmp_path: Path) -> None:
    from policies.bench.context import build_context
    from specenv.generator import generate_paper

    ts = generate_paper(24, kmax=KMAX, seed=4, greedy=True, name="steps-greedy")
    path = recorded(tmp_path, "steps-greedy", base=ts)
    arr = select_split(load_dataset(path).arrays(), "test")
    gids = [int(g) for g in arr.generation_ids]
    assert len(gids) >= 4  # groups of 2 and 3 with a short last group
    spec = build_context(str(path), KMAX, "fit-train", None).spec
    bm = _lockstep_model()

    def fixed(k: int):
        return lambda: replay_policy({"kind": "fixed", "k": k}, spec)

    for k in (1, 3):
        for batch in (2, 3):
            res = predict_batch(str(path), "fit-train", KMAX, gids, fixed(k), 40, batch, bm)
            assert res.speedup == pytest.approx(_hand_lockstep(arr, gids, k, bm, batch, 40), rel=1e-9), (k, batch)
            # what the live time per output token measures: each request's own clock, plain's over the arm's
            hand = _hand_lockstep(arr, gids, k, bm, batch, 40, tpot=True)
            assert res.tpot_speedup == pytest.approx(hand, rel=1e-9), (k, batch)
            # a request that ends early in its group stops its clock: above the groups' ratio here
            assert res.tpot_speedup > res.decode_speedup, (k, batch)
        one = predict_batch(str(path), "fit-train", KMAX, gids, fixed(k), 40, 1, bm)
        assert one.tpot_speedup == pytest.approx(one.decode_speedup, rel=1e-12)  # one request a group: the same
    # with a prefill term: every group first pays its prefill phase (spec engine for the arm, plain for the
    # reference) on the sum of its prompts' tokens; the decoding steps are the same hand walk
    pre = {"spec": (50.0, 0.2), "plain": (30.0, 0.15)}
    bmp = bm.replace(prefill=pre)
    for k, batch in ((1, 2), (3, 3)):
        res = predict_batch(str(path), "fit-train", KMAX, gids, fixed(k), 40, batch, bmp)
        decode = predict_batch(str(path), "fit-train", KMAX, gids, fixed(k), 40, batch, bm)
        assert decode.prefill_ms == 0.0 and decode.speedup == decode.decode_speedup
        hand = _hand_lockstep(arr, gids, k, bm, batch, 40)
        assert res.decode_speedup == pytest.approx(hand, rel=1e-9)
        assert res.decode_ms == pytest.approx(decode.decode_ms, rel=1e-12)
        tok = [
            sum(float(arr.L[int(arr.offsets[i])]) for i in range(g0, min(g0 + batch, len(gids))))
            for g0 in range(0, len(gids), batch)
        ]
        p_spec = sum(50.0 + 0.2 * t for t in tok)
        p_plain = sum(30.0 + 0.15 * t for t in tok)
        assert res.prefill_ms == pytest.approx(p_spec, rel=1e-12) and res.ar_prefill_ms == pytest.approx(
            p_plain, rel=1e-12
        )
        assert res.speedup == pytest.approx((p_plain + res.ar_decode_ms) / (p_spec + res.decode_ms), rel=1e-12)
        # the prefill pulls the speedup towards plain's prefill / spec's prefill: here below the decode figure
        assert res.speedup < res.decode_speedup
        # the plain engine's steps: each group runs as long as its longest request (40 tokens at most)
        lens = [min(40, int(arr.lengths[i])) for i in range(len(gids))]
        steps = [max(lens[g0 : g0 + batch]) for g0 in range(0, len(gids), batch)]
        assert (res.ar_steps, res.groups) == (sum(steps), len(steps))
        # batch 1's composition: another model's decoding ratio on this prediction's prefill and plain clock
        other = res.with_decode(1.25)
        assert other.decode_ms == pytest.approx(res.ar_decode_ms / 1.25, rel=1e-12)
        assert other.speedup == pytest.approx(
            (p_plain + res.ar_decode_ms) / (p_spec + res.ar_decode_ms / 1.25), rel=1e-12
        )
        assert (other.prefill_ms, other.ar_prefill_ms, other.ar_decode_ms) == (
            res.prefill_ms,
            res.ar_prefill_ms,
            res.ar_decode_ms,
        )
        with pytest.raises(ValueError, match="decode_speedup"):
            res.with_decode(0.0)

    # a batch policy (one object per group, asked once per step with the stacked rows of the step's
    # requests): k = the number of requests in the step, so the groups' tails verify fewer drafts
    class ByCount:
        name, stateless = "by-count", True

        def __init__(self) -> None:
            self.calls: list[int] = []

        def reset(self) -> None:
            pass

        def act(self, obs, ids=None, step=None):
            obs = np.asarray(obs)
            assert obs.ndim == 2 and ids is not None and len(ids) == len(obs)
            self.calls.append(len(obs))
            return np.full(len(obs), min(len(obs), KMAX), dtype=np.int64)

    made: list[ByCount] = []

    def make() -> ByCount:
        made.append(ByCount())
        return made[-1]

    for batch in (2, 3):
        made.clear()
        joint = predict_batch(str(path), "fit-train", KMAX, gids, make, 40, batch, bm, joint=True, draft_horizon=None)
        hand = _hand_lockstep(arr, gids, lambda n: min(n, KMAX), bm, batch, 40)
        assert joint.decode_speedup == pytest.approx(hand, rel=1e-9), batch
        # as the controller serves it: the step after a request ended drafted what the step before asked
        # (its horizon, asked before the outcome) -- more drafts than its own k, the same verification
        served = predict_batch(str(path), "fit-train", KMAX, gids, make, 40, batch, bm, joint=True)
        hand = _hand_lockstep(arr, gids, lambda n: min(n, KMAX), bm, batch, 40, horizon=True)
        assert served.decode_speedup == pytest.approx(hand, rel=1e-9), batch
        assert served.decode_speedup < joint.decode_speedup, batch
        made.clear()
        joint = predict_batch(str(path), "fit-train", KMAX, gids, make, 40, batch, bm, joint=True, draft_horizon=None)
        groups = -(-len(gids) // batch)
        assert len(made) == groups + 1  # one per group, and one for the environment's arguments
        assert max(max(p.calls) for p in made[1:]) == batch  # every request of a full group in one call


def _prefill_rows() -> list[dict]:
    rows = []
    for rep in range(3):
        for B in (1, 2, 4, 8):
            tokens = 240 * B + 7 * rep
            for engine, (a, b) in (("spec", (40.0, 3.5)), ("plain", (25.0, 3.25))):
                rows.append(
                    {"engine": engine, "run": f"rep{rep}", "batch": B, "group": rep * 4 + B, "B": B,
                     "prompt_tokens": tokens, "prefill_ms": a + b * tokens, "prefill_steps": 1}
                )  # fmt: skip
    return rows


def test_prefill_line_per_engine_is_recovered_and_bad_rows_are_named() -> None:
    coef, diag = fit_prefill({"columns": [], "rows": _prefill_rows()})
    assert coef["spec"] == pytest.approx((40.0, 3.5), rel=1e-9)
    assert coef["plain"] == pytest.approx((25.0, 3.25), rel=1e-9)
    assert diag["spec"]["r2"] == pytest.approx(1.0) and diag["spec"]["oos_mape_pct"] == pytest.approx(0.0, abs=1e-9)
    assert [p["B"] for p in diag["plain"]["per_batch"]] == [1, 2, 4, 8] and diag["plain"]["groups"] == 12
    # a negative intercept is noise: fixed at 0, the slope refitted through the origin
    neg = [dict(r, prefill_ms=3.0 * r["prompt_tokens"] - 20.0) for r in _prefill_rows()]
    assert fit_prefill({"rows": neg})[0]["spec"][0] == 0.0
    with pytest.raises(ValueError, match=r"extra\.prefill: rows lack column 'prompt_tokens'"):
        fit_prefill({"rows": [{k: v for k, v in r.items() if k != "prompt_tokens"} for r in _prefill_rows()]})
    with pytest.raises(ValueError, match=r"extra\.prefill: engine 'plain' has 0 groups"):
        fit_prefill({"rows": [r for r in _prefill_rows() if r["engine"] == "spec"]})
    bad = _prefill_rows()
    bad[5]["prefill_ms"] = -1.0
    with pytest.raises(ValueError, match=r"extra\.prefill: row 5: prefill_ms"):
        fit_prefill({"rows": bad})
    with pytest.raises(ValueError, match=r"extra\.prefill: expected"):
        fit_prefill([1, 2])


def test_step_fit_carries_the_prefill_term_and_its_json_round_trips(tmp_path: Path) -> None:
    steps, manifest = _recording()
    manifest["extra"] = manifest["extra"] | {"prefill": {"rows": _prefill_rows()}}
    model = fit_batch_cost(steps, manifest, timing="step").model
    assert model.prefill == {"spec": pytest.approx((40.0, 3.5)), "plain": pytest.approx((25.0, 3.25))}
    assert model.prefill_ms(1000, "spec") == pytest.approx(40.0 + 3500.0)
    back = BatchCostModel.load(model.save(tmp_path / "bc.json"))
    assert back.prefill == model.prefill
    assert fit_batch_cost(*_recording(), timing="step").model.prefill is None  # not recorded: decoding only
    assert (
        BatchCostModel.load(fit_batch_cost(*_recording(), timing="step").model.save(tmp_path / "b2.json")).prefill_ms(
            500, "plain"
        )
        == 0.0
    )
    with pytest.raises(ValueError, match="engine="):
        model.prefill_ms(10, "draft")
    obj = model.to_json()
    obj["prefill"]["spec"]["b_ms_per_token"] = -1.0
    with pytest.raises(ValueError, match="prefill"):
        BatchCostModel.from_json(obj, "bc.json")
    with pytest.raises(ValueError, match="prefill"):
        model.replace(prefill={"spec": (1.0, 1.0)})


@pytest.mark.parametrize(
    ("name", "groups"),
    [
        ("live-vllm-wide-batch-v2", 35),
        ("live-vllm-wide-batch-v3", 28),
        ("live-vllm-wide-batch-v4", 42),
        ("live-vllm-wide-batch-v5", 28),
        ("live-vllm-wide-batch-v6", 28),
    ],
)
def test_shipped_wide_recording_is_a_step_time_fit_of_its_steps(name: str, groups: int) -> None:
    from specenv.cost.batch import load_batch_cost_model
    from specenv.cost.batchfit import load_plain, load_steps
    from specenv.replay.batch import fitted_batch_cost, step_time_recording

    steps, manifest = load_steps(name)
    assert manifest["extra"]["models"] == "wide-moe-v1" and "engine_step_ms" in steps.columns
    assert set(steps["B"]) >= {1, 2, 4, 8, 16}
    ship = load_batch_cost_model(name)
    # the form and the predictors it was fitted with are in its provenance (the linear form and
    # independent/shared when absent: every recording before v6's refit)
    form = ship.source.get("verify_form", "linear")
    asked = tuple(ship.source.get("predictors", ("independent", "shared")))
    refit = fit_batch_cost(steps, manifest, timing="step", verify_form=form, predictors=asked).model
    for field in ("beta0", "alpha", "c", "overhead"):
        np.testing.assert_allclose(getattr(ship, field), getattr(refit, field), rtol=1e-9)
    assert ship.predictor == refit.predictor and ship.u_pool == pytest.approx(refit.u_pool, rel=1e-6)
    assert ship.u_theta == pytest.approx(refit.u_theta, rel=1e-6)
    assert ship.b_odd_query == pytest.approx(refit.b_odd_query, rel=1e-9)
    assert ship.ar_step == pytest.approx(refit.ar_step, rel=1e-9)
    # the plain engine's own batch steps: the reference's line is their least-squares fit, read back here
    ref = manifest["extra"]["ar_reference"]
    want = (ref["a_ms"], ref["b_req_ms"], ref["c_ms_per_token"], ref.get("u_ms_per_expert", 0.0))
    assert ship.ar_step == pytest.approx(want, rel=1e-12)
    plain = load_plain(name)
    if plain is not None:  # v4 on: the raw plain steps ship, and the reference is their fit (the union form)
        refit_ref = summarize_plain_batch(plain, manifest["model"]["n_experts"], manifest["model"]["top_k"])
        got = (refit_ref["a_ms"], refit_ref["b_req_ms"], refit_ref["c_ms_per_token"], refit_ref["u_ms_per_expert"])
        assert got == pytest.approx(want, rel=1e-9) and refit_ref["steps"] == ref["steps"] == len(plain)
        assert want[3] > 0  # the union term is used
        if name >= "live-vllm-wide-batch-v6":  # the plain step charged per B: the measured mean at a recorded B
            assert ship.ar_by_batch is not None
            np.testing.assert_allclose(ship.ar_by_batch, refit.ar_by_batch, rtol=1e-9)
            for b, t in plain.groupby("B"):
                ctx = np.full(int(b), t["context_sum"].mean() / int(b))
                assert ship.ar_ms(ctx) == pytest.approx(t["engine_step_ms"].mean(), rel=1e-9)
        else:  # shipped before the correction: the form alone, as then
            assert ship.ar_by_batch is None
        # its fixed-k groups: every request of every step but a group's last two verifies the group's k
        fixed = {int(g): k for g, k in manifest["extra"]["fixed_groups"].items()}
        assert 0 < len(fixed) < groups
        for g, rows in steps[steps["group"].isin(list(fixed))].sort_values("step").groupby("group"):
            assert (rows["drafted"] == fixed[g]).all()
            assert all(set(ks) == {fixed[g]} for ks in rows["k"].iloc[:-2])
    # every group's prefill phase on both engines, and the shipped prefill term is their fit
    rows = pd.DataFrame(manifest["extra"]["prefill"]["rows"])
    assert sorted(rows["engine"].value_counts().items()) == [("plain", groups), ("spec", groups)]
    assert ship.prefill is not None and refit.prefill is not None
    for engine in ("spec", "plain"):
        assert ship.prefill[engine] == pytest.approx(refit.prefill[engine], rel=1e-9)
        t = rows[rows["engine"] == engine]
        a, b = np.polyfit(t["prompt_tokens"].to_numpy(float), t["prefill_ms"].to_numpy(float), 1)[::-1]
        if a >= 0 and b >= 0:  # the unconstrained line is the fit when it needs no constraint
            assert ship.prefill[engine] == pytest.approx((a, b), rel=1e-6)
    # the newest recording of the wide models is the one the A/B and the batch env use
    assert step_time_recording("wide-moe-v1") == "live-vllm-wide-batch-v6"
    assert step_time_recording("small-moe-v1") is None  # its recording has no engine steps: forwards only
    wide = load_dataset("live-vllm-wide")
    chosen = fitted_batch_cost(wide, 8)
    newest = load_batch_cost_model("live-vllm-wide-batch-v6")
    assert chosen is not None and chosen.ar_step == newest.ar_step  # the batch env prices live-vllm-wide with it
    small = fitted_batch_cost(load_dataset("live-vllm"), 8)
    assert small is not None and small.ar_step is None  # the small models keep their own recording


def test_batch_prediction_of_a_gated_policy_is_its_k_by_the_steps_requests(tmp_path: Path) -> None:
    """A policy gated by the batch size (TableGated) replays as the hand walk of k(n): k where the table says
    speculate at the step's n requests, 0 elsewhere -- also in a group's tail, where n falls to one."""
    from policies.batch.controllers import TableGated
    from policies.bench.context import build_context
    from policies.heuristics import FixedK
    from specenv.generator import generate_paper
    from specenv.observation.batch import BatchObservationSpec

    ts = generate_paper(24, kmax=KMAX, seed=4, greedy=True, name="steps-greedy")
    path = recorded(tmp_path, "steps-greedy", base=ts)
    arr = select_split(load_dataset(path).arrays(), "test")
    gids = [int(g) for g in arr.generation_ids]
    spec = build_context(str(path), KMAX, "fit-train", None).spec
    bm = _lockstep_model()

    def gated() -> TableGated:
        return TableGated(BatchObservationSpec(spec, 4), FixedK(spec, 3), [(1, 1, 2), (2, 4, 0)])

    # groups of 3 whose last group is one request: the gate opens there (and wherever a group's tail is one)
    n_g = len(gids) - (len(gids) - 1) % 3
    assert n_g >= 4
    for batch in (1, 3):
        res = predict_batch(str(path), "fit-train", KMAX, gids[:n_g], gated, 40, batch, bm, joint=True)
        hand = _hand_lockstep(arr, gids[:n_g], lambda n: 3 if n == 1 else 0, bm, batch, 40)
        assert res.decode_speedup == pytest.approx(hand, rel=1e-9), batch
    # at batch 3 the gate is shut except for single requests: it differs from fixed k = 3 and from plain
    always = _hand_lockstep(arr, gids[:n_g], 3, bm, 3, 40)
    never = _hand_lockstep(arr, gids[:n_g], 0, bm, 3, 40)
    assert len({round(always, 9), round(never, 9), round(hand, 9)}) == 3

    # a gated block policy (lookahead h = 3, k = 2 <= h): the drafter proposes the block of h where the
    # gate is open, nothing where it is shut (the controller's horizon 0 there), never h at every step
    h = 3
    spec_h = dataclasses.replace(spec, lookahead=h)

    class Observing(FixedK):  # reads its rows, as a block policy reads its draft signals
        observes = True

    def gated_block() -> TableGated:
        return TableGated(BatchObservationSpec(spec_h, 4), Observing(spec_h, 2), [(1, 1, 2), (2, 4, 0)])

    assert gated_block().drafting == "block"
    res = predict_batch(str(path), "fit-train", KMAX, gids[:n_g], gated_block, 40, 3, bm, joint=True)
    hand = _hand_lockstep(
        arr, gids[:n_g], lambda n: 2 if n == 1 else 0, bm, 3, 40, drafted_of=lambda n: h if n == 1 else 0
    )
    assert res.decode_speedup == pytest.approx(hand, rel=1e-9)
    # (the block charged in every step, the old prediction, is a different figure)
    every = _hand_lockstep(arr, gids[:n_g], lambda n: 2 if n == 1 else 0, bm, 3, 40, drafted_of=lambda n: h)
    assert every < hand
