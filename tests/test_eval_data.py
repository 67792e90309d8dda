"""Shipped data sets: row counts, published hashes, corruption, download checks, user schema."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from atlas_core.io import sha256_file
from atlas_core.paths import data_dir
from evaluation import data as D
from evaluation.datafiles import (
    KNOWN_FILES,
    DataIntegrityError,
    build_splits_json,
    download,
    known,
    verified_path,
)
from evaluation.userdata import SchemaError, load_retained_jsonl, load_skill_jsonl

ROOT = data_dir()
pytestmark = pytest.mark.skipif(not (ROOT / "gsm8k/test.jsonl").is_file(), reason=f"data files not in {ROOT}")


def _rows(path: Path) -> int:
    if path.suffix == ".gz":
        return sum(1 for line in gzip.decompress(path.read_bytes()).splitlines() if line.strip())
    if path.name == "sanitized-mbpp.json":
        return len(json.loads(path.read_text()))
    if path.name == "splits.json":
        return sum(json.loads(path.read_text())["sanitized_counts"].values())
    return sum(1 for line in path.read_text().splitlines() if line.strip())


@pytest.mark.parametrize("relpath", list(KNOWN_FILES))
def test_every_shipped_file_matches_published_hash_size_and_rows(relpath: str) -> None:
    spec = KNOWN_FILES[relpath]
    path = verified_path(relpath)
    assert sha256_file(path) == spec.sha256
    assert path.stat().st_size == spec.size
    assert _rows(path) == spec.rows


def test_known_table_matches_provenance_document() -> None:
    # The hard-coded registry must agree with the published provenance table.
    table = (ROOT / "PROVENANCE.md").read_text()
    for spec in KNOWN_FILES.values():
        assert spec.sha256 in table and str(spec.size) in table, spec.relpath


@pytest.mark.parametrize(
    "loader, split, n",
    [
        (D.load_gsm8k, "test", 1319),
        (D.load_gsm8k, "train", 7473),
        (D.load_csqa, "validation", 1221),
        (D.load_csqa, "train", 9741),
        (D.load_mbpp, "train", 120),
        (D.load_mbpp, "validation", 43),
        (D.load_mbpp, "test", 257),
        (D.load_mbpp_plus, "test", 224),
    ],
)
def test_loaders_row_counts(loader, split: str, n: int) -> None:
    ds = loader(split)
    assert len(ds) == n
    key = "id" if "id" in ds.column_names else "task_id"
    assert len(set(ds[key])) == n  # ids unique


def test_loader_contents() -> None:
    gsm = D.load_gsm8k("test")
    assert gsm[0]["final"] == "18" and gsm[0]["id"] == "gsm8k-test-0"
    csqa = D.load_csqa("validation")
    assert csqa[0]["labels"] == list("ABCDE") and csqa[0]["answer"] == "A" and csqa[0]["texts"][0] == "bank"
    counts = {k: csqa["answer"].count(k) for k in "ABCDE"}
    assert counts == {"A": 239, "B": 255, "C": 241, "D": 251, "E": 235}  # PROVENANCE.md
    plus = D.load_mbpp_plus("test")
    assert plus[0]["task_id"] == "Mbpp/11" and plus[0]["first_test"].startswith("assert remove_Occ(")
    assert all(row["first_test"].startswith("assert") and row["text"] for row in plus)
    # MBPP+ test problems are sanitized-MBPP test problems.
    sanitized_test = set(D.mbpp_split_ids("test"))
    assert {int(t.split("/")[1]) for t in plus["task_id"]} <= sanitized_test
    assert all(11 <= t <= 510 for t in sanitized_test)
    with pytest.raises(ValueError, match="unknown split"):
        D.load_gsm8k("validation")


def test_mbpp_pairs_are_the_generation_message_to_fenced_reference_code() -> None:
    from evaluation.prompts import code_message

    rows, pairs = D.load_mbpp("train"), D.mbpp_pairs("train")
    assert len(pairs) == 120 and pairs[0]["id"] == f"mbpp-{rows[0]['task_id']}"
    # The prompt is the user message generation sends (evaluation.tasks renders code_message).
    assert all(p["prompt"] == code_message(r["text"], r["first_test"]) for p, r in zip(pairs, rows))
    assert pairs[0]["response"] == f"```python\n{rows[0]['code'].strip()}\n```"
    assert {p["id"] for p in D.mbpp_pairs("validation")}.isdisjoint(p["id"] for p in pairs)


def test_splits_json_regenerates_to_published_sha() -> None:
    regenerated = build_splits_json(
        (ROOT / "mbpp/sanitized-mbpp.json").read_bytes(), (ROOT / "mbppplus/MbppPlus-v0.2.0.jsonl").read_bytes()
    )
    assert regenerated == (ROOT / "mbpp/splits.json").read_bytes()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_copy_fails_with_clear_error(tmp_path: Path, damage: str) -> None:
    rel = "gsm8k/test.jsonl"
    copy = tmp_path / rel
    copy.parent.mkdir(parents=True)
    data = (ROOT / rel).read_bytes()
    copy.write_bytes(data[:-100] if damage == "truncate" else data.replace(b"Janet", b"Jenny", 1))
    with pytest.raises(DataIntegrityError) as err:
        D.load_gsm8k("test", root=tmp_path)
    message = str(err.value)
    assert str(copy) in message and known(rel).sha256 in message and sha256_file(copy) in message
    assert "python -m evaluation.data download" in message
    assert ("truncated" in message) == (damage == "truncate")


def test_missing_file_names_download_command(tmp_path: Path) -> None:
    with pytest.raises(DataIntegrityError, match=r"not found.*evaluation\.data download"):
        D.load_csqa("validation", root=tmp_path)


def _local_fetcher(calls: list[str], corrupt: str | None = None):
    """Serves the shipped files for their upstream URLs, as the network would."""
    by_url = {spec.url: ROOT / spec.relpath for spec in KNOWN_FILES.values() if spec.url}

    def fetch(url: str) -> bytes:
        calls.append(url)
        data = by_url[url].read_bytes()
        return data[: len(data) // 2] if corrupt and url.endswith(corrupt) else data

    return fetch


def test_download_checks_and_writes_every_file(tmp_path: Path) -> None:
    calls: list[str] = []
    written = download(tmp_path, fetch=_local_fetcher(calls), log=lambda _: None)
    assert len(written) == len(KNOWN_FILES)
    assert len(calls) == sum(spec.url is not None for spec in KNOWN_FILES.values())
    for rel, spec in KNOWN_FILES.items():
        assert sha256_file(tmp_path / rel) == spec.sha256
    # A second run finds everything in place and fetches nothing.
    calls.clear()
    assert download(tmp_path, fetch=_local_fetcher(calls), log=lambda _: None) == [] and calls == []


def test_download_refuses_bad_bytes_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(DataIntegrityError, match=r"sanitized-mbpp\.json.*expected ca95deaa"):
        download(tmp_path, fetch=_local_fetcher([], corrupt="sanitized-mbpp.json"), log=lambda _: None)
    assert not (tmp_path / "mbpp/sanitized-mbpp.json").exists()
    assert not list(tmp_path.rglob("*.tmp"))


def test_cli_verify(tmp_path: Path, capsys) -> None:
    assert D.main(["verify", "--root", str(ROOT)]) == 0
    shutil.copytree(ROOT, tmp_path / "d")
    bad = tmp_path / "d/csqa/dev_rand_split.jsonl"
    bad.chmod(0o644)
    bad.write_bytes(bad.read_bytes()[:1000])
    assert D.main(["verify", "--root", str(tmp_path / "d")]) == 1
    assert "dev_rand_split.jsonl" in capsys.readouterr().out


# ---------------------------------------------------------------- user JSONL schema


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_user_sets_load(tmp_path: Path) -> None:
    skill = load_skill_jsonl(
        _write(
            tmp_path / "s.jsonl",
            [
                {"id": "a", "prompt": "p", "response": "r", "tests": ["assert 1"]},
                "",
                {"id": "b", "prompt": "p2", "response": "", "meta": {"src": "x"}},
            ],
        )
    )
    assert [s.id for s in skill] == ["a", "b"] and skill[0].tests == ("assert 1",) and skill[1].meta == {"src": "x"}
    retained = load_retained_jsonl(_write(tmp_path / "r.jsonl", [{"id": "r1", "prompt": "q", "answer": "5"}]))
    assert retained[0].answer == "5"


@pytest.mark.parametrize(
    "row, pattern",
    [
        ("{not json", r"line 2: not valid JSON"),
        ("[1, 2]", r"line 2: expected a JSON object"),
        ({"id": "b", "prompt": "p"}, r"line 2: field 'response' is missing"),
        ({"id": "b", "promt": "p", "prompt": "p", "response": "r"}, r"line 2: field 'promt' is not part"),
        ({"id": 3, "prompt": "p", "response": "r"}, r"line 2: field 'id' must be a string"),
        ({"id": "b", "prompt": " ", "response": "r"}, r"line 2: field 'prompt' is empty"),
        ({"id": "b", "prompt": "p", "response": "r", "tests": "assert 1"}, r"line 2: field 'tests' must be a list"),
        ({"id": "a", "prompt": "p", "response": "r"}, r"line 2: field 'id' 'a' repeats line 1"),
    ],
)
def test_malformed_skill_rows_name_file_line_field(tmp_path: Path, row, pattern: str) -> None:
    path = _write(tmp_path / "skill.jsonl", [{"id": "a", "prompt": "p", "response": "r"}, row])
    with pytest.raises(SchemaError, match=rf"skill\.jsonl: {pattern}"):
        load_skill_jsonl(path)


def test_retained_schema_rejects_skill_fields(tmp_path: Path) -> None:
    path = _write(tmp_path / "ret.jsonl", [{"id": "a", "prompt": "p", "answer": "x", "tests": []}])
    with pytest.raises(SchemaError, match=r"ret\.jsonl: line 1: field 'tests' is not part"):
        load_retained_jsonl(path)
    with pytest.raises(SchemaError, match="no rows"):
        load_retained_jsonl(_write(tmp_path / "empty.jsonl", [""]))
