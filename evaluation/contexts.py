"""Shared teacher-forced retained contexts: rendered prompt + reference answer.

The same strings feed the atlas (calibration activations) and the retained-KL evaluation,
so the atlas describes exactly the inputs whose outputs the gates watch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .data import load_csqa, load_gsm8k
from .prompts import choice_message, math_message, render

RETAINED_DOMAINS = ("gsm8k", "csqa")


def retained_contexts(tokenizer: Any, domain: str, split: str | None = None, limit: int | None = None,
                      root: str | Path | None = None) -> tuple[list[str], list[str]]:
    """(ids, contexts) of the first `limit` rows of a retained domain, in file order.

    gsm8k: math prompt + the reference solution (split 'test' by default);
    csqa: choice prompt + the correct label (split 'validation' by default).
    """
    if domain == "gsm8k":
        ds = load_gsm8k(split or "test", root)
        ds = ds.select(range(min(limit, len(ds)))) if limit else ds
        texts = [render(tokenizer, math_message(q), "math") + a for q, a in zip(ds["question"], ds["answer"])]
    elif domain == "csqa":
        ds = load_csqa(split or "validation", root)
        ds = ds.select(range(min(limit, len(ds)))) if limit else ds
        texts = [render(tokenizer, choice_message(s, t), "choice") + a for s, t, a in zip(ds["stem"], ds["texts"], ds["answer"])]
    else:
        raise ValueError(f"domain: expected one of {RETAINED_DOMAINS}, got {domain!r}")
    return list(ds["id"]), texts
