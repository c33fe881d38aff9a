"""A real client's view of ``specenv serve``: a bounded load test with the OpenAI Python client, on loopback.

Run in the ``vllm`` environment (the ``openai`` client comes with vLLM)::

    python -m scripts.load_test --models small-moe-v1 --arms none,ucb --concurrency 1,4,16 \\
        --requests 32 --time-limit 120 --out DIR [--sigterm ucb]

Every arm (a ``--policy`` of ``specenv serve``; ``none`` = vLLM's fixed ``num_speculative_tokens``,
``plain`` = stock vLLM without speculation) is served by its own server, one after another (one
engine at a time), on 127.0.0.1 only. Before the arms, a plain server (stock vLLM, no speculation,
no specenv) answers every prompt once, one request at a time: the greedy reference. Then, per arm and
per concurrency C: a fixed number of requests (``--requests``; completions and chat completions
alternating, streamed, greedy, ``ignore_eos``) from C client threads, stopping early at the time
limit. Each response is checked identical to the reference. Reported per (arm, C): output tokens/s
over the wall time of the level, time to first token and time per output token (the mean gap between
the streamed tokens after the first) at p50/p99, and each request's outcome:

* ``ok``: finished, the text equals plain greedy's;
* ``mismatch``: finished, another text;
* ``refused``: a clean error before the request was accepted: HTTP 503 (the drain gate of
  :mod:`specenv.engines.vllm.drain`) or a refused connection (the server has gone);
* ``lost``: anything else -- accepted, then cut, aborted (``finish_reason="abort"``) or failed.

``--sigterm ARM`` sends SIGTERM to that arm's server half-way through its last concurrency level
(after half of its requests were sent): the run then shows that every request sent before it ends
``ok`` and those after it ``refused`` (none ``lost``), and checks the stop itself: exit code 0 within
the grace period and no traceback in the server's log. Every server is stopped with SIGTERM and the
same checks.

``--server-per-level`` starts one server per (arm, C) with ``--max-num-seqs C`` (a batch controller
decides at most its B requests; the batch-4/8/16 measurements). ``--repeats R`` repeats the arms,
interleaved. Results: ``DIR/load_test.json`` (every request) and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HOST = "127.0.0.1"  # loopback only
DEFAULT_PROMPTS = [
    "def fibonacci(n):\n    return",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(10):\n        print(",
    "# Copyright 2001 Python Software Foundation\n",
    "def test_parse(self):\n    self.assertEqual(",
    "Once upon a time",
    "The quick brown fox",
]
TRACEBACK = "Traceback (most recent call last)"


# ---------------------------------------------------------------------------- the server
def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Stopped:
    """How a server stopped: exit code, seconds from SIGTERM to exit, tracebacks in its log."""

    rc: int | None
    seconds: float
    tracebacks: int
    log: str


class Server:
    """One ``specenv serve`` (or stock vLLM) process on loopback, its log in a file; started in a new session.

    Args:
        argv: The command (from :func:`serve_command` / :func:`plain_command`); ``--port`` is appended.
        log: Log file.
        env: Environment (default this process's, less ``VLLM_ENABLE_V1_MULTIPROCESSING``).
    """

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.log = Path(log)
        base = dict(os.environ if env is None else env)
        base.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core in its own process, as deployed
        base.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(
                [*argv, "--host", HOST, "--port", str(self.port)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=base,
                start_new_session=True,
            )
        self.t_term: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    def wait_ready(self, timeout: float = 900.0) -> None:
        """Until ``/health`` answers 200; raises with the log's tail if the process exits or time runs out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log.read_text()[-6000:]}")

    def sigterm(self) -> None:
        """Send SIGTERM to the server (the API server process: it drains, then stops its engine)."""
        if self.t_term is None and self.proc.poll() is None:
            self.t_term = time.monotonic()
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 120.0) -> Stopped:
        """SIGTERM (unless sent), wait for the exit; SIGKILL the process group if it outlives ``timeout``."""
        self.sigterm()
        try:
            rc: int | None = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            self.kill()
        secs = time.monotonic() - (self.t_term or time.monotonic())
        text = self.log.read_text(errors="replace")
        return Stopped(rc, secs, text.count(TRACEBACK), str(self.log))

    def kill(self) -> None:
        """SIGKILL the whole process group (API server, engine core, worker) if anything of it is left."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)


def serve_command(policy: str, models: str, max_num_seqs: int, extra: list[str], record: Path | None) -> list[str]:
    """``specenv serve`` for one arm (``--policy``), greedy-reproducible vLLM arguments after ``--``."""
    cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'specenv'; from specenv.cli import main; main()"]
    cmd += ["serve", "--models", models, "--policy", policy]
    if record is not None:
        cmd += ["--record", str(record)]
    return [*cmd, "--", *_engine_args(max_num_seqs), *extra]


def plain_command(models: str, max_num_seqs: int, extra: list[str]) -> list[str]:
    """Stock vLLM's OpenAI server for the target of a model set: no speculation, no specenv (the reference)."""
    from specenv.engines.vllm import settings as vs
    from specenv.engines.vllm.models import vllm_model_dirs

    dirs = vllm_model_dirs(models)
    args = ["--model", str(dirs.target), "--served-model-name", dirs.name, *_engine_args(max_num_seqs), *extra]
    return vs.launch_command(args, vs.vllm_distribution())


def _engine_args(max_num_seqs: int) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-num-seqs", str(max_num_seqs)]


# ---------------------------------------------------------------------------- the client
@dataclass
class Request:
    """One request of a level: its prompt, API and what came back."""

    index: int
    prompt: int
    api: str  # "completions" or "chat"
    sent_at: float = 0.0
    outcome: str = "not sent"
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    error: str | None = None
    after_sigterm: bool = False
    first_token_at: float | None = None  # time.monotonic() of the first streamed text


def model_name(base_url: str) -> str:
    """The served model's name (the first of ``/v1/models``)."""
    with urllib.request.urlopen(base_url + "/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def send(client: Any, model: str, prompts: list[str], req: Request, max_tokens: int) -> None:
    """Send one streamed greedy request with the OpenAI client; fill ``req`` (never raises)."""
    import openai

    t0 = time.perf_counter()
    req.sent_at = time.monotonic()
    stamps: list[float] = []
    parts: list[str] = []
    common = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    try:
        if req.api == "chat":
            stream = client.chat.completions.create(
                messages=[{"role": "user", "content": prompts[req.prompt]}], **common
            )
        else:
            stream = client.completions.create(prompt=prompts[req.prompt], **common)
        for chunk in stream:
            if chunk.usage is not None:
                req.tokens = int(chunk.usage.completion_tokens)
            for ch in chunk.choices:
                piece = ch.delta.content if req.api == "chat" else ch.text
                if piece:
                    if not parts:
                        req.first_token_at = time.monotonic()
                    parts.append(piece)
                    stamps.append(time.perf_counter())
                if ch.finish_reason is not None:
                    req.finish_reason = ch.finish_reason
    except openai.APIStatusError as exc:
        req.outcome = "refused" if exc.status_code == 503 and not parts else "lost"
        req.error = f"HTTP {exc.status_code}: {exc}"
        return
    except openai.APIConnectionError as exc:
        # refused before anything was accepted (the server has gone), or cut once streaming
        req.outcome = "lost" if parts else "refused"
        req.error = f"{type(exc).__name__}: {exc.__cause__ or exc}"
        return
    except Exception as exc:  # the load test reports every failure as an outcome
        req.outcome, req.error = "lost", f"{type(exc).__name__}: {exc}"
        return
    req.text = "".join(parts)
    if stamps:
        req.ttft_s = stamps[0] - t0
        if req.tokens > 1:
            req.tpot_s = (stamps[-1] - stamps[0]) / (req.tokens - 1)
    req.outcome = "finished" if req.finish_reason in ("length", "stop") else "lost"


def run_level(
    base_url: str,
    prompts: list[str],
    n_requests: int,
    concurrency: int,
    max_tokens: int,
    time_limit: float,
    on_half: Any = None,
) -> tuple[list[Request], float]:
    """``n_requests`` (completions and chat alternating over the prompts) from ``concurrency`` threads.

    No request is sent after ``time_limit`` seconds; ``on_half`` (if given) is called once, from the
    thread that sends request ``n_requests // 2``, just before it sends.

    Returns:
        The requests and the wall time of the level.
    """
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=600.0)
    model = model_name(base_url)
    reqs = [Request(i, i % len(prompts), "chat" if i % 2 else "completions") for i in range(n_requests)]
    lock, nxt = threading.Lock(), [0]
    t0 = time.monotonic()
    halted = threading.Event()

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n_requests or time.monotonic() - t0 > time_limit:
                return
            if on_half is not None and i == n_requests // 2:
                on_half()
                halted.set()
            reqs[i].after_sigterm = halted.is_set()
            send(client, model, prompts, reqs[i], max_tokens)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return reqs, time.monotonic() - t0


def judge(reqs: list[Request], reference: dict[tuple[int, str], str]) -> None:
    """Turn ``finished`` into ``ok``/``mismatch`` against the plain-greedy reference text."""
    for r in reqs:
        if r.outcome == "finished":
            r.outcome = "ok" if r.text == reference[(r.prompt, r.api)] else "mismatch"


def summary(reqs: list[Request], wall_s: float) -> dict[str, Any]:
    """Outcome counts, output tokens/s, TTFT and time-per-output-token p50/p99 of one level."""
    done = [r for r in reqs if r.outcome in ("ok", "mismatch")]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(xs, q) * 1e3) if xs else None

    counts = {k: sum(r.outcome == k for r in reqs) for k in ("ok", "mismatch", "refused", "lost", "not sent")}
    return {
        **counts,
        "tok_per_s": sum(r.tokens for r in done) / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50),
        "tpot_ms_p99": pct(tpot, 99),
    }


# ---------------------------------------------------------------------------- the run
@dataclass
class Level:
    """One (repeat, arm, concurrency) of the run."""

    repeat: int
    arm: str
    concurrency: int
    summary: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)
    stopped: dict[str, Any] | None = None


def reference(args: argparse.Namespace, prompts: list[str], out: Path) -> dict[tuple[int, str], str]:
    """Plain greedy (stock vLLM, no speculation): every prompt through both APIs, one at a time."""
    srv = Server(plain_command(args.models, 1, args.vllm_args), out / "plain-reference.log")
    try:
        srv.wait_ready()
        n = 2 * len(prompts)
        reqs, _ = run_level(srv.base_url, prompts, n, 1, args.max_tokens, time_limit=float("inf"))
    finally:
        stopped = srv.stop()
    bad = [r for r in reqs if r.outcome != "finished"]
    if bad:
        raise RuntimeError(f"plain reference: request {bad[0].index} {bad[0].outcome} ({bad[0].error})")
    print(f"plain reference: {n} requests; stop rc={stopped.rc} in {stopped.seconds:.1f} s", file=sys.stderr)
    return {(r.prompt, r.api): r.text for r in reqs}


def run_arm(
    args: argparse.Namespace, prompts: list[str], ref: dict[tuple[int, str], str], arm: str, rep: int, out: Path
) -> list[Level]:
    """Serve one arm (one server, or one per level) and run its concurrency levels."""
    levels: list[Level] = []
    groups = [[c] for c in args.concurrency] if args.server_per_level else [list(args.concurrency)]
    for group in groups:
        seqs = max(group)
        tag = f"{arm.replace('/', '_').replace(':', '_')}-r{rep}-b{seqs}"
        rec = out / f"rec-{tag}" if args.record else None
        if arm == "plain":
            cmd = plain_command(args.models, seqs, args.vllm_args)
        else:
            cmd = serve_command(arm, args.models, seqs, args.vllm_args, rec)
        srv = Server(cmd, out / f"{tag}.log")
        stopped: Stopped | None = None
        try:
            srv.wait_ready()
            for c in group:
                last = c == group[-1] and args.sigterm == arm and rep == 0
                reqs, wall = run_level(
                    srv.base_url,
                    prompts,
                    args.requests,
                    c,
                    args.max_tokens,
                    args.time_limit,
                    on_half=srv.sigterm if last else None,
                )
                judge(reqs, ref)
                lv = Level(rep, arm, c, summary(reqs, wall), [asdict(r) for r in reqs])
                levels.append(lv)
                _print_row(lv)
        finally:
            stopped = srv.stop(timeout=args.grace + 60)
        levels[-1].stopped = asdict(stopped)
        print(
            f"  {tag}: stop rc={stopped.rc} in {stopped.seconds:.1f} s, tracebacks in the log: {stopped.tracebacks}",
            file=sys.stderr,
        )
    return levels


def _print_row(lv: Level) -> None:
    s = lv.summary

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(
        f"| {lv.arm} | {lv.concurrency} | {lv.repeat} | {s['tok_per_s']:.1f} | {f(s['ttft_ms_p50'])} / "
        f"{f(s['ttft_ms_p99'])} | {f(s['tpot_ms_p50'])} / {f(s['tpot_ms_p99'])} | {s['ok']} | {s['mismatch']} | "
        f"{s['refused']} | {s['lost']} | {s['not sent']} |",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small-moe-v1", help="model set of specenv serve --models")
    p.add_argument("--arms", default="none,ucb", help="comma-separated --policy values; 'plain' = stock vLLM")
    p.add_argument("--concurrency", default="1,4,16", help="client threads per level, comma-separated")
    p.add_argument("--requests", type=int, default=32, help="requests per level (fixed count)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per level: nothing is sent after")
    p.add_argument("--repeats", type=int, default=1, help="repeats of every arm, interleaved")
    p.add_argument("--sigterm", default=None, help="arm whose server gets SIGTERM half-way through its last level")
    p.add_argument("--server-per-level", action="store_true", help="one server per level, --max-num-seqs = C")
    p.add_argument("--record", action="store_true", help="record every specenv arm (--record DIR/rec-...)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds a stop may take (vLLM --shutdown-timeout)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("vllm_args", nargs="*", help="more vLLM arguments (after --)")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    arms = [a for a in args.arms.split(",") if a]
    if args.sigterm is not None and args.sigterm not in arms:
        p.error(f"--sigterm {args.sigterm}: not one of --arms {arms}")
    if args.requests < 1 or min(args.concurrency) < 1:
        p.error("--requests and --concurrency must be >= 1")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    prompts = DEFAULT_PROMPTS
    ref = reference(args, prompts, out)
    print(
        "| arm | C | repeat | tokens/s | TTFT ms p50 / p99 | TPOT ms p50 / p99 | ok | mismatch | refused | lost "
        "| not sent |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    levels: list[Level] = []
    for rep in range(args.repeats):
        for arm in arms:
            levels += run_arm(args, prompts, ref, arm, rep, out)
    bad_stops = [lv.stopped for lv in levels if lv.stopped and (lv.stopped["rc"] != 0 or lv.stopped["tracebacks"])]
    lost = sum(lv.summary["lost"] for lv in levels)
    mismatched = sum(lv.summary["mismatch"] for lv in levels)
    res = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load_avg": os.getloadavg(),
        "levels": [asdict(lv) for lv in levels],
        "lost": lost,
        "mismatch": mismatched,
        "unclean_stops": bad_stops,
    }
    (out / "load_test.json").write_text(json.dumps(res, indent=1))
    print(f"lost: {lost}, mismatch: {mismatched}, unclean stops: {len(bad_stops)}; load {os.getloadavg()}")
    return 0 if lost == mismatched == len(bad_stops) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
