"""Retained domains: the contexts whose outputs a release must not move, from a config entry.

An entry of `retained.domains` is either a built-in name or a mapping for a user's JSONL:

    domains:
      - gsm8k                        # math prompt + reference solution
      - csqa                         # choice prompt + correct label
      - mbpp                         # code prompt + reference code, rendered as the skill pairs are
      - name: support                # a user's domain (thresholds in the policy use this name)
        file: data/support.jsonl     # rows: id, prompt, reference; optional answer
        gate_rows: 64                # the first 64 rows gate, the rest calibrate (default: half)
        checker: exact               # how a generated answer is graded against `answer`

Every domain has two disjoint row sets, by construction:
- 'gate' rows are what the gates measure (retained KL, answer churn): a built-in's evaluation
  split (gsm8k test, csqa validation, mbpp test), or a file's first `gate_rows` rows;
- 'calibration' rows are what the atlas is fitted on: a built-in's train split, or the rows
  of the file after the gating ones.
So the atlas never sees the inputs the gates judge it on.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

from atlas_core.errors import InputError
from atlas_core.io import sha256_file
from atlas_core.typed_config import ConfigError, build, field
from evaluation.answers import CHECKERS
from evaluation.contexts import rendered_pairs, retained_prompts
from evaluation.datafiles import known
from evaluation.userdata import DomainExample, load_domain_jsonl, resolve_path

BUILTIN_DOMAINS = ("gsm8k", "csqa", "mbpp")
ROLES = ("gate", "calibration")
# built-in -> (gate split, calibration split) and the data files its rows come from
BUILTIN_SPLITS = {"gsm8k": ("test", "train"), "csqa": ("validation", "train"), "mbpp": ("test", "train")}
BUILTIN_FILES = {
    "gsm8k": ("gsm8k/test.jsonl", "gsm8k/train.jsonl"),
    "csqa": ("csqa/dev_rand_split.jsonl", "csqa/train_rand_split.jsonl"),
    "mbpp": ("mbpp/sanitized-mbpp.json", "mbpp/splits.json"),
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # used as a key in policies, the ledger and reports

DomainSpec = Any  # a built-in name, a {name, file, ...} mapping, or a RetainedDomain


@dataclass(frozen=True)
class RetainedDomain:
    name: str = field(
        "The domain's name: a built-in (gsm8k, csqa, mbpp) or the user's own (letters, digits, "
        "'_', '.', '-'); policy thresholds are keyed by it.",
        "",
    )
    file: str | None = field(
        "JSONL of the user's domain (id, prompt, reference; optional answer). None: a built-in.", None
    )
    gate_rows: int | None = field(
        "User's domain: the first N rows gate, the rows after them calibrate the atlas "
        "(null: the first half of the file gates).",
        None,
    )
    checker: str = field(
        f"User's domain: how a generated answer is graded against `answer`, one of {CHECKERS}.", "exact"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(f"name: expected a name of letters, digits, '_', '.', '-', got {self.name!r}")
        if self.file is None and self.name not in BUILTIN_DOMAINS:
            raise ConfigError(
                f"name: {self.name!r} is not a built-in domain {list(BUILTIN_DOMAINS)}; a domain of your own "
                "needs a JSONL file (file)"
            )
        if self.file is not None and not self.file.strip():
            raise ConfigError(f"file: expected the path of a JSONL file, got {self.file!r}")
        if self.file is not None and self.name in BUILTIN_DOMAINS:
            raise ConfigError(
                f"file: {self.name!r} is a built-in domain and reads no file; a file's domain needs a name "
                "of its own (name)"
            )
        if self.file is None and self.gate_rows is not None:
            raise ConfigError(
                f"gate_rows: only for a JSONL domain; built-in {self.name!r} gates on its evaluation split"
            )
        if self.gate_rows is not None and self.gate_rows < 1:
            raise ConfigError(f"gate_rows: expected a positive integer, got {self.gate_rows!r}")
        if self.checker not in CHECKERS:
            raise ConfigError(f"checker: expected one of {list(CHECKERS)}, got {self.checker!r}")

    @property
    def builtin(self) -> bool:
        return self.file is None


def resolve_domain(spec: DomainSpec, where: str = "retained.domain") -> RetainedDomain:
    """A RetainedDomain from a config entry (no file is read); errors name `where`."""
    if isinstance(spec, RetainedDomain):
        return spec
    if isinstance(spec, str):
        if spec not in BUILTIN_DOMAINS:
            raise ConfigError(
                f"{where}: unknown built-in domain {spec!r}; expected one of {list(BUILTIN_DOMAINS)} "
                "or a mapping with name and file"
            )
        return RetainedDomain(spec)
    if isinstance(spec, dict):
        return build(RetainedDomain, spec, where)
    raise ConfigError(f"{where}: expected a built-in name or a mapping with name and file, got {spec!r}")


def validate_domain(spec: DomainSpec, index: int | None = None) -> RetainedDomain:
    """Resolve an entry and, for a file, read and schema-check it and check that rows remain for
    calibration after the gating ones. Cheap: no tokenizer, no model."""
    where = "retained.domain" if index is None else f"retained.domains[{index}]"
    domain = resolve_domain(spec, where)
    if not domain.builtin:
        try:
            _file_rows(domain)
        except InputError as e:  # it names the field: "file: ..." or "gate_rows: ..."
            raise ConfigError(f"{where}.{e}") from e
    return domain


def validate_domains(specs: list) -> list[RetainedDomain]:
    """Every entry of `retained.domains` validated; names must be distinct."""
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"retained.domains: expected a non-empty list of domains, got {specs!r}")
    domains, seen = [], {}
    for i, spec in enumerate(specs):
        domain = validate_domain(spec, i)
        if domain.name in seen:
            raise ConfigError(
                f"retained.domains[{i}]: name {domain.name!r} repeats retained.domains[{seen[domain.name]}]"
            )
        seen[domain.name] = i
        domains.append(domain)
    return domains


# ------------------------------------------------------------------------------ rows and contexts
def _file_rows(domain: RetainedDomain) -> dict[str, list[DomainExample]]:
    """role -> rows of a JSONL domain: the first `gate_rows` gate, the rest calibrate. Errors are
    InputErrors that start with the field: 'file: ...' (unreadable, or a row breaks the schema)
    or 'gate_rows: ...' (no row left to calibrate)."""
    path = resolve_path(domain.file)
    try:
        rows = load_domain_jsonl(path)
    except ValueError as e:  # the file and the line are named
        raise InputError(f"file: {e}") from e
    gate = domain.gate_rows if domain.gate_rows is not None else math.ceil(len(rows) / 2)
    if gate >= len(rows):
        raise InputError(
            f"gate_rows: {domain.file} has {len(rows)} rows, and gate_rows={gate} gate on "
            f"{'all of them' if gate == len(rows) else 'more than there are'}: none remain to calibrate "
            "the atlas (the rows after the gating ones); add rows or lower gate_rows"
        )
    return {"gate": rows[:gate], "calibration": rows[gate:]}


def domain_contexts(
    tokenizer: Any, spec: DomainSpec, role: str, limit: int | None = None
) -> tuple[list[str], list[str]]:
    """(ids, teacher-forced contexts) of the domain's first `limit` rows in `role` ('gate' or
    'calibration'); the two roles never share a row."""
    ids, _, texts = domain_prompts(tokenizer, spec, role, limit)
    return ids, texts


def domain_prompts(
    tokenizer: Any, spec: DomainSpec, role: str, limit: int | None = None
) -> tuple[list[str], list[str], list[str]]:
    """(ids, prompts, contexts) as domain_contexts, with each context's rendered prompt."""
    if role not in ROLES:
        raise ValueError(f"role: expected one of {list(ROLES)}, got {role!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit: expected a positive integer or None, got {limit!r}")
    domain = resolve_domain(spec)
    if domain.builtin:
        split = BUILTIN_SPLITS[domain.name][ROLES.index(role)]
        return retained_prompts(tokenizer, domain.name, split, limit)
    rows = _file_rows(domain)[role][:limit]
    return [r.id for r in rows], *rendered_pairs(tokenizer, [(r.prompt, r.reference) for r in rows])


# ------------------------------------------------------------------------------ content hashes
def domain_data_files(spec: DomainSpec) -> dict[str, str]:
    """file -> sha256 of every file the domain's rows come from (a built-in: the published hashes)."""
    domain = resolve_domain(spec)
    if domain.builtin:
        return {rel: known(rel).sha256 for rel in BUILTIN_FILES[domain.name]}
    return {domain.file: sha256_file(resolve_path(domain.file))}


def domain_data_sha256(spec: DomainSpec) -> str:
    """One sha256 for the domain's data: a JSONL domain's file hash, or for a built-in the sha256
    of its "relpath sha256" lines (it reads two files: its evaluation and its train split)."""
    files = domain_data_files(spec)
    if len(files) == 1:
        return next(iter(files.values()))
    return hashlib.sha256("".join(f"{rel} {sha}\n" for rel, sha in files.items()).encode()).hexdigest()
