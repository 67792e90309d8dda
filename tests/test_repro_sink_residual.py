"""bench/repro/sink_residual.py: the per-position residual size behind RESULTS.md's sink paragraphs."""

import pytest
import torch

from atlas_core.atlas import Atlas
from bench.repro.sink_residual import by_kind, find_atlas


def test_a_context_splits_into_the_sink_the_other_prompt_positions_and_the_answer():
    parts = by_kind(torch.arange(10.0), n_prompt=4)
    assert parts["sink"].tolist() == [0.0]
    assert parts["prompt"].tolist() == [1.0, 2.0, 3.0] and parts["answer"].tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]


def _atlas(seed: int) -> Atlas:
    g = torch.Generator().manual_seed(seed)
    bases = torch.linalg.qr(torch.randn(2, 6, 6, generator=g)).Q[:, :, :2]  # (K, d, m) orthonormal columns
    return Atlas(torch.randn(2, 6, generator=g), bases, torch.ones(2, 2), 1.0, torch.randn(4, 6, generator=g))


def test_the_adapters_atlas_is_found_by_its_sha256_and_a_missing_one_is_named(tmp_path):
    first, second = _atlas(0), _atlas(1)
    first.save(tmp_path / "a.safetensors")
    second.save(tmp_path / "b.safetensors")
    assert torch.equal(find_atlas(tmp_path, second.sha256).centers, second.centers)
    with pytest.raises(SystemExit, match="no atlas with sha256 0+ in"):
        find_atlas(tmp_path, "0" * 64)
