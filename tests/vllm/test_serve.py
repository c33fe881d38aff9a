"""`specenv serve`: vLLM's OpenAI server with the controller and recorder; SIGKILL leaves valid parts only."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import KMAX, MAX_TOKENS, PROMPTS  # noqa: E402

from specenv.engines.recorder import PARTS, load_recording, recording_status  # noqa: E402
from specenv.observation.single import ObservationSpec  # noqa: E402
from specenv.policy.mlp import MLPPolicy  # noqa: E402
from specenv.traces.schema import validate_rounds  # noqa: E402
from specenv.traces.traceset import TraceSet  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.load_test import Server  # noqa: E402  - the server process of the load test, on loopback


def post(port: int, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_serve_records_and_sigkill_leaves_only_complete_parts(model_dirs, plain_reference, tmp_path):
    # the served model's experts: the controller refuses a policy trained for another model
    cfg = json.loads((Path(model_dirs.target) / "config.json").read_text())
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    # a block-mode policy (lookahead 2): the draft signals reach it through the worker's shared memory
    spec = ObservationSpec(kmax=KMAX, lookahead=2, max_new_tokens=MAX_TOKENS, n_experts=n_experts)
    rng = np.random.default_rng(2)
    pol = MLPPolicy(
        spec,
        [(rng.normal(size=(spec.dim, 8)), rng.normal(size=8)), (rng.normal(size=(8, KMAX + 1)), np.zeros(KMAX + 1))],
    ).save(tmp_path / "policy")
    rec = tmp_path / "rec"
    specenv_bin = Path(sys.executable).parent / "specenv"
    cmd = [
        str(specenv_bin),
        "serve",
        "--policy",
        str(pol),
        "--record",
        str(rec),
        "--part-rounds",
        "8",
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
    srv = Server(cmd, tmp_path / "server.log")  # its engine core in a process of its own, as deployed
    port = srv.port
    try:
        srv.wait_ready(timeout=600)
        # lossless through the server: greedy completions equal plain greedy vLLM
        for p in PROMPTS[:2]:
            out = post(
                port,
                {
                    "model": str(model_dirs.target),
                    "prompt": p,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert out["choices"][0]["text"] == plain_reference[p]["text"]
        # keep the server busy, then SIGKILL the whole process group (API server and engine core,
        # where the recorder runs) while requests are in flight
        stop = threading.Event()

        def load() -> None:
            i = 0
            while not stop.is_set():
                try:
                    post(
                        port,
                        {
                            "model": str(model_dirs.target),
                            "prompt": PROMPTS[i % len(PROMPTS)],
                            "max_tokens": 200,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                        timeout=30,
                    )
                except OSError:
                    return
                i += 1

        threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        while len(recording_status(rec)["parts"]) < 4 and time.monotonic() - t0 < 180:
            time.sleep(0.2)
        time.sleep(0.35)  # land somewhere inside the next part
        srv.kill()  # SIGKILL to the whole process group
        stop.set()
    finally:
        srv.kill()
    time.sleep(1.0)  # let the killed engine-core process disappear

    st = recording_status(rec)
    assert len(st["parts"]) >= 4, st
    assert st["invalid"] == [] and st["rejected"] == []
    for name in st["incomplete"]:  # only temporaries or an unindexed (never announced) Parquet file
        assert name.startswith(".") or name.endswith(".parquet"), name
    man = json.loads((rec / "recording.json").read_text())
    assert (
        man["format"] == "specenv.recording/1"
        and man["source"] == "vllm"
        and man["extra"]["settings"]["policy"] == str(pol)
    )
    ts = load_recording(rec)
    for part in st["parts"]:
        idx = json.loads((rec / PARTS / f"{part}.json").read_text())
        table = pq.read_table(rec / PARTS / idx["path"])
        assert table.num_rows == idx["rows"]
        validate_rounds(table, ts.facts, KMAX, file=part)
    assert len(ts.rounds) == st["rows"] and ts.rounds["K"].nunique() >= 2
    assert not ts.rounds["fallback"].any()  # every round's policy saw its draft signals
    back = TraceSet.load(ts.save(tmp_path / "traces"))
    assert len(back.rounds) == st["rows"]
