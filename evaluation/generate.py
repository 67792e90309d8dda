"""Batched greedy generation for any Hugging Face causal LM, and code extraction.

`generate` works on whatever `model` it is given: an adapter attached through a forward
hook takes part automatically because every step runs the model's ordinary forward.
Greedy decoding is deterministic; prompts are sorted by length so a batch holds prompts of
similar length (less padding), padded on the left, and results come back in input order.

The decoding loop is ours rather than `model.generate`, for savings that leave a row's tokens
as they were:
  - a finished row leaves the batch (its KV cache rows are dropped), so a step costs what
    the rows still running cost, not the whole batch until its longest answer ends;
  - stop strings and `stop_after` are looked for in the last few tokens of the rows still
    running (a window that covers any match), not in every row's whole suffix at every step;
  - the KV cache is written in place (`_GrowingLayer`), and the prefill's LM head gets a
    contiguous input (`atlas_core.backbone.contiguous_head_input`).
In fp32 the answers equal `model.generate`'s at any batch size. In bf16 a greedy answer
depends on the batch it was decoded in, with either loop: the CPU's bf16 kernels round a row
differently for another number of rows or another padding, and a near-tie then picks another
token (docs/BENCHMARKS.md counts how many answers that moves).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from atlas_core.backbone import contiguous_head_input
from atlas_core.errors import InputError
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


# Tokens decoded per running row to look for a stop: a stop string needs at most one token per
# character (+1 for a token that straddles its start); `stop_after` patterns are short lines
# (e.g. "The answer is 42."), which 64 tokens cover. A match seen later than it formed costs
# steps only: the text is cut at its first match anyway.
_AFTER_WINDOW = 64


class _Stops:
    """Whether a row's new tokens end its answer: an eos id, a stop string, a `stop_after` match."""

    def __init__(self, tokenizer: Any, eos: Sequence[int], stop: Sequence[str], after: re.Pattern[str] | None):
        self.tokenizer, self.eos, self.stop, self.after = tokenizer, set(eos), [s for s in stop if s], after
        self.window = max([len(s) + 1 for s in self.stop] + [_AFTER_WINDOW if after else 0])

    def done(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.eos:
            return True
        if not self.window:
            return False
        tail = self.tokenizer.decode(tokens[-self.window :], skip_special_tokens=True)
        return any(s in tail for s in self.stop) or bool(self.after and self.after.search(tail))


# Positions of spare room a growing cache layer adds when it is full.
_GROW = 128


class _GrowingLayer(DynamicLayer):
    """A KV cache layer with spare room at the end: a decoding step writes its keys and values in
    place. `DynamicLayer` concatenates instead, a copy of the whole cache per layer and step
    (a quarter of a decode step at 32 rows of the default backbone, by torch.profiler)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.keys.dim() < 4 or end > self.keys.shape[-2]:  # (B, H, room, D) buffers, grown by copy
            self.keys, self.values = (
                _with_room(old, new, self.length, end + _GROW)
                for old, new in ((self.keys, key_states), (self.values, value_states))
            )
        self.keys[..., self.length : end, :] = key_states
        self.values[..., self.length : end, :] = value_states
        self.length = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.keys, self.values = self.keys[indices], self.values[indices]


def _with_room(old: torch.Tensor, like: torch.Tensor, length: int, room: int) -> torch.Tensor:
    """A (B, H, room, D) buffer holding the first `length` positions of `old`."""
    buf = like.new_empty((*like.shape[:-2], room, like.shape[-1]))
    if length:
        buf[..., :length, :] = old[..., :length, :]
    return buf


def _cache(model: Any) -> Cache:
    """A growing cache for full-attention models; transformers' own for sliding-window ones."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "sliding_window", None) or set(getattr(config, "layer_types", None) or ["full_attention"]) != {
        "full_attention"
    }:
        return DynamicCache(config=model.config)
    return Cache(layer_class_to_replicate=_GrowingLayer)


def _cache_argument(model: Any) -> str:
    """The forward's name for the KV cache: `cache` in transformers >= 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _greedy_batch(
    model: Any, input_ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, stops: _Stops
) -> list[list[int]]:
    """Each row's new tokens (an eos included, as `model.generate` returns it); inputs (B, T) left-padded."""
    cache = _cache(model)
    kv = {_cache_argument(model): cache}
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T): left padding does not shift positions
    with contiguous_head_input(model):
        logits = model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, **kv
        ).logits[:, -1]  # (B, V)
    tokens: list[list[int]] = [[] for _ in range(len(input_ids))]
    running = list(range(len(input_ids)))  # batch row -> input row
    position = positions[:, -1:]  # (B, 1)
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1)  # (b,)
        keep = []
        for j, token in enumerate(nxt.tolist()):
            tokens[running[j]].append(token)
            if not stops.done(tokens[running[j]]):
                keep.append(j)
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(running):  # finished rows leave the batch and the cache
            rows = torch.tensor(keep, device=nxt.device)
            cache.batch_select_indices(rows)
            nxt, mask, position = nxt[rows], mask[rows], position[rows]
            running = [running[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones(len(running), 1)], dim=1)  # (b, T + step + 1)
        position = position + 1
        logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=position, use_cache=True, **kv).logits[
            :, -1
        ]  # (b, V)
    return tokens


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
        raise InputError(f"max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) must be >= 1")
    if add_special_tokens is None:
        add_special_tokens = add_special_tokens_for(tokenizer)
    stops = _Stops(tokenizer, _eos_ids(model, tokenizer), stop, stop_after)
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
            new = _greedy_batch(model, enc["input_ids"], enc["attention_mask"], max_new_tokens, stops)
            texts = tokenizer.batch_decode(new, skip_special_tokens=True)
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
    blocks = [body for lang, body in _FENCE.findall(completion) if lang.lower() in ("", "python", "py", "python3")]
    if blocks:
        for wanted in ([f"def {entry_point}"] if entry_point else []) + ["def "]:
            for body in blocks:
                if wanted in body:
                    return body.strip("\n")
        return blocks[0].strip("\n")
    start = _CODE_START.search(completion)
    return (completion[start.start() :] if start else completion).strip("\n")
