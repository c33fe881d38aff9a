"""The policy registry: folders and registered names, never import paths."""

from __future__ import annotations

import numpy as np
import pytest

from policies.heuristics import FixedK, UCBBandit
from specenv.observation.single import ObservationSpec
from specenv.policy import registry
from specenv.policy.mlp import MLPPolicy

SPEC = ObservationSpec(kmax=6, lookahead=0, max_new_tokens=200, n_experts=64)


@pytest.fixture
def names():
    """Register test names and forget them afterwards."""
    added: list[str] = []

    def reg(name, factory, **kw):
        added.append(registry.register(name, factory, **kw))
        return name

    yield reg
    for n in added:
        registry.unregister(n)


def _mlp(spec: ObservationSpec, seed: int = 0) -> MLPPolicy:
    rng = np.random.default_rng(seed)
    weights = [
        (rng.normal(size=(spec.dim, 8)).astype(np.float32), np.zeros(8, np.float32)),
        (rng.normal(size=(8, spec.kmax + 1)).astype(np.float32), np.zeros(spec.kmax + 1, np.float32)),
    ]
    return MLPPolicy(spec, weights, name="test-mlp")


def test_registered_name_is_built_for_the_callers_spec(names):
    names("test-fixed", FixedK)
    pol = registry.resolve("test-fixed:k=3", SPEC)
    assert isinstance(pol, FixedK) and pol.k == 3 and pol.spec == SPEC
    obs = np.zeros(SPEC.dim, np.float32)
    assert pol.act(obs) == 3
    assert registry.resolve("test-fixed", SPEC, k=5).k == 5  # keyword parameters
    assert registry.resolve("test-fixed:k=1", SPEC, k=2).k == 2  # keywords override the string
    assert "test-fixed" in registry.names()


def test_parameters_are_parsed_as_literals(names):
    seen = {}

    def factory(spec, **params):
        seen.update(params)
        return UCBBandit(spec)

    names("test-params", factory)
    registry.resolve("test-params:a=3,b=0.25,c=true,d=False,e=text", SPEC)
    assert seen == {"a": 3, "b": 0.25, "c": True, "d": False, "e": "text"}
    assert type(seen["a"]) is int and type(seen["b"]) is float
    with pytest.raises(ValueError, match="key=value"):
        registry.resolve("test-params:oops", SPEC)


def test_policy_folder(tmp_path):
    folder = _mlp(SPEC).save(tmp_path / "pol")
    pol = registry.resolve(folder)
    assert isinstance(pol, MLPPolicy) and pol.spec == SPEC
    assert registry.resolve(str(folder), SPEC).spec == SPEC
    registry.check(folder)
    other = ObservationSpec(kmax=6, lookahead=0, max_new_tokens=200, n_experts=128)
    with pytest.raises(ValueError, match=r"policy.json: observation contract differs: n_experts 64 != 128"):
        registry.resolve(folder, other)
    with pytest.raises(ValueError, match="no parameters"):
        registry.resolve(folder, SPEC, k=3)


@pytest.mark.parametrize(
    "name",
    [
        "policies.heuristics:FixedK",  # the removed module:attribute form
        "policies.heuristics.FixedK",
        "os:system",
        "no-such-policy",
    ],
)
def test_import_paths_and_unknown_names_are_refused(name):
    with pytest.raises(ValueError, match="not a policy folder"):
        registry.resolve(name, SPEC)
    with pytest.raises(ValueError, match="not a policy folder"):
        registry.check(name)


def test_name_needs_a_spec_and_a_policy(names):
    names("test-ucb", UCBBandit)
    registry.check("test-ucb")  # no spec needed to check
    with pytest.raises(ValueError, match="needs the observation spec"):
        registry.resolve("test-ucb")
    names("test-not-a-policy", lambda spec: object())
    with pytest.raises(ValueError, match="not a policy"):
        registry.resolve("test-not-a-policy", SPEC)
    names("test-fixed2", FixedK)
    with pytest.raises(ValueError, match="test-fixed2"):  # the factory's TypeError (k missing), one line
        registry.resolve("test-fixed2", SPEC)
    with pytest.raises(ValueError, match="outside"):  # the factory's own ValueError
        registry.resolve("test-fixed2:k=9", SPEC)


def test_register_validates(names):
    names("test-once", FixedK)
    names("test-once", FixedK)  # the same factory again: fine
    with pytest.raises(ValueError, match="already registered"):
        registry.register("test-once", UCBBandit)
    names("test-once", UCBBandit, replace=True)
    assert isinstance(registry.resolve("test-once", SPEC), UCBBandit)
    for bad in ("a:b", "a/b", "", " x", "x y"):
        with pytest.raises(ValueError, match="policy name"):
            registry.register(bad, FixedK)
    with pytest.raises(ValueError, match="not callable"):
        registry.register("test-nc", 3)


def test_vllm_settings_resolve_through_the_registry(names, tmp_path):
    from specenv.engines.vllm.settings import register_policy, resolve_policy

    folder = _mlp(SPEC).save(tmp_path / "pol")
    assert resolve_policy(str(folder)).spec == SPEC  # a folder keeps its own spec
    names("test-vfixed", FixedK)
    pol = resolve_policy("test-vfixed:k=2", SPEC)
    assert isinstance(pol, FixedK) and pol.k == 2
    obj = UCBBandit(SPEC)
    name = register_policy("test-object", obj)
    try:
        assert resolve_policy(name, SPEC) is obj
        assert resolve_policy(name, ObservationSpec(kmax=2)) is obj  # the very object, whatever the spec
    finally:
        registry.unregister(name)
    with pytest.raises(ValueError, match="not a policy folder"):
        resolve_policy("policies.heuristics:FixedK", SPEC)


def test_serve_policy_help_and_check(tmp_path):
    from typer.testing import CliRunner

    from specenv.cli import app

    res = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert res.exit_code == 0 and "module:attribute" not in res.output and "registered name" in res.output
    res = CliRunner().invoke(app, ["serve", "--policy", "policies.heuristics:FixedK", "--print-command", "--", "M"])
    assert res.exit_code != 0 and "not a policy folder" in res.output


def test_shipped_heuristics_resolve_through_the_entry_point_group():
    """Reads installed metadata: passes once the package is (re)installed with the specenv.policies group."""
    from policies.heuristics import CascadeUtility, ConfidenceThreshold, TransformersHeuristic

    assert {"fixed-k", "transformers-heuristic", "confidence-threshold", "cascade", "ucb"} <= set(registry.names())
    assert isinstance(registry.resolve("ucb", SPEC), UCBBandit)
    assert registry.resolve("fixed-k:k=4", SPEC).k == 4
    assert isinstance(registry.resolve("transformers-heuristic", SPEC), TransformersHeuristic)
    assert isinstance(registry.resolve("cascade", SPEC), CascadeUtility)
    spec_h = ObservationSpec(kmax=6, lookahead=2)
    assert isinstance(registry.resolve("confidence-threshold:threshold=0.5", spec_h), ConfidenceThreshold)
