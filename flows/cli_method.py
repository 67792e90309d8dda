"""The method-level commands of `atlas`: backbone, fit-atlas, demo, eval-base.

Each imports what it needs when it runs, so `atlas --help` stays instant.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def _dtype(name: str):
    from atlas_core.backbone import resolve_dtype

    return resolve_dtype(name)


def cmd_backbone(args: argparse.Namespace) -> int:
    from atlas_core.backbone import load_backbone

    start = time.perf_counter()
    bb = load_backbone(args.backbone, _dtype(args.dtype))
    print(
        f"backbone   {bb.name}\nrevision   {bb.revision}\nclass      {type(bb.model).__name__}\n"
        f"layers     {bb.num_layers} (middle {bb.middle_layer})\nhidden     {bb.hidden_size}\n"
        f"loaded in  {time.perf_counter() - start:.1f} s"
    )
    return 0


def _fit(args: argparse.Namespace):
    """Extract calibration activations from retained contexts and fit an atlas."""
    from atlas_core.atlas import AtlasConfig, fit_atlas
    from atlas_core.backbone import load_backbone
    from atlas_core.extract import sample_activations
    from evaluation.contexts import retained_contexts
    from evaluation.datafiles import known, verified_path

    config = AtlasConfig(
        num_charts=args.charts,
        rank=args.rank,
        variant=args.variant,
        equal_support=args.equal_support,
        num_vectors=args.num_vectors,
        per_example=args.per_example,
        seed=args.seed,
    )
    bb = load_backbone(args.backbone, _dtype(args.dtype))
    layer = bb.middle_layer if args.layer == -1 else args.layer
    examples = -(-config.num_vectors // config.per_example)
    _, texts = retained_contexts(bb.tokenizer, args.retained, limit=examples)
    start = time.perf_counter()
    x = sample_activations(bb.model, bb.tokenizer, texts, layer, config.num_vectors, config.per_example, config.seed)
    extracted = time.perf_counter()
    data_file = {"gsm8k": "gsm8k/test.jsonl", "csqa": "csqa/dev_rand_split.jsonl"}[args.retained]
    verified_path(data_file)
    meta = {
        "backbone": bb.name,
        "revision": bb.revision,
        "layer": layer,
        "dtype": bb.dtype,
        "data": {data_file: known(data_file).sha256, "examples": examples},
    }
    atlas = fit_atlas(x, config, meta)
    print(
        f"extracted {len(x)} vectors at layer {layer}/{bb.num_layers} in {extracted - start:.1f} s; "
        f"fitted K={atlas.num_charts} m={atlas.rank} in {time.perf_counter() - extracted:.2f} s (tau={atlas.tau:.1f})"
    )
    return bb, atlas


def cmd_fit_atlas(args: argparse.Namespace) -> int:
    from atlas_core.paths import state_dir

    _, atlas = _fit(args)
    out = (
        Path(args.out)
        if args.out
        else state_dir() / "atlases" / f"{args.backbone}-l{atlas.meta['layer']}-{args.variant}.safetensors"
    )
    manifest = atlas.save(out)
    print(f"atlas saved: {out} (sha256 {manifest['sha256'][:16]}..., {out.stat().st_size / 2**20:.2f} MiB)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Fit an atlas, attach a full ATLAS residual and show what the method guarantees."""
    import torch

    from atlas_core.paths import state_dir
    from atlas_core.residual import ResidualConfig, attach, build_residual, load_adapter, save_adapter
    from evaluation.contexts import retained_contexts
    from evaluation.kl import RetainedKL

    bb, atlas = _fit(args)
    atlas.save(state_dir() / "demo" / "atlas.safetensors")
    layer = atlas.meta["layer"]
    residual = build_residual(ResidualConfig(variant="atlas", layer=layer, scale="calibrated"), bb.model, atlas)
    print(
        f"residual: {residual}, trainable parameters {sum(p.numel() for p in residual.parameters())} "
        f"(2*d*r = {2 * bb.hidden_size * residual.config.rank}), s = {float(residual.s):.2f}"
    )
    _, contexts = retained_contexts(bb.tokenizer, "gsm8k", limit=args.contexts)
    batch = bb.tokenizer(contexts[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        base = bb.model(**batch).logits
        with attach(bb.model, residual):
            same = bb.model(**batch).logits
    print(f"B = 0: adapted logits equal the base model's exactly: {torch.equal(base, same)}")

    torch.nn.init.normal_(residual.B, std=args.b_std, generator=torch.Generator().manual_seed(0))
    path = state_dir() / "demo" / "adapter.safetensors"
    save_adapter(path, residual, {"demo": True})
    residual = load_adapter(path, atlas)
    kl = RetainedKL(bb.model, bb.tokenizer, contexts, layer, progress=False)
    moved = kl.kl(kl.reference(), residual)
    print(
        f"random B (std {args.b_std}): retained KL(base || adapted) on {len(contexts)} GSM8K contexts = "
        f"{moved.mean:.5f} nats/token over {moved.positions} positions; prefix cache {kl.cache_bytes() / 2**20:.1f} MiB"
    )
    print(f"adapter saved and reloaded with sha256 check: {path}")
    return 0


def cmd_eval_base(args: argparse.Namespace) -> int:
    """Evaluate the base model on a small fixed subset of every set; build the KL caches."""
    from atlas_core.backbone import load_backbone
    from evaluation.contexts import retained_contexts
    from evaluation.kl import RetainedKL
    from evaluation.tasks import eval_csqa_choice, eval_gsm8k, eval_mbpp_plus

    bb = load_backbone(args.backbone, _dtype(args.dtype))
    layer = bb.middle_layer if args.layer == -1 else args.layer
    code = eval_mbpp_plus(bb.model, bb.tokenizer, limit=args.limit, max_new_tokens=args.max_new_tokens).result
    math = eval_gsm8k(bb.model, bb.tokenizer, limit=args.limit, max_new_tokens=args.max_new_tokens)
    csqa = eval_csqa_choice(bb.model, bb.tokenizer, limit=args.limit)
    print(f"\n{bb.name} base model, first {args.limit} problems of each set")
    print(
        f"  MBPP+ (EvalPlus)  solved {code.solved}/{code.n} ({code.percent:.1f}%), "
        f"base tests only {code.base_solved}/{code.n}"
    )
    print(
        f"  GSM8K test        correct {sum(a.correct for a in math.answers)}/{len(math.answers)} ({math.accuracy:.1%})"
    )
    print(
        f"  CSQA validation   correct {sum(a.correct for a in csqa.answers)}/{len(csqa.answers)} ({csqa.accuracy:.1%})"
    )
    for domain in ("gsm8k", "csqa"):
        _, contexts = retained_contexts(bb.tokenizer, domain, limit=args.limit)
        kl = RetainedKL(bb.model, bb.tokenizer, contexts, layer, progress=False)
        reference = kl.reference()
        check = kl.kl(reference).mean
        print(
            f"  KL reference {domain:5s}  {len(contexts)} contexts, {kl.positions} positions, "
            f"prefix cache at layer {layer}: "
            f"{kl.cache_bytes() / 2**20:.1f} MiB (+ the same for the reference); KL(base || base) = {check:.1e}"
        )
    return 0


def _add_fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layer", type=int, default=-1, help="decoder layer l (-1: the middle layer)")
    p.add_argument(
        "--retained", default="gsm8k", choices=["gsm8k", "csqa"], help="retained domain of the calibration contexts"
    )
    p.add_argument("--num-vectors", type=int, default=4096, help="N calibration vectors")
    p.add_argument("--per-example", type=int, default=2, help="positions sampled per retained example")
    p.add_argument("--charts", type=int, default=32, help="K charts")
    p.add_argument("--rank", type=int, default=16, help="m directions per chart")
    p.add_argument("--variant", default="local", choices=["local", "global", "random-local", "shuffled-patch"])
    p.add_argument("--equal-support", type=int, default=None, help="PCA from each chart's N nearest vectors")
    p.add_argument("--seed", type=int, default=0)
