"""VLLMBackend: an in-process vLLM engine stepped one round at a time (the live env's vllm backend)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

pytestmark = pytest.mark.slow  # a live vLLM engine

from vhelpers import KMAX, MAX_TOKENS, PROMPTS, controller_of  # noqa: E402


def test_rounds_follow_the_requested_k_and_stay_lossless(backend, plain_reference):
    ids = backend.models.encode(PROMPTS[0])
    ref = plain_reference[PROMPTS[0]]["token_ids"]
    top_k = controller_of(backend.llm).top_k
    for k in (0, 2, KMAX):
        toks, rounds = backend.generate(ids, k)
        assert toks == ref, f"k={k}"
        assert [r.k for r in rounds] == [k] * len(rounds)
        assert sum(len(r.committed) for r in rounds) == MAX_TOKENS - 1  # the prefill made the first token
        assert all(r.m == k + 1 and 0 <= r.accepted <= k and r.T_T_ms > 0 and r.T_T_cpu_ms > 0 for r in rounds)
        assert all(len(r.drafted) == KMAX and r.drafted[: r.accepted] == r.committed[: r.accepted] for r in rounds)
        assert all(top_k <= r.U_r <= (k + 1) * top_k and 1 <= r.E_max <= k + 1 for r in rounds)
        assert rounds[-1].done and not any(r.done for r in rounds[:-1])
    backend.start(ids)
    t, i, out = backend.t, 0, []
    while not backend.done:  # a different k every round
        r = backend.step(i % (KMAX + 1))
        assert r.k == i % (KMAX + 1) and r.t == t and r.L == len(ids) + 1 + t
        t += len(r.committed)
        out += r.committed
        i += 1
    assert backend.generated == ref and out == ref[1:]
    backend.start(ids)
    with pytest.raises(ValueError, match="outside"):
        backend.step(KMAX + 1)
    backend.abort()
    assert backend.done and not backend.llm.llm_engine.has_unfinished_requests()


def test_live_env_with_the_vllm_backend(backend, model_dirs):
    import gymnasium as gym

    from specenv.traces.datasets import list_datasets

    if "live-cpu" not in {d.name for d in list_datasets()} or model_dirs.source.name != "small-moe-v1":
        pytest.skip("needs the live-cpu trace set and the shipped models")
    env = gym.make("specenv/MoESpecLive-v0", backend="vllm", kmax=KMAX, max_new_tokens=MAX_TOKENS)
    try:
        obs, info = env.reset(seed=0)
        total, done = 0, False
        while not done:
            obs, reward, done, truncated, info = env.step(2)
            assert env.observation_space.contains(obs) and reward < 0 and info["k"] == 2
            assert info["T_T_cpu_ms"] > 0 and info["T_D_cpu_ms"] > 0
            total += info["committed"]
        assert info["speedup"] > 0 and 0 < total <= MAX_TOKENS - 1  # the prefill made the first token
    finally:
        env.close()


def test_the_engines_weights_are_on_huge_pages(backend):
    """The tap's loader put the target's largest weight on transparent huge pages (specenv.engines.vllm.hugepages)."""
    from specenv.engines.vllm import hugepages

    if hugepages.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {hugepages.thp_mode()!r} on this machine")
    model = hugepages.engine_models(backend.llm)[0]
    big = max(model.parameters(), key=lambda t: t.untyped_storage().nbytes())
    assert big.untyped_storage().nbytes() >= 2 * hugepages.HUGE  # it holds at least one whole huge page
    ptr = big.untyped_storage().data_ptr()
    path = hugepages.mapping_path(ptr)
    if path:  # a float32 checkpoint is mmap'd as is: page cache, not the anonymous memory advised here
        pytest.skip(f"the weights are mapped from {path}, not copied into anonymous memory")
    first = -(-ptr // hugepages.HUGE) * hugepages.HUGE  # its first whole huge page (madvise splits the mapping there)
    kb = hugepages.huge_kb_at(first)
    assert kb is not None and kb * 1024 >= hugepages.HUGE, kb
