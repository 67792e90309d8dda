"""A version's answers on what the gate watches: stored per version in the ledger, generated once.

Kinds of answers: "target" (the skill taught now), "skill:<name>" (each released skill, by its own
scorer), "gsm8k" and "csqa" (retained domains that have answers). Each kind is stored under a ledger
dataset name (`answer_sets`), so a version is generated for once per evaluation subset: later
cycles, reruns after a crash, the noise floor and `atlas compare` read them back.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from registry import Flips

from .cycle import Applied, CycleContext
from .resources import Resources, scope
from .retries import transient_only

Answers = dict  # question id -> registry.AnswerRecord


SKILL = "skill:"  # answer kinds of released skills: "skill:<name>"


def scorer_for(res: Resources, ctx: CycleContext, kind: str):
    """The target scorer, or a released skill's scorer for kind "skill:<name>"."""
    if kind == "target":
        return res.scorer(ctx.skill)
    return res.scorer(next(s for s in ctx.released if s.name == kind[len(SKILL) :]))


def released_scorers(res: Resources, ctx: CycleContext) -> dict:
    return {s.name: res.scorer(s) for s in ctx.released}


def answer_sets(res: Resources, ctx: CycleContext) -> dict[str, str]:
    """kind -> ledger dataset name of the answers each evaluation needs."""
    r = ctx.config.retained
    sets = {"target": scorer_for(res, ctx, "target").dataset}
    sets |= {SKILL + name: s.dataset for name, s in released_scorers(res, ctx).items()}
    if "gsm8k" in r.domains:
        sets["gsm8k"] = f"gsm8k@{r.max_new_tokens}tok"
    if "csqa" in r.domains:
        sets["csqa"] = "csqa-choice"
    return sets


def question_ids(res: Resources, ctx: CycleContext, kind: str) -> list[str]:
    from evaluation.data import load_csqa, load_gsm8k

    r = ctx.config.retained
    if kind == "target" or kind.startswith(SKILL):
        return scorer_for(res, ctx, kind).problem_ids()
    rows = load_gsm8k("test") if kind == "gsm8k" else load_csqa("validation")
    return list(rows["id"][: r.gsm8k_questions if kind == "gsm8k" else r.csqa_questions])


def _generate(
    res: Resources, ctx: CycleContext, applied: Applied, kind: str, batch_size: int | None = None
) -> dict[str, tuple[str | None, bool]]:
    """A version's answers; `batch_size` (GSM8K, CSQA) replaces the config's batching (the noise floor)."""
    from evaluation.tasks import eval_gsm8k
    from evaluation.timing import phase

    if kind == "csqa":  # its shared prefix states are built before the version is attached
        return {a.id: (a.answer, bool(a.correct)) for a in res.csqa_answers(ctx, applied, batch_size)}
    tokenizer, r = res.backbone(ctx.backbone).tokenizer, ctx.config.retained
    with res.applied_on(ctx, applied) as model, phase(f"answers {kind}"):
        if kind == "target" or kind.startswith(SKILL):
            scored = scorer_for(res, ctx, kind).score(model, tokenizer)
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

    with scope(ctx.platform) as res:

        def read() -> dict:
            return {q: a for (d, q), a in get_answers(res.ledger, applied.version.id).items() if d == dataset}

        stored = read()
        if any(q not in stored for q in ids):
            fresh = _generate(res, ctx, applied, kind, batch_size)
            new = [
                AnswerRecord(dataset=dataset, question_id=q, answer=fresh[q][0], correct=fresh[q][1])
                for q in ids
                if q not in stored
            ]
            # Workers evaluating candidates at once decode the same champion: where another stored its
            # answers first (other hardware may break near-ties differently), every candidate uses those.
            record_answers(res.ledger, applied.version.id, new, keep_stored=True)
            stored = read()
        return {q: stored[q] for q in ids}


def all_answers(res: Resources, ctx: CycleContext, applied: Applied) -> dict[str, Answers]:
    return {
        kind: version_answers(ctx, applied, kind, dataset, question_ids(res, ctx, kind))
        for kind, dataset in answer_sets(res, ctx).items()
    }


def flips(reference: Answers, new: Answers) -> Flips:
    """F/G/W of `new` against `reference` (same question ids); none asked gives n = 0, which the gate rejects."""
    from .compare import answer_churn

    return answer_churn(reference, new).flips
