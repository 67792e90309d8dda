"""Recording what a version did: evaluations, per-question answers and gate decisions."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

from sqlalchemy import select

from registry.db import Ledger, LedgerError
from registry.models import (
    Answer,
    Evaluation,
    EvaluationChurn,
    EvaluationKL,
    GateCheck,
    GateDecision,
    ModelVersion,
)
from registry.records import (
    AnswerRecord,
    ChurnCounts,
    DomainKL,
    EvaluationInfo,
    EvaluationRecord,
    GateCheckRecord,
    GateDecisionInfo,
    finite_or_none,
)
from registry.rows import json_field, once_more_on_conflict, require_row

CHURN_AGAINST = ("base", "release")


def _check_evaluation(record: EvaluationRecord) -> None:
    if not 0 <= record.target_solved <= record.target_total:
        raise LedgerError(
            f"evaluation of version {record.version_id}: target_solved must be within "
            f"0..target_total, got {record.target_solved}/{record.target_total}"
        )
    for kl in record.kl:
        finite_or_none(kl.kl_vs_base, f"kl_vs_base[{kl.domain}]")
        finite_or_none(kl.kl_vs_release, f"kl_vs_release[{kl.domain}]")
    for c in record.churn:
        if c.against not in CHURN_AGAINST:
            raise LedgerError(f"churn[{c.domain}].against: expected one of {CHURN_AGAINST}, got {c.against!r}")
        if min(c.flips_f, c.flips_g, c.flips_w) < 0 or c.flips_f + c.flips_g + c.flips_w > c.n:
            raise LedgerError(
                f"churn[{c.against}/{c.domain}]: need 0 <= F+G+W <= n, got "
                f"F={c.flips_f} G={c.flips_g} W={c.flips_w} n={c.n}"
            )
    finite_or_none(record.csqa_choice_churn, "csqa_choice_churn")


def record_evaluation(ledger: Ledger, record: EvaluationRecord) -> int:
    """Store an evaluation with its per-domain KL and churn rows; returns its id."""
    _check_evaluation(record)
    with ledger.transaction() as s:
        require_row(s, ModelVersion, record.version_id, "model version")
        if record.release_version_id is not None:
            require_row(s, ModelVersion, record.release_version_id, "release model version")
        row = Evaluation(
            model_version_id=record.version_id,
            release_version_id=record.release_version_id,
            target_solved=int(record.target_solved),
            target_total=int(record.target_total),
            csqa_choice_churn=record.csqa_choice_churn,
            extra=json_field(record.extra, "extra"),
            flow_run_id=record.flow_run_id,
        )
        s.add(row)
        s.flush()
        for kl in record.kl:
            s.add(
                EvaluationKL(
                    evaluation_id=row.id, domain=kl.domain, kl_vs_base=kl.kl_vs_base, kl_vs_release=kl.kl_vs_release
                )
            )
        for c in record.churn:
            s.add(
                EvaluationChurn(
                    evaluation_id=row.id,
                    against=c.against,
                    domain=c.domain,
                    flips_f=c.flips_f,
                    flips_g=c.flips_g,
                    flips_w=c.flips_w,
                    n=c.n,
                )
            )
        return row.id


def latest_evaluation(ledger: Ledger, version_id: int) -> Optional[EvaluationInfo]:
    with ledger.transaction() as s:
        row = s.scalar(
            select(Evaluation).where(Evaluation.model_version_id == version_id).order_by(Evaluation.id.desc()).limit(1)
        )
        if row is None:
            return None
        kl = [
            DomainKL(domain=k.domain, kl_vs_base=k.kl_vs_base, kl_vs_release=k.kl_vs_release)
            for k in s.scalars(
                select(EvaluationKL).where(EvaluationKL.evaluation_id == row.id).order_by(EvaluationKL.domain)
            )
        ]
        churn = [
            ChurnCounts(
                against=c.against, domain=c.domain, flips_f=c.flips_f, flips_g=c.flips_g, flips_w=c.flips_w, n=c.n
            )
            for c in s.scalars(
                select(EvaluationChurn)
                .where(EvaluationChurn.evaluation_id == row.id)
                .order_by(EvaluationChurn.against, EvaluationChurn.domain)
            )
        ]
        return EvaluationInfo(
            id=row.id,
            version_id=row.model_version_id,
            release_version_id=row.release_version_id,
            target_solved=row.target_solved,
            target_total=row.target_total,
            kl=kl,
            churn=churn,
            csqa_choice_churn=row.csqa_choice_churn,
            created_at=row.created_at,
        )


def record_answers(ledger: Ledger, version_id: int, answers: Iterable[AnswerRecord], keep_stored: bool = False) -> int:
    """Store a version's per-question answers (all or nothing); returns how many were stored.

    A question already answered by this version is accepted again only with the same
    answer, so re-running an interrupted evaluation is safe but silent rewrites are not.
    `keep_stored`: a question already answered keeps its stored answer and a different one is
    dropped, not refused (the first of several concurrent writers wins; nothing is rewritten).
    """
    answers = list(answers)
    seen: set[tuple[str, str]] = set()
    for a in answers:
        key = (a.dataset, a.question_id)
        if not a.dataset or not a.question_id:
            raise LedgerError(f"answer {key}: dataset and question_id must be non-empty")
        if key in seen:
            raise LedgerError(f"answer {key}: given twice for version {version_id}")
        if not isinstance(a.correct, bool):
            raise LedgerError(f"answer {key}: correct must be a bool, got {a.correct!r}")
        seen.add(key)

    def store() -> int:
        with ledger.transaction() as s:
            require_row(s, ModelVersion, version_id, "model version")
            stored = {
                (r.dataset, r.question_id): r
                for r in s.scalars(select(Answer).where(Answer.model_version_id == version_id))
            }
            added = 0
            for a in answers:
                old = stored.get((a.dataset, a.question_id))
                if old is not None:
                    if not keep_stored and (old.answer, old.correct) != (a.answer, a.correct):
                        raise LedgerError(
                            f"answer {(a.dataset, a.question_id)} of version {version_id}: already "
                            f"stored as {old.answer!r} (correct={old.correct}), not {a.answer!r} "
                            f"(correct={a.correct})"
                        )
                    continue
                s.add(
                    Answer(
                        model_version_id=version_id,
                        dataset=a.dataset,
                        question_id=a.question_id,
                        answer=a.answer,
                        correct=a.correct,
                    )
                )
                added += 1
            return added

    # Two workers evaluating against the same champion answer its questions at once: the one that
    # commits second reads the other's rows on the retry (same answers, or keep_stored: accepted).
    return once_more_on_conflict(store)


def get_answers(ledger: Ledger, version_id: int) -> dict[tuple[str, str], AnswerRecord]:
    """A version's answers keyed by (dataset, question_id)."""
    with ledger.transaction() as s:
        require_row(s, ModelVersion, version_id, "model version")
        rows = s.scalars(select(Answer).where(Answer.model_version_id == version_id))
        return {
            (r.dataset, r.question_id): AnswerRecord(
                dataset=r.dataset, question_id=r.question_id, answer=r.answer, correct=r.correct
            )
            for r in rows
        }


def record_gate_decision(
    ledger: Ledger,
    version_id: int,
    policy_name: str,
    policy: dict[str, Any],
    checks: list[GateCheckRecord],
    *,
    evaluation_id: Optional[int] = None,
    release_version_id: Optional[int] = None,
    flow_run_id: Optional[str] = None,
) -> GateDecisionInfo:
    """Store a gate verdict: passed only if there is at least one check and every check passed.

    `release_version_id` is the champion the candidate was measured against; a promotion
    based on this decision is refused once another version holds `champion`.
    """
    if not checks:
        raise LedgerError(f"gate decision for version {version_id}: no checks given (fail closed)")
    for c in checks:
        if c.passed and (c.measured is None or not math.isfinite(c.measured)):
            raise LedgerError(
                f"gate check {c.name!r}: passed with measured value {c.measured} "
                "(a missing or non-finite metric must fail)"
            )
    passed = all(c.passed for c in checks)
    with ledger.transaction() as s:
        require_row(s, ModelVersion, version_id, "model version")
        if evaluation_id is not None:
            require_row(s, Evaluation, evaluation_id, "evaluation")
        if release_version_id is not None:
            require_row(s, ModelVersion, release_version_id, "release model version")
        row = GateDecision(
            model_version_id=version_id,
            evaluation_id=evaluation_id,
            release_version_id=release_version_id,
            policy_name=policy_name,
            policy=json_field(policy, "policy"),
            passed=passed,
            flow_run_id=flow_run_id,
        )
        s.add(row)
        s.flush()
        for c in checks:
            finite = c.measured is not None and math.isfinite(c.measured)
            # A non-finite measurement cannot be stored portably; keep it readable in `detail`.
            detail = c.detail if finite or c.measured is None else f"{c.detail} (measured {c.measured})".strip()
            s.add(
                GateCheck(
                    decision_id=row.id,
                    name=c.name,
                    threshold=finite_or_none(c.threshold, c.name),
                    measured=c.measured if finite else None,
                    passed=c.passed,
                    detail=detail,
                )
            )
        return GateDecisionInfo(
            id=row.id,
            version_id=version_id,
            evaluation_id=evaluation_id,
            release_version_id=release_version_id,
            policy_name=policy_name,
            passed=passed,
            checks=list(checks),
            created_at=row.created_at,
        )


def latest_gate_decision(ledger: Ledger, version_id: int) -> Optional[GateDecisionInfo]:
    with ledger.transaction() as s:
        row = s.scalar(
            select(GateDecision)
            .where(GateDecision.model_version_id == version_id)
            .order_by(GateDecision.id.desc())
            .limit(1)
        )
        if row is None:
            return None
        checks = [
            GateCheckRecord(name=c.name, threshold=c.threshold, measured=c.measured, passed=c.passed, detail=c.detail)
            for c in s.scalars(select(GateCheck).where(GateCheck.decision_id == row.id).order_by(GateCheck.id))
        ]
        return GateDecisionInfo(
            id=row.id,
            version_id=row.model_version_id,
            evaluation_id=row.evaluation_id,
            release_version_id=row.release_version_id,
            policy_name=row.policy_name,
            passed=row.passed,
            checks=checks,
            created_at=row.created_at,
        )
