"""A user's own skill set or retained set, as JSONL with a small fixed schema.

Skill set (what a new skill should teach), one JSON object per line:

    {"id": "q1", "prompt": "Write a function ...", "response": "def f(x): ...",
     "tests": ["assert f(1) == 2"]}            # "tests" optional: list of strings

Retained set (behaviour to keep), one JSON object per line:

    {"id": "r1", "prompt": "What is 2 + 3?", "answer": "2 + 3 = 5. The answer is 5."}

Retained domain (teacher-forced contexts whose outputs a release must not move; see
evaluation/domains.py), one JSON object per line:

    {"id": "d1", "prompt": "What is 2 + 3?", "reference": "2 + 3 = 5. The answer is 5.",
     "answer": "5"}                             # "answer" optional: graded by the domain's checker

Answer set (the `exact-match` scorer): rows with `id`, `prompt` and `answer`; a retained set
is one, and so is a retained domain whose rows all carry `answer`.

Rules, checked on load with an error that names the file, the line and the field:
- `id` is a non-empty string, unique within the file;
- `prompt`, `response`, `reference` and `answer` are strings, `prompt` (and `reference`) non-empty;
- `tests` (skill sets only) is a list of strings;
- an optional `meta` object is carried through untouched; any other key is an error
  (a typo such as "promt" must not silently drop a field);
- blank lines are skipped; the file must hold at least one row.

`prompt` is the user's message; chat formatting is applied later (evaluation.prompts),
so the same file works for base and chat models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from atlas_core.errors import InputError
from atlas_core.paths import PROJECT_ROOT


def resolve_path(path: str | Path) -> Path:
    """A user file's path as given, else relative to the project root: the rule of
    flows.config.resolve, for files named in a config (evaluation must not import flows)."""
    path = Path(path).expanduser()
    return path if path.is_absolute() or path.exists() else PROJECT_ROOT / path


class SchemaError(InputError):
    """A row of a user data file does not follow the documented schema."""


def jsonl_objects(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, "file: line N", object) for every non-blank line of a JSONL file;
    a line that is not a JSON object raises `error` naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise error(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield lineno, where, row


@dataclass(frozen=True)
class SkillExample:
    id: str
    prompt: str
    response: str
    tests: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RetainedExample:
    id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DomainExample:
    id: str
    prompt: str
    reference: str
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


_SKILL_FIELDS = {"id": True, "prompt": True, "response": True, "tests": False, "meta": False}
_RETAINED_FIELDS = {"id": True, "prompt": True, "answer": True, "meta": False}
_DOMAIN_FIELDS = {"id": True, "prompt": True, "reference": True, "answer": False, "meta": False}
_ANSWER_FIELDS = {"id": True, "prompt": True, "answer": True, "reference": False, "meta": False}


def _rows(path: Path, fields: dict[str, bool]) -> list[tuple[int, dict[str, Any]]]:
    """Parse and type-check every row; returns (line number, row) pairs."""
    if not path.is_file():
        raise SchemaError(f"{path}: file not found")
    rows: list[tuple[int, dict[str, Any]]] = []
    first_line_of: dict[str, int] = {}
    for lineno, where, row in jsonl_objects(path, SchemaError):
        for name, required in fields.items():
            if required and name not in row:
                raise SchemaError(f"{where}: field '{name}' is missing")
        unknown = sorted(set(row) - set(fields))
        if unknown:
            raise SchemaError(f"{where}: field '{unknown[0]}' is not part of the schema (allowed: {sorted(fields)})")
        for name in ("id", "prompt", "response", "answer", "reference"):
            if name in row and not isinstance(row[name], str):
                raise SchemaError(f"{where}: field '{name}' must be a string, got {type(row[name]).__name__}")
        for name in ("id", "prompt"):
            if not row[name].strip():
                raise SchemaError(f"{where}: field '{name}' is empty")
        tests = row.get("tests", [])
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            raise SchemaError(f"{where}: field 'tests' must be a list of strings")
        if not isinstance(row.get("meta", {}), dict):
            raise SchemaError(f"{where}: field 'meta' must be a JSON object")
        if row["id"] in first_line_of:
            raise SchemaError(f"{where}: field 'id' {row['id']!r} repeats line {first_line_of[row['id']]}")
        first_line_of[row["id"]] = lineno
        rows.append((lineno, row))
    if not rows:
        raise SchemaError(f"{path}: no rows")
    return rows


def load_skill_jsonl(path: str | Path) -> list[SkillExample]:
    """Read a skill set (schema in the module docstring)."""
    return [
        SkillExample(row["id"], row["prompt"], row["response"], tuple(row.get("tests", [])), row.get("meta", {}))
        for _, row in _rows(Path(path), _SKILL_FIELDS)
    ]


def load_retained_jsonl(path: str | Path) -> list[RetainedExample]:
    """Read a retained set (schema in the module docstring)."""
    return [
        RetainedExample(row["id"], row["prompt"], row["answer"], row.get("meta", {}))
        for _, row in _rows(Path(path), _RETAINED_FIELDS)
    ]


def load_domain_jsonl(path: str | Path) -> list[DomainExample]:
    """Read a retained domain (schema in the module docstring); `reference` must not be empty,
    since it is the teacher-forced continuation whose outputs are watched."""
    out = []
    for lineno, row in _rows(Path(path), _DOMAIN_FIELDS):
        if not row["reference"].strip():
            raise SchemaError(f"{path}: line {lineno}: field 'reference' is empty")
        out.append(DomainExample(row["id"], row["prompt"], row["reference"], row.get("answer"), row.get("meta", {})))
    return out


def load_answer_jsonl(path: str | Path) -> list[RetainedExample]:
    """Read an answer set: a retained set, or a retained domain whose rows all have `answer`."""
    return [
        RetainedExample(row["id"], row["prompt"], row["answer"], row.get("meta", {}))
        for _, row in _rows(Path(path), _ANSWER_FIELDS)
    ]
