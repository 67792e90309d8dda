"""Conditional multiple-choice answers (CSQA): the label with the highest next-token likelihood.

Each question gets one rendered prompt (`prompts.choice_message` + `prompts.render`); one
forward pass per question (batched, left-padded) gives the next-token distribution at the
prompt's end, and the choice is the argmax of the log-probabilities of the label tokens
("A".."E" after a chat prompt, " A".." E" after a plain "Answer:"). Every mainstream
tokenizer writes each of these as a single token; if one does not, that is an error rather
than a silent fallback to a different scoring rule.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from evaluation.answers import Answer
from evaluation.prompts import CSQA_LABELS, add_special_tokens_for, label_continuations


@dataclass(frozen=True)
class ChoiceResult:
    labels: tuple[str, ...]
    choices: list[str]  # chosen label per question, in input order
    logprobs: torch.Tensor  # (n_questions, n_labels) log p(label | prompt), full-vocabulary softmax

    def answers(self, ids: Sequence[str], gold: Sequence[str]) -> list[Answer]:
        """Per-question records (answer = chosen label) for storage and `churn.answer_churn`."""
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
            raise ValueError(f"label continuation {text!r} is {len(tokens)} tokens ({tokens}) for this tokenizer; "
                             "conditional choice needs one token per label")
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise ValueError(f"labels {list(labels)} do not map to distinct tokens: {ids}")
    return ids


@torch.inference_mode()
def choose(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    labels: Sequence[str] = CSQA_LABELS,
    batch_size: int = 16,
    progress: bool = True,
) -> ChoiceResult:
    """Pick a label per rendered prompt by next-token log-likelihood."""
    label_ids = torch.tensor(label_token_ids(tokenizer, labels))
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    logprobs = torch.empty(len(prompts), len(labels))
    saved_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # so position -1 is every prompt's last real token
    try:
        for start in tqdm(range(0, len(order), batch_size), desc="choice", disable=not progress, unit="batch"):
            idx = order[start : start + batch_size]
            enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True,
                            add_special_tokens=add_special_tokens_for(tokenizer)).to(device)
            # Positions count real tokens only, so left padding does not shift a prompt (as in generate).
            positions = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            logits = model(**enc, position_ids=positions, logits_to_keep=1).logits[:, -1, :].float()
            logprobs[idx] = torch.log_softmax(logits, dim=-1)[:, label_ids.to(device)].cpu()
    finally:
        tokenizer.padding_side = saved_side
    chosen = logprobs.argmax(dim=-1).tolist()
    return ChoiceResult(tuple(labels), [labels[j] for j in chosen], logprobs)
