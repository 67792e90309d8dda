"""The pluggable parts of a cycle: backbone loading and target scorers (evaluation/scorers.py:
the built-ins and a user's 'package.module:Factory', all built from YAML).
"""
from __future__ import annotations

import json

TINY_BACKBONE = "tiny-llama"


def load_model(name: str, dtype: str):
    """An `atlas_core.backbone.Backbone` in `dtype` (a name from DTYPES, 'auto' included);
    'tiny-llama' is a seeded random 4-layer fp32 toy (tests)."""
    from atlas_core.backbone import Backbone, decoder_layers, load_backbone

    if name != TINY_BACKBONE:
        return load_backbone(name, dtype)
    from evaluation.tiny import tiny_llama, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), seed=0, hidden_size=64, layers=4)
    model.config.max_position_embeddings = 2048  # GSM8K contexts in a 400-token BPE run long
    return Backbone(TINY_BACKBONE, f"tiny-seed0-d64-l4-v{len(tokenizer)}", model, tokenizer, decoder_layers(model))


# ------------------------------------------------------------------------------ target scorers
def make_scorer(spec):
    """The target scorer of a skill (flows.skills.SkillSpec), built and validated without a model."""
    from evaluation.scorers import build_scorer

    return build_scorer(spec.target["scorer"], dict(spec.target.get("options") or {}))


def json_dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
