"""The Ray path of collection: one vLLM engine per Ray actor over a prompt shard each, then one merged set.

On CPU: two actors (one CPU each) run :func:`specenv.engines.vllm.collect.collect_vllm` with the shipped
``small-moe-v1`` models over one prompt each (:func:`policies.distributed.ray_shards`); the driver merges
the two sets (:func:`specenv.engines.merge.merge_sets`) and saves them as one validated trace set.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
ray = pytest.importorskip("ray", reason="the ray extra is not installed in .venv-vllm (make venv-vllm installs it)")

from specenv.traces.traceset import TraceSet  # noqa: E402

KMAX = 2
N_TOKENS = 8
#: What the actors' vLLM engines need on a shared CPU machine (as tests/vllm/conftest.py sets for this process).
ENGINE_ENV = (
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "OMP_NUM_THREADS",
)


def _shipped() -> bool:
    from specenv.engines.hf.models import model_dir

    try:
        model_dir("small-moe-v1")
    except ValueError:
        return False
    return True


@pytest.mark.slow
def test_two_actors_collect_shards_and_the_merge_is_one_set(tmp_path) -> None:
    if not _shipped():
        pytest.skip("needs the shipped small-moe-v1 models")
    from policies.distributed import ray_shards, shard
    from specenv.engines.hf.models import load_prompts
    from specenv.engines.merge import merge_sets
    from specenv.engines.vllm.collect import PROMPT_SET, collect_vllm

    prompts = load_prompts(PROMPT_SET)[:2]
    env = {k: os.environ[k] for k in ENGINE_ENV if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        kwargs = [
            {"prompts": part, "kmax": KMAX, "max_new_tokens": N_TOKENS, "name": f"shard{i}"}
            for i, part in enumerate(shard(prompts, 2))
        ]
        sets = ray_shards(collect_vllm, kwargs, num_cpus=1)
    finally:
        ray.shutdown()
    assert [sorted(s.positions["generation_id"].unique().tolist()) for s in sets] == [[prompts[0].id], [prompts[1].id]]
    merged = merge_sets(sets, name="live-vllm-ray")
    back = TraceSet.load(merged.save(tmp_path / "set"))
    ids = {p.id for p in prompts}
    assert set(back.positions["generation_id"].unique().tolist()) == ids
    assert set(back.rounds["generation_id"].unique().tolist()) == ids
    refs = back.manifest.extra["reference_tokens"]
    assert set(refs) == {str(i) for i in ids}
    for gid in ids:  # one position row per committed token of the reference output
        assert (back.positions["generation_id"] == gid).sum() == len(refs[str(gid)])
        assert set(back.rounds.loc[back.rounds["generation_id"] == gid, "K"].unique().tolist()) == set(range(KMAX + 1))
    shards = back.manifest.extra["shards"]
    assert [s["generations"] for s in shards] == [1, 1] and [s["id_offset"] for s in shards] == [0, 0]
    assert back.manifest.extra["lossless"]["runs_checked"] == 2 * KMAX
    assert back.manifest.extra["lossless"]["mismatched_runs"] == 0
    assert back.manifest.counts["generations"] == 2
