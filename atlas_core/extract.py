"""Calibration activations: layer-l vectors sampled from retained examples (spec section 1)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from .backbone import hidden_at_layer
from .errors import InputError


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
    max_length: int = 1024,
    progress: bool = True,
    first: Sequence[int] | None = None,
) -> torch.Tensor:
    """(num_vectors, d) fp32 layer-`layer` outputs at random non-padding positions.

    Uses the first ceil(num_vectors / per_example) texts, `per_example` distinct positions
    each, drawn from a generator seeded with `seed` (the same vectors whatever the batch
    size). Only layers 0..layer run, and each text only up to its last sampled position:
    a causal model's later tokens cannot change an earlier position's hidden state.
    `first`: per text, the first position that may be sampled (e.g. its prompt's token count,
    so that only states that have seen some of the answer are drawn); None: any position.
    """
    needed = math.ceil(num_vectors / per_example)
    if len(texts) < needed:
        raise InputError(
            f"texts: {num_vectors} vectors at {per_example} per example need {needed} retained examples, "
            f"got {len(texts)}"
        )
    encoded = tokenizer(list(texts[:needed]), add_special_tokens=False, truncation=True, max_length=max_length)[
        "input_ids"
    ]
    lengths = torch.tensor([len(ids) for ids in encoded])
    start = torch.zeros_like(lengths) if first is None else torch.tensor(list(first[:needed]), dtype=torch.long)
    if len(start) != needed:
        raise ValueError(f"first: expected a position for each of the {needed} texts used, got {len(start)}")
    if (lengths - start < per_example).any():
        short = int((lengths - start < per_example).nonzero()[0])
        raise InputError(
            f"texts: example {short} has {int(lengths[short] - start[short])} tokens to sample from, fewer than "
            f"per_example={per_example}"
        )
    # Random scores on the positions that may be drawn, -inf elsewhere: the top `per_example` are a uniform sample.
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(needed, int(lengths.max()), generator=generator)
    t = torch.arange(scores.shape[1])[None, :]  # (1, T)
    scores[(t >= lengths[:, None]) | (t < start[:, None])] = -math.inf
    positions = scores.topk(per_example, dim=1).indices  # (needed, per_example)
    ends = positions.max(1).values + 1  # tokens each text must run

    order = torch.argsort(ends, descending=True, stable=True)  # similar lengths per batch: little padding
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    vectors = torch.empty(needed, per_example, model.config.get_text_config().hidden_size)
    for start in tqdm(range(0, needed, batch_size), desc=f"extract layer {layer}", disable=not progress, unit="batch"):
        rows = order[start : start + batch_size]
        width = int(ends[rows].max())
        ids = torch.full((len(rows), width), pad)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for j, i in enumerate(rows.tolist()):  # right padding keeps real positions at 0..n-1
            n = int(ends[i])
            ids[j, :n] = torch.tensor(encoded[i][:n])
            mask[j, :n] = 1
        hidden = hidden_at_layer(model, layer, ids.to(device), mask.to(device)).float().cpu()  # (B, T, d)
        vectors[rows] = hidden[torch.arange(len(rows))[:, None], positions[rows]]
    return vectors.reshape(-1, vectors.shape[-1])[:num_vectors]
