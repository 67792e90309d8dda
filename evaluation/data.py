"""Loading the shipped data sets as Hugging Face `datasets`, every file checked by sha256 first.

    load_gsm8k("test")        1,319 rows: id, question, answer (worked solution), final ("#### N" value)
    load_gsm8k("train")       7,473 rows
    load_csqa("validation")   1,221 rows: id, stem, labels ["A".."E"], texts, answer ("A".."E")
    load_csqa("train")        9,741 rows
    load_mbpp("train")          120 rows (sanitized MBPP): task_id, text, first_test, code, test_list, test_imports
    load_mbpp("validation"/"test")  43 / 257 rows
    mbpp_pairs("train")         the same rows as training pairs: {"prompt", "response", "id"}
    gsm8k_pairs("train")        GSM8K as training pairs: math prompt -> solution ending "The answer is N."
    load_mbpp_plus("test")      224 rows (MBPP+ v0.2.0 ids in the MBPP test split):
                                task_id ("Mbpp/N"), text, first_test, entry_point, canonical_solution

Splits of MBPP and MBPP+ come from `mbpp/splits.json` (the google-research task_id rule).
Everything runs offline; the `datasets` cache lives in `<state_dir>/hf_datasets`.

Command line (files from upstream, each sha256 checked before it is written):

    python -m evaluation.data download [--dest DIR]     # default DIR: ATLAS_DATA_DIR or <state>/data
    python -m evaluation.data verify [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from atlas_core.errors import InputError
from atlas_core.paths import data_dir, state_dir
from evaluation.datafiles import DataIntegrityError, download, verified_path, verify_all
from evaluation.prompts import code_pair, math_pair

GSM8K_FILES = {"test": "gsm8k/test.jsonl", "train": "gsm8k/train.jsonl"}
CSQA_FILES = {"validation": "csqa/dev_rand_split.jsonl", "train": "csqa/train_rand_split.jsonl"}
MBPP_SPLITS = ("train", "validation", "test", "prompt")
CSQA_LABELS = ("A", "B", "C", "D", "E")

if TYPE_CHECKING:
    from datasets import Dataset  # imported where a set is loaded: `datasets` costs ~1 s (pandas, pyarrow)


def _offline() -> None:
    """No hub traffic ever: every file is local. Set before `datasets` is first imported (it reads
    these once), here rather than at import: importing a module changes no environment."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _json_dataset(path: Path) -> Dataset:
    _offline()
    import datasets

    datasets.disable_progress_bars()  # a bar per tiny local file is noise
    return datasets.load_dataset(
        "json", data_files=str(path), split="train", cache_dir=str(state_dir() / "hf_datasets")
    )


def _check_split(split: str, allowed: tuple[str, ...] | list[str]) -> None:
    if split not in allowed:
        raise InputError(f"unknown split {split!r}; choose one of {list(allowed)}")


# ---------------------------------------------------------------- GSM8K

_FINAL = re.compile(r"####\s*(.+?)\s*$")


def load_gsm8k(split: str = "test", root: str | Path | None = None) -> Dataset:
    """GSM8K with a stable id per row ("gsm8k-<split>-<row index>") and the reference final answer."""
    _check_split(split, list(GSM8K_FILES))
    path = verified_path(GSM8K_FILES[split], root)
    ds = _json_dataset(path)

    def add_fields(row: dict, idx: int) -> dict:
        match = _FINAL.search(row["answer"])
        if match is None:
            raise DataIntegrityError(f"{path}: line {idx + 1}: field 'answer' has no '#### N' final answer")
        return {"id": f"gsm8k-{split}-{idx}", "final": match.group(1).replace(",", "")}

    return ds.map(add_fields, with_indices=True).select_columns(["id", "question", "answer", "final"])


def gsm8k_pairs(split: str = "train", root: str | Path | None = None) -> list[dict]:
    """GSM8K `split` as training pairs (ids as in `load_gsm8k`): the math prompt -> the worked
    solution in the answer format the prompt asks for (`prompts.math_pair`)."""
    ds = load_gsm8k(split, root)
    return [math_pair(q, a, f, i) for q, a, f, i in zip(ds["question"], ds["answer"], ds["final"], ds["id"])]


# ---------------------------------------------------------------- CommonsenseQA


def load_csqa(split: str = "validation", root: str | Path | None = None) -> Dataset:
    """CommonsenseQA flattened to id, stem, labels, texts, answer (the answerKey)."""
    _check_split(split, list(CSQA_FILES))
    path = verified_path(CSQA_FILES[split], root)
    ds = _json_dataset(path)

    def flatten(row: dict, idx: int) -> dict:
        choices = row["question"]["choices"]
        labels = [c["label"] for c in choices]
        if tuple(labels) != CSQA_LABELS or row["answerKey"] not in CSQA_LABELS:
            raise DataIntegrityError(f"{path}: line {idx + 1}: expected choices labelled A-E and an answerKey A-E")
        return {
            "stem": row["question"]["stem"],
            "labels": labels,
            "texts": [c["text"] for c in choices],
            "answer": row["answerKey"],
        }

    return ds.map(flatten, with_indices=True).select_columns(["id", "stem", "labels", "texts", "answer"])


# ---------------------------------------------------------------- MBPP and MBPP+


def mbpp_split_ids(split: str, which: str = "sanitized", root: str | Path | None = None) -> list[int]:
    """Task ids of one MBPP split, from splits.json; `which` is "sanitized" or "mbppplus"."""
    _check_split(split, MBPP_SPLITS)
    key = {"sanitized": "sanitized_task_ids", "mbppplus": "mbppplus_v0.2.0_task_ids"}[which]
    splits = json.loads(verified_path("mbpp/splits.json", root).read_text())
    return list(splits[key][split])


def load_mbpp(split: str = "train", root: str | Path | None = None) -> Dataset:
    """Sanitized MBPP rows of one split; `text` is the problem statement, `first_test` its first assert."""
    ids = set(mbpp_split_ids(split, "sanitized", root))
    ds = _json_dataset(verified_path("mbpp/sanitized-mbpp.json", root))
    ds = ds.filter(lambda row: row["task_id"] in ids)
    return ds.map(lambda row: {"text": row["prompt"], "first_test": row["test_list"][0]}).select_columns(
        ["task_id", "text", "first_test", "code", "test_list", "test_imports"]
    )


def mbpp_pairs(split: str = "train", root: str | Path | None = None) -> list[dict]:
    """Sanitized MBPP `split` as training pairs: problem + first test -> fenced reference code."""
    return [code_pair(r["text"], r["first_test"], r["code"], f"mbpp-{r['task_id']}") for r in load_mbpp(split, root)]


def split_plus_prompt(prompt: str, where: str) -> tuple[str, str]:
    """MBPP+ prompts are a docstring holding the statement and one assert: return (text, assert)."""
    body = prompt.strip().strip('"').strip()
    lines = body.splitlines()
    asserts = [i for i, line in enumerate(lines) if line.lstrip().startswith("assert")]
    if not asserts:
        raise DataIntegrityError(f"{where}: field 'prompt' has no assert line")
    first = asserts[0]
    return "\n".join(lines[:first]).strip(), "\n".join(lines[first:]).strip()


def mbpp_plus_lines(task_ids: list[str] | None = None, root: str | Path | None = None) -> list[str]:
    """Raw JSONL lines of MBPP+ v0.2.0 for `task_ids` ("Mbpp/N"; all when None), in file order.

    EvalPlus needs the rows byte for byte (heterogeneous test inputs that Arrow cannot hold)."""
    path = verified_path("mbppplus/MbppPlus-v0.2.0.jsonl", root)
    lines = [line for line in path.read_text().splitlines(keepends=True) if line.strip()]
    if task_ids is None:
        return lines
    wanted = set(task_ids)
    picked = [line for line in lines if json.loads(line)["task_id"] in wanted]
    found = {json.loads(line)["task_id"] for line in picked}
    if found != wanted:
        raise KeyError(f"not MBPP+ v0.2.0 task ids: {sorted(wanted - found)}")
    return picked


def load_mbpp_plus(split: str = "test", root: str | Path | None = None) -> Dataset:
    """MBPP+ v0.2.0 problems of one MBPP split (224 for "test"), text fields only.

    Built with `Dataset.from_list`: the json loader cannot load this file (some test inputs
    overflow Arrow's integer types), and scoring reads the raw rows anyway."""
    ids = {f"Mbpp/{i}" for i in mbpp_split_ids(split, "mbppplus", root)}
    rows = []
    for n, line in enumerate(mbpp_plus_lines(None, root), start=1):
        row = json.loads(line)
        if row["task_id"] not in ids:
            continue
        text, first_test = split_plus_prompt(row["prompt"], f"MbppPlus-v0.2.0.jsonl line {n} ({row['task_id']})")
        rows.append(
            {
                "task_id": row["task_id"],
                "text": text,
                "first_test": first_test,
                "entry_point": row["entry_point"],
                "canonical_solution": row["canonical_solution"],
            }
        )
    _offline()
    from datasets import Dataset

    return Dataset.from_list(rows)


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download", help="fetch every data file from upstream and check its sha256")
    dl.add_argument("--dest", type=Path, default=None, help="target folder (default: ATLAS_DATA_DIR or <state>/data)")
    vf = sub.add_parser("verify", help="check every data file against its published sha256")
    vf.add_argument("--root", type=Path, default=None, help="data folder (default: the configured data dir)")
    args = parser.parse_args(argv)
    try:
        if args.command == "download":
            dest = args.dest or (
                Path(os.environ["ATLAS_DATA_DIR"]) if "ATLAS_DATA_DIR" in os.environ else state_dir() / "data"
            )
            download(dest)
            print(f"all data files present and verified in {dest}")
        else:
            for path in verify_all(args.root or data_dir()):
                print(f"ok  {path}")
    except DataIntegrityError as e:
        print(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
