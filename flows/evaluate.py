"""evaluate_candidate: target score, retained KL vs base and vs champion, answers and churn.

Per-question answers are stored per version in the ledger (target pass/fail, GSM8K final
answers, CSQA choices), so a version is generated for once per evaluation subset: later
cycles, reruns after a crash and `atlas compare` reuse them. An evaluation measured against
the same champion with the same settings (`UpdateConfig.eval_key`) is reused as well.
"""
from __future__ import annotations

import math

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from .cycle import Applied, Cycle, apply_version, reference, retained_kl
from .gates import CandidateMetrics, Flips

Answers = dict  # question id -> registry.AnswerRecord


def answer_sets(cycle: Cycle, scorer) -> dict[str, str]:
    """kind -> ledger dataset name of the answers each evaluation needs."""
    r = cycle.config.retained
    sets = {"target": scorer.dataset}
    if "gsm8k" in r.domains:
        sets["gsm8k"] = f"gsm8k@{r.max_new_tokens}tok"
    if "csqa" in r.domains:
        sets["csqa"] = "csqa-choice"
    return sets


def question_ids(cycle: Cycle, kind: str, scorer) -> list[str]:
    from evaluation.data import load_csqa, load_gsm8k

    r = cycle.config.retained
    if kind == "target":
        return scorer.problem_ids()
    rows = load_gsm8k("test") if kind == "gsm8k" else load_csqa("validation")
    return list(rows["id"][: r.gsm8k_questions if kind == "gsm8k" else r.csqa_questions])


def _generate(cycle: Cycle, applied: Applied, kind: str, scorer) -> dict[str, tuple[str | None, bool]]:
    from evaluation.tasks import eval_csqa_choice, eval_gsm8k

    bb, r = cycle.backbone, cycle.config.retained
    with applied.on_model(bb.model):
        if kind == "target":
            return {q: ("pass" if ok else "fail", ok) for q, ok in scorer.score(bb.model, bb.tokenizer).items()}
        if kind == "gsm8k":
            got = eval_gsm8k(bb.model, bb.tokenizer, limit=r.gsm8k_questions, max_new_tokens=r.max_new_tokens,
                             batch_size=r.batch_size).answers
        else:
            got = eval_csqa_choice(bb.model, bb.tokenizer, limit=r.csqa_questions, batch_size=r.batch_size).answers
    return {a.id: (a.answer, bool(a.correct)) for a in got}


@task(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1, task_run_name="answers-{kind}")
def version_answers(cycle: Cycle, applied: Applied, kind: str, dataset: str, ids: list[str], scorer) -> Answers:
    """The version's answers on these questions: stored ones, plus the missing ones generated and stored."""
    from registry import AnswerRecord, get_answers, record_answers

    stored = {q: a for (d, q), a in get_answers(cycle.ledger, applied.version.id).items() if d == dataset}
    if any(q not in stored for q in ids):
        fresh = _generate(cycle, applied, kind, scorer)
        new = [AnswerRecord(dataset, q, *fresh[q]) for q in ids if q not in stored]
        record_answers(cycle.ledger, applied.version.id, new)
        stored |= {a.question_id: a for a in new}
    return {q: stored[q] for q in ids}


def flips(reference: Answers, new: Answers) -> Flips:
    """F/G/W of `new` against `reference` (same question ids); none asked gives n = 0, which the gate rejects."""
    from evaluation.churn import answer_churn

    if not reference:
        return Flips(0, 0, 0, 0)
    c = answer_churn(reference, new)
    return Flips(c.n, c.F, c.G, c.W)


@task(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1)
def kl_against(cycle: Cycle, applied: Applied, ref_applied: Applied) -> dict[str, float]:
    """Retained KL(ref || version) per domain, nats/token."""
    return {d: retained_kl(cycle, applied, reference(cycle, ref_applied, d), d) for d in cycle.config.retained.domains}


def all_answers(cycle: Cycle, applied: Applied, scorer) -> dict[str, Answers]:
    return {kind: version_answers(cycle, applied, kind, dataset, question_ids(cycle, kind, scorer), scorer)
            for kind, dataset in answer_sets(cycle, scorer).items()}


def solved(answers: dict[str, Answers]) -> int:
    return sum(a.correct for a in answers["target"].values())


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def record_candidate(cycle: Cycle, m: CandidateMetrics, champion_id: int) -> int:
    """Store the evaluation (NaN/inf kept readable in `extra`, since the ledger stores only finite
    numbers) and log its numbers to the version's MLflow run at its training step."""
    from registry import ChurnCounts, DomainKL, EvaluationRecord, ensure_mlflow_run, get_version, record_evaluation

    ok = lambda v: v if v is not None and math.isfinite(v) else None  # noqa: E731
    nonfinite = {f"{k}[{d}]": str(v) for k in ("kl_vs_base", "kl_vs_champion")
                 for d, v in getattr(m, k).items() if v is not None and not math.isfinite(v)}
    churn = [ChurnCounts(against, d, f.F, f.G, f.W, f.n) for against, fl in
             (("base", m.flips_vs_base), ("release", m.flips_vs_champion)) for d, f in sorted(fl.items())]
    record = EvaluationRecord(m.version_id, m.target_solved, m.target_total,
                              [DomainKL(d, ok(m.kl_vs_base.get(d)), ok(m.kl_vs_champion.get(d))) for d in m.kl_vs_base],
                              churn, ok(m.csqa_choice_churn), champion_id,
                              {"eval_key": cycle.config.eval_key(), "nonfinite": nonfinite,
                               "champion_solved": m.champion_solved}, cycle.flow_run_id)
    evaluation_id = record_evaluation(cycle.ledger, record)
    numbers = {"target_solved": m.target_solved, "csqa_choice_churn": m.csqa_choice_churn}
    numbers |= {f"{k}_{d}": v for k in ("kl_vs_base", "kl_vs_champion") for d, v in getattr(m, k).items()}
    run_id = ensure_mlflow_run(cycle.ledger, cycle.platform.bridge, get_version(cycle.ledger, m.version_id).training_run_id)
    cycle.platform.bridge.log_metrics(run_id, {k: v for k, v in numbers.items() if ok(v) is not None}, m.step)
    return evaluation_id


def stored_metrics(cycle: Cycle, version, champion_id: int):
    """The candidate's evaluation against this champion with these settings, if one is stored."""
    from registry import latest_evaluation

    from .ledger_ops import evaluation_extra

    ev = latest_evaluation(cycle.ledger, version.id)
    if ev is None or ev.release_version_id != champion_id:
        return None
    extra = evaluation_extra(cycle.ledger, ev.id)
    if extra.get("eval_key") != cycle.config.eval_key():
        return None
    nan = {k: float(v) for k, v in extra.get("nonfinite", {}).items()}
    kl = lambda which, attr: {k.domain: nan.get(f"{which}[{k.domain}]", getattr(k, attr)) for k in ev.kl}  # noqa: E731
    fl = lambda against: {c.domain: Flips(c.n, c.flips_f, c.flips_g, c.flips_w) for c in ev.churn  # noqa: E731
                          if c.against == against}
    return CandidateMetrics(version.id, version.name, version.method, version.seed, version.epoch, version.step,
                            ev.target_solved, ev.target_total, extra.get("champion_solved"),
                            kl("kl_vs_base", "kl_vs_base"), kl("kl_vs_champion", "kl_vs_release"),
                            fl("base"), fl("release"), ev.csqa_choice_churn, ev.id)


@flow(name="evaluate_candidate", validate_parameters=False)
def evaluate_candidate(cycle: Cycle, version_id: int, champion: Applied, base: Applied, scorer) -> CandidateMetrics:
    """All gate metrics of one candidate version against the champion and the base model."""
    from registry import get_version

    version = get_version(cycle.ledger, version_id)
    found = stored_metrics(cycle, version, champion.version.id)
    if found is not None:
        return found
    applied = apply_version(cycle, version)
    mine, champ, base_ans = (all_answers(cycle, a, scorer) for a in (applied, champion, base))
    watched = [k for k in mine if k != "target"]
    choice = flips(champ["csqa"], mine["csqa"]).churn if "csqa" in mine else None
    m = CandidateMetrics(version.id, version.name, version.method, version.seed, version.epoch, version.step,
                         solved(mine), len(mine["target"]), solved(champ),
                         kl_against(cycle, applied, base), kl_against(cycle, applied, champion),
                         {k: flips(base_ans[k], mine[k]) for k in watched},
                         {k: flips(champ[k], mine[k]) for k in watched}, choice)
    m.evaluation_id = record_candidate(cycle, m, champion.version.id)
    return m


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def record_base(cycle: Cycle, base: Applied, scorer) -> None:
    """The base model's own evaluation (KL 0 by definition), once per evaluation settings, so that
    comparisons and history show its target score next to the versions'."""
    from registry import DomainKL, EvaluationRecord, latest_evaluation, record_evaluation

    from .ledger_ops import evaluation_extra

    ev = latest_evaluation(cycle.ledger, base.version.id)
    if ev is not None and evaluation_extra(cycle.ledger, ev.id).get("eval_key") == cycle.config.eval_key():
        return
    answers = all_answers(cycle, base, scorer)
    record_evaluation(cycle.ledger, EvaluationRecord(
        base.version.id, solved(answers), len(answers["target"]), [DomainKL(d, 0.0) for d in cycle.config.retained.domains],
        extra={"eval_key": cycle.config.eval_key()}, flow_run_id=cycle.flow_run_id))
