"""A line's history as a score matrix (TRACE, arXiv 2310.06762), from stored answers only.

Release t is the t-th delta of the champion's chain (t = 0: the base). Skill i is the skill
that release i taught, measured with release i's own scorer (rebuilt from the spec stored on
its training run). Then

    R[t][i]  = release t's score on skill i            (i <= t; from the answers stored for it)
    OP_t     = mean over i <= t of R[t][i]             (overall performance)
    BWT_t    = mean over i < t of s_i (R[t][i] - R[i][i])   (backward transfer; s_i = -1 when
               lower is better, so BWT > 0 always means later releases improved earlier skills)

Scores are normalised so skills can be averaged: a solved-problem scorer as the share of its
problems solved, a mean scorer (reference NLL) as its mean. OP over skills with different
scorers therefore mixes units; the matrix itself is the primary view. Nothing is generated
again: a cell the ledger holds no answers for is None ('-').
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean
from typing import Optional


@dataclass(frozen=True)
class LineHistory:
    releases: list[str]  # version names, t = 0 (base) .. T
    parents: list[str]  # the parent of each release ('-' for the base)
    skills: list[str]  # skills[i - 1]: the skill release i taught
    higher_is_better: list[bool]  # per skill
    scores: list[list[Optional[float]]]  # scores[t][i - 1] = R[t][i] for i <= t, else None
    kl_vs_base: list[dict[str, Optional[float]]]  # release t's retained KL vs the base per domain

    def op(self, t: int) -> Optional[float]:
        cells = [v for v in self.scores[t][:t] if v is not None]
        return fmean(cells) if t and len(cells) == t else None

    def bwt(self, t: int) -> Optional[float]:
        diffs = []
        for i in range(1, t):
            now, then = self.scores[t][i - 1], self.scores[i][i - 1]
            if now is None or then is None:
                return None
            diffs.append((now - then) * (1 if self.higher_is_better[i - 1] else -1))
        return fmean(diffs) if diffs else None

    def to_markdown(self) -> str:
        head = ["t", "release", "parent", "taught"] + [f"R[t][{i + 1}] {s}" for i, s in enumerate(self.skills)]
        domains = sorted({d for row in self.kl_vs_base for d in row})
        head += ["OP_t", "BWT_t"] + [f"KL vs base [{d}]" for d in domains]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for t, name in enumerate(self.releases):
            row = [str(t), name, self.parents[t], self.skills[t - 1] if t else "-"]
            row += [_num(v) for v in self.scores[t]] + [_num(self.op(t)), _num(self.bwt(t))]
            row += [_num(self.kl_vs_base[t].get(d)) for d in domains]
            lines.append("| " + " | ".join(row) + " |")
        notes = [f"{s}: {'share of problems solved' if hib else 'mean reference NLL, lower is better'}"
                 for s, hib in zip(self.skills, self.higher_is_better)]
        return "\n".join(lines + ["", "Scores: " + "; ".join(notes) + "."])

    def metrics(self) -> dict[str, float]:
        """The newest release's row as MLflow metrics (R[T][i], OP, BWT, KL vs base)."""
        t = len(self.releases) - 1
        out = {f"line_R_{i + 1}_{self.skills[i]}": v for i, v in enumerate(self.scores[t]) if v is not None}
        out |= {f"line_kl_vs_base_{d}": v for d, v in self.kl_vs_base[t].items() if v is not None}
        for name, value in (("line_OP", self.op(t)), ("line_BWT", self.bwt(t))):
            if value is not None:
                out[name] = value
        return out


def _num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.4g}"


def _normalised(scorer, answers: dict) -> Optional[float]:
    from .evaluate import score_of

    if not answers:
        return None
    score = score_of(scorer, answers)
    return score / len(answers) if scorer.aggregate == "sum" else score


def line_history(ledger, model_id: int, version_id: int) -> LineHistory:
    """The history of the chain ending at `version_id` (usually the champion)."""
    from registry import base_version, get_answers, get_version, latest_evaluation, training_run_config, version_chain

    from .components import make_scorer
    from .skills import SkillSpec

    chain = version_chain(ledger, version_id)
    versions = [base_version(ledger, model_id), *chain]
    # Runs recorded before lines kept no skill spec: their column is shown, with no scores.
    stored = [training_run_config(ledger, v.training_run_id).get("skill") for v in chain]
    scorers = [make_scorer(SkillSpec.from_dict(d)) if d else None for d in stored]
    scores, kl = [], []
    for t, v in enumerate(versions):
        answers = get_answers(ledger, v.id)
        row = []
        for i, scorer in enumerate(scorers, start=1):
            mine = {q: a for (d, q), a in answers.items() if scorer is not None and d == scorer.dataset}
            row.append(_normalised(scorer, mine) if i <= t else None)
        scores.append(row)
        ev = latest_evaluation(ledger, v.id)
        kl.append({k.domain: k.kl_vs_base for k in ev.kl} if ev else {})
    parents = ["-"] + [get_version(ledger, v.parent_id).name for v in chain]
    return LineHistory([v.name for v in versions], parents, [v.skill for v in chain],
                       [s.higher_is_better if s is not None else True for s in scorers], scores, kl)
