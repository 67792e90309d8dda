"""Attaching a residual to a loaded model, and saving/loading adapter weights."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..atlas import Atlas
from ..backbone import check_layer, decoder_layers, hidden_size, layer_output, with_layer_output
from ..io import IntegrityError, expect_shape, load_verified, save_verified
from .config import ResidualConfig
from .layer import AtlasResidual

ADAPTER_FORMAT = 1


def build_residual(config: ResidualConfig, model: nn.Module, atlas: Atlas | None = None) -> AtlasResidual:
    """A fresh residual (B = 0) for `model`; resolves layer=-1 to the middle layer."""
    layers = decoder_layers(model)
    if config.layer == -1:
        config = ResidualConfig(**{**config.to_dict(), "layer": len(layers) // 2})
    check_layer(layers, config.layer)
    if atlas is not None and config.atlas_variant is not None and atlas.meta.get("layer", config.layer) != config.layer:
        raise ValueError(
            f"layer: the atlas was fitted at layer {atlas.meta['layer']}, the residual is for layer {config.layer}"
        )
    return AtlasResidual(config, hidden_size(model), atlas)


class Attachment:
    """A residual attached at the output of decoder layer `l` by a forward hook.

    The model is not copied or modified; `detach()` (or leaving the `with` block) restores it.
    Generation works unchanged: routing depends only on the token's own h, so nothing is
    added to the KV cache.

    Residuals attached to the same layer apply in the order they were attached: each sees
    the output of the ones before it (h1 = h + D1(h), h2 = h1 + D2(h1)), which is what a
    version chain means (a release trained with its parent attached). They share one hook
    per layer, registered first (prepend) so that it runs before hooks that record layer
    outputs (transformers' output_hidden_states) and before partial-forward hooks.
    """

    def __init__(self, model: nn.Module, residual: AtlasResidual):
        layers = decoder_layers(model)
        check_layer(layers, residual.config.layer)
        param = next(model.parameters())
        residual.to(param.device)
        self.model, self.residual = model, residual
        self._layer = layers[residual.config.layer]
        stack = _residual_stack(self._layer)
        stack.append(residual)
        self._attached = True

    def detach(self) -> None:
        if self._attached:
            _release(self._layer, self.residual)
            self._attached = False

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


_STACK = "_atlas_residual_stack"  # attribute on a decoder layer: (hook handle, [residuals in order])


def _residual_stack(layer: nn.Module) -> list:
    """The ordered residuals of a layer, creating its single hook on first use."""
    if not hasattr(layer, _STACK):
        residuals: list[AtlasResidual] = []

        def hook(_module, _args, output):
            h = layer_output(output)  # (B, T, d)
            for r in residuals:
                h = h + r(h)
            return with_layer_output(output, h)

        setattr(layer, _STACK, (layer.register_forward_hook(hook, prepend=True), residuals))
    return getattr(layer, _STACK)[1]


def _release(layer: nn.Module, residual: AtlasResidual) -> None:
    handle, residuals = getattr(layer, _STACK)
    residuals.remove(residual)
    if not residuals:  # leave the model exactly as it was: no hook, no attribute
        handle.remove()
        delattr(layer, _STACK)


def attach(model: nn.Module, residual: AtlasResidual) -> Attachment:
    return Attachment(model, residual)


def save_adapter(path: str | Path, residual: AtlasResidual, meta: dict | None = None) -> dict:
    """Adapter weights (A, B and calibrated scales) as safetensors + manifest with sha256."""
    manifest = {
        **(meta or {}),
        "kind": "adapter",
        "format": ADAPTER_FORMAT,
        "config": residual.config.to_dict(),
        "d": residual.dim,
        "atlas_sha256": residual.atlas_sha256,
    }
    return save_verified(path, residual.state_dict(), manifest)


def load_adapter(path: str | Path, atlas: Atlas | None = None) -> AtlasResidual:
    """Load an adapter; refuses a corrupted file or an atlas other than the one it was trained with."""
    tensors, manifest = load_verified(path, kind="adapter")
    try:
        config = ResidualConfig(**manifest["config"])
        dim = int(manifest["d"])
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"{path}: manifest has an invalid 'config' or 'd' ({e})") from e
    expected = manifest.get("atlas_sha256")
    if expected is not None and (atlas is None or atlas.sha256 != expected):
        raise IntegrityError(
            f"{path}: adapter was trained with atlas sha256 {expected}, got {None if atlas is None else atlas.sha256}"
        )
    residual = AtlasResidual(config, dim, atlas if expected is not None else None)
    for name, shape in (("A", (config.rank, dim)), ("B", (dim, config.rank)), ("s", ()), ("s_d", ())):
        if name not in tensors:
            raise IntegrityError(f"{path}: tensor {name!r} missing")
        expect_shape(name, tensors[name], shape, str(path))
    residual.load_state_dict(tensors)
    return residual
