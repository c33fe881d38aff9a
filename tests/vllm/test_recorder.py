"""The recorder: U_r through vLLM equals U_r from transformers; recordings assemble into valid trace sets."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import KMAX, PROMPTS, controller_of, greedy  # noqa: E402

from specenv.engines.vllm import load_recording  # noqa: E402
from specenv.traces.traceset import TraceSet  # noqa: E402


@pytest.fixture
def ctl(engine):
    c = controller_of(engine)
    yield c
    c.stop_recording()
    c.set_policy(None)


def hf_routing_stats(model, seq: list[int], m: int, top_k: int) -> tuple[float, float]:
    """U_r and E_max of the last m positions of ``seq`` from a plain transformers forward."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([seq]), output_router_logits=True)
    us, es = [], []
    for logits in out.router_logits:  # one (tokens, n_experts) tensor per MoE layer
        ids = torch.topk(logits.reshape(len(seq), -1)[-m:].float(), top_k, dim=-1).indices
        counts = torch.bincount(ids.reshape(-1), minlength=logits.shape[-1])
        us.append(int((counts > 0).sum()))
        es.append(int(counts.max()))
    return float(np.mean(us)), float(np.mean(es))


def test_U_r_through_vllm_equals_transformers(engine, ctl, model_dirs, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    rec = tmp_path / "rec"
    ctl.start_recording(str(rec))
    outs = engine.generate(PROMPTS[:3], greedy(), use_tqdm=False)  # a batch of 3: token offsets matter
    ctl.stop_recording()
    df = load_recording(rec).rounds
    assert (df["K"] == KMAX).all() and (df["batch_size"] > 1).any()
    tokens = {}
    for o in outs:
        tokens[o.request_id] = (list(o.prompt_token_ids), list(o.outputs[0].token_ids))
    model = AutoModelForCausalLM.from_pretrained(model_dirs.target, dtype=torch.float32).eval()
    top_k = int(model.config.num_experts_per_tok)
    checked = 0
    for row in df.itertuples():
        key = next(k for k in tokens if row.request_id == k or row.request_id.startswith(f"{k}-"))
        prompt, output = tokens[key]
        context = prompt + output[: row.t]  # committed before the round
        verified = list(row.verified_tokens)
        assert len(verified) == row.m and verified[0] == context[-1]
        n = min(row.accepted, len(output) - row.t)  # the last round may run past max_tokens
        assert verified[1 : 1 + n] == output[row.t : row.t + n]
        U, E = hf_routing_stats(model, context[:-1] + verified, row.m, top_k)
        # stored as float32: equal to the float64 mean up to rounding
        assert (row.U_r, row.E_max) == (pytest.approx(U, rel=1e-6), pytest.approx(E, rel=1e-6)), row.request_id
        checked += 1
    assert checked == len(df) > 30


def test_recording_saves_as_a_trace_set_that_validates(engine, ctl, tmp_path):
    rec = tmp_path / "rec"
    ctl.start_recording(str(rec), part_rounds=10, run="K=4", category="code", name="vllm-test")
    engine.generate(PROMPTS[:2], greedy(), use_tqdm=False)
    ctl.stop_recording()
    ts = load_recording(rec)
    assert ts.manifest.source == "vllm" and ts.manifest.greedy
    assert ts.manifest.model.n_experts == ctl.n_experts and ts.manifest.kmax == KMAX
    assert set(ts.rounds["run"]) == {"K=4"} and set(ts.rounds["category"]) == {"code"}
    assert (ts.rounds["timing"] == "hooks").all()
    assert (ts.rounds["T_T_ms"] > 0).all() and (ts.rounds["T_D_ms"] > 0).all()
    out = ts.save(tmp_path / "traces")
    back = TraceSet.load(out)
    assert len(back.rounds) == len(ts.rounds)
    assert back.manifest.counts["generations"] == 2
