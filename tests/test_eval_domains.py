"""Retained domains: gate and calibration rows are disjoint, JSONL domains, data hashes, config errors."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from atlas_core.io import sha256_file
from atlas_core.paths import data_dir
from atlas_core.typed_config import ConfigError
from evaluation.contexts import rendered_pairs, retained_contexts
from evaluation.data import load_csqa, load_gsm8k, mbpp_pairs
from evaluation.datafiles import known
from evaluation.domains import (
    BUILTIN_DOMAINS,
    RetainedDomain,
    domain_contexts,
    domain_data_files,
    domain_data_sha256,
    validate_domain,
    validate_domains,
)
from evaluation.prompts import choice_message, math_message, render
from evaluation.tiny import tiny_tokenizer

pytestmark = pytest.mark.skipif(not (data_dir() / "gsm8k/test.jsonl").is_file(), reason="data files not available")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(chat=True)


def _domain_file(path: Path, n: int, **extra) -> str:
    path.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "prompt": f"Question {i}?", "reference": f"Reply {i}.", **extra}) + "\n"
            for i in range(n)
        )
    )
    return str(path)


# ------------------------------------------------------------------------------ built-ins
@pytest.mark.parametrize(
    "name, gate_ids, calibration_ids",
    [
        ("gsm8k", lambda: load_gsm8k("test")["id"], lambda: load_gsm8k("train")["id"]),
        ("csqa", lambda: load_csqa("validation")["id"], lambda: load_csqa("train")["id"]),
        ("mbpp", lambda: [p["id"] for p in mbpp_pairs("test")], lambda: [p["id"] for p in mbpp_pairs("train")]),
    ],
)
def test_builtin_gate_and_calibration_rows_are_disjoint(tok, name, gate_ids, calibration_ids) -> None:
    gate, gate_texts = domain_contexts(tok, name, "gate")
    calibration, calibration_texts = domain_contexts(tok, name, "calibration")
    assert gate == list(gate_ids()) and calibration == list(calibration_ids())  # evaluation split vs train split
    assert not set(gate) & set(calibration)
    assert not set(gate_texts) & set(calibration_texts)  # not even an identical context under another id
    assert len(set(gate_texts)) > 0.99 * len(gate_texts)
    first, _ = domain_contexts(tok, name, "calibration", limit=5)
    assert first == calibration[:5]


def test_builtin_contexts_are_the_retained_contexts(tok) -> None:
    # retained_contexts keeps its old behaviour (the gates' KL contexts) and also knows 'mbpp'.
    ds = load_gsm8k("test").select(range(3))
    assert retained_contexts(tok, "gsm8k", limit=3) == (
        list(ds["id"]),
        [render(tok, math_message(q), "math") + a for q, a in zip(ds["question"], ds["answer"])],
    )
    cs = load_csqa("validation").select(range(3))
    assert retained_contexts(tok, "csqa", limit=3)[1] == [
        render(tok, choice_message(s, t), "choice") + a for s, t, a in zip(cs["stem"], cs["texts"], cs["answer"])
    ]
    assert domain_contexts(tok, "gsm8k", "gate", 3) == retained_contexts(tok, "gsm8k", limit=3)
    pairs = mbpp_pairs("test")[:2]
    ids, texts = domain_contexts(tok, "mbpp", "gate", 2)
    assert (ids, texts) == retained_contexts(tok, "mbpp", limit=2)
    assert (
        texts[0] == f"<s><|user|>{pairs[0]['prompt']}\n<|assistant|>{pairs[0]['response']}"
    )  # the trainer's rendering
    plain = tiny_tokenizer(chat=False)
    assert domain_contexts(plain, "mbpp", "gate", 1)[1] == [pairs[0]["prompt"] + pairs[0]["response"] + plain.eos_token]


def test_builtin_data_hashes() -> None:
    for name, files in (
        ("gsm8k", ["gsm8k/test.jsonl", "gsm8k/train.jsonl"]),
        ("csqa", ["csqa/dev_rand_split.jsonl", "csqa/train_rand_split.jsonl"]),
        ("mbpp", ["mbpp/sanitized-mbpp.json", "mbpp/splits.json"]),
    ):
        assert domain_data_files(name) == {f: known(f).sha256 for f in files}
        lines = "".join(f"{f} {known(f).sha256}\n" for f in files)
        assert domain_data_sha256(name) == hashlib.sha256(lines.encode()).hexdigest()
    assert len({domain_data_sha256(name) for name in BUILTIN_DOMAINS}) == 3


# ------------------------------------------------------------------------------ JSONL domains
def test_jsonl_domain_gates_on_its_first_rows_and_calibrates_on_the_rest(tok, tmp_path) -> None:
    spec = {"name": "support", "file": _domain_file(tmp_path / "d.jsonl", 10), "gate_rows": 4}
    domain = validate_domain(spec, 2)
    assert domain == RetainedDomain("support", spec["file"], 4)
    gate, texts = domain_contexts(tok, spec, "gate")
    calibration, _ = domain_contexts(tok, domain, "calibration")
    assert gate == ["r0", "r1", "r2", "r3"] and calibration == [f"r{i}" for i in range(4, 10)]
    rendered = ["<s><|user|>Question 1?\n<|assistant|>Reply 1."]
    assert [texts[1]] == rendered_pairs(tok, [("Question 1?", "Reply 1.")])[1] == rendered
    assert domain_contexts(tok, spec, "gate", limit=2)[0] == ["r0", "r1"]
    assert domain_contexts(tok, spec, "calibration", limit=2)[0] == ["r4", "r5"]
    assert domain_contexts(tok, spec, "gate", limit=99)[0] == gate  # never spills into calibration rows
    halves = {"name": "support", "file": _domain_file(tmp_path / "e.jsonl", 5, answer="x")}  # default: first half gates
    assert domain_contexts(tok, halves, "gate")[0] == ["r0", "r1", "r2"]
    assert domain_contexts(tok, halves, "calibration")[0] == ["r3", "r4"]


@pytest.mark.parametrize(
    "rows, gate_rows, message",
    [
        (4, 4, r"4 rows, and gate_rows=4 gate on all of them: none remain to calibrate"),
        (4, 9, r"4 rows, and gate_rows=9 gate on more than there are"),
        (1, None, r"1 rows, and gate_rows=1 gate on all of them"),
    ],
)
def test_jsonl_domain_needs_rows_left_for_calibration(tok, tmp_path, rows, gate_rows, message) -> None:
    spec = {"name": "small", "file": _domain_file(tmp_path / "d.jsonl", rows), "gate_rows": gate_rows}
    with pytest.raises(ConfigError, match=r"retained.domains\[1\]\.gate_rows: .*d.jsonl has " + message):
        validate_domain(spec, 1)
    with pytest.raises(ValueError, match=message):
        domain_contexts(tok, spec, "calibration")


def test_jsonl_domain_hash_is_its_file(tmp_path) -> None:
    spec = {"name": "support", "file": _domain_file(tmp_path / "d.jsonl", 4)}
    assert domain_data_sha256(spec) == sha256_file(spec["file"])
    before = domain_data_sha256(spec)
    _domain_file(Path(spec["file"]), 5)
    assert domain_data_sha256(spec) != before


# ------------------------------------------------------------------------------ config errors
BAD_ROWS = {
    "missing": '{"id": "a", "prompt": "p"}\n',
    "typo": '{"id": "a", "prompt": "p", "reference": "r", "anwser": "x"}\n',
    "empty": '{"id": "a", "prompt": "p", "reference": "r"}\n{"id": "b", "prompt": "p", "reference": " "}\n',
    "json": '{"id": "a", "prompt": "p", "reference": "r"}\n{"id": "b",\n',
    "type": '{"id": "a", "prompt": "p", "reference": "r", "answer": 3}\n',
}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gsm8", r"retained.domains\[0\]: unknown built-in domain 'gsm8'"),
        (7, r"retained.domains\[0\]: expected a built-in name or a mapping"),
        ({"name": "mine"}, r"retained.domains\[0\].name: 'mine' is not a built-in domain .* needs a JSONL file"),
        ({"name": "mine", "file": " "}, r"retained.domains\[0\].file: expected the path of a JSONL file"),
        (
            {"name": "gsm8k", "file": "{good}"},
            r"retained.domains\[0\].file: 'gsm8k' is a built-in domain and reads no file",
        ),
        ({"name": "my domain", "file": "{good}"}, r"retained.domains\[0\].name: expected a name of letters"),
        (
            {"name": "mine", "file": "{good}", "gate_rows": 0},
            r"retained.domains\[0\].gate_rows: expected a positive integer",
        ),
        ({"name": "mine", "file": "{good}", "gate_rows": "4"}, r"retained.domains\[0\].gate_rows: expected an integer"),
        ({"name": "mine", "file": "{good}", "gate_row": 4}, r"retained.domains\[0\].gate_row: unknown field"),
        ({"name": "mine", "file": "{good}", "checker": "fuzzy"}, r"retained.domains\[0\].checker: expected one of"),
        ({"name": "csqa", "gate_rows": 4}, r"retained.domains\[0\].gate_rows: only for a JSONL domain"),
        ({"name": "mine", "file": "no/such.jsonl"}, r"retained.domains\[0\]\.file: .*no/such.jsonl: file not found"),
        (
            {"name": "mine", "file": "{missing}"},
            r"retained.domains\[0\]\.file: .*missing.jsonl: line 1: field 'reference' is missing",
        ),
        (
            {"name": "mine", "file": "{typo}"},
            r"retained.domains\[0\]\.file: .*typo.jsonl: line 1: field 'anwser' is not part",
        ),
        (
            {"name": "mine", "file": "{empty}"},
            r"retained.domains\[0\]\.file: .*empty.jsonl: line 2: field 'reference' is empty",
        ),
        ({"name": "mine", "file": "{json}"}, r"retained.domains\[0\]\.file: .*json.jsonl: line 2: not valid JSON"),
        (
            {"name": "mine", "file": "{type}"},
            r"retained.domains\[0\]\.file: .*type.jsonl: line 1: field 'answer' must be a string",
        ),
    ],
)
def test_domain_errors_name_the_entry(spec, message, tmp_path) -> None:
    files = {"{good}": _domain_file(tmp_path / "good.jsonl", 4)}
    for key, text in BAD_ROWS.items():
        (tmp_path / f"{key}.jsonl").write_text(text)
        files[f"{{{key}}}"] = str(tmp_path / f"{key}.jsonl")
    if isinstance(spec, dict) and "file" in spec:
        spec = {**spec, "file": files.get(spec["file"], spec["file"])}
    with pytest.raises(ConfigError, match=message):
        validate_domain(spec, 0)


def test_validate_domains_checks_every_entry_and_distinct_names(tmp_path) -> None:
    file = _domain_file(tmp_path / "d.jsonl", 4)
    domains = validate_domains(["gsm8k", "mbpp", {"name": "mine", "file": file}])
    assert [d.name for d in domains] == ["gsm8k", "mbpp", "mine"] and [d.builtin for d in domains] == [
        True,
        True,
        False,
    ]
    with pytest.raises(ConfigError, match=r"retained.domains\[2\]: name 'gsm8k' repeats retained.domains\[0\]"):
        validate_domains(["gsm8k", "csqa", {"name": "gsm8k"}])
    with pytest.raises(ConfigError, match=r"retained.domains\[1\]: unknown built-in domain"):
        validate_domains(["gsm8k", "code"])
    with pytest.raises(ConfigError, match=r"retained.domains: expected a non-empty list"):
        validate_domains([])
    with pytest.raises(ValueError, match="role: expected one of"):
        domain_contexts(None, "gsm8k", "train")
