"""Every method's trainable count is the spec's budget at the configured rank (BASELINES.md table),
on a square o_proj and on one with d_in != d_out; the trainer's summary prints rank and count."""

import pytest

from atlas_core.train.baselines.toplora import toplora_rank
from tests.baseline_fixtures import WEIGHT_METHODS, build, o_proj, tiny, train_steps


def spec_budget(method: str, r: int, d_in: int, d_out: int) -> tuple[int, int]:
    """(rank the method runs at, trainable count) from the spec's table."""
    if method == "lora-null-v2":  # A frozen: d_out * rank, run at rank 2r
        return 2 * r, d_out * 2 * r
    if method == "toplora":  # A, B, Theta (d_in, r_T), gain (r_T,) at r_T = round(2r/3)
        rt = toplora_rank(r)
        return rt, rt * (d_in + d_out) + d_in * rt + rt
    return r, r * (d_in + d_out)


@pytest.mark.parametrize("shape", ["square", "wide"])
@pytest.mark.parametrize("method", WEIGHT_METHODS)
def test_trainable_count_is_the_spec_budget(method, shape):
    model = tiny() if shape == "square" else tiny(family="qwen3", head_dim=32)  # o_proj 64 x 64, or 64 x 128
    d_out, d_in = o_proj(model).weight.shape
    assert (d_in, d_out) == ((64, 64) if shape == "square" else (128, 64))
    r = 8
    adapter, _ = build(model, method, rank=r)
    rank, count = spec_budget(method, r, d_in, d_out)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert adapter.rank == rank and adapter.num_trainable == count
    if method != "toplora":  # TopLoRA's gate lives beside the model, not inside it
        assert sum(p.numel() for p in trainable) == count
    b = adapter.budget()
    assert b == {
        "method": b["method"],
        "rank": rank,
        "budget_rank": r,
        "trainable": count,
        "budget": r * (d_in + d_out),
    }
    if shape == "square" and method != "toplora":
        assert count == 2 * 64 * r  # 2dr
    adapter.remove()


def test_summary_prints_rank_and_count(tmp_path, capsys):
    model = tiny()
    adapter, rc = build(model, "lora-null-v2", rank=4)
    summary = train_steps(model, adapter, rc, tmp_path)
    assert summary.budget["trainable"] == 64 * 8
    assert (
        "adapter lora-null: rank 8 (budget rank 4), trainable 512 (budget r (d_in + d_out) = 512)" in summary.format()
    )
    adapter.remove()
