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

from ..backbone import full_hidden, head_logits, hidden_at_layer, upper_hidden
from .data import TokenizedSet, collate

__all__ = ["PrefixCache", "full_hidden", "head_logits", "upper_hidden"]  # the head-less forwards live in backbone


@dataclass
class PrefixCache:
    """Layer-`layer` outputs of every example of one data set, unpadded: hidden[i] is (T_i, d)."""

    layer: int
    hidden: list[torch.Tensor]

    @classmethod
    @torch.no_grad()
    def build(
        cls, model: nn.Module, data: TokenizedSet, layer: int, pad_id: int, batch_size: int = 16
    ) -> "PrefixCache":
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
