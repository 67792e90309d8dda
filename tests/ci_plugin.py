"""In CI (CI=true) a skipped test fails the run: a missing service (PostgreSQL) or data file
must turn CI red, not green. Locally a skip stays a skip, with its reason in the summary.

The one exception: a test marked `cuda` (tests/test_cuda_paths.py) may skip under CI=true on a
machine without a CUDA device, where it cannot run; it still shows as a skip with its reason
(`-rs`). Where a device exists, a skipped `cuda` test fails CI like any other."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail") and not _cuda_without_device(item):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which fails the run (a service or data file is missing): {reason}"


def _cuda_without_device(item) -> bool:
    if item.get_closest_marker("cuda") is None:
        return False
    import torch  # only for a `cuda` test: the plugin itself needs no torch

    return not torch.cuda.is_available()
