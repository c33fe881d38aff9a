"""The controller inside vLLM: k per request and round, losslessness, vLLM's own counters, fail-safe."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import KMAX, MAX_TOKENS, PROMPTS, controller_of, greedy, spec_metrics  # noqa: E402

from policies.heuristics import FixedK  # noqa: E402
from specenv.engines.vllm import load_recording, recording_status  # noqa: E402
from specenv.observation.single import ObservationSpec  # noqa: E402
from specenv.policy.base import Policy  # noqa: E402
from specenv.policy.mlp import MLPPolicy  # noqa: E402


@pytest.fixture
def ctl(engine):
    """The shared engine's controller, restored to 'no policy, not recording' afterwards."""
    c = controller_of(engine)
    yield c
    c.stop_recording()
    c.set_policy(None)
    c.settings.draft_horizon = "max"


def run(engine, prompts=PROMPTS):
    outs = engine.generate(prompts, greedy(), use_tqdm=False)
    return {o.prompt: o for o in outs}


def assert_lossless(outs, reference):
    for prompt, o in outs.items():
        ref = reference[prompt]
        assert list(o.outputs[0].token_ids) == ref["token_ids"], prompt
        assert o.outputs[0].text == ref["text"]
        assert len(o.outputs[0].token_ids) == MAX_TOKENS


class Alternating(Policy):
    """Alternates k between two values round by round; each request starts at the next phase.

    Stateful: the base class keeps one memory per request id (the one protocol).
    """

    name = "alternating"
    started = 0

    def __init__(self, spec, ks=(1, 3)):
        self.ks = ks
        super().__init__(spec)

    def _reset_state(self):
        self.i = 0

    def _act(self, obs):
        if self.view.first_round(obs):  # a new request: the next phase
            type(self).started += 1
            self.i = type(self).started % 2
        k = self.ks[self.i % 2]
        self.i += 1
        return k


class Flaky:
    """Returns garbage for some rows and raises on some steps (one act per step)."""

    name = "flaky"

    def __init__(self):
        self.n = 0

    def reset(self):
        self.n = 0

    def act(self, obs, ids=None, step=None):
        out = []
        for _ in range(len(obs)):
            self.n += 1
            bad = [RuntimeError("policy bug"), 99, -1, None, float("nan"), 2.5, "2"]
            choice = bad[self.n % len(bad)] if self.n % 3 == 0 else 2
            if isinstance(choice, Exception):
                raise choice
            out.append(choice)
        return np.array(out, dtype=object)


class FlakyBatch:
    """Stateless policy whose act fails on every other step (raises, then wrong shape)."""

    name = "flaky-batch"
    stateless = True

    def __init__(self):
        self.n = 0

    def reset(self):
        pass

    def act(self, obs, ids=None, step=None):
        self.n += 1
        if self.n % 4 == 1:
            raise ValueError("batch bug")
        if self.n % 4 == 3:
            return np.ones(len(obs) + 1, dtype=np.int64)
        return np.ones(len(obs), dtype=np.int64)


def test_alternating_policy_sets_each_rounds_k_and_stays_lossless(engine, ctl, plain_reference, tmp_path):
    ctl.set_policy(Alternating(ObservationSpec(kmax=KMAX, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)))
    rec = tmp_path / "rec"
    ctl.start_recording(str(rec), part_rounds=16, run="alternating")
    outs = run(engine)
    ctl.stop_recording()
    assert_lossless(outs, plain_reference)

    df = load_recording(rec).rounds
    assert len(df) > 0 and set(df["K"]) == {1, 3}
    assert (df["K"] == df["policy_k"]).all()  # the drafted (verified) count is exactly the chosen k
    assert (df["m"] == df["K"] + 1).all()
    assert (df["drafted"] == KMAX).all() and not df["fallback"].any() and not df["capped"].any()
    first = []
    for _, g in df.sort_values("round").groupby("generation_id"):
        ks = g["K"].to_numpy()
        assert (ks[1:] != ks[:-1]).all(), ks  # alternates round by round
        assert list(g["round"]) == list(range(len(g)))
        committed = (g["accepted"] + 1).to_numpy()
        assert committed.sum() == MAX_TOKENS - 1  # prefill made the first token; never past max_tokens
        first.append(ks[0])
    assert set(first) == {1, 3}  # requests start in different phases
    assert len(recording_status(rec)["parts"]) >= 2


def test_recorded_accepted_equals_vllm_spec_decode_metrics(engine, ctl, tmp_path):
    spec = ObservationSpec(kmax=KMAX, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)
    # one linear layer: score_k = 2*KMAX*progress*k - k^2, so k grows from 0 to KMAX over a generation
    ks = np.arange(KMAX + 1, dtype=float)
    W = np.zeros((spec.dim, KMAX + 1))
    W[spec.index("progress")] = 2.0 * KMAX * ks
    layers = [(W, -(ks**2) + 0.1 * ks)]
    folder = MLPPolicy(spec, layers, name="progress-mlp").save(tmp_path / "mlp")
    from specenv.engines.vllm import resolve_policy

    ctl.set_policy(resolve_policy(str(folder)))  # the numpy export, as `specenv serve --policy` loads it
    before = spec_metrics(engine)
    rec = tmp_path / "rec"
    ctl.start_recording(str(rec))
    run(engine)
    ctl.stop_recording()
    after = spec_metrics(engine)
    df = load_recording(rec).rounds

    def delta(name):
        return np.asarray(after[name]) - np.asarray(before.get(name, 0))

    assert df["K"].nunique() >= 3  # the MLP varies k
    # vLLM counts what the verifier accepted (accepted_raw); accepted stops where the request was cut
    assert int(delta("vllm:spec_decode_num_accepted_tokens")) == int(df["accepted_raw"].sum())
    assert (df["accepted"] <= df["accepted_raw"]).all()
    assert int(delta("vllm:spec_decode_num_draft_tokens")) == int(df["K"].sum())
    assert int(delta("vllm:spec_decode_num_drafts")) == int((df["K"] > 0).sum())
    per_pos = delta("vllm:spec_decode_num_accepted_tokens_per_pos")
    acc = df["accepted_raw"].to_numpy()
    assert list(per_pos) == [int((acc > j).sum()) for j in range(KMAX)]
    assert ctl.stats["fallbacks"] == 0


def test_failing_policy_falls_back_and_every_request_completes(engine, ctl, plain_reference, tmp_path):
    fallbacks = ctl.stats["fallbacks"]
    ctl.set_policy(Flaky())
    rec = tmp_path / "rec"
    ctl.start_recording(str(rec))
    outs = run(engine)
    ctl.stop_recording()
    assert_lossless(outs, plain_reference)  # every request completes, output unchanged
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs.values())
    assert ctl.stats["fallbacks"] > fallbacks
    df = load_recording(rec).rounds
    fb = df[df["fallback"]]
    assert len(fb) > 0 and (fb["K"] == ctl.fallback_k).all()
    assert (df.loc[~df["fallback"], "K"] == 2).all()

    ctl.set_policy(FlakyBatch())
    n = ctl.stats["fallbacks"]
    outs = run(engine, PROMPTS[:3])
    assert_lossless(outs, plain_reference)
    assert ctl.stats["fallbacks"] > n
    assert ctl.stats["errors"]  # the first errors are kept for the operator


def test_draft_horizon_policy_drafts_only_what_the_policy_uses(engine, ctl, plain_reference, tmp_path):
    spec = ObservationSpec(kmax=KMAX, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts)
    ctl.set_policy(FixedK(spec, 2))
    ctl.settings.draft_horizon = "policy"
    rec = tmp_path / "rec"
    ctl.start_recording(str(rec))
    outs = run(engine, PROMPTS[:3])
    ctl.stop_recording()
    assert_lossless(outs, plain_reference)
    df = load_recording(rec).rounds
    assert (df["K"] == 2).all() and (df["drafted"] == 2).all() and not df["capped"].any()
