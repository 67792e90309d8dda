"""Squashing a chain of LoRA-family deltas into one delta (`atlas squash`, flows/squash.py).

A long line stacks a delta per release: its load time, hook count and decoding cost grow with
the chain. Deltas on one Linear add (atlas_core.export):

    W x + sum_i s_i B_i A_i x = W x + B A x,   A = [A_1; A_2; ...] (R, d_in),  B = [s_1 B_1, s_2 B_2, ...] (d_out, R)

so a chain of LoRA deltas (the platform's Weight-LoRA, submitted PEFT LoRAs) is exactly one LoRA
of rank R = sum_i r_i per Linear: the exact squash, one hook per Linear whatever the chain's
length. A truncated squash keeps the best rank-r approximation of each module's B A
(Eckart-Young) without forming the d_out x d_in product:

    B = Q_b R_b,  A^T = Q_a R_a              QR: Q_b (d_out, R), Q_a (d_in, R)
    R_b R_a^T = U S V^T                      SVD of an R x R core
    B' = Q_b U_r S_r^1/2,  A' = S_r^1/2 V_r^T Q_a^T

dropping sqrt(sum of the dropped S^2) of B A in Frobenius norm; what that does to the outputs is
measured by the caller as the KL of the chain vs the squash. ATLAS residuals and TopLoRA are no
plain LoRA (routing, token-wise gates) and are refused by their delta format, naming the delta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .chain import Chain
from .export import lora_factors
from .lora_delta import FrozenLoRA
from .peft_lora import LoraSet, module_layer


@dataclass(frozen=True)
class ModuleSquash:
    """What the squash did to one Linear."""

    rank_in: int  # sum of the chain's ranks on it
    rank_out: int
    dropped: float  # ||B A - B' A'||_F / ||B A||_F (0 for an exact squash)


def truncated(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A' (rank, d_in), B' (d_out, rank), relative Frobenius error) with B' A' the best rank-`rank`
    approximation of B A, for A (R, d_in) and B (d_out, R)."""
    q_b, r_b = torch.linalg.qr(b.double())  # (d_out, R), (R, R)
    q_a, r_a = torch.linalg.qr(a.double().T)  # (d_in, R), (R, R)
    u, s, vh = torch.linalg.svd(r_b @ r_a.T)  # (R, R), (R,), (R, R)
    root = s[:rank].sqrt()  # (rank,)
    b_new = q_b @ (u[:, :rank] * root)  # (d_out, rank)
    a_new = (root[:, None] * vh[:rank]) @ q_a.T  # (rank, d_in)
    total = float(s.square().sum())
    dropped = float(s[rank:].square().sum() / total) ** 0.5 if total > 0 else 0.0
    return a_new.float(), b_new.float(), dropped


def squash_chain(chain: Chain, model: nn.Module, rank: int | None = None) -> tuple[LoraSet, dict[str, ModuleSquash]]:
    """One LoRA delta for a chain of LoRA-family deltas on `model` (the line's backbone): exact
    (`rank` None, or at least every module's summed rank) or truncated to `rank` per module."""
    if rank is not None and rank < 1:
        raise ValueError(f"rank: expected a positive integer, got {rank}")
    loras, report = [], {}
    for module, (a, b) in sorted(lora_factors(chain).items()):  # A (R, d_in), B (d_out, R), scalings folded
        total, dropped = a.shape[0], 0.0
        if rank is not None and rank < total:
            a, b, dropped = truncated(a, b, rank)
        loras.append(FrozenLoRA(module, a.contiguous(), b.contiguous(), 1.0, module_layer(model, module)))
        report[module] = ModuleSquash(total, a.shape[0], dropped)
    return LoraSet(loras, {"format": "squash", "rank": rank}), report
