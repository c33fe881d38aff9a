"""The README's commands, run as written: every fenced block whose info string says ``readme-test``.

Blocks run from a fresh temporary folder (not the checkout, so nothing relies on the working
directory), bash blocks with ``bash -euo pipefail`` and the venv's scripts on PATH, Python blocks
with this interpreter and PATH as it is (as ``.venv/bin/python file.py`` runs: a block that calls
the ``specenv`` script by name fails here). What cannot run inside the suite (``make demo``,
``make test``, long training, serving) is in blocks without the marker, and README says how long
each takes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\w+)[ \t]+readme-test[^\n]*\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    """(language, code) of every marked block, in README order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README.read_text(encoding="utf-8"))]


def test_readme_marks_blocks():
    langs = [lang for lang, _ in blocks()]
    assert langs.count("bash") >= 2 and langs.count("python") >= 1, langs


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(blocks())))
def test_readme_block_runs_as_written(index: int, tmp_path: Path) -> None:
    lang, code = blocks()[index]
    env = dict(os.environ)
    env["MPLBACKEND"] = "Agg"
    if (
        lang == "bash"
    ):  # a shell with the venv active; a Python block runs as `.venv/bin/python file.py` (PATH as it is)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    elif lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        pytest.fail(f"README block {index}: unknown language {lang!r}")
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"README block {index} ({lang}) failed:\n{code}\n--- stderr:\n{p.stderr[-4000:]}"
