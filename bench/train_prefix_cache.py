"""Training throughput with the frozen-prefix cache versus without, same batches, default
backbone (SmolLM2-135M, 30 layers) with full ATLAS at its middle layer (15), MBPP train.

    .venv/bin/python bench/train_prefix_cache.py [--batches 6 --batch-size 8 --layer 15]

Part 1 times each phase of a step on the same batches, cached and uncached interleaved.
Part 2 runs `train()` end to end on a subset both ways (tokens/s from its summary; the
one-off cache build is reported separately and amortised over 5 epochs).
Part 3 repeats part 1's step timing at other layers (`--curve`): the cache skips the forward of
layers 0..l but not the forward and backward of l+1..L, so the speed-up to expect is
(F_low + F_up + B_up) / (F_up + B_up), about 1.5x at l = L/2 when B_up ~ F_up (frozen
weights: input gradients only), and it grows with l. Beside the measured ratios it prints
that ratio counted in matmul FLOPs (`matmul_ratio`), which is where ~3/4 of a step goes on
CPU (torch.profiler: aten::mm), and its ceiling with a free LM head, 1 + (l+1) / (2 (L-l-1)).
Prints a markdown section; bench/run_all.py puts it into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.backbone import decoder_layers, hidden_at_layer, load_backbone
from atlas_core.residual import ResidualConfig, build_residual
from atlas_core.train import TrainConfig, build_caches, epoch_batches, prepare_data, train
from atlas_core.train.adapters import ResidualAdapter
from atlas_core.train.data import collate
from atlas_core.train.objectives import selected_logits
from bench.common import machine, reading
from bench.train_common import atlas_for, mbpp_pairs


def timed_step(model, adapter, batch, cache, optimizer) -> dict[str, float]:
    t = {}
    start = time.perf_counter()
    logits, targets = selected_logits(model, adapter, batch, cache)  # forward (cache gather included)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    t["forward + head + loss"] = time.perf_counter() - start
    start = time.perf_counter()
    loss.backward()
    t["backward"] = time.perf_counter() - start
    start = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t["optimizer"] = time.perf_counter() - start
    return t


def part1_batches(data, args) -> list[list[int]]:
    """Part 1's batches (first epoch, seed 0): one warm-up batch, then `args.batches` timed ones."""
    return epoch_batches(data.train.lengths, args.batch_size, 0, 0)[: args.batches + 1]


def step_times(model, adapter, data, cache, layer: int, args) -> tuple[dict, int]:
    """Per-phase seconds of `args.batches` steps (after one warm-up), cached and uncached
    interleaved on the same batches, and the forward of layers 0..layer alone."""
    optimizer = torch.optim.AdamW([p for _, p in adapter.named_trainable()], lr=1e-5)
    batches = part1_batches(data, args)
    rows = {"cached": [], "uncached": [], "lower": []}
    tokens = 0
    for i, index in enumerate(batches):
        batch = collate(data.train, index, data.pad_id)
        c = timed_step(model, adapter, batch, cache, optimizer)
        u = timed_step(model, adapter, batch, None, optimizer)
        start = time.perf_counter()
        hidden_at_layer(model, layer, batch.ids, batch.mask)
        low = time.perf_counter() - start
        if i == 0:
            continue  # warm-up
        rows["cached"].append(c), rows["uncached"].append(u), rows["lower"].append(low)
        tokens += int(batch.mask.sum())
    return rows, tokens


def mean_step(rows: list[dict[str, float]]) -> float:
    """Mean seconds of a whole step over `rows` (one dict of phase seconds per step)."""
    return sum(sum(r.values()) for r in rows) / len(rows)


def matmul_ratio(model, data, layer: int, args) -> float:
    """Part 1's uncached/cached step ratio counted in multiply-adds of the backbone's linear
    layers over the same batches: each decoder layer's nn.Linear weights once per (padded)
    token, the LM head once per supervised (response) position. With frozen weights a
    backward computes input gradients only: as many multiply-adds as the forward."""
    layers = decoder_layers(model)
    per_token_layer = sum(m.weight.numel() for m in layers[0].modules() if isinstance(m, torch.nn.Linear))
    per_target_head = model.get_output_embeddings().weight.numel()
    lower = upper = 0
    for index in part1_batches(data, args)[1:]:  # the timed ones
        batch = collate(data.train, index, data.pad_id)
        padded, supervised = batch.ids.numel(), int((batch.targets != -100).sum())
        lower += (layer + 1) * per_token_layer * padded
        upper += (len(layers) - layer - 1) * per_token_layer * padded + per_target_head * supervised
    return (lower + 2 * upper) / (2 * upper)


def free_head_ceiling(layer: int, n_layers: int) -> float:
    """`matmul_ratio` if the LM head cost nothing: 1 + (l+1) / (2 (L-l-1)); 1.5x at l = L/2."""
    return 1 + (layer + 1) / (2 * (n_layers - layer - 1))


def layer_curve(backbone, data, layers: list[int], args) -> list[tuple[int, float, float, float, float]]:
    """(layer, cached s/step, uncached s/step, lower-forward s, matmul ratio) at each layer: part 1's timing."""
    out = []
    for layer in layers:
        residual = build_residual(
            ResidualConfig(variant="atlas", layer=layer, rank=16), backbone.model, atlas_for(backbone, layer)
        )
        torch.nn.init.normal_(residual.B, std=1e-3)
        cache = build_caches(backbone.model, data, layer)["train"]
        rows, _ = step_times(backbone.model, ResidualAdapter(residual), data, cache, layer, args)
        out.append(
            (
                layer,
                mean_step(rows["cached"]),
                mean_step(rows["uncached"]),
                statistics.median(rows["lower"]),
                matmul_ratio(backbone.model, data, layer, args),
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--subset", type=int, default=48, help="examples in the end-to-end part")
    parser.add_argument("--curve", default="10,15,18,21,24", help="layers of part 3 (comma-separated; '' skips it)")
    args = parser.parse_args()

    backbone = load_backbone("smollm2-135m")
    model, layer = backbone.model, args.layer
    atlas = atlas_for(backbone, layer)
    residual = build_residual(ResidualConfig(variant="atlas", layer=layer, rank=16), model, atlas)
    torch.nn.init.normal_(residual.B, std=1e-3)
    adapter = ResidualAdapter(residual)
    config = TrainConfig(batch_size=args.batch_size, progress=False)
    data = prepare_data(backbone.tokenizer, mbpp_pairs("train"), config)
    start = time.perf_counter()
    cache = build_caches(model, data, layer)["train"]
    cache_s = time.perf_counter() - start

    # ---- part 1: per-phase times on the same batches, interleaved
    rows, tokens = step_times(model, adapter, data, cache, layer, args)
    total = {k: sum(sum(r.values()) for r in rows[k]) for k in ("cached", "uncached")}
    phases = list(rows["cached"][0])

    # ---- part 2: train() end to end on a subset, both ways
    subset = replace(
        data,
        train=replace(
            data.train,
            ids=data.train.ids[: args.subset],
            prompt_len=data.train.prompt_len[: args.subset],
            example_ids=data.train.example_ids[: args.subset],
        ),
    )
    e2e = {}
    for cached in (True, False):
        residual2 = build_residual(ResidualConfig(variant="atlas", layer=layer, rank=16), model, atlas)
        cfg = replace(config, epochs=1, prefix_cache=cached, lr=2e-4)
        with tempfile.TemporaryDirectory() as tmp:
            e2e[cached] = train(model, residual2, subset, cfg, tmp)
    cache_subset_s = cache_s * args.subset / len(data.train)
    epoch_c = e2e[True].seconds
    amortised = (5 * e2e[False].seconds) / (5 * epoch_c + cache_subset_s)
    curve = layer_curve(backbone, data, [int(x) for x in args.curve.split(",") if x.strip()], args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    n, n_layers = len(rows["cached"]), model.config.num_hidden_layers
    print("\n### Prefix cache: training throughput (bench/train_prefix_cache.py)\n")
    print(
        f"Machine: {machine()}. Backbone smollm2-135m (30 layers, d=576), fp32, full ATLAS r=16 at layer {layer}; "
        f"MBPP train, batch {args.batch_size}, right padding, logits only at response positions.\n"
    )
    print(
        f"Part 1: {n} steps on the same batches ({tokens:,} real tokens), cached and uncached interleaved; "
        "median seconds per step:\n"
    )
    print("| phase | with prefix cache | without |")
    print("|---|---|---|")
    for p in phases:
        print(
            f"| {p} | {statistics.median(r[p] for r in rows['cached']):.3f} | "
            f"{statistics.median(r[p] for r in rows['uncached']):.3f} |"
        )
    print(f"| *(of which layers 0..{layer}, no grad)* | 0 (cached) | {statistics.median(rows['lower']):.3f} |")
    print(f"| **total per step** | **{total['cached'] / n:.3f}** | **{total['uncached'] / n:.3f}** |")
    print(f"| tokens/s | {tokens / total['cached']:,.0f} | {tokens / total['uncached']:,.0f} |\n")
    print(
        f"Step-time ratio (uncached / cached): **{total['uncached'] / total['cached']:.2f}x**. The same ratio "
        f"counted in matmul FLOPs over these batches: {matmul_ratio(model, data, layer, args):.2f}x; with a free "
        f"LM head at most {free_head_ceiling(layer, n_layers):.2f}x.\n"
    )
    print(
        f"Part 2: `train()` end to end, 1 epoch on {args.subset} examples "
        f"({e2e[True].steps} steps, {e2e[True].tokens:,} tokens, validation and checkpoints off the clock):\n"
    )
    print("| | tokens/s | epoch time (s) |")
    print("|---|---|---|")
    print(f"| prefix cache | {e2e[True].tokens_per_s:,.0f} | {e2e[True].seconds:.1f} |")
    print(f"| no cache | {e2e[False].tokens_per_s:,.0f} | {e2e[False].seconds:.1f} |\n")
    print(
        f"Ratio {e2e[False].seconds / e2e[True].seconds:.2f}x per epoch. Building the cache for all "
        f"{len(data.train)} training examples took {cache_s:.1f} s once ({cache.nbytes / 2**20:.0f} MiB fp32); "
        f"over 5 epochs, cache build included: {amortised:.2f}x. Peak RSS of this process: {peak:,.0f} MiB."
    )
    if curve:
        print(
            f"\nPart 3: step time by adapted layer (part 1's timing, {args.batches} steps each, mean seconds per "
            "step). The cache removes only the forward of layers 0..l, so the expected ratio is the uncached step "
            "over the uncached step less that forward; steps on this 2-core VM vary by ~15% between repeats:\n"
        )
        print(
            "| layer l | (l+1) / L | with cache | without | ratio | without / (without - forward of 0..l) "
            "| matmul FLOPs | ceiling, free head |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for lay, c, u, low, flops in curve:
            print(
                f"| {lay} | {(lay + 1) / n_layers:.2f} | {c:.3f} | {u:.3f} | **{u / c:.2f}x** | {u / (u - low):.2f}x "
                f"| {flops:.2f}x | {free_head_ceiling(lay, n_layers):.2f}x |"
            )
    step, ceiling = total["uncached"] / total["cached"], free_head_ceiling(layer, n_layers)
    by_layer = "".join(f"; {u / c:.2f}x at l = {lay}" for lay, c, u, _, _ in curve or [])
    reading(
        f"training with the prefix cache, layer {layer} of {n_layers}",
        f"{step:.2f}x per step, {e2e[False].seconds / e2e[True].seconds:.2f}x per epoch{by_layer}",
        ">= 1.7x at l = L/2",
        "yes" if step >= 1.7 else f"**no** at L/2: no exact method can (matmul FLOP ceiling {ceiling:.2f}x, Notes)",
    )


if __name__ == "__main__":
    main()
