"""Retained KL beyond its mean: its tail over a member's contexts, its split by position kind, and
the contexts that moved most.

A member's retained KL (flows/resources.py: Resources.retained_kl) is the mean over all its tokens; a
candidate that leaves most contexts alone and wrecks a few can pass a mean limit. The gate
can also bound the p95, p99 and max of the per-context values (flows/gates.py: kl_tail_checks),
and the report and the candidate's MLflow run list the contexts that moved most, with their
text, so a reviewer sees what moved.

The mean also mixes two kinds of position (evaluation/kl.py): prompt positions, whose hidden
states have seen only the rendered prompt (a chat template and instruction every context of a
domain shares), and response positions, inside the reference answer. "prompt" and "response",
the mean KL over each kind, are limited like the tail statistics: a policy can bound the KL on
answers alone, which a shared prompt cannot dilute.

Values are kept per reference: "vs_champion" and "vs_base" (AGAINST), then per member of the
retained set (configured domains and released skills). Pure functions; the evaluation stores
them in its `extra` (to_extra / from_extra), where NaN/inf are written as strings because the
ledger's JSON refuses them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Optional

import numpy as np

AGAINST = ("vs_champion", "vs_base")
QUANTILES = MappingProxyType({"p95": 0.95, "p99": 0.99})
# evaluation.kl.POSITION_KINDS, spelled out: importing it would load torch into the operational
# commands that read a policy (tests/test_gate_kl_tail.py checks the two agree).
POSITION_KINDS = ("prompt", "response")
STATISTICS = (*QUANTILES, "max", *POSITION_KINDS)  # what a policy may limit; the fields of KLTail
TOP_K = 5  # contexts listed per (reference, member)
SNIPPET_CHARS = 100


@dataclass(frozen=True)
class KLTail:
    """p95, p99 and max of one member's per-context KL (nats/token) over its `contexts` contexts,
    and its mean KL over prompt and over response positions (None: not split, e.g. stored by
    older code; a limit on it then fails closed)."""

    p95: Optional[float]
    p99: Optional[float]
    max: Optional[float]
    contexts: int
    prompt: Optional[float] = None
    response: Optional[float] = None


@dataclass(frozen=True)
class MovedContext:
    """One of the contexts that moved most: its index into the member's gate contexts
    (Resources.gate_texts, in that order), its KL (nats/token) and its text's beginning."""

    index: int
    kl: Optional[float]
    text: str


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of `values` by linear interpolation between order statistics (numpy's
    default, Hyndman & Fan type 7): with x_0 <= ... <= x_{n-1} and h = (n - 1) q,
    x_floor(h) + (h - floor(h)) (x_floor(h)+1 - x_floor(h)). q = 1 is the max; one value is itself.
    NaN when there are no values or any is not finite (fail closed: the gate rejects NaN)."""
    if not values or not all(v is not None and math.isfinite(v) for v in values):
        return math.nan
    return float(np.quantile(np.asarray(values, dtype=np.float64), q, method="linear"))


def tail(per_context: Sequence[float], by_kind: Optional[Mapping[str, float]] = None) -> KLTail:
    """The tail of `per_context`, with the mean KL per position kind when `by_kind` gives it."""
    quantiles = (quantile(per_context, q) for q in (*QUANTILES.values(), 1.0))
    return KLTail(*quantiles, contexts=len(per_context), **{k: (by_kind or {}).get(k) for k in POSITION_KINDS})


def snippet(text: str, chars: int = SNIPPET_CHARS) -> str:
    """The text's beginning on one line (whitespace collapsed), cut at `chars` with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= chars else flat[: chars - 1] + "…"


def distinctive(texts: Sequence[str]) -> list[str]:
    """Each text without the words all of them begin with (a chat template, an instruction), marked
    by a leading "…": otherwise every snippet of a domain would read the same."""
    if len(texts) < 2:
        return list(texts)
    shared = os.path.commonprefix(list(texts))
    cut = max(shared.rfind(c) for c in " \n\t") + 1  # whole words only
    return [f"…{t[cut:]}" if cut and t[cut:].strip() else t for t in texts]


def most_moved(per_context: Sequence[float], texts: Sequence[str], k: int = TOP_K) -> list[MovedContext]:
    """The k contexts of largest KL, largest first (ties: the lower index), with the beginning of
    what is their own (distinctive). A non-finite value sorts first: it is the one to look at."""

    def key(i: int) -> tuple[float, int]:
        v = per_context[i]
        return (-math.inf if v is None or not math.isfinite(v) else -v, i)

    own = distinctive(texts)
    return [MovedContext(i, per_context[i], snippet(own[i])) for i in sorted(range(len(per_context)), key=key)[:k]]


def summarise(
    per_context: Mapping[str, Mapping[str, Sequence[float]]],
    texts: Callable[[str], Sequence[str]],
    k: int = TOP_K,
    by_kind: Optional[Mapping[str, Mapping[str, Mapping[str, float]]]] = None,
) -> tuple[dict[str, dict[str, KLTail]], dict[str, dict[str, list[MovedContext]]]]:
    """per_context: reference (AGAINST) -> member -> its per-context KL, in the order of
    `texts(member)`; by_kind, keyed the same way: the mean KL per position kind. Returns the
    tails and the k contexts that moved most, keyed the same way."""
    kinds = by_kind or {}
    tails = {
        against: {m: tail(v, kinds.get(against, {}).get(m)) for m, v in members.items()}
        for against, members in per_context.items()
    }
    moved = {
        against: {m: most_moved(v, texts(m), k) for m, v in members.items()} for against, members in per_context.items()
    }
    return tails, moved


# ------------------------------------------------------------------------ storage and tables
def _json(v: Optional[float]):
    return v if v is None or math.isfinite(v) else str(v)  # "nan" / "inf" read back by float()


def _number(v) -> Optional[float]:
    return None if v is None else float(v)


def to_extra(tails: dict[str, dict[str, KLTail]], moved: dict[str, dict[str, list[MovedContext]]]) -> dict:
    """The evaluation's `extra` entries "kl_tail" and "kl_top_contexts" (JSON, NaN/inf as strings)."""
    return {
        "kl_tail": {
            a: {m: asdict(t) | {s: _json(getattr(t, s)) for s in STATISTICS} for m, t in members.items()}
            for a, members in tails.items()
        },
        "kl_top_contexts": {
            a: {m: [asdict(c) | {"kl": _json(c.kl)} for c in top] for m, top in members.items()}
            for a, members in moved.items()
        },
    }


def from_extra(extra: dict) -> tuple[dict[str, dict[str, KLTail]], dict[str, dict[str, list[MovedContext]]]]:
    """What to_extra stored; empty for an evaluation stored before tails were measured (a tail
    limit then fails closed as not measured)."""
    tails = {
        a: {
            m: KLTail(**{s: _number(t.get(s)) for s in STATISTICS}, contexts=int(t.get("contexts", 0)))
            for m, t in members.items()
        }
        for a, members in extra.get("kl_tail", {}).items()
    }
    moved = {
        a: {
            m: [MovedContext(int(c["index"]), _number(c["kl"]), str(c["text"])) for c in top]
            for m, top in members.items()
        }
        for a, members in extra.get("kl_top_contexts", {}).items()
    }
    return tails, moved


def rows(moved: dict[str, dict[str, list[MovedContext]]]) -> list[dict]:
    """One row per listed context (reference, member, rank 1..k, context index, KL, text): the
    report's table and the MLflow table (flows/evaluate.py: record_candidate) are both these rows."""
    return [
        {"against": a, "member": m, "rank": rank, "context": c.index, "kl": c.kl, "text": c.text}
        for a in AGAINST
        for m, top in sorted(moved.get(a, {}).items())
        for rank, c in enumerate(top, 1)
    ]
