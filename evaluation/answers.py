"""Final answers: extraction from GSM8K-style completions, numeric normalisation, JSONL storage.

Extraction order (first that yields a number wins):
  1. the text after the last "####"           (GSM8K reference format)
  2. the text after the last "answer is"      ("The answer is 42.", "the final answer is $1,200")
  3. the last number anywhere in the completion
Numbers are normalised so that equal values compare equal as strings: commas, "$", "%" and
spaces go, "5.0" -> "5", "0.50" -> "0.5", ".5" -> "0.5", "-$3" -> "-3". A minus counts as a
sign only when it does not follow a digit or letter, so "5-3=2" ends in 2, not -3.

Per-question answers are stored as JSONL, one object per question keyed by id:
    {"id": "gsm8k-test-0", "answer": "18", "correct": true, "raw": "... completion ..."}
`answer` is null when nothing could be extracted; `raw` is optional.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from atlas_core.errors import InputError
from atlas_core.io import atomic_write_bytes
from evaluation.userdata import jsonl_objects

_NUMBER = re.compile(
    r"(?<![\w.])(?P<neg>[-−]\s?)?\$?\s?(?P<neg2>-)?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_ANSWER_IS = re.compile(r"answer\s+is\b", re.IGNORECASE)
# "The answer is N" with N complete (a character that cannot continue it follows): what the math
# prompt asks a completion to end with, so generation may stop there (evaluation.generate).
ANSWER_GIVEN = re.compile(r"answer\s+is\b[^\d\n]{0,12}\d(?:[\d,]*\d)?(?:\.\d+)?(?:[^\d.,]|[.,](?=\D))", re.IGNORECASE)


def normalize_number(text: str) -> str | None:
    """Canonical string of the first number in `text` (None if there is none)."""
    match = _NUMBER.search(text)
    return _canonical(match) if match else None


def _canonical(match: re.Match[str]) -> str | None:
    try:
        value = Decimal(match.group("num").replace(",", ""))
    except InvalidOperation:
        return None
    if match.group("neg") or match.group("neg2"):
        value = -value
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_gsm8k_answer(completion: str) -> str | None:
    """The normalised final answer of a GSM8K-style completion, or None."""
    hashes = completion.rfind("####")
    if hashes >= 0:
        found = normalize_number(completion[hashes + 4 :])
        if found is not None:
            return found
    answer_is = list(_ANSWER_IS.finditer(completion))
    if answer_is:
        found = normalize_number(completion[answer_is[-1].end() :])
        if found is not None:
            return found
    numbers = list(_NUMBER.finditer(completion))
    return _canonical(numbers[-1]) if numbers else None


def normalize_text(text: str) -> str:
    """Whitespace runs collapsed to one space, ends stripped, case folded: "  The  Cat\n" -> "the cat"."""
    return " ".join(text.split()).casefold()


# How a generated completion is graded against a reference answer (exact-match scorer, domain answers).
CHECKERS = ("exact", "number")


def grade_answer(checker: str, completion: str, reference: str) -> tuple[str | None, bool]:
    """(the answer read from `completion`, whether it equals `reference`).

    exact: whole completion vs reference, both through `normalize_text`;
    number: the GSM8K-style final answer (`extract_gsm8k_answer`) vs the reference's number."""
    if checker == "exact":
        answer = normalize_text(completion)
        return answer, answer == normalize_text(reference)
    if checker == "number":
        answer, gold = extract_gsm8k_answer(completion), normalize_number(reference)
        return answer, answer is not None and answer == gold
    raise ValueError(f"checker: expected one of {CHECKERS}, got {checker!r}")


@dataclass(frozen=True)
class Answer:
    id: str
    answer: str | None
    correct: bool
    raw: str | None = None


def score_gsm8k(ids: Sequence[str], completions: Sequence[str], references: Sequence[str]) -> list[Answer]:
    """Extract and grade: `references` are reference final answers (e.g. the `final` column)."""
    if not len(ids) == len(completions) == len(references):
        raise ValueError(
            f"lengths differ: {len(ids)} ids, {len(completions)} completions, {len(references)} references"
        )
    out = []
    for qid, completion, reference in zip(ids, completions, references):
        predicted = extract_gsm8k_answer(completion)
        gold = normalize_number(reference)
        out.append(Answer(qid, predicted, predicted is not None and predicted == gold, completion))
    return out


def write_answers(path: str | Path, answers: Iterable[Answer], keep_raw: bool = True) -> None:
    """Write answers as JSONL (atomically); ids must be unique."""
    lines, seen = [], set()
    for a in answers:
        if a.id in seen:
            raise InputError(f"{path}: duplicate answer id {a.id!r}")
        seen.add(a.id)
        row = asdict(a)
        if not keep_raw or a.raw is None:
            row.pop("raw")
        lines.append(json.dumps(row, ensure_ascii=False))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())


def read_answers(path: str | Path) -> dict[str, Answer]:
    """Read an answers JSONL file into {id: Answer}, with errors naming file, line and field."""
    out: dict[str, Answer] = {}
    for _, where, row in jsonl_objects(path):
        for name, kinds in (("id", (str,)), ("answer", (str, type(None))), ("correct", (bool,))):
            if name not in row:
                raise InputError(f"{where}: field '{name}' is missing")
            if not isinstance(row[name], kinds):
                raise InputError(f"{where}: field '{name}' has type {type(row[name]).__name__}")
        if row["id"] in out:
            raise InputError(f"{where}: field 'id' {row['id']!r} appears twice")
        out[row["id"]] = Answer(row["id"], row["answer"], row["correct"], row.get("raw"))
    return out
