"""Draft confidences reach the controller: captured q equals the draft's own softmax, block policies stay lossless.

Engines: the session's shared in-process engine (``KMAX`` drafts, tap bound) and the plain greedy
reference subprocess; the draft model is also loaded once with transformers to recompute q.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import KMAX, PROMPTS, controller_of, greedy  # noqa: E402

from policies.heuristics import ConfidenceThreshold  # noqa: E402
from specenv.observation.single import ObservationSpec  # noqa: E402
from specenv.policy.mlp import MLPPolicy  # noqa: E402

N_TOKENS = 16
TWO = PROMPTS[:2]


@pytest.fixture
def ctl(engine):
    """The shared engine's controller, restored to 'no policy' afterwards."""
    c = controller_of(engine)
    yield c
    c.set_policy(None)


def _spec(ctl, h: int, signals: tuple[str, ...] = ("q",)) -> ObservationSpec:
    """A block spec with h drafts; with observation contract v2 also the named signals."""
    kw = {"signals": signals} if "signals" in {f.name for f in dataclasses.fields(ObservationSpec)} else {}
    return ObservationSpec(kmax=KMAX, lookahead=h, max_new_tokens=N_TOKENS, n_experts=ctl.n_experts, **kw)


def _generate(engine) -> dict[str, list[int]]:
    outs = engine.generate(TWO, greedy(N_TOKENS), use_tqdm=False)
    return {o.prompt: list(o.outputs[0].token_ids) for o in outs}


def _assert_plain(outs, reference) -> None:
    for prompt, ids in outs.items():
        assert ids == reference[prompt]["token_ids"][:N_TOKENS], prompt


def test_captured_q_equals_the_draft_models_softmax_recomputed_with_transformers(
    engine, ctl, model_dirs, plain_reference, monkeypatch
):
    import torch
    from transformers import AutoModelForCausalLM

    ctl.set_policy(ConfidenceThreshold(_spec(ctl, KMAX), threshold=0.4))
    seen: list[tuple[list[int], list[int], np.ndarray]] = []
    base = ctl.update_draft_token_ids

    def spy(dti):
        base(dti)
        for req_id in dti.req_ids:
            request, st = ctl.requests.get(req_id), ctl._reqs.get(req_id)
            if request is not None and st is not None and st.signals is not None:
                seen.append((list(request.all_token_ids), list(st.full_drafts), st.signals.copy()))

    monkeypatch.setattr(ctl, "update_draft_token_ids", spy)
    _plain = _generate(engine)
    _assert_plain(_plain, plain_reference)
    assert len(seen) >= 4 and ctl.stats["no_signals"] == 0
    assert ctl.tap.captured_steps > 0 and ctl.summary()["capture_ms"] > 0

    draft = AutoModelForCausalLM.from_pretrained(str(model_dirs.draft), torch_dtype=torch.float32).eval()
    worst = np.zeros(3)
    for prefix, drafts, sig in seen:
        assert sig.shape == (KMAX, 3) and len(drafts) == KMAX
        ids = torch.tensor([prefix + drafts[:-1]])
        with torch.no_grad():
            logits = draft(ids).logits[0, len(prefix) - 1 :].double()
        p = torch.softmax(logits, dim=-1)
        top = torch.topk(p, 2, dim=-1).values
        q = p[torch.arange(KMAX), torch.tensor(drafts)].numpy()
        ent = torch.special.entr(p).sum(-1).numpy()
        margin = (top[:, 0] - top[:, 1]).numpy()
        assert (p.argmax(-1).numpy() == np.array(drafts)).all() or np.abs(margin).min() < 1e-4  # greedy drafts
        worst = np.maximum(worst, np.abs(np.stack([q, ent, margin], 1) - sig).max(0))
    assert worst[0] < 1e-4 and worst[2] < 1e-4 and worst[1] < 1e-3, worst  # measured: ~1e-6


def test_block_policies_are_lossless_and_see_the_signals(engine, ctl, plain_reference):
    # a confidence rule in block mode (stateful, per-request copies)
    ctl.set_policy(ConfidenceThreshold(_spec(ctl, KMAX), threshold=0.4))
    before = {key: ctl.stats[key] for key in ("decisions", "no_signals", "fallbacks")}  # the engine is shared
    _assert_plain(_generate(engine), plain_reference)
    delta = {key: ctl.stats[key] - before[key] for key in before}
    assert delta["decisions"] > 0 and delta["no_signals"] == 0 and delta["fallbacks"] == 0, (delta, ctl.stats)

    # an exported MLP with lookahead h = 2 (one act per step), reading every signal the contract has
    spec = _spec(ctl, 2, ("q", "ent", "margin"))
    rng = np.random.default_rng(0)
    mlp = MLPPolicy(
        spec,
        [(rng.normal(size=(spec.dim, 8)), rng.normal(size=8)), (rng.normal(size=(8, KMAX + 1)), np.zeros(KMAX + 1))],
    )
    seen = []

    class Seeing(MLPPolicy):
        def act(self, obs, ids=None, step=None):
            seen.append(np.array(obs))
            return super().act(obs, ids, step)

    pol = Seeing(spec, mlp.weights, name="seeing")
    ctl.set_policy(pol)
    before = dict(ctl.stats)
    _assert_plain(_generate(engine), plain_reference)
    assert ctl.stats["decisions"] > before["decisions"] and ctl.stats["fallbacks"] == before["fallbacks"]
    obs = np.concatenate(seen)
    conf = obs[:, [spec.index(f"conf_{j}") for j in (1, 2)]]
    assert (conf > 0).all() and (conf <= 1).all() and len(np.unique(conf)) > 2

    # without a lookahead policy the capture is off (it costs a softmax per draft step)
    ctl.set_policy(None)
    n = ctl.tap.captured_steps
    _assert_plain(_generate(engine), plain_reference)
    assert ctl.tap.captured_steps == n


def test_refusals_are_one_line(ctl):
    class Sequential(ConfidenceThreshold):
        drafting = "sequential"

    cases = [
        (Sequential(_spec(ctl, KMAX)), "sequential"),
        (ConfidenceThreshold(dataclasses.replace(_spec(ctl, KMAX), kmax=KMAX + 1, lookahead=KMAX + 1)), ">="),
    ]
    odd = ConfidenceThreshold(_spec(ctl, 2))
    object.__setattr__(odd.spec, "signals", ("q", "hidden_state"))
    cases.append((odd, "hidden_state"))
    for policy, word in cases:
        with pytest.raises(ValueError) as info:
            ctl.set_policy(policy)
        msg = str(info.value)
        assert "\n" not in msg and word in msg, msg
    assert ctl.policy is None


def test_live_backend_shows_the_confidences_of_the_next_round(backend, plain_reference):
    ids = backend.models.encode(PROMPTS[0])
    before = backend.lookahead
    backend.lookahead = KMAX
    try:
        backend.start(ids)
        rounds = 0
        while not backend.done:
            q = backend.propose(KMAX)
            assert len(q) == KMAX and all(0 < x <= 1 for x in q)
            assert len(backend.draft_entropy) == len(backend.draft_margin) == KMAX
            k = next((j for j, x in enumerate(q, 1) if x < 0.4), KMAX)  # a confidence stop in block mode
            assert backend.step(k).k == k
            rounds += 1
        assert backend.generated == plain_reference[PROMPTS[0]]["token_ids"] and rounds > 1
    finally:
        backend.lookahead = before
        backend.abort()
