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
from dataclasses import asdict, replace

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from . import kl_tail
from .cycle import Applied, CycleContext
from .gates import CandidateMetrics, Flips, Regression
from .history import problem_scores, score_of  # stored answers' scores (light: `atlas history` uses them)
from .policy import ANSWERED
from .retries import transient_only

Answers = dict  # question id -> registry.AnswerRecord


SKILL = "skill:"  # answer kinds of released skills: "skill:<name>"


def scorer_for(ctx: CycleContext, kind: str):
    """The target scorer, or a released skill's scorer for kind "skill:<name>"."""
    from .runtime import scorer

    if kind == "target":
        return scorer(ctx.skill)
    return scorer(next(s for s in ctx.released if s.name == kind[len(SKILL) :]))


def released_scorers(ctx: CycleContext) -> dict:
    from .runtime import scorer

    return {s.name: scorer(s) for s in ctx.released}


def answer_sets(ctx: CycleContext) -> dict[str, str]:
    """kind -> ledger dataset name of the answers each evaluation needs."""
    r = ctx.config.retained
    sets = {"target": scorer_for(ctx, "target").dataset}
    sets |= {SKILL + name: s.dataset for name, s in released_scorers(ctx).items()}
    if "gsm8k" in r.domains:
        sets["gsm8k"] = f"gsm8k@{r.max_new_tokens}tok"
    if "csqa" in r.domains:
        sets["csqa"] = "csqa-choice"
    return sets


def question_ids(ctx: CycleContext, kind: str) -> list[str]:
    from evaluation.data import load_csqa, load_gsm8k

    r = ctx.config.retained
    if kind == "target" or kind.startswith(SKILL):
        return scorer_for(ctx, kind).problem_ids()
    rows = load_gsm8k("test") if kind == "gsm8k" else load_csqa("validation")
    return list(rows["id"][: r.gsm8k_questions if kind == "gsm8k" else r.csqa_questions])


def _generate(
    ctx: CycleContext, applied: Applied, kind: str, batch_size: int | None = None
) -> dict[str, tuple[str | None, bool]]:
    """A version's answers; `batch_size` (GSM8K, CSQA) replaces the config's batching (the noise floor)."""
    from evaluation.tasks import eval_gsm8k
    from evaluation.timing import phase

    from .runtime import applied_on, backbone, csqa_answers

    if kind == "csqa":  # its shared prefix states are built before the version is attached
        return {a.id: (a.answer, bool(a.correct)) for a in csqa_answers(ctx, applied, batch_size)}
    tokenizer, r = backbone(ctx.backbone).tokenizer, ctx.config.retained
    with applied_on(ctx, applied) as model, phase(f"answers {kind}"):
        if kind == "target" or kind.startswith(SKILL):
            scored = scorer_for(ctx, kind).score(model, tokenizer)
            return {q: (ps.answer, ps.correct) for q, ps in scored.items()}
        got = eval_gsm8k(
            model,
            tokenizer,
            limit=r.gsm8k_questions,
            max_new_tokens=r.max_new_tokens,
            batch_size=batch_size or r.generation_batch_size,
        ).answers
    return {a.id: (a.answer, bool(a.correct)) for a in got}


@task(
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=1,
    retry_condition_fn=transient_only,
    task_run_name="answers-{kind}",
)
def version_answers(
    ctx: CycleContext, applied: Applied, kind: str, dataset: str, ids: list[str], batch_size: int | None = None
) -> Answers:
    """The version's answers on these questions: stored ones, plus the missing ones generated and stored."""
    from registry import AnswerRecord, get_answers, record_answers

    from .runtime import ledger

    stored = {q: a for (d, q), a in get_answers(ledger(), applied.version.id).items() if d == dataset}
    if any(q not in stored for q in ids):
        fresh = _generate(ctx, applied, kind, batch_size)
        new = [AnswerRecord(dataset, q, *fresh[q]) for q in ids if q not in stored]
        record_answers(ledger(), applied.version.id, new)
        stored |= {a.question_id: a for a in new}
    return {q: stored[q] for q in ids}


def regression(scorer, reference: Answers, new: Answers) -> Regression:
    """Paired per-problem drop of a released skill's score (reference minus new, signed so that
    > 0 is worse whether the scorer's higher or lower values are better): its mean and sample sd,
    and for a pass/fail scorer (values 0/1) the exact counts of problems lost and gained."""
    from statistics import fmean, stdev

    from .gates import PASS_FAIL, regression_kind

    kind = regression_kind(scorer)
    sign = 1.0 if scorer.higher_is_better else -1.0
    ref, got = problem_scores(scorer, reference), problem_scores(scorer, new)
    drops = [sign * (ref[q].value - got[q].value) for q in ref if q in got]
    if not drops:
        return Regression(0, None, None, None, None, kind)
    counts = (sum(d > 0 for d in drops), sum(d < 0 for d in drops)) if kind == PASS_FAIL else (None, None)
    return Regression(
        len(drops),
        score_of(scorer, reference),
        score_of(scorer, new),
        fmean(drops),
        stdev(drops) if len(drops) > 1 else None,
        kind,
        *counts,
    )


def flips(reference: Answers, new: Answers) -> Flips:
    """F/G/W of `new` against `reference` (same question ids); none asked gives n = 0, which the gate rejects."""
    from evaluation.churn import answer_churn

    if not reference:
        return Flips(0, 0, 0, 0)
    c = answer_churn(reference, new)
    return Flips(c.n, c.F, c.G, c.W)


@task(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1, retry_condition_fn=transient_only)
def kl_against(
    ctx: CycleContext, applied: Applied, refs: list[Applied], teachers: dict[str, Applied] | None = None
) -> list[dict]:
    """Retained KL(ref || version) per member of the retained set (evaluation.kl.KLResult: the mean
    in nats/token and each context's), for each reference, then one more dict: KL vs each member's
    own reference in `teachers` (released skill -> the release that taught it) on that member's
    contexts. The version's forward runs once per member for all of them; a teacher that is also
    in `refs` (the champion) is measured once."""
    from .runtime import retained_kl

    teachers = teachers or {}
    per_member = {
        m: retained_kl(ctx, applied, [*refs, *([teachers[m]] if m in teachers else [])], m) for m in ctx.members
    }
    by_ref = [{m: values[j] for m, values in per_member.items()} for j in range(len(refs))]
    return [*by_ref, {m: per_member[m][len(refs)] for m in teachers if m in per_member}]


def teachers(ctx: CycleContext) -> dict[str, Applied]:
    """Each released skill's teaching release: the newest version of the champion's chain that
    taught it (the one whose spec `ctx.released` keeps), applied as its own chain."""
    from .runtime import resolve_applied

    released = {s.name for s in ctx.released}
    newest = {v.skill: v for v in ctx.champion.deltas if v.skill in released}  # later versions overwrite
    return {name: resolve_applied(v) for name, v in newest.items()}


def all_answers(ctx: CycleContext, applied: Applied) -> dict[str, Answers]:
    return {
        kind: version_answers(ctx, applied, kind, dataset, question_ids(ctx, kind))
        for kind, dataset in answer_sets(ctx).items()
    }


def solved(answers: dict[str, Answers]) -> int:
    return sum(a.correct for a in answers["target"].values())


def released_regressions(
    ctx: CycleContext, champ: dict[str, Answers], mine: dict[str, Answers]
) -> dict[str, Regression]:
    return {name: regression(s, champ[SKILL + name], mine[SKILL + name]) for name, s in released_scorers(ctx).items()}


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def record_candidate(ctx: CycleContext, m: CandidateMetrics, kl_vs_teacher: dict[str, float] | None = None) -> int:
    """Store the evaluation (NaN/inf kept readable in `extra`, since the ledger stores only finite
    numbers) and log its numbers to the version's MLflow run at its training step."""
    from registry import ChurnCounts, DomainKL, EvaluationRecord, ensure_mlflow_run, get_version, record_evaluation

    from .runtime import ledger, platform

    ok = lambda v: v if v is not None and math.isfinite(v) else None
    nonfinite = {
        f"{k}[{d}]": str(v)
        for k in ("kl_vs_base", "kl_vs_champion")
        for d, v in getattr(m, k).items()
        if v is not None and not math.isfinite(v)
    }
    churn = [
        ChurnCounts(against, d, f.F, f.G, f.W, f.n)
        for against, fl in (("base", m.flips_vs_base), ("release", m.flips_vs_champion))
        for d, f in sorted(fl.items())
    ]
    record = EvaluationRecord(
        m.version_id,
        m.target_solved,
        m.target_total,
        [DomainKL(d, ok(m.kl_vs_base.get(d)), ok(m.kl_vs_champion.get(d))) for d in m.kl_vs_base],
        churn,
        ok(m.csqa_choice_churn),
        ctx.champion.version.id,
        {
            "eval_key": eval_key(ctx),
            "nonfinite": nonfinite,
            "champion_solved": m.champion_solved,
            "released": {k: asdict(r) for k, r in m.released.items()},
            "target_score": ok(m.target_score),
            "champion_score": ok(m.champion_score),
            "higher_is_better": m.higher_is_better,
            "kl_vs_teacher": {k: ok(v) for k, v in (kl_vs_teacher or {}).items()},
            "flips_floor": {d: asdict(f) for d, f in m.flips_floor.items()},
        }
        | kl_tail.to_extra(m.kl_tail, m.kl_top_contexts),
        ctx.flow_run_id,
    )
    evaluation_id = record_evaluation(ledger(), record)
    numbers = {"target_solved": m.target_solved, "csqa_choice_churn": m.csqa_choice_churn}
    numbers |= {f"{k}_{d}": v for k in ("kl_vs_base", "kl_vs_champion") for d, v in getattr(m, k).items()}
    numbers |= {f"released_score_{k}": r.score for k, r in m.released.items()}
    bridge = platform().bridge
    run_id = ensure_mlflow_run(ledger(), bridge, get_version(ledger(), m.version_id).training_run_id)
    bridge.log_metrics(run_id, {k: v for k, v in numbers.items() if ok(v) is not None}, m.step)
    # The run's versions share one table (MLflow appends); each row names its version and evaluation.
    moved = [{"version": m.name, "evaluation_id": evaluation_id} | row for row in kl_tail.rows(m.kl_top_contexts)]
    bridge.log_table(run_id, moved, "kl_top_contexts.json")  # nothing when no rows
    return evaluation_id


def eval_key(ctx: CycleContext) -> str:
    """Identity of what an evaluation measures: the config's subsets plus the released skills
    (their scorers and contexts); a stored evaluation is reused only if it matches."""
    from .config import digest

    return digest([ctx.config.eval_key(), [s.to_dict() for s in ctx.released]])


def stored_metrics(ctx: CycleContext, version) -> CandidateMetrics | None:
    """The candidate's evaluation against this champion with these settings, if one is stored."""
    from registry import evaluation_extra, latest_evaluation

    from .runtime import ledger

    ev = latest_evaluation(ledger(), version.id)
    if ev is None or ev.release_version_id != ctx.champion.version.id:
        return None
    extra = evaluation_extra(ledger(), ev.id)
    if extra.get("eval_key") != eval_key(ctx):
        return None
    nan = {k: float(v) for k, v in extra.get("nonfinite", {}).items()}
    kl = lambda which, attr: {k.domain: nan.get(f"{which}[{k.domain}]", getattr(k, attr)) for k in ev.kl}
    fl = lambda against: {
        c.domain: Flips(c.n, c.flips_f, c.flips_g, c.flips_w) for c in ev.churn if c.against == against
    }
    released = {k: Regression(**r) for k, r in extra.get("released", {}).items()}
    if any(r.kind is None for r in released.values()):
        return None  # stored by older code without the exact paired counts: measured again (answers are stored)
    tails, moved = kl_tail.from_extra(extra)  # empty when stored by older code: a tail limit fails closed
    return CandidateMetrics(
        version.id,
        version.name,
        version.method,
        version.seed,
        version.epoch,
        version.step,
        ev.target_solved,
        ev.target_total,
        extra.get("champion_solved"),
        kl("kl_vs_base", "kl_vs_base"),
        kl("kl_vs_champion", "kl_vs_release"),
        fl("base"),
        fl("release"),
        ev.csqa_choice_churn,
        released,
        ev.id,
        extra.get("target_score"),
        extra.get("champion_score"),
        extra.get("higher_is_better", True),
        kl_tail=tails,
        kl_top_contexts=moved,
        flips_floor={d: Flips(**f) for d, f in extra.get("flips_floor", {}).items()},
    )


@flow(name="evaluate_candidate", validate_parameters=True)
def evaluate_candidate(ctx: CycleContext, version_id: int) -> CandidateMetrics:
    """All gate metrics of one candidate version against the champion and the base model, recorded."""
    from registry import get_version

    from .noise_floor import flip_floor
    from .runtime import gate_texts, ledger, resolve_applied

    version = get_version(ledger(), version_id)
    found = stored_metrics(ctx, version)
    if found is not None:
        return found
    applied, champion, base = resolve_applied(version), ctx.champion, ctx.base
    mine, champ, base_ans = (all_answers(ctx, a) for a in (applied, champion, base))
    watched = [k for k in mine if k in ANSWERED]  # domains whose answers have churn / NFR
    choice = flips(champ["csqa"], mine["csqa"]).churn if "csqa" in mine else None
    target = scorer_for(ctx, "target")
    kl = kl_against(ctx, applied, [base, champion], teachers(ctx))
    vs_base, vs_champion, vs_teacher = ({member: r.mean for member, r in results.items()} for results in kl)
    tails, moved = kl_tail.summarise(
        {
            "vs_base": {member: r.per_context for member, r in kl[0].items()},
            "vs_champion": {member: r.per_context for member, r in kl[1].items()},
        },
        lambda member: gate_texts(ctx, member),
    )
    m = CandidateMetrics(
        version.id,
        version.name,
        version.method,
        version.seed,
        version.epoch,
        version.step,
        solved(mine),
        len(mine["target"]),
        solved(champ),
        vs_base,
        vs_champion,
        {k: flips(base_ans[k], mine[k]) for k in watched},
        {k: flips(champ[k], mine[k]) for k in watched},
        choice,
        released_regressions(ctx, champ, mine),
        target_score=score_of(target, mine["target"]),
        champion_score=score_of(target, champ["target"]),
        higher_is_better=target.higher_is_better,
        kl_tail=tails,
        kl_top_contexts=moved,
        flips_floor=flip_floor(ctx, champ),
    )
    return replace(m, evaluation_id=record_candidate(ctx, m, vs_teacher))


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, retry_condition_fn=transient_only)
def record_base(ctx: CycleContext) -> None:
    """The base model's own evaluation (KL 0 by definition), once per evaluation settings, so that
    comparisons and history show its target score next to the versions'."""
    from registry import DomainKL, EvaluationRecord, evaluation_extra, latest_evaluation, record_evaluation

    from .runtime import ledger

    base = ctx.base
    ev = latest_evaluation(ledger(), base.version.id)
    if ev is not None and evaluation_extra(ledger(), ev.id).get("eval_key") == eval_key(ctx):
        return
    answers = all_answers(ctx, base)
    score = score_of(scorer_for(ctx, "target"), answers["target"])
    record_evaluation(
        ledger(),
        EvaluationRecord(
            base.version.id,
            solved(answers),
            len(answers["target"]),
            [DomainKL(d, 0.0) for d in ctx.members],
            extra={
                "eval_key": eval_key(ctx),
                "skill": ctx.skill.name,
                "target_score": score if math.isfinite(score) else None,
            },
            flow_run_id=ctx.flow_run_id,
        ),
    )
