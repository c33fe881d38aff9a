"""The batch-step recorder on the session's engine: a valid steps table, vLLM's draft loop, callbacks restored."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import KMAX, PROMPTS, controller_of  # noqa: E402

from specenv.cost.batchfit import STEPS_FORMAT, check_steps  # noqa: E402
from specenv.engines.vllm.batchrec import record_batch_steps  # noqa: E402


def test_record_batch_steps(engine):
    ctl = controller_of(engine)
    before = (ctl.round_callback, ctl.forward_callback, ctl.draft_tokens, ctl.policy)
    tok = engine.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    steps, stats = record_batch_steps(engine, prompts, [1, 2, 4], reps=2, max_tokens=12, kmax=KMAX, seed=3)
    assert (ctl.round_callback, ctl.forward_callback, ctl.draft_tokens, ctl.policy) == before
    manifest = {
        "format": STEPS_FORMAT,
        "name": "t",
        "model": {"n_layers": ctl.tap.n_layers, "n_experts": ctl.n_experts, "top_k": ctl.top_k},
        "kmax": KMAX,
        "max_batch": 4,
    }
    check_steps(steps, manifest)  # bounds of every union, positions = sum(k+1), times > 0...
    assert stats["groups"] == 6 and stats["steps"] == len(steps) > 10
    # every group's prefill phase: the prompts it took (cycling), timed until each request had a token
    pre = stats["prefill"]
    assert [p["B"] for p in pre] == [1, 2, 4] * 2 and {p["engine"] for p in pre} == {"spec"}
    cursor = 0
    for p in pre:
        assert p["prompt_tokens"] == sum(len(prompts[(cursor + i) % len(prompts)]) for i in range(p["B"]))
        cursor += p["B"]
        assert p["prefill_ms"] > 0 and p["prefill_steps"] >= 1
    # the pure steps come after the prefill: no kept step's group is still prefilling (its first row has
    # every request of the group running a verification round)
    assert (steps.groupby("group")["B"].first() == pd.Series({p["group"]: p["B"] for p in pre})).all()
    assert {1, 2, 4} <= set(steps["B"])
    # vLLM's drafter runs the step's n forward passes for the whole batch
    assert (steps["draft_calls"] == steps["drafted"]).all()
    assert steps["drafted"].nunique() > 1 and steps["positions"].nunique() > 3
    # a k = 0 request verifies one position: its own union is top_k
    for k, U in zip(steps["k"], steps["U"], strict=True):
        assert np.all(np.asarray(U)[np.asarray(k) == 0] == ctl.top_k)
    # a k drawn for a request never exceeds the drafts proposed for it in its previous step
    by_group = steps.sort_values(["group", "step"])
    prev = by_group.groupby("group")["drafted"].shift(1)
    consecutive = by_group["step"].diff() == 1
    mask = consecutive & prev.notna()
    kmax_row = by_group["k"].map(max)
    assert (kmax_row[mask] <= prev[mask]).all()


def test_uniform_steps_draft_and_verify_the_fixed_k_for_every_request(engine):
    ctl = controller_of(engine)
    tok = engine.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    k = min(2, KMAX)
    steps, _ = record_batch_steps(engine, prompts, [2], reps=2, max_tokens=16, kmax=k, seed=0, uniform=True)
    assert len(steps) > 4
    assert (steps["drafted"] == k).all() and (steps["draft_calls"] == k).all()  # every step drafts k
    # every request verifies all k drafts, but where vLLM trims a round at the end of its generation
    for _, g in steps.sort_values(["group", "step"]).groupby("group"):
        inner = g.iloc[:-2]  # the last steps of a group may verify fewer (the tokens left)
        assert all(list(ks) == [k] * len(ks) for ks in inner["k"]), inner["k"].tolist()
        assert (g["k"].map(max) <= k).all()
    # the policy's k is the drafts proposed: the random draw is not used
    from specenv.engines.vllm.batchrec import RandomK

    pol = RandomK(KMAX, seed=5, drafted=lambda: k, uniform=True)
    assert pol.act(np.zeros((3, 4))).tolist() == [k, k, k]
    assert ctl.policy is not pol


def test_fixed_share_groups_serve_one_k_and_the_rest_stay_random(engine):
    ctl = controller_of(engine)
    before = (ctl.round_callback, ctl.forward_callback, ctl.draft_tokens, ctl.policy)
    tok = engine.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    steps, stats = record_batch_steps(
        engine, prompts, [2, 3], reps=4, max_tokens=16, kmax=KMAX, seed=4, fixed_share=0.5
    )
    assert (ctl.round_callback, ctl.forward_callback, ctl.draft_tokens, ctl.policy) == before
    fixed = {int(g): k for g, k in stats.get("fixed_groups", {}).items()}
    assert 0 < len(fixed) < stats["groups"]  # some groups of each kind (seed 4: drawn, not all or none)
    assert all(1 <= k <= KMAX for k in fixed.values())
    for group, g in steps.sort_values(["group", "step"]).groupby("group"):
        if group in fixed:
            k = fixed[group]
            assert (g["drafted"] == k).all()  # every step of the group drafts its k
            inner = g.iloc[:-2]  # the last steps may verify fewer (the tokens left)
            assert all(list(ks) == [k] * len(ks) for ks in inner["k"]), (group, inner["k"].tolist())
    # a random group draws its draft lengths: over the random groups they vary
    random_rows = steps[~steps["group"].isin(list(fixed))]
    assert random_rows["drafted"].nunique() > 1
    with pytest.raises(ValueError, match="fixed_share"):
        record_batch_steps(engine, prompts, [2], reps=1, max_tokens=4, kmax=KMAX, fixed_share=1.5)
