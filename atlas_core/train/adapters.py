"""What the trainer trains: a residual at layer l's output, or (lora.py) LoRA inside layer l, or
any registered method's trainable delta (atlas_core.methods).

All expose the same small interface so one training loop serves every method:
    cache_layer             the layer whose output the prefix cache holds (None: no cache possible)
    named_trainable()       [(name, parameter)] in a fixed order (optimizer state is saved by name)
    hidden(model, batch_ids, mask, cached=None, enabled=True)
                            final hidden states; from the cache if given, else a full forward;
                            enabled=False gives the frozen f0 (the Output-KL teacher)
    save(path, meta) / load_weights(path)
    to(device), describe()  the run key's description of the adapter
    optional: budget() (rank and trainable count, for the summary), penalty() (a regulariser
    the objective adds once per step), remove() (take it out of the model)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .. import methods
from ..io import IntegrityError, expect_shape, load_verified
from ..residual import AtlasResidual, attach, save_adapter
from .prefix_cache import full_hidden, upper_hidden


class ResidualAdapter:
    """An `AtlasResidual` (any structural variant) added to layer l's output: h' = h + Delta(h)."""

    kind = "residual"

    def __init__(self, residual: AtlasResidual):
        self.residual = residual
        self.update_gate = None  # an UpdateGate (update_gate.py) masking Delta per position, or None

    @property
    def layer(self) -> int:
        return self.residual.config.layer

    @property
    def cache_layer(self) -> int | None:
        return self.layer

    def to(self, device) -> "ResidualAdapter":
        self.residual.to(device)
        return self

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [("A", self.residual.A), ("B", self.residual.B)]

    def describe(self) -> dict:
        return {"kind": self.kind, "config": self.residual.config.to_dict(), "atlas_sha256": self.residual.atlas_sha256}

    def budget(self) -> dict:
        d = self.residual.A.shape[-1]
        r = self.residual.config.rank
        return {
            "method": self.residual.config.variant,
            "rank": r,
            "budget_rank": r,
            "trainable": sum(p.numel() for _, p in self.named_trainable()),
            "budget": 2 * d * r,
        }

    def hidden(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        cached: torch.Tensor | None = None,
        enabled: bool = True,
    ) -> torch.Tensor:
        if self.update_gate is not None:  # a pass from the prefix cache never reaches the embeddings' hook
            self.update_gate.set(ids)
        if cached is not None:
            h = cached + self.residual(cached) if enabled else cached
            return upper_hidden(model, self.layer, h, ids, mask)
        if not enabled:
            return full_hidden(model, ids, mask)
        with attach(model, self.residual):
            return full_hidden(model, ids, mask)

    def save(self, path: str | Path, meta: dict) -> dict:
        return save_adapter(path, self.residual, meta)

    @torch.no_grad()
    def load_weights(self, path: str | Path) -> None:
        tensors, _ = load_verified(path, kind="adapter")
        for name, p in self.named_trainable():
            if name not in tensors:
                raise IntegrityError(f"{path}: tensor {name!r} missing")
            expect_shape(name, tensors[name], tuple(p.shape), str(path))
            p.copy_(tensors[name])


def as_adapter(obj):
    """Wrap an `AtlasResidual`; pass a WeightLoRA or ResidualAdapter through."""
    if isinstance(obj, AtlasResidual):
        return ResidualAdapter(obj)
    if hasattr(obj, "named_trainable") and hasattr(obj, "hidden"):
        return obj
    raise TypeError(f"adapter: expected an AtlasResidual or a WeightLoRA, got {type(obj).__name__}")


def build_adapter(config, model: nn.Module, atlas=None, stats=None):
    """A fresh adapter for a `RunConfig`, built by the method it names (atlas_core.methods): a
    residual variant, or a weight adapter (Weight-LoRA or the baseline `config.lora.method` names,
    installed into `model` in place; `remove()` takes it out), or a plugin's. `stats`: the retained
    statistics some baselines need (atlas_core.train.retained_stats), else the file `config.lora.stats` names."""
    return methods.method_for(config).build(config, model, atlas=atlas, stats=stats)
