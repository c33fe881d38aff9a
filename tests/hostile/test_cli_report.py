"""Hostile inputs of ``specenv report DIR``: a bad DIR, missing, garbled or hostile JSON, a fake figure.

Every refused case: exit 2, one ``specenv: error:`` line naming the folder or the file (and the
field), nothing written under the case's folder (no ``report.html``, no temporary file).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.hostile.harness import reject_cleanly, run_cli

FIT = {
    "per_k": [
        {"K": 1, "alpha": 0.084, "c": 0.0011, "beta0": 7.3, "N": 100, "R2": 0.98, "oos_mape_pct": 0.4, "alpha_p": 0.0}
    ],
    "forms": [{"model": "U_r + L", "R2": 0.83, "cv_rmse_ms": 0.69, "cv_mape_pct": 4.6}],
    "draft": {"d1": 0.459, "d0": 0.073, "R2": 0.99},
    "ar": {"extrapolated": True},
    "cost_model": {"source": {"traces": "toy"}},
}
ORACLE = {
    "dataset": "toy",
    "split": "all",
    "cost_model": "fit",
    "kmax": 2,
    "lookahead": 0,
    "generations": 3,
    "tokens": 300,
    "s_max_pooled": 1.5,
    "s_max_mean": 1.52,
    "mean_k": 1.6,
    "mean_accepted": 1.1,
    "expected_rounds": 140.0,
    "cost_per_token_ms": 4.0,
    "ar_per_token_ms": 6.0,
    "sweep": [
        {
            "kmax": 1,
            "s_max_pooled": 1.3,
            "s_max_mean": 1.3,
            "mean_k": 0.9,
            "mean_accepted": 0.8,
            "best_fixed_k": 1,
            "best_fixed_speedup": 1.29,
        }
    ],
    "delta": {
        "decisions": 10,
        "points": 20,
        "quadrants": {"I": 10, "II": 0, "III": 8, "IV": 2, "axis": 0},
        "lambda_sep_ms": 3.0,
        "sep_error": 0.05,
        "lambda_ls_ms": 2.0,
        "r2_origin": 0.6,
        "lambda_interval_ms": [2.5, 2.0],
    },
}
ROW = {
    "policy": "fixed k=1",
    "evaluation": "exact",
    "speedup_mean": 1.3,
    "ci95_low": 1.3,
    "ci95_high": 1.3,
    "speedup_pooled": 1.3,
    "pooled_ci95_low": 1.3,
    "pooled_ci95_high": 1.3,
    "oracle_pct": 86.0,
    "mean_k": 1.0,
    "mean_accepted": 0.8,
    "constant": True,
    "learned": False,
}
BENCH = {
    "context": {
        "dataset": "toy",
        "kmax": 2,
        "cost_model": "fit-train",
        "cost_model_fitted_on": "train split",
        "episodes": 1,
        "test_generations": 3,
        "best_fixed_k_train": 1,
        "delta_lambda_ms": 3.0,
    },
    "policies": [ROW, {**ROW, "policy": "oracle bound (SSP)", "speedup_mean": 1.5, "oracle_pct": 100.0}],
    "categories": [{"policy": "fixed k=1", "qa": 1.3}, {"policy": "oracle bound (SSP)", "qa": 1.5}],
    "notes": [],
    "skipped": [],
}
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 64


def _write_valid(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, obj in (("fit.json", FIT), ("oracle.json", ORACLE), ("bench.json", BENCH)):
        (folder / name).write_text(json.dumps(obj))
    (folder / "speedup.png").write_bytes(PNG)


def _set(obj: dict, path: str, value: object) -> dict:
    """A deep copy of ``obj`` with ``a.b.0.c`` set to ``value`` (``...`` deletes the field)."""
    out = json.loads(json.dumps(obj))
    *head, last = path.split(".")
    cur = out
    for key in head:
        cur = cur[int(key)] if isinstance(cur, list) else cur[key]
    if value is ...:
        del cur[last]
    elif isinstance(cur, list):
        cur[int(last)] = value
    else:
        cur[last] = value
    return out


# (case id, file to corrupt, its new bytes, strings the error line must name)
FILE_CASES: list[tuple[str, str, bytes, list[str]]] = [
    ("fit-truncated", "fit.json", b'{"per_k": [', ["fit.json", "not valid JSON"]),
    ("fit-empty", "fit.json", b"", ["fit.json", "not valid JSON"]),
    ("fit-not-object", "fit.json", b"[1, 2]", ["fit.json", "JSON object"]),
    ("fit-not-utf8", "fit.json", b'{"per_k": "\xff\xfe"}', ["fit.json", "UTF-8"]),
    ("fit-duplicate-key", "fit.json", b'{"per_k": [], "per_k": []}', ["fit.json", "duplicate key"]),
    ("fit-deep-nesting", "fit.json", b"[" * 100000 + b"]" * 100000, ["fit.json"]),
    ("fit-huge-integer", "fit.json", b'{"per_k": ' + b"9" * 5000 + b"}", ["fit.json"]),
    ("fit-per-k-empty", "fit.json", json.dumps(_set(FIT, "per_k", [])).encode(), ["fit.json", "per_k"]),
    (
        "fit-alpha-text",
        "fit.json",
        json.dumps(_set(FIT, "per_k.0.alpha", "big")).encode(),
        ["fit.json", "per_k.0.alpha"],
    ),
    ("fit-alpha-nan", "fit.json", json.dumps(_set(FIT, "per_k.0.alpha", float("nan"))).encode(), ["per_k.0.alpha"]),
    ("fit-k-negative", "fit.json", json.dumps(_set(FIT, "per_k.0.K", -1)).encode(), ["per_k.0.K"]),
    ("fit-k-huge", "fit.json", json.dumps(_set(FIT, "per_k.0.K", 10**6)).encode(), ["per_k.0.K"]),
    ("fit-n-bool", "fit.json", json.dumps(_set(FIT, "per_k.0.N", True)).encode(), ["per_k.0.N"]),
    ("fit-draft-missing", "fit.json", json.dumps(_set(FIT, "draft", ...)).encode(), ["fit.json", "draft"]),
    ("fit-form-name-newline", "fit.json", json.dumps(_set(FIT, "forms.0.model", "a\nb")).encode(), ["forms.0.model"]),
    ("oracle-truncated", "oracle.json", b'{"dataset": "to', ["oracle.json", "not valid JSON"]),
    (
        "oracle-s-max-infinite",
        "oracle.json",
        json.dumps(_set(ORACLE, "s_max_pooled", float("inf"))).encode(),
        ["oracle.json", "s_max_pooled"],
    ),
    ("oracle-dataset-number", "oracle.json", json.dumps(_set(ORACLE, "dataset", 7)).encode(), ["dataset"]),
    ("oracle-sweep-not-list", "oracle.json", json.dumps(_set(ORACLE, "sweep", {"a": 1})).encode(), ["sweep"]),
    ("oracle-sep-error-over-1", "oracle.json", json.dumps(_set(ORACLE, "delta.sep_error", 3.0)).encode(), ["delta"]),
    (
        "oracle-interval-short",
        "oracle.json",
        json.dumps(_set(ORACLE, "delta.lambda_interval_ms", [1.0])).encode(),
        ["delta.lambda_interval_ms"],
    ),
    (
        "oracle-quadrant-negative",
        "oracle.json",
        json.dumps(_set(ORACLE, "delta.quadrants.I", -4)).encode(),
        ["delta.quadrants.I"],
    ),
    (
        "bench-policies-text",
        "bench.json",
        json.dumps(_set(BENCH, "policies", "x")).encode(),
        ["bench.json", "policies"],
    ),
    ("bench-policies-empty", "bench.json", json.dumps(_set(BENCH, "policies", [])).encode(), ["policies"]),
    ("bench-context-missing", "bench.json", json.dumps(_set(BENCH, "context", ...)).encode(), ["context"]),
    (
        "bench-speedup-nan",
        "bench.json",
        json.dumps(_set(BENCH, "policies.0.speedup_mean", float("nan"))).encode(),
        ["policies.0.speedup_mean"],
    ),
    (
        "bench-policy-name-escape",
        "bench.json",
        json.dumps(_set(BENCH, "policies.0.policy", "a\x1b[31mred")).encode(),
        ["policies.0.policy"],
    ),
    (
        "bench-category-list",
        "bench.json",
        json.dumps(_set(BENCH, "categories.0.qa", [1, 2])).encode(),
        ["categories.0.qa"],
    ),
    ("bench-notes-not-text", "bench.json", json.dumps(_set(BENCH, "notes", [1])).encode(), ["notes.0"]),
    ("figure-not-png", "speedup.png", b"<html>not an image</html>", ["speedup.png", "not a PNG"]),
    ("figure-empty", "speedup.png", b"", ["speedup.png", "not a PNG"]),
]


@pytest.mark.parametrize(("case", "name", "data", "names"), FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_garbled_input_is_one_line_naming_the_file_and_writes_nothing(tmp_path, case, name, data, names):
    folder = tmp_path / "out"
    _write_valid(folder)
    (folder / name).write_bytes(data)
    reject_cleanly(["report", folder], [str(folder / name), *names], [tmp_path])


def test_input_that_is_a_folder(tmp_path):
    folder = tmp_path / "out"
    _write_valid(folder)
    (folder / "oracle.json").unlink()
    (folder / "oracle.json").mkdir()
    reject_cleanly(["report", folder], [str(folder / "oracle.json"), "folder"], [tmp_path])


def test_figure_that_is_a_folder(tmp_path):
    folder = tmp_path / "out"
    _write_valid(folder)
    (folder / "oracle_delta.png").mkdir()
    reject_cleanly(["report", folder], [str(folder / "oracle_delta.png"), "folder"], [tmp_path])


def test_dangling_link_as_input(tmp_path):
    folder = tmp_path / "out"
    _write_valid(folder)
    (folder / "bench.json").unlink()
    (folder / "bench.json").symlink_to(tmp_path / "nowhere.json")
    reject_cleanly(["report", folder], [str(folder / "bench.json"), "no such file"], [tmp_path])


DIR_CASES: list[tuple[str, list[str], list[str]]] = [
    ("dir-missing-argument", ["report"], ["DIR"]),
    ("dir-does-not-exist", ["report", "{W}/nope"], ["DIR", "{W}/nope"]),
    ("dir-is-a-file", ["report", "{W}/notes.txt"], ["DIR", "{W}/notes.txt"]),
    ("dir-empty", ["report", "{W}/empty"], ["{W}/empty", "fit.json", "oracle.json", "bench.json"]),
    ("dir-only-figures", ["report", "{W}/figs"], ["{W}/figs", "fit.json"]),
    ("dir-report-is-a-folder", ["report", "{W}/taken"], ["DIR", "{W}/taken/report.html", "folder"]),
    ("extra-argument", ["report", "{W}/empty", "surplus"], ["surplus"]),
    ("unknown-option", ["report", "{W}/empty", "--bogus"], ["--bogus"]),
]


@pytest.mark.parametrize(("case", "args", "names"), DIR_CASES, ids=[c[0] for c in DIR_CASES])
def test_bad_dir_is_one_line_and_writes_nothing(tmp_path, case, args, names):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("a user's file\n")
    (work / "empty").mkdir()
    (work / "figs").mkdir()
    (work / "figs" / "speedup.png").write_bytes(PNG)
    _write_valid(work / "taken")
    (work / "taken" / "report.html").mkdir()

    def fill(items: list[str]) -> list[str]:
        return [i.replace("{W}", str(work)) for i in items]

    reject_cleanly(fill(args), fill(names), [tmp_path])


def test_valid_handmade_inputs_make_a_page(tmp_path):
    """The cases above corrupt a valid folder: this one is accepted (and only report.html is added)."""
    folder = tmp_path / "out"
    _write_valid(folder)
    res = run_cli(["report", folder])
    assert res.exit_code == 0, res.stderr
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["fit.json", "oracle.json", "bench.json", "speedup.png", "report.html"]
    )
    page = (folder / "report.html").read_text()
    assert "No line separates every point" in page  # the hand-made interval is empty (2.5 > 2.0)
    assert page.count('class="missing"') == 3  # oracle_sweep.png, oracle_delta.png, speedup_by_category.png
