"""Derived model sets: a shipped target with every expert widened by zeros (same function, more bytes).

An expert of a Qwen3-MoE layer computes ``down(silu(gate x) * up x)``. Appending ``W - I`` zero rows to
``gate`` and ``up`` and ``W - I`` zero columns to ``down`` adds hidden units whose activation is
``silu(0) * 0 = 0`` and whose output weight is 0: the layer computes the same function. What changes is
the expert's size in memory (``3 * hidden * W`` weights instead of ``3 * hidden * I``), and with it what a
verification pass costs on hardware that reads the weights of every expert it runs: the small target of
``small-moe-v1`` (20 MB) sits in this machine's last-level cache, so its verification cost hardly
depends on the unique experts a pass touches; the widened target (hundreds of MB of experts) does not,
as on a GPU serving Qwen3-30B-A3B, where every touched expert is a few MB read from HBM.

A derived set ships only its *recipe* (``specenv/data/models/<id>/recipe.json``: the source set, the new
width, and the sha256 of every file the build writes); :func:`build_derived_set` writes the set
deterministically into the user's cache (``$SPECENV_CACHE/models/<id>``) and checks every sha256 against
the recipe before the folder appears. :func:`derived_dir` is how the rest of specenv finds it.

Needs torch and safetensors (the ``live`` or ``vllm`` extra).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from specenv.io import atomic_dir, cache_dir, package_data, sha256_file

RECIPE = "recipe.json"
RECIPE_FORMAT = "specenv.derived-models/1"
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
#: Files copied unchanged from the source set (the draft and the tokenizer are the source's own).
COPIED = ("draft/config.json", "draft/generation_config.json", "draft/model.safetensors", "tokenizer.json")


def widen_state(state: dict[str, Any], width: int) -> dict[str, Any]:
    """The target's tensors with every expert's intermediate size padded to ``width`` by zeros.

    ``gate_proj``/``up_proj`` (``I x hidden``) get ``width - I`` zero rows, ``down_proj``
    (``hidden x I``) ``width - I`` zero columns; every other tensor is returned as it is.

    Raises:
        ValueError: ``width`` below an expert's intermediate size, or no expert tensor found.
    """
    import torch

    out: dict[str, Any] = {}
    n = 0
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        n += 1
        kind = m.group(3)
        inter = t.shape[1] if kind == "down_proj" else t.shape[0]
        if width < inter:
            raise ValueError(f"width {width} is below {name}'s intermediate size {inter}")
        if kind == "down_proj":
            pad = torch.zeros((t.shape[0], width - inter), dtype=t.dtype)
            out[name] = torch.cat([t, pad], dim=1).contiguous()
        else:
            pad = torch.zeros((width - inter, t.shape[1]), dtype=t.dtype)
            out[name] = torch.cat([t, pad], dim=0).contiguous()
    if n == 0:
        raise ValueError("no expert tensors (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight) found")
    return out


def widened_config(config: dict[str, Any], width: int) -> dict[str, Any]:
    """The target's ``config.json`` with ``moe_intermediate_size = width`` (nothing else changes)."""
    cfg = dict(config)
    cfg["moe_intermediate_size"] = int(width)
    return cfg


def expert_bytes(config: dict[str, Any]) -> int:
    """Bytes of all routed experts of a Qwen3-MoE config (3 matrices hidden x moe_intermediate each).

    The weights are stored as ``config["dtype"]`` (bf16/fp16: 2 bytes, float32: 4).
    """
    width = {"bfloat16": 2, "float16": 2, "float32": 4}.get(str(config.get("dtype", "bfloat16")), 2)
    layers = int(config["num_hidden_layers"]) - len(config.get("mlp_only_layers") or [])
    experts = int(config.get("num_experts", config.get("num_local_experts")))
    return layers * experts * 3 * int(config["hidden_size"]) * int(config["moe_intermediate_size"]) * width


_TARGET_FILES = ("target/config.json", "target/generation_config.json", "target/model.safetensors")


def write_widened(src: Path, tmp: Path, width: int) -> dict[str, Any]:
    """Write the widened target and the copied files of model set ``src`` into the empty folder ``tmp``.

    Returns:
        The widened target's config.
    """
    from safetensors.torch import load_file, save_file

    (tmp / "target").mkdir()
    (tmp / "draft").mkdir()
    for rel in COPIED:
        shutil.copyfile(src / rel, tmp / rel)
    cfg = json.loads((src / "target" / "config.json").read_text())
    wide_cfg = widened_config(cfg, width)
    (tmp / "target" / "config.json").write_text(json.dumps(wide_cfg, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(src / "target" / "generation_config.json", tmp / "target" / "generation_config.json")
    state = load_file(str(src / "target" / "model.safetensors"))
    save_file(widen_state(state, width), str(tmp / "target" / "model.safetensors"), metadata={"format": "pt"})
    return wide_cfg


def read_recipe(set_id: str) -> dict[str, Any] | None:
    """The shipped recipe of a derived model set, or None when ``set_id`` is not one.

    Raises:
        ValueError: A malformed recipe (one line naming the file and the field).
    """
    if not set_id or "/" in set_id or "\\" in set_id or set_id in (".", ".."):
        return None
    path = package_data("models", set_id, RECIPE)
    if not path.is_file():
        return None
    from specenv.validation import read_json

    doc = read_json(path, what="model recipe")
    if not isinstance(doc, dict) or doc.get("format") != RECIPE_FORMAT:
        raise ValueError(f"{path}: format must be {RECIPE_FORMAT!r}")
    width = doc.get("moe_intermediate_size")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"{path}: moe_intermediate_size must be a positive integer, got {width!r}")
    if not isinstance(doc.get("source"), str):
        raise ValueError(f"{path}: source must be a model-set id")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) and len(v) == 64 for v in files.values()):
        raise ValueError(f"{path}: files must map each built file to its sha256")
    return doc


def derived_ids() -> list[str]:
    """Ids of the shipped derived model sets (folders with a recipe), sorted."""
    root = package_data("models")
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / RECIPE).is_file())


def derived_dir(set_id: str) -> Path:
    """Where :func:`build_derived_set` writes (and the engines read) a derived set: the user's cache.

    Raises:
        ValueError: The disk cache is disabled (``SPECENV_CACHE=off``): a derived set needs a place.
    """
    base = cache_dir()
    if base is None:
        raise ValueError(
            f"models={set_id!r}: a derived model set is built into the cache, which is off (SPECENV_CACHE)"
        )
    return base / "models" / set_id


def is_built(set_id: str) -> bool:
    """Whether the derived set's folder exists in the cache (its files are checked on load)."""
    try:
        return (derived_dir(set_id) / "manifest.json").is_file()
    except ValueError:
        return False


def build_derived_set(set_id: str, out: str | os.PathLike[str] | None = None, check: bool = True) -> Path:
    """Build a derived model set from its shipped recipe; returns its folder.

    Deterministic: the same source files and recipe give byte-identical files. The folder is written
    next to its destination and renamed into place only after every file's sha256 matched the recipe
    (``check``), so an interrupted or wrong build leaves nothing behind.

    Args:
        set_id: The derived set's id (``wide-moe-v1``).
        out: Destination (default :func:`derived_dir`). An existing folder is replaced only if it is a
            derived set of the same id (its manifest says so).
        check: Compare every written file with the recipe's sha256 (off only to *make* a recipe).

    Raises:
        ValueError: Unknown id, a source file whose sha256 differs from the source set's manifest, or a
            built file whose sha256 differs from the recipe (one line naming the file).
    """
    from specenv.engines.hf.manifest import check_files, read_model_manifest

    recipe = read_recipe(set_id)
    if recipe is None:
        raise ValueError(f"models={set_id!r}: not a derived model set ({', '.join(derived_ids()) or 'none'})")
    src = package_data("models", recipe["source"])  # a shipped set (not derived): its own folder
    if not (src / "manifest.json").is_file():
        raise ValueError(f"{set_id}: its source model set {recipe['source']!r} is not shipped")
    src_manifest = read_model_manifest(src)
    problem = check_files(src, src_manifest)
    if problem is not None:
        raise ValueError(f"{src}: {problem} (the source of {set_id} does not match its manifest)")
    width = int(recipe["moe_intermediate_size"])
    dest = Path(out) if out is not None else derived_dir(set_id)
    replace = False
    if dest.exists():
        old = dest / "manifest.json"
        try:
            same = json.loads(old.read_text()).get("derived", {}).get("id") == set_id
        except (OSError, ValueError, AttributeError):
            same = False
        if not same:
            raise ValueError(f"{dest}: exists and is not a build of {set_id}; not replaced")
        replace = True
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(dest, replace=replace) as tmp:
        wide_cfg = write_widened(src, tmp, width)
        files = {rel: sha256_file(tmp / rel) for rel in sorted([*COPIED, *_TARGET_FILES])}
        if check:
            for rel, digest in files.items():
                want = recipe["files"].get(rel)
                if want != digest:
                    raise ValueError(
                        f"{set_id}: built {rel} has sha256 {digest[:12]}..., the recipe says {str(want)[:12]}..."
                    )
        manifest = {
            "name": recipe.get("name", set_id.rsplit("-v", 1)[0]),
            "version": recipe.get("version", 1),
            "description": recipe.get("description", ""),
            "derived": {"id": set_id, "source": recipe["source"], "moe_intermediate_size": width},
            "target": {
                "class": src_manifest.get("target", {}).get("class", "Qwen3MoeForCausalLM"),
                "params": _params(tmp / "target" / "model.safetensors"),
                "expert_bytes": expert_bytes(wide_cfg),
            },
            "draft": src_manifest.get("draft", {}),
            "files": {rel: {"sha256": d, "bytes": (tmp / rel).stat().st_size} for rel, d in files.items()},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


def _params(path: Path) -> int:
    """Parameters in a safetensors file (from its header: no tensor is read)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    total = 0
    for name, ent in header.items():
        if name == "__metadata__":
            continue
        size = 1
        for d in ent["shape"]:
            size *= int(d)
        total += size
    return total
