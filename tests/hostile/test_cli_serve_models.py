"""`specenv serve --models` / `--kmax` and `specenv models`: hostile input refused in one line, and what is accepted.

Every refused case: exit 2, one ``specenv: error:`` line naming the option, nothing written under the
case's folder or the disk cache (where :func:`specenv.engines.vllm.models.vllm_model_dirs` builds its
views). ``serve`` cases carry ``--print-command`` so that a missing check prints instead of starting vLLM.
Placeholders: ``{F}`` a plain file, ``{NOMAN}`` a folder with target/ and draft/ but no manifest,
``{NODRAFT}`` a model set without ``draft/config.json``, ``{BADMAN}`` a truncated manifest,
``{BADCFG}`` a truncated ``target/config.json``, ``{BADLEN}`` a negative ``max_position_embeddings``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from specenv.engines.hf.models import model_dir, model_set_info
from specenv.engines.vllm import settings as vs
from specenv.engines.vllm.models import CHAT_TEMPLATE, vllm_model_dirs
from tests.hostile.harness import private_cache, reject_cleanly, run_cli

HUGE = str(10**30)
ROOT = Path(__file__).resolve().parents[2]
POLICY_128 = str(
    ROOT / "policies" / "shipped" / "paper-default-v2" / "imitation"
)  # trained for 128 experts (paper profile)
SERVE = ["serve", "--policy", "none", "--print-command"]

CASES: list[tuple[str, list[str], list[str]]] = [
    ("serve-models-unknown", [*SERVE, "--models", "nope"], ["--models", "nope", "small-moe-v1"]),
    ("serve-models-empty", [*SERVE, "--models", ""], ["--models"]),
    ("serve-models-newline", [*SERVE, "--models", "small\nmoe"], ["--models"]),
    ("serve-models-a-file", [*SERVE, "--models", "{F}"], ["--models", "{F}"]),
    ("serve-models-no-manifest", [*SERVE, "--models", "{NOMAN}"], ["--models", "manifest.json"]),
    ("serve-models-no-draft", [*SERVE, "--models", "{NODRAFT}"], ["--models", "draft/config.json"]),
    ("serve-models-manifest-truncated", [*SERVE, "--models", "{BADMAN}"], ["--models", "manifest.json"]),
    ("serve-models-config-truncated", [*SERVE, "--models", "{BADCFG}"], ["--models", "config.json"]),
    ("serve-models-max-len-negative", [*SERVE, "--models", "{BADLEN}"], ["--models", "max_position_embeddings"]),
    ("serve-kmax-zero", [*SERVE, "--models", "small-moe-v1", "--kmax", "0"], ["--kmax"]),
    ("serve-kmax-negative", [*SERVE, "--models", "small-moe-v1", "--kmax", "-3"], ["--kmax"]),
    ("serve-kmax-65", [*SERVE, "--models", "small-moe-v1", "--kmax", "65"], ["--kmax"]),
    ("serve-kmax-huge", [*SERVE, "--models", "small-moe-v1", "--kmax", HUGE], ["--kmax"]),
    ("serve-kmax-text", [*SERVE, "--models", "small-moe-v1", "--kmax", "eight"], ["--kmax"]),
    ("serve-kmax-without-models", [*SERVE, "--kmax", "4", "--", "m"], ["--kmax", "--models"]),
    (
        "serve-kmax-and-own-speculative-config",
        [*SERVE, "--models", "small-moe-v1", "--kmax", "4", "--", "--speculative-config", "{}"],
        ["--kmax", "--speculative-config"],
    ),
    (
        "serve-models-policy-for-other-experts",
        ["serve", "--policy", POLICY_128, "--models", "small-moe-v1", "--print-command"],
        ["--policy", "128 experts", "64"],
    ),
    (
        "serve-models-flag-set-by-specenv",
        [*SERVE, "--models", "small-moe-v1", "--", "--load-format", "auto"],
        ["--load-format"],
    ),
    ("serve-neither-models-nor-model", [*SERVE], ["--models", "vLLM arguments"]),
    ("models-extra-argument", ["models", "surplus"], ["surplus"]),
    ("models-unknown-option", ["models", "--bogus"], ["--bogus"]),
]


def _model_set(dst: Path) -> Path:
    """A copy of the shipped set (weights linked, not copied)."""
    src = model_dir("small-moe-v1")
    for f in src.rglob("*"):
        out = dst / f.relative_to(src)
        if f.is_dir():
            out.mkdir(parents=True, exist_ok=True)
        elif f.suffix == ".safetensors":
            out.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(f.resolve(), out)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, out)
    return dst


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The folder of broken model sets and the placeholders naming them."""
    root = tmp_path_factory.mktemp("model-sets")
    (root / "notes.txt").write_text("a user's file\n")
    noman = _model_set(root / "no-manifest")
    (noman / "manifest.json").unlink()
    nodraft = _model_set(root / "no-draft")
    (nodraft / "draft" / "config.json").unlink()
    badman = _model_set(root / "bad-manifest")
    (badman / "manifest.json").write_text('{"name": "x", "files": {')
    badcfg = _model_set(root / "bad-config")
    (badcfg / "target" / "config.json").write_text('{"architectures": [')
    badlen = _model_set(root / "bad-len")
    cfg = json.loads((badlen / "target" / "config.json").read_text())
    (badlen / "target" / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": -1}))
    subs = {
        "{F}": str(root / "notes.txt"),
        "{NOMAN}": str(noman),
        "{NODRAFT}": str(nodraft),
        "{BADMAN}": str(badman),
        "{BADCFG}": str(badcfg),
        "{BADLEN}": str(badlen),
    }
    return root, subs


def _fill(items: list[str], subs: dict[str, str]) -> list[str]:
    out = []
    for item in items:
        for key, val in subs.items():
            item = item.replace(key, val)
        out.append(item)
    return out


@pytest.mark.parametrize(("case", "args", "names"), CASES, ids=[c[0] for c in CASES])
def test_bad_models_or_kmax_is_one_line_and_writes_nothing(sets, case, args, names, monkeypatch, tmp_path):
    root, subs = sets
    cache = private_cache(monkeypatch, tmp_path / "cache")  # no other worker writes into it
    reject_cleanly(_fill(args, subs), _fill(names, subs), [root, cache])


def test_case_names_are_unique():
    assert len({c[0] for c in CASES}) == len(CASES) >= 20


# ---------------------------------------------------------------------------------------- accepted


def test_models_lists_the_shipped_set_with_sizes_and_a_good_sha256():
    res = run_cli(["models", "--json"])
    assert res.exit_code == 0, res.stderr
    rows = json.loads(res.stdout)
    row = next(r for r in rows if r["id"] == "small-moe-v1")
    assert (row["name"], row["version"], row["sha256"]) == ("small-moe", 1, "ok")
    assert row["target"] == {
        "class": "Qwen3MoeForCausalLM",
        "layers": 6,
        "experts": 64,
        "top_k": 4,
        "params": 10045440,
    }
    assert row["draft"]["layers"] == 2 and "experts" not in row["draft"]
    text = run_cli(["models"])
    assert text.exit_code == 0 and "small-moe-v1: small-moe v1" in text.stdout
    assert "64 experts top-4" in text.stdout and "sha256 ok" in text.stdout


def test_model_set_info_reports_a_changed_or_missing_file(tmp_path):
    folder = _model_set(tmp_path / "set")
    assert model_set_info(folder).sha256 == "ok"
    tok = folder / "tokenizer.json"
    tok.write_text(tok.read_text().replace("a", "b", 1))
    assert model_set_info(folder).sha256 == "mismatch: tokenizer.json"
    assert model_set_info(folder, verify=False).sha256 == "not checked"
    (folder / "draft" / "generation_config.json").unlink()
    assert model_set_info(folder).sha256.startswith("missing: ")


def _printed(args: list[str]) -> str:
    res = run_cli(["serve", *args])
    assert res.exit_code == 0, res.stderr
    return res.stdout.strip()


def _spec_config(line: str) -> dict:
    import shlex

    words = shlex.split(line)
    configs = [json.loads(words[i + 1]) for i, w in enumerate(words) if w == "--speculative-config"]
    assert len(configs) == 1, line
    return configs[0]


def test_serve_models_builds_model_and_speculative_config():
    dirs = vllm_model_dirs("small-moe-v1")
    line = _printed(["--policy", "ucb", "--models", "small-moe", "--print-command", "--", "--port", "8123"])
    assert f"--model {dirs.target}" in line and "--served-model-name small-moe-v1" in line
    assert "--port 8123" in line
    assert _spec_config(line) == {"method": "draft_model", "model": str(dirs.draft), "num_speculative_tokens": 8}
    line = _printed(["--policy", "ucb", "--models", "small-moe-v1", "--kmax", "3", "--print-command"])
    assert _spec_config(line)["num_speculative_tokens"] == 3


def test_serve_models_takes_the_policy_folders_kmax(tmp_path):
    from specenv.observation.single import ObservationSpec
    from specenv.policy.mlp import MLPPolicy

    spec = ObservationSpec(kmax=5, max_new_tokens=64, n_experts=64)
    rng = np.random.default_rng(0)
    pol = MLPPolicy(spec, [(rng.normal(size=(spec.dim, 4)), np.zeros(4)), (rng.normal(size=(4, 6)), np.zeros(6))])
    folder = pol.save(tmp_path / "pol")
    line = _printed(["--policy", str(folder), "--models", "small-moe-v1", "--print-command"])
    assert _spec_config(line)["num_speculative_tokens"] == 5


@pytest.mark.parametrize("models", [True, False])
def test_serve_loads_a_policy_folder_once_before_vllm(tmp_path, monkeypatch, models):
    from typer.testing import CliRunner

    from specenv.cli import app
    from specenv.observation.single import ObservationSpec
    from specenv.policy import registry
    from specenv.policy.mlp import MLPPolicy

    spec = ObservationSpec(kmax=4, max_new_tokens=64, n_experts=64)
    rng = np.random.default_rng(0)
    folder = MLPPolicy(spec, [(rng.normal(size=(spec.dim, 5)), np.zeros(5))]).save(tmp_path / "pol")
    loads = []
    resolve = registry.resolve

    def counted(name, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        loads.append(Path(name).resolve() == Path(folder).resolve())
        return resolve(name, *a, **kw)

    monkeypatch.setattr(registry, "resolve", counted)
    rest = ["--models", "small-moe-v1"] if models else ["--", "m", "-sc", json.dumps({"num_speculative_tokens": 4})]
    res = CliRunner().invoke(app, ["serve", "--policy", str(folder), "--print-command", *rest])
    assert res.exit_code == 0, res.output
    assert '"num_speculative_tokens": 4' in res.stdout
    assert loads == [True]  # loaded once; the checks against the served model reuse it


def test_serve_models_leaves_what_the_user_gives_after_the_separator():
    own = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    line = _printed(["--policy", "none", "--models", "small-moe-v1", "--print-command", "--", "-sc", own])
    assert "--speculative-config" not in line and "--model " in line
    line = _printed(["--policy", "none", "--models", "small-moe-v1", "--print-command", "--", "my/model"])
    assert "--model " not in line and "--served-model-name" not in line and "my/model" in line
    assert _spec_config(line)["model"].endswith("/draft")


def test_serve_without_models_keeps_the_old_form():
    line = _printed(["--policy", "none", "--print-command", "--", "M", "--speculative-config", "{}"])
    assert "--served-model-name" not in line and line.count("--speculative-config") == 1


@pytest.mark.slow  # seconds of work; the full suite runs it
def test_view_carries_a_chat_template_and_a_new_key():
    dirs = vllm_model_dirs("small-moe-v1")
    for part in (dirs.target, dirs.draft):
        cfg = json.loads((part / "tokenizer_config.json").read_text())
        assert cfg["chat_template"] == CHAT_TEMPLATE
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dirs.target))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # the key of a view without the template (format 1: the manifest's sha256 alone) is not reused
    import hashlib

    old = hashlib.sha256((dirs.source / "manifest.json").read_bytes()).hexdigest()[:16]
    assert dirs.target.parent.name != f"small-moe-v1-{old}"


# ------------------------------------------------------------------------ environment and command


def test_serve_env_sets_a_kv_cache_that_fits_on_cpu_only():
    gib = 2**30
    assert vs.serve_env({}, [], on_cpu=False, available_bytes=64 * gib) == {}
    assert vs.serve_env({}, [], on_cpu=True, available_bytes=64 * gib) == {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",  # the weights on huge pages (engines.vllm.hugepages)
    }
    assert vs.serve_env({}, [], on_cpu=True, available_bytes=10 * gib)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert vs.serve_env({}, [], on_cpu=True, available_bytes=gib)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert vs.cpu_kvcache_gib(None) == 1
    user = {"VLLM_CPU_KVCACHE_SPACE": "7", "VLLM_CPU_OMP_THREADS_BIND": "0-3"}
    assert vs.serve_env(user, [], on_cpu=True, available_bytes=64 * gib) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    user["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=0"  # the user's own choice is kept
    assert vs.serve_env(user, [], on_cpu=True, available_bytes=64 * gib) == {}
    sized = vs.serve_env({}, ["--kv-cache-memory-bytes=1000000"], on_cpu=True, available_bytes=64 * gib)
    assert sized == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    avail = vs.available_memory_bytes()
    assert avail is None or avail > 0


def test_launch_command_per_install():
    args = ["M", "--port", "1"]
    assert vs.launch_command(args, ("vllm", "0.32.0")) == ["vllm", "serve", *args]
    assert vs.launch_command(args, None) == ["vllm", "serve", *args]
    cpu = vs.launch_command(args, ("vllm-cpu", "0.32.0"))
    assert cpu == [sys.executable, "-m", vs.LAUNCHER_MODULE, "--model", "M", "--port", "1"]
    assert vs.vllm_on_cpu(("vllm-cpu", "0.32.0")) and vs.vllm_on_cpu(("vllm", "0.32.0+cpu"))
    assert not vs.vllm_on_cpu(("vllm", "0.32.0")) and not vs.vllm_on_cpu(None)


def test_print_command_names_the_environment_on_a_cpu_install(monkeypatch):
    monkeypatch.setattr(vs, "vllm_distribution", lambda: ("vllm-cpu", "0.32.0"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    line = _printed(["--policy", "none", "--models", "small-moe-v1", "--print-command"])
    assert line.startswith("VLLM_CPU_KVCACHE_SPACE=")
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind " in line
    assert f"GLIBC_TUNABLES=glibc.malloc.hugetlb=1 {sys.executable} -m {vs.LAUNCHER_MODULE} --model " in line
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    line = _printed(["--policy", "none", "--models", "small-moe-v1", "--print-command"])
    assert "VLLM_CPU_KVCACHE_SPACE" not in line
