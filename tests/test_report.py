"""``specenv report``: one self-contained page from fit/oracle/bench outputs, and the figures it embeds.

The page is built from real outputs of the small trace set. The browser check renders it with
Debian's headless Chromium and checks the screenshot; it is skipped (with the reason) only when no
Chromium binary is installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from policies.bench.figures import FAMILIES, family_representatives, plot_categories, plot_speedup, policy_family
from policies.bench.result import BenchResult
from policies.bench.single import ORACLE_ROW
from tests.hostile.harness import run_cli

FIGURE_NAMES = ("oracle_sweep.png", "oracle_delta.png", "speedup.png", "speedup_by_category.png")


@pytest.fixture(scope="module")
def outputs(small_traces: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with what fit, oracle and bench write on the small set (a few policies only)."""
    folder = tmp_path_factory.mktemp("report") / "out"
    folder.mkdir()
    nopol = tmp_path_factory.mktemp("no-policies")
    fit = run_cli(["fit", small_traces, "--json", "--folds", "2"])
    assert fit.exit_code == 0, fit.stderr
    (folder / "fit.json").write_text(fit.stdout)
    orc = run_cli(["oracle", small_traces, "--sweep", "--delta", "--plot", folder, "--json", "--episodes", "0"])
    assert orc.exit_code == 0, orc.stderr
    (folder / "oracle.json").write_text(orc.stdout)
    args = ["bench", small_traces, "--out", folder, "--episodes", "1", "--policies", nopol]
    bench = run_cli([*args, "--only", "fixed k=1", "--only", "adaptive", "--only", "UCB"])
    assert bench.exit_code == 0, bench.stderr
    return folder


def _report(folder: Path) -> tuple[dict, str]:
    res = run_cli(["report", folder, "--json"])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout), (folder / "report.html").read_text()


@pytest.mark.slow  # seconds of work; the full suite runs it
def test_page_holds_fit_oracle_and_bench_with_embedded_figures(outputs: Path) -> None:
    summary, page = _report(outputs)
    assert summary == {"report": str(outputs / "report.html"), "missing": []}
    fit = json.loads((outputs / "fit.json").read_text())
    oracle = json.loads((outputs / "oracle.json").read_text())
    bench = json.loads((outputs / "bench.json").read_text())
    # the fit table: every K with its alpha, the paper's Table A4 value beside K=1, the Table A6 forms
    for r in fit["per_k"]:
        assert f"{r['alpha']:.4f}" in page, r["K"]
    assert "[0.0839]" in page  # paper Table A4, alpha at K=1
    for form in fit["forms"]:
        assert f"<code>{form['model']}</code>" in page
    assert "[0.999]" in page  # paper Table A6, R2 of the categorical form
    # the oracle: S_max, every sweep row, the delta space's boundary slope and wrong-side share
    assert f"{oracle['s_max_pooled']:.4f}" in page
    assert len(oracle["sweep"]) == 6
    assert f"{oracle['delta']['lambda_sep_ms']:.3f} ms/token" in page
    assert f"{100 * oracle['delta']['sep_error']:.1f}%</b> of the weight" in page
    # the bench: every policy, its family, its % of bound; the category table
    for p in bench["policies"]:
        assert f"{p['oracle_pct']:.1f}%" in page and p["policy"] in page
    assert ORACLE_ROW in page and "Pooled speedup per prompt category" in page
    # every figure embedded byte for byte; nothing fetched from anywhere
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]+)"', page)
    assert {alt for _, alt in images} == set(FIGURE_NAMES)
    for data, alt in images:
        assert base64.b64decode(data) == (outputs / alt).read_bytes(), alt
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)=["']?(https?:|//|file:)""", page), "page references something outside"
    assert "not found" not in page


def test_missing_inputs_are_named_with_the_command_that_writes_them(outputs: Path, tmp_path: Path) -> None:
    folder = tmp_path / "only-bench"
    folder.mkdir()
    for name in ("bench.json", "speedup.png", "speedup_by_category.png"):
        shutil.copy(outputs / name, folder / name)
    summary, page = _report(folder)
    assert summary["missing"] == ["fit.json", "oracle.json", "oracle_sweep.png", "oracle_delta.png"]
    assert f"specenv fit TRACES --json &gt; {folder}/fit.json" in page
    assert f"specenv oracle TRACES --sweep --delta --plot {folder}" in page
    assert page.count('class="missing"') == 4
    assert page.count("data:image/png;base64,") == 2


def test_text_from_the_inputs_is_escaped(outputs: Path, tmp_path: Path) -> None:
    folder = tmp_path / "hostile-names"
    folder.mkdir()
    bench = json.loads((outputs / "bench.json").read_text())
    evil = '<script>alert("x")</script><img src="http://example.com/x.png">'
    bench["policies"][1]["policy"] = evil
    bench["notes"] = ["<b>bold</b> & <i>co</i>"]
    (folder / "bench.json").write_text(json.dumps(bench))
    _, page = _report(folder)
    assert "<script" not in page
    assert not re.search(r"""(src|href)=["']?(https?:|//|file:)""", page), "an input's text became markup"
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; &lt;i&gt;co&lt;/i&gt;" in page


def test_inputs_from_different_trace_sets_are_flagged(outputs: Path, tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    shutil.copytree(outputs, folder)
    oracle = json.loads((folder / "oracle.json").read_text())
    oracle["dataset"] = "another-set"
    (folder / "oracle.json").write_text(json.dumps(oracle))
    _, page = _report(folder)
    assert 'class="warn"' in page and "another-set" in page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.mark.slow  # seconds of work; the full suite runs it
def test_browser_renders_the_page(outputs: Path, tmp_path: Path) -> None:
    """Headless Chromium renders the page into a 1280x2000 screenshot that is not blank."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium binary on PATH (.ci/run installs Debian's chromium package)")
    from PIL import Image

    _report(outputs)
    shot = tmp_path / "shot.png"
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1280,2000",
        (outputs / "report.html").as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    with Image.open(shot) as im:
        assert im.format == "PNG" and im.size == (1280, 2000)
        pixels = np.asarray(im.convert("RGB"), dtype=np.float64)
    gray = pixels.mean(axis=2)
    assert gray.std() > 10.0, "screenshot is (nearly) one colour"
    # text and coloured figures, not a blank or error page: many distinct colours, dark text pixels
    colours = np.unique(pixels.reshape(-1, 3).astype(np.uint8), axis=0)
    assert len(colours) > 200, len(colours)
    assert (gray < 80).mean() > 0.005
    # the top of the page is the report, not a browser error: the title's dark text sits in the first rows
    assert (gray[:120] < 80).mean() > 0.001


# ---------------------------------------------------------------------- the figures
def _summary_row(policy: str, evaluation: str = "monte-carlo", learned: bool = False, constant: bool = False) -> dict:
    return {"policy": policy, "evaluation": evaluation, "learned": learned, "constant": constant}


def test_policy_families() -> None:
    assert policy_family(_summary_row(ORACLE_ROW, "exact")) == "oracle"
    assert policy_family(_summary_row("fixed k=4", "exact")) == "exact"
    assert policy_family(_summary_row("imitation (learned)", learned=True)) == "learned"
    assert policy_family(_summary_row("ppo (constant k=6)", learned=True, constant=True)) == "constant"
    assert policy_family(_summary_row("delta-space (adaptive lambda)")) == "delta"
    assert policy_family(_summary_row("UCB bandit")) == "heuristic"
    assert policy_family(_summary_row("UCB bandit", constant=True)) == "heuristic"  # constant only flags learners


def _bench_result(rows: list[tuple[str, str, bool, bool, float]], cats: tuple[str, ...] = ("qa", "rag")) -> BenchResult:
    """A BenchResult with (policy, evaluation, learned, constant, mean speedup) rows; the oracle last."""
    recs = []
    for name, ev, learned, constant, sp in rows:
        half = 0.0 if ev == "exact" else 0.05
        recs.append(
            {
                "policy": name,
                "evaluation": ev,
                "speedup_mean": sp,
                "ci95_low": sp - half,
                "ci95_high": sp + half,
                "speedup_pooled": sp,
                "oracle_pct": 100.0 * sp / rows[-1][4],
                "learned": learned,
                "constant": constant,
            }
        )
    summary = pd.DataFrame(recs)
    categories = pd.DataFrame(
        [
            {"policy": r[0], "category": c, "speedup_pooled": r[4] * (1.0 + 0.1 * i)}
            for r in rows
            for i, c in enumerate(cats)
        ]
    )
    ctx = {"dataset": "toy", "kmax": 6, "cost_model": "fit-train", "test_generations": 5}
    return BenchResult("single", summary, ctx, [], categories=categories, episodes=pd.DataFrame())


TOY = [
    ("autoregressive (k=0)", "exact", False, False, 1.0),
    ("best fixed k=3 (train)", "exact", False, False, 1.6),
    ("UCB bandit", "monte-carlo", False, False, 1.5),
    ("goodput (SmartSpec)", "monte-carlo", False, False, 1.7),
    ("delta-space (oracle lambda)", "monte-carlo", False, False, 1.65),
    ("ppo (constant k=4)", "monte-carlo", True, True, 1.75),
    ("imitation (learned)", "monte-carlo", True, False, 1.72),
    (ORACLE_ROW, "exact", False, False, 1.9),
]


def test_family_representatives_are_each_familys_best_and_skip_constant_learners() -> None:
    res = _bench_result(TOY)
    assert family_representatives(res) == [
        ("exact", "best fixed k=3 (train)"),
        ("heuristic", "goodput (SmartSpec)"),
        ("delta", "delta-space (oracle lambda)"),
        ("learned", "imitation (learned)"),  # not the better constant ppo: an adaptive learner ran
        ("oracle", ORACLE_ROW),
    ]
    only_constant = [r for r in TOY if r[0] != "imitation (learned)"]
    assert ("constant", "ppo (constant k=4)") in family_representatives(_bench_result(only_constant))


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list:
    """The matplotlib figures the plotting functions close (kept open for inspection)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    yield figs
    monkeypatch.undo()
    for f in figs:
        plt.close(f)


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda o: hasattr(o, "get_text")) if t.get_text()]


def test_speedup_figure_names_every_family_labels_the_bound_and_zooms(captured: list, tmp_path: Path) -> None:
    res = _bench_result(TOY)
    plot_speedup(res, tmp_path / "speedup.png")
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = captured
    ax = fig.axes[0]
    texts = _texts(fig)
    for fam in ("exact", "heuristic", "delta", "learned", "constant", "oracle"):
        assert FAMILIES[fam][0] in texts, fam
    assert "oracle bound (SSP) = 1.900" in texts
    lo, hi = ax.get_xlim()
    assert 0.8 < lo <= 0.9 and 1.9 < hi < 2.1  # zoomed to the data, not from 0
    assert "bootstrap" in ax.get_xlabel() and "whisker" in ax.get_xlabel()


def test_category_figure_shows_each_familys_best_per_category(captured: list, tmp_path: Path) -> None:
    res = _bench_result(TOY, cats=("qa", "rag", "stem"))
    plot_categories(res, tmp_path / "cat.png")
    (fig,) = captured
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert labels == [
        "fixed k: best fixed k=3 (train)",
        "published heuristic: goodput (SmartSpec)",
        "delta-space rule: delta-space (oracle lambda)",
        "learned policy: imitation (learned)",
        "oracle bound (SSP)",
    ]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["qa", "rag", "stem"]
    assert ax.get_ylim()[0] > 0.5  # zoomed
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert round(1.9 * 1.2, 6) in heights  # the oracle's pooled speedup on the third category


def test_delta_figure_explains_quadrants_and_the_wrong_side(small_set, captured: list, tmp_path: Path) -> None:
    from oracle import delta_analysis, plot_delta
    from specenv.cost.source import cost_model_for

    an = delta_analysis(small_set.arrays(), cost_model_for(small_set, "profile"))
    plot_delta(an, str(tmp_path / "delta.png"))
    (fig,) = captured
    texts = " | ".join(_texts(fig))
    for q, meaning in (
        ("I", "costlier, accepts more"),
        ("III", "cheaper, accepts fewer"),
        ("IV", "costlier, accepts fewer"),
    ):
        assert f"{q}: {meaning}: {an.quadrants[q]:,} points" in texts
    assert f"II: cheaper, accepts more (empty when V(t) falls with t): {an.quadrants['II']:,} points" in texts
    assert f"{an.sep_error:.1%} of the weight of the points off the dE[a] = 0 axis lies below it" in texts
    assert f"{an.sep_error:.1%} of the weight on its wrong side" in texts
    assert "(ms)" in fig.axes[0].get_ylabel() and "(tokens per round)" in fig.axes[0].get_xlabel()


def test_sweep_figure_has_titled_panels_with_units(small_set, captured: list, tmp_path: Path) -> None:
    from oracle import kmax_sweep, plot_kmax_sweep
    from specenv.cost.source import cost_model_for

    table = kmax_sweep(small_set.arrays(), cost_model_for(small_set, "profile"), kmaxes=[1, 2, 3])
    plot_kmax_sweep(table, str(tmp_path / "sweep.png"), "toy")
    (fig,) = captured
    assert all(ax.get_title() for ax in fig.axes)
    assert "autoregressive" in fig._suptitle.get_text() and "AR" in fig._suptitle.get_text()
    assert all("draft tokens" in ax.get_xlabel() for ax in fig.axes)
    assert "autoregressive" in fig.axes[0].get_ylabel()
    assert "(draft tokens)" in fig.axes[1].get_ylabel() and "(tokens)" in fig.axes[2].get_ylabel()
