"""The verification-time expert cap of the transformers engine (issue 17, item 1).

Capped engines are not lossless: only the cap-off cases are compared with plain greedy.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from specenv.engines.base import BackendConfig, make_backend  # noqa: E402
from specenv.engines.hf import LiveEngine, load_models, load_prompts  # noqa: E402
from specenv.engines.hf.engine import cap_routing  # noqa: E402

KMAX, NEW, PROMPTS = 3, 16, (0, 1)


@pytest.fixture(scope="module")
def models():
    return load_models()


@pytest.fixture(scope="module")
def ids(models):
    prompts = load_prompts()
    return [models.encode(prompts[i].text) for i in PROMPTS]


def engine(models, cap):
    return LiveEngine(models, kmax=KMAX, max_new_tokens=NEW, expert_cap=cap)


def rounds_key(rounds):
    return [(r.k, r.accepted, r.committed, r.U_r, r.E_max, r.q) for r in rounds]


def per_layer_union(routing):
    return [len(np.unique(routing[layer])) for layer in range(routing.shape[0])]


def test_cap_off_is_plain_greedy_and_unchanged(models, ids):
    off, noop = engine(models, None), engine(models, models.n_experts)
    try:
        for p in ids:
            ref, _ = off.generate(p, 0)
            toks, rounds = off.generate(p, KMAX)
            assert toks == ref
            toks2, rounds2 = noop.generate(p, KMAX)  # a cap of every expert drops nothing
            assert toks2 == ref and rounds_key(rounds2) == rounds_key(rounds)
    finally:
        off.close()
        noop.close()


@pytest.mark.parametrize("cap", [6])
def test_cap_bounds_the_union_of_every_verification(models, ids, cap):
    eng = engine(models, cap)
    capped = 0
    try:
        for p in ids:
            eng.start(p)
            while not eng.done:
                r = eng.step(KMAX)
                assert r.U_r <= cap
                assert max(per_layer_union(eng.last_routing)) <= cap
                assert eng.last_uncapped_U >= r.U_r
                capped += eng.last_uncapped_U > cap
    finally:
        eng.close()
    assert capped  # the cap did bind somewhere (4 positions x top-4 of 64 experts)


def test_plain_decoding_is_never_capped(models, ids):
    off, tight = engine(models, None), engine(models, 2)  # B below top_k
    try:
        for p in ids:
            ref, r0 = off.generate(p, 0)
            toks, r1 = tight.generate(p, 0)
            assert toks == ref and rounds_key(r1) == rounds_key(r0)
            assert all(r.U_r == models.top_k for r in r1)
            tight.start(p)
            for k in (KMAX, 0, KMAX, 0):  # a k = 0 round after capped rounds is not capped either
                r = tight.step(k)
                assert r.U_r == models.top_k if k == 0 else r.U_r <= 2
                if tight.done:
                    break
    finally:
        off.close()
        tight.close()


def test_cap_routing_rule():
    # 3 positions, 6 experts, top-2; weights sum to 1 per row
    idx = torch.tensor([[0, 1], [0, 2], [3, 4]])
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    logits = torch.tensor([[5.0, 4, 0, 0, 0, 3], [5, 0, 4, 0, 0, 0], [0, 2, 1, 5, 4, 0]])
    assert cap_routing(logits, w, idx, 5) is None  # union of 5 fits
    cw, ci = cap_routing(logits, w, idx, 2)  # scores: e0 1.3, e3 0.9, e1 0.4, e2 0.3, e4 0.1
    assert ci.tolist() == [[0, 0], [0, 0], [3, 3]]
    assert torch.allclose(cw, torch.tensor([[1.0, 0], [1.0, 0], [1.0, 0]]))
    cw, ci = cap_routing(logits, w, idx, 1)  # only e0: row 2 falls back to the kept set
    assert ci.tolist() == [[0, 0], [0, 0], [0, 0]] and torch.allclose(cw[:, 0], torch.ones(3))
    cw, ci = cap_routing(logits, w, idx, 3)  # e0, e3, e1 kept: row 0 keeps both, row 2 loses e4
    assert ci.tolist() == [[0, 1], [0, 0], [3, 3]]
    assert torch.allclose(cw, torch.tensor([[0.6, 0.4], [1.0, 0], [1.0, 0]]))


def test_backend_config_option(models):
    be = make_backend("hf", "small-moe-v1", BackendConfig(kmax=2, max_new_tokens=4, expert_cap=8))
    try:
        assert be.expert_cap == 8
    finally:
        be.close()
    with pytest.raises(ValueError, match="expert_cap"):
        LiveEngine(models, kmax=2, expert_cap=0)


# ---------------------------------------------------------------------- counterfactual data (issue 17 item 2)
SWEEP_NEW, SWEEP_KMAX, SWEEP_CAPS = 12, 3, (5, 8)


@pytest.fixture(scope="module")
def cap_sweep(models, ids):
    """The reference of prompt 0 and its sweep with caps (plus the cap that drops nothing, n_experts)."""
    eng = LiveEngine(models, kmax=SWEEP_KMAX, max_new_tokens=SWEEP_NEW)
    try:
        ref, _ = eng.generate(ids[0], 0)
        plain = eng.sweep(ids[0], ref, SWEEP_KMAX)
        sw = eng.sweep(ids[0], ref, SWEEP_KMAX, caps=(*SWEEP_CAPS, models.n_experts))
    finally:
        eng.close()
    return ref, plain, sw


def direct_logits(models, seq, m, cap):
    """Target logits of the last m positions of ``seq`` in one forward without a cache, the cap over those m."""

    def hook(module, args, output):
        if cap is None:
            return None
        logits, w, idx = output
        capped = cap_routing(logits[-m:], w[-m:], idx[-m:], cap)
        if capped is None:
            return None
        return logits, torch.cat([w[:-m], capped[0]]), torch.cat([idx[:-m], capped[1]])

    gates = [layer.mlp.gate for layer in models.target.model.layers if hasattr(layer.mlp, "gate")]
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        with torch.inference_mode():
            return models.target(input_ids=torch.tensor([seq])).logits[0, -m:].double()
    finally:
        for h in handles:
            h.remove()


def test_sweep_with_caps_keeps_the_uncapped_columns(cap_sweep, models):
    ref, plain, sw = cap_sweep
    for key in ("rho", "q", "U", "E", "ent", "margin"):
        assert np.array_equal(plain[key], sw[key]), key
    assert sw["acc_cap"].shape == (len(SWEEP_CAPS) + 1, SWEEP_KMAX + 1, len(ref))
    # the cap of every expert drops nothing: the uncapped verdicts, U and no quality loss
    lead = np.cumprod(plain["rho"] > 0.5, axis=1)
    for k in range(1, SWEEP_KMAX + 1):
        assert np.array_equal(sw["acc_cap"][-1, k], lead[:, :k].sum(axis=1))
        assert np.array_equal(sw["U_cap"][-1, k], plain["U"][:, k])
        assert (sw["mis_cap"][-1, k] == 0).all()
        assert np.abs(sw["lpgap_cap"][-1, k]).max() < 1e-4
    # U never exceeds the cap; tighter caps never load more experts
    for c, B in enumerate(SWEEP_CAPS):
        assert sw["U_cap"][c, 1:].max() <= B
    assert (sw["U_cap"][0] <= sw["U_cap"][1] + 1e-6).all()
    assert sw["mis_cap"][0].sum() > 0  # the tight cap changes tokens on this prompt: the check below has teeth


@pytest.mark.parametrize("t", [0, 5, 9])
def test_recorded_cap_metrics_match_a_direct_comparison(cap_sweep, models, ids, t):
    """acc, U, mis from an independent capped engine round; lpgap and tokens from cache-free forwards."""
    ref, _, sw = cap_sweep
    P, N = len(ids[0]), len(ref)
    ctx = [*ids[0], *ref[:t]]
    for c, B in enumerate(SWEEP_CAPS):
        eng = LiveEngine(models, kmax=SWEEP_KMAX, max_new_tokens=SWEEP_KMAX + 2, expert_cap=B, stop_at_eos=False)
        try:
            for k in range(1, SWEEP_KMAX + 1):
                eng.start(ctx)
                r = eng.step(k)
                assert sw["acc_cap"][c, k, t] == r.accepted
                assert sw["U_cap"][c, k, t] == pytest.approx(r.U_r, abs=1e-6)
                mis = sum(tok != ref[t + j] for j, tok in enumerate(r.committed) if t + j < N)
                assert sw["mis_cap"][c, k, t] == mis
                seq = [*ctx, *r.drafted]
                lu = torch.log_softmax(direct_logits(models, seq, k + 1, None), -1)
                lc = torch.log_softmax(direct_logits(models, seq, k + 1, B), -1)
                g = lu.argmax(-1)
                gap = float((lu[torch.arange(k + 1), g] - lc[torch.arange(k + 1), g]).mean())
                assert sw["lpgap_cap"][c, k, t] == pytest.approx(gap, abs=2e-4)
                gc = lc.argmax(-1).tolist()  # the capped verdict, recomputed without a cache
                assert list(r.committed) == [*r.drafted[: r.accepted], gc[r.accepted]]
        finally:
            eng.close()
    assert P + t == len(ctx)
