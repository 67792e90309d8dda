"""Batched greedy generation for any Hugging Face causal LM, and code extraction.

`generate` works on whatever `model` it is given: an adapter attached through a forward
hook takes part automatically because every step runs the model's ordinary forward.
Greedy decoding is deterministic; prompts are sorted by length so a batch holds prompts of
similar length (less padding), padded on the left, and results come back in input order.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from evaluation.prompts import add_special_tokens_for


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """End-of-sequence ids from the model's generation config and the tokenizer.

    Chat models often end a turn with a token (e.g. <|im_end|>) that is not the tokenizer's
    eos; their generation config lists it, so both sources are merged."""
    ids: list[int] = []
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i not in ids:
                ids.append(int(i))
    return ids


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """Cut `text` at the earliest occurrence of any stop string (the stop string is dropped)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]


def truncate_after(text: str, pattern: re.Pattern[str] | None) -> str:
    """Cut `text` just after the first match of `pattern` (unchanged without one)."""
    match = pattern.search(text) if pattern else None
    return text[: match.end()] if match else text


class _StopAfter(StoppingCriteria):
    """Per row: done once the new text (after the `width` prompt tokens) matches `pattern`."""

    def __init__(self, tokenizer: Any, pattern: re.Pattern[str], width: int):
        self.tokenizer, self.pattern, self.width = tokenizer, pattern, width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.width :], skip_special_tokens=True)
        return torch.tensor([self.pattern.search(t) is not None for t in texts], device=input_ids.device)


@torch.inference_mode()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 512,
    batch_size: int = 8,
    stop: Sequence[str] = (),
    progress: bool = True,
    desc: str = "generate",
    add_special_tokens: bool | None = None,
    stop_after: re.Pattern[str] | None = None,
) -> list[str]:
    """Greedy completions of `prompts` (already rendered), cut at the first stop string.

    `stop_after` ends a completion as soon as its text matches the pattern (the match is
    kept, the rest is cut): e.g. a final-answer line, after which a batch need not wait for
    a rambling row to reach `max_new_tokens`.

    `add_special_tokens` defaults to False for tokenizers with a chat template (the
    template writes BOS itself) and True otherwise."""
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) must be >= 1")
    if add_special_tokens is None:
        add_special_tokens = add_special_tokens_for(tokenizer)
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos or None,
        pad_token_id=pad_id,
        stop_strings=list(stop) or None,
    )
    device = next(model.parameters()).device
    # Longest first: similar lengths share a batch, and an out-of-memory shows at once.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    outputs: list[str] = [""] * len(prompts)
    saved_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # new tokens must line up at the right edge of the batch
    try:
        for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=not progress, unit="batch"):
            idx = order[start : start + batch_size]
            enc = tokenizer(
                [prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=add_special_tokens
            ).to(device)
            width = enc["input_ids"].shape[1]
            criteria = StoppingCriteriaList([_StopAfter(tokenizer, stop_after, width)] if stop_after else [])
            out = model.generate(
                input_ids=enc["input_ids"],
                attention_mask=enc["attention_mask"],
                generation_config=config,
                tokenizer=tokenizer if stop else None,
                stopping_criteria=criteria,
            )
            texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
            for i, text in zip(idx, texts):
                outputs[i] = truncate_after(truncate_at_stop(text, stop), stop_after)
    finally:
        tokenizer.padding_side = saved_side
    return outputs


_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^(?:def |class |import |from |@|async def )", re.MULTILINE)


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The Python code in a completion.

    Fenced blocks (```python / ```py / bare ```, an unclosed last fence included) win; among
    them the first that defines `entry_point`, else the first that defines any function,
    else the first. Without fences, the text from the first line that looks like code
    (def/class/import/from/decorator) on; failing that, the whole completion."""
    blocks = [
        body for lang, body in _FENCE.findall(completion) if lang.lower() in ("", "python", "py", "python3")
    ]
    if blocks:
        for wanted in ([f"def {entry_point}"] if entry_point else []) + ["def "]:
            for body in blocks:
                if wanted in body:
                    return body.strip("\n")
        return blocks[0].strip("\n")
    start = _CODE_START.search(completion)
    return (completion[start.start() :] if start else completion).strip("\n")
