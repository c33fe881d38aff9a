"""The harness itself: it must fail on what it is meant to catch."""

from __future__ import annotations

import pytest

from tests.hostile.harness import Outcome, assert_rejected, assert_unchanged, run_cli, snapshot


def test_assert_rejected_catches_tracebacks_panels_and_exit_codes():
    assert_rejected(Outcome(2, "", "specenv: error: --kmax: 0 outside 1..10\n"), "--kmax")
    for bad in (
        Outcome(1, "", "specenv: error: --kmax: bad\n"),
        Outcome(2, "", "Usage: specenv [OPTIONS]\nTry 'specenv --help'\nError: bad\n"),
        Outcome(2, "", "Traceback (most recent call last):\nValueError: x\n"),
        Outcome(2, "partial output", "specenv: error: --kmax: bad\n"),
        Outcome(2, "", "specenv: error: something else\n"),
    ):
        with pytest.raises(AssertionError):
            assert_rejected(bad, "--kmax")


def test_snapshot_sees_writes_and_deletes(tmp_path):
    (tmp_path / "a").write_text("1")
    before = snapshot(tmp_path)
    (tmp_path / "b").write_text("2")
    with pytest.raises(AssertionError):
        assert_unchanged(before, snapshot(tmp_path))
    (tmp_path / "b").unlink()
    (tmp_path / "a").unlink()
    with pytest.raises(AssertionError):
        assert_unchanged(before, snapshot(tmp_path))


def test_run_cli_reports_a_bad_option():
    out = run_cli(["validate", "no-such-set-anywhere"])
    assert out.exit_code == 2
