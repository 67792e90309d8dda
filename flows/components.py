"""The pluggable parts of a cycle: backbone loading and target scorers (evaluation/scorers.py:
the built-ins and a user's 'package.module:Factory', all built from YAML).
"""

from __future__ import annotations

import json


def load_model(name: str, dtype: str):
    """The cycle's backbone (evaluation.tiny.load_model: 'tiny-llama' or any atlas_core backbone)."""
    from evaluation.tiny import load_model as load

    return load(name, dtype)


# ------------------------------------------------------------------------------ target scorers
def make_scorer(target: dict):
    """The target scorer of a skill from its target spec ({scorer, options}: flows.skills.SkillSpec.target,
    also as a training run stored it), built and validated without a model."""
    from evaluation.scorers import build_scorer

    return build_scorer(target["scorer"], dict(target.get("options") or {}))


def json_dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
