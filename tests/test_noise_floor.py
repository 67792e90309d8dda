"""The flip noise floor in the NFR gate (flows/noise_floor.py): reported beside F always, and
with `nfr.above_floor` the bound is computed on the flips above it; missing: fail closed."""

from __future__ import annotations

import pytest

from flows.gates import nfr_checks
from flows.metrics import CandidateMetrics
from flows.policy import NfrLimits, ReleasePolicy, wilson_upper
from registry import Flips


def _metrics(floor: dict) -> CandidateMetrics:
    return CandidateMetrics(
        1,
        "c",
        "atlas",
        0,
        1,
        1,
        1,
        4,
        1,
        flips_vs_champion={"gsm8k": Flips(16, 3, 0, 1)},
        flips_vs_base={"gsm8k": Flips(16, 0, 0, 0)},
        flips_floor=floor,
    )


def _policy(above_floor: bool) -> ReleasePolicy:
    return ReleasePolicy(
        nfr=NfrLimits(max_vs_champion={"gsm8k": 0.3}, max_vs_base={"gsm8k": 1.0}, above_floor=above_floor)
    )


def _check(floor: dict, above_floor: bool):
    return next(
        c
        for c in nfr_checks(_metrics(floor), _policy(above_floor), ["gsm8k"])
        if c.name == "nfr_upper_vs_champion[gsm8k]"
    )


def test_the_floor_is_reported_but_not_subtracted_by_default():
    check = _check({"gsm8k": Flips(16, 2, 1, 0)}, above_floor=False)
    assert check.measured == pytest.approx(wilson_upper(3, 16)) and not check.passed
    assert "noise floor F=2 G=1 W=0" in check.detail


def test_above_floor_judges_the_flips_above_the_floor():
    check = _check({"gsm8k": Flips(16, 2, 1, 0)}, above_floor=True)
    assert check.measured == pytest.approx(wilson_upper(1, 16)) and check.passed  # 3 - 2 = 1 flip
    assert "judged on the 1 flip(s) above the floor" in check.detail
    more = _check({"gsm8k": Flips(16, 5, 0, 0)}, above_floor=True)  # a floor above F counts as zero, never negative
    assert more.measured == pytest.approx(wilson_upper(0, 16))


@pytest.mark.parametrize("floor", [{}, {"gsm8k": Flips(8, 0, 0, 0)}])
def test_above_floor_without_a_floor_on_these_questions_fails_closed(floor):
    check = _check(floor, above_floor=True)
    assert not check.passed and check.measured is None and "noise floor was not measured" in check.detail
