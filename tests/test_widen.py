"""Derived model sets: experts widened by zeros compute the same function (specenv.engines.hf.widen)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from specenv.engines.hf.models import model_dir  # noqa: E402
from specenv.engines.hf.widen import (  # noqa: E402
    build_derived_set,
    derived_ids,
    expert_bytes,
    read_recipe,
    widen_state,
    write_widened,
)

REPO = Path(__file__).resolve().parents[1]


def _load(folder: Path):
    from transformers import Qwen3MoeForCausalLM

    m = Qwen3MoeForCausalLM.from_pretrained(
        folder / "target",
        dtype=torch.float32,
        local_files_only=True,
        use_safetensors=True,
        experts_implementation="eager",
    )
    return m.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    """small-moe-v1's target and the same target widened to 160 (a small width: the test stays fast)."""
    src = model_dir("small-moe-v1")
    out = tmp_path_factory.mktemp("wide") / "w160"
    out.mkdir()
    cfg = write_widened(src, out, 160)
    return _load(src), _load(out), cfg


def test_widening_changes_no_output_and_no_routing(pair) -> None:
    small, wide, cfg = pair
    assert cfg["moe_intermediate_size"] == 160
    assert wide.config.moe_intermediate_size == 160 and small.config.moe_intermediate_size == 64
    n_small = sum(p.numel() for p in small.parameters())
    n_wide = sum(p.numel() for p in wide.parameters())
    assert n_wide - n_small == 6 * 64 * 3 * 128 * (160 - 64)  # exactly the zero rows and columns
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, small.config.vocab_size, (3, 40), generator=g)
    with torch.no_grad():
        a = small(ids, output_router_logits=True)
        b = wide(ids, output_router_logits=True)
    # the router decisions (top-k experts of every token in every layer) are the same
    k = small.config.num_experts_per_tok
    for ra, rb in zip(a.router_logits, b.router_logits, strict=True):
        np.testing.assert_array_equal(ra.topk(k, dim=-1).indices.numpy(), rb.topk(k, dim=-1).indices.numpy())
    np.testing.assert_allclose(a.logits.numpy(), b.logits.numpy(), rtol=0, atol=1e-4)
    # greedy continuations are identical
    with torch.no_grad():
        ga = small.generate(ids[:, :8], max_new_tokens=24, do_sample=False)
        gb = wide.generate(ids[:, :8], max_new_tokens=24, do_sample=False)
    assert torch.equal(ga, gb)


def test_widen_state_pads_with_zeros_and_refuses_narrowing() -> None:
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)  # gate/up: (I=2, hidden=3)
    d = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)  # down: (hidden=3, I=2)
    state = {
        "model.layers.0.mlp.experts.0.gate_proj.weight": t,
        "model.layers.0.mlp.experts.0.up_proj.weight": t,
        "model.layers.0.mlp.experts.0.down_proj.weight": d,
        "model.norm.weight": torch.ones(3),
    }
    out = widen_state(state, 4)
    g = out["model.layers.0.mlp.experts.0.gate_proj.weight"]
    assert g.shape == (4, 3) and torch.equal(g[:2], t) and not g[2:].any()
    dn = out["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert dn.shape == (3, 4) and torch.equal(dn[:, :2], d) and not dn[:, 2:].any()
    assert out["model.norm.weight"] is state["model.norm.weight"]
    with pytest.raises(ValueError, match="below"):
        widen_state(state, 1)
    with pytest.raises(ValueError, match="no expert tensors"):
        widen_state({"model.norm.weight": torch.ones(3)}, 4)


def test_expert_bytes_counts_every_routed_expert() -> None:
    cfg = json.loads((model_dir("small-moe-v1") / "target" / "config.json").read_text())
    # 6 layers x 64 experts x 3 matrices of 128 x 64 bf16 weights
    assert expert_bytes(cfg) == 6 * 64 * 3 * 128 * 64 * 2
    recipe = read_recipe("wide-moe-v1")
    assert recipe is not None and recipe["source"] == "small-moe-v1"
    assert recipe["expert_bytes"] == 6 * 64 * 3 * 128 * recipe["moe_intermediate_size"] * 2
    assert recipe["expert_bytes"] >= 10 * 32 * 2**20  # at least 10x this machine's 32 MiB last-level cache
    assert "wide-moe-v1" in derived_ids()


def test_a_derived_set_not_built_is_refused_with_the_command(tmp_path: Path) -> None:
    env = {"SPECENV_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    code = "from specenv.engines.hf.models import model_dir; model_dir('wide-moe-v1')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert res.returncode != 0 and "specenv models --build wide-moe-v1" in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "specenv.cli", "models", "--build", "nope"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert res.returncode == 2 and "not a derived model set" in res.stderr
    assert not (tmp_path / "cache").exists()  # nothing written


@pytest.mark.slow
def test_the_recipe_builds_byte_identical_files(tmp_path: Path) -> None:
    """The shipped recipe's sha256 (recorded when it was made) is what a build here writes (~20 s, 870 MB)."""
    out = build_derived_set("wide-moe-v1", out=tmp_path / "wide-moe-v1")
    manifest = json.loads((out / "manifest.json").read_text())
    recipe = read_recipe("wide-moe-v1")
    assert {k: v["sha256"] for k, v in manifest["files"].items()} == recipe["files"]
    # a folder that is not a build of this set is never replaced
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("user data")
    with pytest.raises(ValueError, match="not replaced"):
        build_derived_set("wide-moe-v1", out=foreign)
    assert (foreign / "notes.txt").read_text() == "user data"
