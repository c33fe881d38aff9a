"""The peers' controllers (policies/peers.py): each rule's equation, train-only fitting, bench rows, registry."""

from __future__ import annotations

import math
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest

from policies.peers import (
    DISCO,
    SVIP,
    AdaEDL,
    LinearHead,
    SpecDecPP,
    VLLMAdaptiveVerification,
    VLLMDSDTable,
    first_stop,
    parse_schedule,
    spec_for,
)
from specenv.cost.model import CostModel
from specenv.observation.single import ObservationSpec, ObservationState
from specenv.policy import registry

KMAX = 6
SPEC_Q = ObservationSpec(kmax=KMAX, lookahead=KMAX)
CM = CostModel.paper_profile(KMAX)
ROOT = Path(__file__).resolve().parents[1]


def obs_with(conf: list[float], spec: ObservationSpec = SPEC_Q, L: float = 600.0, first: bool = True) -> np.ndarray:
    """One observation showing the draft confidences ``conf`` (a generation's first round unless ``first=False``)."""
    st = ObservationState(spec, 1)
    if not first:
        st.update(np.array([2]), np.array([1]), np.array([16.0]), np.array([1.5]), np.array([2]))
    return st.build(np.array([L]), np.array([0 if first else 2]), np.array([conf], dtype=np.float64))[0]


# ------------------------------------------------------------------ the equations
def test_first_stop_is_the_first_failing_token_else_h() -> None:
    stop = np.array([[False, True, True], [False, False, False], [True, False, True]])
    assert first_stop(stop).tolist() == [2, 3, 1]


def test_adaedl_stops_where_the_entropy_bound_falls_below_lambda() -> None:
    rule = AdaEDL(spec_for(KMAX, ("q", "ent")), lam=0.5, gamma=0.2)
    # 1 - sqrt(0.2 H) < 0.5  <=>  H > 1.25
    ent = np.array([[0.1, 1.0, 1.2, 1.3, 0.0, 0.0], [0.1] * 6, [2.0] + [0.0] * 5])
    sig = {"q": np.ones_like(ent), "ent": ent}
    assert rule.bound(np.array([1.25]))[0] == pytest.approx(0.5)
    assert rule.budgets(sig).tolist() == [4, 6, 1]
    # the same decisions from observations showing q then the entropies (observation contract v2)
    obs = np.stack([obs_with([0.5] * KMAX + e.tolist(), spec=rule.spec) for e in ent])
    assert rule.act_batch(obs).tolist() == [4, 6, 1]
    assert [rule.act(o) for o in obs] == [4, 6, 1]


def test_svip_stops_where_sqrt_entropy_exceeds_h_and_matches_static_adaedl() -> None:
    spec = spec_for(KMAX, ("q", "ent"))
    rule = SVIP(spec, h=1.0)
    ent = np.array([[0.5, 0.99, 1.01, 0.1, 0.1, 0.1], [0.2] * 6])
    sig = {"q": np.ones_like(ent), "ent": ent}
    assert rule.budgets(sig).tolist() == [3, 6]
    # static AdaEDL with lambda = 1 - h sqrt(gamma) is the same stopping rule
    rng = np.random.default_rng(0)
    ent = rng.exponential(1.0, size=(200, KMAX))
    sig = {"q": np.ones_like(ent), "ent": ent}
    ada = AdaEDL(spec, lam=1.0 - 0.8 * math.sqrt(0.2), gamma=0.2)
    assert (SVIP(spec, h=0.8).budgets(sig) == ada.budgets(sig)).all()


def test_specdecpp_stops_when_the_probability_of_a_rejection_so_far_exceeds_h() -> None:
    head = LinearHead(("q",), (1.0,), 0.0, 0.0)  # p_j = sigmoid(q_j)
    rule = SpecDecPP(SPEC_Q, head, threshold=0.8)
    q = [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]  # p = 0.9526 each: 1 - p^j = .047, .093, .136, .177, .216, .253
    obs = np.array([obs_with([0.9] * 6)])
    p = 1.0 / (1.0 + math.exp(-0.9))  # q = 0.9 in the observation: p = 0.711 per token
    expected = next(j for j in range(1, 7) if 1 - p**j > 0.8)  # 1 - .711^5 = 0.818 > 0.8 -> 5
    assert rule.act(obs[0]) == expected == 5
    sig = {"q": np.array([q])}
    assert rule.budgets(sig).tolist() == [6]
    assert SpecDecPP(SPEC_Q, head, threshold=0.1).budgets(sig).tolist() == [3]


def test_disco_stops_at_the_first_token_whose_continue_probability_is_below_threshold() -> None:
    head = LinearHead(("q",), (10.0,), -1.0, 0.0)  # p_j = sigmoid(10 q_j - j)
    rule = DISCO(SPEC_Q, head, threshold=0.5)  # continue while 10 q_j > j
    conf = [0.9, 0.5, 0.35, 0.2, 0.9, 0.9]  # 9>1, 5>2, 3.5>3, 2<4 -> stop after token 4
    assert rule.act(obs_with(conf)) == 4
    assert rule.act_batch(np.stack([obs_with(conf), obs_with([0.05] * 6), obs_with([1.0] * 6)])).tolist() == [4, 1, 6]


def test_stop_rules_refuse_an_observation_without_their_signals() -> None:
    with pytest.raises(ValueError, match="lookahead"):
        SpecDecPP(ObservationSpec(KMAX, 0), LinearHead(("q",), (1.0,), 0.0, 0.0))
    with pytest.raises(ValueError, match="ent"):
        AdaEDL(SPEC_Q, lam=0.5)


def test_vllm_adaptive_verification_maximises_expected_tokens_per_cost() -> None:
    u = np.array([8.0, 13, 17, 20, 23, 25, 27])
    fresh = VLLMAdaptiveVerification(SPEC_Q, CM, u_prior=u, stale=False)
    conf = np.array([0.95, 0.9, 0.5, 0.2, 0.9, 0.9])
    L = 600.0
    surv = np.cumprod(conf)
    tokens = 1 + np.concatenate([[0.0], np.cumsum(surv)])
    costs = CM.draft_ms(KMAX) + CM.target_ms(np.arange(KMAX + 1), u, L)
    want = int(np.argmax(tokens / costs))
    assert fresh.budget(conf, L) == want
    assert fresh.act(obs_with(conf.tolist(), L=L)) == want
    # vLLM 0.32 reads the previous step's confidences (1.0 for a new request)
    stale = VLLMAdaptiveVerification(SPEC_Q, CM, u_prior=u)
    first = stale.act(obs_with(conf.tolist(), L=L))
    assert first == fresh.budget(np.ones(KMAX), L)
    second = stale.act(obs_with([0.1] * 6, L=L, first=False))
    assert second == fresh.budget(conf.astype(np.float32).astype(np.float64), L)


def test_vllm_dsd_table_looks_up_the_batch_size_as_vllm_does() -> None:
    sched = parse_schedule("1-4:5;8-16:3;32-64:1")
    assert sched == [(1, 4, 5), (8, 16, 3), (32, 64, 1)]
    t = VLLMDSDTable(SPEC_Q, schedule=sched)
    assert [t.lookup(b) for b in (1, 4, 5, 7, 8, 20, 32, 100)] == [5, 5, 5, 5, 3, 3, 1, 1]
    assert t.act(obs_with([0.5] * 6)) == 5
    assert VLLMDSDTable(SPEC_Q, k=9).k == KMAX  # capped at num_speculative_tokens
    assert VLLMDSDTable(SPEC_Q, schedule="1-4:5;5-8:2", batch_size=6).k == 2
    for bad in ("2-4:5", "1-4:5;3-8:2", "4-1:2", "1-4"):
        with pytest.raises(ValueError):
            parse_schedule(bad)


# ------------------------------------------------------------------ fitted on train only
@pytest.fixture(scope="module")
def peer_sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small generated set, and a copy whose test-split positions are scrambled."""
    from specenv.generator import generate_paper
    from specenv.replay.tables import select_positions

    ts = generate_paper(12, kmax=KMAX, seed=5, name="peers-small")
    a = tmp_path_factory.mktemp("peers") / "a"
    ts.save(a)
    test_ids = set(select_positions(ts, KMAX, "test").generation_ids.tolist())
    pos = ts.positions.copy()
    mask = pos["generation_id"].isin(test_ids).to_numpy()
    assert 0 < mask.sum() < len(pos)
    rng = np.random.default_rng(1)
    rows = np.flatnonzero(mask)
    draft = [c for c in pos.columns if c.split("_")[0] in ("q", "ent", "margin")]
    for cols in (draft, [c for c in pos.columns if c.startswith("rho_")]):  # each row's signals stay consistent
        pos.iloc[rows, [pos.columns.get_loc(c) for c in cols]] = pos.iloc[rng.permutation(rows)][cols].to_numpy()
    ts.positions = pos
    b = tmp_path_factory.mktemp("peers") / "b"
    ts.save(b)
    return a, b


def test_the_fit_reads_the_train_split_only(peer_sets: tuple[Path, Path]) -> None:
    from policies.bench.context import build_context

    a, b = (build_context(str(p), None, "fit-train", None) for p in peer_sets)
    assert not np.array_equal(a.test.q, b.test.q)  # the test split did change
    assert a.peers == b.peers
    assert a.peers.specdecpp.features == a.peers.signals and a.peers.dsd_k == a.best_fixed_k


def test_bench_has_the_peer_rows_with_their_drafting_modes(peer_sets: tuple[Path, Path]) -> None:
    from policies.bench.context import build_context
    from policies.bench.single import default_entries

    ctx = build_context(str(peer_sets[0]), None, "fit-train", None)
    rows = {e.name: e for e in default_entries(ctx)}
    want = {
        "SpecDec++ (acceptance head)": ("sequential", KMAX),
        "DISCO (stop classifier)": ("sequential", KMAX),
        "vLLM adaptive verification": ("block", KMAX),
        "vLLM DSD table (batch 1)": ("none", 0),
    }
    if ctx.train.has_signals:
        want |= {"AdaEDL (entropy bound)": ("sequential", KMAX), "SVIP (entropy)": ("sequential", KMAX)}
    for name, (mode, h) in want.items():
        assert name in rows, name
        assert (rows[name].mode, rows[name].lookahead) == (mode, h), name
    assert rows["vLLM DSD table (batch 1)"].exact_k == ctx.best_fixed_k
    assert "ent" in rows["SpecDec++ (acceptance head)"].signals


# ------------------------------------------------------------------ the registry
def _declared() -> dict[str, EntryPoint]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = data["project"]["entry-points"][registry.ENTRY_POINT_GROUP]
    return {n: EntryPoint(n, v, registry.ENTRY_POINT_GROUP) for n, v in group.items()}


@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> dict[str, EntryPoint]:
    """The entry points pyproject.toml declares, as the registry would see them once installed."""
    eps = _declared()
    monkeypatch.setattr(registry, "_entry_points", lambda: eps)
    return eps


def test_peers_round_trip_through_the_registry(declared: dict[str, EntryPoint]) -> None:
    assert {"adaedl", "svip", "specdec-pp", "disco", "vllm-adaptive-verification", "vllm-dsd-table"} <= set(declared)
    spec_e = spec_for(KMAX, ("q", "ent", "margin"))
    ada = registry.resolve("adaedl:lam=0.4,gamma=0.3", spec_e)
    assert isinstance(ada, AdaEDL) and (ada.lam, ada.gamma) == (0.4, 0.3)
    assert registry.resolve("svip:h=1.5", spec_e).h == 1.5
    pp = registry.resolve("specdec-pp:w_q=2.0,w_depth=-0.1,bias=0.5,threshold=0.7", SPEC_Q)
    assert isinstance(pp, SpecDecPP) and pp.threshold == 0.7
    assert pp.head == LinearHead(("q",), (2.0,), -0.1, 0.5)
    d = registry.resolve("disco:w_q=3.0,bias=-1.0,threshold=0.4", SPEC_Q)
    assert isinstance(d, DISCO) and d.head.weights == (3.0,) and d.threshold == 0.4
    dsd = registry.resolve("vllm-dsd-table:schedule=1-4:3;5-64:1", SPEC_Q)
    assert isinstance(dsd, VLLMDSDTable) and dsd.k == 3
    assert registry.resolve("vllm-dsd-table:k=2", SPEC_Q).act(obs_with([0.5] * KMAX)) == 2
    with pytest.raises(ValueError, match="unknown parameter"):
        registry.resolve("disco:w_foo=1", SPEC_Q)


@pytest.mark.slow
def test_registry_factories_fit_on_a_data_set(declared: dict[str, EntryPoint], peer_sets: tuple[Path, Path]) -> None:
    pp = registry.resolve(f"specdec-pp:dataset={peer_sets[0]}", SPEC_Q)
    assert isinstance(pp, SpecDecPP) and pp.head.features == ("q",) and 0 < pp.threshold < 1
    va = registry.resolve(f"vllm-adaptive-verification:dataset={peer_sets[0]},stale=false", SPEC_Q)
    assert isinstance(va, VLLMAdaptiveVerification) and not va.stale
    assert registry.resolve(f"vllm-dsd-table:dataset={peer_sets[0]}", SPEC_Q).k in range(KMAX + 1)


# ------------------------------------------------------------------ the peers' fit, cached per train split
def test_the_peers_fit_is_cached_in_the_process_and_on_disk(
    peer_sets: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from policies.bench import context
    from policies.peers import fit_peers

    monkeypatch.setenv("SPECENV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(context, "_PEERS", {})
    fits: list[int] = []

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        fits.append(1)
        return fit_peers(*args, **kwargs)

    monkeypatch.setattr(context, "fit_peers", counting)
    ctx = context.build_context(str(peer_sets[0]), None, "fit-train", None)
    fresh = fit_peers(ctx.train, ctx.cost_model, best_fixed_k=ctx.best_fixed_k)  # by hand, no cache
    assert ctx.peers == fresh and len(fits) == 1
    entries = list((tmp_path / "cache" / context.PEERS_CACHE_SUBDIR).glob("peers-*.json"))
    assert len(entries) == 1
    # a new context in the same process, then in a fresh one (process cache emptied): no new fit
    assert context.build_context(str(peer_sets[0]), None, "fit-train", None).peers == fresh and len(fits) == 1
    monkeypatch.setattr(context, "_PEERS", {})
    again = context.build_context(str(peer_sets[0]), None, "fit-train", None)
    assert again.peers == fresh and len(fits) == 1
    # every float exactly as fitted (repr round trip), the heads' too
    assert again.peers.specdecpp.weights == fresh.specdecpp.weights and again.peers.svip_h == fresh.svip_h
    # another cost model is another key: refitted
    monkeypatch.setattr(context, "_PEERS", {})
    other = context.build_context(str(peer_sets[0]), None, "profile", None)
    assert other.peers is not None and len(fits) == 2
    assert len(list(entries[0].parent.glob("peers-*.json"))) == 2
    # a damaged entry is ignored and rewritten
    monkeypatch.setattr(context, "_PEERS", {})
    entries[0].write_text(entries[0].read_text()[:-40])
    assert context.build_context(str(peer_sets[0]), None, "fit-train", None).peers == fresh and len(fits) == 3
    assert context._read_peers(entries[0], context.peers_cache_key(ctx)) == fresh


def test_a_set_not_loaded_from_verified_files_is_fitted_every_time(peer_sets: tuple[Path, Path], monkeypatch) -> None:
    from policies.bench import context
    from specenv.traces.traceset import TraceSet

    ts = TraceSet.load(peer_sets[0], verify_hashes=False)
    ctx = context.build_context(ts, None, "fit-train", None)
    assert context.peers_cache_key(ctx) is None
    calls: list[int] = []
    real = context.fit_peers
    monkeypatch.setattr(context, "fit_peers", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert context.cached_peers(ctx) == context.cached_peers(ctx) and len(calls) == 2
