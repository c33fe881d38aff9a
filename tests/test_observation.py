"""The observation contract has one owner: state, scalar path, decoder, versioned JSON, policy loading."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import specenv  # noqa: F401
from specenv.envs.replay import ENV_ID
from specenv.observation.single import (
    OBSERVATION_VERSION,
    ObservationSpec,
    ObservationState,
    ObsView,
    ScalarObservation,
    upgrade_contract,
)
from specenv.policy.mlp import MLPPolicy

ROOT = Path(__file__).resolve().parents[1]


class ReferenceState:
    """The statistics written one feature at a time (the pre-block arithmetic, kept as the oracle).

    Version-1 constants are literals here on purpose: the fast classes must agree with them.
    """

    def __init__(self, spec: ObservationSpec, n: int):
        self.spec, self.n = spec, n
        self.prev_k, self.prev_acc, self.prev_U, self.prev_cost = (np.zeros(n) for _ in range(4))
        self.acc_rate, self.acc_len = np.full(n, 0.5), np.zeros(n)
        self.cost_per_token, self.first = np.ones(n), np.ones(n)
        self.acc_depth = np.full((n, spec.kmax), 0.5)

    def reset(self, mask=None) -> None:  # noqa: ANN001
        m = slice(None) if mask is None else np.asarray(mask, dtype=bool)
        for arr, v in [(self.prev_k, 0.0), (self.prev_acc, 0.0), (self.prev_U, 0.0), (self.prev_cost, 0.0)]:
            arr[m] = v
        self.acc_rate[m], self.acc_len[m], self.cost_per_token[m], self.first[m] = 0.5, 0.0, 1.0, 1.0
        self.acc_depth[m] = 0.5

    def update(self, k, accepted, U_r, cost_units, committed, mask=None) -> None:  # noqa: ANN001
        ema = 0.8
        sel = np.ones(self.n, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        k = np.asarray(k, dtype=np.float64)
        a = np.asarray(accepted, dtype=np.float64)
        spec_round = sel & (k >= 1)
        self.prev_k[sel] = k[sel]
        self.prev_acc[sel] = a[sel]
        self.prev_U[sel] = np.asarray(U_r, dtype=np.float64)[sel]
        self.prev_cost[sel] = np.asarray(cost_units, dtype=np.float64)[sel]
        self.first[sel] = 0.0
        ratio = np.divide(a, k, out=np.zeros_like(a), where=k > 0)
        self.acc_rate[spec_round] = ema * self.acc_rate[spec_round] + (1 - ema) * ratio[spec_round]
        self.acc_len[spec_round] = ema * self.acc_len[spec_round] + (1 - ema) * (a[spec_round] / self.spec.kmax)
        cpt = np.asarray(cost_units, dtype=np.float64) / np.maximum(np.asarray(committed, dtype=np.float64), 1.0)
        self.cost_per_token[sel] = ema * self.cost_per_token[sel] + (1 - ema) * cpt[sel]
        j = np.arange(1, self.spec.kmax + 1)[None, :]
        reached = sel[:, None] & (k[:, None] >= j) & (a[:, None] >= j - 1)
        success = (a[:, None] >= j).astype(np.float64)
        self.acc_depth = np.where(reached, ema * self.acc_depth + (1 - ema) * success, self.acc_depth)

    def build(self, L, t, conf=None) -> np.ndarray:  # noqa: ANN001
        s = self.spec
        cols = [
            np.asarray(L, dtype=np.float64) / 4096.0,
            np.minimum(np.asarray(t, dtype=np.float64) / s.max_new_tokens, 1.0),
            self.prev_k / s.kmax,
            self.prev_acc / s.kmax,
            self.prev_U / s.n_experts,
            self.prev_cost / (s.kmax + 1),
            self.acc_rate,
            self.acc_len,
            self.cost_per_token,
            self.first,
        ]
        obs = np.empty((self.n, s.dim), dtype=np.float32)
        for i, c in enumerate(cols):
            obs[:, i] = c
        obs[:, 10 : 10 + s.kmax] = self.acc_depth
        if s.lookahead:
            obs[:, 10 + s.kmax :] = conf
        hi = np.ones(s.dim, dtype=np.float32)
        hi[0], hi[5], hi[8] = 64.0, 16.0, 16.0
        return np.clip(obs, 0.0, hi)


def _random_round(rng: np.random.Generator, n: int, k_top: int):  # noqa: ANN202
    k = rng.integers(0, k_top + 1, n)
    a = np.minimum(rng.integers(0, k_top + 1, n), k)
    committed = np.minimum(a + 1, rng.integers(1, 12, n))
    U = rng.uniform(8, 130, n)  # may exceed n_experts: clipping must agree too
    units = rng.uniform(-0.5, 40, n)
    return k, a, U, units, committed


# ------------------------------------------------------------------------------------- the state
@pytest.mark.parametrize("kmax, h, n", [(6, 0, 5), (10, 3, 17), (1, 0, 3)])
def test_state_is_bit_identical_to_reference_with_masks(kmax: int, h: int, n: int) -> None:
    rng = np.random.default_rng(0)
    spec = ObservationSpec(kmax=kmax, lookahead=h, max_new_tokens=1000, n_experts=128)
    ref, fast = ReferenceState(spec, n), ObservationState(spec, n)
    for step in range(300):
        if step % 23 == 0:
            mask = rng.random(n) < 0.4
            ref.reset(mask)
            fast.reset(mask)
        rnd = _random_round(rng, n, kmax)
        upd_mask = None if step % 3 else rng.random(n) < 0.5
        ref.update(*rnd, mask=upd_mask)
        fast.update(*rnd, mask=upd_mask)
        L, t = rng.integers(1, 300_000, n), rng.integers(0, 2000, n)
        conf = rng.random((n, h)) if h else None
        got = fast.build(L, t, conf)
        assert got.dtype == np.float32 and got.shape == (n, spec.dim)
        assert np.array_equal(got, ref.build(L, t, conf)), step
    assert np.array_equal(fast.prev_k, ref.prev_k) and np.array_equal(fast.acc_depth, ref.acc_depth)


def test_state_accepts_budgets_above_kmax_like_reference() -> None:
    """A vLLM server may verify more drafts than the policy's kmax: the table extends itself."""
    rng = np.random.default_rng(1)
    spec = ObservationSpec(kmax=4)
    ref, fast = ReferenceState(spec, 6), ObservationState(spec, 6)
    for step in range(200):
        rnd = _random_round(rng, 6, 4 if step < 50 else 9)
        ref.update(*rnd)
        fast.update(*rnd)
        L, t = rng.integers(1, 9000, 6), rng.integers(0, 2000, 6)
        assert np.array_equal(fast.build(L, t), ref.build(L, t)), step


def test_state_views_take_and_resized() -> None:
    rng = np.random.default_rng(2)
    spec = ObservationSpec(kmax=5, lookahead=2)
    st = ObservationState(spec, 7)
    for _ in range(9):
        st.update(*_random_round(rng, 7, 5))
    L, t, conf = rng.integers(1, 9000, 7), rng.integers(0, 900, 7), rng.random((7, 2))
    full = st.build(L, t, conf)
    rows = [5, 0, 3]
    assert np.array_equal(st.take(rows).build(L[rows], t[rows], conf[rows]), full[rows])
    big = st.resized(10)
    L10, t10, c10 = np.r_[L, 1, 1, 1], np.r_[t, 0, 0, 0], np.r_[conf, np.zeros((3, 2))]
    out = big.build(L10, t10, c10)
    assert np.array_equal(out[:7], full)
    assert np.array_equal(out[7:], ObservationState(spec, 3).build(L10[7:], t10[7:], c10[7:]))
    # the attributes by name are views into the blocks, and assignment writes into them
    st.prev_k[2] = 3.0
    st.acc_depth = 0.25
    o = st.build(L, t, conf)[2]
    v = ObsView(spec)
    assert v.prev_k(o) == 3 and np.allclose(v.acc_depth(o), 0.25)


@pytest.mark.parametrize("kmax, h", [(6, 0), (10, 4)])
def test_scalar_path_is_bit_identical_to_state_and_reference(kmax: int, h: int) -> None:
    """n scalar streams against one vectorised state of n streams, rounds masked per stream."""
    rng = np.random.default_rng(3)
    n = 4
    spec = ObservationSpec(kmax=kmax, lookahead=h, max_new_tokens=1000, n_experts=128)
    vec, ref = ObservationState(spec, n), ReferenceState(spec, n)
    scal = [ScalarObservation(spec) for _ in range(n)]
    for step in range(400):
        if step % 57 == 0:
            mask = rng.random(n) < 0.5
            vec.reset(mask)
            ref.reset(mask)
            for i in np.flatnonzero(mask):
                scal[i].reset()
        k, a, U, units, committed = _random_round(rng, n, kmax)
        upd = rng.random(n) < 0.7
        vec.update(k, a, U, units, committed, mask=upd)
        ref.update(k, a, U, units, committed, mask=upd)
        for i in np.flatnonzero(upd):
            scal[i].update(int(k[i]), int(a[i]), float(U[i]), float(units[i]), int(committed[i]))
        L, t = rng.integers(1, 300_000, n), rng.integers(0, 2000, n)
        conf = rng.random((n, h)) if h else None
        want = vec.build(L, t, conf)
        assert np.array_equal(want, ref.build(L, t, conf)), step
        for i in range(n):
            got = scal[i].build(int(L[i]), int(t[i]), conf[i].tolist() if h else None)
            assert got.dtype == np.float32 and np.array_equal(got, want[i]), (step, i)


def test_single_and_vector_env_share_the_owner() -> None:
    from specenv.envs import live, replay, vector

    for mod in (replay, vector, live):
        src = Path(mod.__file__).read_text()
        assert "class _ScalarObservation" not in src and "class _BatchObservationState" not in src
    env = gym.make(ENV_ID, split="test")
    assert isinstance(env.unwrapped._obs, ScalarObservation)
    venv = gym.make_vec(ENV_ID, num_envs=2, split="test")
    assert type(venv._obs_state) is ObservationState


# ------------------------------------------------------------------------------------- the decoder
def _decoders(v: ObsView) -> dict[str, object]:
    """Physical value of every feature name, through the view's named accessors."""
    s = v.spec
    out: dict[str, object] = {
        "context": lambda o: v.L(o),
        "progress": lambda o: v.t(o),
        "prev_k": lambda o: v.prev_k(o),
        "prev_accepted": lambda o: v.prev_accepted(o),
        "prev_U": lambda o: v.prev_U(o),
        "prev_cost": lambda o: v.prev_cost(o),
        "acc_rate": lambda o: v.acc_rate(o),
        "acc_len": lambda o: v.acc_len(o),
        "cost_per_token": lambda o: v.cost_per_token(o),
        "first_round": lambda o: v.first_round(o),
    }
    for j in range(1, s.kmax + 1):
        out[f"acc_depth_{j}"] = lambda o, j=j: v.acc_depth(o)[j - 1]
    for j in range(1, s.lookahead + 1):
        out[f"conf_{j}"] = lambda o, j=j: v.conf(o)[j - 1]
    return out


@pytest.mark.parametrize("kmax, h", [(10, 0), (6, 3)])
def test_obsview_round_trip_for_every_feature_by_name(kmax: int, h: int) -> None:
    spec = ObservationSpec(kmax=kmax, lookahead=h, max_new_tokens=500, n_experts=64)
    st = ObservationState(spec, 1)
    st.update(np.array([4]), np.array([3]), np.array([20.5]), np.array([1.25]), np.array([4]))
    st.update(np.array([2]), np.array([1]), np.array([33.0]), np.array([2.5]), np.array([2]))
    conf = np.linspace(0.1, 0.9, h)[None, :] if h else None
    o = st.build(np.array([6000.0]), np.array([123.0]), conf)[0]
    d = np.arange(1, kmax + 1)
    # the two rounds by hand: (k=4, a=3) then (k=2, a=1)
    depth = np.full(kmax, 0.5)
    depth = np.where(d <= 4, 0.8 * depth + 0.2 * (d <= 3), depth)
    depth = np.where(d <= 2, 0.8 * depth + 0.2 * (d <= 1), depth)
    want = {
        "context": 6000.0,
        "progress": 123.0,
        "prev_k": 2,
        "prev_accepted": 1,
        "prev_U": 33.0,
        "prev_cost": 2.5,
        "acc_rate": 0.8 * (0.8 * 0.5 + 0.2 * 0.75) + 0.2 * 0.5,
        "acc_len": (0.8 * (0.2 * 3 / kmax) + 0.2 * 1 / kmax) * kmax,
        "cost_per_token": 0.8 * (0.8 * 1.0 + 0.2 * 1.25 / 4) + 0.2 * 1.25,
        "first_round": False,
        **{f"acc_depth_{j}": depth[j - 1] for j in d},
        **{f"conf_{j}": float(conf[0, j - 1]) for j in range(1, h + 1)},
    }
    v = ObsView(spec)
    dec = _decoders(v)
    assert list(dec) == spec.names  # a decoder for every feature, in vector order
    for name in spec.names:
        assert v.raw(o, name) == float(o[spec.index(name)])
        got = dec[name](o)
        assert got == pytest.approx(want[name], rel=1e-6), name
    o_first = ObservationState(spec, 1).build(np.array([10.0]), np.array([0.0]), conf)[0]
    assert v.first_round(o_first) and v.prev_k(o_first) == 0


def test_obsview_reads_indices_from_the_spec() -> None:
    """A view on a longer layout still finds each feature by name."""
    for kmax, h in [(3, 0), (12, 5)]:
        spec = ObservationSpec(kmax=kmax, lookahead=h)
        v = ObsView(spec)
        for name in spec.names:
            o = np.zeros(spec.dim, dtype=np.float32)
            o[spec.index(name)] = 1.0
            assert v.raw(o, name) == 1.0
            assert sum(v.raw(o, other) for other in spec.names) == 1.0
        o = np.zeros(spec.dim, dtype=np.float32)
        o[spec.index("first_round")] = 1.0
        assert v.first_round(o)
        assert v.conf(o).shape == (h,) and v.acc_depth(o).shape == (kmax,)


def test_no_literal_observation_indices_in_the_code() -> None:
    """Features are read by name: no ``obs[3]``, ``obs[:, 9]`` or ``obs[10:...]`` in specenv, policies, oracle."""
    literal = re.compile(r"\bobs\w*\[(\s*:\s*,)?\s*-?\d+\s*[]:,]")
    assert literal.search("x = obs[9]") and literal.search("obs[:, 0] = L") and literal.search("obs_b[10 : 12]")
    assert not literal.search("obs[self.i_first_round]") and not literal.search("obs[:, self._c_context]")
    hits = []
    for folder in ("specenv", "policies", "oracle"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if literal.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not hits, hits


# ------------------------------------------------------------------------------------- the contract
def test_contract_json_records_version_and_every_constant() -> None:
    spec = ObservationSpec(kmax=8, lookahead=2, max_new_tokens=700, n_experts=64)
    d = json.loads(json.dumps(spec.to_json()))
    assert OBSERVATION_VERSION == 2 and isinstance(OBSERVATION_VERSION, int)
    assert d["version"] == 2
    assert (d["kmax"], d["lookahead"], d["max_new_tokens"], d["n_experts"], d["dim"]) == (8, 2, 700, 64, 20)
    assert d["names"] == spec.names
    assert (d["context_scale"], d["ema"], d["prior_rate"]) == (4096.0, 0.8, 0.5)
    assert d["prev_cost_norm"] == "ar_step_at_context"
    assert d["signals"] == ["q"]
    assert d["low"] == 0.0 and d["high"] == [float(x) for x in spec.space().high]
    assert d["high"][spec.index("context")] == 64.0 and d["high"][spec.index("cost_per_token")] == 16.0
    assert ObservationSpec.from_json(d) == spec
    assert spec.mismatch(d) is None and spec.mismatch(ObservationSpec.from_json(d)) is None


@pytest.mark.parametrize(
    "change, line",
    [
        ({"kmax": 8}, "kmax 10 != 8"),
        ({"lookahead": 3}, "lookahead 0 != 3"),
        ({"max_new_tokens": 2000}, "max_new_tokens 1000 != 2000"),
        ({"n_experts": 64}, "n_experts 128 != 64"),
        ({"ema": 0.7}, "ema 0.8 != 0.7"),
        ({"context_scale": 8192.0}, "context_scale 4096.0 != 8192.0"),
        ({"prior_rate": 0.6}, "prior_rate 0.5 != 0.6"),
        ({"cost_high": 32.0}, "high[5] 16.0 != 32.0"),
    ],
)
def test_mismatch_names_the_first_differing_field(change: dict, line: str) -> None:
    a = ObservationSpec(kmax=10)
    b = dataclasses.replace(a, **change)
    assert a.mismatch(b) == line
    assert "\n" not in line and a.mismatch(a) is None


def test_mismatch_on_dictionaries_version_norm_and_names() -> None:
    a = ObservationSpec(kmax=4)
    d = a.to_json()
    assert a.mismatch(d | {"version": 3}) == "version 2 != 3"
    assert (
        a.mismatch(d | {"prev_cost_norm": "mean_ar_step_of_split"})
        == "prev_cost_norm 'ar_step_at_context' != 'mean_ar_step_of_split'"
    )
    assert a.mismatch(d | {"signals": ["q", "ent"]}) == "signals has 1 entries != 2"
    names = list(d["names"])
    names[12] = "acc_depth_x"
    assert a.mismatch(d | {"names": names}) == "names[12] 'acc_depth_3' != 'acc_depth_x'"
    no_ema = {k: v for k, v in d.items() if k != "ema"}
    assert a.mismatch(no_ema) == "ema 0.8 != (absent)"


def test_from_json_rejects_what_it_cannot_build_with_one_line() -> None:
    d = ObservationSpec(kmax=4).to_json()
    with pytest.raises(ValueError, match=r"^version 3 != 2$"):
        ObservationSpec.from_json(d | {"version": 3})
    with pytest.raises(ValueError, match=r"^version 1 != 2 \(version 1 divided .* retrain"):
        ObservationSpec.from_json(d | {"version": 1})
    with pytest.raises(ValueError, match=r"signals"):
        ObservationSpec.from_json(d | {"signals": ["ent"]})
    with pytest.raises(ValueError, match=r"signals"):
        ObservationSpec.from_json(d | {"signals": "q"})
    with pytest.raises(ValueError, match=r"prev_cost_norm"):
        ObservationSpec.from_json(d | {"prev_cost_norm": "something"})
    with pytest.raises(ValueError, match=r"names\[3\]"):
        ObservationSpec.from_json(d | {"names": d["names"][:3] + ["x"] + d["names"][4:]})
    with pytest.raises(ValueError, match=r"dim 15 != 14"):
        ObservationSpec.from_json(d | {"dim": 15})
    with pytest.raises(ValueError, match=r"high\[1\]"):
        ObservationSpec.from_json(d | {"high": [64.0, 2.0] + d["high"][2:]})
    with pytest.raises(ValueError, match=r"kmax missing"):
        ObservationSpec.from_json({k: v for k, v in d.items() if k != "kmax"})


def test_unversioned_contract_is_read_as_version_1_and_refused_with_one_line() -> None:
    legacy = {"kmax": 10, "lookahead": 3, "max_new_tokens": 1000, "n_experts": 128}
    up = upgrade_contract(legacy)
    assert up["version"] == 1 and up["prev_cost_norm"] == "mean_ar_step_of_split"
    assert up["names"] == ObservationSpec(10, 3).names and up["dim"] == 23
    with pytest.raises(ValueError, match=r"^version 1 != 2 .*retrain the policy\)$"):
        ObservationSpec.from_json(legacy)


@pytest.mark.parametrize("signals", [("q", "ent"), ("q", "margin"), ("q", "ent", "margin")])
def test_signals_extend_the_lookahead_and_per_token_blocks(signals: tuple[str, ...]) -> None:
    spec = ObservationSpec(kmax=4, lookahead=2, signals=signals, per_token=True)
    extra = [s for s in signals if s != "q"]
    look = ["conf_1", "conf_2"] + [f"{s}_{j}" for s in extra for j in (1, 2)]
    tok = ["draft_conf", "drafted", "draft_conf_prod"] + [f"draft_{s}" for s in extra]
    assert spec.names[14:] == look + tok and spec.dim == len(spec.names)
    assert ObservationSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    st = ObservationState(spec, 2)
    conf = np.arange(2 * len(look), dtype=np.float64).reshape(2, -1) / 100
    token = np.tile([0.3, 2.0, 0.2] + [0.5] * len(extra), (2, 1))
    obs = st.build(np.array([10.0, 20.0]), np.array([0, 1]), conf, token)
    view = ObsView(spec)
    np.testing.assert_allclose(view.conf(obs[1]), conf[1, :2], rtol=1e-6)
    if "ent" in signals:
        np.testing.assert_allclose(view.ent(obs[1]), conf[1, 2:4], rtol=1e-6)
        assert spec.high()[spec.index("ent_1")] == 16.0 and view.draft_ent(obs[0]) == 0.5
    if "margin" in signals:
        np.testing.assert_allclose(view.margin(obs[1]), conf[1, -2:], rtol=1e-6)
    assert view.drafted(obs[0]) == 2
    sc = ScalarObservation(spec)
    np.testing.assert_array_equal(sc.build(20.0, 1, conf[1].tolist(), tuple(token[1])), obs[1])
    with pytest.raises(ValueError, match="signals"):
        ObservationSpec(kmax=4, signals=("ent",))


# ------------------------------------------------------------------------------------- policies
def _tiny_policy(spec: ObservationSpec, seed: int = 0) -> MLPPolicy:
    rng = np.random.default_rng(seed)
    w = [
        (rng.normal(size=(spec.dim, 8)), rng.normal(size=8)),
        (rng.normal(size=(8, spec.kmax + 1)), rng.normal(size=spec.kmax + 1)),
    ]
    return MLPPolicy(spec, w, "tanh", "tiny")


def test_policy_json_records_the_full_contract(tmp_path: Path) -> None:
    spec = ObservationSpec(kmax=6, lookahead=2, max_new_tokens=300, n_experts=32)
    _tiny_policy(spec).save(tmp_path)
    meta = json.loads((tmp_path / "policy.json").read_text())
    assert meta["observation"] == spec.to_json()
    assert MLPPolicy.load(tmp_path, expect=spec).spec == spec


@pytest.mark.parametrize(
    "expect, field",
    [
        (ObservationSpec(kmax=8, lookahead=2, max_new_tokens=300, n_experts=32), "kmax 6 != 8"),
        (ObservationSpec(kmax=6, lookahead=0, max_new_tokens=300, n_experts=32), "lookahead 2 != 0"),
        (ObservationSpec(kmax=6, lookahead=2, max_new_tokens=300, n_experts=32, ema=0.9), "ema 0.8 != 0.9"),
    ],
)
def test_mismatching_policy_fails_to_load_with_one_line(tmp_path: Path, expect: ObservationSpec, field: str) -> None:
    _tiny_policy(ObservationSpec(kmax=6, lookahead=2, max_new_tokens=300, n_experts=32)).save(tmp_path)
    with pytest.raises(ValueError) as err:
        MLPPolicy.load(tmp_path, expect=expect)
    msg = str(err.value)
    assert msg == f"{tmp_path / 'policy.json'}: observation contract differs: {field}"
    assert "\n" not in msg


def test_policy_with_another_stored_constant_or_version_fails(tmp_path: Path) -> None:
    spec = ObservationSpec(kmax=4)
    _tiny_policy(spec).save(tmp_path)
    pj = tmp_path / "policy.json"
    meta = json.loads(pj.read_text())
    meta["observation"]["context_scale"] = 2048.0
    pj.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"policy.json: observation contract differs: context_scale 2048.0 != 4096.0$"):
        MLPPolicy.load(tmp_path, expect=spec)
    meta["observation"]["context_scale"] = 4096.0
    meta["observation"]["version"] = 3
    pj.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"policy.json: observation contract: version 3 != 2"):
        MLPPolicy.load(tmp_path)
    with pytest.raises(ValueError, match=r"policy.json: observation contract differs: version 3 != 2$"):
        MLPPolicy.load(tmp_path, expect=spec)


def test_unversioned_policy_json_is_refused_with_one_line(tmp_path: Path) -> None:
    spec = ObservationSpec(kmax=5)
    _tiny_policy(spec, 4).save(tmp_path)
    pj = tmp_path / "policy.json"
    meta = json.loads(pj.read_text())
    meta["observation"] = {"kmax": 5, "lookahead": 0, "max_new_tokens": 1000, "n_experts": 128}
    pj.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"observation contract differs: version 1 != 2 \(.*retrain the policy\)$"):
        MLPPolicy.load(tmp_path, expect=spec)
    with pytest.raises(ValueError, match=r"observation contract: version 1 != 2 \(.*retrain the policy\)$"):
        MLPPolicy.load(tmp_path)


# ------------------------------------------------------------------------------------- benchmark
def test_benchmark_lists_every_policy_it_could_not_run(tmp_path: Path) -> None:
    import pandas as pd

    from policies.bench.context import build_context
    from policies.bench.result import BenchResult
    from policies.bench.single import default_entries
    from policies.bench.tables import markdown_table

    _tiny_policy(gym.make(ENV_ID, split="test").unwrapped.data.spec).save(tmp_path / "ppo")
    _tiny_policy(ObservationSpec(kmax=8)).save(tmp_path / "dqn-kmax8")
    (tmp_path / "imitation-broken").mkdir()
    (tmp_path / "imitation-broken" / "policy.json").write_text("{not json")
    ctx = build_context("paper-default", None, "fit", tmp_path)
    names = [e.name for e in default_entries(ctx)]
    assert "ppo (learned)" in names
    assert not [n for n in names if "kmax8" in n or "broken" in n]
    skipped = {s["policy"]: s["reason"] for s in ctx.skipped}
    assert set(skipped) == {"dqn-kmax8", "imitation-broken"}
    assert skipped["dqn-kmax8"].endswith("policy.json: observation contract differs: kmax 8 != 10")
    assert "cannot read policy" in skipped["imitation-broken"]
    for folder in skipped:
        assert len([n for n in ctx.notes if n.startswith(f"skipped '{folder}'")]) == 1
    cols = [
        "policy",
        "speedup_mean",
        "ci95_low",
        "ci95_high",
        "speedup_pooled",
        "oracle_pct",
        "mean_k",
        "mean_accepted",
    ]
    cats = pd.DataFrame(columns=["policy", "category", "speedup_pooled"])
    res = BenchResult("single", pd.DataFrame(columns=cols), {}, ctx.notes, categories=cats, skipped=ctx.skipped)
    assert res.to_json()["skipped"] == ctx.skipped
    table = markdown_table(res)
    assert "| dqn-kmax8 (not run: " in table and "| imitation-broken (not run: " in table


def test_learned_entry_refuses_another_environment_with_the_field() -> None:
    from policies.bench.single import _learned

    pol = _tiny_policy(ObservationSpec(kmax=6))
    make = _learned(pol)
    assert make(ObservationSpec(kmax=6)) is pol
    with pytest.raises(ValueError, match=r"observation contract differs: max_new_tokens 1000 != 50"):
        make(ObservationSpec(kmax=6, max_new_tokens=50))


# ------------------------------------------------------------------------------------- contract 2
@pytest.mark.parametrize("kind", ["single", "vector", "sequential"])
def test_prev_cost_is_in_ar_steps_at_the_rounds_own_context(kind: str) -> None:
    """Offline as online: prev_cost = round cost / C_AR(L) at that round's context (not the split's mean)."""
    if kind == "vector":
        env = gym.make_vec(ENV_ID, num_envs=2, split="test", vectorization_mode="vector_entry_point")
    elif kind == "sequential":
        env = gym.make("specenv/MoESpecSeq-v0", split="test")
    else:
        env = gym.make(ENV_ID, split="test")
    d = env.unwrapped.data
    cm, view = d.cost_model, ObsView(env.unwrapped.obs_spec if kind == "sequential" else d.spec)
    obs, _ = env.reset(seed=5)
    seen = 0
    for i in range(30):
        if kind == "sequential":
            obs, _, _, _, info = env.step(1 if i % 4 else 0)
            if not info["verified"]:
                continue
        else:
            action = np.array([3, 5]) if kind == "vector" else 4
            obs, _, _, _, info = env.step(action)
        row = obs[0] if kind == "vector" else obs
        cost = float(np.atleast_1d(info["cost_ms"])[0])
        L = float(np.atleast_1d(info["L"])[0])
        expect = cost / float(cm.ar_ms(L))
        assert view.prev_cost(row) == pytest.approx(expect, rel=1e-5)
        assert abs(expect - cost / d.ar_unit_ms) > 1e-6  # the split's mean would differ
        seen += 1
    assert seen >= 5


def test_signals_reach_the_round_and_per_token_envs() -> None:
    from specenv.replay.tables import select_positions
    from specenv.traces.datasets import load_dataset

    arr = select_positions(load_dataset("paper-default"), None, "test")
    sig = ("q", "ent", "margin")
    env = gym.make(ENV_ID, split="test", lookahead=3, signals=sig)
    obs, info = env.reset(seed=1, options={"generation_id": int(arr.generation_ids[0])})
    view = ObsView(env.unwrapped.data.spec)
    np.testing.assert_allclose(view.conf(obs), arr.q[0, :3], rtol=1e-6)
    np.testing.assert_allclose(view.ent(obs), np.minimum(arr.ent[0, :3], 16.0), rtol=1e-6)
    np.testing.assert_allclose(view.margin(obs), arr.margin[0, :3], rtol=1e-6)
    seq = gym.make("specenv/MoESpecSeq-v0", split="test", signals=["margin", "q"])
    sv = ObsView(seq.unwrapped.obs_spec)
    obs, _ = seq.reset(seed=1, options={"generation_id": int(arr.generation_ids[0])})
    for j in range(2):
        obs, *_ = seq.step(1)
        assert sv.draft_conf(obs) == pytest.approx(arr.q[0, j], rel=1e-6)
        assert sv.draft_margin(obs) == pytest.approx(arr.margin[0, j], rel=1e-6)
    with pytest.raises(ValueError, match="signals"):
        gym.make(ENV_ID, signals=("ent",))
