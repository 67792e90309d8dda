"""Conditional multiple-choice answers (CSQA): the label with the highest next-token likelihood.

Each question gets one rendered prompt (`prompts.choice_message` + `prompts.render`); one
forward pass per question (batched, left-padded) gives the next-token distribution at the
prompt's end, and the choice is the argmax of the log-probabilities of the label tokens
("A".."E" after a chat prompt, " A".." E" after a plain "Answer:"). Every mainstream
tokenizer writes each of these as a single token; if one does not, that is an error rather
than a silent fallback to a different scoring rule.

Versions of one line share the backbone's layers below the lowest one any delta changes, so
`ChoiceSet` can keep the prompts' states at such a layer (computed once, on the base) and
answer each version from there: only the layers above and the LM head at the last position run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from atlas_core.backbone import contiguous_head_input, head_logits, hidden_at_layer, upper_hidden
from evaluation.answers import Answer
from evaluation.kl import adopted_states
from evaluation.prompts import CSQA_LABELS, add_special_tokens_for, label_continuations


@dataclass(frozen=True)
class ChoiceResult:
    labels: tuple[str, ...]
    choices: list[str]  # chosen label per question, in input order
    logprobs: torch.Tensor  # (n_questions, n_labels) log p(label | prompt), full-vocabulary softmax

    def answers(self, ids: Sequence[str], gold: Sequence[str]) -> list[Answer]:
        """Per-question records (answer = chosen label) for storage and `flows.compare.answer_churn`."""
        if not len(ids) == len(gold) == len(self.choices):
            raise ValueError(f"{len(ids)} ids and {len(gold)} gold labels for {len(self.choices)} choices")
        return [Answer(i, c, c == g) for i, c, g in zip(ids, self.choices, gold)]

    def accuracy(self, gold: Sequence[str]) -> float:
        if len(gold) != len(self.choices):
            raise ValueError(f"{len(gold)} gold labels for {len(self.choices)} choices")
        return sum(c == g for c, g in zip(self.choices, gold)) / len(gold)


def label_token_ids(tokenizer: Any, labels: Sequence[str] = CSQA_LABELS) -> list[int]:
    """The single token id of each label continuation; raises if a label is not one token."""
    ids = []
    for text in label_continuations(tokenizer, labels):
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) != 1:
            raise ValueError(
                f"label continuation {text!r} is {len(tokens)} tokens ({tokens}) for this tokenizer; "
                "conditional choice needs one token per label"
            )
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"labels {list(labels)} do not map to distinct tokens: {ids}")
    return ids


class ChoiceSet:
    """Rendered prompts tokenized once into length-sorted, left-padded batches, answered by any
    version of the backbone (whatever is attached to `model` when `choose` runs).

    With `layer`, the batches' layer-`layer` outputs are computed once (`prefix`, on first use:
    call it before any delta is attached, so they are the base model's) or adopted
    (`use_prefix`), and `choose` runs only layers above `layer` and the LM head: valid for
    every version whose deltas change nothing at or below `layer`. Without, full forwards.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        prompts: Sequence[str],
        labels: Sequence[str] = CSQA_LABELS,
        batch_size: int = 16,
        layer: int | None = None,
    ):
        self.model, self.labels, self.layer, self.size = model, tuple(labels), layer, len(prompts)
        self.label_ids = torch.tensor(label_token_ids(tokenizer, labels))
        # Similar lengths share a batch: little padding.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
        self.batches: list[
            tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]
        ] = []  # ids, mask, positions, rows
        saved_side = tokenizer.padding_side
        tokenizer.padding_side = "left"  # so position -1 is every prompt's last real token
        try:
            for start in range(0, len(order), batch_size):
                rows = order[start : start + batch_size]
                enc = tokenizer(
                    [prompts[i] for i in rows],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=add_special_tokens_for(tokenizer),
                )
                # Positions count real tokens only, so left padding does not shift a prompt (as in generate).
                positions = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
                self.batches.append((enc["input_ids"], enc["attention_mask"], positions, rows))
        finally:
            tokenizer.padding_side = saved_side
        self._prefix: list[torch.Tensor] | None = None

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _inputs(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dev = self._device()
        return tuple(t.to(dev) for t in self.batches[i][:3])

    def _layer(self) -> int:
        if self.layer is None:
            raise ValueError("prefix states: this ChoiceSet was built without a prefix layer (layer=None)")
        return self.layer

    @torch.no_grad()
    def prefix(self) -> list[torch.Tensor]:
        """Layer-`layer` outputs of every batch (B, T, d), computed on first use (layers 0..layer only)."""
        if self._prefix is None:
            layer = self._layer()
            self._prefix = [hidden_at_layer(self.model, layer, *self._inputs(i)) for i in range(len(self.batches))]
        return self._prefix

    def use_prefix(self, states: Sequence[torch.Tensor]) -> None:
        """Adopt prefix states computed before (e.g. stored on disk) for these same batches."""
        self._layer()
        self._prefix = adopted_states(states, [ids.shape for ids, *_ in self.batches], self.model)

    @torch.inference_mode()
    def choose(self, progress: bool = True) -> ChoiceResult:
        """Pick a label per prompt by next-token log-likelihood (log-softmax over the vocabulary)."""
        logprobs = torch.empty(self.size, len(self.labels))
        for i in tqdm(range(len(self.batches)), desc="choice", disable=not progress, unit="batch"):
            ids, mask, positions = self._inputs(i)
            if self.layer is None:
                with contiguous_head_input(self.model):
                    logits = self.model(
                        input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1
                    ).logits[:, -1, :]
            else:  # the head on the last position only, shaped (B, 1, d) as in the full forward (same GEMM)
                last = upper_hidden(self.model, self.layer, self.prefix()[i], ids, mask, positions)[:, -1:, :]
                logits = head_logits(self.model, last.contiguous())[:, -1, :]
            label_logprobs = torch.log_softmax(logits.float(), dim=-1)[:, self.label_ids.to(ids.device)]
            logprobs[self.batches[i][3]] = label_logprobs.cpu()
        chosen = logprobs.argmax(dim=-1).tolist()
        return ChoiceResult(self.labels, [self.labels[j] for j in chosen], logprobs)


def choose(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    labels: Sequence[str] = CSQA_LABELS,
    batch_size: int = 16,
    progress: bool = True,
) -> ChoiceResult:
    """Pick a label per rendered prompt by next-token log-likelihood (full forwards)."""
    return ChoiceSet(model, tokenizer, prompts, labels, batch_size).choose(progress)
