"""The one policy protocol: act(obs (n, dim), ids, step) with memory per stream id, and the batch env's adapter."""

from __future__ import annotations

import numpy as np
import pytest

from policies.batch.controllers import FixedBatch, PerRequest, StepPolicy
from policies.caps.controllers import FixedCap
from policies.heuristics import FixedK, TransformersHeuristic
from specenv.observation.batch import BATCH_FEATURES, BatchObservationSpec
from specenv.observation.single import ObservationSpec, ObservationState
from specenv.policy.base import BatchStep, PolicyProtocol, act_batch_obs, policy_spec

SPEC = ObservationSpec(kmax=10, lookahead=0)


def _rows(history: list[list[tuple[int, int]]]) -> np.ndarray:
    """Observations of streams that ran the given (k, accepted) rounds (an empty history: a first round)."""
    out = []
    for rounds in history:
        one = ObservationState(SPEC, 1)
        for k, a in rounds:
            one.update(np.array([k]), np.array([a]), np.array([16.0]), np.array([1.5]), np.array([a + 1]))
        out.append(one.build(np.array([600.0]), np.array([float(sum(a + 1 for _, a in rounds))]))[0])
    return np.stack(out)


def test_memory_follows_the_id_not_the_row() -> None:
    p = TransformersHeuristic(SPEC, start=4)  # +2 after a fully accepted round, else -1 (floor 1)
    assert p.act(_rows([[], []]), ["a", "b"]).tolist() == [4, 4]
    # a accepted everything (n 4 -> 6), b did not (n 4 -> 3); rows come in the other order
    ks = p.act(_rows([[(4, 1)], [(4, 4)]]), ["b", "a"])
    assert ks.tolist() == [3, 6]
    # a third stream starts fresh beside them; a's memory goes on (6 -> 8)
    assert p.act(_rows([[(4, 4), (6, 6)], []]), ["a", "c"]).tolist() == [8, 4]


def test_release_forgets_a_stream_and_none_is_the_object_itself() -> None:
    p = TransformersHeuristic(SPEC, start=4)
    p.act(_rows([[]]), ["a"])
    p.act(_rows([[(4, 4)]]), ["a"])  # n = 6
    p.release(["a"])
    assert p.act(_rows([[(6, 6)]]), ["a"]).tolist() == [6]  # fresh memory (start 4), then +2
    one = _rows([[]])[0]
    assert p.act(one) == 4 and p.n == 4.0  # single-request use: a batch of one on the object's own memory
    assert p.act(_rows([[(4, 1)]])[0]) == 3 and p.n == 3.0


def test_batch_obs_adapter_gives_active_rows_slot_ids_and_the_batch_record() -> None:
    bspec = BatchObservationSpec(SPEC, 4)
    rows = _rows([[], [(3, 2)], [], [(5, 5)]])
    active = np.array([True, False, True, True])
    feats = np.array([0.75, 0.5, 0.25, 0.125], dtype=np.float32)
    flat = bspec.assemble(active, rows, feats)
    seen = []

    class Probe:
        name = "probe"

        def reset(self) -> None:
            pass

        def act(self, obs, ids=None, step=None):  # noqa: ANN001, ANN202
            seen.append((np.array(obs), list(ids), step))
            return np.array([7, 8, 9])

    k = act_batch_obs(Probe(), bspec, flat)
    assert k.tolist() == [7, 0, 8, 9]  # idle slot 1 gets 0
    obs, ids, step = seen[0]
    assert ids == [0, 2, 3]
    np.testing.assert_array_equal(obs, rows[[0, 2, 3]].astype(np.float32))
    assert step == BatchStep(0.75, 0.5, 0.25, 0.125)
    assert tuple(f for f in BatchStep.__dataclass_fields__) == BATCH_FEATURES


def test_batch_controller_alias_and_per_request_wrapper() -> None:
    bspec = BatchObservationSpec(SPEC, 3)
    rows = _rows([[], [(4, 4)], []])
    flat = bspec.assemble(np.array([True, True, False]), rows, np.zeros(4, dtype=np.float32))
    assert FixedBatch(bspec, 5).act(flat).tolist() == [5, 5, 0]  # the flat observation: the env's alias
    assert FixedBatch(bspec, 5).act(rows[:2], ["x", "y"]).tolist() == [5, 5]
    per = PerRequest(bspec, TransformersHeuristic(SPEC, start=4))
    # new streams start at 4; y's row shows a fully accepted round: +2
    assert per.act(rows[:2], ["x", "y"]).tolist() == [4, 6]
    assert per.act(flat).tolist() == [4, 6, 0]  # slots 0, 1 are new ids: fresh memory again
    step = StepPolicy(bspec, FixedK(SPEC, 2))
    assert step.act(rows, ["p", "q", "r"], BatchStep()).tolist() == [2, 2, 2]


def test_every_kind_speaks_the_protocol() -> None:
    bspec = BatchObservationSpec(SPEC, 2)
    for pol in (FixedK(SPEC, 1), TransformersHeuristic(SPEC), FixedBatch(bspec, 1)):
        assert isinstance(pol, PolicyProtocol)
        assert policy_spec(pol) is SPEC
    assert isinstance(FixedCap(FixedK(SPEC, 1), 1), PolicyProtocol)
    pair = FixedCap(FixedK(SPEC, 3), 2)
    assert pair.act(_rows([[], []])).tolist() == [[3, 2], [3, 2]]  # joint (k, cap) rows
    assert pair.act(_rows([[]])[0]).tolist() == [3, 2]
    with pytest.raises(ValueError, match="privileged"):
        from policies.learn.expert import OracleExpert

        OracleExpert.act(object.__new__(OracleExpert), _rows([[]]))


def test_served_peek_leaves_the_memory_as_it_was() -> None:
    from specenv.engines.vllm.served import ServedPolicy

    def run(peek: bool) -> list[int]:
        served = ServedPolicy(TransformersHeuristic(SPEC, start=4), SPEC, 4)
        out = served.act(_rows([[], []]), ["a", "b"], BatchStep()).tolist()
        if peek:  # what it would do on a hypothetical round: a fully accepted one for a, a miss for b
            assert served.peek(_rows([[(4, 4)], [(4, 0)]]), ["a", "b"], BatchStep()).tolist() == [6, 3]
        out += served.act(_rows([[(4, 1)], [(4, 4)]]), ["a", "b"], BatchStep()).tolist()
        return out

    assert run(peek=True) == run(peek=False) == [4, 4, 3, 6]
    bad = ServedPolicy(FixedBatch(BatchObservationSpec(SPEC, 2), 1), SPEC, 2)
    bad.policy.act = lambda obs, ids=None, step=None: np.zeros(len(obs) + 1)  # one budget too many
    with pytest.raises(ValueError, match=r"act returned shape \(3,\) for 2 observations"):
        bad.act(_rows([[], []]), ["a", "b"], None)


def test_rowwise_policies_answer_act_and_peek_in_one_call() -> None:
    from policies.heuristics import UCBBandit
    from specenv.engines.vllm.served import ServedPolicy, rowwise
    from specenv.policy.mlp import MLPPolicy

    rng = np.random.default_rng(3)
    dims = [SPEC.dim, 16, SPEC.kmax + 1]
    mlp = MLPPolicy(
        SPEC, [(rng.normal(size=(a, b)), rng.normal(size=b)) for a, b in zip(dims[:-1], dims[1:], strict=True)]
    )
    assert rowwise(mlp) and rowwise(FixedK(SPEC, 3))
    # memory per stream, rows decided jointly, an act of its own (may read the step): two calls
    assert not rowwise(UCBBandit(SPEC)) and not rowwise(FixedBatch(BatchObservationSpec(SPEC, 2), 1))
    assert not rowwise(FixedCap(FixedK(SPEC, 2), 1)) and not rowwise(object())
    spied = MLPPolicy(SPEC, mlp.weights)
    spied.act = lambda obs, ids=None, step=None: mlp.act(obs, ids, step)  # an act on the object itself
    assert not rowwise(spied)

    served = ServedPolicy(mlp, SPEC, 4)
    real, hyp = _rows([[], [(4, 1)], [(2, 2), (6, 3)]]), _rows([[(4, 4)], [(3, 3), (1, 0)]])
    # what act answers on the real rows and peek on the hypothetical ones, each asked alone
    alone = [int(mlp._act_rows(r[None])[0]) for r in np.concatenate([real, hyp])]
    both = served.act_and_peek(np.concatenate([real, hyp]), ["a", "b", "c", "a", "b"], BatchStep(n_active=0.5))
    assert both.tolist() == alone
    assert served.act(real, ["a", "b", "c"], None).tolist() == alone[:3]
    assert served.peek(hyp, ["a", "b"], None).tolist() == alone[3:]
    with pytest.raises(ValueError, match="not rowwise"):
        ServedPolicy(UCBBandit(SPEC), SPEC, 4).act_and_peek(real, ["a", "b", "c"], None)


def _same(a: object, b: object) -> bool:
    """Equal values: arrays elementwise, containers item by item, plain objects attribute by attribute."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dict__") and hasattr(b, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and _same(vars(a), vars(b))
    return a == b


def test_a_peek_copies_only_the_asked_streams_and_answers_as_a_full_copy() -> None:
    """Per-request policies are peeked on copies of the asked requests' memories (served.stream_copy)."""
    from policies.delta import DeltaSpaceRule
    from policies.heuristics import UCBBandit
    from specenv.cost.model import CostModel
    from specenv.engines.vllm.served import ServedPolicy, clone, per_stream

    cm = CostModel(beta0=np.linspace(5, 9, SPEC.kmax + 1), alpha=np.full(SPEC.kmax + 1, 0.05),
                   c=np.full(SPEC.kmax + 1, 1e-4), d0=0.3, d1=0.6, top_k=4)  # fmt: skip
    rng = np.random.default_rng(11)
    for make in (
        lambda: TransformersHeuristic(SPEC, start=4),
        lambda: DeltaSpaceRule(SPEC, cm, adaptive=True),
        lambda: UCBBandit(SPEC),
    ):
        assert per_stream(make())
        plain, peeked = ServedPolicy(make(), SPEC, 4), ServedPolicy(make(), SPEC, 4)
        hist: dict[str, list[tuple[int, int]]] = {i: [] for i in "abc"}
        for _ in range(12):
            ids = list(rng.choice(list("abc"), size=int(rng.integers(1, 4)), replace=False))
            rows = _rows([hist[i] for i in ids])
            hyp = _rows([hist[i] + [(4, int(rng.integers(0, 5)))] for i in ids] + [[]])
            full = clone(peeked.policy).act(hyp, ids + ["new"], None).tolist()
            before = clone(peeked.policy)
            assert peeked.peek(hyp, ids + ["new"], None).tolist() == full  # the same answers as a whole copy
            assert set(peeked.policy._streams) == set(before._streams)  # no stream added by the peek ...
            for i, s in peeked.policy._streams.items():  # ... and none changed
                assert _same(vars(s), vars(before._streams[i])), i
            ks = plain.act(rows, ids, None).tolist()
            assert peeked.act(rows, ids, None).tolist() == ks
            for i, k in zip(ids, ks, strict=True):
                hist[i].append((k, int(rng.integers(0, k + 1))))
