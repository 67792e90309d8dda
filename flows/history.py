"""A line's history as a score matrix (TRACE, arXiv 2310.06762), from stored answers only.

Release t is the t-th delta of the champion's chain (t = 0: the base). Skill i is the skill
that release i taught, measured with release i's own scorer (rebuilt from the spec stored on
its training run). R[t][i] is release t's raw score on skill i (i <= t), in the scorer's units:

    solved-problem scorer ('sum'):            share of its problems solved, in [0, 1]
    'mean' scorer, lower is better (a loss):  its mean, e.g. reference NLL in nats/token
    'mean' scorer, higher is better:          its mean

One scale for every skill. Averaging raw scores would mix a share solved with an NLL whose
direction is the opposite (a share of 0.156 and an NLL of 1.141 averaged to a meaningless
0.6485). So each score is put on one scale, higher is better, 0 to 1:

    S[t][i] = R[t][i]            solved share, or a higher-is-better mean taken as it is
    S[t][i] = exp(-R[t][i])      a loss: exp(-NLL) is the per-token probability the release
                                 gives the reference answer (geometric mean), in (0, 1]

A value outside [0, 1] after this is off the scale: its cell shows the raw value only and the
row's OP/BWT are undefined. exp(-NLL) was chosen over a reduction relative to the base (or to
the release that taught the skill) because it needs no second measurement (the line's base row
holds no scores), is never clipped (a release worse than the base still counts as worse by how
much), is strictly decreasing in the NLL (so a gain or loss keeps its sign), and has a meaning
of its own. Then

    OP_t  = mean over i <= t of S[t][i]               (overall performance, 0..1)
    BWT_t = mean over i < t of (S[t][i] - S[i][i])    (backward transfer, -1..1; > 0: later
                                                       releases improved earlier skills)

Retention. Retained KL vs the base on a released skill's contexts includes that skill's
intended change, so it is not drift. Each evaluation therefore also stores, per released skill,
KL vs the release that taught it (flows/evaluate.py `teachers`; `extra["kl_vs_teacher"]`); the
table shows it next to KL vs the base. Evaluations stored before that show '-'.

Nothing is generated again: a cell the ledger holds nothing for is None ('-').
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import fmean
from types import MappingProxyType
from typing import Optional

SOLVED, LOSS, MEAN = "solved", "loss", "mean"  # the kinds of skill score (see above)
UNITS = MappingProxyType(
    {
        SOLVED: "share of problems solved",
        LOSS: "mean loss (e.g. reference NLL, nats/token; lower is better)",
        MEAN: "mean score",
    }
)

Row = list[Optional[float]]
Panel = tuple[str, str, dict[str, Row]]  # (title, y label, series label -> a value per release t)


def kind_of(scorer) -> str:
    if scorer.aggregate == "sum":
        return SOLVED
    return MEAN if scorer.higher_is_better else LOSS


def on_scale(kind: str, raw: Optional[float]) -> Optional[float]:
    """A raw skill score on the line's one scale (higher is better, 0 to 1), or None off it."""
    if raw is None:
        return None
    value = math.exp(-raw) if kind == LOSS else raw
    return value if 0.0 <= value <= 1.0 else None


@dataclass(frozen=True)
class LineHistory:
    releases: list[str]  # version names, t = 0 (base) .. T
    parents: list[str]  # the parent of each release ('-' for the base)
    skills: list[str]  # skills[i - 1]: the skill release i taught
    kinds: list[str]  # per skill: SOLVED, LOSS or MEAN
    scores: list[Row]  # scores[t][i - 1] = raw R[t][i] for i <= t, else None
    kl_vs_base: list[dict[str, Optional[float]]]  # release t's retained KL vs the base per member
    kl_vs_teacher: list[dict[str, Optional[float]]]  # release t's KL vs each released skill's teacher

    def scaled(self, t: int) -> Row:
        """S[t][i] for every skill (None where R is missing or off the scale)."""
        return [on_scale(k, v) for k, v in zip(self.kinds, self.scores[t])]

    def op(self, t: int) -> Optional[float]:
        cells = self.scaled(t)[:t]
        return fmean(cells) if t and None not in cells else None

    def bwt(self, t: int) -> Optional[float]:
        now = self.scaled(t)
        diffs = []
        for i in range(1, t):
            then = self.scaled(i)[i - 1]
            if now[i - 1] is None or then is None:
                return None
            diffs.append(now[i - 1] - then)
        return fmean(diffs) if diffs else None

    def kl_columns(self) -> tuple[list[str], list[str]]:
        """(configured domains, released skills) that have KL in some row; a skill's KL vs the base
        includes its intended change, so skills are kept apart from the domains' drift."""
        measured = {d for row in self.kl_vs_base + self.kl_vs_teacher for d in row}
        skills = [s for s in dict.fromkeys(self.skills) if s in measured]
        return sorted(measured - set(skills)), skills

    def to_markdown(self) -> str:
        domains, skills = self.kl_columns()
        head = ["t", "release", "parent", "taught"] + [f"R[t][{i + 1}] {s}" for i, s in enumerate(self.skills)]
        head += ["OP_t", "BWT_t"] + [f"KL vs base [{d}]" for d in domains]
        head += [f"KL vs {ref} [{s}]" for s in skills for ref in ("teacher", "base")]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for t, name in enumerate(self.releases):
            row = [str(t), name, self.parents[t], self.skills[t - 1] if t else "-"]
            row += [_cell(k, v) for k, v in zip(self.kinds, self.scores[t])] + [_num(self.op(t)), _num(self.bwt(t))]
            row += [_num(self.kl_vs_base[t].get(d)) for d in domains]
            row += [_num(kl[t].get(s)) for s in skills for kl in (self.kl_vs_teacher, self.kl_vs_base)]
            lines.append("| " + " | ".join(row) + " |")
        notes = [f"{s}: {UNITS[k]}" for s, k in dict.fromkeys(zip(self.skills, self.kinds))]
        legend = [
            "",
            "Cells: R[t][i] raw; a loss shows its score exp(-loss) in brackets. OP_t and BWT_t are "
            "means of the scores on one scale (higher is better, 0 to 1): a share solved as it is, a loss "
            "as exp(-loss).",
            "KL in nats/token. KL vs teacher [s]: on skill s's contexts against the release that taught s "
            "(retention); KL vs base: against the base, for a skill including its intended change.",
            "",
            "Skills: " + "; ".join(notes) + ".",
        ]
        return "\n".join(lines + legend)

    def panels(self) -> list[Panel]:
        """What history.png draws: one panel per kind of number, never two units on one axis
        (panels with nothing measured are left out; the line's OP/BWT panel always stays)."""
        t_all = range(len(self.releases))

        def skill_series(kind: str) -> dict[str, Row]:
            return {
                f"{i + 1}: {s}": [self.scaled(t)[i] for t in t_all]
                for i, (s, k) in enumerate(zip(self.skills, self.kinds))
                if k == kind
            }

        domains, skills = self.kl_columns()
        line: Panel = (
            "The line (TRACE)",
            "mean of skill scores (0-1 scale)",
            {"OP_t": [self.op(t) for t in t_all], "BWT_t": [self.bwt(t) for t in t_all]},
        )
        out: list[Panel] = [
            ("Solved-problem skills", "share solved (0-1)", skill_series(SOLVED)),
            ("Loss skills (e.g. reference NLL)", "exp(-loss): per-token probability (0-1)", skill_series(LOSS)),
            ("Mean-score skills", "mean score (0-1)", skill_series(MEAN)),
            line,
            ("Drift: retained KL vs the base", "nats/token", {d: [r.get(d) for r in self.kl_vs_base] for d in domains}),
            (
                "Released skills: KL vs teacher and vs base",
                "nats/token",
                {
                    f"{s} vs {ref}": [r.get(s) for r in kl]
                    for s in skills
                    for ref, kl in (("teacher", self.kl_vs_teacher), ("base", self.kl_vs_base))
                },
            ),
        ]
        drawn = lambda series: any(v is not None for row in series.values() for v in row)
        return [p for p in out if p is line or drawn(p[2])]

    def metrics(self) -> dict[str, float]:
        """The newest release's row as MLflow metrics (raw R[T][i], scaled S[T][i], OP, BWT, KL)."""
        t = len(self.releases) - 1
        out = {f"line_R_{i + 1}_{self.skills[i]}": v for i, v in enumerate(self.scores[t]) if v is not None}
        out |= {f"line_S_{i + 1}_{self.skills[i]}": v for i, v in enumerate(self.scaled(t)) if v is not None}
        out |= {f"line_kl_vs_base_{d}": v for d, v in self.kl_vs_base[t].items() if v is not None}
        out |= {f"line_kl_vs_teacher_{s}": v for s, v in self.kl_vs_teacher[t].items() if v is not None}
        for name, value in (("line_OP", self.op(t)), ("line_BWT", self.bwt(t))):
            if value is not None:
                out[name] = value
        return out


def _num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.4g}"


def _cell(kind: str, raw: Optional[float]) -> str:
    scaled = on_scale(kind, raw)
    return _num(raw) if kind != LOSS or scaled is None else f"{raw:.4g} ({scaled:.4g})"


def problem_scores(scorer, answers: dict) -> dict:
    """Stored answers back as the scorer's ProblemScores (a 'mean' scorer's value is in `answer`)."""
    return {q: scorer.restore(a.answer, a.correct) for q, a in answers.items()}


def score_of(scorer, answers: dict) -> float:
    """A scorer's score of stored answers (NaN for none); here, not in flows/evaluate.py, so that
    `atlas history` imports no Prefect."""
    return scorer.summarise(problem_scores(scorer, answers)) if answers else math.nan


def _raw(scorer, answers: dict) -> Optional[float]:
    """R[t][i]: a solved-problem scorer's share solved, a mean scorer's mean."""
    if not answers:
        return None
    score = score_of(scorer, answers)
    return score / len(answers) if scorer.aggregate == "sum" else score


def line_history(ledger, model_id: int, version_id: int) -> LineHistory:
    """The history of the chain ending at `version_id` (usually the champion)."""
    from registry import (
        base_version,
        evaluation_extra,
        get_answers,
        get_version,
        latest_evaluation,
        training_run_config,
        version_chain,
    )

    from .components import make_scorer  # light: no Prefect (`atlas history` must answer at once)

    chain = version_chain(ledger, version_id)
    versions = [base_version(ledger, model_id), *chain]
    # Runs recorded before lines kept no skill spec: their column is shown, with no scores.
    stored = [training_run_config(ledger, v.training_run_id).get("skill") for v in chain]
    scorers = [make_scorer(d["target"]) if d else None for d in stored]
    scores, kl, kl_teacher = [], [], []
    for t, v in enumerate(versions):
        answers = get_answers(ledger, v.id)
        row = []
        for i, scorer in enumerate(scorers, start=1):
            mine = {q: a for (d, q), a in answers.items() if scorer is not None and d == scorer.dataset}
            row.append(_raw(scorer, mine) if i <= t else None)
        scores.append(row)
        ev = latest_evaluation(ledger, v.id)
        kl.append({k.domain: k.kl_vs_base for k in ev.kl} if ev else {})
        kl_teacher.append(dict(evaluation_extra(ledger, ev.id).get("kl_vs_teacher", {})) if ev else {})
    parents = ["-"] + [get_version(ledger, v.parent_id).name for v in chain]
    return LineHistory(
        releases=[v.name for v in versions],
        parents=parents,
        skills=[v.skill for v in chain],
        kinds=[kind_of(s) if s is not None else SOLVED for s in scorers],
        scores=scores,
        kl_vs_base=kl,
        kl_vs_teacher=kl_teacher,
    )
