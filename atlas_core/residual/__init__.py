"""The shared ATLAS residual: config, operator, attaching to a model, adapter files."""

from .config import FULL_FORM, RESIDUAL_VARIANTS, ResidualConfig
from .layer import AtlasResidual
from .model import Attachment, attach, build_residual, load_adapter, save_adapter

__all__ = [
    "FULL_FORM",
    "RESIDUAL_VARIANTS",
    "AtlasResidual",
    "Attachment",
    "ResidualConfig",
    "attach",
    "build_residual",
    "load_adapter",
    "save_adapter",
]
