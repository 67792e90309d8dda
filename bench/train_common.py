"""What the training benchmark and the real run share: MBPP pairs, GSM8K texts, the atlas.

MBPP files are read directly (a tiny adapter; evaluation.data has the verified loaders).
Prompts use evaluation.prompts.code_message when it is importable, so training sees the
same user message that generation does.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.atlas import Atlas, AtlasConfig, fit_atlas  # noqa: E402
from atlas_core.extract import sample_activations  # noqa: E402
from atlas_core.paths import data_dir, state_dir  # noqa: E402

try:
    from evaluation.prompts import code_message
except ImportError:  # the same message, for a checkout without the evaluation package
    def code_message(text: str, first_test: str) -> str:
        return (f"{text.strip()}\nYour code should pass this test:\n\n{first_test.strip()}\n\n"
                "Write the Python function in a single ```python code block.")


def mbpp_pairs(split: str) -> list[dict]:
    """Sanitized-MBPP `split` as {"prompt", "response", "id"}: problem + first test -> reference code."""
    root = data_dir() / "mbpp"
    ids = set(json.loads((root / "splits.json").read_text())["sanitized_task_ids"][split])
    rows = [r for r in json.loads((root / "sanitized-mbpp.json").read_text()) if r["task_id"] in ids]
    return [{"prompt": code_message(r["prompt"], r["test_list"][0]),
             "response": f"```python\n{r['code'].strip()}\n```", "id": f"mbpp-{r['task_id']}"} for r in rows]


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
    atlas = fit_atlas(x, config, meta={"layer": layer, "backbone": backbone.name, "revision": backbone.revision,
                                       "data": f"gsm8k test, first {num_vectors // 2} question+answer"})
    atlas.save(path)
    return atlas
