"""What a target scorer is: per-problem scores, the TargetScorer contract, option parsing.

A scorer measures one model on a fixed list of problems and returns one `ProblemScore` per
problem id. The ledger keeps only `answer` and `correct` per (dataset, problem), so:
- `dataset` names the answer set and must change whenever a setting changes the answers
  (split, limit, generation budget, a file's content, a threshold);
- a 'sum' scorer's value is 1.0 for a solved problem and 0.0 otherwise (the score is the
  number solved); a 'mean' scorer writes its value into `answer` (`restore` reads it back).

Options are a dataclass per scorer, parsed by `parse_options`: unknown keys and wrong types
are refused, and every error names `options.<key>` (build_scorer prefixes `target.`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atlas_core.errors import InputError
from atlas_core.typed_config import build
from evaluation.userdata import resolve_path

AGGREGATES = ("sum", "mean")


@dataclass(frozen=True)
class ProblemScore:
    answer: str | None  # what the ledger stores (an extracted answer, "pass"/"fail", or a mean scorer's value)
    correct: bool  # solved
    value: float  # what `aggregate` combines: 0/1 for 'sum' scorers

    def __post_init__(self) -> None:
        if self.answer is not None and not isinstance(self.answer, str):
            raise InputError(f"answer: expected a string or None, got {type(self.answer).__name__}")
        if not isinstance(self.correct, bool):
            raise InputError(f"correct: expected true or false, got {self.correct!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise InputError(f"value: expected a finite number, got {self.value!r}")


def aggregate_values(aggregate: str, values: dict[str, ProblemScore]) -> float:
    """'sum' of the values (problems solved) or their 'mean'."""
    if aggregate == "sum":
        return float(sum(v.value for v in values.values()))
    if aggregate == "mean":
        if not values:
            raise ValueError("values: a mean needs at least one problem score")
        return sum(v.value for v in values.values()) / len(values)
    raise ValueError(f"aggregate: expected one of {AGGREGATES}, got {aggregate!r}")


class TargetScorer:
    """Scores one model on a fixed problem list. Subclasses set the four attributes and
    implement `problem_ids` and `score`; the model must be left as it was given."""

    name: str  # registry name ("gsm8k-accuracy", or "package.module:Factory")
    dataset: str  # ledger answer-set name
    higher_is_better: bool = True
    aggregate: str = "sum"

    def problem_ids(self) -> list[str]:
        raise NotImplementedError

    def score(self, model: Any, tokenizer: Any) -> dict[str, ProblemScore]:
        """One ProblemScore per id of `problem_ids()`, in that order."""
        raise NotImplementedError

    def summarise(self, values: dict[str, ProblemScore]) -> float:
        return aggregate_values(self.aggregate, values)

    def restore(self, answer: str | None, correct: bool) -> ProblemScore:
        """The ProblemScore of a stored ledger answer."""
        if self.aggregate == "sum":
            return ProblemScore(answer, correct, float(correct))
        if answer is None:
            raise ValueError(f"{self.name}: a stored answer of a 'mean' scorer holds its value; got None")
        return ProblemScore(answer, correct, float(answer))


def in_order(ids: list[str], scores: dict[str, ProblemScore], name: str) -> dict[str, ProblemScore]:
    """`scores` keyed and ordered exactly as `ids`; a missing problem is an error, not a silent 0."""
    missing = [q for q in ids if q not in scores]
    if missing:
        raise InputError(f"{name}: no score for {len(missing)} problem(s): {missing[:5]}")
    return {q: scores[q] for q in ids}


def solved(answer: str | None, correct: bool) -> ProblemScore:
    """A 'sum' scorer's score of one problem."""
    return ProblemScore(answer, correct, 1.0 if correct else 0.0)


def mean_score(value: float, correct: bool) -> ProblemScore:
    """A 'mean' scorer's score: the answer is the value at 6 decimals and the value is that
    rounded number, so a score read back from the ledger equals a fresh one exactly."""
    answer = f"{value:.6f}"
    return ProblemScore(answer, correct, float(answer))


# ------------------------------------------------------------------------------ options
def parse_options(cls: type, options: dict | None):
    """The options dataclass `cls` from a mapping; errors name `options.<key>`.

    `build` names unknown keys and bad types itself; the classes' __post_init__ raise InputError
    already naming `options.<key>` (build re-prefixes only its own ConfigError)."""
    return build(cls, options, "options")


def positive(options: Any, *names: str) -> None:
    """Each named option is a positive integer (or None, where the type allows it)."""
    for name in names:
        value = getattr(options, name)
        if value is not None and value < 1:
            raise InputError(f"options.{name}: expected a positive integer, got {value!r}")


def one_of(name: str, value: Any, allowed: tuple | list) -> None:
    if value not in allowed:
        raise InputError(f"options.{name}: expected one of {list(allowed)}, got {value!r}")


def existing_file(name: str, path: str) -> Path:
    """The resolved file of option `name`, or an InputError naming it."""
    if not path:
        raise InputError(f"options.{name}: expected the path of a JSONL file, got {path!r}")
    resolved = resolve_path(path)
    if not resolved.is_file():
        raise InputError(f"options.{name}: file not found: {path} (looked at {resolved})")
    return resolved


def file_tag(path: Path) -> str:
    """'<stem>-<first 12 hex of sha256>': a file's name in a dataset name, changing with its content."""
    return f"{path.stem}-{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"


def limit_tag(limit: int | None) -> str:
    return "all" if limit is None else str(limit)
