"""bench/train_prefix_cache.py's FLOP count: the ceiling that docs/BENCHMARKS.md holds the
measured prefix-cache speed-up against."""

from argparse import Namespace

import pytest
import torch

from atlas_core.train import TrainConfig, epoch_batches, prepare_data
from atlas_core.train.data import collate
from bench.train_prefix_cache import free_head_ceiling, matmul_ratio

from .conftest import tiny_model
from .train_fixtures import CharTokenizer, toy_pairs


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_matmul_ratio_counts_lower_forward_against_upper_forward_and_backward(family):
    model = tiny_model(family)  # 4 layers, d=64, ffn 128, 4 heads of 16, 2 kv heads, vocabulary 97
    data = prepare_data(CharTokenizer(), toy_pairs(12), TrainConfig(batch_size=4, progress=False), chat=False)
    args = Namespace(batch_size=4, batches=2)
    # Hand count: q, o 64x64; k, v 64x32; gate, up, down 64x128 per token; head 64x97 per target.
    per_layer, head = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128, 64 * 97
    batches = [collate(data.train, i, data.pad_id) for i in epoch_batches(data.train.lengths, 4, 0, 0)[1:3]]
    padded = sum(b.ids.numel() for b in batches)
    targets = sum(int((b.targets != -100).sum()) for b in batches)
    for layer in (0, 1, 2):

        def ratio(head_cost):  # the hand count; head_cost 0 is the free-head ceiling
            upper = (3 - layer) * per_layer * padded + head_cost * targets
            return ((layer + 1) * per_layer * padded + 2 * upper) / (2 * upper)

        assert matmul_ratio(model, data, layer, args) == pytest.approx(ratio(head))
        assert free_head_ceiling(layer, 4) == pytest.approx(ratio(0))


def test_free_head_ceiling_is_one_and_a_half_at_half_depth():
    assert free_head_ceiling(14, 30) == pytest.approx(1.5)  # 15 layers below, 15 above
    assert free_head_ceiling(15, 30) == pytest.approx(1 + 16 / 28)
    assert torch.tensor([free_head_ceiling(n, 30) for n in range(10, 25)]).diff().gt(0).all()
