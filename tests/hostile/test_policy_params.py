"""Hostile policy parameters: typed and ranged by each policy's declaration, one line naming the parameter.

``registry.check`` (no spec: ``serve``'s pre-start check) and ``registry.resolve`` (the API, ``export``,
``bench``, the vLLM controller) refuse the same strings with the same line, before any fitting.
"""

from __future__ import annotations

import numpy as np
import pytest

from specenv.observation.single import ObservationSpec
from specenv.policy import registry
from tests.hostile.harness import reject_cleanly

SPEC = ObservationSpec(6, 0)
SPEC_H = ObservationSpec(6, 6, signals=("q", "ent", "margin"))

# (string, parameter named, spec that would otherwise build it)
BAD: list[tuple[str, str]] = [
    ("ucb:c=nan", "'c'"),
    ("ucb:c=-1", "'c'"),
    ("ucb:c=inf", "'c'"),
    ("fixed-k:k=4.5", "'k'"),
    ("fixed-k:k=true", "'k'"),
    ("fixed-k:k=", "'k'"),
    ("fixed-k:k=4,k=5", "'k' given twice"),
    ("fixed-k:k=-1", "'k'"),
    ("adaedl:lam=inf", "'lam'"),
    ("adaedl:lam=0.5,gamma=nan", "'gamma'"),
    ("adaedl:lam=0.5,gamma=0", "'gamma'"),
    ("svip:h=nan", "'h'"),
    ("svip:h=-1", "'h'"),
    ("confidence-threshold:threshold=nan", "'threshold'"),
    ("confidence-threshold:threshold=1.5", "'threshold'"),
    ("confidence-threshold:adaptive=2", "'adaptive'"),
    ("disco:w_q=nan", "'w_q'"),
    ("specdec-pp:threshold=nan", "'threshold'"),
    ("specdec-pp:w_q=1,bias=inf", "'bias'"),
    ("cascade:set_rounds=nan", "'set_rounds'"),
    ("cascade:test_rounds=0", "'test_rounds'"),
    ("cascade:test_rounds=2.5", "'test_rounds'"),
    ("transformers-heuristic:start=-5", "'start'"),
    ("transformers-heuristic:start=nan", "'start'"),
    ("vllm-dsd-table:k=1.5", "'k'"),
    ("vllm-dsd-table:k=2,batch_size=0", "'batch_size'"),
    ("vllm-adaptive-verification:stale=1", "'stale'"),
    ("fixed-k:zz=3", "'zz': unknown (known: k)"),
    ("fixed-k:k=3,zz=1", "'zz': unknown"),
    ("ucb:c=1,zz=1", "'zz': unknown (known: arms, c)"),
    ("cascade:zz=1", "'zz': unknown"),
]


def _message(fn, *args) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize(("text", "named"), BAD, ids=[b[0] for b in BAD])
def test_check_and_resolve_refuse_the_same_line(text, named):
    spec = SPEC_H if text.split(":")[0] in ("adaedl", "svip", "confidence-threshold", "disco", "specdec-pp") else SPEC
    checked = _message(registry.check, text)
    resolved = _message(registry.resolve, text, spec)
    assert checked == resolved
    assert checked.startswith(f"policy {text!r}: parameter {named.split()[0]}")
    assert named in checked and "\n" not in checked


def test_good_parameters_keep_their_values():
    assert registry.resolve("fixed-k:k=4", SPEC).k == 4
    assert registry.resolve("fixed-k", SPEC, k=np.int64(3)).k == 3  # numpy integers are integers
    assert registry.resolve("ucb:c=1", SPEC).c == 1.0
    assert registry.resolve("confidence-threshold:threshold=0", SPEC_H).threshold0 == 0.0
    assert registry.resolve("cascade:test_rounds=1,set_rounds=3", SPEC).test_rounds == 1
    assert registry.resolve("transformers-heuristic:start=1", SPEC).start == 1
    assert registry.resolve("svip:h=0.5", SPEC_H).h == 0.5


@pytest.mark.parametrize("name", ["specdec-pp", "disco", "adaedl", "svip"])
def test_stop_rule_without_signals_is_refused_before_fitting(name, monkeypatch):
    """A stop rule in drafting mode none (lookahead 0): one line, no StopIteration, no fitting."""
    import policies.peers

    def no_fit(*args, **kwargs):
        raise AssertionError("fitted on the train split before refusing")

    monkeypatch.setattr(policies.peers, "_train_fit", no_fit)
    msg = _message(registry.resolve, name, SPEC)
    assert "lookahead >= 1" in msg and msg.startswith(f"policy {name!r}")


@pytest.mark.parametrize("text", ["specdec-pp", "specdec-pp:threshold=nan", "cascade:test_rounds=0", "fixed-k:k=4.5"])
def test_export_refuses_in_one_line(tmp_path, small_traces, text):
    named = "lookahead" if ":" not in text else text.split(":")[1].split("=")[0]
    reject_cleanly(
        ["export", "minari", "--dataset", small_traces, "--policy", text, "--root", tmp_path / "root"],
        [named],
        [tmp_path, small_traces],
    )
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("text", ["cascade:test_rounds=0", "fixed-k:k=true", "ucb:c=nan", "fixed-k:zz=3", "ucb:zz=1"])
def test_serve_refuses_before_start(tmp_path, text):
    named = text.split(":")[1].split("=")[0]
    reject_cleanly(["serve", "--policy", text, "--print-command", "--models", "small-moe-v1"], [named], [tmp_path])


def _plain_factory(spec, k=2):
    return registry.resolve(f"fixed-k:k={k}", spec)


def test_a_registered_policy_with_an_unknown_key_is_refused_by_check_serve_and_resolve(tmp_path):
    """An undeclared factory's keyword names are its parameters: an unknown key is one line, before start."""
    name = registry.register("hostile26-plain", _plain_factory, replace=True)
    try:
        line = "policy 'hostile26-plain:zz=1': parameter 'zz': unknown (known: k)"
        assert _message(registry.check, f"{name}:zz=1") == line
        assert _message(registry.resolve, f"{name}:zz=1", SPEC) == line
        assert registry.resolve(f"{name}:k=3", SPEC) is not None
        args = ["serve", "--policy", f"{name}:zz=1", "--print-command", "--models", "small-moe-v1"]
        reject_cleanly(args, ["--policy", "'zz'"], [tmp_path])
    finally:
        registry.unregister(name)


@pytest.mark.parametrize("mode", ["zzz", "sequential", "block"])
def test_bench_refuses_a_policy_whose_recorded_drafting_mode_it_would_not_run(tmp_path, small_traces, mode):
    """A lookahead-0 policy that records another drafting mode is not run; ``--only`` it names the reason."""
    from specenv.observation.single import ObservationSpec as Spec
    from specenv.policy.mlp import MLPPolicy
    from specenv.traces.traceset import TraceSet

    facts = TraceSet.load(small_traces).facts
    spec = Spec(kmax=6, lookahead=0, n_experts=facts.n_experts)
    rng = np.random.default_rng(0)
    policy = MLPPolicy(spec, [(rng.normal(size=(spec.dim, 7)), np.zeros(7))], meta={"drafting": mode})
    policy.save(tmp_path / "pols" / "odd")
    args = ["bench", small_traces, "--policies", tmp_path / "pols", "--only", "odd", "--out", tmp_path / "o", "-q"]
    reject_cleanly(args, ["no policy matches", "'odd'", "drafting mode", mode], [tmp_path, small_traces])
