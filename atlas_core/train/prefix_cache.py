"""The frozen-prefix cache, and forwards that stop before the LM head.

Layers 0..l of the frozen backbone give the same hidden states every epoch, so they run
once per data set (`PrefixCache.build`); each training step then runs only layers
l+1..L on the cached states (`upper_hidden`). Both paths stop before the LM head and
return the final-norm hidden states, so the loss computes logits only at the supervised
positions (`head_logits`): on a 49k-token vocabulary the head over prompt tokens would
otherwise cost as much as several decoder layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..backbone import hidden_at_layer, run_from_layer
from .data import TokenizedSet, collate


class _HeadReached(Exception):
    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden


def _stopping_at_head(model: nn.Module, run) -> torch.Tensor:
    """Run `run()` (a full or partial model forward) and return the LM head's input (B, T, d)."""

    def grab(_module, args):
        raise _HeadReached(args[0])

    handle = model.get_output_embeddings().register_forward_pre_hook(grab)
    try:
        run()
    except _HeadReached as reached:
        return reached.hidden
    finally:
        handle.remove()
    raise RuntimeError("the model's forward never reached its output embeddings (LM head)")


def full_hidden(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Final hidden states from the whole model (hooks attached to layers fire as usual)."""
    return _stopping_at_head(model, lambda: model(input_ids=ids, attention_mask=mask, use_cache=False))


def upper_hidden(model: nn.Module, layer: int, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Final hidden states given layer `layer`'s output `hidden`: only layers above it run."""
    return _stopping_at_head(model, lambda: run_from_layer(model, layer, hidden, ids, mask))


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits for final hidden states (..., d), with the output transforms some families apply."""
    logits = model.get_output_embeddings()(hidden)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scale = getattr(config, "logit_scale", None)  # Cohere
    if isinstance(scale, (int, float)) and scale != 1:
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@dataclass
class PrefixCache:
    """Layer-`layer` outputs of every example of one data set, unpadded: hidden[i] is (T_i, d)."""

    layer: int
    hidden: list[torch.Tensor]

    @classmethod
    @torch.no_grad()
    def build(cls, model: nn.Module, data: TokenizedSet, layer: int, pad_id: int, batch_size: int = 16) -> "PrefixCache":
        """Run layers 0..layer once over `data`, longest examples first (batches of similar
        length pad little), and keep each example's real positions."""
        device = next(model.parameters()).device
        order = torch.sort(data.lengths, descending=True, stable=True).indices.tolist()
        hidden: list[torch.Tensor | None] = [None] * len(data)
        for start in range(0, len(order), batch_size):
            index = order[start : start + batch_size]
            batch = collate(data, index, pad_id)
            h = hidden_at_layer(model, layer, batch.ids.to(device), batch.mask.to(device))
            for row, i in enumerate(index):
                hidden[i] = h[row, : len(data.ids[i])].clone()
        return cls(layer, hidden)

    def batch(self, index: list[int], length: int) -> torch.Tensor:
        """(B, length, d) right-padded with zeros (padding positions never reach a loss)."""
        return torch.nn.utils.rnn.pad_sequence([self.hidden[i] for i in index], batch_first=True)[:, :length]

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.hidden)
