"""``specenv collect --engine vllm --target DIR --draft DIR``: any pair of folders, the same collector.

The shipped small models are copied into plain Hugging Face folders elsewhere (weights, config, each
its own tokenizer files), and collected at the size of the session's ``--models small-moe-v1``
collection (``small_collection``): the tables must be the same, timing columns aside. Bad folders are
refused before any engine starts: one line, exit code 2, nothing written.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from typer.testing import CliRunner  # noqa: E402
from vhelpers import collect_args  # noqa: E402

from specenv.cli import app  # noqa: E402
from specenv.traces.traceset import TraceSet  # noqa: E402

#: tokenizer_config.json of the copied target (what a Hugging Face folder of a fast tokenizer carries).
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "model_max_length": 1024,
}


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """The shipped small models as two Hugging Face folders, not a model set: (target, draft)."""
    from specenv.engines.hf.models import model_dir

    try:
        src = model_dir("small-moe-v1")
    except ValueError:
        pytest.skip("needs the shipped small-moe-v1 models")
    root = tmp_path_factory.mktemp("hf-folders")
    out = []
    for part, name in (("target", "moe-target"), ("draft", "dense-draft")):
        dest = root / name
        shutil.copytree(src / part, dest)
        shutil.copy2(src / "tokenizer.json", dest / "tokenizer.json")
        (dest / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG), encoding="utf-8")
        out.append(dest)
    return tuple(out)


@pytest.fixture(scope="session")
def pair_collection(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("vcollect-pair") / "set"
    target, draft = pair
    res = CliRunner().invoke(app, [*collect_args(out, "--target", str(target), "--draft", str(draft)), "--json"])
    assert res.exit_code == 0, res.output
    return out, TraceSet.load(out)


def _untimed(df):
    """A table without its timing columns (``*_ms``), rows in a fixed order."""
    keep = [c for c in df.columns if not c.endswith("_ms")]
    keys = [c for c in ("generation_id", "K", "round", "t") if c in df.columns]
    return df[keep].sort_values(keys).reset_index(drop=True)


def test_a_pair_of_folders_gives_the_model_sets_tables(small_collection, pair_collection, pair):
    _, ref = small_collection
    _, got = pair_collection
    for table in ("positions", "rounds"):
        a, b = _untimed(getattr(ref, table)), _untimed(getattr(got, table))
        assert list(a.columns) == list(b.columns), table
        assert len(a) == len(b) > 0, table
        for col in a.columns:
            if a[col].dtype.kind == "f":
                assert np.allclose(a[col].to_numpy(), b[col].to_numpy(), rtol=0, atol=1e-6, equal_nan=True), (
                    table,
                    col,
                )
            else:
                assert (a[col].to_numpy() == b[col].to_numpy()).all(), (table, col)
    assert got.manifest.extra["reference_tokens"] == ref.manifest.extra["reference_tokens"]
    assert got.manifest.extra["models"] == {"target": str(pair[0]), "draft": str(pair[1])}
    assert got.manifest.extra["method"] == "draft_model" and got.manifest.extra["device"] == "cpu"
    assert got.manifest.extra["model_runner"] == "V1"
    # the measured no-drafter AR baseline: a plain engine's steps, lossless against the K = 0 output
    ar = got.manifest.extra["ar_reference"]
    assert ar["steps"] > 0 and ar["mismatches"] == 0


def _refused(args, out):
    res = CliRunner().invoke(app, args)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1, res.output
    assert not out.exists()
    return lines[0]


def test_bad_folders_are_refused_with_one_line(pair, tmp_path):
    target, draft = pair
    out = tmp_path / "set"
    # a draft folder without config.json
    no_cfg = tmp_path / "no-config"
    no_cfg.mkdir()
    (no_cfg / "model.safetensors").write_bytes(b"")
    line = _refused(collect_args(out, "--target", str(target), "--draft", str(no_cfg)), out)
    assert "config.json" in line and str(no_cfg) in line
    # a dense target (the draft's folder, tokenizer and all)
    line = _refused(collect_args(out, "--target", str(draft), "--draft", str(draft)), out)
    assert "mixture-of-experts" in line and str(draft) in line
    # a draft of another vocabulary
    other = tmp_path / "other-vocab"
    shutil.copytree(draft, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] * 2}))
    (other / "tokenizer.json").unlink()
    line = _refused(collect_args(out, "--target", str(target), "--draft", str(other)), out)
    assert "vocab_size" in line and str(other) in line
    # the same vocabulary size with another token -> id map
    remapped = tmp_path / "remapped"
    shutil.copytree(draft, remapped)
    tok = json.loads((remapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (remapped / "tokenizer.json").write_text(json.dumps(tok))
    line = _refused(collect_args(out, "--target", str(target), "--draft", str(remapped)), out)
    assert "tokenizer.json" in line and str(remapped) in line
    # a target without its tokenizer
    bare = tmp_path / "bare-target"
    shutil.copytree(target, bare)
    (bare / "tokenizer_config.json").unlink()
    line = _refused(collect_args(out, "--target", str(bare), "--draft", str(draft)), out)
    assert "tokenizer_config.json" in line


def test_inconsistent_model_options_are_refused(pair, tmp_path):
    target, draft = pair
    out = tmp_path / "set"
    both = collect_args(out, "--models", "small-moe-v1", "--target", str(target), "--draft", str(draft))
    assert "--models" in _refused(both, out)
    assert "--draft" in _refused(collect_args(out, "--target", str(target)), out)
    assert "--method" in _refused(collect_args(out, "--models", "small-moe-v1", "--method", "eagle3"), out)
    line = _refused(collect_args(out, "--target", str(target), "--draft", str(draft), "--method", "ngram"), out)
    assert "ngram" in line
    # this machine's vLLM is the CPU build: cuda is refused before any engine starts
    line = _refused(collect_args(out, "--target", str(target), "--draft", str(draft), "--device", "cuda"), out)
    assert "--device cuda" in line and "cpu" in line


def test_the_v2_model_runner_is_refused_at_start(pair, tmp_path, monkeypatch):
    """V2 hands the scheduler placeholder draft ids and ignores the per-step draft length: refused, one line."""
    target, draft = pair
    out = tmp_path / "set"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    line = _refused(collect_args(out, "--target", str(target), "--draft", str(draft)), out)
    assert "V2 model runner + draft_model" in line and "VLLM_USE_V2_MODEL_RUNNER=0" in line
    line = _refused(collect_args(out, "--target", str(target), "--draft", str(draft), "--method", "eagle3"), out)
    assert "V2 model runner + eagle3" in line
