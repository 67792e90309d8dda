"""The Weight-LoRA baseline: PEFT LoRA on the attention output projection of layer l only.

At rank r on a square d x d o_proj it trains r * (d_in + d_out) = 2 d r parameters, the
same budget as the residual. LoRA changes what layer l computes, so the prefix cache
holds layer l's *input* (the output of layer l-1) and each step runs layers l..L; at
l = 0 nothing below is frozen-and-separate and the full forward is used.

The model is modified in place (PEFT swaps the projection for a LoRA wrapper);
`remove()` puts the original projection back, bit-identical.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..backbone import check_layer, decoder_layers
from ..io import IntegrityError, expect_shape, load_verified, save_verified
from .prefix_cache import full_hidden, upper_hidden

LORA_FORMAT = 1
_ADAPTER_NAME = "default"


def _layer_prefix(model: nn.Module) -> str:
    layers = decoder_layers(model)
    for name, module in model.named_modules():
        if module is layers:
            return name
    raise ValueError("decoder layers not found among the model's modules")


class WeightLoRA:
    kind = "weight-lora"

    def __init__(self, model: nn.Module, layer: int, rank: int = 16, alpha: float = 16.0,
                 target: str = "self_attn.o_proj", seed: int = 0):
        from peft import LoraConfig, inject_adapter_in_model

        layers = decoder_layers(model)
        layer = len(layers) // 2 if layer == -1 else layer
        check_layer(layers, layer)
        self.layer, self.rank, self.alpha, self.target = layer, rank, float(alpha), target
        self.seed = seed
        self.module_name = f"{_layer_prefix(model)}.{layer}.{target}"
        try:
            base = model.get_submodule(self.module_name)
        except AttributeError as e:
            raise ValueError(f"target: layer {layer} has no module {target!r} ({e})") from e
        if not isinstance(base, nn.Linear):
            raise ValueError(f"target: {self.module_name} is a {type(base).__name__}, LoRA needs an nn.Linear")
        self.model, self.base = model, base
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=[self.module_name], lora_dropout=0.0, bias="none")
        inject_adapter_in_model(config, model, adapter_name=_ADAPTER_NAME)
        self.lora = model.get_submodule(self.module_name)
        # Trainable factors stay fp32 in a bf16 model, like the residual's A and B: bf16 Adam
        # updates of 2e-4 are below its precision. PEFT casts the input to them and back.
        self.lora.lora_A[_ADAPTER_NAME].float()
        self.lora.lora_B[_ADAPTER_NAME].float()
        self.lora_A = self.lora.lora_A[_ADAPTER_NAME].weight  # (r, d_in)
        self.lora_B = self.lora.lora_B[_ADAPTER_NAME].weight  # (d_out, r)
        with torch.no_grad():  # PEFT draws A from the global RNG; draw it from our seed instead
            g = torch.Generator().manual_seed(seed)
            bound = 1.0 / math.sqrt(self.lora_A.shape[1])  # kaiming-uniform(a=sqrt(5)), as PEFT
            self.lora_A.copy_((torch.rand(self.lora_A.shape, generator=g) * 2 - 1) * bound)
            self.lora_B.zero_()
        for p in model.parameters():  # PEFT may touch flags; only the LoRA factors train
            p.requires_grad_(False)
        self.lora_A.requires_grad_(True)
        self.lora_B.requires_grad_(True)

    @property
    def cache_layer(self) -> int | None:
        return self.layer - 1 if self.layer > 0 else None

    @property
    def num_trainable(self) -> int:
        return self.lora_A.numel() + self.lora_B.numel()

    def to(self, device) -> "WeightLoRA":
        self.lora.to(device)
        return self

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [("lora_A", self.lora_A), ("lora_B", self.lora_B)]

    def describe(self) -> dict:
        return {"kind": self.kind, "layer": self.layer, "rank": self.rank, "alpha": self.alpha, "target": self.target,
                "seed": self.seed}

    @contextmanager
    def disabled(self):
        self.lora.enable_adapters(False)
        try:
            yield
        finally:
            self.lora.enable_adapters(True)

    def hidden(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, cached: torch.Tensor | None = None,
               enabled: bool = True) -> torch.Tensor:
        if not enabled:
            with self.disabled():
                return self.hidden(model, ids, mask, cached)
        if cached is not None:
            return upper_hidden(model, self.cache_layer, cached, ids, mask)
        return full_hidden(model, ids, mask)

    def remove(self) -> None:
        """Put the original projection back; the model is then exactly the frozen backbone."""
        parent_name, _, child = self.module_name.rpartition(".")
        setattr(self.model.get_submodule(parent_name), child, self.base)
        if hasattr(self.model, "peft_config"):
            del self.model.peft_config

    def __enter__(self) -> "WeightLoRA":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path, meta: dict) -> dict:
        manifest = {**meta, "kind": "weight-lora", "format": LORA_FORMAT, **self.describe(),
                    "module": self.module_name, "scaling": self.alpha / self.rank}
        return save_verified(path, {"lora_A": self.lora_A, "lora_B": self.lora_B}, manifest)

    @torch.no_grad()
    def load_weights(self, path: str | Path) -> None:
        tensors, _ = load_verified(path, kind="weight-lora")
        for name, p in self.named_trainable():
            if name not in tensors:
                raise IntegrityError(f"{path}: tensor {name!r} missing")
            expect_shape(name, tensors[name], tuple(p.shape), str(path))
            p.copy_(tensors[name])

    @classmethod
    def load(cls, path: str | Path, model: nn.Module) -> "WeightLoRA":
        """Attach a saved Weight-LoRA to `model` (in place; `remove()` undoes it)."""
        _, manifest = load_verified(path, kind="weight-lora")
        try:
            lora = cls(model, manifest["layer"], manifest["rank"], manifest["alpha"], manifest["target"], manifest["seed"])
        except KeyError as e:
            raise IntegrityError(f"{path}: manifest lacks field {e}") from e
        lora.load_weights(path)
        return lora
