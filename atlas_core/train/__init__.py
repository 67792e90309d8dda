"""Training residuals and baselines: configs, prefix cache, trainer, checkpoints, LR sweep.

from atlas_core.train import TrainConfig, prepare_data, train
data = prepare_data(tokenizer, train_pairs, config, val=val_pairs)
summary = train(model, residual, data, config, run_dir)

The names below are imported from their modules when first used, so importing one module of
the package (a method module, atlas_core.methods' built-ins) runs none of the others: the
package has no import cycle whichever module is imported first.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "adapters": ("ResidualAdapter", "as_adapter", "build_adapter"),
    "checkpoint": ("latest_checkpoint", "list_checkpoints", "load_checkpoint", "read_state"),
    "config": (
        "ConfigError",
        "LoRAOptions",
        "ObjectiveConfig",
        "ResidualOptions",
        "RunConfig",
        "TrainConfig",
        "load_run_config",
    ),
    "data": ("Example", "TokenizedSet", "collate", "epoch_batches", "render_chat", "tokenize"),
    "lora": ("WeightLoRA",),
    "prefix_cache": ("PrefixCache", "full_hidden", "head_logits", "upper_hidden"),
    "sweep": ("SweepResult", "sweep_learning_rate"),
    "trainer": ("TrainData", "TrainingDiverged", "TrainSummary", "build_caches", "prepare_data", "train"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
