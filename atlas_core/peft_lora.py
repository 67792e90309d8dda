"""A PEFT LoRA adapter trained anywhere, as one frozen delta of a chain (kind "peft-lora").

PEFT's LoRA adds, on every adapted Linear m (any modules, any layers),

    y_m = W_m x + s_m B_m (A_m x),    A_m (r_m, d_in), B_m (d_out, r_m),
    s_m = alpha_m / r_m    (alpha_m / sqrt(r_m) with use_rslora)

where r_m and alpha_m come from `rank_pattern` / `alpha_pattern` matched against the module's
name exactly as PEFT matches them (peft.utils.other.get_pattern_key), else `r` / `lora_alpha`.
`LoraSet` is that sum as frozen hooks: one atlas_core.lora_delta.FrozenLoRA per module, the same
arithmetic (x cast to the factors' dtype, the sum cast back), so it stacks after any other
delta of a chain and folds into merged weights like the platform's own Weight-LoRA.

What the chain cannot apply exactly is refused with one line naming the option, never
approximated: DoRA (a per-column magnitude renormalisation), trained biases (`bias`,
`lora_bias`), `modules_to_save` (whole replaced modules), initialisations that rewrite the
base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA: the adapter is only valid on the rewritten
base), layer replication, LoRA on parameters or embeddings, and any option this code does
not know with a non-empty value (fail closed on a newer PEFT).
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from .backbone import decoder_layers, decoder_layers_name
from .errors import InputError
from .io import IntegrityError, load_verified, save_verified, sha256_file
from .lora_delta import FrozenLoRA, hooked_linear
from .methods import DeltaFormat, register_format

KIND = "peft-lora"
FORMAT = 1
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# Options applied exactly below, or without effect on the trained adapter's forward pass.
_APPLIED = {
    "task_type",
    "peft_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "r",
    "lora_alpha",
    "rank_pattern",
    "alpha_pattern",
    "use_rslora",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "lora_dropout",
    "init_lora_weights",
    "eva_config",
    "runtime_config",
    "ensure_weight_tying",
    "megatron_core",
    "qalora_group_size",
}
# Initialisations that subtract the initial adapter from the base weights: the saved adapter is
# valid only on that rewritten base (PEFT converts them with path_initial_model_for_weight_conversion).
_REWRITES_BASE = ("pissa", "olora", "corda", "loftq", "lora_ga")


def _is_empty(value) -> bool:
    return value in (None, False, "none", "") or value == [] or value == {}


def refused_option(config: dict) -> str | None:
    """The first LoRA option the chain cannot apply exactly, as a message; None if all can be."""
    if str(config.get("peft_type", "")).upper() != "LORA":
        return f"peft_type {config.get('peft_type')!r}: only LoRA adapters can be submitted"
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_REWRITES_BASE):
        return (
            f"init_lora_weights={init!r} rewrites the base weights, so the adapter is not valid on the line's "
            "backbone; save it converted (save_pretrained(path_initial_model_for_weight_conversion=...))"
        )
    for name in ("loftq_config", "corda_config", "lora_ga_config"):
        if not _is_empty(config.get(name)):
            return f"{name} is set: that initialisation rewrites the base weights"
    for name, value in sorted(config.items()):
        if name not in _APPLIED and not _is_empty(value):
            return f"{name}={value!r} cannot be applied exactly by a chain of frozen LoRA deltas"
    return None


def _module_of(key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' -> ('model.layers.0.self_attn.q_proj', 'A')."""
    match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
    if match is None:
        raise InputError(
            f"tensor {key!r} is no LoRA factor (lora_A / lora_B of a Linear); the chain cannot apply it exactly"
        )
    return match.group(1), match.group(2)


def module_layer(model: nn.Module, module: str) -> int:
    """The decoder layer a module sits in; modules after the stack (e.g. lm_head) count as the last + 1."""
    stack = decoder_layers_name(model)
    match = re.match(rf"{re.escape(stack)}\.(\d+)\.", module + ".")
    return int(match.group(1)) if match else len(decoder_layers(model))


@dataclass
class LoraSet:
    """A LoRA adapter on several Linears, frozen: one FrozenLoRA per module (name -> factors, scaling)."""

    loras: list[FrozenLoRA]
    source: dict  # where it came from: format, sha256 of the submitted weights, the PEFT options kept

    kind = KIND

    @property
    def layer(self) -> int:
        """The lowest decoder layer it changes (prefix caches must end below it)."""
        return min(lora.layer for lora in self.loras)

    @contextmanager
    def attached(self, model: nn.Module) -> Iterator[None]:
        with ExitStack() as stack:
            for lora in self.loras:
                stack.enter_context(lora.attached(model))
            yield

    def save(self, path: str | Path, meta: dict | None = None) -> dict:
        tensors = {}
        for lora in self.loras:
            tensors[f"{lora.module_name}.lora_A"] = lora.lora_A  # (r, d_in)
            tensors[f"{lora.module_name}.lora_B"] = lora.lora_B  # (d_out, r)
        modules = {
            lora.module_name: {"scaling": lora.scaling, "rank": int(lora.lora_A.shape[0]), "layer": lora.layer}
            for lora in self.loras
        }
        return save_verified(
            path,
            tensors,
            {
                **(meta or {}),
                "kind": KIND,
                "format": FORMAT,
                "modules": modules,
                "layer": self.layer,
                "source": self.source,
            },
        )

    @classmethod
    def load(cls, path: str | Path) -> "LoraSet":
        tensors, manifest = load_verified(path, kind=KIND)
        loras = []
        try:
            for module, info in sorted(manifest["modules"].items()):
                a, b = tensors[f"{module}.lora_A"], tensors[f"{module}.lora_B"]
                if a.ndim != 2 or b.ndim != 2 or a.shape[0] != info["rank"] or b.shape[1] != info["rank"]:
                    raise IntegrityError(
                        f"{path}: {module}: factors {tuple(a.shape)}, {tuple(b.shape)} do not have rank {info['rank']}"
                    )
                loras.append(FrozenLoRA(module, a, b, info["scaling"], info["layer"]))
        except (KeyError, TypeError) as e:
            raise IntegrityError(f"{path}: manifest or tensors incomplete ({type(e).__name__}: {e})") from e
        if not loras or len(tensors) != 2 * len(loras):
            raise IntegrityError(f"{path}: expected the factors of {len(loras)} modules, found {len(tensors)} tensors")
        return cls(loras, manifest.get("source", {}))


def read_peft_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise InputError(
            f"{path}: missing; a PEFT adapter folder holds {CONFIG_FILE} and "
            f"{WEIGHTS_FILES[0]} (model.save_pretrained(DIR))"
        )
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: expected a JSON object")
    return config


def _weights(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILES[0]
    if not path.is_file():
        if (folder / WEIGHTS_FILES[1]).is_file():
            raise InputError(
                f"{folder / WEIGHTS_FILES[1]}: pickled weights are not loaded (they can run code); "
                "save with safe_serialization=True"
            )
        raise InputError(f"{path}: missing; the adapter's weights are expected there")
    try:
        return path, load_file(str(path))
    except SafetensorError as e:
        raise InputError(f"{path}: not a readable safetensors file ({e})") from None


def from_peft_folder(folder: str | Path, model: nn.Module) -> LoraSet:
    """A PEFT LoRA adapter folder as a LoraSet for `model` (the line's backbone): every module must
    exist there as a Linear of the factors' shapes; scalings as PEFT computes them."""
    from peft.utils.other import get_pattern_key

    folder = Path(folder)
    config = read_peft_config(folder)
    refused = refused_option(config)
    if refused is not None:
        raise InputError(f"{folder / CONFIG_FILE}: {refused}")
    path, tensors = _weights(folder)
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, which = _module_of(key)
        factors.setdefault(module, {})[which] = tensor
    if not factors:
        raise InputError(f"{path}: no LoRA factors found")
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    loras = []
    for module, ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            raise InputError(f"{path}: {module}: lora_A and lora_B expected, found only lora_{''.join(ab)}")
        a, b = ab["A"].float(), ab["B"].float()  # (r, d_in), (d_out, r)
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), config.get("r"))
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), config.get("lora_alpha"))
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise InputError(
                f"{path}: {module}: factors {tuple(a.shape)} and {tuple(b.shape)} do not have "
                f"the rank {r} that adapter_config.json gives it"
            )
        try:
            hooked_linear(model, module, (b.shape[0], a.shape[1]), "adapter")
        except ValueError as e:
            raise InputError(f"{path}: {e} (the line's backbone)") from None
        scaling = alpha / (r**0.5 if config.get("use_rslora") else r)
        loras.append(FrozenLoRA(module, a, b, scaling, module_layer(model, module)))
    source = {
        "format": "peft",
        "weights_sha256": sha256_file(path),
        "config_sha256": sha256_file(folder / CONFIG_FILE),
        "base_model_name_or_path": config.get("base_model_name_or_path"),
        "revision": config.get("revision"),
        "peft_version": config.get("peft_version"),
        "use_rslora": bool(config.get("use_rslora")),
    }
    return LoraSet(loras, source)


class LoraSetDelta(DeltaFormat):
    """A submitted PEFT LoRA (kind "peft-lora"): a LoraSet, exported as LoRA like the platform's own."""

    kind = KIND
    peft_method = "lora"

    def load(self, path: Path, manifest: dict, atlas_for) -> LoraSet:
        return LoraSet.load(path)

    def loras(self, delta: LoraSet, where: str) -> list[FrozenLoRA]:
        return delta.loras


register_format(LoraSetDelta())
