"""How much of the retained inputs' energy a weight adapter's update lets through.

A weight adapter on o_proj changes the layer's output on a retained position x by
Delta W x = s B A x. Over the retained calibration contexts (the stored statistics,
C = X^T X over N tokens):

    E ||Delta W x||^2 = tr(Delta W C Delta W^T) / N

This prints, per checkpoint of a run, that energy relative to the base output's E ||W x||^2,
and how strongly A's rows point into the retained directions:

    through A = tr(A C A^T) / (||A||_F^2 tr(C) / d_in)     1 = like a random direction,
                                                            < 1 = avoids the retained inputs

with the share of tr(C) held by C's top-r eigenvectors (O-LoRA's A_past). No model is loaded:
the statistics file and the adapter files are enough.

    .venv/bin/python -m bench.repro.retained_energy \
        --stats .atlas_state/repro/smollm2-l15/retained-stats/<key>.safetensors \
        --backbone .atlas_state/backbones/smollm2-135m/model.safetensors \
        .atlas_state/repro/smollm2-l15/runs/o-lora/seed0/lr-0.005/checkpoints/step-*
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors import safe_open

from atlas_core.io import load_verified
from atlas_core.train.retained_stats import RetainedStats


def through_a(A: torch.Tensor, C: torch.Tensor) -> float:
    """tr(A C A^T) / (||A||_F^2 tr(C) / d_in): A (r, d_in), C (d_in, d_in)."""
    return float(torch.einsum("ri,ij,rj->", A, C, A) / (A.square().sum() * C.trace() / C.shape[0]))


def update_energy(A: torch.Tensor, B: torch.Tensor, scaling: float, C: torch.Tensor) -> float:
    """tr(Delta W C Delta W^T) with Delta W = scaling B A (d_out, d_in)."""
    dW = scaling * B @ A
    return float(torch.einsum("oi,ij,oj->", dW, C, dW))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stats", required=True, help="retained statistics file (.safetensors)")
    parser.add_argument("--backbone", help="the backbone's safetensors file, for E||W x||^2 of the base o_proj")
    parser.add_argument("checkpoints", nargs="+", help="checkpoint folders holding adapter.safetensors")
    args = parser.parse_args()
    stats = RetainedStats.load(args.stats)
    C = stats.cov.double()  # (d_in, d_in)
    evals = torch.linalg.eigvalsh(C).flip(0)
    base = None
    if args.backbone:
        key = f"model.layers.{stats.layer}.{stats.target}.weight"
        with safe_open(args.backbone, "pt") as f:
            if key not in f.keys():
                raise SystemExit(f"--backbone {args.backbone}: no tensor {key} (the statistics' layer and module)")
            W = f.get_tensor(key).double()  # (d_out, d_in)
        base = update_energy(torch.eye(W.shape[1], dtype=W.dtype), W, 1.0, C)
    print(f"retained stats: {stats.tokens} tokens, layer {stats.layer} {stats.target}, d_in {C.shape[0]}")
    for r in (1, 16, 128):
        print(f"  top-{r} eigenvectors of C hold {float(evals[:r].sum() / evals.sum()):.3f} of tr(C)")
    random_a = torch.rand(16, C.shape[0], generator=torch.Generator().manual_seed(0), dtype=C.dtype) * 2 - 1
    print(f"  a random A (16 uniform rows, as LoRA's init): through A {through_a(random_a, C):.3f}")
    for folder in args.checkpoints:
        tensors, m = load_verified(Path(folder) / "adapter.safetensors", kind="weight-lora")
        A, B = tensors["lora_A"].double(), tensors["lora_B"].double()
        e = update_energy(A, B, m["scaling"], C)
        rel = "" if base is None else f"  E||dW x||^2 / E||W x||^2 {e / base:.2e}"
        print(
            f"{m.get('method', '?'):12s} step {m.get('step', '?'):>4}  through A {through_a(A, C):.3f}  "
            f"E||dW x||^2 {e / stats.tokens:.3e}{rel}"
        )


if __name__ == "__main__":
    main()
