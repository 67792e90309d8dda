"""Answering user messages with a loaded release: chat template, greedy or sampled, streamed.

What `atlas generate`, the MLflow pyfunc model and `flows.load_release` users call. The
evaluation's own decoding (evaluation/generate.py) is tuned for benchmarks (stop strings,
answer patterns); this is the plain transformers `generate` a person expects, on the
model as it is (a release's chain is attached by hooks, so it takes part in every step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from atlas_core.errors import InputError
from evaluation.generate import _eos_ids
from evaluation.prompts import add_special_tokens_for, has_chat_template


@dataclass(frozen=True)
class Sampling:
    """Decoding settings; temperature 0 is greedy (the default, deterministic)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise InputError(f"max_new_tokens: expected an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise InputError(f"temperature: expected a number >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise InputError(f"top_k: expected an integer >= 0 (0 = off), got {self.top_k!r}")

    def config(self, eos: list[int], pad_id: int) -> GenerationConfig:
        sampled = self.temperature > 0
        options = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or None) if sampled else {}
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=sampled,
            num_beams=1,
            eos_token_id=eos or None,
            pad_token_id=pad_id,
            **options,
        )


def chat_prompt(tokenizer: Any, message: str) -> str:
    """The prompt of one user turn: the model's chat template, or the message itself without one."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
    return message


@torch.no_grad()
def chat(
    model: Any,
    tokenizer: Any,
    messages: Sequence[str],
    sampling: Sampling = Sampling(),
    batch_size: int = 8,
    streamer: Any = None,
) -> list[str]:
    """The model's reply to each user message, in input order. `streamer` (a transformers
    streamer, e.g. TextStreamer) receives the tokens as they are generated; it needs batch 1."""
    if isinstance(messages, str):
        raise TypeError("messages: expected a list of strings, got one string")
    if streamer is not None:
        batch_size = 1
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    config = sampling.config(eos, pad_id)
    device = next(model.parameters()).device
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    prompts = [chat_prompt(tokenizer, m) for m in messages]
    replies: list[str] = []
    saved_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # new tokens line up on the right
    try:
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(
                prompts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=add_special_tokens_for(tokenizer),
            ).to(device)
            out = model.generate(**enc, generation_config=config, streamer=streamer)  # (B, T + new)
            replies += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = saved_side
    return replies
