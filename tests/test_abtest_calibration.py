"""The A/B's calibration on its own train fit: the speculating engine's decoding scaled by one factor per batch size.

No engines: predictions are hand-built :class:`BatchPrediction` values and every expected figure is written out
here from the definition (plain's prefill + decoding over the arm's prefill + r x decoding).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from specenv import abtest
from specenv.abtest import BatchPrediction, calibrate_decode


def _pred(pre: float, dec: float, ar_pre: float, ar_dec: float) -> BatchPrediction:
    return BatchPrediction(
        speedup=(ar_pre + ar_dec) / (pre + dec),
        decode_speedup=ar_dec / dec,
        decode_ms=dec,
        ar_decode_ms=ar_dec,
        prefill_ms=pre,
        ar_prefill_ms=ar_pre,
        ar_steps=100,
        groups=2,
        tpot_speedup=1.1 * ar_dec / dec,
    )


# three fixed k of one batch size: the same prefill phases, decoding that shrinks then grows with k
PREDS = {
    1: _pred(900.0, 3000.0, 850.0, 3600.0),
    2: _pred(900.0, 2700.0, 850.0, 3600.0),
    3: _pred(900.0, 2900.0, 850.0, 3600.0),
}


def test_calibrated_prediction_scales_the_arms_decoding_only() -> None:
    p = PREDS[2]
    c = p.calibrated(1.2)
    assert c.speedup == pytest.approx((850.0 + 3600.0) / (900.0 + 2700.0 * 1.2))
    assert c.decode_ms == pytest.approx(3240.0) and c.decode_speedup == pytest.approx(3600.0 / 3240.0)
    assert c.tpot_speedup == pytest.approx(1.1 * 3600.0 / 2700.0 / 1.2)
    assert (c.prefill_ms, c.ar_prefill_ms, c.ar_decode_ms) == (900.0, 850.0, 3600.0)
    assert p.calibrated(1.0) == p
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="r="):
            p.calibrated(bad)


@pytest.mark.parametrize("r_true", [0.8, 1.0, 1.17])
def test_calibration_recovers_the_factor_that_made_the_measurements(r_true: float) -> None:
    measured = {k: [(850.0 + 3600.0) / (900.0 + p.decode_ms * r_true)] * 2 for k, p in PREDS.items()}
    assert calibrate_decode(measured, PREDS) == pytest.approx(r_true, rel=1e-4)


def test_calibration_is_the_log_least_squares_fit_of_noisy_passes() -> None:
    rng = np.random.default_rng(0)
    measured = {
        k: [(850.0 + 3600.0) / (900.0 + p.decode_ms * 1.1) * math.exp(rng.normal(0, 0.03)) for _ in range(3)]
        for k, p in PREDS.items()
    }
    r = calibrate_decode(measured, PREDS)

    def loss(x: float) -> float:
        return sum(
            (math.log(m) - math.log((850.0 + 3600.0) / (900.0 + PREDS[k].decode_ms * x))) ** 2
            for k, ms in measured.items()
            for m in ms
        )

    grid = np.linspace(0.9, 1.3, 4001)  # the minimum on a fine grid, computed here
    best = float(grid[np.argmin([loss(x) for x in grid])])
    assert r == pytest.approx(best, abs=2e-4)
    assert loss(r) <= loss(1.1) + 1e-12  # at least as good as the factor that made them


def test_calibration_refuses_what_it_cannot_fit() -> None:
    with pytest.raises(ValueError, match="no fixed k"):
        calibrate_decode({4: [1.1]}, PREDS)
    with pytest.raises(ValueError, match="finite and > 0"):
        calibrate_decode({1: [0.0]}, PREDS)


def test_run_calibration_uses_only_a_fit_measured_in_the_run() -> None:
    calls: list[tuple[int, int, str]] = []
    r_true = {1: 1.25, 4: 0.9}

    def predict_raw(desc, b, cm, bm, lazy, ids, split):  # the train prompts of the run, on the train split
        calls.append((b, desc["k"], split))
        assert ids == [7, 8, 9] and lazy is False and desc["kind"] == "fixed"
        return PREDS[desc["k"]]

    ratios = {
        str(b): {str(k): [(850.0 + 3600.0) / (900.0 + p.decode_ms * r)] for k, p in PREDS.items()}
        for b, r in r_true.items()
    }
    fit = {"mode": "measured", "train_ratio_all": ratios}
    opts = abtest.AbtestOptions(models="wide-moe-v1")
    got = abtest._calibration(fit, opts, [7, 8, 9], "cm.json", None, predict_raw)
    assert set(got) == {"1", "4"}
    for b, r in r_true.items():
        assert got[str(b)]["r"] == pytest.approx(r, rel=1e-4)
        assert got[str(b)]["train_mean_abs_err_after"] < 1e-4 < got[str(b)]["train_mean_abs_err_before"]
        assert got[str(b)]["passes"] == 3 and got[str(b)]["ks"] == [1, 2, 3]
    assert {split for *_, split in calls} == {"train"}
    # a fit reused from another run, or chosen by replay, has no train passes of this run: no calibration
    assert abtest._calibration(fit | {"mode": "from"}, opts, [7], "cm.json", None, predict_raw) == {}
    assert abtest._calibration({"mode": "replay"}, opts, [7], "cm.json", None, predict_raw) == {}


def test_a_variant_prediction_is_picked_per_row_as_the_full_one() -> None:
    pa = {("learned x", 4): (1.2, 1.4), ("fixed k=2", 4): (1.1, 1.3)}
    pk = {(2, 4): (1.1, 1.3), (0, 4): (0.97, 0.95)}
    # the best static choice and specenv's table at k = 0 run the plain engine: 1.0
    assert abtest._variant_pred({"arm": "best", "group": "best", "k": 0, "batch": 4}, pa, pk) == (1.0, 1.0)
    assert abtest._variant_pred({"arm": "t", "group": "table", "k": 0, "batch": 4}, pa, pk) == (1.0, 1.0)
    # vLLM's table at k = 0 still drafts: its fixed-k prediction at 0
    assert abtest._variant_pred({"arm": "d", "group": "dynamic", "k": 0, "batch": 4}, pa, pk) == (0.97, 0.95)
    for group in ("best", "dynamic", "table"):
        assert abtest._variant_pred({"arm": "a", "group": group, "k": 2, "batch": 4}, pa, pk) == (1.1, 1.3)
    assert abtest._variant_pred({"arm": "learned x", "group": "learned", "batch": 4}, pa, pk) == (1.2, 1.4)
    assert abtest._variant_pred({"arm": "learned x", "group": "learned", "batch": 8}, pa, pk) is None


# ---- this machine's clock, measured on the train passes (prefill phases, plain step) before r is fitted

# PREDS' clock: 2 groups, 100 plain steps -> plain prefill 425 ms a group, drafter engine's 450, plain step 36 ms
CLOCK = abtest.ClockFactors(prefill_spec=0.5, prefill_plain=0.55, step_plain=0.75)


def _measured(p: BatchPrediction, r: float, c: abtest.ClockFactors) -> float:
    """What a pass measures when this machine runs the model's phases at ``c`` and the drafter's decoding x r."""
    return (850.0 * c.prefill_plain + 3600.0 * c.step_plain) / (900.0 * c.prefill_spec + p.decode_ms * r * c.step_plain)


def test_clock_puts_every_phase_on_this_machine_and_r_stays_relative() -> None:
    c = PREDS[2].calibrated(1.2, CLOCK)
    assert c.speedup == pytest.approx((850.0 * 0.55 + 3600.0 * 0.75) / (900.0 * 0.5 + 2700.0 * 1.2 * 0.75))
    assert (c.prefill_ms, c.ar_prefill_ms) == pytest.approx((450.0, 467.5))
    assert (c.ar_decode_ms, c.decode_ms) == pytest.approx((2700.0, 2430.0))
    # the decoding ratio moves by r alone: the plain step's factor is on both sides
    assert c.decode_speedup == pytest.approx(3600.0 / 2700.0 / 1.2)
    assert PREDS[2].calibrated(1.2, abtest.ClockFactors()) == PREDS[2].calibrated(1.2)
    for bad in (0.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clock step_plain="):
            abtest.ClockFactors(step_plain=bad)


def _requests(ttfts: list[list[float]], tpot: float) -> list[dict[str, float]]:
    """One pass's requests: per group, its requests' times to first token; every request at ``tpot``."""
    return [{"group": g, "ttft_ms": t, "tpot_ms": tpot} for g, ts in enumerate(ttfts) for t in ts]


def test_train_clock_is_measured_over_modelled_on_the_train_passes() -> None:
    # plain: a group's prefill is its last first token: (200 + 260) / 2 = 230 a group over 425 modelled;
    # its step 27 ms and 27 ms over 36 modelled; the drafter engine's groups (240, 210, 240, 210) over 450
    plain = [{"requests": _requests([[180.0, 200.0], [260.0, 250.0]], 27.0)}] * 2
    spec = [{"requests": _requests([[240.0, 230.0], [200.0, 210.0]], 20.0)}] * 2
    got = abtest.train_clock(PREDS[1], plain, spec)
    assert got == pytest.approx(abtest.ClockFactors(225.0 / 450.0, 230.0 / 425.0, 27.0 / 36.0))
    # no request timings on a side: no clock (not a clock of 1)
    assert abtest.train_clock(PREDS[1], plain, [{"requests": []}]) is None
    assert abtest.train_clock(PREDS[1], [{"requests": []}], spec) is None


@pytest.mark.parametrize("r_true", [0.85, 1.1])
def test_calibration_on_this_machines_clock_recovers_r(r_true: float) -> None:
    measured = {k: [_measured(p, r_true, CLOCK)] * 2 for k, p in PREDS.items()}
    assert calibrate_decode(measured, PREDS, CLOCK) == pytest.approx(r_true, rel=1e-4)
    # without the clock the same passes need another r, and it does not fit them all
    r_blind = calibrate_decode(measured, PREDS)
    assert abs(r_blind - r_true) > 0.01
    assert abtest._calibration_error(measured, PREDS, r_blind) > abtest._calibration_error(
        measured, PREDS, r_true, CLOCK
    )


def test_run_calibration_measures_the_clock_from_the_fits_request_timings() -> None:
    def predict_raw(desc, b, cm, bm, lazy, ids, split):
        return PREDS[desc["k"]]

    c = CLOCK
    # passes whose timings give CLOCK exactly: plain groups 425 x 0.55, its step 36 x 0.75, drafter groups 450 x 0.5
    plain_reqs = _requests([[425.0 * c.prefill_plain]] * 2, 36.0 * c.step_plain)
    spec_reqs = _requests([[450.0 * c.prefill_spec]] * 2, 20.0)
    fit = {
        "mode": "measured",
        "train_ratio_all": {"4": {str(k): [_measured(p, 0.9, c)] for k, p in PREDS.items()}},
        "train_requests": {"4": {"0": [plain_reqs] * 3, **{str(k): [spec_reqs] for k in PREDS}}},
    }
    opts = abtest.AbtestOptions(models="wide-moe-v1")
    got = abtest._calibration(fit, opts, [7, 8], "cm.json", None, predict_raw)["4"]
    assert got["clock"] == pytest.approx({"prefill_spec": 0.5, "prefill_plain": 0.55, "step_plain": 0.75})
    assert got["r"] == pytest.approx(0.9, rel=1e-4)
    assert got["train_mean_abs_err_after"] < 1e-4 < got["train_mean_abs_err_clock"] < got["train_mean_abs_err_before"]
    # a fit without request timings (an older abtest.json) is calibrated on the model's clock
    old = abtest._calibration(fit | {"train_requests": None}, opts, [7, 8], "cm.json", None, predict_raw)["4"]
    assert old["clock"] is None and old["train_mean_abs_err_clock"] is None
