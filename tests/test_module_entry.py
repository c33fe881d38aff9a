"""``python -m specenv`` runs the same command line as the ``specenv`` script."""

import subprocess
import sys


def test_python_m_specenv_runs_the_cli(tmp_path):
    # from another folder, so the checkout's own folder on the path is not what makes it work
    out = subprocess.run(
        [sys.executable, "-m", "specenv", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "bench" in out.stdout and "generate" in out.stdout


def test_python_m_specenv_refuses_bad_arguments_with_exit_2(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "specenv", "generate", "-o", str(tmp_path / "x"), "-n", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert not (tmp_path / "x").exists()
