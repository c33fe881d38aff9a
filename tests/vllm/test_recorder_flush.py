"""The recorder loses no finished round: idle flush, close, signals, dead temporaries, and `specenv serve` on SIGTERM.

The unit tests need no vLLM (they run in both environments); the serve test starts one vLLM server
(``.venv-vllm``, marked slow).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from specenv.engines.recorder import (
    PARTS,
    RUN_MANIFEST,
    PartRecorder,
    chain_flush_on_signals,
    load_recording,
    recording_status,
)
from specenv.engines.vllm.settings import DRAIN_MIDDLEWARE, SHUTDOWN_TIMEOUT_S, SpecenvSettings, shutdown_args
from specenv.traces.schema import ModelFacts
from tests.rows import recorder_row

FACTS = ModelFacts(n_layers=2, n_experts=16, top_k=2)
ROOT = Path(__file__).resolve().parents[2]


def _has_vllm() -> bool:
    try:
        return importlib.util.find_spec("vllm.v1.core.sched.scheduler") is not None
    except ImportError:  # no vLLM (or only this test folder, seen as a namespace package)
        return False


row = recorder_row


def wait_rows(folder: Path, n: int, timeout: float) -> float:
    """Seconds until ``n`` rows are on disk in complete parts (fails after ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if recording_status(folder)["rows"] >= n:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"{recording_status(folder)['rows']} of {n} rows on disk after {timeout} s")


def test_idle_rows_are_written_without_further_calls(tmp_path):
    rec = PartRecorder(tmp_path, FACTS, kmax=4, meta={}, source="vllm", part_rounds=1000, part_seconds=0.4)
    try:
        t0 = time.monotonic()
        for i in range(5):
            rec.add(row(0, i))
        # no flush, no maybe_flush, no further add: the writer writes the rows once they are 0.4 s old
        waited = wait_rows(tmp_path, 5, timeout=5.0)
        assert time.monotonic() - t0 >= 0.4 - 1e-3 and waited < 5.0
        st = recording_status(tmp_path)
        assert st["parts"] == ["part-000000"] and st["rows"] == 5 and st["incomplete"] == []
        for i in range(5, 8):  # a second burst, then idle again: a second part
            rec.add(row(0, i))
        wait_rows(tmp_path, 8, timeout=5.0)
        assert recording_status(tmp_path)["parts"] == ["part-000000", "part-000001"]
        assert rec.rows_buffered == 0
    finally:
        rec.close()
    man = json.loads((tmp_path / RUN_MANIFEST).read_text())
    assert man["summary"]["rows"] == 8 and man["summary"]["parts"] == 2 and "closed_at" in man
    assert list(load_recording(tmp_path).rounds["round"]) == list(range(8))


def test_close_writes_everything_buffered(tmp_path):
    rec = PartRecorder(tmp_path, FACTS, kmax=4, meta={}, source="vllm", part_rounds=1000, part_seconds=3600)
    for i in range(7):
        rec.add(row(1, i))
    assert recording_status(tmp_path)["rows"] == 0  # nothing is old enough yet
    rec.close(summary={"note": "closed"})
    st = recording_status(tmp_path)
    assert st["parts"] == ["part-000000"] and st["rows"] == 7 and st["incomplete"] == []
    man = json.loads((tmp_path / RUN_MANIFEST).read_text())
    assert man["summary"]["rows"] == 7 and man["summary"]["note"] == "closed"
    rec.close()  # idempotent
    assert recording_status(tmp_path)["rows"] == 7


def test_concurrent_adds_while_the_writer_flushes_lose_and_mix_nothing(tmp_path):
    rec = PartRecorder(tmp_path, FACTS, kmax=4, meta={}, source="vllm", part_rounds=97, part_seconds=0.005)
    n, gens = 1500, 3

    def produce(gid: int) -> None:
        for i in range(n):
            rec.add(row(gid, i))
            if i % 50 == 0:
                rec.maybe_flush()

    threads = [threading.Thread(target=produce, args=(g,)) for g in range(gens)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()
    st = recording_status(tmp_path)
    assert st["rows"] == n * gens and st["invalid"] == st["rejected"] == st["incomplete"] == []
    assert rec.errors == [] and len(st["parts"]) >= 3
    # parts are numbered without gaps, and every row is whole (columns never shifted against each other)
    assert st["parts"] == [f"part-{i:06d}" for i in range(len(st["parts"]))]
    df = load_recording(tmp_path).rounds
    for gid in range(gens):
        g = df[df["generation_id"] == gid]
        assert sorted(g["round"]) == list(range(n))
        assert (g["L"] == 20 + g["round"]).all() and (g["request_id"] == f"r{gid}").all()
        assert list(g["round"]) == list(range(n))  # one producer per generation: its order is kept


def test_signal_asks_the_writer_for_a_part_then_runs_the_previous_handler(tmp_path):
    rec = PartRecorder(tmp_path, FACTS, kmax=4, meta={}, source="vllm", part_seconds=3600)
    seen: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        assert chain_flush_on_signals(lambda: rec, signals=(signal.SIGUSR1,)) == [signal.SIGUSR1]
        for i in range(4):
            rec.add(row(2, i))
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_rows(tmp_path, 4, timeout=3.0)  # long before part_seconds
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old)
        rec.close()
    # the default action is never replaced (nothing to chain to)
    old = signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    try:
        assert chain_flush_on_signals(lambda: None, signals=(signal.SIGUSR2,)) == []
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_recorder_start_removes_temporaries_of_dead_writers_only(tmp_path):
    parts = tmp_path / PARTS
    parts.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = parts / f".part-000003.parquet.{dead_pid}.0a1b2c3d.tmp"
    mine = parts / f".part-000004.parquet.{os.getpid()}.0a1b2c3d.tmp"  # a writer still running
    unnamed = parts / ".part-000005.parquet.tmp"  # no process id: not ours to judge
    for p in (stale, mine, unnamed):
        p.write_bytes(b"PAR1 half a file")
    rec = PartRecorder(tmp_path, FACTS, kmax=4, meta={}, source="vllm")
    rec.close()
    assert rec.removed_temporaries == [stale.name]
    assert not stale.exists() and mine.exists() and unnamed.exists()


def test_interpreter_exit_closes_an_open_recorder(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from test_recorder_flush import FACTS, row
        from specenv.engines.recorder import PartRecorder
        rec = PartRecorder({str(tmp_path)!r}, FACTS, kmax=4, meta={{}}, source="hf", part_seconds=3600)
        for i in range(6):
            rec.add(row(3, i))
        # no close(): the interpreter exits
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    st = recording_status(tmp_path)
    assert st["rows"] == 6 and st["incomplete"] == []
    man = json.loads((tmp_path / RUN_MANIFEST).read_text())
    assert man["summary"]["closed_by"] == "atexit" and man["summary"]["rows"] == 6


def test_serve_gives_the_engine_time_to_drain_and_close_the_recording(tmp_path):
    gate = ["--middleware", DRAIN_MIDDLEWARE]
    assert shutdown_args(["MODEL"]) == [*gate, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    assert shutdown_args(["MODEL", "--shutdown-timeout", "60"]) == gate
    assert shutdown_args(["MODEL", "--shutdown-timeout=0"]) == gate
    from specenv.cli import app

    args = ["serve", "--policy", "none", "--print-command"]
    res = CliRunner().invoke(app, [*args, "--record", str(tmp_path / "rec"), "--", "M"])
    assert res.exit_code == 0, res.output
    assert f"--shutdown-timeout {SHUTDOWN_TIMEOUT_S}" in res.output and f"--middleware {DRAIN_MIDDLEWARE}" in res.output
    res = CliRunner().invoke(app, [*args, "--", "M"])  # a drain without a recording too
    assert res.exit_code == 0 and f"--shutdown-timeout {SHUTDOWN_TIMEOUT_S}" in res.output
    res = CliRunner().invoke(app, [*args, "--record", str(tmp_path / "rec"), "--", "M", "--shutdown-timeout", "3"])
    assert res.exit_code == 0 and res.output.count("--shutdown-timeout") == 1 and "--shutdown-timeout 3" in res.output


# ---------------------------------------------------------------------- live: specenv serve + SIGTERM
@pytest.mark.slow
@pytest.mark.skipif(not _has_vllm(), reason="needs vLLM (.venv-vllm)")
def test_serve_sigterm_after_idle_keeps_every_round(model_dirs, tmp_path):
    from test_serve import post
    from vhelpers import KMAX, PROMPTS

    from scripts.load_test import Server

    rec, log = tmp_path / "rec", tmp_path / "server.log"
    specenv_bin = Path(sys.executable).parent / "specenv"
    cmd = [
        str(specenv_bin),
        "serve",
        "--policy",
        "none",  # vLLM's fixed k: the recorder alone
        "--record",
        str(rec),
        "--",
        str(model_dirs.target),
        "--tokenizer",
        str(model_dirs.target),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(min(model_dirs.max_model_len, 1024)),
        "--max-num-seqs",
        "2",
        "--seed",
        "0",
        "--speculative-config",
        json.dumps({"method": "draft_model", "model": str(model_dirs.draft), "num_speculative_tokens": KMAX}),
    ]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # engine core spawned
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this checkout's specenv
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # vLLM's shutdown messages
    tokens = 16
    srv = Server(cmd, log, env=env)  # appends --host 127.0.0.1 --port, a session of its own
    proc, port = srv.proc, srv.port
    try:
        srv.wait_ready()
        body = {"model": str(model_dirs.target), "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        usage: list[int] = []

        def send(prompts: list[str]) -> None:
            threads = []
            for p in prompts:  # two at a time: the rounds of a batch
                t = threading.Thread(
                    target=lambda p=p: usage.append(post(port, {**body, "prompt": p})["usage"]["completion_tokens"])
                )
                t.start()
                threads.append(t)
            for t in threads:
                t.join()

        for _ in range(2):
            send(PROMPTS[:2])
        # idle: the rounds reach the disk without another step, well before SIGTERM
        wait_rows(rec, 1, timeout=10.0)
        time.sleep(SpecenvSettings().part_seconds + 1.0)
        idle = recording_status(rec)
        # then two more requests, and SIGTERM right after they finish (within part_seconds)
        send(PROMPTS[2:4])
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 60)
        t_exit = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text()
    assert rc == 0, text[-6000:]
    assert "mode=drain" in text, text[-6000:]  # this checkout's `specenv serve` set --shutdown-timeout
    assert "force killing" not in text, text[-6000:]  # the engine core exited on its own, recording closed
    assert usage == [tokens] * 6

    st = recording_status(rec)
    assert st["invalid"] == st["rejected"] == st["incomplete"] == [], st  # nothing half-written
    man = json.loads((rec / RUN_MANIFEST).read_text())
    assert "closed_at" in man and man["summary"]["rows"] == st["rows"] and man["summary"]["errors"] == []
    # closed as soon as the engine had no request left after the signal, before it tore down its workers
    assert man["summary"]["closed_by"] == "signal"
    for part in st["parts"]:
        idx = json.loads((rec / PARTS / f"{part}.json").read_text())
        assert pq.read_table(rec / PARTS / idx["path"]).num_rows == idx["rows"]
    df = load_recording(rec).rounds
    by_req = {rid: g.sort_values("round") for rid, g in df.groupby("request_id")}
    assert len(by_req) == 6 and df["generation_id"].nunique() == 6
    for rid, g in by_req.items():
        rounds, t, acc = list(g["round"]), list(g["t"]), list(g["accepted"])
        assert rounds == list(range(len(g))), rid  # every round of the request, none twice
        # the prefill gives token 1; each round commits accepted + 1 tokens, the last one reaching the cap
        assert t[0] == 1, rid
        assert all(t[j + 1] == t[j] + acc[j] + 1 for j in range(len(g) - 1)), rid
        assert t[-1] < tokens <= t[-1] + acc[-1] + 1, rid
    # the first four requests were on disk after the idle period, before SIGTERM
    assert idle["rows"] == len(df[df["generation_id"] < 4]) and idle["incomplete"] == []
    print(f"SIGTERM -> exit {t_exit:.1f} s; rows {st['rows']} in {len(st['parts'])} parts; idle {idle}")
