"""CI=true turns a skip (missing service or data) into a failure; locally it stays a skip."""

from __future__ import annotations

pytest_plugins = ["pytester"]

EXAMPLE = """
import pytest

@pytest.mark.skipif(True, reason="data files not available")
def test_needs_data():
    pass

def test_needs_a_server():
    pytest.skip("PostgreSQL is not reachable")

@pytest.mark.xfail(reason="known")
def test_expected_to_fail():
    assert False

def test_plain():
    pass
"""


def test_skips_fail_under_ci_and_stay_skips_locally(pytester, monkeypatch):
    pytester.makepyfile(EXAMPLE)
    monkeypatch.delenv("CI", raising=False)
    pytester.runpytest("-p", "tests.ci_plugin").assert_outcomes(passed=1, skipped=2, xfailed=1)
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest("-p", "tests.ci_plugin", "-rA")
    result.assert_outcomes(passed=1, failed=1, errors=1, xfailed=1)  # skipif fails in setup: an error
    result.stdout.fnmatch_lines(["*skipped under CI=true*PostgreSQL is not reachable*"])
