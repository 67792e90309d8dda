"""What the training benchmark and the real run share: MBPP pairs, GSM8K texts, the atlas.

MBPP pairs are evaluation.data.mbpp_pairs (sha256-checked files; the user message is the one
generation sends), re-exported here so the training scripts import one module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.atlas import Atlas, AtlasConfig, fit_atlas
from atlas_core.extract import sample_activations
from atlas_core.paths import data_dir, state_dir
from evaluation.data import mbpp_pairs  # noqa: F401  (re-exported)


def gsm8k_texts(n: int, split: str = "test") -> list[str]:
    lines = (data_dir() / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:n]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in map(json.loads, lines)]


def atlas_for(backbone, layer: int, variant: str = "local", num_vectors: int = 1024) -> Atlas:
    """The GSM8K atlas at `layer` (fitted once, then loaded from the state dir)."""
    path = state_dir() / "atlases" / f"smollm2-135m-L{layer}-gsm8k-{variant}.safetensors"
    if path.exists():
        return Atlas.load(path)
    x = sample_activations(backbone.model, backbone.tokenizer, gsm8k_texts(num_vectors // 2), layer, num_vectors)
    config = AtlasConfig(variant=variant, num_vectors=num_vectors)
    atlas = fit_atlas(
        x,
        config,
        meta={
            "layer": layer,
            "backbone": backbone.name,
            "revision": backbone.revision,
            "data": f"gsm8k test, first {num_vectors // 2} question+answer",
        },
    )
    atlas.save(path)
    return atlas
