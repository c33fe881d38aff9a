"""Third-party warnings never reach the terminal before a refusal's one line (``SPECENV_WARNINGS=1`` shows them).

Each case runs ``specenv`` in a subprocess (pytest's own warning capture would hide what a user sees):
a library underneath warns while the command runs (as statsmodels, numpy, gymnasium or Ray do), then
the command is refused. stderr holds the one error line only; with ``SPECENV_WARNINGS=1`` or a
Python ``-W`` option the warning is shown as Python shows it. specenv's own warnings stay visible.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.hostile.harness import Outcome, assert_rejected

#: A command that warns from "a library" (here: a numpy-like RuntimeWarning and a gymnasium-like
#: UserWarning, issued inside the command), then is refused on a missing trace set.
CODE = """
import sys, warnings
import specenv.cli.common as common
real = common.load_traces
def noisy(traces):
    warnings.warn("overflow encountered in multiply", RuntimeWarning)
    warnings.warn("WARN: env.reset() obs is not within the observation space", UserWarning)
    {own}
    return real(traces)
import specenv.cli.fit as fit_mod
fit_mod.load_traces = noisy
sys.argv = ["specenv", "fit", "no-such-set", "--json"]
from specenv.cli import main
main()
"""


def _run(code: str, *python_args: str, **env: str) -> Outcome:
    environ = {k: v for k, v in os.environ.items() if k not in ("SPECENV_WARNINGS", "PYTHONWARNINGS")} | env
    p = subprocess.run(
        [sys.executable, *python_args, "-c", code], capture_output=True, text=True, timeout=60, env=environ
    )
    return Outcome(p.returncode, p.stdout, p.stderr)


def test_library_warnings_do_not_precede_the_error_line():
    out = _run(CODE.format(own=""))
    assert_rejected(out, "no-such-set")


@pytest.mark.parametrize(("python_args", "env"), [((), {"SPECENV_WARNINGS": "1"}), (("-W", "default"), {})])
def test_library_warnings_shown_when_asked(python_args, env):
    out = _run(CODE.format(own=""), *python_args, **env)
    assert out.exit_code == 2
    assert "RuntimeWarning: overflow encountered in multiply" in out.stderr
    assert "UserWarning: WARN: env.reset()" in out.stderr
    assert out.stderr.splitlines()[-1].startswith("specenv: error: ")


def test_specenvs_own_warnings_stay_visible():
    out = _run(CODE.format(own='warnings.warn("specenv.engines.vllm is tested with vLLM 0.32", RuntimeWarning)'))
    assert out.exit_code == 2
    assert "specenv.engines.vllm is tested with vLLM" in out.stderr
    assert "overflow" not in out.stderr
