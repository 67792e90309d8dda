"""Comparing two versions from what the ledger stored, and the release history of a model.

Churn is recomputed from the per-question answers, so no generation is needed. Going
from version A (the reference) to version B, for questions both answered:
F = correct -> wrong, G = wrong -> correct, W = wrong -> a different wrong answer;
churn = (F + G + W) / n and NFR = F / n.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from registry.db import Ledger, LedgerError
from registry.lines import base_version, get_model, get_version, list_versions
from registry.mlflow_bridge import MANAGED_ALIASES, MlflowBridge
from registry.promotion import alias_holder, list_releases
from registry.queries import evaluation_extra, version_source
from registry.records import AnswerRecord, EvaluationInfo, FlipRates, VersionInfo
from registry.results import get_answers, latest_evaluation
from registry.store import atomic_write_text


@dataclass(frozen=True)
class Flip:
    dataset: str
    question_id: str
    kind: str  # "F" | "G" | "W"
    answer_a: Optional[str]
    answer_b: Optional[str]


@dataclass(frozen=True)
class ChurnRow(FlipRates):
    dataset: str
    flips_f: int
    flips_g: int
    flips_w: int
    n: int
    only_in_a: int  # questions one side never answered are not counted in n
    only_in_b: int


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
            "churn": [{**asdict(c), "churn": c.churn, "nfr": c.nfr} for c in self.churn],
            "flips": [asdict(f) for f in self.flips],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def _tables(self) -> list[tuple[str, list[str], list[list[str]]]]:
        metric_rows = [[m.name, _fmt(m.a), _fmt(m.b), _fmt(m.delta, signed=True)] for m in self.metrics]
        churn_rows = [
            [
                c.dataset,
                str(c.n),
                str(c.flips_f),
                str(c.flips_g),
                str(c.flips_w),
                f"{c.churn:.4f}",
                f"{c.nfr:.4f}",
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
            out += _text_table(header, rows) if rows else ["  (none)"]
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


def _fmt(value: Optional[float], signed: bool = False) -> str:
    """Counts print as integers, rates and KL with four decimals."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:+d}" if signed else str(value)
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def _text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  " + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    return [line(header), "  " + "  ".join("-" * w for w in widths), *map(line, rows)]


def answer_churn(
    a: dict[tuple[str, str], AnswerRecord], b: dict[tuple[str, str], AnswerRecord]
) -> tuple[list[ChurnRow], list[Flip]]:
    """Per-dataset F/G/W (plus an 'all' row) and the flipped questions, going from a to b."""
    from evaluation.churn import flip_kind  # the one F/G/W classifier (evaluation, gates, registry)

    datasets = sorted({d for d, _ in a} | {d for d, _ in b})
    rows: list[ChurnRow] = []
    flips: list[Flip] = []
    for dataset in datasets:
        qa = {q for d, q in a if d == dataset}
        qb = {q for d, q in b if d == dataset}
        counts = {"F": 0, "G": 0, "W": 0}
        for q in sorted(qa & qb):
            old, new = a[(dataset, q)], b[(dataset, q)]
            kind = flip_kind(old.correct, old.answer, new.correct, new.answer)
            if kind is None:
                continue
            counts[kind] += 1
            flips.append(Flip(dataset, q, kind, old.answer, new.answer))
        rows.append(ChurnRow(dataset, counts["F"], counts["G"], counts["W"], len(qa & qb), len(qa - qb), len(qb - qa)))
    if rows:
        rows.append(
            ChurnRow(
                "all",
                *(
                    sum(getattr(r, k) for r in rows)
                    for k in ("flips_f", "flips_g", "flips_w", "n", "only_in_a", "only_in_b")
                ),
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
        metrics["nfr_vs_base"] = base_churn.nfr
        metrics["churn_vs_base"] = base_churn.churn
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


def resolve_version(ledger: Ledger, model: int | str, ref: str) -> VersionInfo:
    """A version of `model` named the way people name it on a command line:
    'base', an alias ('champion', 'candidate'), 'mlflow:<n>', '#<ledger id>' or a version name.
    'champion' while nobody holds it is the base version: the base is what serves then.

    The form of `ref` decides what it is matched against, and names are unique within a
    line, so a reference never matches two versions.
    """
    info = get_model(ledger, model)
    if ref == "base":
        return base_version(ledger, info.id)
    if ref in MANAGED_ALIASES:
        holder = alias_holder(ledger, info.id, ref)
        if holder is None and ref == "champion":  # nobody holds it (never released, or rolled back to the base)
            return base_version(ledger, info.id)
        if holder is None:
            raise LedgerError(f"{info.name}: nobody holds {ref!r}")
        return holder
    versions = list_versions(ledger, info.id)
    if ref.startswith("#"):
        matches = [v for v in versions if f"#{v.id}" == ref]
    elif ref.startswith("mlflow:"):
        matches = [v for v in versions if v.mlflow_version is not None and f"mlflow:{v.mlflow_version}" == ref]
    else:
        matches = [v for v in versions if v.name == ref]
    if not matches:
        known = ", ".join(v.name for v in versions) or "none"
        raise LedgerError(f"{info.name}: version {ref!r} matches 0 versions (known: {known})")
    if len(matches) > 1:  # the unique (line, name) constraint makes this a corrupted ledger
        raise LedgerError(
            f"{info.name}: version {ref!r} matches {len(matches)} versions: {', '.join(f'#{v.id}' for v in matches)}"
        )
    return matches[0]


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
    churn, flips = answer_churn(get_answers(ledger, version_a), get_answers(ledger, version_b))
    return Comparison(
        va.name,
        vb.name,
        [MetricRow(n, ma.get(n), mb.get(n)) for n in names],
        churn,
        flips,
        version_source(ledger, va),
        version_source(ledger, vb),
    )


@dataclass(frozen=True)
class HistoryRow:
    release_id: int
    when: str
    action: str
    alias: str
    version: str
    previous: str
    target: str
    max_kl_vs_base: Optional[float]
    nfr_vs_base: Optional[float]
    flow_run_id: Optional[str]
    reason: str
    source: str = "-"  # trained | submitted ... (registry.queries.version_source)


def release_history(ledger: Ledger, model_id: int, alias: Optional[str] = "champion") -> list[HistoryRow]:
    """Every release of a model (oldest first) with the released version's key metrics."""
    rows = []
    for r in list_releases(ledger, model_id, alias):
        v = get_version(ledger, r.version_id)
        prev = get_version(ledger, r.previous_version_id).name if r.previous_version_id else "-"
        ev = latest_evaluation(ledger, r.version_id)
        churn = ev.churn_total("base") if ev else None
        rows.append(
            HistoryRow(
                r.id,
                r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                r.action,
                r.alias,
                v.name,
                prev,
                f"{ev.target_solved}/{ev.target_total}" if ev else "-",
                ev.max_kl("kl_vs_base") if ev else None,
                churn.nfr if churn else None,
                r.flow_run_id,
                r.reason,
                version_source(ledger, v),
            )
        )
    return rows


def format_history(rows: list[HistoryRow], markdown: bool = False) -> str:
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
            _fmt(r.max_kl_vs_base),
            _fmt(r.nfr_vs_base),
            r.flow_run_id or "-",
            r.reason or "-",
        ]
        for r in rows
    ]
    if not markdown:
        return "\n".join(_text_table(header, cells))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells])
