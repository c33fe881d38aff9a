"""The vLLM collector's device settings (:mod:`specenv.engines.vllm.devices`), without vLLM or a GPU.

The memory split is checked against sizes computed here from the shipped small models' files and
configs (6 target layers and 2 draft layers, 2 KV heads of 32 dimensions each).
"""

from __future__ import annotations

import pytest

from specenv.engines.vllm.devices import check_device, memory_split, select_runner
from specenv.engines.vllm.models import VLLMModelDirs

GiB = 1 << 30
T_LAYERS, D_LAYERS, KV_HEADS, HEAD_DIM = 6, 2, 2, 32


@pytest.fixture
def dirs():
    from specenv.engines.hf.models import model_dir

    try:
        src = model_dir("small-moe-v1")
    except ValueError:
        pytest.skip("needs the shipped small-moe-v1 models")
    return VLLMModelDirs(src / "target", src / "draft", 1024, src)


def test_cpu_kv_cache_holds_a_batch_of_full_sequences(dirs):
    spec, plain = memory_split("cpu", dirs, batch=32)
    per_token_t = 2 * T_LAYERS * KV_HEADS * HEAD_DIM * 4  # float32 keys and values
    per_token_d = 2 * D_LAYERS * KV_HEADS * HEAD_DIM * 4
    assert spec["kv_cache_memory_bytes"] >= 32 * 1024 * (per_token_t + per_token_d)
    assert plain["kv_cache_memory_bytes"] >= 1024 * per_token_t
    assert spec["kv_cache_memory_bytes"] < GiB  # sized from the models, not vLLM's default space


def test_gpu_split_gives_the_plain_engine_its_needs_and_the_rest_to_the_speculative_engine(dirs):
    total = 141 * GiB
    spec, plain = memory_split("cuda", dirs, batch=32, utilization=0.9, total_bytes=total)
    u_s, u_p = spec["gpu_memory_utilization"], plain["gpu_memory_utilization"]
    weights_t = (dirs.target / "model.safetensors").stat().st_size
    weights_d = (dirs.draft / "model.safetensors").stat().st_size
    assert u_p * total >= weights_t + 1024 * 2 * T_LAYERS * KV_HEADS * HEAD_DIM * 2  # bf16 KV of one sequence
    assert u_s + u_p <= 0.9 + 1e-9
    assert u_s * total > weights_t + weights_d and u_s > u_p


def test_gpu_split_that_cannot_hold_both_engines_is_refused(dirs):
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.5") as err:
        memory_split("cuda", dirs, batch=32, utilization=0.5, total_bytes=8 * GiB)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="fraction"):
        memory_split("cuda", dirs, batch=32, utilization=1.5, total_bytes=8 * GiB)


def test_device_refusals_and_runner_selection(monkeypatch):
    with pytest.raises(ValueError, match="--device tpu"):
        check_device("tpu", platform="cpu")
    with pytest.raises(ValueError, match="runs on cpu"):
        check_device("cuda", platform="cpu")
    check_device("cuda", platform="cuda")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert select_runner("cpu") == "V1"
    assert select_runner("cuda") == "V1"  # vLLM would pick V2 on CUDA: the collector selects V1
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert select_runner("cuda") == "V2"
