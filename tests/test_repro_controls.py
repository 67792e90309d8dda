"""The control table's comparison (bench.repro.controls): two runs at shared NLL levels, each level
represented by the run's least-KL checkpoint reaching it, and the same checkpoints' KL by kind."""

import pytest

from bench.repro.controls import Point, compare, learned, per_seed


def _run(seed: int, scale: float, split: bool = True) -> list[Point]:
    # NLL falls over training while KL grows; the prompt share of KL is 1/4 (by position-weighted mean).
    return [
        Point(seed, nll, kl * scale, {"prompt": 0.5 * kl * scale, "response": 2 * kl * scale} if split else None)
        for nll, kl in ((0.90, 0.01), (0.85, 0.02), (0.80, 0.04))
    ]


def test_ratio_at_shared_levels_and_by_kind():
    a = _run(0, 0.1) + _run(1, 0.1)
    b = _run(0, 1.0) + _run(1, 1.0)
    r = compare(a, b, 3)
    assert r["seeds"] == [0, 1] and len(r["levels"]) == 3
    assert r["all"] == pytest.approx(0.1) and r["prompt"] == pytest.approx(0.1) and r["response"] == pytest.approx(0.1)


def test_least_kl_checkpoint_reaching_the_level_represents_a_run():
    a = [Point(0, 0.80, 0.02, None), Point(0, 0.80, 0.05, None)]  # two checkpoints at one NLL: the lesser KL counts
    b = [Point(0, 0.80, 0.04, None)]
    assert compare(a, b, 1)["all"] == pytest.approx(0.5)


def test_kinds_only_where_both_runs_are_split_and_no_shared_seed():
    r = compare(_run(0, 0.1), _run(0, 1.0, split=False), 3)
    assert "all" in r and "prompt" not in r and "response" not in r
    assert compare(_run(0, 0.1), _run(1, 1.0), 3) == {"seeds": []}


def test_kinds_over_the_split_seeds_only():
    r = compare(_run(0, 0.1) + _run(1, 0.2, split=False), _run(0, 1.0) + _run(1, 1.0), 3)
    assert r["all"] == pytest.approx((0.1 * 0.2) ** 0.5)  # both seeds
    assert r["prompt"] == pytest.approx(0.1) and r["prompt_seeds"] == [0]  # seed 1 is not split


def test_positions_neither_run_moved_are_named_not_divided():
    """Answer-only updates leave every prompt position's KL at exactly 0 on both sides: no ratio."""
    zero = lambda seed, scale: [
        Point(p.seed, p.nll, p.kl, {"prompt": 0.0, "response": p.by_kind["response"]}) for p in _run(seed, scale)
    ]
    r = compare(zero(0, 0.1), zero(0, 1.0), 3)
    assert r["prompt_zero"] == "both" and "prompt" not in r and r["response"] == pytest.approx(0.1)
    assert compare(zero(0, 0.1), _run(0, 1.0), 3)["prompt_zero"] == "first"  # a ratio of 0: only the second moved them
    assert "prompt_zero" not in compare(_run(0, 1.0), zero(0, 0.1), 3)  # only the first moved them: no finite ratio


def test_each_seeds_own_ratio_beside_the_mean():
    a, b = _run(0, 0.1) + _run(1, 0.4) + _run(2, 0.3), _run(0, 1.0) + _run(1, 1.0)  # seed 2 has no partner
    assert per_seed(a, b, 3) == pytest.approx({0: 0.1, 1: 0.4})
    assert compare(a, b, 3)["all"] == pytest.approx((0.1 * 0.4) ** 0.5)


def test_a_pair_sharing_no_level_below_the_base_is_uninformative():
    a, b = _run(0, 0.1), [Point(0, nll + 0.3, kl, None) for nll, kl in ((0.90, 0.01), (0.85, 0.02))]  # b got worse
    levels = compare(a, b, 3)["levels"]
    assert not learned(levels, base=1.0) and learned(compare(a, _run(0, 1.0), 3)["levels"], base=1.0)
