"""The Weight-LoRA baseline: PEFT LoRA on the attention output projection of layer l only.

At rank r on a square d x d o_proj it trains r * (d_in + d_out) = 2 d r parameters, the
same budget as the residual. LoRA changes what layer l computes, so the prefix cache
holds layer l's *input* (the output of layer l-1) and each step runs layers l..L; at
l = 0 nothing below is frozen-and-separate and the full forward is used.

The model is modified in place (PEFT swaps the projection for a LoRA wrapper);
`remove()` puts the original projection back, bit-identical.

The weight-adapter baselines (atlas_core/train/baselines/) are subclasses: they change the
initialisation, freeze a factor, add a regulariser (`penalty`) or change the LoRA branch with
hooks on PEFT's lora_A / lora_B (`_hook`). Each saves the update it makes to the ORIGINAL
weight as LoRA factors (`delta_factors`), so atlas_core.lora_delta.FrozenLoRA applies any of them.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..backbone import check_layer, decoder_layers, decoder_layers_name
from ..io import IntegrityError, expect_shape, load_verified, save_verified
from .prefix_cache import full_hidden, upper_hidden

LORA_FORMAT = 1
_ADAPTER_NAME = "default"


class WeightLoRA:
    kind = "weight-lora"
    method = "weight-lora"  # the baselines override it; recorded in every file

    def __init__(
        self,
        model: nn.Module,
        layer: int,
        rank: int = 16,
        alpha: float = 16.0,
        target: str = "self_attn.o_proj",
        seed: int = 0,
    ):
        from peft import LoraConfig, inject_adapter_in_model

        layers = decoder_layers(model)
        layer = len(layers) // 2 if layer == -1 else layer
        check_layer(layers, layer)
        self.layer, self.rank, self.alpha, self.target = layer, rank, float(alpha), target
        self.seed = seed
        self.module_name = f"{decoder_layers_name(model)}.{layer}.{target}"
        try:
            base = model.get_submodule(self.module_name)
        except AttributeError as e:
            raise ValueError(f"target: layer {layer} has no module {target!r} ({e})") from e
        if not isinstance(base, nn.Linear):
            raise ValueError(f"target: {self.module_name} is a {type(base).__name__}, LoRA needs an nn.Linear")
        self.model, self.base = model, base
        self.budget_rank = rank  # the rank r of the budget r (d_in + d_out); a method may run at another rank
        self._hooks: list = []
        self.update_gate = None  # an UpdateGate (update_gate.py) masking the branch per position, or None
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=[self.module_name],
            lora_dropout=0.0,
            bias="none",
            **self._peft_options(),
        )
        self._before_inject(model, config)
        inject_adapter_in_model(config, model, adapter_name=_ADAPTER_NAME)
        self.lora = model.get_submodule(self.module_name)
        # Trainable factors stay fp32 in a bf16 model, like the residual's A and B: bf16 Adam
        # updates of 2e-4 are below its precision. PEFT casts the input to them and back.
        self.lora.lora_A[_ADAPTER_NAME].float()
        self.lora.lora_B[_ADAPTER_NAME].float()
        self.lora_A = self.lora.lora_A[_ADAPTER_NAME].weight  # (r, d_in)
        self.lora_B = self.lora.lora_B[_ADAPTER_NAME].weight  # (d_out, r)
        for p in model.parameters():  # PEFT may touch flags; only the LoRA factors train
            p.requires_grad_(False)
        self.lora_A.requires_grad_(True)
        self.lora_B.requires_grad_(True)
        try:
            with torch.no_grad():
                self._init_factors(torch.Generator().manual_seed(seed))
                self._setup()
        except BaseException:
            self.remove()  # a refused config leaves the model as it was
            raise

    # ------------------------------------------------------------------ what a baseline overrides
    def _peft_options(self) -> dict:
        """Extra LoraConfig fields (CorDA's init)."""
        return {}

    def _before_inject(self, model: nn.Module, config) -> None:
        """Runs before PEFT wraps the projection (CorDA's preprocessing)."""

    def _setup(self) -> None:
        """Runs after the init: a baseline's fixed tensors and hooks (may raise: the model is restored)."""

    def _init_factors(self, g: torch.Generator) -> None:
        """PEFT's default init, drawn from our seed rather than the global RNG:
        A kaiming-uniform(a = sqrt 5), B = 0."""
        bound = 1.0 / math.sqrt(self.lora_A.shape[1])
        self.lora_A.copy_((torch.rand(self.lora_A.shape, generator=g) * 2 - 1) * bound)
        self.lora_B.zero_()

    @property
    def cache_layer(self) -> int | None:
        return self.layer - 1 if self.layer > 0 else None

    @property
    def num_trainable(self) -> int:
        return sum(p.numel() for _, p in self.named_trainable())

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank  # PEFT's s = alpha / r, at the rank the adapter runs at

    def base_weight(self) -> torch.Tensor:
        """The frozen W (d_out, d_in) in fp32 (the baselines' SVDs and projections use it)."""
        return self.base.weight.detach().float()

    def budget(self) -> dict:
        """Rank and trainable count, and the spec's budget r (d_in + d_out) at the configured rank."""
        d_out, d_in = self.base.weight.shape
        return {
            "method": self.method,
            "rank": self.rank,
            "budget_rank": self.budget_rank,
            "trainable": self.num_trainable,
            "budget": self.budget_rank * (d_in + d_out),
        }

    def penalty(self) -> torch.Tensor | None:
        """A regulariser added once per optimizer step (O-LoRA, CLoRA); None: none."""
        return None

    def to(self, device) -> "WeightLoRA":
        self.lora.to(device)
        return self

    def _hook(self, module: nn.Module, fn, pre: bool = False) -> None:
        """A forward (pre-)hook on a module of the LoRA branch, removed by `remove()`. PEFT skips the
        branch entirely when adapters are disabled, so these never touch the frozen f0."""
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        self._hooks.append(register(fn))

    def named_trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [("lora_A", self.lora_A), ("lora_B", self.lora_B)]

    def describe(self) -> dict:
        d = {
            "kind": self.kind,
            "layer": self.layer,
            "rank": self.rank,
            "alpha": self.alpha,
            "target": self.target,
            "seed": self.seed,
        }
        if self.method != "weight-lora":  # plain Weight-LoRA keeps the description (and run hashes) it always had
            d |= {"method": self.method, "budget_rank": self.budget_rank}
        return d

    @contextmanager
    def disabled(self):
        self.lora.enable_adapters(False)
        try:
            yield
        finally:
            self.lora.enable_adapters(True)

    def hidden(
        self,
        model: nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        cached: torch.Tensor | None = None,
        enabled: bool = True,
    ) -> torch.Tensor:
        if not enabled:
            with self.disabled():
                return self.hidden(model, ids, mask, cached)
        if self.update_gate is not None:  # a pass from the prefix cache never reaches the embeddings' hook
            self.update_gate.set(ids)
        if cached is not None:
            return upper_hidden(model, self.cache_layer, cached, ids, mask)
        return full_hidden(model, ids, mask)

    def remove(self) -> None:
        """Put the original projection back; the model is then exactly the frozen backbone."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        parent_name, _, child = self.module_name.rpartition(".")
        setattr(self.model.get_submodule(parent_name), child, self.base)
        if hasattr(self.model, "peft_config"):
            del self.model.peft_config

    def __enter__(self) -> "WeightLoRA":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------------ files
    @torch.no_grad()
    def delta_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A' (r', d_in), B' (d_out, r')) with  W_adapted = W + scaling * B' A'  for the ORIGINAL W:
        what a chain applies (atlas_core.lora_delta.FrozenLoRA). Plain LoRA: its own factors."""
        return self.lora_A, self.lora_B

    def save(self, path: str | Path, meta: dict) -> dict:
        """lora_A / lora_B: the delta's factors (`delta_factors`, rank r' in the manifest's `rank`);
        a baseline whose trained tensors differ from them also saves those, as param.<name>."""
        A, B = self.delta_factors()
        tensors = {"lora_A": A, "lora_B": B}
        for name, p in self.named_trainable():
            if not (name in tensors and tensors[name] is p):
                tensors[f"param.{name}"] = p
        manifest = {
            **meta,
            "kind": self.kind,
            "format": LORA_FORMAT,
            **self.describe(),
            "method": self.method,
            "adapter_rank": self.rank,
            "rank": A.shape[0],
            "module": self.module_name,
            "scaling": self.scaling,
        }
        return save_verified(path, tensors, manifest)

    @torch.no_grad()
    def load_weights(self, path: str | Path) -> None:
        tensors, manifest = load_verified(path, kind=self.kind)
        if manifest.get("method", "weight-lora") != self.method:
            raise IntegrityError(f"{path}: holds a {manifest.get('method')!r} adapter, this one is {self.method!r}")
        for name, p in self.named_trainable():
            key = f"param.{name}" if f"param.{name}" in tensors else name
            if key not in tensors:
                raise IntegrityError(f"{path}: tensor {name!r} missing")
            expect_shape(name, tensors[key], tuple(p.shape), str(path))
            p.copy_(tensors[key])

    @classmethod
    def load(cls, path: str | Path, model: nn.Module) -> "WeightLoRA":
        """Attach a saved Weight-LoRA to `model` (in place; `remove()` undoes it). A baseline's file is
        applied frozen by atlas_core.lora_delta.FrozenLoRA, or loaded into a rebuilt adapter (`load_weights`)."""
        _, manifest = load_verified(path, kind="weight-lora")
        if manifest.get("method", "weight-lora") != "weight-lora":
            raise IntegrityError(f"{path}: a {manifest['method']!r} adapter; rebuild it and call load_weights")
        try:
            lora = cls(
                model, manifest["layer"], manifest["rank"], manifest["alpha"], manifest["target"], manifest["seed"]
            )
        except KeyError as e:
            raise IntegrityError(f"{path}: manifest lacks field {e}") from e
        lora.load_weights(path)
        return lora
