"""The line's score matrix: TRACE's overall performance and backward transfer by hand."""
import pytest

from flows.history import LineHistory


def history() -> LineHistory:
    # Release 1 teaches code (share solved, higher is better), release 2 math (NLL, lower is better),
    # release 3 retrains code.
    return LineHistory(
        releases=["base", "v1", "v2", "v3"], parents=["-", "base", "v1", "v2"], skills=["code", "math", "code"],
        higher_is_better=[True, False, True],
        scores=[[None, None, None], [0.25, None, None], [0.20, 0.90, None], [0.30, 0.95, 0.35]],
        kl_vs_base=[{}, {"csqa": 0.01}, {"csqa": 0.02, "code": 0.03}, {"csqa": 0.02}])


def test_overall_performance_and_backward_transfer_follow_trace():
    h = history()
    assert h.op(0) is None and h.op(1) == pytest.approx(0.25)
    assert h.op(2) == pytest.approx((0.20 + 0.90) / 2)
    assert h.op(3) == pytest.approx((0.30 + 0.95 + 0.35) / 3)
    assert h.bwt(1) is None  # nothing released before release 1
    assert h.bwt(2) == pytest.approx(0.20 - 0.25)
    # code gained 0.05; math's NLL rose by 0.05, a loss: BWT counts it negative
    assert h.bwt(3) == pytest.approx(((0.30 - 0.25) - (0.95 - 0.90)) / 2)


def test_a_missing_cell_leaves_op_and_bwt_undefined_and_the_table_shows_it():
    h = history()
    h.scores[3][1] = None
    assert h.op(3) is None and h.bwt(3) is None
    table = h.to_markdown()
    assert "| 3 | v3 | v2 | code | 0.3 | - | 0.35 | - | - |" in table
    assert "math: mean reference NLL, lower is better" in table
    assert h.metrics() == {"line_R_1_code": 0.30, "line_R_3_code": 0.35, "line_kl_vs_base_csqa": 0.02}  # newest row
