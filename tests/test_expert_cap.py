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
