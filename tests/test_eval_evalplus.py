"""EvalPlus scoring on real MBPP+ problems: canonical solutions pass, harmful ones fail harmlessly.

The subset is the first 23 MBPP+ test problems plus Mbpp/455 (only 13 plus inputs, so a
solution that hangs at import is killed quickly). Its ground truth takes about a second to
build and is cached under `<state>/evalplus_cache`, where later runs reuse it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from atlas_core.paths import data_dir
from evaluation.data import load_mbpp_plus
from evaluation.evalplus_score import evalplus_cache_home, score_mbpp_plus

pytestmark = pytest.mark.skipif(
    not (data_dir() / "mbppplus/MbppPlus-v0.2.0.jsonl").is_file(), reason="MBPP+ data not available"
)


@pytest.fixture(scope="module")
def canonical() -> dict[str, str]:
    plus = load_mbpp_plus("test")
    rows = {r["task_id"]: r for r in plus}
    ids = list(plus["task_id"][:23]) + ["Mbpp/455"]
    return {t: rows[t]["canonical_solution"] for t in ids}


def _bad_solutions(sentinel: Path) -> dict[str, str]:
    target = repr(str(sentinel))
    deleter = f"""
import os, shutil, pathlib, subprocess
def _attack():
    for attempt in (lambda: os.remove({target}), lambda: os.unlink({target}),
                    lambda: pathlib.Path({target}).unlink(), lambda: shutil.rmtree(os.path.dirname({target})),
                    lambda: os.system("rm -f " + {target}), lambda: subprocess.run(["rm", "-f", {target}])):
        try:
            attempt()
        except BaseException:
            pass
_attack()
def remove_Occ(s, ch):
    _attack()
    return s
"""
    return {
        "Mbpp/11": deleter,
        "Mbpp/12": "def sort_matrix(M):\n    while True:\n        pass\n",  # loops forever inside the call
        "Mbpp/455": "while True:\n    pass\n",  # loops forever at import, before any test runs
        "Mbpp/14": "def find_Volume(l, b, h):\n    return l * b * h\n",  # wrong answer (missing / 2)
        "Mbpp/16": "def text_lowercase_underscore(text:\n    return True\n",  # syntax error
    }


def test_deleting_solution_really_deletes_outside_the_sandbox(tmp_path) -> None:
    # Guards the test below: the attack code works when nothing contains it.
    sentinel = tmp_path / "keep" / "sentinel.txt"
    sentinel.parent.mkdir()
    sentinel.write_text("x")
    exec(_bad_solutions(sentinel)["Mbpp/11"], {})
    assert not sentinel.exists()


def test_canonical_pass_and_harmful_solutions_fail_safely(canonical, tmp_path, monkeypatch) -> None:
    # Set in the caller's environment on purpose: evalplus 0.3.1 crashes if the child sees it.
    monkeypatch.setenv("EVALPLUS_TIMEOUT_PER_TASK", "5")
    good = score_mbpp_plus(canonical, results_path=tmp_path / "good.json")
    assert good.n == 24 and good.solved == 24 and good.base_solved == 24 and good.percent == 100.0
    assert all(p.base_status == "pass" and p.plus_status == "pass" for p in good.problems)
    cache_file = evalplus_cache_home() / "evalplus" / f"{good.dataset_md5}.pkl"
    assert cache_file.is_file()
    cache_mtime = cache_file.stat().st_mtime_ns
    written = json.loads((tmp_path / "good.json").read_text())
    assert written["solved"] == 24 and len(written["problems"]) == 24

    sentinel = tmp_path / "keep" / "sentinel.txt"
    sentinel.parent.mkdir()
    sentinel.write_text("still here")
    bad = _bad_solutions(sentinel)
    mixed = {**canonical, **bad}
    result = score_mbpp_plus(mixed, results_path=tmp_path / "mixed.json")

    assert sentinel.read_text() == "still here"  # the deleting solution was contained
    by_id = {p.task_id: p for p in result.problems}
    assert {t for t, p in by_id.items() if not p.passed} == set(bad)
    assert result.solved == 24 - len(bad) and result.n == 24
    assert not by_id["Mbpp/455"].base_passed and by_id["Mbpp/455"].base_status == "timeout"
    assert not by_id["Mbpp/12"].base_passed
    # Same problems file -> same ground-truth cache, reused rather than rebuilt.
    assert result.dataset_md5 == good.dataset_md5 and cache_file.stat().st_mtime_ns == cache_mtime
    # The first run's results were not reused (fresh samples folder per run).
    assert result.solved != good.solved


def test_base_only_and_per_problem_counts(canonical) -> None:
    # Mbpp/14 (volume of a triangular prism) with an integer division passes the 3 base
    # tests but fails plus tests with odd products: solved counts base AND plus.
    ids = list(canonical)[:24]
    solutions = {t: canonical[t] for t in ids}
    solutions["Mbpp/14"] = "def find_Volume(l, b, h):\n    return (l * b * h) // 2\n"
    result = score_mbpp_plus(solutions)
    by_id = {p.task_id: p for p in result.problems}
    assert by_id["Mbpp/14"].base_passed and not by_id["Mbpp/14"].passed
    assert result.base_solved == 24 and result.solved == 23
    assert result.solved_ids() == [p.task_id for p in result.problems if p.task_id != "Mbpp/14"]


def test_input_errors() -> None:
    with pytest.raises(ValueError, match="no solutions"):
        score_mbpp_plus({})
    with pytest.raises(KeyError, match="Mbpp/1"):
        score_mbpp_plus({"Mbpp/1": "x = 1"})  # a prompt-split id that MBPP+ does not hold
