"""How much a model's answers moved relative to a reference model's answers.

For each question, comparing reference -> new:
  F  correct -> wrong            (harmful flip, "negative flip")
  G  wrong   -> correct
  W  wrong   -> a different wrong answer
churn = (F + G + W) / n and NFR (negative-flip rate) = F / n. Since a question has one
correct answer, churn is exactly the share of questions whose answer changed; the same
function therefore gives CSQA choice churn (answers are the chosen labels A-E).
Two unextractable answers (None, None) count as unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # kept light: registry classifies stored answers with `flip_kind` too
    from evaluation.answers import Answer


def flip_kind(
    ref_correct: bool, ref_answer: Optional[str], new_correct: bool, new_answer: Optional[str]
) -> Optional[str]:
    """'F', 'G' or 'W' for one question going from the reference's answer to the new one; None: unchanged."""
    if ref_correct and not new_correct:
        return "F"
    if not ref_correct and new_correct:
        return "G"
    if not ref_correct and not new_correct and ref_answer != new_answer:
        return "W"
    return None


@dataclass(frozen=True)
class Churn:
    n: int
    F: int
    G: int
    W: int
    churn: float
    nfr: float
    accuracy_ref: float
    accuracy_new: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def _by_id(answers: Mapping[str, Answer] | Iterable[Answer]) -> dict[str, Answer]:
    if isinstance(answers, Mapping):
        return dict(answers)
    out: dict[str, Answer] = {}
    for a in answers:
        if a.id in out:
            raise ValueError(f"answer id {a.id!r} appears twice")
        out[a.id] = a
    return out


def answer_churn(
    reference: Mapping[str, Answer] | Iterable[Answer], new: Mapping[str, Answer] | Iterable[Answer]
) -> Churn:
    """F/G/W, churn and NFR of `new` against `reference`; both must cover the same question ids."""
    ref, cur = _by_id(reference), _by_id(new)
    if ref.keys() != cur.keys():
        only_ref, only_new = sorted(ref.keys() - cur.keys()), sorted(cur.keys() - ref.keys())
        raise ValueError(
            f"answer sets cover different questions: {len(only_ref)} only in the reference "
            f"(e.g. {only_ref[:3]}), {len(only_new)} only in the new set (e.g. {only_new[:3]})"
        )
    n = len(ref)
    if n == 0:
        raise ValueError("answer sets are empty")
    kinds = [flip_kind(r.correct, r.answer, cur[qid].correct, cur[qid].answer) for qid, r in ref.items()]
    F, G, W = (kinds.count(k) for k in "FGW")
    return Churn(
        n=n,
        F=F,
        G=G,
        W=W,
        churn=(F + G + W) / n,
        nfr=F / n,
        accuracy_ref=sum(a.correct for a in ref.values()) / n,
        accuracy_new=sum(a.correct for a in cur.values()) / n,
    )
