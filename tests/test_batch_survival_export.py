"""The learned-survival batch controller exported in numpy form (policies/batch/export.py) decides as the original.

A controller is trained (scikit-learn MLPRegressor) on a small greedy set; its batch observations are
recorded while it runs episodes of ``specenv/MoESpecBatch-v0`` on the test split; the exported
controller -- loaded from ``policy.json`` + ``weights.npz`` without scikit-learn or pickle -- replays
them and must give the same budgets, through the flat batch observation and through the served policy
path of the vLLM controller (:class:`specenv.engines.vllm.served.ServedPolicy`: stacked per-request
rows, request ids, the step's batch features).
"""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from policies.batch.export import KIND, NumpyRegressor, export_survival, load_survival, make_batch_survival
from policies.batch.learn import train_batch_survival
from specenv.engines.vllm.served import ServedPolicy
from specenv.envs.batch import MoESpecBatchEnv
from specenv.generator import generate_paper
from specenv.observation.single import ObservationSpec
from specenv.policy import registry
from specenv.policy.base import BatchStep
from specenv.traces.traceset import TraceSet

B = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """A survival controller trained on a small mixed greedy set (some requests' drafts survive, some not)."""
    K = 4
    ts = generate_paper(12, kmax=K, seed=5, greedy=True, with_rounds=False, name="mixed")
    pos = ts.positions
    pos = pos[pos["t"] < 30].copy()
    rng = np.random.default_rng(0)
    rate = rng.uniform(0.0, 1.0, size=int(pos["generation_id"].max()) + 1)[pos["generation_id"].to_numpy()]
    for j in range(1, K + 1):  # greedy: each draft accepted or not, more often in high-rate generations
        pos[f"rho_{j}"] = (rng.uniform(0.0, 1.0, size=len(pos)) < rate).astype(np.float64)
    path = tmp_path_factory.mktemp("traces") / "mixed"
    TraceSet(ts.manifest, positions=pos).save(path)
    surv = train_batch_survival(str(path), B, iterations=1, episodes=2, hidden=(16,), cost_model="profile", seed=0)
    return str(path), surv.policy


def _recorded_steps(dataset: str, policy, seeds: list[int]) -> list[np.ndarray]:
    """The flat batch observations the in-memory controller saw (and acted on) in test episodes."""
    env = MoESpecBatchEnv(dataset, batch_size=B, split="test", cost_model="profile")
    seen = []
    for s in seeds:
        obs, _ = env.reset(seed=s)
        policy.reset()
        done = False
        while not done:
            seen.append(obs.copy())
            obs, _, done, _, _ = env.step(policy.act(obs))
    return seen


def test_exported_controller_gives_the_same_budgets_as_the_in_memory_one(trained, tmp_path):
    dataset, pol = trained
    folder = export_survival(pol, tmp_path / "ctl")
    meta = json.loads((folder / "policy.json").read_text())
    assert meta["kind"] == KIND and meta["batch_size"] == B
    with zipfile.ZipFile(folder / "weights.npz") as z:  # plain .npy arrays, nothing pickled
        assert sorted(z.namelist()) == sorted(f"{p}{i}.npy" for i in range(meta["layers"]) for p in "Wb")
    back = load_survival(folder)
    assert isinstance(back.model, NumpyRegressor) and "sklearn" not in type(back.model).__module__
    steps = _recorded_steps(dataset, pol, seeds=[0, 1, 2])
    assert len(steps) > 20
    spec = pol.spec
    served = ServedPolicy(back, spec.request, B)
    differing_common = 0
    for obs in steps:
        active, rows = spec.slots(obs)
        # the flat batch observation (the environments' call)
        np.testing.assert_array_equal(back.act(obs), pol.act(obs))
        # the served path: the active requests' rows, their ids and the step's batch features
        ids = [f"req-{i}" for i in np.flatnonzero(active)]
        step = BatchStep.from_features(spec.batch_features(obs))
        np.testing.assert_array_equal(served.act(rows[active], ids, step), pol.act(rows[active], ids, step))
        s_mem, s_exp = pol.survival(rows[active]), back.survival(rows[active])
        np.testing.assert_allclose(s_exp, s_mem, rtol=0, atol=1e-12)
        differing_common += len(set(pol.act(rows[active]).tolist())) > 1
    assert differing_common > 0  # the recorded steps hold joint decisions, not one common k


def test_served_by_name_like_every_policy(trained, tmp_path):
    _, pol = trained
    folder = export_survival(pol, tmp_path / "ctl")
    # what the entry point of pyproject.toml declares, under a test name (forgotten afterwards)
    registry.register("test-batch-survival", make_batch_survival, replace=True)
    try:
        server = ObservationSpec(kmax=pol.kmax, n_experts=pol.spec.request.n_experts)
        got = registry.resolve(f"test-batch-survival:folder={folder}", server)
        with pytest.raises(ValueError, match="kmax"):
            registry.resolve(f"test-batch-survival:folder={folder}", ObservationSpec(kmax=pol.kmax + 1))
    finally:
        registry.unregister("test-batch-survival")
    assert got.spec == pol.spec  # its own trained contract, the server's kmax and experts
    from specenv.engines.vllm.settings import policy_refusal

    assert policy_refusal(got, num_spec_tokens=pol.kmax, max_num_seqs=B) is None
    assert "max-num-seqs" in policy_refusal(got, num_spec_tokens=pol.kmax, max_num_seqs=B + 1)


def test_bad_exports_are_refused_with_one_line(trained, tmp_path):
    _, pol = trained
    folder = export_survival(pol, tmp_path / "ctl")
    with np.load(folder / "weights.npz") as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(folder / "weights.npz", **{**arrays, "W0": arrays["W0"][:-1]})
    with pytest.raises(ValueError, match="layer 0"):
        load_survival(folder)
    meta = json.loads((folder / "policy.json").read_text())
    (folder / "policy.json").write_text(json.dumps({**meta, "kind": "mlp"}))
    with pytest.raises(ValueError, match="not a specenv batch-survival controller"):
        load_survival(folder)


def test_abtest_serves_the_exported_folder_as_a_policy_description(trained, tmp_path):
    """``specenv abtest --arms survival``: the engine builds the controller from ``{"kind": "batch-survival"}``."""
    from specenv.abtest import make_policy, replay_policy

    dataset, pol = trained
    folder = export_survival(pol, tmp_path / "ctl")
    req = pol.spec.request

    class _Ctl:  # what the engine's controller tells make_policy: the served model's expert count
        n_experts = req.n_experts

    desc = {"kind": "batch-survival", "folder": str(folder), "kmax": req.kmax, "max_new_tokens": req.max_new_tokens}
    served = make_policy(desc, _Ctl())
    replayed = replay_policy({"kind": "batch-survival", "folder": str(folder)}, req)
    for obs in _recorded_steps(dataset, pol, seeds=[3]):
        np.testing.assert_array_equal(served.act(obs), pol.act(obs))
        np.testing.assert_array_equal(replayed.act(obs), pol.act(obs))
    with pytest.raises(ValueError, match="kmax"):  # served with another kmax: refused, not misread
        make_policy({**desc, "kmax": req.kmax + 1}, _Ctl())
