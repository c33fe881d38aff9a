"""Fitting the batch cost model on recorded vLLM batch steps (the batch counterpart of :mod:`specenv.cost.fit`).

A **steps recording** is a folder with ``steps.parquet`` (one row per pure engine step:
:data:`STEP_COLUMNS`; written by ``scripts/collect_vllm_batch.py`` through
:func:`specenv.engines.vllm.batchrec.record_batch_steps`) and ``manifest.json`` (format
:data:`STEPS_FORMAT`: model facts, kmax, max_batch, collection settings, the machine's load, and the
sha256 of the table, checked on load). :func:`load_steps` validates it; every problem is one line
naming the file, the column and the row.

:func:`fit_batch_cost` fits, as :mod:`specenv.cost.fit` fits B = 1:

* **verification** ``T_T = b0 + b_pos * P + alpha * U_batch + c * sum L + b_req * (B - 1)`` (the ``"linear"``
  form, the default; ``verify_form="parity"`` adds ``b_odd_query * odd``, ``odd`` the requests verifying an
  even budget k >= 2, whose query of k + 1 tokens is odd: :func:`specenv.cost.batch.odd_queries`) by OLS with
  standard errors clustered by group (the requests served together: every step of a group shares
  them), with the recorded (exact) union; GroupKFold(5) by group gives the out-of-sample errors.
  Slopes are kept >= 0: a negative estimate is dropped (fixed at 0) and the rest refitted, in sample
  and in every fold alike (a time cannot fall with more work, and a negative slope would charge
  negative times at large inputs; the report flags dropped terms).
  The other main form and two reduced forms (no expert term; no request term) are compared beside it
  (:data:`VERIFY_FORMS`, plain OLS in sample and GroupKFold out of sample). On ``live-vllm-wide-batch-v6``
  (vLLM 0.32 on this CPU) a request with an odd query costs 1.2 ms more than the position term charges
  (clustered p < 1e-4; its ``b_req`` then falls below 0 and is dropped), and the out-of-sample MAPE of the
  forwards falls from 6.1% to 3.5% (batch 8: 6.7% -> 2.7%, 16: 9.3% -> 3.5%); the even/odd pattern is in
  the A/B's fixed-k arms too (even k served slower than the linear form predicts at batch 4 and 8), and
  the mechanism in vLLM's CPU kernels is not located. Not the shipped model's form: with the pooled
  union (the engine step 7.0% -> 5.2% out of sample) it priced a live A/B's fixed-k arms better only on
  a recording made minutes before it (1.0% / 2.6% against 3.8% / 3.0% at batch 4 / 8), not on v6 three
  hours old, and the goodput controller it fed stopped speculating and served below plain (README,
  "v6 refitted");
* **drafting** ``T_D = d0 + d_step * n + d_tok * n * B`` (every request of a vLLM step drafts the same
  n: ``max = n``, ``sum = n * B``), clustered the same way;
* **the U_batch predictors** (:data:`specenv.cost.batch.PREDICTORS`, plus ``"exact"``, the recorded
  union, the reference): out-of-sample error of U_batch itself on steps with B >= 2, and of the step
  time when the verification model fitted on the training folds with the exact union is evaluated
  on the held-out steps with the predicted union. The ``"shared"`` exponent theta (and the ``"pooled"``
  pool with its own theta, :func:`fit_pool`) is fitted on the training folds only (bounded least
  squares on U_batch). The predictor with the smallest out-of-sample MAPE of the step time among the
  candidates (``predictors``: ``"independent"`` and ``"shared"`` unless ``"pooled"`` is asked for, so
  the refits of the shipped recordings are unchanged) is the model's predictor (ties: of
  U_batch).

The step time the model prices is the target's forward time plus the draft's (the tap's forward
hooks), as the B = 1 model prices ``T_T + T_D``; the scheduler's own time (the rest of the step's wall
time) is reported as ``overhead_share`` and not charged, as at B = 1.

statsmodels and scikit-learn are imported inside the functions that fit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from specenv.cost.batch import PREDICTORS, BatchCostModel, odd_queries, plain_union, union_pooled, union_shared

__all__ = [
    "BATCHCOST_FILE",
    "STEPS_FILE",
    "STEPS_FORMAT",
    "PLAIN_COLUMNS",
    "PLAIN_FILE",
    "PREFILL_COLUMNS",
    "STEP_COLUMNS",
    "MAIN_FORMS",
    "VERIFY_FORMS",
    "BatchFitReport",
    "fit_batch_cost",
    "fit_pool",
    "fit_theta",
    "format_report",
    "load_plain",
    "load_steps",
    "summarize_plain_batch",
    "write_steps",
]

STEPS_FORMAT = "specenv.batchsteps/1"
STEPS_FILE = "steps.parquet"
#: The plain engine's decode steps (optional: recordings since ``live-vllm-wide-batch-v4``), the rows the
#: manifest's ``extra.ar_reference`` summarises (:func:`summarize_plain_batch`), kept so it can be refitted.
PLAIN_FILE = "plain.parquet"
#: Columns of the plain table (:func:`specenv.engines.vllm.batchrec.record_plain_steps`).
PLAIN_COLUMNS = ("run", "batch", "group", "B", "context_sum", "engine_step_ms")
BATCHCOST_FILE = "batchcost.json"
#: Scalar columns of the steps table and their kinds ("i" integer, "f" float, "s" string).
SCALARS = {
    "run": "s",
    "batch": "i",
    "group": "i",
    "step": "i",
    "B": "i",
    "positions": "i",
    "context_sum": "i",
    "U_batch": "f",
    "T_T_ms": "f",
    "T_D_ms": "f",
    "T_T_cpu_ms": "f",
    "T_D_cpu_ms": "f",
    "draft_calls": "i",
    "step_ms": "f",
    "drafted": "i",
    "committed": "i",
}
#: List columns (one entry per request of the step; ``U_batch_layer``: one per MoE layer).
LISTS = {"k": "i", "U": "f", "L": "i", "accepted": "i", "U_batch_layer": "f"}
STEP_COLUMNS = (*SCALARS, *LISTS)

#: Columns of the prefill table (``manifest.extra.prefill``): one row per group and engine (``"spec"``:
#: the engine with the drafter, ``"plain"``: the target alone). ``prefill_ms`` is the wall time of the
#: group's prefill phase: the ``engine.step()`` calls from the group's submission until every request
#: of it has its first token (the time to first token of its last request); ``prefill_steps`` counts
#: them (more than one when the prompts did not fit one step's token budget).
PREFILL_COLUMNS = ("engine", "run", "batch", "group", "B", "prompt_tokens", "prefill_ms", "prefill_steps")
#: Optional columns: ``engine_step_ms``, the wall time of the whole ``engine.step()`` that ran the step
#: (recordings made since the step-time model; it feeds the per-step overhead of ``timing="step"``).
OPTIONAL = {"engine_step_ms": "f"}
#: The verification forms a model can be fitted with (``fit_batch_cost(verify_form=...)``) -> their terms.
MAIN_FORMS: dict[str, tuple[str, ...]] = {
    "linear": ("P", "U_batch", "sumL", "B-1"),
    "parity": ("P", "U_batch", "sumL", "B-1", "odd"),
}
#: The verification forms compared in every fit's report (name -> terms); the first two are :data:`MAIN_FORMS`.
VERIFY_FORMS: dict[str, tuple[str, ...]] = {
    "P + U_batch + sumL + (B-1)": MAIN_FORMS["linear"],
    "P + U_batch + sumL + (B-1) + odd": MAIN_FORMS["parity"],
    "P + sumL + (B-1)": ("P", "sumL", "B-1"),
    "P + U_batch + sumL": ("P", "U_batch", "sumL"),
}


# ---------------------------------------------------------------------- the recording
def _err(file: str, problem: str, column: str | None = None, row: int | None = None) -> ValueError:
    from specenv.validation import one_line

    where = [file] + ([f"column '{column}'"] if column else []) + ([f"row {row}"] if row is not None else [])
    return ValueError(one_line(f"{', '.join(where)}: {problem}"))


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_steps(steps: pd.DataFrame, manifest: dict[str, Any], file: str = STEPS_FILE) -> None:
    """Validate a steps table against its manifest; one line (file, column, row) for the first problem.

    Checks: every column present with its kind and no nulls; B in 1..max_batch; every list column one
    entry per request (``U_batch_layer`` one per layer); k in 0..kmax; ``positions = sum(k + 1)``;
    ``context_sum = sum(L)``; U_i in [top_k, n_experts]; ``max(U_i) <= U_batch <= min(n, sum U_i)``;
    ``U_batch`` the mean of ``U_batch_layer``; times finite and positive (``T_D_ms`` >= 0).

    Raises:
        ValueError: The first problem.
    """
    model = manifest["model"]
    n, top_k, n_layers = model["n_experts"], model["top_k"], model["n_layers"]
    kmax, max_batch = manifest["kmax"], manifest["max_batch"]
    if len(steps) == 0:
        raise _err(file, "no steps")
    for col in STEP_COLUMNS:
        if col not in steps.columns:
            raise _err(file, "missing required column", col)
        if steps[col].isna().any():
            raise _err(file, "null value", col, _first_bad(steps[col].isna().to_numpy()))
    for col, kind in (SCALARS | {c: k for c, k in OPTIONAL.items() if c in steps.columns}).items():
        if col in OPTIONAL and steps[col].isna().any():
            raise _err(file, "null value", col, _first_bad(steps[col].isna().to_numpy()))
        v = steps[col].to_numpy()
        if kind == "s":
            if not all(isinstance(x, str) for x in v):
                raise _err(file, "must be text", col, _first_bad(np.array([not isinstance(x, str) for x in v])))
            continue
        if v.dtype.kind not in ("iu" if kind == "i" else "iuf"):
            raise _err(file, f"has type {v.dtype}, expected {'integer' if kind == 'i' else 'float'}", col)
        if not np.all(np.isfinite(v.astype(np.float64))):
            raise _err(file, "must be finite", col, _first_bad(~np.isfinite(v.astype(np.float64))))
    B = steps["B"].to_numpy()
    if (bad := (B < 1) | (B > max_batch)).any():
        raise _err(file, f"must be in 1..max_batch={max_batch}", "B", _first_bad(bad))
    lists: dict[str, list[np.ndarray]] = {}
    for col, kind in LISTS.items():
        arrs = []
        want = n_layers if col == "U_batch_layer" else None
        for r, x in enumerate(steps[col]):
            try:
                a = np.asarray(x, dtype=np.float64)
            except (TypeError, ValueError):
                raise _err(file, "must be a list of numbers", col, r) from None
            if a.ndim != 1 or len(a) != (want if want is not None else B[r]):
                raise _err(file, f"must hold {'n_layers' if want else 'B'} = {want or B[r]} entries", col, r)
            if not np.all(np.isfinite(a)) or (kind == "i" and not np.all(a == np.round(a))):
                raise _err(file, f"entries must be finite {'integers' if kind == 'i' else 'numbers'}", col, r)
            arrs.append(a)
        lists[col] = arrs
    for r in range(len(steps)):
        k, U, L, ub = lists["k"][r], lists["U"][r], lists["L"][r], lists["U_batch_layer"][r]
        if k.min() < 0 or k.max() > kmax:
            raise _err(file, f"budgets must be in 0..kmax={kmax}", "k", r)
        if int(steps["positions"].iat[r]) != int(np.sum(k + 1)):
            raise _err(file, "must equal the sum of (k + 1)", "positions", r)
        if int(steps["context_sum"].iat[r]) != int(L.sum()) or L.min() < 1:
            raise _err(file, "must equal the sum of L (each >= 1)", "context_sum", r)
        if U.min() < top_k - 1e-9 or U.max() > n + 1e-9:
            raise _err(file, f"per-request unions must be in [top_k={top_k}, n_experts={n}]", "U", r)
        u_b = float(steps["U_batch"].iat[r])
        if not U.max() - 1e-6 <= u_b <= min(n, U.sum()) + 1e-6:
            raise _err(file, f"{u_b} outside [max U_i, min(n, sum U_i)] = [{U.max()}, {min(n, U.sum())}]", "U_batch", r)
        if abs(ub.mean() - u_b) > 1e-6 * max(1.0, u_b):
            raise _err(file, "must be the mean of U_batch_layer", "U_batch", r)
    from specenv.validation import TIME_MS_MAX

    positive = ("T_T_ms", "step_ms", *(c for c in OPTIONAL if c in steps.columns))
    for col in positive:
        if (bad := steps[col].to_numpy() <= 0).any():
            raise _err(file, "must be > 0", col, _first_bad(bad))
    for col in ("T_D_ms", "T_T_cpu_ms", "T_D_cpu_ms", "draft_calls"):
        if (bad := steps[col].to_numpy() < 0).any():
            raise _err(file, "must be >= 0", col, _first_bad(bad))
    for col in (*positive, "T_D_ms", "T_T_cpu_ms", "T_D_cpu_ms"):
        if (bad := steps[col].to_numpy(np.float64) > TIME_MS_MAX).any():
            raise _err(file, f"must be at most {TIME_MS_MAX:g} ms (not a plausible step time)", col, _first_bad(bad))


def write_steps(
    folder: str | os.PathLike[str],
    steps: pd.DataFrame,
    manifest: dict[str, Any],
    replace: bool = False,
    fit: bool = True,
    plain: pd.DataFrame | None = None,
) -> Path:
    """Validate and write a steps recording atomically (``steps.parquet``, ``manifest.json``, ``batchcost.json``).

    Args:
        folder: Destination (must not exist unless ``replace``; a replaced folder must be a steps recording).
        steps: The steps table (:data:`STEP_COLUMNS`).
        manifest: ``name``, ``version``, ``description``, ``model`` (n_layers, n_experts, top_k), ``kmax``,
            ``max_batch``, ``extra``; ``format`` and ``files`` are filled in here.
        replace: Replace an existing recording.
        fit: Also fit and write the batch cost model (:func:`fit_batch_cost`).
        plain: The plain engine's decode steps (:data:`PLAIN_COLUMNS`), written as :data:`PLAIN_FILE`.

    Raises:
        ValueError: A bad table, or a folder that exists (without ``replace``) or is not a steps recording.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specenv.io import atomic_dir, atomic_write_json, sha256_file

    folder = Path(folder)
    if os.path.lexists(folder):
        if not replace:
            raise ValueError(f"{folder}: already exists (replace it explicitly)")
        if not (folder / "manifest.json").is_file() or recording_format(folder / "manifest.json") != STEPS_FORMAT:
            raise ValueError(f"{folder}: is not a steps recording (no {STEPS_FORMAT} manifest): refusing to replace it")
    manifest = {"format": STEPS_FORMAT, **{k: v for k, v in manifest.items() if k not in ("format", "files")}}
    check_steps(steps, manifest, f"{STEPS_FILE} (in memory)")
    if plain is not None:
        plain = check_plain(plain, f"{PLAIN_FILE} (in memory)")
    report = (
        fit_batch_cost(steps, manifest, source={"recording": str(manifest.get("name", folder.name))}) if fit else None
    )
    cols = [*STEP_COLUMNS, *(c for c in OPTIONAL if c in steps.columns)]
    table = pa.Table.from_pandas(steps[cols], preserve_index=False)
    with atomic_dir(folder, replace=replace) as tmp:
        pq.write_table(table, tmp / STEPS_FILE, compression="zstd", compression_level=9)
        manifest["files"] = {"steps": {"path": STEPS_FILE, "sha256": sha256_file(tmp / STEPS_FILE), "rows": len(steps)}}
        if plain is not None:
            pq.write_table(pa.Table.from_pandas(plain, preserve_index=False), tmp / PLAIN_FILE, compression="zstd")
            manifest["files"]["plain"] = {
                "path": PLAIN_FILE,
                "sha256": sha256_file(tmp / PLAIN_FILE),
                "rows": len(plain),
            }
        atomic_write_json(tmp / "manifest.json", manifest)
        if report is not None:
            report.model.save(tmp / BATCHCOST_FILE)
    return folder


def check_plain(plain: pd.DataFrame, file: str = PLAIN_FILE) -> pd.DataFrame:
    """Validate a plain-steps table (:data:`PLAIN_COLUMNS`); returns it with those columns, typed.

    Raises:
        ValueError: One line naming the file, the column and the first bad row.
    """
    missing = [c for c in PLAIN_COLUMNS if c not in plain.columns]
    if missing:
        raise _err(file, f"missing column(s) {missing}")
    out = plain[list(PLAIN_COLUMNS)].reset_index(drop=True).copy()
    for col in ("batch", "group", "B", "context_sum"):
        v = pd.to_numeric(out[col], errors="coerce").to_numpy(np.float64)
        bad = ~np.isfinite(v) | (v != np.round(v)) | (v < (1 if col in ("batch", "B") else 0))
        if bad.any():
            raise _err(file, "must be a whole number (>= 1 for batch, B; >= 0 otherwise)", col, _first_bad(bad))
        out[col] = v.astype(np.int64)
    t = pd.to_numeric(out["engine_step_ms"], errors="coerce").to_numpy(np.float64)
    if (bad := ~np.isfinite(t) | (t <= 0)).any():
        raise _err(file, "must be a finite time > 0", "engine_step_ms", _first_bad(bad))
    out["engine_step_ms"] = t
    out["run"] = out["run"].astype(str)
    return out


def load_plain(path: str | os.PathLike[str]) -> pd.DataFrame | None:
    """The plain engine's decode steps of a recording (:data:`PLAIN_FILE`), checked; None when it has none.

    Args:
        path: A recording folder or a shipped name, as :func:`load_steps`.

    Raises:
        ValueError: As :func:`load_steps` (one line: file, column, row), or a sha256 mismatch.
    """
    import pyarrow.parquet as pq

    from specenv.io import sha256_file

    _, manifest = load_steps(path)
    entry = manifest["files"].get("plain")
    if entry is None:
        return None
    folder = Path(path) if Path(path).exists() else _shipped(str(path))
    file = folder / entry["path"]
    try:
        digest = sha256_file(file)
    except OSError as exc:
        raise _err(str(file), f"cannot read ({exc.strerror or type(exc).__name__})") from None
    if digest != entry["sha256"]:
        raise _err(str(file), f"sha256 {digest} differs from the manifest's {entry['sha256']}")
    try:
        table = pq.read_table(file).to_pandas()
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise _err(str(file), f"not a readable Parquet file ({str(exc).splitlines()[0][:200]})") from None
    return check_plain(table, str(file))


def _shipped(name: str) -> Path:
    from specenv.io import package_data

    return package_data(name)


def recording_format(path: Path) -> Any:
    """The ``format`` field of a JSON file (None when it is unreadable or has none)."""
    from specenv.io import read_limited
    from specenv.validation import JSON_MAX_BYTES

    try:
        obj = json.loads(read_limited(path, JSON_MAX_BYTES))
    except (OSError, ValueError):
        return None
    return obj.get("format") if isinstance(obj, dict) else None


def load_steps(path: str | os.PathLike[str]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Read and validate a steps recording: a folder, or a shipped name (``live-vllm-batch-v1``).

    Returns:
        ``(steps, manifest)``.

    Raises:
        ValueError: One line naming the file (and column, row) for a missing folder, a bad manifest,
            a sha256 mismatch or a bad table.
    """
    import pyarrow.parquet as pq

    from specenv.io import package_data, sha256_file
    from specenv.validation import check, read_json

    folder = Path(path)
    if not folder.exists() and os.sep not in str(path) and "/" not in str(path):
        folder = package_data(str(path))
        if not folder.is_dir():  # name the argument as given, not a path inside the package
            raise _err(str(path), "no such folder, nor a shipped recording (live-vllm-batch-v1)")
    mf = folder / "manifest.json"
    obj = read_json(mf, what="steps recording manifest")
    m = check("BatchStepsJSON", obj, str(mf), formats=(STEPS_FORMAT,), what="specenv steps recording")
    entry = m.files["steps"]
    file = folder / entry.path
    try:
        digest = sha256_file(file)
    except OSError as exc:
        raise _err(str(file), f"cannot read ({exc.strerror or type(exc).__name__})") from None
    if digest != entry.sha256:
        raise _err(str(file), f"sha256 {digest} differs from the manifest's {entry.sha256}")
    try:
        steps = pq.read_table(file).to_pandas()
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise _err(str(file), f"not a readable Parquet file ({str(exc).splitlines()[0][:200]})") from None
    check_steps(steps, obj, str(file))
    return steps, obj


def summarize_plain_batch(
    plain: pd.DataFrame, n_experts: int | None = None, top_k: int | None = None
) -> dict[str, Any]:
    """The batch AR reference: a plain engine's (no drafter loaded) decode steps and their fitted form.

    ``step_ms = a + b_req * (B - 1) + c * sum L + u * (U_ind(B) - top_k)`` by least squares with
    ``b_req, c, u >= 0`` (a step never gets cheaper with more requests, context or experts: a negative
    estimate is noise and is fixed at 0, as :func:`_nonneg_ols` does), fitted on the rows of
    :func:`specenv.engines.vllm.batchrec.record_plain_steps` (``B``, ``context_sum``,
    ``engine_step_ms``). ``U_ind(B)`` is :func:`specenv.cost.batch.plain_union`, the experts per layer B
    single tokens touch when routed independently: a plain step's verification of B positions touches
    the batch's union of experts, concave in B, which a line in B misses (``live-vllm-wide-batch-v3``'s
    line, 21.4 + 2.82 (B-1) ms, is 38% above the measured 15.5 ms at B = 1 and below it at B = 8).
    Without ``n_experts`` and ``top_k`` (every recording before v4) the term is left out (``u = 0``).
    It is the 1.0 of every batch speedup of the step-time model
    (:meth:`specenv.cost.batch.BatchCostModel.ar_ms`), as ``manifest.extra.ar_reference`` is for a
    trace set's B = 1 step-time model (:mod:`specenv.cost.steptime`).

    Returns:
        ``engine``, ``steps``, ``form``, ``a_ms``, ``b_req_ms``, ``c_ms_per_token``, ``u_ms_per_expert``
        (with the union term), ``r2``, and ``per_batch``: per B the steps, mean and median step time,
        mean context sum, and the fitted form at that mean (``model_ms``).

    Raises:
        ValueError: Fewer than 3 steps, or a step time that is not positive and finite.
    """
    y = plain["engine_step_ms"].to_numpy(np.float64)
    if len(y) < 3:
        raise ValueError(f"the plain engine timed {len(y)} steps: too few for the batch AR reference")
    if not np.all(np.isfinite(y)) or (y <= 0).any():
        raise ValueError("plain steps, column engine_step_ms: every step time must be finite and > 0")
    B = plain["B"].to_numpy(np.float64)
    L = plain["context_sum"].to_numpy(np.float64)
    union = n_experts is not None and top_k is not None
    cols = [np.ones_like(y), B - 1.0, L]
    if union:
        cols.append(plain_union(B, float(n_experts), int(top_k)) - float(top_k))
    X = np.column_stack(cols)
    beta = _lstsq_nonneg(X, y)
    resid = y - X @ beta
    tss = float(((y - y.mean()) ** 2).sum())
    per = []
    for b in np.unique(B):
        sel = B == b
        per.append(
            {
                "B": int(b),
                "steps": int(sel.sum()),
                "mean_ms": float(y[sel].mean()),
                "median_ms": float(np.median(y[sel])),
                "context_sum_mean": float(L[sel].mean()),
                "model_ms": float(X[sel].mean(axis=0) @ beta),
            }
        )
    return {
        "engine": "vLLM, the target alone (no speculative config), greedy, B concurrent requests",
        "steps": int(len(y)),
        "form": "a + b_req (B-1) + c sumL" + (" + u (U_ind(B) - top_k)" if union else ""),
        "a_ms": float(beta[0]),
        "b_req_ms": float(beta[1]),
        "c_ms_per_token": float(beta[2]),
        **({"u_ms_per_expert": float(beta[3])} if union else {}),
        "r2": float(1.0 - float(resid @ resid) / tss) if tss > 0 else 0.0,
        "per_batch": per,
    }


def plain_residual_by_batch(ref: dict[str, Any], max_batch: int) -> np.ndarray | None:
    """Per B = 1..max_batch the plain steps' mean residual from their fitted form (``BatchCostModel.ar_by_batch``).

    From ``ref["per_batch"]`` (:func:`fit_ar_reference`: per recorded B the mean step and the form at
    that B's mean context), ``mean_ms - model_ms``; batch sizes without plain steps take the linear
    interpolation between the recorded ones (the nearest at the ends), as
    :func:`step_overhead_by_batch` does for the overhead. None when ``ref`` has no per-batch rows with
    the form at them (manifests before ``live-vllm-wide-batch-v4``).

    Raises:
        ValueError: A per-batch row without ``B`` or ``mean_ms``, or not finite.
    """
    rows = ref.get("per_batch")
    if not rows or not all(isinstance(r, dict) and "model_ms" in r for r in rows):
        return None  # no per-batch rows, or rows without the form at them (manifests before v4)
    try:
        seen = np.array([int(r["B"]) for r in rows])
        resid = np.array([float(r["mean_ms"]) - float(r["model_ms"]) for r in rows])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"manifest.json, extra.ar_reference.per_batch: a row without B or mean_ms ({exc})") from None
    if not np.all(np.isfinite(resid)) or (seen < 1).any():
        raise ValueError("manifest.json, extra.ar_reference.per_batch: B >= 1 and finite mean_ms, model_ms needed")
    order = np.argsort(seen)
    return np.interp(np.arange(1, max_batch + 1), seen[order], resid[order])


def fit_prefill(prefill: Any, file: str = "manifest.json") -> tuple[dict[str, tuple[float, float]], dict[str, Any]]:
    """The prefill phase of a group, per engine: ``prefill_ms = a + b * prompt_tokens``.

    Fitted on ``manifest.extra.prefill`` (``{"columns": [...], "rows": [...]}``, one row per group
    and engine: :data:`specenv.engines.vllm.batchrec.PREFILL_COLUMNS`, written by
    ``scripts/collect_vllm_batch.py``) by least squares with ``a, b >= 0`` (a negative estimate is
    fixed at 0, as :func:`_nonneg_ols` does), separately for the engine with the drafter (``"spec"``)
    and the plain engine (``"plain"``). Out of sample: each repetition (``run``) predicted from the
    others.

    Returns:
        ``({"spec": (a, b), "plain": (a, b)}, diagnostics)``; per engine the diagnostics hold ``a_ms``,
        ``b_ms_per_token``, ``r2``, ``groups``, ``oos_mape_pct`` and, per B, the mean prefill time.

    Raises:
        ValueError: One line naming ``extra.prefill`` and the problem (a missing column or engine,
        fewer than 3 groups of an engine, a time that is not positive and finite).
    """
    where = f"{file}, extra.prefill"
    if not isinstance(prefill, dict) or not isinstance(prefill.get("rows"), list):
        raise ValueError(f"{where}: expected {{'columns': [...], 'rows': [...]}}")
    try:
        table = pd.DataFrame(prefill["rows"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: rows: {exc}") from None
    missing = [c for c in PREFILL_COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"{where}: rows lack column {missing[0]!r}")
    coef: dict[str, tuple[float, float]] = {}
    diag: dict[str, Any] = {}
    for engine in ("spec", "plain"):
        t = table[table["engine"] == engine]
        if len(t) < 3:
            raise ValueError(f"{where}: engine {engine!r} has {len(t)} groups (need at least 3)")
        y = pd.to_numeric(t["prefill_ms"], errors="coerce").to_numpy(np.float64)
        x = pd.to_numeric(t["prompt_tokens"], errors="coerce").to_numpy(np.float64)
        bad = ~np.isfinite(y) | (y <= 0) | ~np.isfinite(x) | (x <= 0)
        if bad.any():
            row = int(t.index[int(np.argmax(bad))])
            raise ValueError(f"{where}: row {row}: prefill_ms and prompt_tokens must be finite and > 0")
        X = np.column_stack([np.ones_like(x), x])
        beta = _lstsq_nonneg(X, y, free=())
        runs = t["run"].astype(str).to_numpy()
        pred = np.full_like(y, np.nan)
        for r in np.unique(runs):
            if (runs != r).sum() >= 2:
                pred[runs == r] = X[runs == r] @ _lstsq_nonneg(X[runs != r], y[runs != r], free=())
        tss = float(((y - y.mean()) ** 2).sum())
        resid = y - X @ beta
        ok = np.isfinite(pred)
        coef[engine] = (float(beta[0]), float(beta[1]))
        Bs = t["B"].to_numpy()
        diag[engine] = {
            "a_ms": float(beta[0]),
            "b_ms_per_token": float(beta[1]),
            "r2": float(1.0 - float(resid @ resid) / tss) if tss > 0 else 0.0,
            "groups": int(len(t)),
            "oos_mape_pct": float(100 * np.mean(np.abs(pred[ok] - y[ok]) / y[ok])) if ok.any() else None,
            "per_batch": [
                {"B": int(b), "groups": int((Bs == b).sum()), "mean_ms": float(y[Bs == b].mean())}
                for b in np.unique(Bs)
            ],
        }
    return coef, diag


# ---------------------------------------------------------------------- the fit
def _design(steps: pd.DataFrame, terms: tuple[str, ...], u_batch: np.ndarray | None = None) -> np.ndarray:
    ub = steps["U_batch"].to_numpy(np.float64) if u_batch is None else u_batch
    cols = {
        "P": steps["positions"].to_numpy(np.float64),
        "U_batch": ub,
        "sumL": steps["context_sum"].to_numpy(np.float64),
        "B-1": steps["B"].to_numpy(np.float64) - 1.0,
    }
    if "odd" in terms:
        cols["odd"] = np.fromiter((odd_queries(np.asarray(k)) for k in steps["k"]), np.float64, len(steps))
    return np.column_stack([np.ones(len(steps)), *(cols[t] for t in terms)])


def _nonneg_ols(
    y: np.ndarray, X: np.ndarray, groups: np.ndarray, free: tuple[int, ...] = (0,)
) -> tuple[Any, np.ndarray]:
    """Clustered OLS whose slopes are >= 0: a negative slope is dropped (fixed at 0) and the rest refitted.

    A time cannot fall with more positions, experts, context, requests or drafted tokens; an estimate
    below 0 is noise (within its SE on these recordings) and would make the model charge negative
    times at large inputs. The most negative slope is dropped first, repeatedly; columns in ``free``
    (the intercept) may be negative.

    Returns:
        ``(result, keep)``: the statsmodels result on the kept columns and the kept column indices.
    """
    from specenv.cost.fit import statsmodels_ols

    sm = statsmodels_ols()

    keep = np.arange(X.shape[1])
    while True:
        res = sm.OLS(y, X[:, keep]).fit(cov_type="cluster", cov_kwds={"groups": groups})
        slopes = [(v, i) for v, i in zip(res.params, keep, strict=True) if i not in free and v < 0]
        if not slopes:
            return res, keep
        keep = keep[keep != min(slopes)[1]]


def _full(res: Any, keep: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Params, SEs and p-values of a reduced fit spread to all ``width`` columns (dropped: 0, NaN, NaN)."""
    out = [np.zeros(width), np.full(width, np.nan), np.full(width, np.nan)]
    for arr, src in zip(out, (res.params, res.bse, res.pvalues), strict=True):
        arr[keep] = src
    return out[0], out[1], out[2]


def _lstsq_nonneg(X: np.ndarray, y: np.ndarray, free: tuple[int, ...] = (0,)) -> np.ndarray:
    """Least squares with the same drop rule as :func:`_nonneg_ols` (for the cross-validation folds)."""
    keep = np.arange(X.shape[1])
    while True:
        beta, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        neg = [(v, i) for v, i in zip(beta, keep, strict=True) if i not in free and v < 0]
        if not neg:
            full = np.zeros(X.shape[1])
            full[keep] = beta
            return full
        keep = keep[keep != min(neg)[1]]


def _draft_design(steps: pd.DataFrame) -> np.ndarray:
    n = steps["drafted"].to_numpy(np.float64)
    return np.column_stack([np.ones(len(steps)), n, n * steps["B"].to_numpy(np.float64)])


def _errors(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    resid = y - pred
    pos = y > 0  # a zero time (nothing timed) has no percentage error
    return {
        "mape_pct": float(100.0 * np.mean(np.abs(resid[pos]) / y[pos])) if pos.any() else float("nan"),
        "rmse": float(np.sqrt(np.mean(resid**2))),
        "r2": float(1.0 - np.sum(resid**2) / np.sum((y - y.mean()) ** 2)) if len(y) > 1 else float("nan"),
    }


def _u_matrix(steps: pd.DataFrame) -> np.ndarray:
    """(steps, max B) per-request unions, 0 for absent requests."""
    width = int(steps["B"].max())
    out = np.zeros((len(steps), width))
    for r, u in enumerate(steps["U"]):
        out[r, : len(u)] = u
    return out


def fit_theta(u: np.ndarray, u_batch: np.ndarray, n: float) -> float:
    """The ``"shared"`` exponent theta in (0, 1] minimising the squared error of U_batch (bounded scalar search).

    Args:
        u: (steps, B) per-request unions (0 for absent requests).
        u_batch: (steps,) recorded unions.
        n: Experts per layer.
    """
    from scipy.optimize import minimize_scalar

    res = minimize_scalar(
        lambda th: float(np.sum((union_shared(u, n, th) - u_batch) ** 2)), bounds=(1e-3, 1.0), method="bounded"
    )
    return float(res.x)


def fit_pool(
    u: np.ndarray, u_batch: np.ndarray, n: float, top_k: int, theta: float | None = None
) -> tuple[float, float]:
    """The ``"pooled"`` predictor's ``(pool, theta)`` minimising the squared error of U_batch (bounded least squares).

    The pool lies in ``[max(top_k, largest recorded count), n]``, theta in ``[1e-3, 1]``; the search
    starts from the ``"shared"`` fit over all n experts (``theta``: that fit's exponent when already
    known, else :func:`fit_theta`).

    Args:
        u: (steps, B) per-request unions (0 for absent requests).
        u_batch: (steps,) recorded unions.
        n: Experts per layer.
        top_k: Experts per token.
        theta: The ``"shared"`` exponent on the same steps, if known.
    """
    from scipy.optimize import least_squares

    theta0 = fit_theta(u, u_batch, n) if theta is None else float(theta)
    lo = min(max(float(top_k), float(np.max(u))), n)
    if lo >= n:  # a request covered every expert: no smaller pool fits
        return n, theta0
    res = least_squares(
        lambda p: union_pooled(u, p[0], p[1]) - u_batch,
        x0=[n, theta0],
        bounds=([lo, 1e-3], [n, 1.0]),
    )
    return float(res.x[0]), float(res.x[1])


def _predict_u(name: str, u: np.ndarray, n: float, theta: float, pool: tuple[float, float] | None = None) -> np.ndarray:
    if name == "pooled":
        assert pool is not None
        return union_pooled(u, pool[0], pool[1])
    return union_shared(u, n, 1.0 if name == "independent" else theta)


@dataclass
class BatchFitReport:
    """What ``specenv fit-batch`` prints.

    Attributes:
        model: The fitted batch cost model.
        coefficients: One row per verification and draft coefficient: value, clustered SE, p-value.
        forms: One row per verification form: in-sample R2, OOS MAPE / RMSE / R2 (exact union).
        predictors: One row per U_batch predictor: OOS MAPE / RMSE of U_batch (B >= 2) and of the
            verification and step times.
        summary: Counts, draft fit, the OOS MAPE of the step, overhead share, load.
    """

    model: BatchCostModel
    coefficients: pd.DataFrame
    forms: pd.DataFrame
    predictors: pd.DataFrame
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form."""
        rec = lambda df: json.loads(df.to_json(orient="records"))  # noqa: E731
        return {
            "coefficients": rec(self.coefficients),
            "forms": rec(self.forms),
            "predictors": rec(self.predictors),
            "summary": self.summary,
            "batch_cost_model": self.model.to_json(),
        }


#: Which recorded times a fit prices: the CPU time of the forwards' thread, or their wall time.
TIMINGS: dict[str, tuple[str, str]] = {
    "cpu": ("T_T_cpu_ms", "T_D_cpu_ms"),
    "wall": ("T_T_ms", "T_D_ms"),
    "step": ("T_T_ms", "T_D_ms"),
}


def step_overhead_by_batch(steps: pd.DataFrame, max_batch: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Per batch size B the mean of ``engine_step_ms - T_T_ms - T_D_ms``: the step outside its forwards.

    Batch sizes without steps take the linear interpolation between the recorded ones (the nearest
    at the ends).

    Raises:
        ValueError: No ``engine_step_ms`` column, or a mean below 0 (the clocks disagree), named with B.
    """
    if "engine_step_ms" not in steps.columns:
        raise _err(STEPS_FILE, "missing (the step-time fit needs the whole engine step's wall time)", "engine_step_ms")
    rest = (steps["engine_step_ms"] - steps["T_T_ms"] - steps["T_D_ms"]).to_numpy(np.float64)
    B = steps["B"].to_numpy(np.int64)
    seen = np.unique(B)
    means = np.array([rest[B == b].mean() for b in seen])
    if (means < 0).any():
        b = int(seen[np.flatnonzero(means < 0)[0]])
        raise _err(
            STEPS_FILE,
            f"at B={b} the engine step is shorter than its forwards on average: the clocks disagree",
            "engine_step_ms",
        )
    over = np.interp(np.arange(1, max_batch + 1), seen, means)
    sd = [float(rest[B == b].std(ddof=1)) if (B == b).sum() > 1 else 0.0 for b in seen]
    return over, {
        "B": seen.tolist(),
        "mean_ms": means.tolist(),
        "sd_ms": sd,
        "steps": [int((B == b).sum()) for b in seen],
    }


def fit_batch_cost(
    steps: pd.DataFrame,
    manifest: dict[str, Any],
    n_splits: int = 5,
    source: dict[str, Any] | None = None,
    timing: str = "cpu",
    verify_form: str = "linear",
    predictors: tuple[str, ...] = ("independent", "shared"),
) -> BatchFitReport:
    """Fit the batch cost model on a validated steps table (module docstring for the method).

    Args:
        steps: The steps table (:func:`load_steps`).
        manifest: Its manifest (model facts, kmax, max_batch).
        n_splits: GroupKFold folds (by group).
        source: Provenance stored in the model.
        timing: ``"cpu"`` (default: the forwards' thread CPU time, the work without the time other
            processes of a shared machine took), ``"wall"`` (their wall time, as the B = 1 fits) or
            ``"step"``: what a user waits for, the step-time model (the forwards' wall times, the
            engine's per-step overhead by batch size as a term of its own, :func:`step_overhead_by_batch`,
            and the plain engine's step ``manifest.extra.ar_reference`` as the AR reference; needs
            ``engine_step_ms`` and that reference, :func:`summarize_plain_batch`).
        verify_form: The verification form of the model, a key of :data:`MAIN_FORMS`: ``"linear"`` (the
            default, and every shipped recording's) or ``"parity"``
            (its per-request term for odd queries, ``BatchCostModel.b_odd_query``).
        predictors: The U_batch predictors the model may choose from (:data:`PREDICTORS`; every one is
            reported): ``("independent", "shared")`` by default, the choice of every recording shipped
            before the ``"pooled"`` predictor.

    Returns:
        The :class:`BatchFitReport`.

    Raises:
        ValueError: Fewer than ``n_splits`` groups, or no step with B >= 2.
    """
    from specenv.cost.fit import statsmodels_ols

    sm = statsmodels_ols()
    from sklearn.model_selection import GroupKFold

    model_facts = manifest["model"]
    n = float(model_facts["n_experts"])
    groups = steps["group"].to_numpy()
    if len(np.unique(groups)) < n_splits:
        raise ValueError(f"the fit needs at least {n_splits} groups of requests (got {len(np.unique(groups))})")
    if not (steps["B"] >= 2).any():
        raise ValueError("the fit needs steps with B >= 2 (batched steps)")
    if timing not in TIMINGS:
        raise ValueError(f"timing={timing!r}: expected one of {tuple(TIMINGS)}")
    if verify_form not in MAIN_FORMS:
        raise ValueError(f"verify_form={verify_form!r}: expected one of {tuple(MAIN_FORMS)}")
    if not predictors or set(predictors) - set(PREDICTORS):
        raise ValueError(f"predictors={predictors!r}: expected some of {PREDICTORS}")
    predictors_asked = tuple(predictors)
    col_t, col_d = TIMINGS[timing]
    y_t = steps[col_t].to_numpy(np.float64)
    y_d = steps[col_d].to_numpy(np.float64)
    if (bad := y_t <= 0).any():
        raise _err(STEPS_FILE, f"must be > 0 to fit with timing={timing}", col_t, _first_bad(bad))
    for col, y in ((col_t, y_t), (col_d, y_d)):
        if np.ptp(y) == 0:
            raise _err(STEPS_FILE, f"is constant ({y[0]:g} ms in every step): no timing variation to fit", col)
    y_s = y_t + y_d
    overhead, over_diag, ar_step, prefill, prefill_diag = None, None, None, None, None
    ar_by_batch = None
    if timing == "step":
        ref = manifest.get("extra", {}).get("ar_reference")
        if not isinstance(ref, dict) or not {"a_ms", "b_req_ms", "c_ms_per_token"} <= set(ref):
            raise ValueError(
                "manifest.json, extra.ar_reference: missing (the step-time fit needs the plain engine's batch "
                "steps: record with scripts/collect_vllm_batch.py --plain)"
            )
        overhead, over_diag = step_overhead_by_batch(steps, int(manifest["max_batch"]))
        ar_step = (
            float(ref["a_ms"]),
            float(ref["b_req_ms"]),
            float(ref["c_ms_per_token"]),
            float(ref.get("u_ms_per_expert", 0.0)),
        )
        ar_by_batch = plain_residual_by_batch(ref, int(manifest["max_batch"]))
        if "prefill" in manifest.get("extra", {}):  # recorded since the step-time model's second recording
            prefill, prefill_diag = fit_prefill(manifest["extra"]["prefill"])
    u = _u_matrix(steps)
    ub = steps["U_batch"].to_numpy(np.float64)
    multi = steps["B"].to_numpy() >= 2
    folds = list(GroupKFold(n_splits=n_splits).split(steps, y_t, groups))

    # --- verification forms: clustered OLS in sample, GroupKFold out of sample (exact union)
    form_rows, fits = [], {}
    for name, terms in VERIFY_FORMS.items():
        X = _design(steps, terms)
        res = sm.OLS(y_t, X).fit(cov_type="cluster", cov_kwds={"groups": groups})
        fits[name] = res
        pred = np.empty_like(y_t)
        for tr, te in folds:
            beta, *_ = np.linalg.lstsq(X[tr], y_t[tr], rcond=None)
            pred[te] = X[te] @ beta
        e = _errors(y_t, pred)
        form_rows.append(
            {
                "form": name,
                "R2": float(res.rsquared),
                "oos_mape_pct": e["mape_pct"],
                "oos_rmse_ms": e["rmse"],
                "oos_r2": e["r2"],
            }
        )
    forms = pd.DataFrame(form_rows)
    main_terms = MAIN_FORMS[verify_form]
    main_name = next(name for name, terms in VERIFY_FORMS.items() if terms == main_terms)

    # --- the model's verification form and the draft T_D = d0 + d_step * n + d_tok * n * B, slopes >= 0
    Xv = _design(steps, main_terms)
    vres, vkeep = _nonneg_ols(y_t, Xv, groups)
    Xd = _draft_design(steps)
    dres, dkeep = _nonneg_ols(y_d, Xd, groups)

    # --- predictors: U_batch OOS (theta on train folds only), and the step times with the predicted union
    pred_u = {p: np.empty_like(ub) for p in (*PREDICTORS, "exact")}
    pred_v = {p: np.empty_like(ub) for p in pred_u}
    pred_d = np.empty_like(ub)
    thetas, pools = [], []
    top_k = int(model_facts["top_k"])
    for tr, te in folds:
        theta = fit_theta(u[tr][multi[tr]], ub[tr][multi[tr]], n)
        thetas.append(theta)
        pool = fit_pool(u[tr][multi[tr]], ub[tr][multi[tr]], n, top_k, theta)
        pools.append(pool)
        beta = _lstsq_nonneg(Xv[tr], y_t[tr])
        bd = _lstsq_nonneg(Xd[tr], y_d[tr])
        pred_d[te] = Xd[te] @ bd
        for p in pred_u:
            pu = ub[te] if p == "exact" else _predict_u(p, u[te], n, theta, pool)
            pred_u[p][te] = pu
            pred_v[p][te] = _design(steps.iloc[te], main_terms, pu) @ beta
    pred_o = np.zeros_like(ub)  # the per-step overhead by B, from the training folds (timing="step")
    if overhead is not None:
        for tr, te in folds:
            o_tr, _ = step_overhead_by_batch(steps.iloc[tr], int(manifest["max_batch"]))
            pred_o[te] = o_tr[steps["B"].to_numpy(np.int64)[te] - 1]
    pred_rows = []
    for p in pred_u:
        eu = _errors(ub[multi], pred_u[p][multi])
        ev = _errors(y_t, pred_v[p])
        es = _errors(y_s, pred_v[p] + pred_d)
        pred_rows.append(
            {
                "predictor": p,
                "U_batch_mape_pct": eu["mape_pct"],
                "U_batch_rmse": eu["rmse"],
                "U_batch_bias": float(np.mean(pred_u[p][multi] - ub[multi])),
                "verify_mape_pct": ev["mape_pct"],
                "step_mape_pct": es["mape_pct"],
                "step_rmse_ms": es["rmse"],
            }
        )
    predictors = pd.DataFrame(pred_rows)
    usable = predictors[predictors["predictor"].isin(predictors_asked)]
    best = usable.sort_values(["step_mape_pct", "U_batch_mape_pct"]).iloc[0]["predictor"]
    theta_all = fit_theta(u[multi], ub[multi], n)
    pool_all = fit_pool(u[multi], ub[multi], n, top_k, theta_all)

    # --- coefficients table
    vpar, vse, vp = _full(vres, vkeep, Xv.shape[1])
    dpar, dse, dp = _full(dres, dkeep, Xd.shape[1])
    coef = [
        {"term": nm, "part": part, "value": float(v), "se": float(se), "p": float(pv), "dropped": bool(np.isnan(se))}
        for part, names, params, ses, ps in (
            ("verify", ["b0", "b_pos", "alpha", "c", "b_req", "b_odd_query"][: Xv.shape[1]], vpar, vse, vp),
            ("draft", ["d0", "d_step", "d_tok"], dpar, dse, dp),
        )
        for nm, v, se, pv in zip(names, params, ses, ps, strict=True)
    ]
    # the unconstrained estimates beside them (the full form's plain clustered OLS)
    full_v = fits[main_name]
    full_d = sm.OLS(y_d, Xd).fit(cov_type="cluster", cov_kwds={"groups": groups})
    unc = [*zip(full_v.params, full_v.bse, strict=True), *zip(full_d.params, full_d.bse, strict=True)]
    for row, (v, se) in zip(coef, unc, strict=True):
        row["unconstrained"], row["unconstrained_se"] = float(v), float(se)
    coefficients = pd.DataFrame(coef)
    b0, b_pos, alpha, c, b_req = (float(x) for x in vpar[:5])
    b_odd_query = float(vpar[5]) if len(vpar) > 5 else 0.0
    d0, d_step, d_tok = (float(x) for x in dpar)
    step_ms = steps["step_ms"].to_numpy(np.float64)
    exact_row = predictors.set_index("predictor").loc["exact"]
    chosen_row = predictors.set_index("predictor").loc[best]
    summary = {
        "timing": timing,
        "verify_form": verify_form,
        "steps": len(steps),
        "groups": int(len(np.unique(groups))),
        "batched_steps": int(multi.sum()),
        "B_range": [int(steps["B"].min()), int(steps["B"].max())],
        "positions_range": [int(steps["positions"].min()), int(steps["positions"].max())],
        "context_mean": float(np.mean(np.concatenate([np.asarray(x, float) for x in steps["L"]]))),
        "U_batch_mean": float(ub.mean()),
        "verify_R2": float(vres.rsquared),
        "draft_R2": float(dres.rsquared),
        "draft_oos_mape_pct": _errors(y_d, pred_d)["mape_pct"],
        "verify_oos_mape_pct_exact": float(exact_row["verify_mape_pct"]),
        "step_oos_mape_pct_exact": float(exact_row["step_mape_pct"]),
        "step_oos_mape_pct": float(chosen_row["step_mape_pct"]),
        "predictor": str(best),
        "u_theta": theta_all,
        "u_theta_folds": thetas,
        "u_pool": pool_all[0],
        "u_pool_theta": pool_all[1],
        "u_pool_folds": [list(p) for p in pools],
        "predictors_asked": list(predictors_asked),
        "overhead_share": float(np.median(np.clip(step_ms - y_s, 0, None) / step_ms)),
        # wall ms of the step outside the timed forwards (scheduler, sampler, bookkeeping), median
        "overhead_ms": float(
            np.median(
                np.clip(step_ms - steps["T_T_ms"].to_numpy(np.float64) - steps["T_D_ms"].to_numpy(np.float64), 0, None)
            )
        ),
        "n_splits": n_splits,
        "load": manifest.get("extra", {}).get("machine", {}),
    }
    if overhead is not None:
        eng = steps["engine_step_ms"].to_numpy(np.float64)
        chosen_v = pred_v[str(best)]
        summary["engine_step"] = {
            "overhead_by_batch": over_diag,
            "ar_reference": manifest["extra"]["ar_reference"],
            # out of sample: the whole engine step against forwards + overhead (GroupKFold, predicted union)
            "oos_mape_pct": _errors(eng, chosen_v + pred_d + pred_o)["mape_pct"],
            "oos_mape_pct_without_overhead": _errors(eng, chosen_v + pred_d)["mape_pct"],
            "prefill": prefill_diag,
        }
    model = BatchCostModel.linear(
        b0=b0,
        b_pos=b_pos,
        alpha=alpha,
        c=c,
        b_req=b_req,
        b_odd_query=b_odd_query,
        d0=d0,
        d_step=d_step,
        d_tok=d_tok,
        kmax=int(manifest["kmax"]),
        max_batch=int(manifest["max_batch"]),
        top_k=int(model_facts["top_k"]),
        n_experts=int(model_facts["n_experts"]),
        n_layers=int(model_facts["n_layers"]),
        predictor=str(best),
        u_theta={"shared": theta_all, "pooled": pool_all[1]}.get(str(best), 1.0),
        u_pool=pool_all[0] if best == "pooled" else None,
        source=dict(source or {})
        | {"kind": "fit", "method": "specenv.cost.batchfit.fit_batch_cost", "timing": timing}
        | ({"verify_form": verify_form} if verify_form != "linear" else {})
        | ({"predictors": list(predictors_asked)} if "pooled" in predictors_asked else {}),
        overhead=overhead,
        ar_step=ar_step,
        ar_by_batch=ar_by_batch,
        prefill=prefill,
        diagnostics={
            "summary": summary,
            "coefficients": json.loads(coefficients.to_json(orient="records")),
            "forms": json.loads(forms.to_json(orient="records")),
            "predictors": json.loads(predictors.to_json(orient="records")),
            "context_mean": summary["context_mean"],
        },
    )
    return BatchFitReport(model=model, coefficients=coefficients, forms=forms, predictors=predictors, summary=summary)


def format_report(report: BatchFitReport) -> str:
    """The report as text tables (what ``specenv fit-batch`` prints)."""
    s = report.summary
    pd_opts = {"index": False, "float_format": lambda x: f"{x:.4g}"}
    lines = [
        f"batch cost model ({s['timing']} times): {s['steps']} steps ({s['batched_steps']} with B >= 2) "
        f"in {s['groups']} groups, "
        f"B {s['B_range'][0]}..{s['B_range'][1]}, positions {s['positions_range'][0]}..{s['positions_range'][1]}",
        "",
        "coefficients (OLS, SEs clustered by group; a negative slope is dropped = fixed at 0):",
        report.coefficients.to_string(**pd_opts),
        "",
        f"verification forms (GroupKFold({s['n_splits']}) by group, exact union):",
        report.forms.to_string(**pd_opts),
        "",
        "U_batch predictors (out of sample; U_batch errors on steps with B >= 2):",
        report.predictors.to_string(**pd_opts),
        "",
        f"chosen predictor: {s['predictor']} of {', '.join(s['predictors_asked'])} (shared: theta = "
        f"{s['u_theta']:.4g}; pooled: pool {s['u_pool']:.4g} experts, theta {s['u_pool_theta']:.4g}; on all steps)",
        f"OOS MAPE of the step time (T_T + T_D), chosen predictor: {s['step_oos_mape_pct']:.2f}% "
        f"(exact union: {s['step_oos_mape_pct_exact']:.2f}%); verification alone, exact union: "
        f"{s['verify_oos_mape_pct_exact']:.2f}%; draft: {s['draft_oos_mape_pct']:.2f}%",
    ]
    eng = s.get("engine_step")
    if eng is None:
        lines.append(
            f"scheduler overhead outside the timed forwards (median share of the step's wall time, not charged): "
            f"{100 * s['overhead_share']:.1f}% (median {s['overhead_ms']:.2f} ms of wall time)"
        )
        return "\n".join(lines)
    over = eng["overhead_by_batch"]
    ref = eng["ar_reference"]
    lines += [
        "",
        "step-time model (what a user waits for: the whole engine step):",
        "  per-step overhead outside the forwards, charged, by batch size: "
        + ", ".join(f"B={b}: {m:.2f} ms" for b, m in zip(over["B"], over["mean_ms"], strict=True)),
        f"  plain engine's step (the 1.0 of every speedup): {ref['a_ms']:.3f} + {ref['b_req_ms']:.3f} (B-1) + "
        f"{ref['c_ms_per_token']:.2e} sum L"
        + (
            f" + {ref['u_ms_per_expert']:.3f} (U_ind(B) - top_k)"  # the expected union of B tokens (plain_union)
            if "u_ms_per_expert" in ref
            else ""
        )
        + f" ms (R2 {ref['r2']:.3f}, {ref['steps']} steps); by B, measured"
        + (" / fitted" if all("model_ms" in p for p in ref["per_batch"]) else "")
        + ": "
        + ", ".join(
            f"B={p['B']}: {p['mean_ms']:.2f}" + (f" / {p['model_ms']:.2f}" if "model_ms" in p else "")
            for p in ref["per_batch"]
        )
        + (
            "; charged: the form plus each B's mean residual (measured at a recorded B, linear between)"
            if all("model_ms" in p for p in ref["per_batch"])
            else ""
        ),
        f"  OOS MAPE of the engine step: {eng['oos_mape_pct']:.2f}% (without the overhead term: "
        f"{eng['oos_mape_pct_without_overhead']:.2f}%)",
    ]
    for engine, d in (eng.get("prefill") or {}).items():
        lines.append(
            f"  prefill phase of a group, {'with the drafter' if engine == 'spec' else 'plain engine'}: "
            f"{d['a_ms']:.1f} + {d['b_ms_per_token']:.3f} ms x prompt tokens (R2 {d['r2']:.3f}, {d['groups']} groups, "
            f"OOS MAPE {d['oos_mape_pct']:.1f}% by repetition); by B: "
            + ", ".join(f"B={p['B']}: {p['mean_ms']:.0f}" for p in d["per_batch"])
        )
    return "\n".join(lines)
