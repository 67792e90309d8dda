"""Greedy decoding throughput (new tokens/s) of the default backbone at batch 1, 8 and 32:
transformers' `generate`, the platform's loop (evaluation.generate), and the platform's loop with
a full ATLAS residual attached (its overhead), next to the memory-bandwidth bound of this machine.

Every row of a batch decodes exactly `--new-tokens` tokens (no eos, no stop) from the same
prompts, so the three are timed on the same work; best of `--repeat`, the three interleaved.
The bound: a decoding step reads every weight once (bf16: 2 bytes a parameter; the KV cache is
small here), so tokens/s <= batch x bandwidth / weight bytes, with the bandwidth measured below
as the read rate of a 1 GiB tensor summed on all threads.

    .venv/bin/python bench/decoding.py [--new-tokens 64 --dtype auto --repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.atlas import AtlasConfig, fit_atlas
from atlas_core.backbone import load_backbone
from atlas_core.extract import sample_activations
from atlas_core.residual import ResidualConfig, attach, build_residual
from bench.common import machine, reading
from evaluation.contexts import retained_contexts
from evaluation.generate import _greedy_batch, _Stops

BATCHES = (1, 8, 32)


def read_bandwidth(gib: float = 1.0, repeat: int = 5) -> float:
    """Bytes/s at which this machine's threads read a tensor far larger than its caches."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()  # touch every page first
    best = min(_timed(x.sum) for _ in range(repeat))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    bb = load_backbone("smollm2-135m", args.dtype)
    model, tok = bb.model, bb.tokenizer
    _, texts = retained_contexts(tok, "gsm8k", limit=256)
    x = sample_activations(model, tok, texts, args.layer, 1024, per_example=4, progress=False)
    atlas = fit_atlas(x, AtlasConfig(num_charts=32, rank=16, num_vectors=len(x)), {"layer": args.layer})
    residual = build_residual(ResidualConfig(variant="atlas", layer=args.layer), model, atlas)
    torch.nn.init.normal_(residual.B, std=0.01)
    tok.padding_side = "left"
    prompts = [t[: t.index("<|im_start|>assistant")] + "<|im_start|>assistant\n" for t in texts]
    never = _Stops(tok, [], (), None)  # every row decodes the full budget

    def hf(enc) -> None:
        model.generate(
            **enc,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )

    def ours(enc) -> None:
        _greedy_batch(model, enc["input_ids"], enc["attention_mask"], args.new_tokens, never)

    def adapted(enc) -> None:
        with attach(model, residual):
            ours(enc)

    bandwidth = read_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"machine: {machine()}")
    print(
        f"{bb.name} ({bb.dtype}, {weight_bytes / 1e6:.0f} MB of weights); read bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"full ATLAS residual at layer {args.layer} (K=32, m=16, r=16); {args.new_tokens} new tokens a row, "
        f"best of {args.repeat}, interleaved"
    )
    print(
        f"{'batch':>5} {'bound tok/s':>11} {'generate':>9} {'ours':>7} {'ours/generate':>13} {'ours % of bound':>15} "
        f"{'adapted':>8} {'overhead':>8}"
    )
    overheads = {}
    with torch.no_grad():
        for batch in BATCHES:
            enc = tok(prompts[:batch], return_tensors="pt", padding=True, add_special_tokens=False)
            times = {fn: [] for fn in (hf, ours, adapted)}
            for _ in range(args.repeat):
                for fn in times:
                    times[fn].append(_timed(lambda: fn(enc)))
            rate = {fn: batch * args.new_tokens / min(t) for fn, t in times.items()}
            bound = batch * bandwidth / weight_bytes
            print(
                f"{batch:5d} {bound:11.1f} {rate[hf]:9.1f} {rate[ours]:7.1f} {rate[ours] / rate[hf]:12.2f}x "
                f"{rate[ours] / bound:15.0%} {rate[adapted]:8.1f} {rate[ours] / rate[adapted] - 1:8.1%}"
            )
            overheads[batch] = (rate[ours] / rate[adapted] - 1, rate[adapted])
    reading(
        "decoding with a full ATLAS residual (the platform's loop)",
        ", ".join(f"{o:+.1%} at batch {b} ({r:.1f} tok/s)" for b, (o, r) in overheads.items()),
        "<= 5% slower than the base",
        "yes" if all(o <= 0.05 for o, _ in overheads.values()) else "**no**",
    )


if __name__ == "__main__":
    main()
