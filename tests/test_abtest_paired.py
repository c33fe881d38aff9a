"""The A/B's live statistics without engines: per-request timing of a pass, paired ratios, latency."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specenv import abtest


def _pass(group_walls: list[float], tokens: int = 10) -> dict:
    return {"groups": [{"wall_s": w, "tokens": tokens} for w in group_walls], "tok_per_s": 1.0}


def test_paired_ratio_of_hand_built_repeats() -> None:
    ref = [_pass([1.0, 2.0]), _pass([1.2, 1.8])]
    arm = [_pass([0.5, 1.0]), _pass([0.8, 1.2])]
    p = abtest._paired(arm, ref)
    # pooled over the four cells: (1 + 2 + 1.2 + 1.8) / (0.5 + 1 + 0.8 + 1.2) = 6 / 3.5
    assert p["ratio"] == pytest.approx(6.0 / 3.5)
    assert p["per_repeat"] == pytest.approx([3.0 / 1.5, 3.0 / 2.0])
    assert p["cells"] == 4
    assert p["ci95"][0] <= p["ratio"] <= p["ci95"][1]
    # the interval spans the cell ratios' range at most: each cell ratio lies in [1.5, 2.0]
    assert 1.5 - 1e-9 <= p["ci95"][0] and p["ci95"][1] <= 2.0 + 1e-9
    assert p["excludes_1"] is True
    # repeats for +-5%: sd of log(2), log(1.5) with ddof 1, by hand
    sd = abs(np.log(2.0) - np.log(1.5)) / np.sqrt(2.0)
    assert p["repeats_for_5pct"] == int(np.ceil((1.96 * sd / np.log(1.05)) ** 2))


def test_paired_scales_by_tokens_and_refuses_unpaired_passes() -> None:
    ref = [_pass([1.0, 1.0], tokens=10), _pass([1.0, 1.0], tokens=10)]
    arm = [_pass([1.0, 1.0], tokens=20), _pass([1.0, 1.0], tokens=20)]  # twice the tokens in the same time
    assert abtest._paired(arm, ref)["ratio"] == pytest.approx(2.0)
    assert abtest._paired(arm, [_pass([1.0])]) is None  # different groupings: no pairs
    assert abtest._paired([{"tok_per_s": 1.0}], [{"tok_per_s": 1.0}]) is None  # no group timings
    same = abtest._paired(ref, ref)
    assert same["ratio"] == pytest.approx(1.0) and same["excludes_1"] is False


def _timed(group_walls: list[float], reqs: list[tuple[int, float, int]]) -> dict:
    """A pass with group wall times and requests (group, tpot_ms, tokens)."""
    p = _pass(group_walls)
    p["requests"] = [{"group": g, "ttft_ms": 100.0, "tpot_ms": t, "tokens": n} for g, t, n in reqs]
    return p


def test_the_decode_phase_pairs_the_time_after_each_first_token_by_request_group() -> None:
    # two groups of two requests; the arm's decoding is 10% faster in every group, its prefill 3x slower:
    # the pass ratio sees the prefill, the decode ratio only the time after the first tokens
    ref = [_timed([1.0, 1.0], [(0, 10.0, 11), (0, 10.0, 11), (1, 20.0, 6), (1, 20.0, 6)]) for _ in range(2)]
    arm = [_timed([3.0, 3.0], [(0, 9.0, 11), (0, 9.0, 11), (1, 18.0, 6), (1, 18.0, 6)]) for _ in range(2)]
    dec = abtest._paired(arm, ref, "decode")
    # per group: ref 2 x 10 ms x 10 tokens = 0.2 s (group 0), 2 x 20 ms x 5 = 0.2 s (group 1); arm 0.18 s each
    assert dec["ratio"] == pytest.approx(0.2 / 0.18)
    assert dec["cells"] == 4 and dec["per_repeat"] == pytest.approx([0.4 / 0.36] * 2)
    assert dec["excludes_1"] is True  # every cell 1.11: the interval is that point
    assert abtest._paired(arm, ref)["ratio"] == pytest.approx(1.0 / 3.0)  # the whole pass: prefill included
    # a request with one token has no decode time but is still paired (0 s, 0 tokens)
    one = [_timed([1.0], [(0, None, 1), (0, 10.0, 3)]) for _ in range(2)]
    assert abtest._paired(one, one, "decode")["ratio"] == pytest.approx(1.0)
    # no per-request timings (an older engine): no decode pairs, the pass pairs still there
    assert abtest._paired([_pass([1.0, 1.0])] * 2, [_pass([1.0, 1.0])] * 2, "decode") is None
    # a different number of groups: no pairs
    assert abtest._paired(arm, [_timed([1.0], [(0, 10.0, 11)])] * 2, "decode") is None


def test_latency_percentiles_over_requests_of_every_repeat() -> None:
    reqs = [{"group": i, "ttft_ms": float(i), "tpot_ms": 10.0 + i, "tokens": 5} for i in range(100)]
    lat = abtest._latency([{"requests": reqs[:50]}, {"requests": reqs[50:] + [{}]}])
    assert lat["requests"] == 100
    assert lat["ttft_ms_p50"] == pytest.approx(49.5)
    assert lat["tpot_ms_p50"] == pytest.approx(59.5)
    assert lat["tpot_ms_p99"] == pytest.approx(np.quantile(np.arange(100) + 10.0, 0.99))
    assert abtest._latency([{"tok_per_s": 1.0}]) is None


def test_the_best_static_choice_may_be_no_speculation() -> None:
    from specenv.abtest import best_static_k

    assert best_static_k({0: 30.0, 1: 28.0, 2: 29.5}) == 0  # every k slower than plain: speculation off
    assert best_static_k({0: 30.0, 1: 31.0, 2: 33.0, 3: 33.0}) == 2  # a tie goes to the smaller k
    # repeats, paired by position: k = 2 is faster on median but lost to plain in one repeat; k = 1 never did
    reps = {0: [30.0, 32.0, 29.0], 1: [31.0, 32.5, 29.5], 2: [36.0, 31.0, 33.0]}
    assert best_static_k(reps) == 1
    assert best_static_k({0: [30.0, 32.0], 1: [29.0, 33.0]}) == 0  # no k wins every repeat
    assert best_static_k({0: [30.0, 30.0], 1: [31.0, 30.6], 2: [30.3, 33.0]}) == 2  # median ratio 1.055 > 1.027
    for bad in ({}, {1: 31.0}, {0: 30.0, 1: float("nan")}, {0: 0.0}, {0: [30.0, 31.0], 1: [32.0]}):
        with pytest.raises(ValueError, match="best_static_k"):
            best_static_k(bad)


def test_the_fit_pairs_every_k_run_with_a_plain_run_beside_it() -> None:
    from specenv.abtest import best_static_from_ratios, fit_order

    order = fit_order(3, [1, 4], 2)
    # every (k, batch size) once a repeat, batch sizes inner: one k engine at a time
    assert [(k, b) for k, b, _ in order] == [(k, b) for _ in range(2) for k in (1, 2, 3) for b in (1, 4)]
    runs = [(kk, b) for _, b, pair in order for kk in pair]
    assert len(runs) == 2 * 3 * 2 * 2
    for i in range(0, len(runs), 2):  # each pair: the k run and a plain run of the same batch size, adjacent
        (a, ba), (c, bc) = runs[i], runs[i + 1]
        assert ba == bc and sorted((a, c))[0] == 0 and max(a, c) >= 1
    firsts = [pair[0] for _, _, pair in order]
    assert firsts.count(0) == len(order) // 2  # plain first in half of the pairs, alternating
    assert all(firsts[i] != firsts[i + 1] for i in range(len(firsts) - 1))

    # the rule on paired ratios: a k that lost one pair is not eligible; the largest median among the rest
    assert best_static_from_ratios({1: [1.02, 1.01, 1.05], 2: [1.30, 0.99, 1.20]}) == 1
    assert best_static_from_ratios({1: [0.98], 2: [0.97]}) == 0
    assert best_static_from_ratios({1: [1.05, 1.05], 2: [1.05, 1.05]}) == 1  # a tie: the smaller k
    for bad in ({1: []}, {0: [1.1]}, {1: [float("inf")]}, {1: [-1.0]}):
        with pytest.raises(ValueError, match="best_static_k"):
            best_static_from_ratios(bad)


def test_a_repeat_runs_the_arms_of_one_batch_size_together_when_every_engine_is_up() -> None:
    from specenv.abtest import repeat_cells

    assert repeat_cells(["a", "b"], [1, 8], True) == [("a", 1), ("b", 1), ("a", 8), ("b", 8)]
    assert repeat_cells(["a", "b"], [1, 8], False) == [("a", 1), ("a", 8), ("b", 1), ("b", 8)]


def test_group_interleaving_runs_every_group_by_every_arm_in_turn_rotating_the_first() -> None:
    from specenv.abtest import interleave_cells

    cells = interleave_cells(["a", "b", "c"], 4, rep=0)
    assert len(cells) == 12 and sorted(cells) == sorted((g, a) for g in range(4) for a in "abc")
    # group by group: every arm runs group g before any arm runs group g + 1
    assert [g for g, _ in cells] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    firsts = [cells[3 * g][1] for g in range(4)]
    assert firsts == ["a", "b", "c", "a"]  # the first arm rotates from group to group
    # and from repeat to repeat: repeat 1's first group starts where repeat 0's second did
    assert [a for _, a in interleave_cells(["a", "b", "c"], 1, rep=1)] == ["b", "c", "a"]
    assert interleave_cells([], 3, rep=2) == []


def test_a_pass_joined_from_its_groups_is_the_pass_they_make_together() -> None:
    from specenv.engines.vllm.bench import join_passes

    def part(wall: float, toks: list[int], outs: list[list[int]], rows=None) -> dict:
        p = {
            "wall_s": wall,
            "tokens": sum(toks),
            "tok_per_s": sum(toks) / wall,
            "steps": 5,
            "outputs": outs,
            "groups": [{"wall_s": wall, "tokens": sum(toks)}],
            "requests": [{"group": 0, "ttft_ms": 1.0, "tpot_ms": 2.0, "tokens": t} for t in toks],
        }
        if rows is not None:
            p["overhead"] = {"steps": len(rows), "rows": rows}
            p.update(decisions=3, fallbacks=1, capped=0)
        return p

    a = part(2.0, [4, 6], [[1, 2, 3, 4], [5] * 6])
    b = part(3.0, [5, 5], [[7] * 5, [8] * 5])
    j = join_passes([a, b])
    assert j["wall_s"] == 5.0 and j["tokens"] == 20 and j["tok_per_s"] == pytest.approx(4.0) and j["steps"] == 10
    assert j["outputs"] == a["outputs"] + b["outputs"]
    assert [r["group"] for r in j["requests"]] == [0, 0, 1, 1]  # renumbered to their place in the pass
    assert [r["group"] for r in b["requests"]] == [0, 0]  # the parts are not changed
    assert j["groups"] == [{"wall_s": 2.0, "tokens": 10}, {"wall_s": 3.0, "tokens": 10}]
    assert "overhead" not in j and "decisions" not in j
    # controller parts: the per-step logs concatenated, the figures recomputed from them, counters summed
    c = part(2.0, [3], [[1, 1, 1]], rows=[[0.1, 0.05, 10.0], [0.3, 0.15, 10.0]])
    d = part(1.0, [2], [[2, 2]], rows=[[0.2, 0.1, 20.0]])
    jc = join_passes([c, d])
    ov = jc["overhead"]
    assert ov["steps"] == 3 and ov["specenv_ms"] == pytest.approx(0.6) and ov["step_ms"] == pytest.approx(40.0)
    assert ov["frac"] == pytest.approx(0.6 / 40.0) and ov["cpu_frac"] == pytest.approx(0.3 / 40.0)
    assert (jc["decisions"], jc["fallbacks"], jc["capped"]) == (6, 2, 0)
    # the paired ratio of joined passes is the one of the groups themselves
    ref = [join_passes([part(4.0, [4, 6], [[0]]), part(3.0, [5, 5], [[0]])])]
    assert abtest._paired([j], ref)["ratio"] == pytest.approx(7.0 / 5.0)
    with pytest.raises(ValueError, match="controller engine"):
        join_passes([a, c])
    with pytest.raises(ValueError, match="no parts"):
        join_passes([])


def test_the_dynamic_sd_table_covers_every_batch_size_and_keeps_k_0() -> None:
    from specenv.abtest import dsd_table

    assert dsd_table({1: 2}, 16) == [(1, 16, 2)]
    table = dsd_table({16: 0, 1: 3, 4: 2, 8: 0}, 16)  # measured at 1, 4, 8, 16 (any order)
    assert table == [(1, 2, 3), (3, 6, 2), (7, 12, 0), (13, 16, 0)]
    # every batch size 1..16 in exactly one range, and the lookup vLLM (and DSDBatch) does agrees
    from policies.batch.controllers import DSDBatch
    from specenv.observation.batch import BatchObservationSpec
    from specenv.observation.single import ObservationSpec

    covered = [n for lo, hi, _ in table for n in range(lo, hi + 1)]
    assert covered == list(range(1, 17))
    pol = DSDBatch(BatchObservationSpec(ObservationSpec(8, 0), 16), table)
    assert [pol.lookup(n) for n in (1, 4, 8, 16)] == [3, 2, 0, 0]
    rows = np.zeros((5, pol.spec.request.dim))
    assert pol.act(rows, list(range(5)), None).tolist() == [2] * 5  # 5 requests in the step: the 3-6 range


def test_held_out_prompts_are_cut_or_served_in_turn_never_invented() -> None:
    ids = [31, 7, 12]
    assert abtest.held_out_prompts(ids, 2) == [31, 7]
    assert abtest.held_out_prompts(ids, 3) == [31, 7, 12]
    with pytest.raises(ValueError, match="exceeds the 3 held-out"):
        abtest.held_out_prompts(ids, 4)
    # a batch of 8 from 3 held-out prompts: each prompt in turn, in the split's order
    assert abtest.held_out_prompts(ids, 8, cycle=True) == [31, 7, 12, 31, 7, 12, 31, 7]
    with pytest.raises(ValueError):
        abtest.held_out_prompts([], 2, cycle=True)
    with pytest.raises(ValueError):
        abtest.held_out_prompts(ids, 0, cycle=True)


def test_the_table_header_says_when_prompts_repeat() -> None:
    assert abtest._distinct([1, 2, 3]) == ""
    assert "2 distinct" in abtest._distinct([1, 2, 1, 2])


def _fit_doc(tmp_path, **over):  # noqa: ANN001, ANN202
    import json

    doc = {
        "options": {"models": "wide-moe-v1", "dataset": "live-vllm-wide", "max_tokens": 48},
        "kmax": 4,
        "fit": {"mode": "measured", "best_k": {"1": 3, "2": 1, "4": 0, "8": 2, "16": 0}, "fit_repeats": 3},
    }
    doc.update(over)
    p = tmp_path / "abtest.json"
    p.write_text(json.dumps(doc))
    return p


def test_an_earlier_train_fit_is_reused_only_for_the_same_models_set_kmax_and_batches(tmp_path) -> None:
    p = _fit_doc(tmp_path)
    fit = abtest.fit_from_file(p, "wide-moe-v1", "live-vllm-wide", 4, [1, 8, 16])
    assert abtest.fit_from_file(p, "wide-moe-v1", "live-vllm-wide", 4, [1], 48)["best_k"] == fit["best_k"]
    assert fit["best_k"] == {1: 3, 2: 1, 4: 0, 8: 2, 16: 0} and fit["fit_repeats"] == 3 and fit["from"] == str(p)
    for args, needle in [
        (("small-moe-v1", "live-vllm-wide", 4, [1]), "models"),
        (("wide-moe-v1", "live-vllm", 4, [1]), "traces"),
        (("wide-moe-v1", "live-vllm-wide", 8, [1]), "kmax"),
        (("wide-moe-v1", "live-vllm-wide", 4, [1, 32]), "batch sizes [32]"),
        (("wide-moe-v1", "live-vllm-wide", 4, [1], 128), "max_tokens 48, this run has 128"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            abtest.fit_from_file(p, *args)
    with pytest.raises(ValueError, match="outside 0..4"):
        abtest.fit_from_file(_fit_doc(tmp_path, fit={"best_k": {"1": 7}}), "wide-moe-v1", "live-vllm-wide", 4, [1])
    (tmp_path / "bad.json").write_text("{not json")
    for bad in (tmp_path / "bad.json", tmp_path / "missing.json", _fit_doc(tmp_path, fit={"mode": "replay"})):
        with pytest.raises(ValueError, match="not an abtest.json with a train fit"):
            abtest.fit_from_file(bad, "wide-moe-v1", "live-vllm-wide", 4, [1])


def test_the_reused_fit_builds_the_table_from_every_fitted_batch_size_up_to_the_largest_run() -> None:
    # what run_abtest does with a reused fit at --batch 1,8: sizes above 8 dropped, 2 and 4 kept
    fitted = {1: 3, 2: 1, 4: 0, 8: 2, 16: 0}
    table = abtest.dsd_table({b: k for b, k in fitted.items() if b <= 8}, 8)
    assert table == [(1, 1, 3), (2, 3, 1), (4, 6, 0), (7, 8, 2)]


def test_pass_records_keep_every_timing_and_no_tokens_and_pair_as_the_passes_do() -> None:
    import json

    plain_name = "plain (no speculation)"
    mk = lambda walls, out: {**_timed(walls, [(0, 10.0, 11), (1, 12.0, 11)]), "outputs": out, "steps": 9}  # noqa: E731
    results = {
        (plain_name, 2): [mk([1.0, 1.0], [[1, 2], [3]]), mk([1.1, 0.9], [[1, 2], [3]])],
        ("arm", 2): [mk([0.5, 0.6], [[1, 2], [3]]), mk([0.7, 0.4], [[1, 2], [4]])],  # repeat 1 differs from plain
        ("arm", 4): [mk([0.5], [[9]])],  # a batch size plain did not run: no reference
    }
    recs = json.loads(json.dumps(abtest.pass_records(results, abtest.plain_outputs(results))))
    assert len(recs) == 5 and all("outputs" not in r for r in recs)
    by = {(r["arm"], r["batch"], r["repeat"]): r for r in recs}
    assert by[("arm", 2, 0)]["identical"] is True and by[("arm", 2, 1)]["identical"] is False
    assert by[("arm", 4, 0)]["identical"] is None
    assert by[("arm", 2, 1)]["groups"] == [{"wall_s": 0.7, "tokens": 10}, {"wall_s": 0.4, "tokens": 10}]
    assert by[("arm", 2, 0)]["steps"] == 9
    # the paired ratios from the records equal those from the passes themselves
    arm = [by[("arm", 2, i)] for i in range(2)]
    ref = [by[(plain_name, 2, i)] for i in range(2)]
    for phase in ("pass", "decode"):
        a, b = abtest._paired(arm, ref, phase), abtest._paired(results[("arm", 2)], results[(plain_name, 2)], phase)
        assert a == b and a is not None


def test_the_clock_check_compares_the_plain_engines_step_and_prefill_with_the_models() -> None:
    # the model's plain side: 100 steps of 2,000 ms in all (20 ms a step), 2 groups of 600 ms of prefill in all
    pred = abtest.BatchPrediction(1.2, 1.3, 1500.0, 2000.0, 700.0, 600.0, ar_steps=100, groups=2)

    def req(group: int, ttft: float, tpot: float) -> dict:
        return {"group": group, "ttft_ms": ttft, "tpot_ms": tpot, "tokens": 10}

    # two repeats of two groups of two requests; a group's prefill phase ends with its last first token
    plain = [
        {"requests": [req(0, 250.0, 21.0), req(0, 330.0, 22.0), req(1, 290.0, 21.0), req(1, 270.0, 22.0)]},
        {"requests": [req(0, 310.0, 22.0), req(0, 300.0, 21.0), req(1, 350.0, 22.0), req(1, 200.0, 21.0)]},
    ]
    c = abtest.clock_check(pred, plain)
    assert c is not None
    assert c["live_step_ms"] == pytest.approx(21.5) and c["model_step_ms"] == pytest.approx(20.0)
    assert c["step_ratio"] == pytest.approx(1.075)
    assert c["live_prefill_ms"] == pytest.approx((330 + 290 + 310 + 350) / 4) == 320.0
    assert c["prefill_ratio"] == pytest.approx(320.0 / 300.0)
    assert c["off"] is False  # 1.075 and 1.067: inside +-10%
    # a machine twice as fast as the recording's: flagged
    fast = [{"requests": [{**q, "tpot_ms": q["tpot_ms"] / 2} for q in r["requests"]]} for r in plain]
    c = abtest.clock_check(pred, fast)
    assert c is not None and c["step_ratio"] == pytest.approx(0.5375) and c["off"] is True
    # nothing to compare: no plain steps predicted, or no request timings
    assert abtest.clock_check(abtest.BatchPrediction(1, 1, 1, 1, 0, 0), plain) is None
    assert abtest.clock_check(pred, [{"requests": []}]) is None
