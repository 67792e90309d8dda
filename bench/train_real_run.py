"""A real training run: a config from configs/train/ on the default backbone, MBPP train
(120 problems) with validation loss on MBPP validation (43) at every checkpoint.

    .venv/bin/python bench/train_real_run.py [--config configs/train/atlas.yaml --epochs 2 --every 5]

Fits the GSM8K atlas first if the state dir has none. Writes under <state>/runs/; prints
the training summary, the validation losses per checkpoint and the peak memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.backbone import load_backbone
from atlas_core.paths import state_dir
from atlas_core.residual import RESIDUAL_VARIANTS
from atlas_core.train import build_adapter, load_run_config, prepare_data, read_state, train
from bench.common import machine
from bench.train_common import atlas_for, gsm8k_texts, mbpp_pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/train/atlas.yaml")
    parser.add_argument("--epochs", type=int, default=None, help="override train.epochs")
    parser.add_argument("--every", type=int, default=None, help="override train.checkpoint_every_steps")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    config = load_run_config(args.config)
    train_config = replace(
        config.train,
        epochs=args.epochs or config.train.epochs,
        checkpoint_every_steps=config.train.checkpoint_every_steps if args.every is None else args.every,
    )
    backbone = load_backbone(config.backbone)
    layer = backbone.middle_layer if config.layer == -1 else config.layer
    needed = RESIDUAL_VARIANTS.get(config.adapter)
    atlas = atlas_for(backbone, layer, needed) if needed else None
    adapter = build_adapter(replace(config, layer=layer), backbone.model, atlas)
    retained = gsm8k_texts(256, split="train") if train_config.objective.uses_retained else None
    data = prepare_data(
        backbone.tokenizer, mbpp_pairs("train"), train_config, val=mbpp_pairs("validation"), retained=retained
    )
    run_dir = Path(args.run_dir or state_dir() / "runs" / f"{Path(args.config).stem}-L{layer}-seed{train_config.seed}")
    summary = train(backbone.model, adapter, data, train_config, run_dir)
    state = read_state(summary.checkpoints[-1])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nmachine: {machine()}")
    print(
        f"train examples {len(data.train)} ({int(data.train.lengths.sum()):,} tokens, "
        f"{data.train.target_tokens:,} response tokens), val examples {len(data.val)}"
    )
    print("val loss per checkpoint:", json.dumps({k: round(v, 4) for k, v in state["val_losses"].items()}))
    print("train loss per step:", [round(x, 3) for x in state["train_losses"]])
    print(f"wall time including load, atlas and caches: {time.perf_counter() - start:.0f} s; peak RSS {peak:,.0f} MiB")


if __name__ == "__main__":
    main()
