"""The line's score matrix: one 0-1 scale for every skill, TRACE's OP and BWT by hand, the
history plot's panels and retention (KL vs the teaching release)."""

import math

import pytest

from flows.history import LOSS, SOLVED, LineHistory


def history() -> LineHistory:
    # Release 1 teaches code (share solved), release 2 math (reference NLL, lower is better),
    # release 3 retrains code. Release 3's evaluation predates KL vs teacher: it stored none.
    return LineHistory(
        releases=["base", "v1", "v2", "v3"],
        parents=["-", "base", "v1", "v2"],
        skills=["code", "math", "code"],
        kinds=[SOLVED, LOSS, SOLVED],
        scores=[[None, None, None], [0.25, None, None], [0.20, 0.90, None], [0.30, 0.95, 0.35]],
        kl_vs_base=[{}, {"csqa": 0.01}, {"csqa": 0.02, "code": 0.03}, {"csqa": 0.02, "code": 0.04, "math": 0.05}],
        kl_vs_teacher=[{}, {}, {"code": 0.004}, {}],
    )


def test_op_averages_solved_shares_and_exp_minus_nll_on_one_scale():
    # The main job's case: a share of 0.156 and an NLL of 1.141 once averaged to 0.6485.
    h = LineHistory(
        ["base", "v1", "v2"],
        ["-", "base", "v1"],
        ["code", "gsm8k-format"],
        [SOLVED, LOSS],
        [[None, None], [0.156, None], [0.156, 1.141]],
        [{}, {}, {}],
        [{}, {}, {}],
    )
    assert h.op(2) == pytest.approx((0.156 + math.exp(-1.141)) / 2)  # 0.2378, not 0.6485
    assert h.scaled(2) == pytest.approx([0.156, 0.31950], abs=1e-5)


def test_overall_performance_and_backward_transfer_follow_trace():
    h = history()
    assert h.op(0) is None and h.op(1) == pytest.approx(0.25)
    assert h.op(2) == pytest.approx((0.20 + math.exp(-0.90)) / 2)
    assert h.op(3) == pytest.approx((0.30 + math.exp(-0.95) + 0.35) / 3)
    assert h.bwt(1) is None  # nothing released before release 1
    assert h.bwt(2) == pytest.approx(0.20 - 0.25)  # code lost 0.05: negative
    # code gained 0.05; math's NLL rose by 0.05, a loss: its exp(-NLL) fell, so it counts negative
    assert h.bwt(3) == pytest.approx(((0.30 - 0.25) + (math.exp(-0.95) - math.exp(-0.90))) / 2)


def test_bwt_is_positive_when_a_later_release_lowers_an_earlier_skills_nll():
    h = history()
    h.scores[3][:2] = [0.25, 0.80]  # code kept, math's NLL fell: later releases helped
    assert h.bwt(3) > 0 and h.bwt(3) == pytest.approx((math.exp(-0.80) - math.exp(-0.90)) / 2)


def test_a_missing_cell_leaves_op_and_bwt_undefined_and_the_table_shows_it():
    h = history()
    h.scores[3][1] = None
    assert h.op(3) is None and h.bwt(3) is None
    table = h.to_markdown()
    assert "| 3 | v3 | v2 | code | 0.3 | - | 0.35 | - | - |" in table
    assert "math: mean loss (e.g. reference NLL, nats/token; lower is better)" in table
    assert h.metrics() == {
        "line_R_1_code": 0.30,
        "line_R_3_code": 0.35,
        "line_S_1_code": 0.30,
        "line_S_3_code": 0.35,
        "line_kl_vs_base_csqa": 0.02,
        "line_kl_vs_base_code": 0.04,
        "line_kl_vs_base_math": 0.05,
    }  # newest row


def test_the_table_keeps_the_raw_nll_next_to_its_score():
    row = next(line for line in history().to_markdown().splitlines() if line.startswith("| 2 |"))
    assert f"| 0.9 ({math.exp(-0.9):.4g}) |" in row  # raw NLL, its exp(-NLL) in brackets


def test_an_nll_below_zero_is_off_the_scale_not_clipped():
    h = history()
    h.scores[2][1] = -0.1  # exp(0.1) > 1: no place on the 0-1 scale
    assert h.scaled(2)[1] is None and h.op(2) is None
    assert "| -0.1 |" in h.to_markdown()


def test_kl_vs_teacher_is_shown_where_stored_and_a_dash_where_not():
    table = history().to_markdown().splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in table[2:6]}
    # a skill's retention sits next to its drift vs the base; configured domains have no teacher
    assert head[-5:] == [
        "KL vs base [csqa]",
        "KL vs teacher [code]",
        "KL vs base [code]",
        "KL vs teacher [math]",
        "KL vs base [math]",
    ]
    assert rows["2"][-5:] == ["0.02", "0.004", "0.03", "-", "-"]
    assert rows["3"][-5:] == ["0.02", "-", "0.04", "-", "0.05"]  # stored before KL vs teacher: '-', never a guess
    assert history().metrics()["line_kl_vs_base_code"] == 0.04 and "line_kl_vs_teacher_code" not in history().metrics()


def test_the_history_plot_has_one_axis_per_kind_of_number():
    import matplotlib.pyplot as plt

    from evaluation.plots import history_figure

    h = history()
    fig = history_figure(h.releases, h.panels())
    try:
        axes = {ax.get_title(): ax for ax in fig.axes}
        assert {t: ax.get_ylabel() for t, ax in axes.items()} == {
            "Solved-problem skills": "share solved (0-1)",
            "Loss skills (e.g. reference NLL)": "exp(-loss): per-token probability (0-1)",
            "The line (TRACE)": "mean of skill scores (0-1 scale)",
            "Drift: retained KL vs the base": "nats/token",
            "Released skills: KL vs teacher and vs base": "nats/token",
        }  # no mean-score skill: no empty panel
        labels = {t: [line.get_label() for line in ax.get_lines()] for t, ax in axes.items()}
        assert labels["Solved-problem skills"] == ["1: code", "3: code"]
        assert labels["Loss skills (e.g. reference NLL)"] == ["2: math"]  # never on the shares' axis
        assert labels["Drift: retained KL vs the base"] == ["csqa"]  # a skill's intended change is not drift
        assert labels["Released skills: KL vs teacher and vs base"] == [
            "code vs teacher",
            "code vs base",
            "math vs base",
        ]
        math_line = axes["Loss skills (e.g. reference NLL)"].get_lines()[0]
        assert list(math_line.get_ydata()) == pytest.approx([math.exp(-0.90), math.exp(-0.95)])
    finally:
        plt.close(fig)


def test_history_png_is_written(tmp_path):
    from evaluation.plots import line_history_plot

    h = history()
    assert line_history_plot(h.releases, h.panels(), tmp_path / "history.png").stat().st_size > 0


def test_each_released_skill_is_measured_against_the_newest_release_that_taught_it(monkeypatch):
    from types import SimpleNamespace as NS

    from evaluation.kl import KLResult
    from flows import evaluate
    from flows.resources import CURRENT

    v1, v2, v3 = (NS(name=n, skill=s) for n, s in (("v1", "a"), ("v2", "b"), ("v3", "a")))
    ctx = NS(
        released=(NS(name="a"), NS(name="b")),
        champion=NS(deltas=(v1, v2, v3)),
        members=["csqa", "a", "b"],
        platform="here",
    )
    res = NS(ref="here", resolve_applied=lambda v: f"applied {v.name}")  # the stages' resources, faked
    token = CURRENT.set(res)
    teachers = evaluate.teachers(res, ctx)
    assert teachers == {"a": "applied v3", "b": "applied v2"}  # a was retrained: v3 teaches it now

    # one pass per member against base, champion and (for a released skill) its teacher
    asked, kl_of = {}, {"base": 1.0, "champ": 2.0, "applied v3": 3.0, "applied v2": 4.0}

    def fake_kl(ctx, applied, refs, member):
        asked[member] = refs
        return [KLResult(kl_of[r], [kl_of[r]], 1) for r in refs]

    res.retained_kl = fake_kl
    vs_base, vs_champion, vs_teacher = (
        {m: r.mean for m, r in results.items()}
        for results in evaluate.kl_against.fn(ctx, "me", ["base", "champ"], teachers)
    )
    assert asked == {
        "csqa": ["base", "champ"],
        "a": ["base", "champ", "applied v3"],
        "b": ["base", "champ", "applied v2"],
    }
    assert vs_base == {"csqa": 1.0, "a": 1.0, "b": 1.0} and vs_champion == {"csqa": 2.0, "a": 2.0, "b": 2.0}
    assert vs_teacher == {"a": 3.0, "b": 4.0}
    assert evaluate.kl_against.fn(ctx, "me", ["base"])[-1] == {}  # no teachers: an empty last dict
    CURRENT.reset(token)
