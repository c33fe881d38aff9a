"""One self-contained HTML page of a run's results: the cost-model fit, the oracle and the benchmark.

``specenv report DIR`` runs nothing itself. It reads what the other commands wrote into ``DIR``:

* ``fit.json`` (``specenv fit TRACES --json > DIR/fit.json``): the per-K cost model beside the
  paper's Table A4 and the pooled forms beside Table A6;
* ``oracle.json`` (``specenv oracle TRACES --sweep --delta --json > DIR/oracle.json``): S_max, the
  Kmax sweep and the delta space, with ``oracle_sweep.png`` and ``oracle_delta.png`` (``specenv
  oracle TRACES --sweep --delta --plot DIR``);
* ``bench.json``, ``speedup.png`` and ``speedup_by_category.png`` (``specenv bench TRACES --out
  DIR``): the benchmark's table and figures;

and writes ``DIR/report.html``: inline CSS, the figures embedded as base64 ``data:`` URIs, no script
and no network reference, so the page opens from anywhere (a mail attachment, a CI artefact). A
missing input is named on the page with the command that writes it; no JSON input at all is an
error, and so is a garbled one (one line ``FILE: field 'a.b': problem``, from
:mod:`specenv.validation`'s ``read_json`` and ``check``, against the models of :func:`_models`,
which check the fields the page shows and let the rest pass). Every text taken from a file is
HTML-escaped.

The module sits in ``policies`` (the top library layer, DESIGN.md section 7) because it presents
the benchmark's policy families (:func:`policies.bench.figures.policy_family`).
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from policies.bench.figures import FAMILIES, policy_family
from policies.bench.single import ORACLE_ROW

__all__ = ["FIGURES", "INPUTS", "REPORT_FILE", "ReportInputs", "read_inputs", "render_html", "write_report"]

#: The page written into the folder.
REPORT_FILE = "report.html"
#: JSON inputs: key -> (file name, the command that writes it; ``TRACES`` and ``DIR`` are placeholders).
INPUTS: dict[str, tuple[str, str]] = {
    "fit": ("fit.json", "specenv fit TRACES --json > DIR/fit.json"),
    "oracle": ("oracle.json", "specenv oracle TRACES --sweep --delta --json > DIR/oracle.json"),
    "bench": ("bench.json", "specenv bench TRACES --out DIR"),
}
#: Figures: file name -> (section, caption, the command that writes it).
FIGURES: dict[str, tuple[str, str, str]] = {
    "oracle_sweep.png": (
        "oracle",
        "The exact oracle's speedup bound, its mean budget k* and its accepted drafts per round against Kmax, "
        "the largest budget allowed (the paper's Figure 2).",
        "specenv oracle TRACES --sweep --delta --plot DIR",
    ),
    "oracle_delta.png": (
        "oracle",
        "Delta space (the paper's Figure 3): every budget the oracle rejected, relative to the budget k* it "
        "chose, with the boundary line of the delta-space rule.",
        "specenv oracle TRACES --sweep --delta --plot DIR",
    ),
    "speedup.png": (
        "bench",
        "Every policy's mean speedup over autoregressive decoding on the held-out generations, by family, "
        "beside the oracle bound.",
        "specenv bench TRACES --out DIR",
    ),
    "speedup_by_category.png": (
        "bench",
        "Pooled speedup per prompt category of the best policy of each family.",
        "specenv bench TRACES --out DIR",
    ),
}
#: Largest figure embedded (bytes).
FIGURE_MAX_BYTES = 32 << 20
#: The mark of a page this module wrote (``specenv report`` replaces such a page without ``--overwrite``).
GENERATOR_META = '<meta name="generator" content="specenv report">'


def written_by_report(path: Path) -> bool:
    """Whether ``path`` is a page :func:`render_html` wrote (its head carries :data:`GENERATOR_META`)."""
    from specenv.io import open_regular

    try:
        with open_regular(path) as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return GENERATOR_META.encode() in head


_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class ReportInputs:
    """What :func:`read_inputs` found in a folder.

    Attributes:
        folder: The folder read.
        fit: The validated ``fit.json`` (a plain dict), or None when absent.
        oracle: The validated ``oracle.json``, or None.
        bench: The validated ``bench.json``, or None.
        figures: File name -> PNG bytes of the figures found.
        missing: File names of the inputs and figures not found.
    """

    folder: Path
    fit: dict[str, Any] | None = None
    oracle: dict[str, Any] | None = None
    bench: dict[str, Any] | None = None
    figures: dict[str, bytes] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


@cache
def _models() -> dict[str, Any]:
    """Pydantic models of the three JSON inputs (the fields the page shows; other fields pass)."""
    from typing import Annotated

    from pydantic import AfterValidator, BaseModel, ConfigDict, Field

    from specenv.validation import KMAX_MAX, check_name

    Finite = Annotated[float, Field(allow_inf_nan=False)]
    Share = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    Count = Annotated[int, Field(ge=0, le=1 << 62)]
    K = Annotated[int, Field(ge=0, le=KMAX_MAX)]
    Name = Annotated[str, AfterValidator(check_name)]
    Rows = 100_000  # most rows of any table

    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")

    class PerK(Open):
        K: K
        alpha: Finite
        c: Finite
        beta0: Finite
        N: Count
        R2: Finite
        oos_mape_pct: Finite
        alpha_p: Finite

    class Form(Open):
        model: Name
        R2: Finite
        cv_rmse_ms: Finite
        cv_mape_pct: Finite

    class Draft(Open):
        d1: Finite
        d0: Finite
        R2: Finite

    class Ar(Open):
        extrapolated: bool

    class FitSource(Open):
        traces: Name | None = None

    class FitModel(Open):
        source: FitSource | None = None

    class FitJSON(Open):
        per_k: Annotated[list[PerK], Field(min_length=1, max_length=KMAX_MAX + 1)]
        forms: Annotated[list[Form], Field(max_length=100)]
        draft: Draft
        ar: Ar
        cost_model: FitModel | None = None

    class SweepRow(Open):
        kmax: K
        s_max_pooled: Finite
        s_max_mean: Finite
        mean_k: Finite
        mean_accepted: Finite
        best_fixed_k: K
        best_fixed_speedup: Finite

    class Delta(Open):
        decisions: Count
        points: Count
        quadrants: dict[Name, Count]
        lambda_sep_ms: Finite
        sep_error: Share
        lambda_ls_ms: Finite
        r2_origin: Finite
        lambda_interval_ms: Annotated[list[Finite], Field(min_length=2, max_length=2)]

    class OracleJSON(Open):
        dataset: Name
        split: Name
        cost_model: Name
        kmax: K
        lookahead: K
        generations: Count
        tokens: Count
        s_max_pooled: Finite
        s_max_mean: Finite
        mean_k: Finite
        mean_accepted: Finite
        expected_rounds: Finite
        cost_per_token_ms: Finite
        ar_per_token_ms: Finite
        sweep: Annotated[list[SweepRow], Field(max_length=KMAX_MAX)] | None = None
        delta: Delta | None = None

    class PolicyRow(Open):
        policy: Name
        evaluation: Name
        speedup_mean: Finite
        ci95_low: Finite | None
        ci95_high: Finite | None
        speedup_pooled: Finite
        pooled_ci95_low: Finite | None
        pooled_ci95_high: Finite | None
        oracle_pct: Finite
        mean_k: Finite
        mean_accepted: Finite
        constant: bool = False
        learned: bool = False

    class BenchContext(Open):
        dataset: Name
        kmax: K
        cost_model: Name
        cost_model_fitted_on: Name
        episodes: Count
        test_generations: Count
        best_fixed_k_train: K
        delta_lambda_ms: Finite

    class Skipped(Open):
        policy: Name
        reason: Annotated[str, Field(max_length=4096)]

    class BenchJSON(Open):
        context: BenchContext
        policies: Annotated[list[PolicyRow], Field(min_length=1, max_length=Rows)]
        categories: Annotated[list[dict[Name, Finite | Name | None]], Field(max_length=Rows)]
        notes: Annotated[list[Annotated[str, Field(max_length=4096)]], Field(max_length=Rows)] = []
        skipped: Annotated[list[Skipped], Field(max_length=Rows)] = []

    return {"fit": FitJSON, "oracle": OracleJSON, "bench": BenchJSON}


def _read_png(path: Path) -> bytes:
    """The bytes of a PNG file, or ValueError ``FILE: problem`` (too big, not a PNG, unreadable)."""
    from specenv.io import read_limited
    from specenv.validation import value_error

    try:
        data = read_limited(path, FIGURE_MAX_BYTES)  # regular files only, at most the cap + 1 bytes read
    except IsADirectoryError:
        raise value_error(str(path), "cannot embed figure: is a folder, not a file") from None
    except OSError as exc:
        raise value_error(str(path), f"cannot embed figure: {exc.strerror or exc.__class__.__name__}") from None
    if not data.startswith(_PNG_MAGIC):
        raise value_error(str(path), "cannot embed figure: not a PNG image")
    return data


def read_inputs(folder: Path) -> ReportInputs:
    """Read and validate the inputs of the page from ``folder``.

    Raises:
        ValueError: One line: the folder is not a folder, it holds none of the JSON inputs, or an input
            present is garbled (``FILE: field 'a.b': problem``).
    """
    from specenv.validation import check, read_json, value_error

    if not folder.is_dir():
        raise value_error(str(folder), "not a folder (give the folder that fit, oracle and bench wrote into)")
    found = ReportInputs(folder)
    for key, (name, _) in INPUTS.items():
        path = folder / name
        if not path.exists() and not path.is_symlink():
            found.missing.append(name)
            continue
        obj = read_json(path, what="report input")
        check(_models()[key], obj, str(path))  # the fields the page reads; the plain dict is kept
        setattr(found, key, obj)
    if found.fit is None and found.oracle is None and found.bench is None:
        names = ", ".join(n for n, _ in INPUTS.values())
        raise value_error(str(folder), f"none of {names} found: write them first (see `specenv report --help`)")
    for name in FIGURES:
        path = folder / name
        if not path.exists() and not path.is_symlink():
            found.missing.append(name)
            continue
        found.figures[name] = _read_png(path)
    return found


# ---------------------------------------------------------------------- HTML
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0;
  color: #1d2330; background: #f6f7f9; line-height: 1.45; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { font-size: 1.6em; margin: 0.2em 0 0.1em; }
h2 { font-size: 1.3em; border-bottom: 2px solid #d8dde6; padding-bottom: 4px; margin-top: 2em; }
h3 { font-size: 1.05em; margin-top: 1.4em; }
p.lead { color: #4a5468; margin-top: 0; }
nav a { margin-right: 1.2em; }
table { border-collapse: collapse; margin: 0.6em 0 1em; font-size: 0.86em; }
th, td { border: 1px solid #d8dde6; padding: 3px 8px; text-align: right; white-space: nowrap; }
th { background: #eef1f6; }
td.name, th.name { text-align: left; }
th, td.name { white-space: normal; }
tr.oracle td { background: #fdecec; font-weight: 600; }
span.ref { color: #7a8497; }
span.ci { font-size: 0.85em; }
div.scroll { overflow-x: auto; }
span.swatch { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.4em; vertical-align: -0.1em;
  border-radius: 2px; }
figure { margin: 1em 0 1.6em; }
figure img { max-width: 100%; border: 1px solid #e3e7ee; }
figcaption { font-size: 0.9em; color: #4a5468; margin-top: 4px; }
.missing { background: #fff7e0; border-left: 4px solid #e0a800; padding: 6px 12px; margin: 0.8em 0; }
.warn { background: #fdecec; border-left: 4px solid #d33; padding: 6px 12px; margin: 0.8em 0; }
code { background: #eef1f6; padding: 0 3px; border-radius: 3px; }
ul.notes li { margin: 0.2em 0; }
"""

#: CSS colours of the benchmark's families (the figure's matplotlib colours).
_FAMILY_CSS = {
    "0.55": "#8c8c8c",
    "tab:blue": "#1f77b4",
    "tab:purple": "#9467bd",
    "tab:green": "#2ca02c",
    "tab:red": "#d62728",
}


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any, fmt: str = "{:.3f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "&ndash;"
    return _e(fmt.format(value))


def _table(head: list[str], rows: list[list[str]], name_cols: int = 1, row_class: list[str] | None = None) -> str:
    """An HTML table; ``head`` plain text (escaped), ``rows`` already-escaped cell HTML."""
    ths = "".join(
        f'<th class="name">{_e(h)}</th>' if i < name_cols else f"<th>{_e(h)}</th>" for i, h in enumerate(head)
    )
    body = []
    for j, row in enumerate(rows):
        cls = f' class="{row_class[j]}"' if row_class and row_class[j] else ""
        tds = "".join(f'<td class="name">{c}</td>' if i < name_cols else f"<td>{c}</td>" for i, c in enumerate(row))
        body.append(f"<tr{cls}>{tds}</tr>")
    return f'<div class="scroll"><table><thead><tr>{ths}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _missing(what: str, command: str, folder: str) -> str:
    cmd = command.replace("DIR", folder)
    return f'<div class="missing">{_e(what)} not found: write it with <code>{_e(cmd)}</code></div>'


def _figure(inputs: ReportInputs, name: str) -> str:
    section, caption, command = FIGURES[name]
    data = inputs.figures.get(name)
    if data is None:
        return _missing(f"figure {name}", command, str(inputs.folder))
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return (
        f'<figure id="fig-{_e(name.removesuffix(".png"))}"><img src="{uri}" alt="{_e(name)}">'
        f"<figcaption><b>{_e(name)}</b>: {_e(caption)}</figcaption></figure>"
    )


def _fit_section(inputs: ReportInputs) -> str:
    from specenv.traces import paper

    fit = inputs.fit
    if fit is None:
        return _missing("fit.json", INPUTS["fit"][1], str(inputs.folder))
    src = ((fit.get("cost_model") or {}).get("source") or {}).get("traces")
    parts = [
        "<p>Per-K OLS fit of the target's verification time "
        "<code>T_T = beta0(K) + alpha(K) * U_r + c(K) * L</code> on the rounds table"
        + (f" of <b>{_e(src)}</b>" if src else "")
        + '; the paper\'s values in <span class="ref">[brackets]</span>. OOS MAPE: out-of-sample mean '
        "absolute percentage error (GroupKFold by generation).</p>"
    ]

    def cell(v: float, ref: Any, fmt: str, scale: float = 1.0) -> str:
        s = _num(v * scale, fmt)
        if ref is not None:
            s += f' <span class="ref">[{_num(ref * scale, fmt)}]</span>'
        return s

    rows = []
    for r in fit["per_k"]:
        ref = paper.TABLE_A4.get(int(r["K"]), (None,) * 5)
        rows.append(
            [
                _e(r["K"]),
                cell(r["alpha"], ref[0], "{:.4f}"),
                cell(r["c"], ref[1], "{:.3f}", 1e3),
                cell(r["beta0"], ref[2], "{:.3f}"),
                _e(f"{r['N']:,}"),
                cell(r["R2"], ref[3], "{:.4f}"),
                cell(r["oos_mape_pct"], ref[4], "{:.2f}"),
                "&lt;1e-300" if r["alpha_p"] == 0 else _num(r["alpha_p"], "{:.1e}"),
            ]
        )
    parts.append("<h3>Per-K coefficients (paper Table A4)</h3>")
    parts.append(
        _table(
            ["K", "alpha (ms/expert)", "c (1e-3 ms/token)", "beta0 (ms)", "rounds N", "R2", "OOS MAPE %", "alpha p"],
            rows,
        )
    )
    rows6 = []
    for r in fit["forms"]:
        ref6 = paper.TABLE_A6.get(r["model"])
        rows6.append(
            [
                f"<code>{_e(r['model'])}</code>",
                cell(r["R2"], ref6 and ref6[0], "{:.3f}"),
                cell(r["cv_rmse_ms"], ref6 and ref6[1], "{:.3f}"),
                cell(r["cv_mape_pct"], ref6 and ref6[2], "{:.2f}"),
            ]
        )
    parts.append("<h3>Pooled model forms (paper Table A6)</h3>")
    parts.append(
        "<p>One line for every K (first two) against the categorical-in-K form the cost model uses (last).</p>"
    )
    parts.append(_table(["model form", "R2", "CV RMSE (ms)", "CV MAPE %"], rows6))
    d, ar = fit["draft"], fit["ar"]
    parts.append(
        f"<p>Draft time: <code>T_D = {_num(d['d1'])}*K + {_num(d['d0'])} ms</code> "
        f'<span class="ref">[paper {paper.DRAFT_D1}*K + {paper.DRAFT_D0}]</span>, R2 {_num(d["R2"], "{:.4f}")}. '
        "Autoregressive step (K = 0): "
        + ("<b>extrapolated</b> (no K=0 rounds in the set)." if ar["extrapolated"] else "fitted on K=0 rounds.")
        + "</p>"
    )
    return "".join(parts)


_QUADRANTS = {
    "I": "costlier, accepts more",
    "II": "cheaper, accepts more",
    "III": "cheaper, accepts fewer",
    "IV": "costlier, accepts fewer",
    "axis": "on an axis (no difference in accepted drafts or cost)",
}


def _oracle_section(inputs: ReportInputs) -> str:
    o = inputs.oracle
    parts = []
    if o is None:
        parts.append(_missing("oracle.json", INPUTS["oracle"][1], str(inputs.folder)))
    else:
        parts.append(
            f"<p>Exact Stochastic-Shortest-Path oracle on <b>{_e(o['dataset'])}</b> (split {_e(o['split'])}, "
            f"{_e(o['generations'])} generations, {_num(o['tokens'], '{:,}')} tokens), Kmax {_e(o['kmax'])}, "
            f"lookahead {_e(o['lookahead'])}, cost model {_e(o['cost_model'])}.</p>"
        )
        parts.append(
            _table(
                ["quantity", "value"],
                [
                    ["S_max, pooled (sum AR cost / sum optimal cost)", _num(o["s_max_pooled"], "{:.4f}")],
                    ["S_max, mean over generations", _num(o["s_max_mean"], "{:.4f}")],
                    ["mean budget k* per round (optimal path)", _num(o["mean_k"])],
                    ["mean accepted drafts per round", _num(o["mean_accepted"])],
                    ["expected rounds", _num(o["expected_rounds"], "{:,.1f}")],
                    ["optimal cost per token V(0)/N (ms)", _num(o["cost_per_token_ms"], "{:.4f}")],
                    ["autoregressive cost per token (ms)", _num(o["ar_per_token_ms"], "{:.4f}")],
                ],
            )
        )
        if o.get("sweep"):
            parts.append("<h3>Against Kmax (paper Figure 2)</h3>")
            rows = [
                [
                    _e(r["kmax"]),
                    _num(r["s_max_pooled"], "{:.4f}"),
                    _num(r["s_max_mean"], "{:.4f}"),
                    _num(r["mean_k"]),
                    _num(r["mean_accepted"]),
                    _e(r["best_fixed_k"]),
                    _num(r["best_fixed_speedup"], "{:.4f}"),
                ]
                for r in o["sweep"]
            ]
            parts.append(
                _table(
                    ["Kmax", "S_max pooled", "S_max mean", "mean k*", "mean accepted", "best fixed k", "its speedup"],
                    rows,
                )
            )
        dl = o.get("delta")
        if dl:
            parts.append("<h3>Delta space (paper Figure 3)</h3>")
            q = dl["quadrants"]
            rows = [[_e(name), _e(_QUADRANTS.get(name, "")), _e(f"{q.get(name, 0):,}")] for name in _QUADRANTS]
            parts.append(
                f"<p>{_num(dl['points'], '{:,}')} rejected budgets at {_num(dl['decisions'], '{:,}')} decision "
                "states, each placed by dE[a] (expected accepted drafts of the rejected k minus those of k*) "
                "and dE[Cost] (its round cost minus that of k*).</p>"
            )
            parts.append(_table(["quadrant", "meaning (rejected k against k*)", "points"], rows, name_cols=2))
            lo, hi = dl["lambda_interval_ms"]
            if lo > hi:
                envelope = (
                    "No line separates every point: the largest ratio dE[Cost]/dE[a] in quadrant III "
                    f"({_num(lo)} ms/token) exceeds the smallest in quadrant I ({_num(hi)})."
                )
            else:
                envelope = f"Every line with a slope in [{_num(lo)}, {_num(hi)}] ms/token separates every point."
            parts.append(
                f"<p>Boundary line: lambda = <b>{_num(dl['lambda_sep_ms'], '{:.3f}')} ms/token</b>. k* maximises "
                "lambda*E[a] - Cost, so every rejected point should lie above it; "
                f"<b>{_num(100 * dl['sep_error'], '{:.1f}')}%</b> of the weight of the points off the dE[a] = 0 "
                f"axis lies below it (on the wrong side). {envelope} Least-squares line through the origin: "
                f"lambda = {_num(dl['lambda_ls_ms'])} ms/token (R2 {_num(dl['r2_origin'])}): the centre of the "
                "cloud, not the decision boundary.</p>"
            )
    for name, (section, _, _) in FIGURES.items():
        if section == "oracle":
            parts.append(_figure(inputs, name))
    return "".join(parts)


def _ci(low: Any, high: Any) -> str:
    if low is None or high is None:
        return ""
    return f'<br><span class="ref ci">[{_num(low)}, {_num(high)}]</span>'


def _bench_section(inputs: ReportInputs) -> str:
    b = inputs.bench
    parts = []
    if b is None:
        parts.append(_missing("bench.json", INPUTS["bench"][1], str(inputs.folder)))
    else:
        c = b["context"]
        parts.append(
            f"<p>Every policy on the <b>{_e(c['test_generations'])} held-out generations</b> of "
            f"<b>{_e(c['dataset'])}</b> (Kmax {_e(c['kmax'])}), beside the exact oracle bound. Cost model "
            f"{_e(c['cost_model'])} (fitted on: {_e(c['cost_model_fitted_on'])}). Fixed-k rows are evaluated "
            f"exactly; the others play {_e(c['episodes'])} Monte-Carlo episodes per generation, with "
            "95% percentile-bootstrap intervals over generations in brackets. Best fixed k on the train split: "
            f"{_e(c['best_fixed_k_train'])}; delta-space lambda (oracle boundary slope, train): "
            f"{_num(c['delta_lambda_ms'])} ms/token.</p>"
        )
        legend = "".join(
            f'<span class="swatch" style="background:{_FAMILY_CSS.get(colour, "#999")}"></span>{_e(label)}&emsp;'
            for label, colour, _ in FAMILIES.values()
        )
        parts.append(f"<p>{legend}</p>")
        rows, classes = [], []
        for r in b["policies"]:
            fam = policy_family(r)
            swatch = f'<span class="swatch" style="background:{_FAMILY_CSS.get(FAMILIES[fam][1], "#999")}"></span>'
            exact = r["evaluation"] == "exact"
            rows.append(
                [
                    swatch + _e(r["policy"]),
                    _e(FAMILIES[fam][0].split(" (")[0]),
                    _num(r["speedup_mean"]) + ("" if exact else _ci(r["ci95_low"], r["ci95_high"])),
                    _num(r["speedup_pooled"]) + ("" if exact else _ci(r["pooled_ci95_low"], r["pooled_ci95_high"])),
                    _num(r["oracle_pct"], "{:.1f}%"),
                    _num(r["mean_k"], "{:.2f}"),
                    _num(r["mean_accepted"], "{:.2f}"),
                    "exact" if exact else "Monte Carlo",
                ]
            )
            classes.append("oracle" if r["policy"] == ORACLE_ROW else "")
        for sk in b.get("skipped", []):
            rows.append([_e(sk["policy"]), "not run", _e(sk["reason"]), "", "", "", "", ""])
            classes.append("")
        parts.append(
            _table(
                [
                    "policy",
                    "family",
                    "speedup (mean)",
                    "speedup (pooled)",
                    "% of bound (pooled)",
                    "mean k",
                    "mean accepted",
                    "evaluation",
                ],
                rows,
                name_cols=2,
                row_class=classes,
            )
        )
        parts.append(_category_table(b))
        notes = b.get("notes") or []
        if notes:
            parts.append('<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    for name, (section, _, _) in FIGURES.items():
        if section == "bench":
            parts.append(_figure(inputs, name))
    return "".join(parts)


def _category_table(b: dict[str, Any]) -> str:
    """Pooled speedup per category, rows in the summary's order."""
    by_policy = {str(r.get("policy")): r for r in b["categories"]}
    cats = sorted({k for r in b["categories"] for k in r if k != "policy"})
    if not cats:
        return ""
    rows, classes = [], []
    for p in b["policies"]:
        rec = by_policy.get(p["policy"], {})
        cells = [_num(rec.get(c)) if not isinstance(rec.get(c), str) else _e(rec.get(c)) for c in cats]
        rows.append([_e(p["policy"]), *cells])
        classes.append("oracle" if p["policy"] == ORACLE_ROW else "")
    return "<h3>Pooled speedup per prompt category</h3>" + _table(["policy", *cats], rows, row_class=classes)


def _datasets(inputs: ReportInputs) -> dict[str, str]:
    """The trace set each input names (the last path component of a folder path)."""
    out = {}
    src = ((inputs.fit or {}).get("cost_model") or {}).get("source") or {}
    if src.get("traces"):
        out["fit.json"] = str(src["traces"])
    if inputs.oracle is not None:
        out["oracle.json"] = str(inputs.oracle["dataset"])
    if inputs.bench is not None:
        out["bench.json"] = str(inputs.bench["context"]["dataset"])
    return {k: Path(v).name or v for k, v in out.items()}


def render_html(inputs: ReportInputs) -> str:
    """The page: inline CSS, embedded figures, no script, no network reference."""
    sets = _datasets(inputs)
    title = "specenv report" + (f": {', '.join(sorted(set(sets.values())))}" if sets else "")
    warn = ""
    if len(set(sets.values())) > 1:
        which = "; ".join(f"{k}: {v}" for k, v in sets.items())
        warn = f'<div class="warn">The inputs come from different trace sets ({_e(which)}).</div>'
    present = [n for n, _ in INPUTS.values() if n not in inputs.missing]
    sections: list[tuple[str, str, Callable[[ReportInputs], str]]] = [
        ("fit", "1. Cost model", _fit_section),
        ("oracle", "2. Oracle bound", _oracle_section),
        ("bench", "3. Benchmark", _bench_section),
    ]
    nav = "".join(f'<a href="#{key}">{_e(head)}</a>' for key, head, _ in sections)
    body = "".join(f'<section id="{key}"><h2>{_e(head)}</h2>{fn(inputs)}</section>' for key, head, fn in sections)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{GENERATOR_META}"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>"
        f"<body><main><h1>{_e(title)}</h1>"
        f'<p class="lead">Speculation-length control on a Mixture-of-Experts target: the cost model, the exact '
        f"oracle bound and the benchmark of every policy, from the outputs in <code>{_e(inputs.folder)}</code> "
        f"({_e(', '.join(present))}).</p>"
        f"<nav>{nav}</nav>{warn}{body}</main></body></html>\n"
    )


def write_report(folder: Path, out: Path | None = None) -> Path:
    """Read ``folder``'s inputs and write the page atomically to ``out`` (default ``folder/report.html``).

    Returns:
        The path written.

    Raises:
        ValueError: One line, from :func:`read_inputs`.
    """
    from specenv.io import atomic_write_text

    inputs = read_inputs(folder)
    out = folder / REPORT_FILE if out is None else out
    atomic_write_text(out, render_html(inputs))
    return out
