"""Activation extraction that stops after layer l versus a full forward (all layers + LM head),
default backbone, the same batch of GSM8K contexts.

    .venv/bin/python bench/extraction.py [--layer 15 --batch 16 --dtype auto]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.backbone import hidden_at_layer, load_backbone
from bench.common import machine, reading, timeit
from evaluation.contexts import retained_contexts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    bb = load_backbone("smollm2-135m", args.dtype)
    _, texts = retained_contexts(bb.tokenizer, "gsm8k", limit=args.batch)
    batch = bb.tokenizer(texts, return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]

    with torch.no_grad():
        t_full = timeit(lambda: bb.model(input_ids=ids, attention_mask=mask, use_cache=False), repeat=args.repeat)
        t_stop = timeit(lambda: hidden_at_layer(bb.model, args.layer, ids, mask), repeat=args.repeat)
    ideal = (args.layer + 1) / bb.num_layers
    print(f"machine: {machine()}")
    print(
        f"{bb.name} ({bb.dtype}), batch {tuple(ids.shape)}, layer {args.layer} of {bb.num_layers}, "
        f"median of {args.repeat}"
    )
    print(f"  full forward (all layers + LM head): {t_full:.3f} s")
    print(f"  stop after layer {args.layer}:            {t_stop:.3f} s")
    print(
        f"  ratio stop/full {t_stop / t_full:.3f} (layers run: (l+1)/L = {ideal:.3f}); speed-up {t_full / t_stop:.2f}x"
    )
    reading(
        f"extraction stopping after layer {args.layer} of {bb.num_layers}",
        f"{t_stop / t_full:.3f} of a full forward ({t_full / t_stop:.2f}x faster)",
        f"approaches (l+1)/L = {ideal:.3f}",
        "yes" if t_stop / t_full <= ideal * 1.1 else "**no**",
    )


if __name__ == "__main__":
    main()
