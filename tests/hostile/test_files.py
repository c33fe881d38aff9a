"""Hostile files: every file kind specenv reads gives one line naming the file and field, exit 2, nothing written.

Through the CLI where a command reads the file (``validate`` and ``fit`` for trace sets, ``oracle
--cost-model`` for cost models, ``serve --policy ... --print-command`` for policies), through the
Python loaders otherwise (recordings, prompt sets, model manifests). Memory bombs run in a
subprocess under a 1 GiB address-space limit.
"""

from __future__ import annotations

import io
import json
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specenv.cost.model import CostModel
from specenv.engines.hf.models import load_prompts, read_model_manifest
from specenv.engines.recorder import PartRecorder, load_recording
from specenv.policy.mlp import MLPPolicy
from specenv.traces.schema import ModelFacts, TraceError
from specenv.traces.traceset import sha256_file
from tests.hostile.harness import assert_rejected, assert_unchanged, reject_cleanly, run_cli, run_limited, snapshot

SHIPPED_POLICY = Path(__file__).resolve().parents[2] / "policies" / "shipped" / "paper-default-v2" / "ppo"


# ====================================================================== trace-set manifest
def _copy_set(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "set"
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        path = root / "manifest.json"
        m = json.loads(path.read_text())
        fn(m)
        path.write_text(json.dumps(m))

    return mutate


def _raw_manifest(fn: Callable[[str], str]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        path = root / "manifest.json"
        path.write_text(fn(path.read_text()))

    return mutate


def _set(key: str, value: Any) -> Callable[[Path], None]:
    def fn(m: dict[str, Any]) -> None:
        obj = m
        *parents, last = key.split(".")
        for p in parents:
            obj = obj[p]
        obj[last] = value

    return _edit_manifest(fn)


def _drop(key: str) -> Callable[[Path], None]:
    return _edit_manifest(lambda m: m.pop(key))


def _raw_value(key: str, literal: str) -> Callable[[Path], None]:
    """Write ``"key": <literal>`` as raw JSON text (for literals json.dumps cannot produce)."""

    def fn(text: str) -> str:
        m = json.loads(text)
        m[key] = "@@RAW@@"
        return json.dumps(m).replace('"@@RAW@@"', literal)

    return _raw_manifest(fn)


MANIFEST_CASES: list[tuple[str, Callable[[Path], None], list[str]]] = [
    ("kmax-1e9", _set("kmax", 10**9), ["manifest.json", "kmax"]),
    ("kmax-1e999", _raw_value("kmax", "1e999"), ["manifest.json", "kmax"]),
    ("kmax-bool", _set("kmax", True), ["kmax", "bool"]),
    ("kmax-zero", _set("kmax", 0), ["kmax"]),
    ("kmax-string", _set("kmax", "6"), ["kmax", "string"]),
    ("kmax-float", _set("kmax", 6.0), ["kmax"]),
    ("kmax-huge-literal", _raw_value("kmax", "1" * 5000), ["manifest.json", "JSON"]),
    ("counts-int", _set("counts", 5), ["manifest.json", "counts"]),
    ("counts-negative", _set("counts.rounds", -1), ["counts.rounds"]),
    ("counts-unknown-key", _set("counts.tokens", 3), ["counts.tokens"]),
    ("counts-positions-wrong", _set("counts.positions", 3), ["counts.positions", "rows"]),
    ("counts-generations-wrong", _set("counts.generations", 9), ["counts.generations"]),
    ("extra-int", _set("extra", 5), ["manifest.json", "extra"]),
    ("rows-list", _set("files.rounds.rows", [1]), ["files.rounds.rows"]),
    ("rows-1e999", _raw_manifest(lambda t: t.replace('"rows": ', '"rows": 1e999, "x": ', 1)), ["rows"]),
    ("files-list", _set("files", [1]), ["files"]),
    ("files-empty", _set("files", {}), ["files"]),
    ("files-unknown-table", _set("files.tokens", {"path": "t.parquet", "sha256": "0" * 64}), ["files"]),
    ("files-path-parent", _set("files.rounds.path", "../rounds.parquet"), ["files.rounds.path"]),
    ("files-path-absolute", _set("files.rounds.path", "/etc/passwd"), ["files.rounds.path"]),
    ("files-path-hidden", _set("files.rounds.path", ".rounds.parquet"), ["files.rounds.path"]),
    ("files-same-path", _set("files.rounds.path", "positions.parquet"), ["files"]),
    ("sha256-not-hex", _set("files.rounds.sha256", "xyz"), ["files.rounds.sha256"]),
    ("max_new_tokens-zero", _set("max_new_tokens", 0), ["max_new_tokens"]),
    ("max_new_tokens-negative", _set("max_new_tokens", -5), ["max_new_tokens"]),
    ("max_new_tokens-bool", _set("max_new_tokens", False), ["max_new_tokens"]),
    ("top_k-zero", _set("model.top_k", 0), ["model.top_k"]),
    ("top_k-above-n_experts", _set("model.top_k", 200), ["model", "top_k"]),
    ("n_experts-1e5", _set("model.n_experts", 100_000), ["model.n_experts"]),
    ("n_layers-zero", _set("model.n_layers", 0), ["model.n_layers"]),
    ("n_layers-bool", _set("model.n_layers", True), ["model.n_layers"]),
    ("model-missing-field", _edit_manifest(lambda m: m["model"].pop("top_k")), ["model.top_k"]),
    ("model-string", _set("model", "qwen"), ["model"]),
    ("name-newline", _set("name", "evil\nspecenv: ok"), ["manifest.json", "name"]),
    ("source-escape", _set("source", "gen\x1b[31m"), ["source"]),
    ("profile-tab", _set("profile", "a\tb"), ["profile"]),
    ("format-wrong", _set("format", "specenv.other"), ["format"]),
    ("format-missing", _drop("format"), ["format"]),
    ("schema_version-string", _set("schema_version", "1"), ["schema_version"]),
    ("greedy-string", _set("greedy", "yes"), ["greedy"]),
    ("unknown-field", _set("kmaxx", 3), ["kmaxx"]),
    ("duplicate-key", _raw_manifest(lambda t: t.replace('"kmax": ', '"kmax": 6, "kmax": ', 1)), ["duplicate", "kmax"]),
    ("nested-200k", _raw_manifest(lambda t: t[:-1] + ', "deep": ' + "[" * 200_000 + "]" * 200_000 + "}"), ["nested"]),
    ("array-not-object", _raw_manifest(lambda t: "[" + t + "]"), ["manifest.json", "object"]),
    ("not-utf8", lambda r: (r / "manifest.json").write_bytes(b'{"name": "\xff\xfe"}'), ["manifest.json", "UTF-8"]),
    ("manifest-is-folder", lambda r: ((r / "manifest.json").unlink(), (r / "manifest.json").mkdir()), ["manifest"]),
]


@pytest.mark.parametrize(("case", "mutate", "names"), MANIFEST_CASES, ids=[c[0] for c in MANIFEST_CASES])
def test_manifest_validate(small_traces: Path, tmp_path: Path, case: str, mutate: Callable, names: list[str]) -> None:
    root = _copy_set(small_traces, tmp_path)
    mutate(root)
    reject_cleanly(["validate", root], names, [tmp_path])


# ====================================================================== Parquet tables (consistency)
def _rewrite(root: Path, table: str, fn: Callable[[pa.Table], pa.Table]) -> None:
    path = root / f"{table}.parquet"
    t = fn(pq.read_table(path))
    pq.write_table(t, path)
    m = json.loads((root / "manifest.json").read_text())
    m["files"][table]["sha256"] = sha256_file(path)
    m["files"][table]["rows"] = t.num_rows
    m["counts"][table] = t.num_rows
    if table == "positions":
        m["counts"]["generations"] = len(set(t.column("generation_id").to_pylist()))
    (root / "manifest.json").write_text(json.dumps(m))


def _rows_where(keep: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[pa.Table], pa.Table]:
    def fn(t: pa.Table) -> pa.Table:
        gid = np.asarray(t.column("generation_id").to_pylist())
        idx = np.arange(t.num_rows)
        return t.filter(pa.array(keep(gid, idx)))

    return fn


def _category(fn: Callable[[list[str], list[int]], list[str]]) -> Callable[[pa.Table], pa.Table]:
    def edit(t: pa.Table) -> pa.Table:
        cats = [str(c) for c in t.column("category").to_pylist()]
        gids = t.column("generation_id").to_pylist()
        i = t.schema.get_field_index("category")
        return t.set_column(i, "category", pa.array(fn(cats, gids), pa.string()))

    return edit


def _flip_one_round(cats: list[str], gids: list[int]) -> list[str]:
    # a row in the middle of some generation gets another category
    g = gids[5]
    rows = [i for i, x in enumerate(gids) if x == g]
    cats[rows[len(rows) // 2]] = "other_category"
    return cats


def _rename_generation(cats: list[str], gids: list[int]) -> list[str]:
    return [("renamed" if g == gids[0] else c) for c, g in zip(cats, gids, strict=True)]


def _lower_kmax(root: Path) -> None:
    m = json.loads((root / "manifest.json").read_text())
    m["kmax"] -= 1
    (root / "manifest.json").write_text(json.dumps(m))


def _drop_positions_table(root: Path) -> None:
    m = json.loads((root / "manifest.json").read_text())
    del m["files"]["positions"]
    (root / "positions.parquet").unlink()
    (root / "manifest.json").write_text(json.dumps(m))


TABLE_CASES: list[tuple[str, Callable[[Path], None], list[str]]] = [
    ("kmax-below-positions-columns", _lower_kmax, ["positions.parquet", "rho_6", "kmax=5"]),
    (
        "kmax-below-rounds-budgets",
        lambda r: (_drop_positions_table(r), _edit_manifest(lambda m: m["counts"].pop("positions"))(r), _lower_kmax(r)),
        ["rounds.parquet", "'K'", "0..5"],
    ),
    (
        "rounds-missing-a-generation",
        lambda r: _rewrite(r, "rounds", _rows_where(lambda g, i: g != g[0])),
        ["rounds.parquet", "positions.parquet", "generation ids"],
    ),
    (
        "positions-missing-a-generation",
        lambda r: _rewrite(r, "positions", _rows_where(lambda g, i: g != g[-1])),
        ["rounds.parquet", "generation ids"],
    ),
    (
        "category-changes-in-rounds",
        lambda r: _rewrite(r, "rounds", _category(_flip_one_round)),
        ["rounds.parquet", "category"],
    ),
    (
        "category-differs-between-tables",
        lambda r: _rewrite(r, "rounds", _category(_rename_generation)),
        ["rounds.parquet", "positions.parquet", "category"],
    ),
    (
        "counts-rounds-without-table",
        lambda r: (_drop_positions_table(r), _set("counts.positions", 5)(r)),
        ["counts.positions"],
    ),
    ("parquet-rows-footer-mismatch", _set("files.rounds.rows", 3), ["rounds.parquet", "rows"]),
]


@pytest.mark.parametrize(("case", "mutate", "names"), TABLE_CASES, ids=[c[0] for c in TABLE_CASES])
def test_tables_validate(small_traces: Path, tmp_path: Path, case: str, mutate: Callable, names: list[str]) -> None:
    root = _copy_set(small_traces, tmp_path)
    mutate(root)
    reject_cleanly(["validate", root], names, [tmp_path])


def test_bad_manifest_refused_by_fit_before_any_output(small_traces: Path, tmp_path: Path) -> None:
    root = _copy_set(small_traces, tmp_path)
    _set("max_new_tokens", 0)(root)
    reject_cleanly(["fit", root, "--out", tmp_path / "c.json"], ["max_new_tokens"], [tmp_path])


# ---------------------------------------------------------------------- memory bombs (subprocess, 1 GiB)
def _bomb(root: Path, kmax: int, rounds_only: bool) -> None:
    if rounds_only:
        _drop_positions_table(root)
        _edit_manifest(lambda m: m["counts"].pop("positions"))(root)
    _set("kmax", kmax)(root)


@pytest.mark.parametrize(
    ("kmax", "rounds_only", "command"),
    [(10**9, False, "validate"), (10**12, True, "validate"), (10**12, True, "fit")],
    ids=["kmax-1e9-validate", "kmax-1e12-rounds-only-validate", "kmax-1e12-rounds-only-fit"],
)
def test_kmax_memory_bomb_fails_fast(
    small_traces: Path, tmp_path: Path, kmax: int, rounds_only: bool, command: str
) -> None:
    root = _copy_set(small_traces, tmp_path)
    _bomb(root, kmax, rounds_only)
    before = snapshot(tmp_path)
    t0 = time.monotonic()
    out = run_limited([command, root], memory_bytes=1 << 30, seconds=60)
    assert time.monotonic() - t0 < 20  # loose guard on a noisy machine; the refusal itself is immediate
    assert_rejected(out, "manifest.json", "kmax")
    assert_unchanged(before, snapshot(tmp_path))


# ====================================================================== cost model (oracle --cost-model)
def _cost_json(kmax: int = 6) -> dict[str, Any]:
    return CostModel.paper_profile(kmax).to_json()


def _cm(fn: Callable[[dict[str, Any]], Any]) -> Callable[[], str]:
    def make() -> str:
        obj = _cost_json()
        fn(obj)
        return json.dumps(obj)

    return make


def _cm_set(path: str, value: Any) -> Callable[[], str]:
    def fn(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for p in parents:
            obj = obj[p]
        obj[last] = value

    return _cm(fn)


def _cm_raw(path: str, literal: str) -> Callable[[], str]:
    return lambda: _cm_set(path, "@@RAW@@")().replace('"@@RAW@@"', literal)


COST_CASES: list[tuple[str, Callable[[], str], list[str]]] = [
    ("d1-nan", _cm_raw("draft.d1", "NaN"), ["draft.d1", "finite"]),
    ("d0-infinity", _cm_raw("draft.d0", "Infinity"), ["draft.d0"]),
    ("d0-1e999", _cm_raw("draft.d0", "1e999"), ["draft.d0"]),
    ("beta0-nan", _cm_raw("target.3.beta0", "NaN"), ["target.3.beta0"]),
    ("alpha-negative", _cm_set("target.4.alpha", -10.0), ["target.4", "<= 0"]),
    ("beta0-negative", _cm_set("target.0.beta0", -100.0), ["target.0", "<= 0"]),
    ("c-negative", _cm_set("target.2.c", -0.01), ["target.2", "<= 0"]),
    ("d1-negative", _cm_set("draft.d1", -1.0), ["draft", "< 0"]),
    ("d0-negative", _cm_set("draft.d0", -5.0), ["draft", "< 0"]),
    ("top_k-zero", _cm_set("top_k", 0), ["top_k"]),
    ("top_k-1e5", _cm_set("top_k", 100_000), ["top_k"]),
    ("top_k-float", _cm_set("top_k", 8.0), ["top_k"]),
    ("top_k-mismatch", _cm_set("top_k", 4), ["top_k", "manifest.json"]),
    ("n_experts-mismatch", _cm_set("n_experts", 64), ["n_experts", "manifest.json"]),
    ("n_layers-mismatch", _cm_set("n_layers", 6), ["n_layers", "manifest.json"]),
    ("top_k-above-n_experts", _cm(lambda o: o.update(n_experts=4)), ["top_k", "n_experts"]),
    ("kmax-below-set", lambda: json.dumps(_cost_json(3)), ["kmax", "manifest.json"]),
    ("kmax-1e9", _cm_set("kmax", 10**9), ["kmax"]),
    ("kmax-bool", _cm_set("kmax", True), ["kmax"]),
    ("target-missing-budget", _cm(lambda o: o["target"].pop("5")), ["target"]),
    ("target-row-missing-field", _cm(lambda o: o["target"]["2"].pop("c")), ["target.2.c"]),
    ("target-list", _cm_set("target", [1, 2]), ["target"]),
    ("draft-missing", _cm(lambda o: o.pop("draft")), ["draft"]),
    ("format-wrong", _cm_set("format", "specenv.costmodel/9"), ["format"]),
    ("format-missing", _cm(lambda o: o.pop("format")), ["format"]),
    ("ar_extrapolated-string", _cm_set("ar_extrapolated", "yes"), ["ar_extrapolated"]),
    ("diagnostics-int", _cm_set("diagnostics", 5), ["diagnostics"]),
    ("source-list", _cm_set("source", [1]), ["source"]),
    ("unknown-field", _cm_set("alpha", 1.0), ["alpha"]),
    ("duplicate-key", lambda: json.dumps(_cost_json()).replace('"top_k": 8', '"top_k": 8, "top_k": 8'), ["duplicate"]),
    ("truncated", lambda: json.dumps(_cost_json())[:200], ["JSON"]),
    ("array", lambda: "[1, 2, 3]", ["object"]),
    ("nested-200k", lambda: "[" * 200_000 + "]" * 200_000, ["nested"]),
    ("empty-file", lambda: "", ["JSON"]),
]


def test_cost_model_base_case_is_accepted(small_traces: Path, tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(_cost_json()))
    out = run_cli(["oracle", small_traces, "--cost-model", path, "--episodes", "0", "--json"])
    assert out.exit_code == 0, out.stderr
    assert json.loads(out.stdout)["s_max_pooled"] > 1.0


@pytest.mark.parametrize(("case", "make", "names"), COST_CASES, ids=[c[0] for c in COST_CASES])
def test_cost_model_oracle(
    small_traces: Path, tmp_path: Path, case: str, make: Callable[[], str], names: list[str]
) -> None:
    path = tmp_path / "cost.json"
    path.write_text(make())
    reject_cleanly(
        ["oracle", small_traces, "--cost-model", path, "--episodes", "0", "--json"],
        ["--cost-model", "cost.json", *names],
        [tmp_path, small_traces],
    )


# ====================================================================== policy (serve --policy ... --print-command)
def _policy(tmp_path: Path) -> Path:
    dst = tmp_path / "pol"
    shutil.copytree(SHIPPED_POLICY, dst)
    return dst


def _weights(fn: Callable[[dict[str, np.ndarray]], Any]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        with np.load(folder / "weights.npz") as z:
            arrays = {k: z[k] for k in z.files}
        fn(arrays)
        with open(folder / "weights.npz", "wb") as fh:
            np.savez(fh, **arrays)

    return mutate


def _pjson(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        d = json.loads((folder / "policy.json").read_text())
        fn(d)
        (folder / "policy.json").write_text(json.dumps(d))

    return mutate


def _huge_npz(folder: Path) -> None:
    """A ~1 KB weights.npz whose W0 header declares a (200000, 200000) float32 array (149 GiB)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (200_000, 200_000)})
    with zipfile.ZipFile(folder / "weights.npz", "w") as zf:
        zf.writestr("W0.npy", header.getvalue() + b"\0" * 64)
        for name in ("b0", "W1", "b1", "W2", "b2"):
            buf = io.BytesIO()
            np.save(buf, np.zeros(3, np.float32))
            zf.writestr(f"{name}.npy", buf.getvalue())


def _truncate_npz(folder: Path) -> None:
    data = (folder / "weights.npz").read_bytes()
    (folder / "weights.npz").write_bytes(data[: len(data) // 2])


def _corrupt_member(folder: Path) -> None:
    """Valid zip directory, but the stored bytes of the first array's data are flipped (bad CRC)."""
    data = bytearray((folder / "weights.npz").read_bytes())
    data[200:260] = bytes(b ^ 0xFF for b in data[200:260])
    (folder / "weights.npz").write_bytes(bytes(data))


POLICY_CASES: list[tuple[str, Callable[[Path], None], list[str]]] = [
    ("W-nan", _weights(lambda a: a["W1"].__setitem__((0, 0), np.nan)), ["weights.npz", "W1", "NaN"]),
    ("b-inf", _weights(lambda a: a["b2"].__setitem__(0, np.inf)), ["weights.npz", "b2"]),
    ("b-shape-1", _weights(lambda a: a.__setitem__("b0", np.zeros(1, np.float32))), ["weights.npz", "b0"]),
    ("W-3d", _weights(lambda a: a.__setitem__("W1", a["W1"][None])), ["weights.npz", "W1", "2-D"]),
    ("W-int", _weights(lambda a: a.__setitem__("W0", a["W0"].astype(np.int32))), ["weights.npz", "W0", "float"]),
    ("W-first-layer-width", _weights(lambda a: a.__setitem__("W0", a["W0"][:5])), ["weights.npz", "W0", "inputs"]),
    (
        "W-last-layer-width",
        _weights(lambda a: (a.__setitem__("W2", a["W2"][:, :4]), a.__setitem__("b2", a["b2"][:4]))),
        ["weights.npz", "scores"],
    ),
    ("array-missing", _weights(lambda a: a.pop("b1")), ["weights.npz", "b1", "missing"]),
    ("array-extra", _weights(lambda a: a.__setitem__("W9", np.zeros((2, 2), np.float32))), ["weights.npz", "W9"]),
    ("npz-149GiB-header", _huge_npz, ["weights.npz", "W0"]),
    ("npz-not-zip", lambda f: (f / "weights.npz").write_bytes(b"this is not a zip file"), ["weights.npz", "zip"]),
    ("npz-truncated", _truncate_npz, ["weights.npz"]),
    ("npz-corrupt-member", _corrupt_member, ["weights.npz"]),
    ("npz-missing", lambda f: (f / "weights.npz").unlink(), ["weights.npz"]),
    ("meta-int", _pjson(lambda d: d.__setitem__("meta", 5)), ["policy.json", "meta"]),
    ("layers-zero", _pjson(lambda d: d.__setitem__("layers", 0)), ["policy.json", "layers"]),
    ("layers-1e9", _pjson(lambda d: d.__setitem__("layers", 10**9)), ["policy.json", "layers"]),
    ("layers-bool", _pjson(lambda d: d.__setitem__("layers", True)), ["policy.json", "layers"]),
    ("layers-more-than-arrays", _pjson(lambda d: d.__setitem__("layers", 4)), ["weights.npz", "W3"]),
    ("activation-unknown", _pjson(lambda d: d.__setitem__("activation", "sigmoid")), ["policy.json", "activation"]),
    ("name-newline", _pjson(lambda d: d.__setitem__("name", "a\nb")), ["policy.json", "name"]),
    ("observation-kmax-1e9", _pjson(lambda d: d["observation"].__setitem__("kmax", 10**9)), ["policy.json", "kmax"]),
    ("observation-int", _pjson(lambda d: d.__setitem__("observation", 5)), ["policy.json", "observation"]),
    ("kind-wrong", _pjson(lambda d: d.__setitem__("kind", "tree")), ["policy.json", "MLP"]),
    (
        "duplicate-key",
        lambda f: (f / "policy.json").write_text(
            (f / "policy.json").read_text().replace('"layers"', '"layers": 3, "layers"', 1)
        ),
        ["policy.json", "duplicate"],
    ),
    ("policy-json-truncated", lambda f: (f / "policy.json").write_text('{"format": '), ["policy.json", "JSON"]),
]


def test_policy_base_case_is_accepted(tmp_path: Path) -> None:
    out = run_cli(["serve", "--policy", _policy(tmp_path), "--print-command", "--", "m"])
    assert out.exit_code == 0, out.stderr


@pytest.mark.parametrize(("case", "mutate", "names"), POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
def test_policy_serve(tmp_path: Path, case: str, mutate: Callable[[Path], None], names: list[str]) -> None:
    folder = _policy(tmp_path)
    mutate(folder)
    reject_cleanly(["serve", "--policy", folder, "--print-command", "--", "m"], ["--policy", *names], [tmp_path])


def test_policy_149gib_npz_under_memory_limit(tmp_path: Path) -> None:
    folder = _policy(tmp_path)
    _huge_npz(folder)
    before = snapshot(tmp_path)
    t0 = time.monotonic()
    out = run_limited(["serve", "--policy", folder, "--print-command", "--", "m"], memory_bytes=1 << 30, seconds=60)
    assert time.monotonic() - t0 < 20  # loose guard; the header is read, nothing is allocated
    assert_rejected(out, "weights.npz", "W0")
    assert_unchanged(before, snapshot(tmp_path))


def test_non_finite_scores_give_an_invalid_k() -> None:
    """argmax(NaN) = 0 would be a valid k (speculation silently off): the policy answers -1, which callers refuse."""
    pol = MLPPolicy.load(SHIPPED_POLICY)
    obs = np.zeros((3, pol.spec.dim), np.float32)
    obs[1, 0] = np.nan
    obs[2, -1] = np.nan
    ks = pol.act_batch(obs)
    assert ks[0] >= 0 and ks[1] == -1 and ks[2] == -1
    assert pol.act(obs[1]) == -1


# ====================================================================== recordings (Python loader)
FACTS = ModelFacts(n_layers=2, n_experts=16, top_k=2)


def _row(gid: int, rnd: int) -> dict[str, Any]:
    return {
        "generation_id": gid, "category": "code", "round": rnd, "K": 3, "m": 4, "accepted": 1, "L": 20 + rnd,
        "U_r": 4.5, "E_max": 2.0, "T_T_ms": 3.0, "T_D_ms": 1.5, "request_id": f"r{gid}", "t": rnd, "step": rnd,
        "batch_size": 1, "batch_tokens": 4, "drafted": 4, "policy_k": 3, "fallback": False, "capped": False,
        "greedy": True, "step_ms": 5.0, "T_T_cpu_ms": 2.9, "T_D_cpu_ms": 1.4, "timing": "hooks", "run": "",
        "accepted_raw": 1,
    }  # fmt: skip


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    folder = tmp_path / "rec"
    rec = PartRecorder(folder, FACTS, kmax=4, meta={}, source="vllm", part_rounds=4)
    for i in range(8):
        rec.add(_row(i // 4, i % 4))
        rec.maybe_flush()
    rec.close()
    assert len(load_recording(folder).rounds) == 8  # the base case loads
    return folder


def _json_file(rel: str, fn: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        path = folder / rel
        d = json.loads(path.read_text())
        fn(d)
        path.write_text(json.dumps(d))

    return mutate


def _text_file(rel: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / rel).write_text(text)


IDX = "parts/part-000000.json"
RECORDING_CASES: list[tuple[str, Callable[[Path], None], list[str]]] = [
    ("index-path-parent", _json_file(IDX, lambda d: d.__setitem__("path", "../../outside.parquet")), [IDX, "path"]),
    ("index-path-absolute", _json_file(IDX, lambda d: d.__setitem__("path", "/etc/passwd")), [IDX, "path"]),
    ("index-path-subfolder", _json_file(IDX, lambda d: d.__setitem__("path", "sub/part.parquet")), [IDX, "path"]),
    ("index-rows-negative", _json_file(IDX, lambda d: d.__setitem__("rows", -1)), [IDX, "rows"]),
    (
        "index-rows-1e999",
        lambda f: (f / IDX).write_text((f / IDX).read_text().replace('"rows": 4', '"rows": 1e999')),
        [IDX, "rows"],
    ),
    ("index-sha-not-hex", _json_file(IDX, lambda d: d.__setitem__("sha256", "nothex")), [IDX, "sha256"]),
    ("index-format-wrong", _json_file(IDX, lambda d: d.__setitem__("format", "x")), [IDX, "format"]),
    ("index-not-json", _text_file(IDX, "{half"), [IDX, "JSON"]),
    (
        "index-duplicate-key",
        lambda f: (f / IDX).write_text((f / IDX).read_text().replace('"rows"', '"rows": 4, "rows"', 1)),
        [IDX, "duplicate"],
    ),
    ("recording-no-model", _json_file("recording.json", lambda d: d.pop("model")), ["recording.json", "model"]),
    (
        "recording-corrupt",
        _text_file("recording.json", '{"format": "specenv.recording/1", "mod'),
        ["recording.json", "JSON"],
    ),
    (
        "recording-model-string",
        _json_file("recording.json", lambda d: d.__setitem__("model", "qwen")),
        ["recording.json", "model"],
    ),
    (
        "recording-top_k-above-n_experts",
        _json_file("recording.json", lambda d: d["model"].__setitem__("top_k", 99)),
        ["recording.json", "top_k"],
    ),
    (
        "recording-kmax-1e9",
        _json_file("recording.json", lambda d: d.__setitem__("kmax", 10**9)),
        ["recording.json", "kmax"],
    ),
    (
        "recording-format-wrong",
        _json_file("recording.json", lambda d: d.__setitem__("format", "x")),
        ["recording.json", "format"],
    ),
    (
        "recording-source-newline",
        _json_file("recording.json", lambda d: d.__setitem__("source", "vllm\nx")),
        ["recording.json", "source"],
    ),
    ("recording-array", _text_file("recording.json", "[]"), ["recording.json", "object"]),
]


def _assert_one_line(exc: BaseException, names: list[str]) -> None:
    msg = str(exc)
    assert "\n" not in msg, msg
    for name in names:
        assert name in msg, (name, msg)


@pytest.mark.parametrize(("case", "mutate", "names"), RECORDING_CASES, ids=[c[0] for c in RECORDING_CASES])
def test_recording_load(
    recording: Path, tmp_path: Path, case: str, mutate: Callable[[Path], None], names: list[str]
) -> None:
    (tmp_path / "outside.parquet").write_bytes((recording / "parts" / "part-000000.parquet").read_bytes())
    mutate(recording)
    before = snapshot(tmp_path)
    with pytest.raises(TraceError) as info:
        load_recording(recording)
    _assert_one_line(info.value, names)
    assert_unchanged(before, snapshot(tmp_path))


@pytest.mark.parametrize(
    "text",
    ["{not json", "[]", json.dumps({"format": "specenv.recording/1", "kmax": 4})],
    ids=["corrupt", "array", "no-model"],
)
def test_recorder_refuses_a_bad_recording_json_in_one_line(tmp_path: Path, text: str) -> None:
    folder = tmp_path / "rec"
    (folder / "parts").mkdir(parents=True)
    (folder / "recording.json").write_text(text)
    before = snapshot(tmp_path)
    with pytest.raises(TraceError) as info:
        PartRecorder(folder, FACTS, kmax=4, meta={}, source="vllm")
    _assert_one_line(info.value, ["recording.json"])
    assert_unchanged(before, snapshot(tmp_path))


# ====================================================================== prompt sets, model manifests (Python loaders)
def _prompts(**change: Any) -> str:
    doc = {
        "name": "p",
        "prompts": [{"id": 0, "category": "code", "text": "def f():"}, {"id": 1, "category": "doc", "text": "x"}],
    }
    doc.update(change)
    return json.dumps(doc)


def _prompt(i: int, **change: Any) -> str:
    doc = json.loads(_prompts())
    doc["prompts"][i].update(change)
    return json.dumps(doc)


PROMPT_CASES: list[tuple[str, str, list[str]]] = [
    ("empty", _prompts(prompts=[]), ["prompts"]),
    ("not-a-list", _prompts(prompts={"a": 1}), ["prompts"]),
    ("missing-prompts", json.dumps({"name": "p"}), ["prompts"]),
    ("duplicate-id", _prompt(1, id=0), ["prompts", "repeats id 0"]),
    ("id-negative", _prompt(0, id=-1), ["prompts.0.id"]),
    ("id-bool", _prompt(0, id=True), ["prompts.0.id"]),
    ("id-float", _prompt(0, id=1.0), ["prompts.0.id"]),
    ("id-1e999", _prompts().replace('"id": 0', '"id": 1e999'), ["prompts.0.id"]),
    ("category-newline", _prompt(1, category="a\nb"), ["prompts.1.category"]),
    ("text-missing", json.dumps({"prompts": [{"id": 0, "category": "c"}]}), ["prompts.0.text"]),
    ("text-number", _prompt(0, text=5), ["prompts.0.text"]),
    ("line-negative", _prompt(0, line=-3), ["prompts.0.line"]),
    ("unknown-prompt-field", _prompt(0, tokens=[1]), ["prompts.0.tokens"]),
    ("array", "[]", ["object"]),
    ("duplicate-key", _prompts().replace('"name": "p"', '"prompts": [], "name": "p"'), ["duplicate"]),
    ("truncated", _prompts()[:30], ["JSON"]),
]


@pytest.mark.parametrize(("case", "text", "names"), PROMPT_CASES, ids=[c[0] for c in PROMPT_CASES])
def test_prompt_set(tmp_path: Path, case: str, text: str, names: list[str]) -> None:
    path = tmp_path / "prompts.json"
    path.write_text(text)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    _assert_one_line(info.value, ["prompts.json", *names])
    assert_unchanged(before, snapshot(tmp_path))


def test_prompt_set_base_case_loads(tmp_path: Path) -> None:
    path = tmp_path / "prompts.json"
    path.write_text(_prompts())
    assert [p.id for p in load_prompts(path)] == [0, 1]


def _model_manifest(files: Any) -> str:
    return json.dumps({"name": "m", "files": files})


HEX = "a" * 64
MODEL_CASES: list[tuple[str, str, list[str]]] = [
    ("path-parent", _model_manifest({"../../etc/passwd": {"sha256": HEX}}), ["files", "relative path"]),
    ("path-absolute", _model_manifest({"/etc/passwd": {"sha256": HEX}}), ["files", "relative path"]),
    ("path-inner-parent", _model_manifest({"target/../../x": {"sha256": HEX}}), ["files"]),
    ("sha256-not-hex", _model_manifest({"target/config.json": {"sha256": "zz"}}), ["sha256"]),
    ("sha256-missing", _model_manifest({"target/config.json": {"bytes": 3}}), ["sha256"]),
    ("bytes-negative", _model_manifest({"target/config.json": {"sha256": HEX, "bytes": -1}}), ["bytes"]),
    ("files-int", _model_manifest(5), ["files"]),
    ("name-newline", json.dumps({"name": "a\nb", "files": {}}), ["name"]),
    ("not-json", "{", ["JSON"]),
]


@pytest.mark.parametrize(("case", "text", "names"), MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_model_manifest(tmp_path: Path, case: str, text: str, names: list[str]) -> None:
    (tmp_path / "manifest.json").write_text(text)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        read_model_manifest(tmp_path)
    _assert_one_line(info.value, ["manifest.json", *names])
    assert_unchanged(before, snapshot(tmp_path))
