"""Calibration activations: layer-l vectors sampled from retained examples (spec section 1)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from .backbone import hidden_at_layer


@torch.no_grad()
def sample_activations(
    model: torch.nn.Module,
    tokenizer,
    texts: Sequence[str],
    layer: int,
    num_vectors: int,
    per_example: int = 2,
    seed: int = 0,
    batch_size: int = 16,
    max_length: int = 512,
    progress: bool = True,
) -> torch.Tensor:
    """(num_vectors, d) fp32 layer-`layer` outputs at random non-padding positions.

    Uses the first ceil(num_vectors / per_example) texts, `per_example` positions each
    (fewer if a text is shorter), positions drawn from a generator seeded with `seed`.
    Only layers 0..layer run.
    """
    needed = math.ceil(num_vectors / per_example)
    if len(texts) < needed:
        raise ValueError(f"texts: {num_vectors} vectors at {per_example} per example need {needed} retained examples, "
                         f"got {len(texts)}")
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    chunks = []
    for start in tqdm(range(0, needed, batch_size), desc=f"extract layer {layer}", disable=not progress, unit="batch"):
        batch = tokenizer(list(texts[start : min(start + batch_size, needed)]), return_tensors="pt", padding=True,
                          truncation=True, max_length=max_length).to(device)
        hidden = hidden_at_layer(model, layer, batch["input_ids"], batch["attention_mask"])  # (B, T, d)
        mask = batch["attention_mask"].bool().cpu()
        # Random scores on real tokens, -inf on padding: the top `per_example` are a uniform sample.
        scores = torch.rand(mask.shape, generator=generator).masked_fill(~mask, -math.inf)
        k = min(per_example, mask.shape[1])
        top = scores.topk(k, dim=1)
        keep = torch.isfinite(top.values)  # a text shorter than k tokens gives fewer vectors
        rows = torch.arange(mask.shape[0])[:, None].expand_as(top.indices)
        chunks.append(hidden.float().cpu()[rows[keep], top.indices[keep]])
    vectors = torch.cat(chunks)
    if len(vectors) < num_vectors:
        raise ValueError(f"texts: only {len(vectors)} non-padding positions available, {num_vectors} requested")
    return vectors[:num_vectors]
