"""Answer extraction, answer storage, churn / NFR and choice churn on hand-made cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from evaluation.answers import (
    ANSWER_GIVEN,
    Answer,
    extract_gsm8k_answer,
    normalize_number,
    read_answers,
    score_gsm8k,
    write_answers,
)
from flows.compare import answer_churn
from registry import Flips, flip_kind


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She pays 3 + 4 = 7 dollars.\n#### 1,234", "1234"),  # "####" wins over earlier numbers
        ("#### 72\nThe answer is 3", "72"),  # "####" wins over "answer is"
        ("So 3 apples, then 4. The answer is 12 apples. Later 99", "12"),  # "answer is" wins over last number
        ("The answer is $1,200.50.", "1200.5"),
        ("The final answer is: .5", "0.5"),
        ("The answer is -7", "-7"),
        ("The answer is -$4", "-4"),
        ("answer is $ 18.00", "18"),  # trailing .0 dropped
        ("x = -3.0", "-3"),
        ("It went down to −5 degrees", "-5"),  # unicode minus
        ("It costs 50%.", "50"),
        ("so 5-3=2", "2"),  # a hyphen after a digit is not a sign
        ("Total: 1,000,000 people", "1000000"),
        ("values 1,2,3", "3"),  # not a thousands separator
        ("0.250 kg", "0.25"),
        ("#### no number here\nbut 8 later", "8"),  # empty "####" tail falls through
        ("no number at all", None),
        ("", None),
    ],
)
def test_extract_gsm8k_answer(text: str, expected: str | None) -> None:
    assert extract_gsm8k_answer(text) == expected


def test_normalize_and_score() -> None:
    assert normalize_number("1,234.0") == "1234" and normalize_number("$-0.50") == "-0.5"
    answers = score_gsm8k(["a", "b", "c"], ["The answer is 18.", "#### 5", "I don't know"], ["18", "6", "3"])
    assert [(a.answer, a.correct) for a in answers] == [("18", True), ("5", False), (None, False)]
    with pytest.raises(ValueError, match="lengths differ"):
        score_gsm8k(["a"], [], ["1"])


def test_answers_round_trip_and_errors(tmp_path: Path) -> None:
    answers = [Answer("q1", "18", True, "raw text"), Answer("q2", None, False)]
    path = tmp_path / "answers.jsonl"
    write_answers(path, answers)
    assert read_answers(path) == {"q1": answers[0], "q2": answers[1]}
    write_answers(path, answers, keep_raw=False)
    assert read_answers(path)["q1"].raw is None
    path.write_text('{"id": "q1", "answer": "1", "correct": true}\n{"id": "q2", "answer": 3, "correct": false}\n')
    with pytest.raises(ValueError, match=r"answers\.jsonl: line 2: field 'answer' has type int"):
        read_answers(path)
    path.write_text('{"id": "q1", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"line 1: field 'correct' is missing"):
        read_answers(path)
    with pytest.raises(ValueError, match="duplicate"):
        write_answers(path, [answers[0], answers[0]])


def _set(rows: list[tuple[str, str | None, bool]]) -> list[Answer]:
    return [Answer(i, a, c) for i, a, c in rows]


def test_churn_by_hand() -> None:
    # gold: q1=5, q2=7, q3=9, q4=2, q5=1, q6=4
    ref = _set(
        [
            ("q1", "5", True),
            ("q2", "6", False),
            ("q3", "8", False),
            ("q4", "2", True),
            ("q5", None, False),
            ("q6", "3", False),
        ]
    )
    new = _set(
        [
            ("q1", "4", False),  # correct -> wrong: F
            ("q2", "7", True),  # wrong -> correct: G
            ("q3", "10", False),  # wrong -> different wrong: W
            ("q4", "2", True),  # unchanged correct
            ("q5", None, False),  # unextractable both times: unchanged
            ("q6", None, False),
        ]
    )  # wrong -> no answer: W
    c = answer_churn(ref, new)
    assert (c.n, c.F, c.G, c.W) == (6, 1, 1, 2)
    assert c.churn == pytest.approx(4 / 6) and c.nfr == pytest.approx(1 / 6)
    assert c.accuracy_ref == pytest.approx(2 / 6) and c.accuracy_new == pytest.approx(2 / 6)
    # Reversed direction: q1 becomes G, q2 becomes F.
    r = answer_churn(new, ref)
    assert (r.F, r.G, r.W) == (1, 1, 2)
    assert answer_churn(ref, ref).churn == 0.0


def test_churn_accepts_mappings_and_rejects_different_ids() -> None:
    a = _set([("q1", "1", True), ("q2", "2", False)])
    assert answer_churn({x.id: x for x in a}, a).n == 2
    with pytest.raises(ValueError, match=r"1 only in the reference \(e\.g\. \['q2'\]\), 1 only in the new set"):
        answer_churn(a, _set([("q1", "1", True), ("q3", "2", False)]))
    with pytest.raises(ValueError, match="appears twice"):
        answer_churn(a, a + a[:1])


def test_choice_churn_is_share_of_changed_choices() -> None:
    # CSQA: answers are chosen labels; gold q1=A q2=B q3=C q4=D
    ref = _set([("q1", "A", True), ("q2", "C", False), ("q3", "E", False), ("q4", "D", True)])
    new = _set([("q1", "A", True), ("q2", "B", True), ("q3", "A", False), ("q4", "D", True)])
    c = answer_churn(ref, new)
    changed = sum(r.answer != n.answer for r, n in zip(ref, new))
    assert changed == 2 and c.churn == pytest.approx(changed / 4) and (c.F, c.G, c.W) == (0, 1, 1)


@pytest.mark.parametrize(
    "text, given",
    [
        ("So the answer is 12", None),  # 12 may go on: 120, 12.5
        ("The answer is 12.", None),
        ("The answer is 12.5.\n", "12.5"),
        ("The answer is $1,200 in total", "1200"),
        ("The answer is: 42\n", "42"),
        ("the answer is 7.\n\nQuestion", "7"),
        ("First 3, then 4 more.", None),
    ],
)
def test_answer_given_waits_for_the_whole_number(text: str, given: str | None) -> None:
    match = ANSWER_GIVEN.search(text)
    assert (extract_gsm8k_answer(text[: match.end()]) if match else None) == given


def test_the_one_classifier_on_every_transition():
    """registry.flip_kind, the only F/G/W classifier (fresh answers, stored answers, gates):
    correct -> wrong is F, wrong -> correct is G, wrong -> another wrong (None included) is W."""
    assert flip_kind(True, "1", False, "2") == "F"
    assert flip_kind(True, "1", False, None) == "F"
    assert flip_kind(False, "2", True, "1") == "G"
    assert flip_kind(False, None, True, "1") == "G"
    assert flip_kind(False, "2", False, "3") == "W"
    assert flip_kind(False, "2", False, None) == "W" and flip_kind(False, None, False, "2") == "W"
    assert flip_kind(True, "1", True, "1") is None
    assert flip_kind(False, "2", False, "2") is None
    assert flip_kind(False, None, False, None) is None  # unextractable both times: unchanged
    assert Flips.tally(["F", "G", "W", "W", None]) == Flips(n=5, F=1, G=1, W=2)


def test_no_questions_compared_has_no_rates():
    """n = 0 means nothing was compared: churn and NFR are None (never 0 or NaN), so every
    consumer fails closed on it; two empty answer sets give exactly that."""
    empty = answer_churn([], [])
    assert (empty.n, empty.F, empty.G, empty.W) == (0, 0, 0, 0)
    assert empty.churn is None and empty.nfr is None and empty.accuracy_ref is None
    assert empty.flips == Flips(0, 0, 0, 0) and Flips(0, 0, 0, 0).nfr is None
    assert Flips.total([]).churn is None and Flips.total([Flips(4, 1, 0, 1), Flips(0, 0, 0, 0)]).nfr == 0.25


def test_registry_counts_flips_with_the_same_classifier():
    """Stored answers compared from the ledger (flows.compare) give the F/G/W that evaluation
    counts from fresh answers and the gates read: every (correct, answer) transition."""
    from itertools import product

    from flows.compare import compare_answers
    from registry.records import AnswerRecord

    states = [(True, "1"), (False, "2"), (False, "3"), (False, None)]
    pairs = list(product(states, states))
    ref = {f"q{i}": Answer(f"q{i}", a, c) for i, ((c, a), _) in enumerate(pairs)}
    new = {f"q{i}": Answer(f"q{i}", a, c) for i, (_, (c, a)) in enumerate(pairs)}
    fresh = answer_churn(ref, new)
    rows, flips = compare_answers(
        {("d", q): AnswerRecord("d", q, x.answer, x.correct) for q, x in ref.items()},
        {("d", q): AnswerRecord("d", q, x.answer, x.correct) for q, x in new.items()},
    )
    f = rows[0].flips
    assert (f.F, f.G, f.W, f.n) == (fresh.F, fresh.G, fresh.W, fresh.n)
    assert (fresh.F, fresh.G, fresh.W) == (3, 3, 6)  # 1 correct x 3 wrong each way; 3 wrong x 2 other wrong
    assert len(flips) == fresh.F + fresh.G + fresh.W
