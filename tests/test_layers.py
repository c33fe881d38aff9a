"""The layers of DESIGN.md section 7, as import-linter contracts ([tool.importlinter] in pyproject.toml)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Every contract the design promises (DESIGN.md section 7); none may be dropped from pyproject.toml.
CONTRACT_IDS = {
    "specenv-below-oracle-policies",
    "oracle-numpy-only",
    "engines-below-envs",
    "core-below-envs-engines",
    "no-package-cycle",
    "cli-on-top",
    "abtest-command-module",
    "no-sibling-cycle",
    "ray-optional",
    "specenv-folders",
    "policies-folders",
    "oracle-folders",
}


def test_contracts_are_declared() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert set(config["root_packages"]) == {"specenv", "oracle", "policies"}
    assert config["include_external_packages"] is True  # "oracle does not import gymnasium" needs it
    assert {c["id"] for c in config["contracts"]} == CONTRACT_IDS
    oracle = next(c for c in config["contracts"] if c["id"] == "oracle-numpy-only")
    assert {"gymnasium", "specenv.envs", "specenv.envs.rollout", "policies"} <= set(oracle["forbidden_modules"])


def test_lint_imports_keeps_every_contract() -> None:
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip("import-linter is not installed (it is in the 'dev' extra: pip install -e '.[dev]')")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    run_cli = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    res = subprocess.run(
        [sys.executable, "-c", run_cli, "--no-cache"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"Contracts: {len(CONTRACT_IDS)} kept, 0 broken." in res.stdout, res.stdout
