"""Atlas fitting (k-means charts + local PCA), variants, and its verified file format."""

import json

import pytest
import torch

from atlas_core.atlas import Atlas, AtlasConfig, fit_atlas, kmeans
from atlas_core.io import IntegrityError


def clustered(k=6, per=80, d=40, seed=0, spread=0.3):
    """k well-separated Gaussian clusters with a distinct low-rank structure each."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, d, generator=g) * 10
    x = torch.cat([centers[c] + spread * torch.randn(per, d, generator=g) for c in range(k)])
    labels = torch.arange(k).repeat_interleave(per)
    return x, labels


def same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a[:, None] == a[None, :]) == (b[:, None] == b[None, :])).all())


def test_kmeans_recovers_known_clusters():
    x, truth = clustered()
    centers, labels, inertia = kmeans(x, 6, seed=0)
    assert same_partition(labels, truth)
    assert inertia == pytest.approx(float(((x - centers[labels]) ** 2).sum()), rel=1e-4)


def test_kmeans_is_deterministic_for_a_seed():
    x, _ = clustered(seed=3)
    assert torch.equal(kmeans(x, 6, seed=1)[1], kmeans(x, 6, seed=1)[1])


def test_fit_recovers_clusters_with_orthonormal_bases():
    x, truth = clustered()
    atlas = fit_atlas(x, AtlasConfig(num_charts=6, rank=5, num_vectors=len(x)))
    d2 = torch.cdist(x, atlas.centers)
    assert same_partition(d2.argmin(1), truth)
    eye = torch.eye(5)
    for c in range(6):
        torch.testing.assert_close(atlas.bases[c].T @ atlas.bases[c], eye, atol=1e-5, rtol=0)
    assert (atlas.sigma[:, :-1] >= atlas.sigma[:, 1:]).all()  # descending singular values
    nearest = d2.min(1).values ** 2
    assert atlas.tau == pytest.approx(float(nearest.mean()), rel=1e-3)


def test_bases_span_the_local_principal_directions():
    g = torch.Generator().manual_seed(0)
    d = 30
    direction = torch.linalg.qr(torch.randn(d, 2, generator=g))[0]  # the cluster varies along 2 directions
    x = torch.randn(200, 2, generator=g) * torch.tensor([5.0, 3.0]) @ direction.T + 0.01 * torch.randn(
        200, d, generator=g
    )
    atlas = fit_atlas(x, AtlasConfig(num_charts=1, rank=2, num_vectors=200))
    proj = atlas.bases[0] @ atlas.bases[0].T
    torch.testing.assert_close(proj @ direction, direction, atol=1e-3, rtol=0)


def test_global_variant_equals_global_pca():
    x, _ = clustered(seed=1)
    atlas = fit_atlas(x, AtlasConfig(variant="global", rank=4, num_vectors=len(x)))
    assert atlas.num_charts == 1
    torch.testing.assert_close(atlas.centers[0], x.mean(0))
    _, s, vh = torch.linalg.svd(x - x.mean(0), full_matrices=False)
    ref = vh[:4].T
    torch.testing.assert_close(atlas.bases[0] @ atlas.bases[0].T, ref @ ref.T, atol=1e-4, rtol=0)
    torch.testing.assert_close(atlas.sigma[0], s[:4], rtol=1e-4, atol=1e-4)


def test_random_and_shuffled_variants():
    x, _ = clustered(seed=2)
    cfg = dict(num_charts=6, rank=3, num_vectors=len(x))
    local = fit_atlas(x, AtlasConfig(**cfg))
    shuffled = fit_atlas(x, AtlasConfig(**cfg, variant="shuffled-patch"))
    rand = fit_atlas(x, AtlasConfig(**cfg, variant="random-local"))
    torch.testing.assert_close(shuffled.centers, local.centers)
    # every chart carries another chart's basis, and all bases are used once
    matches = [[torch.allclose(shuffled.bases[i], local.bases[j]) for j in range(6)] for i in range(6)]
    assert all(sum(row) == 1 and not row[i] for i, row in enumerate(matches))
    for c in range(6):
        torch.testing.assert_close(rand.bases[c].T @ rand.bases[c], torch.eye(3), atol=1e-5, rtol=0)
        assert not torch.allclose(rand.bases[c], local.bases[c], atol=1e-2)


def test_equal_support_uses_nearest_vectors():
    x, _ = clustered(per=40, seed=4)
    atlas = fit_atlas(x, AtlasConfig(num_charts=6, rank=3, equal_support=25, num_vectors=len(x)))
    c = 0
    nearest = torch.cdist(atlas.centers[c : c + 1], x)[0].topk(25, largest=False).indices
    offsets = x[nearest] - atlas.centers[c]
    _, _, vh = torch.linalg.svd(offsets, full_matrices=False)
    torch.testing.assert_close(atlas.bases[c] @ atlas.bases[c].T, vh[:3].T @ vh[:3], atol=1e-4, rtol=0)


def test_small_chart_gets_a_completed_basis():
    x = torch.cat([torch.randn(50, 10) + 20, torch.randn(2, 10) - 20])  # second cluster: 2 members
    atlas = fit_atlas(x, AtlasConfig(num_charts=2, rank=4, num_vectors=len(x)))
    small = int(atlas.sigma[:, 1:].sum(1).argmin())
    torch.testing.assert_close(atlas.bases[small].T @ atlas.bases[small], torch.eye(4), atol=1e-5, rtol=0)
    assert (atlas.sigma[small, 1:] == 0).all()


def test_save_load_round_trip_and_manifest(tmp_path):
    x, _ = clustered()
    atlas = fit_atlas(
        x,
        AtlasConfig(num_charts=6, rank=3, num_vectors=len(x)),
        meta={"backbone": "tiny", "layer": 2, "data": {"gsm8k/test.jsonl": "abc"}},
    )
    manifest = atlas.save(tmp_path / "atlas.safetensors")
    loaded = Atlas.load(tmp_path / "atlas.safetensors")
    for name in ("centers", "bases", "sigma", "calibration"):
        assert torch.equal(getattr(loaded, name), getattr(atlas, name))
    assert loaded.tau == atlas.tau and loaded.sha256 == manifest["sha256"] == atlas.sha256
    on_disk = json.loads((tmp_path / "atlas.json").read_text())
    assert {"backbone", "layer", "K", "m", "num_vectors", "data", "tau", "sha256"} <= set(on_disk)


def test_flipped_byte_is_rejected(tmp_path):
    x, _ = clustered()
    path = tmp_path / "atlas.safetensors"
    fit_atlas(x, AtlasConfig(num_charts=6, rank=3, num_vectors=len(x))).save(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        Atlas.load(path)


def test_mismatching_shapes_are_rejected(tmp_path):
    x, _ = clustered()
    path = tmp_path / "atlas.safetensors"
    fit_atlas(x, AtlasConfig(num_charts=6, rank=3, num_vectors=len(x))).save(path)
    manifest = json.loads((tmp_path / "atlas.json").read_text())
    manifest["m"] = 4
    (tmp_path / "atlas.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="'bases' has shape"):
        Atlas.load(path)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="variant"):
        AtlasConfig(variant="nope")
    with pytest.raises(ValueError, match="rank"):
        AtlasConfig(rank=0)
    with pytest.raises(ValueError, match="num_vectors"):
        fit_atlas(torch.randn(5, 8), AtlasConfig(num_charts=6, rank=2))
