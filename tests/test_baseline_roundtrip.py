"""Every new adapter kind: a save/load round trip, a flipped byte refused, and the chain applying
the saved delta (atlas_core.chain.load_delta) with the trained adapter's logits."""

import pytest
import torch

from atlas_core.chain import Chain, load_delta
from atlas_core.io import IntegrityError
from tests.baseline_fixtures import WEIGHT_METHODS, batch, build, flip_byte, logits, tiny, train_steps

METHODS = [m for m in WEIGHT_METHODS if m != "weight-lora"]


@pytest.fixture(scope="module", params=METHODS)
def trained(request, tmp_path_factory):
    """(method, saved file, trained logits, base logits) after 4 real steps."""
    method, tmp = request.param, tmp_path_factory.mktemp(request.param)
    model = tiny()
    ids, mask = batch(seed=1)
    base = logits(model, ids, mask)
    adapter, rc = build(model, method)
    train_steps(model, adapter, rc, tmp / "run")
    want = logits(model, ids, mask)
    path = tmp / "adapter.safetensors"
    adapter.save(path, {"note": "test"})
    adapter.remove()
    return method, path, want, base


def test_load_weights_round_trip(trained):
    method, path, want, base = trained
    model = tiny()
    ids, mask = batch(seed=1)
    fresh, _ = build(model, method)  # same seed and data: the same fixed tensors
    fresh.load_weights(path)
    assert torch.equal(logits(model, ids, mask), want)
    assert (want - base).abs().max() > 1e-4  # training moved the model: the round trip is not vacuous
    fresh.remove()


def test_the_chain_applies_the_saved_delta(trained):
    method, path, want, base = trained
    model = tiny()
    ids, mask = batch(seed=1)
    delta = load_delta(path, lambda sha: None)
    with Chain([delta]).attached(model):
        got = logits(model, ids, mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(logits(model, ids, mask), base)  # detached: the backbone as it was


def test_a_flipped_byte_is_refused(trained, tmp_path):
    method, path, _, _ = trained
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    copy.with_suffix(".json").write_bytes(path.with_suffix(".json").read_bytes())
    flip_byte(copy)
    with pytest.raises(IntegrityError, match="sha256"):
        load_delta(copy, lambda sha: None)
    model = tiny()
    fresh, _ = build(model, method)
    with pytest.raises(IntegrityError, match="sha256"):
        fresh.load_weights(copy)
    fresh.remove()


def test_a_file_of_another_method_is_refused(trained):
    method, path, _, _ = trained
    other = "clora" if method != "clora" else "oplora"
    model = tiny()
    fresh, _ = build(model, other)
    with pytest.raises(IntegrityError, match="adapter"):
        fresh.load_weights(path)
    fresh.remove()
