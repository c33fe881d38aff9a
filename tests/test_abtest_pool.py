"""The A/B without engines: the bounded engine pool, and the replay prediction on a step-timed set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import oracle
from policies.bench.context import build_context
from specenv.abtest import EnginePool, predicted_speedup, replay_policy
from specenv.cost.source import cost_model_for
from specenv.traces.datasets import load_dataset
from specenv.traces.splits import select_split
from tests.test_steptime import KMAX, recorded


class _FakeEngine:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log, self.closed = name, log, False
        self.info = {"rss_mb": 1000.0}

    def close(self) -> None:
        self.closed = True
        self.log.append(f"close {self.name}")


def _pool(max_alive: int | None):
    log: list[str] = []

    def launch(name: str, cfg: dict) -> _FakeEngine:
        log.append(f"start {name}")
        return _FakeEngine(name, log)

    return EnginePool(launch, max_alive), log


def test_pool_keeps_at_most_max_alive_and_evicts_the_least_recent() -> None:
    pool, log = _pool(2)
    a = pool.get("a", {"k": 1})
    pool.get("b", {"k": 2})
    assert pool.get("a") is a  # alive: no start
    pool.get("c", {"k": 3})  # full: b is the least recently used
    assert log.index("close b") < log.index("start c")
    assert sorted(pool._alive) == ["a", "c"] and pool.restarts == 0
    pool.get("b")  # defined before: restarted (a is now the least recent)
    assert pool.restarts == 1 and "close a" in log and sorted(pool._alive) == ["b", "c"]
    with pytest.raises(KeyError, match="never defined"):
        pool.get("zzz")
    pool.close()
    assert not pool._alive and log.count("close b") == 2


def test_interleaved_rotation_with_a_full_pool_restarts_but_never_exceeds_it() -> None:
    pool, log = _pool(3)
    names = [f"e{i}" for i in range(5)]
    alive_max = 0
    for rep in range(3):
        order = names[rep:] + names[:rep]
        for n in order:
            pool.get(n, {"n": n})
            alive_max = max(alive_max, len(pool._alive))
    assert alive_max == 3
    starts = sum(1 for x in log if x.startswith("start"))
    assert pool.restarts == starts - 5 > 0  # every start after an engine's first is a restart
    assert log.count("close e0") == log.count("start e0") - ("e0" in pool._alive)


def test_pool_sizes_itself_from_the_first_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import specenv.engines.vllm.settings as settings

    monkeypatch.setattr(settings, "available_memory_bytes", lambda: 10 * 1000 * 2**20)  # 10 engines' worth
    pool, _ = _pool(None)
    pool.get("a", {})
    assert pool.max_alive == 7  # 70% of the memory, in engines of 1000 MB


@pytest.mark.parametrize("split", ["test", "train"])  # train: the calibration's predictions of the train fit
def test_prediction_of_a_fixed_k_arm_is_the_oracle_exact_evaluation(tmp_path: Path, split: str) -> None:
    """On a greedy step-timed set, the replay's predicted speedup of fixed k is exact: the oracle's."""
    from specenv.generator import generate_paper

    ts = generate_paper(10, kmax=KMAX, seed=4, greedy=True, name="steps-greedy")
    path = recorded(tmp_path, "steps-greedy", base=ts)
    data = load_dataset(path)
    cm = cost_model_for(data, "fit-train")
    assert cm.ar_step is not None  # the step-time model
    arr = select_split(data.arrays(), split)
    gids = [int(g) for g in arr.generation_ids]
    spec_obj = build_context(str(path), KMAX, "fit-train", None).spec  # as the A/B builds it
    for k in (1, 3):
        pol = replay_policy({"kind": "fixed", "k": k}, spec_obj)
        pred = predicted_speedup(str(path), "fit-train", KMAX, gids, pol, split=split)
        ev = oracle.evaluate_policy(arr, cm, k)
        assert pred == pytest.approx(float(np.sum(ev.ar) / np.sum(ev.cost)), rel=1e-9)


def test_fidelity_summary_of_hand_built_rows() -> None:
    from specenv.abtest import _fidelity, _repeat_ci

    rows = [
        {"arm": "plain", "batch": 1, "group": "plain", "live_speedup": 1.0, "predicted": 1.0},
        {
            "arm": "a",
            "batch": 1,
            "group": "fixed",
            "live_speedup": 1.10,
            "predicted": 1.00,
            "ablations": {"without U_r": {"predicted": 1.21}},
        },
        {
            "arm": "b",
            "batch": 1,
            "group": "fixed",
            "live_speedup": 1.20,
            "predicted": 1.25,
            "ablations": {"without U_r": {"predicted": 1.10}},
        },
        {
            "arm": "c",
            "batch": 1,
            "group": "fixed",
            "live_speedup": 1.30,
            "predicted": 1.30,
            "ablations": {"without U_r": {"predicted": 1.00}},
        },
        {"arm": "d", "batch": 1, "group": "fixed", "status": "not run"},
    ]
    fid = _fidelity(rows)["1"]
    full = fid["full model"]
    errs = [abs(1.10 / 1.00 - 1), abs(1.20 / 1.25 - 1), 0.0]
    assert full["arms"] == 3 and full["worst"] == "a"
    assert full["mean_abs_err"] == pytest.approx(np.mean(errs)) and full["max_abs_err"] == pytest.approx(0.10)
    assert full["spearman"] == pytest.approx(1.0)  # the same order
    assert fid["without U_r"]["spearman"] == pytest.approx(-1.0)  # the reversed order
    # the live speedup's interval over repeats, paired with plain's repeats
    rs = [{"tok_per_s": x} for x in (110.0, 120.0, 130.0)]
    plain = [{"tok_per_s": 100.0}] * 3
    lo, hi = _repeat_ci(rs, plain)
    assert 1.1 <= lo <= 1.2 <= hi <= 1.3
    assert _repeat_ci(rs[:1], plain) is None


def test_decode_phase_view_uses_the_mean_time_per_output_token() -> None:
    from specenv.abtest import _fidelity, _mean_tpot

    plain = [{"requests": [{"tpot_ms": 40.0}, {"tpot_ms": 60.0}, {"tpot_ms": None}]}, {"requests": [{"tpot_ms": 50.0}]}]
    arm = [{"requests": [{"tpot_ms": 25.0}, {"tpot_ms": 35.0}]}]
    assert _mean_tpot(plain) == pytest.approx(50.0) and _mean_tpot(arm) == pytest.approx(30.0)
    assert _mean_tpot([{"requests": [{"tpot_ms": None}]}]) is None
    rows = [
        {"arm": "plain", "batch": 4, "group": "plain", "live_speedup": 1.0, "predicted": 1.0},
        # tokens/s holds the prefill, the same for both arms: the live speedup is pulled towards 1
        {
            "arm": "a",
            "batch": 4,
            "group": "fixed",
            "live_speedup": 1.05,
            "decode_speedup": 50.0 / 30.0,
            "predicted": 1.60,
        },
        {"arm": "b", "batch": 4, "group": "fixed", "live_speedup": 0.97, "decode_speedup": 0.90, "predicted": 0.90},
        {"arm": "c", "batch": 4, "group": "fixed", "live_speedup": 1.01, "decode_speedup": None, "predicted": 1.2},
    ]
    fid = _fidelity(rows)["4"]
    dec = fid["full model, decode phase"]
    assert dec["arms"] == 2  # c has no decode figure
    assert dec["max_abs_err"] == pytest.approx(abs((50.0 / 30.0) / 1.60 - 1))
    assert fid["full model"]["arms"] == 3 and fid["full model"]["worst"] == "a"


def test_rows_of_k_0_the_plain_engine_for_the_best_choice_and_the_replay_for_vllms_table() -> None:
    from specenv.abtest import _Arm, _rows

    def passes(tps: float) -> list[dict]:
        return [
            {
                "tok_per_s": tps * f,
                "outputs": [[1, 2]],
                "groups": [{"wall_s": 100.0 / (tps * f), "tokens": 100}],
                "requests": [{"ttft_ms": 50.0, "tpot_ms": 1000 / tps}],
            }
            for f in (1, 1.01)
        ]

    best_k = {1: 2, 4: 0}
    arms = [
        _Arm("plain (no speculation)", "plain", "plain"),
        _Arm("fixed k=2", "k=2", "fixed", predict={"kind": "fixed", "k": 2}),
        _Arm("best fixed k (train)", "", "best", k_by_batch=best_k),
        _Arm("vLLM dynamic SD", "dynamic", "dynamic", k_by_batch=best_k),
        _Arm("k by batch size (specenv)", "ctl", "table", {"kind": "dsd-table"}, k_by_batch=best_k),
        # the overhead arm's stock reference runs on the same engine as fixed k = 2: not the best arm's passes
        _Arm("stock vLLM k=2 (overhead reference)", "k=2", "overhead-stock"),
    ]
    results = {
        ("plain (no speculation)", 1): passes(20.0), ("plain (no speculation)", 4): passes(30.0),
        ("fixed k=2", 1): passes(22.0), ("fixed k=2", 4): passes(27.0),
        ("stock vLLM k=2 (overhead reference)", 1): passes(25.0),
        ("vLLM dynamic SD", 1): passes(22.0), ("vLLM dynamic SD", 4): passes(28.5),
        ("k by batch size (specenv)", 1): passes(22.2), ("k by batch size (specenv)", 4): passes(29.7),
    }  # fmt: skip
    kpred = {(2, 1): (1.10, 1.2), (2, 4): (0.9, 0.9), (0, 1): (0.97, 0.96), (0, 4): (0.95, 0.94)}
    rows = {(r["arm"], r["batch"]): r for r in _rows(arms, results, {}, kpred, [1, 4])}
    best1, best4 = rows[("best fixed k (train)", 1)], rows[("best fixed k (train)", 4)]
    assert best1["k"] == 2 and best1["live_speedup"] == pytest.approx(1.1) and best1["predicted"] == 1.10
    # at batch 4 the best choice is no speculation: plain's own passes, plain's prediction
    assert best4["k"] == 0 and best4["live_speedup"] == pytest.approx(1.0) and best4["predicted"] == 1.0
    assert rows[("vLLM dynamic SD", 4)]["predicted"] == 0.95  # vLLM drafts at k = 0: the replay prices it
    assert rows[("k by batch size (specenv)", 4)]["predicted"] == 1.0  # plain idle steps
    assert rows[("k by batch size (specenv)", 1)]["predicted"] == 1.10
    # the paired view against the best choice: at batch 4 that is plain itself
    assert rows[("k by batch size (specenv)", 4)]["paired"]["best fixed k (train)"]["ratio"] == pytest.approx(0.99)


def test_a_controller_engine_arm_is_priced_without_the_draft_floor(tmp_path: Path) -> None:
    """The lazy drafter skips vLLM's k = 0 draft forward: the controller arms' cost model has no floor."""
    import dataclasses

    from specenv.abtest import lazy_cost_model
    from specenv.cost.model import CostModel

    base = CostModel.paper_profile(4)
    with_floor = dataclasses.replace(base, d_floor=1.25)
    path = tmp_path / "cost-model.json"
    with_floor.save(path)
    lazy = Path(lazy_cost_model(str(path)))
    assert lazy != path and lazy.parent == tmp_path
    got = CostModel.load(lazy)
    assert got.d_floor == 0.0 and CostModel.load(path).d_floor == 1.25  # the set's own model is left as it was
    L = np.array([100.0, 900.0])
    for k in range(1, 5):  # every speculating round costs what it cost
        assert np.allclose(got.draft_ms(np.full(2, k)), with_floor.draft_ms(np.full(2, k)))
        assert np.allclose(got.target_ms(k, 6.0, L), with_floor.target_ms(k, 6.0, L))
    assert (
        got.draft_ms(np.zeros(1, dtype=np.int64))[0] == 0.0
        and with_floor.draft_ms(np.zeros(1, dtype=np.int64))[0] == 1.25
    )
    base.save(nofloor := tmp_path / "nofloor.json")
    assert lazy_cost_model(str(nofloor)) == str(nofloor)  # nothing to take away
    assert lazy_cost_model("fit-train") == "fit-train"  # a named model: not a file to rewrite
