"""What the vLLM controller serves, decided without vLLM: drafting modes, draft signals, the model's contract.

:func:`specenv.engines.vllm.settings.policy_refusal` is the one check (the controller runs it at start,
``specenv serve`` before vLLM starts); every refusal is one line. The tests with a live engine are in
``tests/vllm/test_draft_signals.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from policies.heuristics import ConfidenceThreshold, FixedK
from specenv.engines.vllm.settings import policy_refusal
from specenv.observation.single import ObservationSpec
from specenv.policy.base import policy_drafting, policy_signals
from specenv.policy.mlp import MLPPolicy
from tests.hostile.harness import run_cli

SERVE = ["serve", "--models", "small-moe-v1", "--print-command"]


def _mlp(kmax=4, lookahead=0, n_experts=64, meta=None) -> MLPPolicy:
    spec = ObservationSpec(kmax=kmax, lookahead=lookahead, n_experts=n_experts)
    rng = np.random.default_rng(0)
    return MLPPolicy(spec, [(rng.normal(size=(spec.dim, kmax + 1)), np.zeros(kmax + 1))], meta=meta)


def _refuse(policy, **kw) -> str:
    why = policy_refusal(policy, **{"num_spec_tokens": 4, "n_experts": 64, "top_k": 4, **kw})
    assert why is not None and "\n" not in why
    return why


def test_drafting_mode_of_a_policy():
    assert policy_drafting(FixedK(ObservationSpec(kmax=4), k=2)) == "none"
    assert policy_drafting(ConfidenceThreshold(ObservationSpec(kmax=4, lookahead=4))) == "block"
    assert policy_drafting(_mlp(meta={"drafting": "sequential"})) == "sequential"
    assert policy_signals(ConfidenceThreshold(ObservationSpec(kmax=4, lookahead=2)))[0] == "q"
    assert policy_signals(_mlp()) == ()
    with pytest.raises(ValueError, match="drafting mode 'eager'"):
        policy_drafting(_mlp(meta={"drafting": "eager"}))


def test_block_and_none_are_served():
    assert policy_refusal(_mlp(lookahead=2), num_spec_tokens=4, n_experts=64, top_k=4) is None
    assert policy_refusal(FixedK(ObservationSpec(kmax=4), k=2), num_spec_tokens=4) is None
    assert policy_refusal(_mlp(kmax=3), num_spec_tokens=4) is None  # the controller caps / warns
    assert policy_refusal(object(), num_spec_tokens=4) is None  # no spec: nothing to check


def test_refusals_are_one_line_each():
    assert "sequential" in _refuse(_mlp(meta={"drafting": "sequential"}))
    assert "no per-token stop" in _refuse(_mlp(lookahead=2, meta={"drafting": "sequential"}))
    assert "cannot supply: no tap" in _refuse(_mlp(lookahead=2), no_signals="no tap")
    assert "need >= 5" in _refuse(ConfidenceThreshold(ObservationSpec(kmax=5, lookahead=5, n_experts=64)))
    assert "128 experts" in _refuse(_mlp(n_experts=128))
    assert "top-8" in _refuse(_mlp(meta={"model": {"top_k": 8}}))
    assert "top-2" in _refuse(_mlp(meta={"top_k": 2}))
    assert "kmax 3 != " in _refuse(_mlp(kmax=3), exact_kmax=True)
    odd = ConfidenceThreshold(ObservationSpec(kmax=4, lookahead=2))
    object.__setattr__(odd.spec, "signals", ("q", "attention"))
    assert "'attention'" in _refuse(odd)


def test_serve_refuses_before_vllm_starts(tmp_path):
    seq = _mlp(kmax=8, meta={"drafting": "sequential"}).save(tmp_path / "seq")
    res = run_cli(["serve", "--policy", seq, *SERVE[1:]])
    assert res.exit_code == 2 and "--policy" in res.stderr and "sequential" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1

    four = _mlp(kmax=4).save(tmp_path / "four")
    res = run_cli(["serve", "--policy", four, *SERVE[1:], "--kmax", "6"])
    assert res.exit_code == 2 and "kmax 4 != the server's num_speculative_tokens 6" in res.stderr
    ok = run_cli(["serve", "--policy", four, *SERVE[1:]])  # kmax from the policy: served
    assert ok.exit_code == 0, ok.stderr

    # a registered name is built for the served model: a confidence rule needs a lookahead (one line)
    res = run_cli(["serve", "--policy", "confidence-threshold", *SERVE[1:]])
    assert res.exit_code == 2 and "lookahead" in res.stderr and len(res.stderr.strip().splitlines()) == 1

    # without --models: num_speculative_tokens from the user's --speculative-config
    sc = '{"method": "draft_model", "model": "d", "num_speculative_tokens": 3}'
    res = run_cli(["serve", "--policy", four, "--print-command", "--", "m", "--speculative-config", sc])
    assert res.exit_code == 2 and "kmax 4 != the server's num_speculative_tokens 3" in res.stderr


def test_v2_signals_pass_through():
    """With observation contract v2 (``signals``), every signal the tap captures is served."""
    spec = ObservationSpec(kmax=4, lookahead=2, n_experts=64, signals=("q", "ent", "margin"))
    pol = ConfidenceThreshold(spec)
    assert policy_signals(pol) == ("q", "ent", "margin")
    assert policy_refusal(pol, num_spec_tokens=4) is None
