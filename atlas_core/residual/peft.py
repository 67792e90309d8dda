"""The ATLAS residual as a PEFT method: after `import atlas_core` (which registers it as soon as
PEFT is imported, whichever comes first), an exported ATLAS adapter loads like a LoRA:

    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "exports/v2-peft")

What PEFT's API can and cannot express. Its tuners wrap modules, and a decoder layer is a
module, so the residual h' = h + Delta(h) on layer l's output is a tuner layer that wraps
`model.layers.l` (target_modules names the layers) and adds each residual of a chain to the
layer's output in chain order, which is what atlas_core.chain does with hooks. The frozen atlas
geometry (centers, bases) is saved with the adapter's weights, so the folder is self-contained.
PEFT's extension point `peft.utils.register_peft_method` accepts only names that are already
members of the `PeftType` enum, which PEFT fixes when it is imported; the member ATLAS is
therefore added to that enum first (the one step without a public API), then registered.
There is no merge: Delta(h) is routed by h itself, so it folds into no weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft.config import PeftConfig
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import PeftType, register_peft_method
from torch import nn

from ..atlas import Atlas
from ..backbone import decoder_layers_name, layer_output, with_layer_output
from .config import ResidualConfig
from .layer import AtlasResidual

NAME = "atlas"


def _add_peft_type() -> None:
    if NAME.upper() in PeftType.__members__:
        return
    member = str.__new__(PeftType, NAME.upper())
    member._name_, member._value_ = NAME.upper(), NAME.upper()
    PeftType._member_map_[member._name_] = member
    PeftType._value2member_map_[member._value_] = member
    PeftType._member_names_.append(member._name_)
    type.__setattr__(PeftType, member._name_, member)


@dataclass
class AtlasPeftConfig(PeftConfig):
    """The residuals of a chain, each on the output of one decoder layer (tensors in the adapter file)."""

    target_modules: list[str] = field(
        default_factory=list,
        metadata={"help": "Decoder layers whose output the residuals modify, by module name (e.g. 'model.layers.15')."},
    )
    residuals: list[dict] = field(
        default_factory=list,
        metadata={
            "help": "One entry per residual in chain order: module, config (ResidualConfig), "
            "d, K, m, tau, atlas_variant."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = PeftType.ATLAS
        for i, r in enumerate(self.residuals):
            missing = {"module", "config", "d", "K", "m", "tau", "atlas_variant"} - set(r)
            if missing:
                raise ValueError(f"residuals[{i}]: fields {sorted(missing)} missing")


class StoredResidual(nn.Module):
    """A residual whose atlas geometry is stored with its weights, so PEFT saves and loads all of it;
    the AtlasResidual that computes Delta(h) is rebuilt from them after every load."""

    def __init__(self, spec: dict):
        super().__init__()
        self.spec, config = spec, ResidualConfig(**spec["config"])
        d, k, m, r = spec["d"], spec["K"], spec["m"], config.rank
        self.A = nn.Parameter(torch.zeros(r, d))  # (r, d)
        self.B = nn.Parameter(torch.zeros(d, r))  # (d, r)
        self.register_buffer("s", torch.tensor(float("nan")))
        self.register_buffer("s_d", torch.tensor(float("nan")))
        has_atlas = spec["atlas_variant"] is not None
        self.register_buffer("centers", torch.zeros(k, d) if has_atlas else torch.zeros(0))  # (K, d)
        self.register_buffer("bases", torch.zeros(k, d, m) if has_atlas else torch.zeros(0))  # (K, d, m)
        self._built: tuple | None = None

    def residual(self) -> AtlasResidual:
        key = (self.centers._version, self.bases._version, self.centers.device)
        if self._built is None or self._built[0] != key:
            spec, config = self.spec, ResidualConfig(**self.spec["config"])
            atlas = None
            if spec["atlas_variant"] is not None:
                atlas = Atlas(
                    self.centers.float(),
                    self.bases.float(),
                    torch.ones(spec["K"], spec["m"]),
                    spec["tau"],
                    self.centers.float(),
                    meta={"config": {"variant": spec["atlas_variant"]}},
                )
            r = AtlasResidual(config, spec["d"], atlas, calibrate=False).to(self.centers.device)
            r.A, r.B, r.s, r.s_d = self.A, self.B, self.s, self.s_d  # shared: the loaded values
            self._built = (key, r)
        return self._built[1]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.residual()(h)


class AtlasPeftLayer(nn.Module, BaseTunerLayer):
    """A decoder layer with residuals on its output: h' = h + D_1(h), h'' = h' + D_2(h'), ..."""

    adapter_layer_names = ("atlas_residuals",)

    def __init__(self, base_layer: nn.Module, adapter_name: str, specs: list[dict]):
        super().__init__()
        self.base_layer = base_layer
        self.atlas_residuals = nn.ModuleDict({})
        self._active_adapter = adapter_name
        self.merged_adapters: list[str] = []
        self.update_layer(adapter_name, specs)

    def update_layer(self, adapter_name: str, specs: list[dict]) -> None:
        self.atlas_residuals[adapter_name] = nn.ModuleList([StoredResidual(s) for s in specs])
        self.set_adapter(adapter_name)

    def forward(self, *args, **kwargs):
        out = self.base_layer(*args, **kwargs)
        if self.disable_adapters:
            return out
        h = layer_output(out)  # (B, T, d)
        for name in self.active_adapters:
            for r in self.atlas_residuals[name] if name in self.atlas_residuals else ():
                h = h + r(h)
        return with_layer_output(out, h)

    def merge(self, *args, **kwargs) -> None:
        raise ValueError("an ATLAS residual is routed by h itself: it folds into no weight and cannot be merged")


class AtlasPeftModel(BaseTuner):
    prefix: str = "atlas_"
    tuner_layer_cls = AtlasPeftLayer
    target_module_mapping: dict = {}

    def _create_and_replace(
        self,
        peft_config: AtlasPeftConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
    ) -> None:
        specs = [r for r in peft_config.residuals if current_key.endswith(r["module"])]
        if isinstance(target, AtlasPeftLayer):
            target.update_layer(adapter_name, specs)
            return
        self._replace_module(parent, target_name, AtlasPeftLayer(target, adapter_name, specs), target)

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # "...atlas_residuals.<adapter>.<i>.A" on disk is "...atlas_residuals.<i>.A" (PEFT's own rule
        # only drops the name when it is second to last, as in lora_A.<adapter>.weight)
        return key.replace(f".atlas_residuals.{adapter_name}.", ".atlas_residuals.")

    def _cast_adapter_dtype(self, adapter_name: str, autocast_adapter_dtype: bool = True) -> None:
        pass  # the residual keeps fp32 factors and geometry and computes in the input's dtype itself


def register() -> None:
    """Make ATLAS a PEFT method; idempotent. Runs when this module is imported, which `import
    atlas_core` arranges for the moment PEFT is imported (see atlas_core._RegisterWithPeft), and
    which export_peft does itself."""
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

    _add_peft_type()
    if PeftType.ATLAS not in PEFT_TYPE_TO_TUNER_MAPPING:  # register_peft_method refuses a second time
        register_peft_method(name=NAME, config_cls=AtlasPeftConfig, model_cls=AtlasPeftModel, prefix="atlas_")


register()


def save_atlas_adapter(chain, model: nn.Module, base_model: str, out: str | Path) -> None:
    """A chain of residuals on `model`'s decoder layers as one PEFT adapter folder
    (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    specs, tensors, index = [], {}, {}
    for delta in chain.deltas:
        module = f"{decoder_layers_name(model)}.{delta.config.layer}"
        i = index[module] = index.get(module, -1) + 1  # position among the residuals of this layer
        has_atlas = delta.config.atlas_variant is not None
        specs.append(
            {
                "module": module,
                "config": delta.config.to_dict(),
                "d": delta.dim,
                "K": delta.centers.shape[0] if has_atlas else 0,
                "m": delta.m if has_atlas else 0,
                "tau": float(delta.tau) if has_atlas else 1.0,
                "atlas_variant": delta.config.atlas_variant,
            }
        )
        prefix = f"base_model.model.{module}.atlas_residuals.{i}"
        parts = {"A": delta.A, "B": delta.B, "s": delta.s, "s_d": delta.s_d}
        if has_atlas:  # U is (d, Km) = bases permuted; store the (K, d, m) form the Atlas takes
            parts |= {"centers": delta.centers, "bases": delta.U.T.reshape(-1, delta.m, delta.dim).transpose(1, 2)}
        for name, t in parts.items():
            tensors[f"{prefix}.{name}"] = (
                t.detach().float().cpu().clone(memory_format=torch.contiguous_format)
            )  # may share an atlas
    config = AtlasPeftConfig(
        target_modules=sorted(index), residuals=specs, base_model_name_or_path=base_model, task_type="CAUSAL_LM"
    )
    config.save_pretrained(str(out))
    save_file(tensors, str(Path(out) / "adapter_model.safetensors"), metadata={"format": "pt"})
