"""Retained activation atlas: fit (k-means charts + local PCA), store, route, filter."""

from .config import ATLAS_VARIANTS, AtlasConfig
from .fit import fit_atlas, kmeans
from .model import Atlas, apply_filter, route, route_with_offset

__all__ = [
    "ATLAS_VARIANTS",
    "Atlas",
    "AtlasConfig",
    "apply_filter",
    "fit_atlas",
    "kmeans",
    "route",
    "route_with_offset",
]
