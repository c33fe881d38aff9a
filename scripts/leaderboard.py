"""The validated leaderboard: one entry per (trace set, drafting mode), re-runnable and checked.

Usage::

    python scripts/leaderboard.py --write            # bench every (set, mode), record the leader of each
    python scripts/leaderboard.py --check            # re-run every entry's command, check its figure
    python scripts/leaderboard.py --check --only live-cpu/sequential

``--write`` runs ``specenv bench SET --drafting MODE --json`` for every shipped trace set and drafting
mode, takes the row with the highest pooled speedup in that mode (every policy the benchmark runs:
fixed k, heuristics, the peers' controllers, the set's shipped learned policies; never the oracle
row), and writes ``leaderboard/entries.json`` (per entry: the policy, its file, the exact command that
reproduces it, its pooled speedup with the bootstrap 95% CI and the bound, and its paired differences
to the best fixed k in hindsight and to the best peer of its mode, the best adaptive row that is not
learned, each with the bench's paired bootstrap 95% CI) with the full bench JSON of the run beside it
(``leaderboard/<set>-<mode>.json``), and the table ``leaderboard/README.md``.

``--check`` re-runs each entry's command and passes when the new pooled figure lies within the
recorded 95% CI (exact rows: equal to 1e-9). The figures are the leaderboard's record, not a copy of
the tests' golden figures; ``tests/test_leaderboard.py`` re-runs one entry.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BOARD = ROOT / "leaderboard"
SETS = ("paper-default", "live-cpu", "live-vllm", "live-vllm-wide", "live-vllm-t07")
MODES = ("none", "block", "sequential")
SEED, EPISODES = 0, 4
ORACLE = "oracle bound"


def bench_command(dataset: str, mode: str, only: str | None = None) -> list[str]:
    """The ``specenv bench`` command line of an entry (``--only`` the leader's row name)."""
    cmd = ["specenv", "bench", dataset, "--drafting", mode, "--seed", str(SEED), "--episodes", str(EPISODES)]
    if only is not None:
        cmd += ["--only", only]
    return cmd + ["--json", "--quiet", "--out", "{out}"]


def run_bench(cmd: list[str], out: Path) -> dict[str, Any]:
    """Run a bench command (``specenv`` of this interpreter's environment) and return its JSON."""
    exe = str(Path(sys.executable).with_name("specenv"))
    argv = [exe, *[a.replace("{out}", str(out)) for a in cmd[1:]]]
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)}: exit {res.returncode}: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout)


def _row(doc: dict[str, Any], name: str) -> dict[str, Any]:
    for row in doc["policies"]:
        if row["policy"] == name:
            return row
    raise KeyError(f"row {name!r} not in the bench output")


def leader(doc: dict[str, Any], mode: str) -> dict[str, Any]:
    """The row of the highest pooled speedup among the mode's rows (the oracle row excluded)."""
    rows = [r for r in doc["policies"] if not r["policy"].startswith(ORACLE) and r["drafting"] == mode]
    if not rows:
        raise ValueError(f"no row in drafting mode {mode!r}")
    return max(rows, key=lambda r: r["speedup_pooled"])


def _policy_file(dataset: str, row: dict[str, Any]) -> str:
    """Where the leader's policy lives: its shipped folder (learned) or the module of the built-in rule."""
    from policies import shipped_policy_dir

    if row.get("learned"):
        name = row["policy"].split(" (")[0]
        return str((shipped_policy_dir(dataset) / name / "policy.json").relative_to(ROOT))
    return "policies/bench/single.py (default rows: policies/heuristics.py, policies/delta.py, policies/peers.py)"


def _difference(row: dict[str, Any], column: str, reference: str | None) -> dict[str, Any] | None:
    """A row's paired difference to a reference, as the bench JSON has it (None when the run had no reference)."""
    if reference is None or row.get(column) is None:
        return None
    return {
        "reference": reference,
        "value": row[column],
        "ci95": [row[f"{column}_ci95_low"], row[f"{column}_ci95_high"]],
    }


def _fmt_difference(d: dict[str, Any] | None, leader: str) -> str:
    """A difference for the table: value [CI] vs its reference; '(the leader)' when the reference is the leader."""
    if d is None:
        return "not recorded"
    if d["reference"] == leader:
        return "(the leader)"
    lo, hi = d["ci95"]
    sig = "" if lo <= 0.0 <= hi else " *"
    return f"{d['value']:+.3f} [{lo:+.3f}, {hi:+.3f}]{sig} vs {d['reference']}"


def _fmt_pct(x: float | None) -> str:
    return "not recorded" if x is None else f"{x:.1f}%"


def write(sets: tuple[str, ...] = SETS, modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    """Bench every (set, mode) of ``sets``, record the leaders, write entries.json, the bench JSONs and README.md.

    The recorded entries of the other sets of :data:`SETS` are kept as they are (re-bench a subset with
    ``--set``); the board lists :data:`SETS` x :data:`MODES` in that order.
    """
    import tempfile

    BOARD.mkdir(exist_ok=True)
    old = BOARD / "entries.json"
    kept = {e["id"]: e for e in (json.loads(old.read_text()) if old.is_file() else []) if e["dataset"] not in sets}
    entries = []
    for ds in sets:
        for mode in modes:
            with tempfile.TemporaryDirectory() as tmp:
                doc = run_bench(bench_command(ds, mode), Path(tmp))
            top = leader(doc, mode)
            bound = next(r for r in doc["policies"] if r["policy"].startswith(ORACLE))
            entry = {
                "id": f"{ds}/{mode}",
                "dataset": ds,
                "drafting": mode,
                "policy": top["policy"],
                "policy_file": _policy_file(ds, top),
                "command": shlex.join(bench_command(ds, mode, top["policy"])).replace("'{out}'", "OUT"),
                "evaluation": top["evaluation"],
                "speedup_pooled": top["speedup_pooled"],
                "pooled_ci95": [top["pooled_ci95_low"], top["pooled_ci95_high"]],
                "oracle_pct": top["oracle_pct"],
                "bound": bound["speedup_pooled"],
                "belief_pct": top.get("belief_pct"),
                "vs_best_fixed": _difference(top, "vs_best_fixed", f"fixed k={doc['context']['best_fixed_k_test']}"),
                "vs_peer": _difference(top, "vs_peer", doc["context"]["vs"]),
                "bench_json": f"{ds}-{mode}.json",
            }
            (BOARD / entry["bench_json"]).write_text(json.dumps(doc, indent=1, default=float) + "\n")
            entries.append(entry)
            print(f"{entry['id']}: {entry['policy']} {entry['speedup_pooled']:.3f}", flush=True)
    fresh = {e["id"]: e for e in entries}
    order = [f"{ds}/{m}" for ds in SETS for m in MODES]
    entries = [fresh.get(i) or kept[i] for i in order if i in fresh or i in kept]
    (BOARD / "entries.json").write_text(json.dumps(entries, indent=1) + "\n")
    (BOARD / "README.md").write_text(table(entries))
    return entries


def table(entries: list[dict[str, Any]]) -> str:
    """The leaderboard as Markdown."""
    lines = [
        "# Leaderboard",
        "",
        "The best controller per (trace set, drafting mode) on the held-out generations, written by",
        "`python scripts/leaderboard.py --write` and re-checked by `python scripts/leaderboard.py --check`",
        "(each entry's command must reproduce its pooled figure within the recorded 95% CI; exact rows",
        "exactly). Each entry's full bench output is `<set>-<mode>.json` here; `entries.json` holds the",
        "records. Pooled speedup over plain decoding; the bound is the exact SSP oracle's; the belief oracle",
        "(oracle/belief.py) is a reference for online controllers, not a bound. The last two",
        "columns are the leader's difference in pooled speedup to the best fixed k in hindsight (chosen on the",
        "held-out generations) and to the best peer of its mode (the best adaptive row that is not learned),",
        "with paired bootstrap 95% CIs over the same generations; * marks a CI that excludes 0.",
        "",
        "| set | drafting | leader | pooled speedup [95% CI] | % of bound | bound | % of belief oracle | "
        "vs best fixed k | vs best peer | policy file |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        lo, hi = e["pooled_ci95"]
        ci = "(exact)" if e["evaluation"] == "exact" else f"[{lo:.3f}, {hi:.3f}]"
        lines.append(
            f"| {e['dataset']} | {e['drafting']} | {e['policy']} | {e['speedup_pooled']:.3f} {ci} | "
            f"{e['oracle_pct']:.1f}% | {e['bound']:.3f} | {_fmt_pct(e.get('belief_pct'))} | "
            f"{_fmt_difference(e.get('vs_best_fixed'), e['policy'])} | "
            f"{_fmt_difference(e.get('vs_peer'), e['policy'])} | `{e['policy_file']}` |"
        )
    lines += ["", "Reproduce one entry: its `command` in `entries.json` (OUT = any output folder).", ""]
    return "\n".join(lines)


def check(entry: dict[str, Any], out: Path) -> tuple[bool, float]:
    """Re-run an entry's command; (reproduced, new pooled figure)."""
    cmd = shlex.split(entry["command"].replace("OUT", "{out}"))
    new = _row(run_bench(cmd, out), entry["policy"])["speedup_pooled"]
    if entry["evaluation"] == "exact":
        return abs(new - entry["speedup_pooled"]) <= 1e-9, new
    lo, hi = entry["pooled_ci95"]
    return lo <= new <= hi, new


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="bench every (set, mode) and record the leaders")
    ap.add_argument("--check", action="store_true", help="re-run every entry and check its figure")
    ap.add_argument("--only", action="append", help="entry id, e.g. live-cpu/sequential (repeatable)")
    ap.add_argument(
        "--set", action="append", choices=SETS, help="with --write: re-bench only this set (repeatable; others kept)"
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.write:
        write(tuple(args.set) if args.set else SETS)
    if args.check:
        import tempfile

        entries = json.loads((BOARD / "entries.json").read_text())
        bad = 0
        for e in entries:
            if args.only and e["id"] not in args.only:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                ok, new = check(e, Path(tmp))
            bad += not ok
            print(
                f"{e['id']}: {e['policy']} recorded {e['speedup_pooled']:.4f}, now {new:.4f}: {'ok' if ok else 'FAIL'}"
            )
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
