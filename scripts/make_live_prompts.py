"""Build the live engine's prompt set: code prompts cut from the Python standard library's source.

Prompts come only from the *validation* files of ``scripts/train_small_models.py`` (the split rule is
repeated here and must stay identical), so the small models never trained on them. Each prompt is a
piece of a real source file ending at a point where code naturally continues:

* ``function_body``: a module-level function, cut after its signature (and docstring, if any);
* ``class_method``: a method of a class, cut after its signature (and docstring);
* ``docstring``: a function or method, cut right after the opening quotes of its docstring;
* ``test_code``: a ``test_*`` method in a test file (under a ``test``/``tests`` folder or named
  ``test_*.py``), cut after its signature.

Each prompt starts on a line boundary 300-1500 characters before the cut (drawn per prompt), so the
model sees some of the file above. Everything is deterministic (sorted files, ``default_rng(seed)``);
prompts are ordered round-robin over the categories so that any prefix of the list is balanced.

Usage: ``python scripts/make_live_prompts.py`` writes ``specenv/data/prompts/stdlib-code-v1.json``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import platform
import sysconfig
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "specenv" / "data" / "prompts" / "stdlib-code-v1.json"
CATEGORIES = ("function_body", "class_method", "docstring", "test_code")


def is_val(rel: str) -> bool:
    """Validation split of scripts/train_small_models.py (keep identical)."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 20 == 0


def val_files() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in p.parts or "__pycache__" in p.parts or not is_val(rel):
            continue
        try:
            text = p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append((rel, text))
    return out


def line_offsets(text: str) -> list[int]:
    offs = [0]
    for line in text.splitlines(keepends=True):
        offs.append(offs[-1] + len(line))
    return offs


def candidates(rel: str, text: str) -> dict[str, list[tuple[int, int]]]:
    """Per category, (cut offset, line number) of every usable cut point in one file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    offs = line_offsets(text)
    parts = rel.split("/")
    is_test = any(d in ("test", "tests") for d in parts[:-1]) or parts[-1].startswith("test_")
    found: dict[str, list[tuple[int, int]]] = {c: [] for c in CATEGORIES}

    def visit(node: ast.AST, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, True)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body0 = child.body[0]
                if len(child.body) < 2 and not isinstance(body0, ast.Expr):
                    continue
                first = min([body0.lineno] + [d.lineno for d in getattr(body0, "decorator_list", [])])
                sig_end = offs[first - 1]  # start of the first body line = end of the signature
                doc = ast.get_docstring(child, clean=False)
                has_doc = doc is not None and isinstance(body0, ast.Expr)
                after_doc = offs[body0.end_lineno] if has_doc and len(child.body) > 1 else None
                if is_test and in_class and child.name.startswith("test"):
                    if not has_doc:
                        found["test_code"].append((sig_end, child.lineno))
                elif not is_test:
                    cat = "class_method" if in_class else "function_body"
                    cut = after_doc if has_doc else sig_end
                    if cut is not None:
                        found[cat].append((cut, child.lineno))
                    if has_doc and body0.end_lineno > body0.lineno:
                        line = text[offs[body0.lineno - 1] : offs[body0.lineno]]
                        q = max(line.find('"""'), line.find("'''"))
                        if q >= 0:
                            found["docstring"].append((offs[body0.lineno - 1] + q + 3, child.lineno))
                visit(child, False)

    visit(tree, False)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    files = val_files()
    pool: dict[str, list[tuple[str, int, int, str]]] = {c: [] for c in CATEGORIES}
    for rel, text in files:
        for cat, cuts in candidates(rel, text).items():
            pool[cat].extend((rel, cut, line, text) for cut, line in cuts)
    chosen: dict[str, list[dict]] = {}
    for cat in CATEGORIES:
        cands = pool[cat]
        # at most 3 prompts per file, so the set is spread over many files
        order = rng.permutation(len(cands))
        per_file: dict[str, int] = {}
        picks = []
        for i in order:
            rel, cut, line, text = cands[i]
            if per_file.get(rel, 0) >= 3:
                continue
            back = int(rng.integers(300, 1501))
            start = text.rfind("\n", 0, max(0, cut - back)) + 1
            prompt = text[start:cut]
            if len(prompt) < 120:
                continue
            per_file[rel] = per_file.get(rel, 0) + 1
            picks.append({"category": cat, "file": rel, "line": line, "text": prompt})
            if len(picks) == a.per_category:
                break
        if len(picks) < a.per_category:
            raise SystemExit(f"only {len(picks)} prompts for {cat}")
        chosen[cat] = picks
    prompts = []
    for i in range(a.per_category):
        for cat in CATEGORIES:
            prompts.append({"id": len(prompts), **chosen[cat][i]})
    doc = {
        "name": "stdlib-code",
        "version": 1,
        "description": "Code prompts cut from validation files of the Python standard library "
        "(never seen by the small models), built by scripts/make_live_prompts.py.",
        "categories": list(CATEGORIES),
        "source": {
            "python": platform.python_version(),
            "seed": a.seed,
            "val_files": len(files),
            "split": "val iff int(sha256(relpath)[:8], 16) % 20 == 0",
        },
        "prompts": prompts,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    counts = {c: sum(p["category"] == c for p in prompts) for c in CATEGORIES}
    print(f"wrote {a.out}: {len(prompts)} prompts {counts}, {len({p['file'] for p in prompts})} files")


if __name__ == "__main__":
    main()
