"""Matched comparison at shared requirements, on hand-made checkpoints worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from evaluation.compare import Checkpoint, matched_comparison, min_kl_at, shared_levels
from evaluation.plots import churn_bars, tradeoff_plot

C = Checkpoint

# Two methods x two seeds. Solved counts and KLs chosen so every value is easy to follow.
RECORDS = [
    # atlas seed 0: reaches 10..13
    C("atlas", 0, 10, 0.5),
    C("atlas", 0, 12, 0.2),
    C("atlas", 0, 13, 0.4),
    # atlas seed 1: reaches 11..14
    C("atlas", 1, 11, 0.1),
    C("atlas", 1, 14, 0.8),
    # baseline seed 0: reaches 9..12  (KL 1.0 at 12 dominates the 9-checkpoint for k <= 12)
    C("lora", 0, 9, 2.0),
    C("lora", 0, 12, 1.0),
    # baseline seed 1: reaches 10..13
    C("lora", 1, 10, 0.05),
    C("lora", 1, 13, 0.4),
]


def test_shared_levels_are_the_range_every_run_reaches() -> None:
    # max of per-run minimums = max(10, 11, 9, 10) = 11; min of per-run maximums = min(13, 14, 12, 13) = 12
    assert shared_levels(RECORDS) == [11.0, 12.0]


def test_min_kl_at_uses_checkpoints_reaching_k() -> None:
    run = [c for c in RECORDS if c.method == "atlas" and c.seed == 0]
    assert min_kl_at(run, 10) == 0.2  # 10, 12 and 13 all reach 10; the 12-checkpoint is cheapest
    assert min_kl_at(run, 13) == 0.4
    with pytest.raises(ValueError, match="no checkpoint reaching 14"):
        min_kl_at(run, 14)


def test_matched_comparison_by_hand() -> None:
    cmp = matched_comparison(RECORDS, method="atlas", baseline="lora")
    # k = 11: atlas s0 min(0.2, 0.4) = 0.2, s1 min(0.1, 0.8) = 0.1; lora s0 1.0, s1 0.4
    # k = 12: atlas s0 0.2, s1 0.8;                                  lora s0 1.0, s1 0.4
    assert cmp.values["atlas"] == {0: [0.2, 0.2], 1: [0.1, 0.8]}
    assert cmp.values["lora"] == {0: [1.0, 1.0], 1: [0.4, 0.4]}
    assert cmp.ratios[0] == pytest.approx([0.2, 0.2]) and cmp.ratios[1] == pytest.approx([0.25, 2.0])
    expected = (0.2 * 0.2 * 0.25 * 2.0) ** 0.25  # = 0.02 ** 0.25 = 0.376
    assert cmp.ratio == pytest.approx(expected) and cmp.reduction == pytest.approx(1 - expected)
    assert cmp.seed_ratios[0] == pytest.approx(0.2) and cmp.seed_ratios[1] == pytest.approx(math.sqrt(0.5))
    assert cmp.level_ratios == pytest.approx([math.sqrt(0.05), math.sqrt(0.4)])
    assert cmp.favour_seeds == {"atlas": 2, "lora": 0, "tie": 0}
    assert cmp.favour_levels == {"atlas": 2, "lora": 0, "tie": 0}


def test_baseline_favoured_and_explicit_levels() -> None:
    cmp = matched_comparison(RECORDS, method="lora", baseline="atlas", levels=[12])
    # k = 12 only: ratios lora/atlas = 1.0/0.2 = 5 and 0.4/0.8 = 0.5
    assert cmp.ratios == {0: pytest.approx([5.0]), 1: pytest.approx([0.5])}
    assert cmp.favour_seeds == {"lora": 1, "atlas": 1, "tie": 0}
    assert cmp.ratio == pytest.approx(math.sqrt(2.5))


def test_lower_is_better_float_levels() -> None:
    # Held-out NLL levels: a checkpoint reaches t when its NLL <= t.
    recs = [
        C("atlas", 0, 2.0, 0.3),
        C("atlas", 0, 1.5, 0.6),
        C("atlas", 0, 1.2, 0.9),
        C("lora", 0, 2.1, 0.5),
        C("lora", 0, 1.4, 1.2),
    ]
    # per-run [min, max]: atlas [1.2, 2.0], lora [1.4, 2.1] -> shared [1.4, 2.0]
    assert shared_levels(recs, "lower", n_grid=3) == pytest.approx([1.4, 1.7, 2.0])
    with pytest.raises(ValueError, match="not integers"):
        shared_levels(recs, "lower")
    cmp = matched_comparison(recs, "atlas", "lora", direction="lower", n_grid=3)
    # t=1.4: atlas {1.2: 0.9} -> 0.9 (1.5 > 1.4), lora {1.4} -> 1.2 ; t=1.7: atlas 0.6, lora 1.2 ; t=2.0: 0.3 vs 1.2
    assert cmp.values == {"atlas": {0: pytest.approx([0.9, 0.6, 0.3])}, "lora": {0: pytest.approx([1.2, 1.2, 1.2])}}
    assert cmp.ratio == pytest.approx((0.75 * 0.5 * 0.25) ** (1 / 3))


def test_non_overlapping_runs_compare_at_the_reachable_end() -> None:
    recs = [C("a", 0, 10, 1.0), C("a", 0, 12, 2.0), C("b", 0, 3, 4.0), C("b", 0, 5, 8.0)]
    # b never exceeds 5; a reaches 5 with all its checkpoints -> only k = 5 carries information
    assert shared_levels(recs) == [5.0]
    assert matched_comparison(recs, "a", "b").ratio == pytest.approx(1.0 / 8.0)
    # Float levels on a grid: the collapsed range is one level, not n_grid copies of it
    # (copies would count one level n_grid times among the levels favouring a method).
    assert shared_levels(recs, n_grid=8) == [5.0]
    lower = [C("a", 0, 0.85, 1.0), C("a", 0, 0.80, 2.0), C("b", 0, 0.90, 4.0), C("b", 0, 0.87, 8.0)]
    assert shared_levels(lower, "lower", n_grid=8) == [0.87]
    assert matched_comparison(lower, "a", "b", direction="lower", n_grid=8).levels == [0.87]


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="seeds \\[1\\]"):
        matched_comparison([c for c in RECORDS if not (c.method == "lora" and c.seed == 1)], "atlas", "lora")
    with pytest.raises(ValueError, match="KL must be finite and > 0"):
        shared_levels([C("a", 0, 1, 0.0)])
    with pytest.raises(ValueError, match="direction"):
        shared_levels(RECORDS, direction="up")


def test_markdown_and_plots(tmp_path: Path) -> None:
    from evaluation.compare import markdown_table

    cmp = matched_comparison(RECORDS, "atlas", "lora")
    table = markdown_table(cmp)
    assert "| 11 | 0.1414 | 0.6325 | 0.224 |" in table  # sqrt(0.2*0.1), sqrt(1.0*0.4), sqrt(0.05)
    assert "0.376 (reduction 62.4%)" in table  # 1 - 0.02 ** 0.25
    png = tradeoff_plot(RECORDS, tmp_path / "tradeoff.png", shared=cmp.levels)
    bars = churn_bars(
        {"v1": {"n": 10, "F": 1, "G": 2, "W": 1}, "v2": {"n": 10, "F": 0, "G": 1, "W": 0}}, tmp_path / "churn.png"
    )
    for path in (png, bars):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_one_shared_level_is_drawn_as_a_line(tmp_path: Path, monkeypatch) -> None:
    import evaluation.plots as plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or Path(path))
    for shared in ([12.0], [11.0, 13.0]):
        tradeoff_plot(RECORDS, tmp_path / "t.png", shared=shared)
    (line_fig, span_fig) = (f.axes[0] for f in figures)
    labels = dict(zip(*reversed(line_fig.get_legend_handles_labels())))
    assert list(labels["shared level"].get_xdata()) == [12.0, 12.0]
    assert "shared levels" in span_fig.get_legend_handles_labels()[1]
