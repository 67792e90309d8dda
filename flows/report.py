"""The cycle report: markdown with the gate tables, the line's history, the comparison with the
champion and plots.

Written atomically into `<state>/reports/<model>/<time>-<flow run>/` (report.md, gate.json,
tradeoff.png, churn.png, history.png); `<state>/reports/<model>/LATEST` names the newest folder
(`atlas status` reads it: flows/cli_ops.py, latest_report).
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from registry import Flips

from . import kl_tail
from .metrics import CandidateMetrics


def _num(v, digits: int = 4) -> str:
    if v is None:
        return "missing"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def summary_table(candidates: list[CandidateMetrics], outcome, selected_id) -> list[str]:
    domains = sorted({d for c in candidates for d in c.kl_vs_base})
    head = ["candidate", "target"] + [f"KL vs champion [{d}]" for d in domains] + [f"KL vs base [{d}]" for d in domains]
    head += ["verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in candidates:
        verdict = (
            "**selected**" if c.version_id == selected_id else ("pass" if outcome.verdict(c.version_id) else "reject")
        )
        row = [c.name, f"{_num(c.target_solved)}/{c.target_total}"]
        row += [_num(c.kl_vs_champion.get(d)) for d in domains] + [_num(c.kl_vs_base.get(d)) for d in domains]
        lines.append("| " + " | ".join(row + [verdict]) + " |")
    return lines


def check_tables(candidates: list[CandidateMetrics], outcome) -> list[str]:
    lines = []
    for c in candidates:
        decision = outcome.decisions.get(c.version_id)
        lines += [
            "",
            f"#### {c.name} (gate decision {decision}: {'PASS' if outcome.verdict(c.version_id) else 'REJECT'})",
            "",
            "| check | threshold | measured | result | detail |",
            "|---|---:|---:|---|---|",
        ]
        for ch in outcome.checks.get(c.version_id, []):
            lines.append(
                f"| {ch.name} | {_num(ch.threshold)} | {_num(ch.measured)} | "
                f"{'pass' if ch.passed else '**FAIL**'} | {ch.detail.replace('|', '/')} |"
            )
    return lines


def flip_table(candidates: list[CandidateMetrics]) -> list[str]:
    """F/G/W of each candidate per answered domain, vs the champion and the base, beside the
    champion's own noise floor (flows/noise_floor.py)."""
    fgw = lambda f: "-" if f is None else f"{f.F}/{f.G}/{f.W} of {f.n}"
    lines = [
        "| candidate | domain | F/G/W vs champion | F/G/W vs base | champion's noise floor |",
        "|---|---|---|---|---|",
    ]
    for c in candidates:
        for d in sorted(c.flips_vs_champion):
            lines.append(
                f"| {c.name} | {d} | {fgw(c.flips_vs_champion.get(d))} | {fgw(c.flips_vs_base.get(d))} | "
                f"{fgw(c.flips_floor.get(d))} |"
            )
    return lines


def kl_context_tables(candidates: list[CandidateMetrics]) -> list[str]:
    """Per candidate: the tail of each member's per-context KL and the contexts that moved most
    (the rows its MLflow run's kl_top_contexts.json table holds too)."""
    lines = []
    for c in candidates:
        lines += ["", f"#### {c.name}", ""]
        if not c.kl_tail:
            lines.append("Not measured: evaluated by a version that stored only the mean KL.")
            continue
        lines += [
            "| against | member | contexts | p95 | p99 | max | prompt positions | response positions |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {against} | {member} | {t.contexts} | {_num(t.p95)} | {_num(t.p99)} | {_num(t.max)} | "
            f"{_num(t.prompt)} | {_num(t.response)} |"
            for against in kl_tail.AGAINST
            for member, t in sorted(c.kl_tail.get(against, {}).items())
        ]
        lines += ["", "| against | member | rank | context | KL | text |", "|---|---|---:|---:|---:|---|"]
        lines += [
            f"| {r['against']} | {r['member']} | {r['rank']} | {r['context']} | {_num(r['kl'])} | "
            f"{r['text'].replace('|', '/')} |"
            for r in kl_tail.rows(c.kl_top_contexts)
        ]
    return lines


def plots(folder: Path, candidates: list[CandidateMetrics]) -> list[str]:
    """tradeoff.png (target vs mean retained KL to the base) and churn.png (flips vs champion)."""
    from evaluation.compare import Checkpoint
    from evaluation.plots import churn_bars, tradeoff_plot

    made = []
    points = [
        Checkpoint(method=c.method, seed=c.seed, level=float(c.target_solved), kl=c.mean_kl("kl_vs_base"), name=c.name)
        for c in candidates
        if c.target_solved is not None and 0 < c.mean_kl("kl_vs_base") < math.inf
    ]
    if points:
        tradeoff_plot(
            points,
            folder / "tradeoff.png",
            kl_label="mean retained KL vs base (nats/token)",
            level_label="target problems solved",
        )
        made.append("tradeoff.png")
    churn = {}
    for c in candidates:
        total = Flips.total(c.flips_vs_champion.values())
        if total.churn is not None:  # n = 0 (nothing compared) has no rates to draw
            churn[c.name] = {"n": total.n, "F": total.F, "G": total.G, "W": total.W}
    if churn:
        churn_bars(churn, folder / "churn.png", title="Answer churn vs the champion (all watched domains)")
        made.append("churn.png")
    return made


def timing_table(phases: dict[str, float]) -> list[str]:
    """Wall seconds per phase of the cycle, in the order they ran, with their share of the total."""
    total = sum(phases.values())
    rows = [f"| {name} | {sec:.1f} | {sec / total:.0%} |" for name, sec in phases.items()] if total > 0 else []
    return ["| phase | wall s | share |", "|---|---|---|", *rows, f"| **total** | **{total:.1f}** | |"]


def step_table(steps: dict[str, float]) -> list[str]:
    """Wall seconds of the steps inside the stages (evaluation.timing), summed over the cycle."""
    return ["| step | wall s |", "|---|---|", *(f"| {name} | {sec:.1f} |" for name, sec in steps.items())]


def write_report(
    folder: Path,
    header: dict,
    outcome_text: str,
    candidates: list[CandidateMetrics],
    outcome,
    comparison_md: str | None,
    where: list[str],
    history=None,
    phases: dict[str, float] | None = None,
    steps: dict[str, float] | None = None,
) -> Path:
    """`history`: the line's flows.history.LineHistory after the cycle (None: no release yet);
    `phases`: wall seconds per stage until the report (flows.update.run_cycle); `steps`: the steps
    inside them (evaluation.timing)."""
    from registry import atomic_write_text

    folder.mkdir(parents=True, exist_ok=True)
    images = plots(folder, candidates)
    if history is not None:
        from evaluation.plots import line_history_plot

        line_history_plot(history.releases, history.panels(), folder / "history.png")
        images.append("history.png")
    selected_id = outcome.selected.version_id if outcome.selected else None
    lines = [f"# Update cycle: {header['model']}", ""]
    lines += [f"- **{k}**: {v}" for k, v in header.items() if k != "model"]
    lines += ["", "## Outcome", "", outcome_text, "", "## Gate", ""]
    lines += summary_table(candidates, outcome, selected_id) if candidates else ["No new candidates this cycle."]
    lines += check_tables(candidates, outcome)
    if any(c.flips_vs_champion for c in candidates):
        lines += [
            "",
            "## Answer flips and the noise floor",
            "",
            "F = correct -> wrong, G = wrong -> correct, "
            "W = wrong -> another wrong. The floor is the champion against its own answers decoded again in "
            "another batching (half the batch size): flips no update caused.",
            "",
        ] + flip_table(candidates)
    if candidates:
        lines += [
            "",
            "## Retained KL per context",
            "",
            "Beyond each member's mean: the p95, p99 and max of its "
            "per-context KL (nats/token; quantiles by linear interpolation), its mean over prompt positions "
            "(hidden states that saw only the rendered prompt) and over response positions (inside the "
            "reference answer), and the contexts that moved most (index into the member's gate contexts, "
            "with the text's beginning).",
        ]
        lines += kl_context_tables(candidates)
    if history is not None:
        lines += [
            "",
            "## The line",
            "",
            "Score matrix R[t][i] of release t on the skill release i taught, with "
            "TRACE's overall performance OP_t and backward transfer BWT_t over the skills' scores on one "
            "scale (higher is better, 0 to 1), and retained KL vs the base and vs each skill's teacher:",
            "",
            history.to_markdown(),
        ]
    if comparison_md:
        lines += ["", "## Comparison with the champion", "", comparison_md]
    if phases:
        lines += ["", "## Where the time went", ""] + timing_table(phases)
    if steps:
        lines += [
            "",
            "Inside the stages, summed over the cycle (the champion's and the base's answers are "
            "generated once, with the first candidate; answers of a set include its scoring):",
            "",
        ]
        lines += step_table(steps)
    if images:
        lines += ["", "## Plots", ""] + [f"![{name[:-4]}]({name})" for name in images]
    lines += ["", "## Where to look", ""] + [f"- {w}" for w in where]
    gate_json = {str(v): [ch.__dict__ for ch in checks] for v, checks in outcome.checks.items()}
    atomic_write_text(folder / "gate.json", json.dumps(gate_json, indent=2, default=str) + "\n")
    path = atomic_write_text(folder / "report.md", "\n".join(lines) + "\n")
    atomic_write_text(folder.parent / "LATEST", str(folder) + "\n")
    return path


def report_folder(state: Path, model_name: str, flow_run_id: str | None) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return state / "reports" / model_name / f"{stamp}-{(flow_run_id or 'local')[:8]}"
