"""evaluate_candidate: target score, released skills' scores, retained KL vs base and vs champion,
answers and churn.

A candidate is measured on everything its line must keep: retained KL on every member of
the retained set R (configured domains and released skills), answer churn where a domain
has answers, and each released skill's target score against the champion's (no-regression).

Per-question answers are stored per version in the ledger (target pass/fail, GSM8K final
answers, CSQA choices), so a version is generated for once per evaluation subset: later
cycles, reruns after a crash and `atlas compare` reuse them. An evaluation measured against
the same champion with the same settings (`UpdateConfig.eval_key`) is reused as well.
"""

from __future__ import annotations

import math
from dataclasses import replace

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from . import kl_tail
from .answers import SKILL, Answers, all_answers, flips, released_scorers, scorer_for
from .cycle import Applied, CycleContext
from .history import problem_scores, score_of  # stored answers' scores (light: `atlas history` uses them)
from .metrics import CandidateMetrics, Regression, version_fields
from .policy import ANSWERED
from .resources import Resources, scope
from .retries import transient_only


def regression(scorer, reference: Answers, new: Answers) -> Regression:
    """Paired per-problem drop of a released skill's score (reference minus new, signed so that
    > 0 is worse whether the scorer's higher or lower values are better): its mean and sample sd,
    and for a pass/fail scorer (values 0/1) the exact counts of problems lost and gained."""
    from statistics import fmean, stdev

    from .metrics import regression_kind
    from .policy import PASS_FAIL

    kind = regression_kind(scorer)
    sign = 1.0 if scorer.higher_is_better else -1.0
    ref, got = problem_scores(scorer, reference), problem_scores(scorer, new)
    drops = [sign * (ref[q].value - got[q].value) for q in ref if q in got]
    if not drops:
        return Regression(n=0, champion_score=None, score=None, mean_drop=None, sd_drop=None, kind=kind)
    lost, gained = (sum(d > 0 for d in drops), sum(d < 0 for d in drops)) if kind == PASS_FAIL else (None, None)
    return Regression(
        n=len(drops),
        champion_score=score_of(scorer, reference),
        score=score_of(scorer, new),
        mean_drop=fmean(drops),
        sd_drop=stdev(drops) if len(drops) > 1 else None,
        kind=kind,
        lost=lost,
        gained=gained,
    )


@task(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1, retry_condition_fn=transient_only)
def kl_against(
    ctx: CycleContext, applied: Applied, refs: list[Applied], teachers: dict[str, Applied] | None = None
) -> list[dict]:
    """Retained KL(ref || version) per member of the retained set (evaluation.kl.KLResult: the mean
    in nats/token and each context's), for each reference, then one more dict: KL vs each member's
    own reference in `teachers` (released skill -> the release that taught it) on that member's
    contexts. The version's forward runs once per member for all of them; a teacher that is also
    in `refs` (the champion) is measured once."""
    teachers = teachers or {}
    with scope(ctx.platform) as res:
        per_member = {
            m: res.retained_kl(ctx, applied, [*refs, *([teachers[m]] if m in teachers else [])], m) for m in ctx.members
        }
    by_ref = [{m: values[j] for m, values in per_member.items()} for j in range(len(refs))]
    return [*by_ref, {m: per_member[m][len(refs)] for m in teachers if m in per_member}]


def teachers(res: Resources, ctx: CycleContext) -> dict[str, Applied]:
    """Each released skill's teaching release: the newest version of the champion's chain that
    taught it (the one whose spec `ctx.released` keeps), applied as its own chain."""
    released = {s.name for s in ctx.released}
    newest = {v.skill: v for v in ctx.champion.deltas if v.skill in released}  # later versions overwrite
    return {name: res.resolve_applied(v) for name, v in newest.items()}


def solved(answers: dict[str, Answers]) -> int:
    return sum(a.correct for a in answers["target"].values())


def released_regressions(
    res: Resources, ctx: CycleContext, champ: dict[str, Answers], mine: dict[str, Answers]
) -> dict[str, Regression]:
    scorers = released_scorers(res, ctx)
    return {name: regression(s, champ[SKILL + name], mine[SKILL + name]) for name, s in scorers.items()}


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def record_candidate(ctx: CycleContext, m: CandidateMetrics, kl_vs_teacher: dict[str, float] | None = None) -> int:
    """Store the evaluation (NaN/inf kept readable in `extra`, since the ledger stores only finite
    numbers) and log its numbers to the version's MLflow run at its training step."""
    from registry import record_evaluation

    record = m.to_record(
        release_version_id=ctx.champion.version.id,
        eval_key=eval_key(ctx),
        flow_run_id=ctx.flow_run_id,
        kl_vs_teacher=kl_vs_teacher,
    )
    with scope(ctx.platform) as res:
        evaluation_id = record_evaluation(res.ledger, record)
        log_candidate(res.ledger, res.platform.bridge, m, evaluation_id)
    return evaluation_id


def log_candidate(db, bridge, m: CandidateMetrics, evaluation_id: int) -> None:
    """The evaluation's numbers on the version's MLflow run, at its training step."""
    from registry import ensure_mlflow_run, get_version

    ok = lambda v: v if v is not None and math.isfinite(v) else None
    numbers = {"target_solved": m.target_solved, "csqa_choice_churn": m.csqa_choice_churn}
    numbers |= {f"{k}_{d}": v for k in ("kl_vs_base", "kl_vs_champion") for d, v in getattr(m, k).items()}
    numbers |= {f"released_score_{k}": r.score for k, r in m.released.items()}
    numbers |= {  # e.g. kl_vs_champion_response_gsm8k: the KL on the answer's positions alone
        f"kl_{against}_{kind}_{member}": getattr(t, kind)
        for against, members in m.kl_tail.items()
        for member, t in members.items()
        for kind in kl_tail.POSITION_KINDS
    }
    run_id = ensure_mlflow_run(db, bridge, get_version(db, m.version_id).training_run_id)
    bridge.log_metrics(run_id, {k: v for k, v in numbers.items() if ok(v) is not None}, m.step)
    # The run's versions share one table (MLflow appends); each row names its version and evaluation.
    moved = [{"version": m.name, "evaluation_id": evaluation_id} | row for row in kl_tail.rows(m.kl_top_contexts)]
    bridge.log_table(run_id, moved, "kl_top_contexts.json")  # nothing when no rows


def eval_key(ctx: CycleContext) -> str:
    """Identity of what an evaluation measures: the config's subsets plus the released skills
    (their scorers and contexts); a stored evaluation is reused only if it matches."""
    from .config import digest

    return digest([ctx.config.eval_key(), [s.to_dict() for s in ctx.released]])


def stored_metrics(db, ctx: CycleContext, version) -> CandidateMetrics | None:
    """The candidate's evaluation against this champion with these settings, if one is stored."""
    from registry import evaluation_extra, latest_evaluation

    ev = latest_evaluation(db, version.id)
    if ev is None or ev.release_version_id != ctx.champion.version.id:
        return None
    extra = evaluation_extra(db, ev.id)
    if extra.get("eval_key") != eval_key(ctx):
        return None
    m = CandidateMetrics.from_record(version, ev, extra)  # tails stored by older code: none (a tail limit fails)
    if any(r.kind is None for r in m.released.values()):
        return None  # stored by older code without the exact paired counts: measured again (answers are stored)
    return m


@flow(name="evaluate_candidate", validate_parameters=True)
def evaluate_candidate(ctx: CycleContext, version_id: int) -> CandidateMetrics:
    """All gate metrics of one candidate version against the champion and the base model, recorded."""
    from registry import get_version

    with scope(ctx.platform) as res:
        version = get_version(res.ledger, version_id)
        found = stored_metrics(res.ledger, ctx, version)
        return found if found is not None else measure_candidate(res, ctx, version)


def measure_candidate(res: Resources, ctx: CycleContext, version) -> CandidateMetrics:
    """Answers, retained KL and regressions of a version not yet evaluated, recorded."""
    from .noise_floor import flip_floor

    applied, champion, base = res.resolve_applied(version), ctx.champion, ctx.base
    mine, champ, base_ans = (all_answers(res, ctx, a) for a in (applied, champion, base))
    watched = [k for k in mine if k in ANSWERED]  # domains whose answers have churn / NFR
    choice = flips(champ["csqa"], mine["csqa"]).churn if "csqa" in mine else None
    target = scorer_for(res, ctx, "target")
    kl = kl_against(ctx, applied, [base, champion], teachers(res, ctx))
    vs_base, vs_champion, vs_teacher = ({member: r.mean for member, r in results.items()} for results in kl)
    against = {"vs_base": kl[0], "vs_champion": kl[1]}
    tails, moved = kl_tail.summarise(
        {a: {member: r.per_context for member, r in results.items()} for a, results in against.items()},
        lambda member: res.gate_texts(ctx, member),
        by_kind={
            a: {member: {k: part.mean for k, part in (r.by_kind or {}).items()} for member, r in results.items()}
            for a, results in against.items()
        },
    )
    m = CandidateMetrics(
        **version_fields(version),
        target_solved=solved(mine),
        target_total=len(mine["target"]),
        champion_solved=solved(champ),
        kl_vs_base=vs_base,
        kl_vs_champion=vs_champion,
        flips_vs_base={k: flips(base_ans[k], mine[k]) for k in watched},
        flips_vs_champion={k: flips(champ[k], mine[k]) for k in watched},
        csqa_choice_churn=choice,
        released=released_regressions(res, ctx, champ, mine),
        target_score=score_of(target, mine["target"]),
        champion_score=score_of(target, champ["target"]),
        higher_is_better=target.higher_is_better,
        kl_tail=tails,
        kl_top_contexts=moved,
        flips_floor=flip_floor(res, ctx, champ),
    )
    return replace(m, evaluation_id=record_candidate(ctx, m, vs_teacher))


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def record_base(ctx: CycleContext) -> None:
    """The base model's own evaluation (KL 0 by definition), once per evaluation settings, so that
    comparisons and history show its target score next to the versions'."""

    with scope(ctx.platform) as res:
        _record_base(res, ctx)


def _record_base(res: Resources, ctx: CycleContext) -> None:
    from registry import DomainKL, EvaluationRecord, evaluation_extra, latest_evaluation, record_evaluation

    base = ctx.base
    ev = latest_evaluation(res.ledger, base.version.id)
    if ev is not None and evaluation_extra(res.ledger, ev.id).get("eval_key") == eval_key(ctx):
        return
    answers = all_answers(res, ctx, base)
    score = score_of(scorer_for(res, ctx, "target"), answers["target"])
    record_evaluation(
        res.ledger,
        EvaluationRecord(
            version_id=base.version.id,
            target_solved=solved(answers),
            target_total=len(answers["target"]),
            kl=[DomainKL(domain=d, kl_vs_base=0.0) for d in ctx.members],
            extra={
                "eval_key": eval_key(ctx),
                "skill": ctx.skill.name,
                "target_score": score if math.isfinite(score) else None,
            },
            flow_run_id=ctx.flow_run_id,
        ),
    )
