"""A served policy of each kind through the one protocol: a heuristic, a peer, a learned MLP, a batch controller.

Every policy runs in the shared engine through the controller's one call path,
``policy.act(obs, request_ids, step)`` (:mod:`specenv.engines.vllm.served`), the method the replay
environments call. Each test wraps the policy object's ``act`` to see every call, and checks: the calls
came through the protocol (stacked rows, one request id per row, a ``BatchStep``), greedy output equals
plain decoding, the recorded rounds verified what the policy returned, and the returned budgets equal a
reference computed here without the policy's code (its published rule, or the network's matrices).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import KMAX, MAX_TOKENS, PROMPTS, controller_of, greedy  # noqa: E402

from policies.batch.controllers import GoodputBatch  # noqa: E402
from policies.caps.controllers import FixedCap  # noqa: E402
from policies.heuristics import FixedK, TransformersHeuristic  # noqa: E402
from specenv.cost.batch import load_batch_cost_model  # noqa: E402
from specenv.engines.vllm import load_recording, resolve_policy  # noqa: E402
from specenv.observation.batch import BatchObservationSpec  # noqa: E402
from specenv.observation.single import ObservationSpec  # noqa: E402
from specenv.policy.base import BatchStep  # noqa: E402
from specenv.policy.mlp import MLPPolicy  # noqa: E402

FOUR = PROMPTS[:4]  # the shared engine runs max_num_seqs = 4


@pytest.fixture
def ctl(engine):
    """The shared engine's controller, restored to 'no policy, not recording' afterwards."""
    c = controller_of(engine)
    yield c
    c.stop_recording()
    c.set_policy(None)


def _spec(ctl, h: int = 0, signals: tuple[str, ...] = ("q",)) -> ObservationSpec:
    return ObservationSpec(kmax=KMAX, lookahead=h, max_new_tokens=MAX_TOKENS, n_experts=ctl.n_experts, signals=signals)


def _serve(engine, ctl, policy, tmp_path):
    """Run FOUR through the engine with ``policy`` installed and its ``act`` spied on; (calls, rounds, dim)."""
    calls: list[tuple[np.ndarray, list, object, np.ndarray]] = []
    inner = policy.act

    def act(obs, ids=None, step=None):  # noqa: ANN001, ANN202
        out = inner(obs, ids, step)
        calls.append((np.array(obs), list(ids), step, np.asarray(out).copy()))
        return out

    policy.act = act  # the instance's method: what the controller calls
    ctl.set_policy(policy)
    dim = ctl.spec.dim
    ctl.start_recording(str(tmp_path / "rec"))
    outs = engine.generate(FOUR, greedy(), use_tqdm=False)
    ctl.stop_recording()
    ctl.set_policy(None)
    return calls, {o.prompt: list(o.outputs[0].token_ids) for o in outs}, load_recording(tmp_path / "rec").rounds, dim


def _check_protocol(calls, outs, rounds, dim, plain_reference):
    """The calls came through the one protocol, output is lossless, each round verified the policy's k."""
    assert calls, "the policy's act was never called"
    for obs, ids, step, out in calls:
        assert obs.ndim == 2 and obs.shape == (len(ids), dim) and len(set(ids)) == len(ids)
        assert all(isinstance(i, str) for i in ids)  # the server's request ids
        assert isinstance(step, BatchStep) and step.n_active == pytest.approx(len(ids) / 4)
        assert 0.0 <= step.queue <= 1.0 and 0.0 <= step.prev_U_batch <= 1.0 and step.prev_step_cost >= 0.0
        assert out.shape == (len(ids),)
    assert max(len(ids) for _, ids, _, _ in calls) > 1  # a batch of requests in one call
    for p in FOUR:
        assert outs[p] == plain_reference[p]["token_ids"], p
    decided: dict[str, list[int]] = {}
    for _, ids, _, out in calls:
        for rid, k in zip(ids, out, strict=True):
            decided.setdefault(rid, []).append(int(k))
    assert set(rounds["request_id"]) == set(decided)
    assert not rounds["fallback"].any()
    for rid, g in rounds.sort_values("round").groupby("request_id"):
        ks = decided[rid]
        assert list(g["policy_k"]) == ks[: len(g)]  # round r ran the r-th decision for the request
        assert (g["K"] == np.minimum(g["policy_k"], g["drafted"])).all()  # and verified exactly that k
    return decided


def test_heuristic_transformers_schedule(engine, ctl, plain_reference, tmp_path):
    pol = TransformersHeuristic(_spec(ctl), start=2)
    calls, outs, rounds, dim = _serve(engine, ctl, pol, tmp_path)
    _check_protocol(calls, outs, rounds, dim, plain_reference)
    # transformers' schedule by hand from what each round verified: +2 after a fully accepted round, else -1
    for _, g in rounds.sort_values("round").groupby("request_id"):
        n, want = 2.0, []
        for K, a in zip(g["K"], g["accepted"], strict=True):
            want.append(int(min(n, KMAX)))
            n = n + 2.0 if (K >= 1 and a == K) else max(1.0, n - 1.0)
        assert list(g["policy_k"]) == want
    assert rounds["policy_k"].nunique() >= 2  # the schedule moved


def test_peer_svip_entropy_stop(engine, ctl, plain_reference, tmp_path):
    spec = _spec(ctl, KMAX, ("q", "ent"))
    ent = [spec.index(f"ent_{j}") for j in range(1, KMAX + 1)]
    # a first run that never stops shows this draft's entropies; the threshold h is their median
    calls, *_ = _serve(engine, ctl, resolve_policy("svip:h=1000", spec), tmp_path / "probe")
    h = float(np.median(np.sqrt(np.concatenate([c[0][:, ent] for c in calls]).astype(np.float64))))
    pol = resolve_policy(f"svip:h={h!r}", spec)  # the registered peer, as `specenv serve --policy` names it
    calls, outs, rounds, dim = _serve(engine, ctl, pol, tmp_path / "svip")
    _check_protocol(calls, outs, rounds, dim, plain_reference)
    # SVIP's rule by hand: stop after the first draft whose sqrt(entropy) exceeds h, else draft all h
    for obs, _, _, out in calls:
        stop = np.sqrt(np.maximum(obs[:, ent].astype(np.float64), 0.0)) > h
        want = np.where(stop.any(axis=1), stop.argmax(axis=1) + 1, KMAX)
        np.testing.assert_array_equal(out, want)
    assert len(np.unique(np.concatenate([c[3] for c in calls]))) >= 2


def test_learned_mlp_export(engine, ctl, plain_reference, tmp_path):
    spec = _spec(ctl)
    rng = np.random.default_rng(3)
    layers = [
        (rng.normal(size=(spec.dim, 16)), rng.normal(size=16)),
        (rng.normal(size=(16, KMAX + 1)), rng.normal(size=KMAX + 1)),
    ]
    folder = MLPPolicy(spec, layers, name="random-mlp").save(tmp_path / "mlp")
    pol = resolve_policy(str(folder))  # the numpy export, as `specenv serve --policy` loads it
    calls, outs, rounds, dim = _serve(engine, ctl, pol, tmp_path)
    _check_protocol(calls, outs, rounds, dim, plain_reference)
    with np.load(folder / "weights.npz") as z:  # the network by hand from the exported arrays
        W0, b0, W1, b1 = (z[n] for n in ("W0", "b0", "W1", "b1"))
    for obs, _, _, out in calls:
        x = obs.astype(np.float32)
        np.testing.assert_array_equal(out, np.argmax(np.tanh(x @ W0 + b0) @ W1 + b1, axis=1))


def test_batch_controller_goodput(engine, ctl, plain_reference, tmp_path):
    bc = load_batch_cost_model()
    ks = np.arange(KMAX + 1)
    pol = GoodputBatch(BatchObservationSpec(_spec(ctl), 4), bc, np.minimum(bc.n_experts, bc.top_k * (ks + 1.0) ** 0.62))
    calls, outs, rounds, dim = _serve(engine, ctl, pol, tmp_path)
    _check_protocol(calls, outs, rounds, dim, plain_reference)
    for _, _, _, out in calls:
        assert len(set(out.tolist())) == 1  # one k for the whole step (SmartSpec at batch level)
    assert pol.acc == {}  # every finished request released its estimator
    assert any(step.prev_step_cost > 0 for _, _, step, _ in calls)  # the clock fed the batch record


def test_unservable_controllers_are_refused_in_one_line(ctl):
    bc = load_batch_cost_model()
    cases = [
        (GoodputBatch(BatchObservationSpec(_spec(ctl), 2), bc, np.full(KMAX + 1, 8.0)), "at most 2 requests"),
        (FixedCap(FixedK(_spec(ctl), 2), 1), "expert cap"),
    ]
    for policy, words in cases:
        with pytest.raises(ValueError) as info:
            ctl.set_policy(policy)
        assert "\n" not in str(info.value) and words in str(info.value), str(info.value)
    assert ctl.policy is None
