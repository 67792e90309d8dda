"""Training residuals and baselines: configs, prefix cache, trainer, checkpoints, LR sweep.

from atlas_core.train import TrainConfig, prepare_data, train
data = prepare_data(tokenizer, train_pairs, config, val=val_pairs)
summary = train(model, residual, data, config, run_dir)
"""

from .adapters import ResidualAdapter, as_adapter, build_adapter
from .checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, read_state
from .config import ConfigError, LoRAOptions, ObjectiveConfig, ResidualOptions, RunConfig, TrainConfig, load_run_config
from .data import Example, TokenizedSet, collate, epoch_batches, render_chat, tokenize
from .lora import WeightLoRA
from .prefix_cache import PrefixCache, full_hidden, head_logits, upper_hidden
from .sweep import SweepResult, sweep_learning_rate
from .trainer import TrainData, TrainingDiverged, TrainSummary, build_caches, prepare_data, train

__all__ = [
    "ConfigError",
    "Example",
    "LoRAOptions",
    "ObjectiveConfig",
    "PrefixCache",
    "ResidualAdapter",
    "ResidualOptions",
    "RunConfig",
    "build_adapter",
    "TokenizedSet",
    "TrainConfig",
    "TrainData",
    "TrainSummary",
    "TrainingDiverged",
    "WeightLoRA",
    "as_adapter",
    "build_caches",
    "collate",
    "epoch_batches",
    "full_hidden",
    "head_logits",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_run_config",
    "prepare_data",
    "read_state",
    "render_chat",
    "SweepResult",
    "sweep_learning_rate",
    "tokenize",
    "train",
    "upper_hidden",
]
