"""Hostile-input probes of every ``specenv`` command (issue 26, round 4): one clear line, exit 2, nothing written.

Each probe runs ``python -m specenv.cli ARGS`` in its own temporary folder (a copy of the fixtures:
a 4-generation Kmax-2 trace set, a fitted cost model, a shipped policy, a batch recording), under
``timeout`` and an address-space limit. It holds when the command exits 2 with one line
``specenv: error: ...`` on stderr naming the culprit, prints no traceback and leaves the folder as it
was (nothing written, replaced or deleted). A probe that must succeed (``expect=0``) is checked for
exit 0 and nothing replaced that it did not write.

Classes: ``special`` (FIFO, /dev/zero links, folders where files are expected, dangling links),
``numbers`` (NaN, inf, 1e308, negative, zero, huge), ``policy`` (policy parameters), ``outputs``
(pre-existing outputs; a failed command leaves nothing).

    python scripts/hostile_probes.py [--only SUBSTRING] [--jobs N] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "specenv: error: "
MEMORY = 4_000_000 * 1024  # ulimit -v 4000000 (KiB)
SECONDS = 120


@dataclass
class Probe:
    """One probe: the command's arguments (``{d}`` is the probe's folder), what the line must name."""

    name: str
    cls: str
    args: list[str]
    names: list[str] = field(default_factory=list)
    setup: Callable[[Path], None] | None = None
    expect: int = 2


def _cleared(d: Path, rel: str) -> Path:
    """``d / rel`` with whatever stood there removed (a link itself, not its target) and its parent made."""
    p = d / rel
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        p.unlink()
    elif p.exists():
        shutil.rmtree(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def fifo(rel: str) -> Callable[[Path], None]:
    return lambda d: os.mkfifo(_cleared(d, rel))


def link(rel: str, target: str) -> Callable[[Path], None]:
    return lambda d: _cleared(d, rel).symlink_to(target)


def folder(rel: str) -> Callable[[Path], None]:
    return lambda d: _cleared(d, rel).mkdir()


def write(rel: str, text: str) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    return make


def edit_json(rel: str, fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        p = d / rel
        obj = json.loads(p.read_text())
        fn(obj)
        p.write_text(json.dumps(obj))

    return make


def both(*makers: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        for m in makers:
            m(d)

    return make


def _set(path: list, value) -> Callable[[dict], None]:  # noqa: ANN001
    def fn(obj: dict) -> None:
        o = obj
        for k in path[:-1]:
            o = o[k]
        o[path[-1]] = value

    return fn


def probes() -> list[Probe]:
    P: list[Probe] = []
    S = "{d}/set"  # 6 generations, Kmax 2 (fixtures)
    CM = "{d}/cm.json"
    POL = "{d}/pols/ppo"
    REC = "{d}/rec"
    serve = ["serve", "--print-command", "--models", "small-moe-v1"]

    # ---------------------------------------------------------------- special files
    for kind, mk in (("fifo", fifo), ("zero", lambda r: link(r, "/dev/zero")), ("dir", folder)):
        word = {"fifo": "FIFO", "zero": "device", "dir": "folder"}[kind]
        P += [
            Probe(
                f"validate rounds.parquet {kind}",
                "special",
                ["validate", S],
                ["rounds.parquet", word],
                mk("set/rounds.parquet"),
            ),
            Probe(f"fit manifest {kind}", "special", ["fit", S], ["manifest.json"], mk("set/manifest.json")),
            Probe(
                f"oracle --cost-model {kind}",
                "special",
                ["oracle", S, "--cost-model", "{d}/x.json"],
                ["x.json", word],
                mk("x.json"),
            ),
            Probe(
                f"bench --cost-model {kind}",
                "special",
                ["bench", S, "--cost-model", "{d}/x.json", "--episodes", "1", "--out", "{d}/o"],
                ["x.json", word],
                mk("x.json"),
            ),
            Probe(
                f"export --cost-model {kind}",
                "special",
                [
                    "export",
                    "minari",
                    "--policy",
                    "fixed-k:k=1",
                    "--dataset",
                    S,
                    "--cost-model",
                    "{d}/x.json",
                    "--root",
                    "{d}/root",
                ],
                ["x.json", word],
                mk("x.json"),
            ),
            Probe(
                f"train --cost-model {kind}",
                "special",
                ["train", "--traces", S, "--cost-model", "{d}/x.json", "--timesteps", "1000", "--out", "{d}/run"],
                ["x.json", word],
                mk("x.json"),
            ),
            Probe(
                f"serve --cost-model {kind}",
                "special",
                [*serve, "--policy", "fixed-k:k=1", "--cost-model", "{d}/x.json"],
                ["x.json", word],
                mk("x.json"),
            ),
            Probe(
                f"collect --prompts {kind}",
                "special",
                ["collect", "--out", "{d}/c", "--prompts", "{d}/p.json", "-n", "1", "--kmax", "1"],
                ["p.json", word],
                mk("p.json"),
            ),
            Probe(
                f"batch fit manifest {kind}",
                "special",
                ["batch", "fit", REC],
                ["manifest.json", word],
                mk("rec/manifest.json"),
            ),
            Probe(
                f"bench --policies weights {kind}",
                "special",
                ["bench", S, "--policies", "{d}/pols", "--episodes", "1", "--out", "{d}/o"],
                ["weights.npz", word],
                mk("pols/ppo/weights.npz"),
            ),
            Probe(
                f"report bench.json {kind}",
                "special",
                ["report", "{d}/rep"],
                ["bench.json"],
                mk("rep/bench.json"),
            ),
            Probe(
                f"batch bench --cost-model {kind}",
                "special",
                [
                    "batch",
                    "bench",
                    S,
                    "--batch",
                    "2",
                    "--no-learners",
                    "--cost-model",
                    "{d}/x.json",
                    "--episodes",
                    "1",
                    "--out",
                    "{d}/o",
                ],
                ["x.json", word],
                mk("x.json"),
            ),
        ]
        # outputs that are special files
        P += [
            Probe(f"fit --out {kind}", "special", ["fit", S, "--out", "{d}/m.json"], ["m.json"], mk("m.json")),
            Probe(
                f"batch fit --out {kind}",
                "special",
                ["batch", "fit", REC, "--out", "{d}/m.json"],
                ["m.json"],
                mk("m.json"),
            ),
            Probe(
                f"oracle --plot {kind}", "special", ["oracle", S, "--sweep", "--plot", "{d}/plot"], ["plot"], mk("plot")
            )
            if kind != "dir"
            else None,
            Probe(
                f"generate -o {kind}", "special", ["generate", "-o", "{d}/g", "-n", "2", "--kmax", "2"], ["g"], mk("g")
            )
            if kind != "dir"
            else None,
            Probe(f"bench --out {kind}", "special", ["bench", S, "--episodes", "1", "--out", "{d}/o"], ["o"], mk("o"))
            if kind != "dir"
            else None,
        ]
    P += [
        Probe(
            "validate dangling positions link",
            "special",
            ["validate", S],
            ["positions.parquet"],
            link("set/positions.parquet", "/nonexistent/p.parquet"),
        ),
        Probe(
            "oracle --cost-model dangling link",
            "special",
            ["oracle", S, "--cost-model", "{d}/x.json"],
            ["x.json"],
            link("x.json", "/nonexistent/x.json"),
        ),
        Probe("validate set is a file", "special", ["validate", "{d}/f"], ["f"], write("f", "x")),
        Probe("report DIR is a file", "special", ["report", "{d}/f"], ["f"], write("f", "x")),
        Probe("report DIR is a FIFO", "special", ["report", "{d}/f"], ["f"], fifo("f")),
        Probe(
            "serve --policy folder policy.json FIFO",
            "special",
            [*serve, "--policy", POL],
            ["policy.json"],
            fifo("pols/ppo/policy.json"),
        ),
        Probe(
            "serve --record FIFO", "special", [*serve, "--policy", "fixed-k:k=1", "--record", "{d}/r"], ["r"], fifo("r")
        ),
        Probe(
            "export --root FIFO",
            "special",
            ["export", "minari", "--policy", "fixed-k:k=1", "--dataset", S, "--root", "{d}/root"],
            ["root"],
            fifo("root"),
        ),
        Probe(
            "train bc --root /dev/zero",
            "special",
            [
                "train",
                "--algo",
                "bc",
                "--dataset",
                "specenv/x/y-v0",
                "--root",
                "{d}/root",
                "--traces",
                S,
                "--out",
                "{d}/run",
            ],
            ["root"],
            link("root", "/dev/zero"),
        ),
        Probe(
            "caps bench --joint-policy weights FIFO",
            "special",
            ["caps", "bench", "--joint-policy", POL, "--out", "{d}/o"],
            ["weights.npz"],
            fifo("pols/ppo/weights.npz"),
        ),
        Probe(
            "abtest --policy-dir policy.json /dev/zero",
            "special",
            ["abtest", "--policy-dir", "{d}/pols", "--out", "{d}/o"],
            ["policy.json"],
            link("pols/ppo/policy.json", "/dev/zero"),
        ),
        Probe("models --build into FIFO cache", "special", ["models", "--build", "zzz"], ["zzz"]),
    ]

    # ---------------------------------------------------------------- degenerate numbers
    nums = {
        "nan": "nan",
        "inf": "inf",
        "-inf": "-inf",
        "1e308": "1e308",
        "neg": "-1",
        "zero": "0",
        "huge": "99999999999999999999999",
    }
    for tag, v in nums.items():
        P += [
            Probe(f"oracle --kmax {tag}", "numbers", ["oracle", S, "--kmax", v], ["--kmax"]),
            Probe(
                f"bench --episodes {tag}", "numbers", ["bench", S, "--episodes", v, "--out", "{d}/o"], ["--episodes"]
            ),
            Probe(
                f"train --gamma {tag}",
                "numbers",
                ["train", "--traces", S, "--gamma", v, "--out", "{d}/run"],
                ["--gamma"],
            )
            if tag not in ("zero",)
            else None,
            Probe(
                f"caps bench --weight {tag}",
                "numbers",
                ["caps", "bench", "--weight", v, "--out", "{d}/o"],
                ["--weight"],
                expect=0 if tag in ("inf", "1e308", "huge") else 2,  # "inf ok" (documented): any weight >= 0 runs
            )
            if tag not in ("zero",)
            else None,
            Probe(
                f"caps bench --max-mismatch {tag}",
                "numbers",
                ["caps", "bench", "--max-mismatch", v, "--out", "{d}/o"],
                ["--max-mismatch"],
            )
            if tag not in ("zero",)
            else None,
            Probe(
                f"caps bench --train-joint {tag}",
                "numbers",
                ["caps", "bench", "--train-joint", v, "--out", "{d}/o"],
                ["--train-joint"],
            )
            if tag not in ("zero", "1e308", "huge")  # a finite weight trains for minutes (any weight): not probed
            else None,
            Probe(
                f"serve --fallback-k {tag}",
                "numbers",
                [*serve, "--policy", "fixed-k:k=1", "--fallback-k", v],
                ["--fallback-k"],
            )
            if tag not in ("zero",)
            else None,
            Probe(
                f"collect --gpu-memory-utilization {tag}",
                "numbers",
                ["collect", "--engine", "vllm", "--device", "cuda", "--gpu-memory-utilization", v, "--out", "{d}/c"],
                ["--gpu-memory-utilization"],
            ),
            Probe(f"abtest --batch {tag}", "numbers", ["abtest", "--batch", v, "--out", "{d}/o"], ["--batch"]),
            Probe(
                f"oracle --lookahead {tag}",
                "numbers",
                ["oracle", S, "--lookahead", v, "--drafting", "block"],
                ["--lookahead"],
            ),
        ]
    for tag, v in (("nan", float("nan")), ("1e308", 1e308), ("neg", -5.0), ("inf", "Infinity"), ("zero", 0.0)):
        P += [
            Probe(
                f"cost model beta0 {tag}",
                "numbers",
                ["oracle", S, "--cost-model", CM],
                ["cm.json"],
                edit_json("cm.json", lambda o, v=v: _poke(o, "beta0", v)),
                expect=0 if tag == "zero" else 2,
            ),
            Probe(
                f"cost model alpha {tag}",
                "numbers",
                ["bench", S, "--cost-model", CM, "--episodes", "1", "--out", "{d}/o"],
                ["cm.json"],
                edit_json("cm.json", lambda o, v=v: _poke(o, "alpha", v)),
            )
            if tag != "zero"
            else None,
            Probe(
                f"cost model d1 {tag}",
                "numbers",
                [
                    "export",
                    "minari",
                    "--policy",
                    "fixed-k:k=1",
                    "--dataset",
                    S,
                    "--cost-model",
                    CM,
                    "--root",
                    "{d}/root",
                ],
                ["cm.json"],
                edit_json("cm.json", lambda o, v=v: _poke(o, "d1", v)),
            )
            if tag != "zero"
            else None,
        ]
    P += [
        Probe("generate --seed -1", "numbers", ["generate", "-o", "{d}/g", "--seed", "-1"], ["--seed"]),
        Probe("generate -n 0", "numbers", ["generate", "-o", "{d}/g", "-n", "0"], ["--generations"]),
        Probe("fit --folds 1", "numbers", ["fit", S, "--folds", "1"], ["--folds"]),
        Probe("fit --folds 1e3", "numbers", ["fit", S, "--folds", "999"], ["folds"]),
        Probe("batch bench --batch 0", "numbers", ["batch", "bench", S, "--batch", "0", "--out", "{d}/o"], ["--batch"]),
        Probe(
            "batch bench --batch 65", "numbers", ["batch", "bench", S, "--batch", "65", "--out", "{d}/o"], ["--batch"]
        ),
        Probe(
            "tune --samples 0", "numbers", ["tune", "--traces", S, "--samples", "0", "--out", "{d}/t"], ["--samples"]
        ),
        Probe(
            "train --n-envs 1e9",
            "numbers",
            ["train", "--traces", S, "--n-envs", "1000000000", "--out", "{d}/run"],
            ["--n-envs"],
        ),
        Probe(
            "serve --part-rounds 0",
            "numbers",
            [*serve, "--policy", "fixed-k:k=1", "--part-rounds", "0"],
            ["--part-rounds"],
        ),
        Probe("serve --kmax 0", "numbers", [*serve, "--policy", "fixed-k:k=1", "--kmax", "0"], ["--kmax"]),
        Probe("serve --kmax 1e9", "numbers", [*serve, "--policy", "fixed-k:k=1", "--kmax", "1000000000"], ["--kmax"]),
        Probe("collect --threads 0", "numbers", ["collect", "--threads", "0", "--out", "{d}/c"], ["--threads"]),
        Probe(
            "collect --max-new-tokens 0",
            "numbers",
            ["collect", "--max-new-tokens", "0", "--out", "{d}/c"],
            ["--max-new-tokens"],
        ),
        Probe("abtest --repeats 0", "numbers", ["abtest", "--repeats", "0", "--out", "{d}/o"], ["--repeats"]),
        Probe("abtest --batch 2,,0", "numbers", ["abtest", "--batch", "2,0", "--out", "{d}/o"], ["--batch"]),
        Probe(
            "export --episodes 0",
            "numbers",
            ["export", "minari", "--policy", "fixed-k:k=1", "--dataset", S, "--episodes", "0", "--root", "{d}/root"],
            ["--episodes"],
        ),
        Probe(
            "export --lookahead 99",
            "numbers",
            [
                "export",
                "minari",
                "--policy",
                "fixed-k:k=1",
                "--dataset",
                S,
                "--lookahead",
                "99",
                "--drafting",
                "block",
                "--root",
                "{d}/root",
            ],
            ["--lookahead"],
        ),
        Probe("batch fit --folds 0", "numbers", ["batch", "fit", REC, "--folds", "0"], ["--folds"]),
        Probe(
            "caps bench --joint-lookahead -1",
            "numbers",
            ["caps", "bench", "--joint-lookahead", "-1", "--out", "{d}/o"],
            ["--joint-lookahead"],
        ),
        Probe(
            "bench --ray-cpus 0", "numbers", ["bench", S, "--ray", "--ray-cpus", "0", "--out", "{d}/o"], ["--ray-cpus"]
        ),
        Probe("bench --kmax 3 above the set", "numbers", ["bench", S, "--kmax", "3", "--out", "{d}/o"], ["3"]),
    ]

    # ---------------------------------------------------------------- policy parameters
    # (string, what the line names, exit): 0 where the value is accepted by design (noted)
    bad_policies = [
        ("fixed-k:k=1e308", "'k'", 2),
        ("fixed-k:k=99999999999999999999999", "k=", 2),
        ("fixed-k:k=3", "k=3", 2),
        ("ucb:c=1e308", "", 0),  # finite, in range (c >= 0)
        ("ucb:arms=9", "'arms'", 2),
        ("ucb:arms=", "'arms'", 2),
        ("svip:h=1e308", "lookahead", 2),
        ("adaedl:lam=0.5,gamma=1e308", "lookahead", 2),
        ("disco:w_q=1e308", "lookahead", 2),
        ("specdec-pp:bias=-1e308", "lookahead", 2),
        ("cascade:candidates=99", "'candidates'", 2),
        ("cascade:set_rounds=99999999999999999999999", "", 0),  # a count >= 1: never re-set
        ("transformers-heuristic:start=99999999999999999999999", "", 0),  # capped at Kmax, as HF's (default 20)
        ("vllm-dsd-table:batch_size=99999999999999999999999", "", 0),  # the table's last range
        ("vllm-dsd-table:k=99999999999999999999999", "", 0),  # capped at Kmax, as vLLM caps it
        ("vllm-dsd-table:schedule=zzz", "'zzz'", 2),
        ("vllm-dsd-table:schedule=1-1:99", "", 0),  # capped at Kmax, as vLLM caps it
        ("adaedl:dataset=/dev/zero", "dataset", 2),
        ("svip:cost_model=/dev/zero", "cost_model", 2),
        ("fixed-k:", "fixed-k", 2),
        ("fixed-k:k=1,", "fixed-k", 2),
        (":k=1", "policy", 2),
        ("fixed-k:k==1", "'k'", 2),
        ("confidence-threshold:threshold=1e-400", "lookahead", 2),  # 0.0 is a probability; needs h >= 1
        ("ucb:c=0x10", "'c'", 2),
        ("batch-survival:x=1", "'x'", 2),
        ("fixed-k:K=1", "'K'", 2),
    ]
    for text, named, code in bad_policies:
        names = [named] if named else []
        P += [
            Probe(
                f"export --policy {text}",
                "policy",
                ["export", "minari", "--policy", text, "--dataset", S, "--root", "{d}/root"],
                names,
                expect=code,
            ),
            Probe(f"serve --policy {text}", "policy", [*serve, "--policy", text, "--kmax", "2"], names, expect=code),
        ]

    # ---------------------------------------------------------------- pre-existing outputs
    P += [
        Probe(
            "generate into a user's folder",
            "outputs",
            ["generate", "-o", "{d}/u", "-n", "2"],
            ["u"],
            write("u/notes.txt", "mine"),
        ),
        Probe(
            "fit --out a user's file", "outputs", ["fit", S, "--out", "{d}/u.json"], ["u.json"], write("u.json", "{}")
        ),
        Probe(
            "batch fit --out a user's file",
            "outputs",
            ["batch", "fit", REC, "--out", "{d}/u.json"],
            ["u.json"],
            write("u.json", "{}"),
        ),
        Probe(
            "bench --out with a user's bench.md",
            "outputs",
            ["bench", S, "--episodes", "1", "--out", "{d}/o"],
            ["bench.md"],
            write("o/bench.md", "mine"),
        ),
        Probe(
            "bench --batch --out with a user's bench-batch2.json",
            "outputs",
            ["bench", S, "--batch", "2", "--no-learners", "--episodes", "1", "--out", "{d}/o"],
            ["o"],
            write("o/bench-batch2.json", "{}"),
        ),
        Probe(
            "caps bench --out with a user's bench_caps.md",
            "outputs",
            ["caps", "bench", "--out", "{d}/o"],
            ["bench_caps.md"],
            write("o/bench_caps.md", "mine"),
        ),
        Probe(
            "oracle --plot with a user's oracle_delta.png",
            "outputs",
            ["oracle", S, "--delta", "--plot", "{d}/p"],
            ["oracle_delta.png"],
            write("p/oracle_delta.png", "x"),
        ),
        Probe(
            "report over a user's report.html",
            "outputs",
            ["report", "{d}/rep"],
            ["report.html"],
            both(write("rep/report.html", "mine"), write("rep/fit.json", "{}")),
        ),
        Probe(
            "train --out a user's folder",
            "outputs",
            ["train", "--traces", S, "--timesteps", "1000", "--out", "{d}/run"],
            ["run"],
            write("run/ppo-seed0/policy/policy.json", "{}"),
        ),
        Probe(
            "tune --out with a user's best.json",
            "outputs",
            ["tune", "--traces", S, "--out", "{d}/t"],
            ["best.json"],
            write("t/best.json", "{}"),
        ),
        Probe(
            "collect into a user's folder",
            "outputs",
            ["collect", "--out", "{d}/u", "-n", "1"],
            ["u"],
            write("u/notes.txt", "mine"),
        ),
        Probe(
            "export over a user's dataset folder",
            "outputs",
            ["export", "minari", "--policy", "fixed-k:k=1", "--dataset", S, "--root", "{d}/root"],
            ["root"],
            write("root/specenv/set/fixed-k-k-1-v0/notes.txt", "mine"),
        ),
        # serve --record into a user's folder: needs vLLM to start (--print-command writes nothing)
        Probe(
            "failed bench leaves no --out",
            "outputs",
            ["bench", S, "--policies", "{d}/nope", "--out", "{d}/o"],
            ["nope"],
        ),
        Probe(
            "failed batch bench leaves no --out",
            "outputs",
            ["batch", "bench", S, "--batch", "2", "--learners", "zzz", "--out", "{d}/o"],
            ["--learners"],
        ),
        Probe(
            "failed export leaves no --root",
            "outputs",
            ["export", "minari", "--policy", "zzz", "--dataset", S, "--root", "{d}/root"],
            ["zzz"],
        ),
        Probe(
            "fit --out through a link to a user's file",
            "outputs",
            ["fit", S, "--out", "{d}/l.json"],
            ["l.json"],
            both(write("mine.json", "{}"), link("l.json", "mine.json")),
        ),
    ]
    return [p for p in P if p is not None]


def _poke(obj: dict, key: str, value) -> None:  # noqa: ANN001
    """Set a cost model's coefficient ``key``: ``beta0``/``alpha``/``c`` of budget 1, or ``d1``/``d0``."""
    if key in ("d1", "d0"):
        obj["draft"][key] = value
    else:
        obj["target"]["1"][key] = value


def snapshot(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in [root, *sorted(root.rglob("*"))]:
        if ".specenv-validated" in p.parts:
            continue
        if p.is_symlink():
            out[str(p)] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[str(p)] = "dir"
        elif not p.is_file():
            out[str(p)] = "special"
        else:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def fixtures(base: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = [sys.executable, "-m", "specenv.cli", "-q"]
    subprocess.run(
        [*run, "generate", "-o", str(base / "set"), "-n", "6", "--kmax", "2", "--name", "set"],
        env=env,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [*run, "fit", str(base / "set"), "--out", str(base / "cm.json")], env=env, check=True, capture_output=True
    )
    shutil.copytree(ROOT / "policies" / "shipped" / "paper-default-v2" / "ppo", base / "pols" / "ppo")
    shutil.copytree(ROOT / "specenv" / "data" / "live-vllm-batch-v1", base / "rec")
    for p in (base / "set").rglob(".specenv-validated"):
        shutil.rmtree(p)


def run_probe(p: Probe, base: Path) -> dict:
    d = Path(tempfile.mkdtemp(prefix="probe-"))
    try:
        for child in base.iterdir():
            (shutil.copytree if child.is_dir() else shutil.copy2)(child, d / child.name)
        if p.setup is not None:
            p.setup(d)
        before = snapshot(d)
        args = [a.replace("{d}", str(d)) for a in p.args]

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))

        env = dict(
            os.environ, PYTHONPATH=str(ROOT), SPECENV_CACHE=str(d / ".cache"), MINARI_DATASETS_PATH=str(d / "mroot")
        )
        t0 = time.monotonic()
        try:
            r = subprocess.run(
                [sys.executable, "-m", "specenv.cli", *args],
                cwd=d,
                capture_output=True,
                text=True,
                timeout=SECONDS,
                preexec_fn=limit,
                env=env,
                stdin=subprocess.DEVNULL,
            )
            rc, out, err = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = 124, str(exc.stdout or ""), str(exc.stderr or "")
        secs = time.monotonic() - t0
        after = snapshot(d)
        after = {k: v for k, v in after.items() if "/.cache" not in k}
        before = {k: v for k, v in before.items() if "/.cache" not in k}
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if p.args[0] == "abtest" and lines and "needs vLLM" in lines[-1]:  # refused before it reads anything
            return {
                "name": p.name,
                "class": p.cls,
                "held": None,
                "problems": ["n/a: vLLM not installed"],
                "exit": rc,
                "seconds": round(time.monotonic() - t0, 1),
                "line": lines[-1][:300],
            }
        problems = []
        if rc != p.expect:
            problems.append(f"exit {rc}")
        if "Traceback" in out + err:
            problems.append("traceback")
        if p.expect == 2:
            if len(lines) != 1:
                problems.append(f"{len(lines)} lines")
            elif not lines[0].startswith(PREFIX):
                problems.append("no 'specenv: error:' prefix")
            else:
                miss = [n.replace("{d}", str(d)) for n in p.names if n.replace("{d}", str(d)) not in lines[0]]
                if miss:
                    problems.append(f"does not name {miss}")
            if before != after:
                added = sorted(set(after) - set(before))
                changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
                removed = sorted(set(before) - set(after))
                problems.append(
                    f"wrote: +{[Path(a).name for a in added][:4]} ~{[Path(a).name for a in changed][:4]}"
                    f" -{[Path(a).name for a in removed][:4]}"
                )
        return {
            "name": p.name,
            "class": p.cls,
            "held": not problems,
            "problems": problems,
            "exit": rc,
            "seconds": round(secs, 1),
            "line": (lines[-1] if lines else "")[:300].replace(str(d), "{d}"),
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    todo = [p for p in probes() if not a.only or any(s in p.name for s in a.only)]
    base = Path(tempfile.mkdtemp(prefix="probe-base-"))
    try:
        fixtures(base)
        results = []
        with ThreadPoolExecutor(a.jobs) as ex:
            for res in ex.map(lambda p: run_probe(p, base), todo):
                mark = {True: "held", None: "n/a"}.get(res["held"], "NOT HELD " + "; ".join(res["problems"]))
                print(f"[{res['class']}] {res['name']}: {mark} ({res['seconds']} s) | {res['line']}", flush=True)
                results.append(res)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    counts: dict[str, list[int]] = {}
    for r in results:
        c = counts.setdefault(r["class"], [0, 0, 0])
        c[{True: 0, False: 1, None: 2}[r["held"]]] += 1
    for cls, (held, not_held, na) in counts.items():
        print(f"{cls}: {held} held, {not_held} not held, {na} n/a")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
