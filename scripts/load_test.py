"""A real client's view of ``specenv serve``: a bounded load test with the OpenAI Python client, on loopback.

Run in the ``vllm`` environment (the ``openai`` client comes with vLLM)::

    python scripts/load_test.py --models small-moe-v1 --arms plain,stock:2,policies/shipped/live-vllm-v1/ppo \\
        --concurrency 1,4,16 --requests 32 --max-tokens 64 --time-limit 120 --out DIR [--sigterm ARM]

Arms, each served by its own server, one after another (one engine at a time), on 127.0.0.1 only:

* ``plain``: stock vLLM's OpenAI server without speculation (no specenv code);
* ``stock:K``: stock vLLM with the model set's draft model, ``num_speculative_tokens = K`` (no specenv);
* anything else: ``specenv serve --models M --policy ARM`` (a policy folder, a registered name such as
  ``ucb``, or ``none``: specenv's path at its fixed ``num_speculative_tokens``, record only), optionally
  followed by more ``specenv serve`` options (``"fixed-k:k=2 --kmax 2 --draft-horizon policy"``).

Every server gets the same vLLM arguments (fp32, eager, seed 0, ``--no-async-scheduling`` -- what the
controller runs with, so the comparison is the scheduler, as in ``specenv abtest``) and the same
environment (:func:`specenv.engines.vllm.settings.serve_env`: the KV-cache size and unpinned threads
that ``specenv serve`` sets on CPU). Prompts: the first ``--prompts`` prompts of a shipped prompt set
(``stdlib-code-v1``) that are not in the train split of ``--held-out-of`` (``live-vllm``: the set the
shipped live-vllm-v1 policies were trained on).

Before the arms, a ``plain`` server answers every prompt once through both APIs, one request at a time:
the greedy reference. Then, per arm and per concurrency C: a fixed number of requests (``--requests``;
completions and chat completions alternating, streamed, greedy, ``ignore_eos``) from C client threads,
none sent after the time limit. Each response is checked identical to the reference. Reported per
(arm, C): output tokens/s over the wall time of the level, time to first token, time per output token
(the mean gap between the streamed tokens after the first) and end-to-end latency at p50/p99, and each
request's outcome:

* ``ok``: finished, the text equals plain greedy's;
* ``mismatch``: finished, another text;
* ``refused``: a clean error, once the server had been sent SIGTERM, before the request was accepted:
  HTTP 503 (the drain gate of :mod:`specenv.engines.vllm.drain`) or a refused connection (the
  server has gone); the same error without a SIGTERM counts as ``lost``;
* ``lost``: anything else -- accepted, then cut, aborted (``finish_reason="abort"``) or failed;
* ``not sent``: the level's time limit came first.

``--sigterm ARM`` adds one level to that arm's server after its measured levels (at the largest
concurrency, tagged ``sigterm``): SIGTERM reaches the server once half of the level's requests were sent,
with up to C of them in flight. Every request sent before it must end ``ok``, later ones ``refused``
(none ``lost``), and the stop itself is checked: exit code 0 within the grace period, no traceback and
no ``EngineDeadError`` in the server's log. Every server is stopped with SIGTERM and the same checks,
required of the ``specenv serve`` arms only (stock vLLM's own stop is reported: it logs an
``EngineDeadError``, vLLM issue 48745, which the drain gate avoids).

``--server-per-level`` starts one server per (arm, C) with ``--max-num-seqs C`` (a batch controller
decides at most its B requests; the batch-4/8/16 measurements). ``--repeats R`` repeats the arms,
interleaved. Results: ``DIR/load_test.json`` (every request), ``DIR/load_test.md`` (the table, also
printed) and every server's log. Exit code 0 iff nothing was lost or mismatched and every stop was clean.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
TRACEBACK = "Traceback (most recent call last)"
UNCLEAN = (TRACEBACK, "EngineDeadError")  # a clean stop logs neither


# ---------------------------------------------------------------------------- the server
def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Stopped:
    """How a server stopped: exit code, seconds from SIGTERM to exit, tracebacks and EngineDeadErrors in its log."""

    rc: int | None
    seconds: float
    tracebacks: int
    engine_dead: int
    log: str

    @property
    def clean(self) -> bool:
        """Exit code 0, no traceback, no ``EngineDeadError``."""
        return self.rc == 0 and self.tracebacks == 0 and self.engine_dead == 0


class Server:
    """One ``specenv serve`` (or stock vLLM) process on loopback, its log in a file; started in a new session.

    Args:
        argv: The command (from :func:`serve_command` / :func:`stock_command`); ``--port`` is appended.
        log: Log file.
        env: Environment (default this process's, less ``VLLM_ENABLE_V1_MULTIPROCESSING``).
        extra_env: Variables set on top of ``env`` (e.g. :func:`stock_env`).
    """

    def __init__(
        self, argv: list[str], log: Path, env: dict[str, str] | None = None, extra_env: dict[str, str] | None = None
    ):
        self.port = free_port()
        self.log = Path(log)
        base = {**(os.environ if env is None else env), **(extra_env or {})}
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
        return Stopped(rc, secs, text.count(TRACEBACK), text.count("EngineDeadError"), str(self.log))

    def kill(self) -> None:
        """SIGKILL the whole process group (API server, engine core, worker) if anything of it is left."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)


def serve_command(policy: str, models: str, max_num_seqs: int, extra: list[str], record: Path | None) -> list[str]:
    """``specenv serve`` for one arm, greedy-reproducible vLLM arguments after ``--``.

    The arm is the ``--policy`` value, optionally followed by more ``specenv serve`` options, split as a shell
    would (``"fixed-k:k=2 --kmax 2 --draft-horizon policy"``).
    """
    policy, *opts = shlex.split(policy)
    cmd = [sys.executable, "-c", "import sys; sys.argv[0] = 'specenv'; from specenv.cli import main; main()"]
    cmd += ["serve", "--models", models, "--policy", policy, *opts]
    if record is not None:
        cmd += ["--record", str(record)]
    return [*cmd, "--", *_engine_args(max_num_seqs), *extra]


def stock_command(models: str, k: int, max_num_seqs: int, extra: list[str]) -> list[str]:
    """Stock vLLM's OpenAI server for a model set, no specenv: without speculation (``k = 0``, plain
    decoding) or with the set's draft model at ``num_speculative_tokens = k``."""
    from specenv.engines.vllm import settings as vs
    from specenv.engines.vllm.models import vllm_model_dirs

    dirs = vllm_model_dirs(models)
    args = vs.model_args(str(dirs.target), str(dirs.draft), max(k, 1), [], dirs.name)
    if k == 0:
        args = args[: args.index("--speculative-config")]
    args += [*_engine_args(max_num_seqs), "--no-async-scheduling", *extra]
    if not vs.has_flag(args, "--shutdown-timeout"):
        args += ["--shutdown-timeout", str(vs.SHUTDOWN_TIMEOUT_S)]  # the same grace period as specenv serve's
    return vs.launch_command(args, vs.vllm_distribution())


def stock_env(argv: list[str]) -> dict[str, str]:
    """The environment ``specenv serve`` would set for these vLLM arguments (KV cache, unpinned threads on CPU)."""
    from specenv.engines.vllm import settings as vs

    return vs.serve_env(os.environ, argv, on_cpu=vs.vllm_on_cpu(vs.vllm_distribution()))


def is_stock(arm: str) -> bool:
    """Whether an arm is stock vLLM (``plain``, ``stock:K``): no specenv code, vLLM's own stop."""
    return arm == "plain" or arm.startswith("stock:")


def arm_server(arm: str, models: str, max_num_seqs: int, extra: list[str], record: Path | None, log: Path) -> Server:
    """The server of one arm: ``plain``, ``stock:K`` (stock vLLM) or a ``specenv serve --policy``."""
    if is_stock(arm):
        k = 0 if arm == "plain" else int(arm.split(":", 1)[1])
        cmd = stock_command(models, k, max_num_seqs, extra)
        return Server(cmd, log, extra_env=stock_env(cmd))
    return Server(serve_command(arm, models, max_num_seqs, extra, record), log)


def _engine_args(max_num_seqs: int) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-num-seqs", str(max_num_seqs)]


def load_prompt_texts(prompt_set: str, n: int, held_out_of: str | None) -> tuple[list[int], list[str]]:
    """The first ``n`` prompts of a shipped prompt set (or JSON file) not in a trace set's train split.

    Returns:
        Their ids and texts.
    """
    from specenv.engines.hf.models import load_prompts

    train: set[int] = set()
    if held_out_of:
        from specenv.traces.datasets import load_dataset
        from specenv.traces.splits import split_ids

        ids = load_dataset(held_out_of).positions["generation_id"].unique()
        train = {int(g) for g in split_ids(ids, "train")}
    picked = [p for p in load_prompts(prompt_set) if p.id not in train][:n]
    if len(picked) < n:
        raise ValueError(
            f"--prompts {n}: prompt set {prompt_set!r} has only {len(picked)} prompts outside the train split"
        )
    return [p.id for p in picked], [p.text for p in picked]


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
    e2e_s: float | None = None
    error: str | None = None
    after_sigterm: bool = False  # sent once the server had been sent SIGTERM
    first_token_at: float | None = None  # time.monotonic() of the first streamed text
    done_at: float | None = None  # time.monotonic() when the answer (or the error) was complete


def model_name(base_url: str) -> str:
    """The served model's name (the first of ``/v1/models``)."""
    with urllib.request.urlopen(base_url + "/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def send(client: Any, model: str, prompts: list[str], req: Request, max_tokens: int) -> None:
    """Send one streamed greedy request with the OpenAI client; fill ``req`` (never raises)."""
    try:
        _send(client, model, prompts, req, max_tokens)
    finally:
        req.done_at = time.monotonic()


def _send(client: Any, model: str, prompts: list[str], req: Request, max_tokens: int) -> None:
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
    req.e2e_s = time.perf_counter() - t0
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
    accept_timeout: float = 300.0,
) -> tuple[list[Request], float]:
    """``n_requests`` (completions and chat alternating over the prompts) from ``concurrency`` threads.

    No request is sent after ``time_limit`` seconds. ``on_half`` (if given) is called once, by the thread
    that is to send request ``n_requests // 2``, once every request sent before it has been accepted and
    is streaming (its first token came) or has finished (at most ``accept_timeout`` seconds of waiting):
    the signal then reaches a server with up to ``concurrency`` requests in flight. No request after the
    half is sent before ``on_half`` returned.

    Returns:
        The requests and the wall time of the level.
    """
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=600.0)
    model = model_name(base_url)
    reqs = [Request(i, i % len(prompts), "chat" if i % 2 else "completions") for i in range(n_requests)]
    lock, nxt = threading.Lock(), [0]
    t0 = time.monotonic()
    half, halted = n_requests // 2, threading.Event()

    def accepted(r: Request) -> bool:
        return r.first_token_at is not None or r.done_at is not None

    def worker() -> None:
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= n_requests or time.monotonic() - t0 > time_limit:
                return
            if on_half is not None and i == half:
                t_wait = time.monotonic()
                while not all(accepted(r) for r in reqs[:half]) and time.monotonic() - t_wait < accept_timeout:
                    time.sleep(0.01)
                try:
                    on_half()
                finally:
                    halted.set()
            elif on_half is not None and i > half:
                halted.wait()
            send(client, model, prompts, reqs[i], max_tokens)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return reqs, time.monotonic() - t0


def judge(reqs: list[Request], reference: dict[tuple[int, str], str], t_term: float | None = None) -> None:
    """Turn ``finished`` into ``ok``/``mismatch`` against the plain-greedy reference text.

    A ``refused`` request counts as ``lost`` unless its answer came once the server had been sent
    SIGTERM (``t_term``, ``time.monotonic()``): a server that is not stopping must refuse nothing.
    """
    for r in reqs:
        r.after_sigterm = t_term is not None and r.outcome != "not sent" and r.sent_at >= t_term
        if r.outcome == "finished":
            r.outcome = "ok" if r.text == reference[(r.prompt, r.api)] else "mismatch"
        elif r.outcome == "refused" and (t_term is None or r.done_at is None or r.done_at < t_term):
            r.outcome, r.error = "lost", f"refused without a SIGTERM: {r.error}"


def summary(reqs: list[Request], wall_s: float) -> dict[str, Any]:
    """Outcome counts, output tokens/s, TTFT and time-per-output-token p50/p99 of one level."""
    done = [r for r in reqs if r.outcome in ("ok", "mismatch")]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]

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
        "e2e_ms_p50": pct(e2e, 50),
        "e2e_ms_p99": pct(e2e, 99),
    }


# ---------------------------------------------------------------------------- the run
@dataclass
class Level:
    """One (repeat, arm, concurrency) of the run; ``sigterm``: the level during which the server got SIGTERM."""

    repeat: int
    arm: str
    concurrency: int
    summary: dict[str, Any]
    requests: list[dict[str, Any]] = field(default_factory=list)
    stopped: dict[str, Any] | None = None
    sigterm: bool = False


def reference(args: argparse.Namespace, prompts: list[str], out: Path) -> dict[tuple[int, str], str]:
    """Plain greedy (stock vLLM, no speculation): every prompt through both APIs, one at a time."""
    srv = arm_server("plain", args.models, 1, args.vllm_args, None, out / "plain-reference.log")
    try:
        srv.wait_ready()
        n = 2 * len(prompts)
        reqs, _ = run_level(srv.base_url, prompts, n, 1, args.max_tokens, time_limit=float("inf"))
    finally:
        stopped = srv.stop()
    bad = [r for r in reqs if r.outcome != "finished" or r.tokens != args.max_tokens]
    if bad:
        raise RuntimeError(f"plain reference: request {bad[0].index} {bad[0].outcome} ({bad[0].error})")
    print(f"plain reference: {n} requests; stop rc={stopped.rc} in {stopped.seconds:.1f} s", file=sys.stderr)
    return {(r.prompt, r.api): r.text for r in reqs}


def run_arm(
    args: argparse.Namespace, prompts: list[str], ref: dict[tuple[int, str], str], arm: str, rep: int, out: Path
) -> list[Level]:
    """Serve one arm (one server, or one per level) and run its concurrency levels (and the SIGTERM level)."""
    levels: list[Level] = []
    groups = [[c] for c in args.concurrency] if args.server_per_level else [list(args.concurrency)]
    for gi, group in enumerate(groups):
        seqs = max(group)
        tag = f"{arm.replace('/', '_').replace(':', '_')}-r{rep}-b{seqs}"
        rec = out / f"rec-{tag}" if args.record else None
        srv = arm_server(arm, args.models, seqs, args.vllm_args, rec, out / f"{tag}.log")
        plan = [(c, False) for c in group]
        if args.sigterm == arm and rep == 0 and gi == len(groups) - 1:
            plan.append((max(group), True))  # one more level, SIGTERM half-way through it
        try:
            srv.wait_ready()
            for c, term in plan:
                reqs, wall = run_level(
                    srv.base_url,
                    prompts,
                    args.requests,
                    c,
                    args.max_tokens,
                    args.time_limit,
                    on_half=srv.sigterm if term else None,
                )
                judge(reqs, ref, srv.t_term)
                lv = Level(rep, arm, c, summary(reqs, wall), [asdict(r) for r in reqs], sigterm=term)
                levels.append(lv)
                print(_row(lv), flush=True)
        finally:
            stopped = srv.stop(timeout=args.grace + 60)
        levels[-1].stopped = asdict(stopped)
        print(
            f"  {tag}: stop rc={stopped.rc} in {stopped.seconds:.1f} s, tracebacks in the log: {stopped.tracebacks}, "
            f"EngineDeadError: {stopped.engine_dead}",
            file=sys.stderr,
        )
    return levels


HEADER = (
    "| arm | C | repeat | tokens/s | TTFT ms p50 / p99 | TPOT ms p50 / p99 | end-to-end ms p50 / p99 | ok | mismatch "
    "| refused | lost | not sent |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(lv: Level) -> str:
    s = lv.summary

    def f(a: str, b: str) -> str:
        return " / ".join("-" if s[k] is None else f"{s[k]:.1f}" for k in (a, b))

    arm = f"{lv.arm} (SIGTERM)" if lv.sigterm else lv.arm
    return (
        f"| {arm} | {lv.concurrency} | {lv.repeat} | {s['tok_per_s']:.1f} | {f('ttft_ms_p50', 'ttft_ms_p99')} | "
        f"{f('tpot_ms_p50', 'tpot_ms_p99')} | {f('e2e_ms_p50', 'e2e_ms_p99')} | {s['ok']} | {s['mismatch']} | "
        f"{s['refused']} | {s['lost']} | {s['not sent']} |"
    )


def _stop_line(lv: Level) -> str:
    st = lv.stopped or {}
    return (
        f"| {lv.arm} | {'SIGTERM under load' if lv.sigterm else 'SIGTERM, idle'} | {st.get('rc')} | "
        f"{st.get('seconds', 0):.1f} | {st.get('tracebacks')} | {st.get('engine_dead')} |"
    )


def markdown(res: dict[str, Any], levels: list[Level]) -> str:
    """The results as Markdown: the per-level table, the stops, the totals."""
    a = res["args"]
    lines = [
        f"# load test: {a['models']}, {a['requests']} requests x {a['max_tokens']} tokens per level, prompts "
        f"{res['prompt_ids']} of {a['prompt_set']}, time limit {a['time_limit']:g} s per level",
        "",
        HEADER,
        *(_row(lv) for lv in levels),
        "",
        "| arm | stop | exit code | seconds | tracebacks | EngineDeadError |",
        "|---|---|---|---|---|---|",
        *(_stop_line(lv) for lv in levels if lv.stopped is not None),
        "",
        "(stock arms, plain and stock:K: vLLM's own stop, listed for comparison; only specenv serve's stop is "
        "required clean)",
        "",
        f"lost: {res['lost']}, mismatch: {res['mismatch']}, unclean specenv stops: {len(res['unclean_stops'])}; "
        "load average "
        f"at the start {res['load_avg_start']}, at the end {res['load_avg']}; {res['wall_s']:.0f} s in all",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small-moe-v1", help="model set of specenv serve --models")
    p.add_argument(
        "--arms",
        default="plain,none,ucb",
        help="comma-separated: plain, stock:K, or --policy values of specenv serve (each optionally followed by more "
        "specenv serve options: 'fixed-k:k=2 --kmax 2 --draft-horizon policy')",
    )
    p.add_argument("--concurrency", default="1,4,16", help="client threads per level, comma-separated")
    p.add_argument("--requests", type=int, default=32, help="requests per level (fixed count)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per level: nothing is sent after")
    p.add_argument("--prompt-set", default="stdlib-code-v1", help="shipped prompt set or JSON file")
    p.add_argument("--prompts", type=int, default=8, help="number of prompts (the requests cycle through them)")
    p.add_argument("--held-out-of", default="live-vllm", help="trace set whose train prompts are skipped ('' for none)")
    p.add_argument("--repeats", type=int, default=1, help="repeats of every arm, interleaved")
    p.add_argument("--sigterm", default=None, help="arm whose server gets SIGTERM in one more level, at half of it")
    p.add_argument("--server-per-level", action="store_true", help="one server per level, --max-num-seqs = C")
    p.add_argument("--record", action="store_true", help="record every specenv arm (--record DIR/rec-...)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds a stop may take (vLLM --shutdown-timeout)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("vllm_args", nargs="*", help="more vLLM arguments (after --)")
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r}: expected comma-separated integers")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a.startswith("stock:") and not a[6:].isdigit():
            p.error(f"--arms: {a!r}: stock:K needs an integer K >= 0")
        try:
            words = shlex.split(a)
        except ValueError as exc:
            p.error(f"--arms: {a!r}: {exc}")
        if not is_stock(a) and (not words or words[0].startswith("-")):
            p.error(f"--arms: {a!r}: a specenv arm starts with its --policy value")
    if args.sigterm is not None and args.sigterm not in arms:
        p.error(f"--sigterm {args.sigterm}: not one of --arms {arms}")
    if args.requests < 1 or min(args.concurrency) < 1 or args.prompts < 1:
        p.error("--requests, --concurrency and --prompts must be >= 1")
    try:
        ids, prompts = load_prompt_texts(args.prompt_set, args.prompts, args.held_out_of or None)
    except ValueError as exc:
        p.error(str(exc))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.monotonic(), os.getloadavg()
    ref = reference(args, prompts, out)
    print(HEADER, flush=True)
    levels: list[Level] = []
    for rep in range(args.repeats):
        for arm in arms:
            levels += run_arm(args, prompts, ref, arm, rep, out)
    # the clean stop is specenv serve's (its drain gate); stock vLLM's own stop is reported, not required
    bad_stops = [lv.stopped for lv in levels if lv.stopped and not is_stock(lv.arm) and not Stopped(**lv.stopped).clean]
    lost = sum(lv.summary["lost"] for lv in levels)
    mismatched = sum(lv.summary["mismatch"] for lv in levels)
    res = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "prompt_ids": ids,
        "load_avg_start": load0,
        "load_avg": os.getloadavg(),
        "wall_s": time.monotonic() - t0,
        "levels": [asdict(lv) for lv in levels],
        "lost": lost,
        "mismatch": mismatched,
        "unclean_stops": bad_stops,
    }
    (out / "load_test.json").write_text(json.dumps(res, indent=1))
    md = markdown(res, levels)
    (out / "load_test.md").write_text(md)
    print(md.split("\n\n", 2)[-1], end="")
    return 0 if lost == mismatched == len(bad_stops) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
