"""How much answers moved between two models: fresh answer sets (`answer_churn`, what an evaluation
and the gates count) and two versions' stored answers (`compare_versions`, `atlas compare`, with
its report); and the tables of a line's release log.

Going from A (the reference) to B, each question both answered is classified by the one classifier
(registry.flip_kind):
  F  correct -> wrong            (harmful flip, "negative flip")
  G  wrong   -> correct
  W  wrong   -> a different wrong answer
and counted in the one flip record (registry.Flips): churn = (F + G + W) / n and NFR (negative-flip
rate) = F / n, both None when n = 0 (nothing compared: every consumer fails closed, a report shows
'-'). Since a question has one correct answer, churn is exactly the share of questions whose answer
changed; the same function therefore gives CSQA choice churn (answers are the chosen labels A-E).
Two unextractable answers (None, None) count as unchanged. Stored answers need no generation.

Here, above both `evaluation` (which makes answers) and `registry` (which stores them and the
flip record): the registry imports nothing of the project and evaluation only atlas_core, so
counting flips of answers is the first layer that sees both. Light: no Prefect and no torch
(`atlas compare` / `atlas history` answer at once).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from registry import (
    AnswerRecord,
    EvaluationInfo,
    Flips,
    HistoryRow,
    Ledger,
    MlflowBridge,
    VersionInfo,
    atomic_write_text,
    evaluation_extra,
    flip_kind,
    get_answers,
    get_version,
    latest_evaluation,
)
from registry.queries import version_source

if TYPE_CHECKING:
    from evaluation.answers import Answer

Answers = dict[tuple[str, str], AnswerRecord]  # (dataset, question id) -> a version's stored answer


# -- fresh answer sets ------------------------------------------------------------------------


@dataclass(frozen=True)
class Churn(Flips):
    """`answer_churn`'s result: the flip record (its counts and rates) plus each side's accuracy
    (None when n = 0)."""

    accuracy_ref: Optional[float]
    accuracy_new: Optional[float]

    @property
    def flips(self) -> Flips:
        """The flip record alone (what the gates and the ledger keep)."""
        return Flips(n=self.n, F=self.F, G=self.G, W=self.W)

    def as_dict(self) -> dict[str, Optional[float]]:
        """Counts, rates and accuracies (e.g. for evaluation.plots.churn_bars)."""
        return asdict(self) | {"churn": self.churn, "nfr": self.nfr}


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
    """F/G/W, churn and NFR of `new` against `reference`; both must cover the same question ids.
    Answers are evaluation.answers.Answer, or any with `.correct` and `.answer` given as a mapping
    by question id (e.g. registry.AnswerRecord). Two empty sets give n = 0: rates and accuracies None."""
    ref, cur = _by_id(reference), _by_id(new)
    if ref.keys() != cur.keys():
        only_ref, only_new = sorted(ref.keys() - cur.keys()), sorted(cur.keys() - ref.keys())
        raise ValueError(
            f"answer sets cover different questions: {len(only_ref)} only in the reference "
            f"(e.g. {only_ref[:3]}), {len(only_new)} only in the new set (e.g. {only_new[:3]})"
        )
    flips = Flips.tally(flip_kind(r.correct, r.answer, cur[qid].correct, cur[qid].answer) for qid, r in ref.items())
    n = flips.n
    return Churn(
        n=n,
        F=flips.F,
        G=flips.G,
        W=flips.W,
        accuracy_ref=sum(a.correct for a in ref.values()) / n if n else None,
        accuracy_new=sum(a.correct for a in cur.values()) / n if n else None,
    )


# -- two versions' stored answers ---------------------------------------------------------------


@dataclass(frozen=True)
class Flip:
    """One question whose answer moved from A to B."""

    dataset: str
    question_id: str
    kind: str  # "F" | "G" | "W"
    answer_a: Optional[str]
    answer_b: Optional[str]


@dataclass(frozen=True)
class ChurnRow:
    """The flips of one dataset (or "all") from A to B; questions only one side answered are
    not in `flips.n` but counted apart."""

    dataset: str
    flips: Flips
    only_in_a: int
    only_in_b: int

    def to_dict(self) -> dict:
        """The row as the comparison's JSON has it (the ledger's column names, rates None at n = 0)."""
        f = self.flips
        return {
            "dataset": self.dataset,
            "flips_f": f.F,
            "flips_g": f.G,
            "flips_w": f.W,
            "n": f.n,
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
            "churn": f.churn,
            "nfr": f.nfr,
        }


@dataclass(frozen=True)
class MetricRow:
    name: str
    a: Optional[float]
    b: Optional[float]

    @property
    def delta(self) -> Optional[float]:
        return None if self.a is None or self.b is None else self.b - self.a


@dataclass
class Comparison:
    version_a: str
    version_b: str
    metrics: list[MetricRow] = field(default_factory=list)
    churn: list[ChurnRow] = field(default_factory=list)  # one per dataset, then "all"
    flips: list[Flip] = field(default_factory=list)
    source_a: str = "-"  # where each delta came from (registry.queries.version_source)
    source_b: str = "-"

    def to_dict(self) -> dict:
        return {
            "version_a": self.version_a,
            "version_b": self.version_b,
            "source_a": self.source_a,
            "source_b": self.source_b,
            "metrics": [{**asdict(m), "delta": m.delta} for m in self.metrics],
            "churn": [c.to_dict() for c in self.churn],
            "flips": [asdict(f) for f in self.flips],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def _tables(self) -> list[tuple[str, list[str], list[list[str]]]]:
        metric_rows = [[m.name, fmt(m.a), fmt(m.b), fmt(m.delta, signed=True)] for m in self.metrics]
        churn_rows = [
            [
                c.dataset,
                str(c.flips.n),
                str(c.flips.F),
                str(c.flips.G),
                str(c.flips.W),
                fmt(c.flips.churn),
                fmt(c.flips.nfr),
                str(c.only_in_a + c.only_in_b),
            ]
            for c in self.churn
        ]
        flip_rows = [[f.dataset, f.question_id, f.kind, repr(f.answer_a), repr(f.answer_b)] for f in self.flips]
        return [
            ("Metrics", ["metric", "A", "B", "B - A"], metric_rows),
            ("Churn A -> B", ["dataset", "n", "F", "G", "W", "churn", "NFR", "unpaired"], churn_rows),
            ("Flipped questions", ["dataset", "question", "kind", "A answer", "B answer"], flip_rows),
        ]

    def to_markdown(self) -> str:
        out = [f"# {self.version_b} vs {self.version_a}", "", f"A: {self.source_a}; B: {self.source_b}", ""]
        for title, header, rows in self._tables():
            out += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
            out.append("")
        return "\n".join(out)

    def to_table(self) -> str:
        """Fixed-width text for a terminal."""
        out = [f"A = {self.version_a} ({self.source_a})", f"B = {self.version_b} ({self.source_b})", ""]
        for title, header, rows in self._tables():
            out.append(title)
            out += text_table(header, rows) if rows else ["  (none)"]
            out.append("")
        return "\n".join(out)

    def write(self, folder: str | Path, stem: str = "comparison") -> tuple[Path, Path]:
        """Write `<stem>.md` and `<stem>.json` atomically; returns both paths."""
        folder = Path(folder)
        return (
            atomic_write_text(folder / f"{stem}.md", self.to_markdown()),
            atomic_write_text(folder / f"{stem}.json", self.to_json()),
        )

    def log_to_mlflow(self, bridge: MlflowBridge, run_id: str, artifact_dir: str = "comparisons") -> None:
        stem = f"{self.version_b}_vs_{self.version_a}"
        bridge.log_text(run_id, self.to_markdown(), f"{artifact_dir}/{stem}.md")
        bridge.log_text(run_id, self.to_json(), f"{artifact_dir}/{stem}.json")


def fmt(value: Optional[float], signed: bool = False) -> str:
    """Counts print as integers, rates and KL with four decimals, None (not measured) as '-'."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:+d}" if signed else str(value)
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Fixed-width columns, a dashed rule under the header."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  " + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    return [line(header), "  " + "  ".join("-" * w for w in widths), *map(line, rows)]


def compare_answers(a: Answers, b: Answers) -> tuple[list[ChurnRow], list[Flip]]:
    """Per-dataset flips (plus an 'all' row) and the flipped questions, going from a to b, on the
    questions both answered."""
    datasets = sorted({d for d, _ in a} | {d for d, _ in b})
    rows: list[ChurnRow] = []
    flips: list[Flip] = []
    for dataset in datasets:
        qa = {q for d, q in a if d == dataset}
        qb = {q for d, q in b if d == dataset}
        kinds = []
        for q in sorted(qa & qb):
            old, new = a[(dataset, q)], b[(dataset, q)]
            kind = flip_kind(old.correct, old.answer, new.correct, new.answer)
            kinds.append(kind)
            if kind is not None:
                flips.append(Flip(dataset=dataset, question_id=q, kind=kind, answer_a=old.answer, answer_b=new.answer))
        rows.append(ChurnRow(dataset=dataset, flips=Flips.tally(kinds), only_in_a=len(qa - qb), only_in_b=len(qb - qa)))
    if rows:
        rows.append(
            ChurnRow(
                dataset="all",
                flips=Flips.total(r.flips for r in rows),
                only_in_a=sum(r.only_in_a for r in rows),
                only_in_b=sum(r.only_in_b for r in rows),
            )
        )
    return rows, flips


def _evaluation_metrics(
    ev: Optional[EvaluationInfo], extra: dict, skill: Optional[str], version: VersionInfo
) -> dict[str, Optional[float]]:
    """A version's numbers from its latest evaluation. Target numbers are keyed by the skill the
    evaluation's target scorer measured (`target_solved[code]`), so two releases of different
    skills never share a target row; `score[s]` is the scorer's value of skill s (the target's
    and each released skill's no-regression score)."""
    metrics: dict[str, Optional[float]] = {}
    if ev is None:
        return metrics
    key = f"[{skill}]" if skill else ""
    metrics[f"target_solved{key}"] = ev.target_solved
    metrics[f"target_total{key}"] = ev.target_total
    if extra.get("target_score") is not None:
        metrics[f"score{key}"] = extra["target_score"]
    for name, regression in sorted(extra.get("released", {}).items()):
        metrics[f"score[{name}]"] = regression.get("score")
    for kl in ev.kl:
        metrics[f"kl_vs_base[{kl.domain}]"] = 0.0 if version.is_base else kl.kl_vs_base
    base_churn = ev.churn_total("base")
    if base_churn is not None:
        metrics["nfr_vs_base"] = base_churn.flips.nfr
        metrics["churn_vs_base"] = base_churn.flips.churn
    if ev.csqa_choice_churn is not None:
        metrics["csqa_choice_churn"] = ev.csqa_choice_churn
    return metrics


def _paired_scores(ev: Optional[EvaluationInfo], extra: dict, skill: Optional[str], reference_id: int) -> dict:
    """The reference's scores as measured in the same evaluation as `ev` (same subsets, same
    cycle), when `ev` was measured against that reference."""
    if ev is None or ev.release_version_id != reference_id:
        return {}
    paired = {f"score[{name}]": r.get("champion_score") for name, r in extra.get("released", {}).items()}
    if skill and extra.get("champion_score") is not None:
        paired[f"score[{skill}]"] = extra["champion_score"]
    return paired


def compare_versions(ledger: Ledger, version_a: int, version_b: int) -> Comparison:
    """Compare B against A (pass the base version's id as A to compare with the backbone)."""
    va, vb = get_version(ledger, version_a), get_version(ledger, version_b)
    ea, eb = latest_evaluation(ledger, version_a), latest_evaluation(ledger, version_b)
    xa, xb = (evaluation_extra(ledger, e.id) if e else {} for e in (ea, eb))
    # The base teaches nothing: its target is the skill its evaluation recorded; a ledger from
    # before lines recorded none, and then a line had one skill, the other side's.
    sa, sb = va.skill or xa.get("skill"), vb.skill or xb.get("skill")
    sa, sb = sa or sb, sb or sa
    ma, mb = _evaluation_metrics(ea, xa, sa, va), _evaluation_metrics(eb, xb, sb, vb)
    ma.update(_paired_scores(eb, xb, sb, version_a))
    if va.is_base:  # the base's KL to itself is zero by definition, measured or not
        ma.update({k: 0.0 for k in mb if k.startswith("kl_vs_base[")})
    names = list(dict.fromkeys([*ma, *mb]))
    churn, flips = compare_answers(get_answers(ledger, version_a), get_answers(ledger, version_b))
    return Comparison(
        version_a=va.name,
        version_b=vb.name,
        metrics=[MetricRow(name=n, a=ma.get(n), b=mb.get(n)) for n in names],
        churn=churn,
        flips=flips,
        source_a=version_source(ledger, va),
        source_b=version_source(ledger, vb),
    )


def format_history(rows: list[HistoryRow], markdown: bool = False) -> str:
    """registry.release_history's rows as a terminal table or markdown."""
    header = [
        "#",
        "when",
        "action",
        "alias",
        "version",
        "source",
        "previous",
        "target",
        "max KL",
        "NFR",
        "flow run",
        "reason",
    ]
    cells = [
        [
            str(r.release_id),
            r.when,
            r.action,
            r.alias,
            r.version,
            r.source,
            r.previous,
            r.target,
            fmt(r.max_kl_vs_base),
            fmt(r.nfr_vs_base),
            r.flow_run_id or "-",
            r.reason or "-",
        ]
        for r in rows
    ]
    if not markdown:
        return "\n".join(text_table(header, cells))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells])
