"""Shared teacher-forced retained contexts: rendered prompt + reference answer.

One rendering feeds both the atlas (calibration activations) and the retained-KL evaluation,
so the atlas describes inputs of the kind whose outputs the gates watch; evaluation/domains.py
picks disjoint rows for the two (evaluation split to gate, train split to calibrate).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atlas_core.errors import InputError
from atlas_core.train import render_chat

from .data import load_csqa, load_gsm8k, mbpp_pairs
from .prompts import choice_message, math_message, render

RETAINED_DOMAINS = ("gsm8k", "csqa")  # the default retained set of an update config ('mbpp' is also accepted here)


def retained_contexts(
    tokenizer: Any, domain: str, split: str | None = None, limit: int | None = None, root: str | Path | None = None
) -> tuple[list[str], list[str]]:
    """(ids, contexts) of the first `limit` rows of a retained domain, in file order (retained_prompts)."""
    ids, _, texts = retained_prompts(tokenizer, domain, split, limit, root)
    return ids, texts


def retained_prompts(
    tokenizer: Any, domain: str, split: str | None = None, limit: int | None = None, root: str | Path | None = None
) -> tuple[list[str], list[str], list[str]]:
    """(ids, prompts, contexts) of the first `limit` rows of a retained domain, in file order; each
    context is its rendered prompt followed by the reference answer (the KL's position kinds).

    gsm8k: math prompt + the reference solution (split 'test' by default);
    csqa: choice prompt + the correct label (split 'validation' by default);
    mbpp: code prompt + the fenced reference code, as a skill pair (split 'test' by default).
    """
    if domain == "gsm8k":
        ds = load_gsm8k(split or "test", root)
        ds = ds.select(range(min(limit, len(ds)))) if limit else ds
        pairs = [(render(tokenizer, math_message(q), "math"), a) for q, a in zip(ds["question"], ds["answer"])]
    elif domain == "csqa":
        ds = load_csqa(split or "validation", root)
        ds = ds.select(range(min(limit, len(ds)))) if limit else ds
        pairs = [
            (render(tokenizer, choice_message(s, t), "choice"), a)
            for s, t, a in zip(ds["stem"], ds["texts"], ds["answer"])
        ]
    elif domain == "mbpp":
        rows = mbpp_pairs(split or "test", root)
        rows = rows[:limit] if limit else rows
        return [p["id"] for p in rows], *rendered_pairs(tokenizer, [(p["prompt"], p["response"]) for p in rows])
    else:
        raise InputError(f"domain: expected one of {RETAINED_DOMAINS + ('mbpp',)}, got {domain!r}")
    return list(ds["id"]), [p for p, _ in pairs], [p + a for p, a in pairs]


def rendered_pairs(tokenizer: Any, pairs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(prompts, contexts) of (prompt, response) pairs rendered as the trainer renders them."""
    heads, texts = [], []
    for prompt, response in pairs:
        head, tail = render_chat(tokenizer, prompt, response)
        heads.append(head)
        texts.append(head + tail)
    return heads, texts
