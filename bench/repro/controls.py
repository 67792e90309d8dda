"""The control table of issue 32: where the reproduction's KL gap comes from, from stored units only.

    .venv/bin/python -m bench.repro.controls --docs docs/RESULTS.md

Each row compares two runs, each named `<experiment>/<method>` (results/repro/<experiment>/), at
held-out NLL levels both reach (evaluation.compare.shared_levels, `nll_levels` evenly spaced), over
the seeds both have finished. At each level and seed a run is represented by its checkpoint of
least retained KL among those reaching the level (as the main comparison); the row gives the
geometric-mean ratio of their KL over all positions, and of the same two checkpoints' KL on prompt
positions and on answer positions (the split stored when scored, or added by bench.repro.kl_split), over the seeds whose
checkpoints are split on both sides (named in the cell when fewer than the row's). Where a row has
more than one seed, each seed's own ratio follows (its levels those that seed's two runs share), so a
reader sees whether one seed carries the mean.
The controls differ from the main experiment in one setting each (configs/repro/controls-*.yaml).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from atlas_core.paths import PROJECT_ROOT
from evaluation.compare import Checkpoint, shared_levels

from .report import update_docs
from .store import ResultStore

KINDS = ("prompt", "response")


@dataclass(frozen=True)
class Control:
    question: str  # what the ratio attributes
    first: str  # <experiment>/<method>
    second: str
    paper: float | None = None  # the paper's ratio for the same pair (Qwen3-8B), if it reports one


MAIN = "smollm2-l15"
MEAN, RESPONSE, CSQA = "smollm2-l15-mean", "smollm2-l15-response-atlas", "smollm2-l15-csqa-atlas"
COMMON, OWN, ANSWER = "smollm2-l15-common-mode", "smollm2-l15-own-objective", "smollm2-l15-answer-only"
SINK, SINK_ANSWER = "smollm2-l15-after-first-atlas", "smollm2-l15-after-first-answer-only"
RES, RES_OWN = "smollm2-l15-resolution", "smollm2-l15-resolution-own-objective"
# The paper's ratios (spec section 7, Qwen3-8B): centering -38.4% vs plain; full ATLAS -4.6% vs centering, -13.0%
# vs Weight-LoRA.
PAPER_CENTERING, PAPER_ATLAS_VS_CENTERED, PAPER_ATLAS_VS_LORA = 1 - 0.384, 1 - 0.046, 1 - 0.130
CONTROLS = [
    # The paper's structural claims (38.4% centering, 4.6% and 13.0% full ATLAS), on the main experiment.
    Control("centering", f"{MAIN}/centered", f"{MAIN}/plain", PAPER_CENTERING),
    Control("full ATLAS vs centering", f"{MAIN}/atlas", f"{MAIN}/centered", PAPER_ATLAS_VS_CENTERED),
    Control("full ATLAS vs Weight-LoRA", f"{MAIN}/atlas", f"{MAIN}/weight-lora", PAPER_ATLAS_VS_LORA),
    Control("Weight-LoRA vs Plain (uncentered)", f"{MAIN}/weight-lora", f"{MAIN}/plain"),
    # Common mode: one chart, so Centered is centered on the calibration mean.
    Control("common mode: centered on the global mean vs Plain", f"{MEAN}/centered", f"{MAIN}/plain"),
    Control("local centering: 32 chart means vs the global mean", f"{MAIN}/centered", f"{MEAN}/centered"),
    Control("local geometry: 32 charts vs one (full ATLAS)", f"{MAIN}/atlas", f"{MEAN}/atlas"),
    Control("one-chart ATLAS vs Weight-LoRA", f"{MEAN}/atlas", f"{MAIN}/weight-lora"),
    Control(
        "common mode, weight adapter: LoRA on x - mu vs Weight-LoRA", f"{COMMON}/centered-lora", f"{MAIN}/weight-lora"
    ),
    Control("full ATLAS vs O-LoRA", f"{MAIN}/atlas", f"{MAIN}/o-lora"),
    Control("common mode, O-LoRA: centered vs uncentered covariance", f"{COMMON}/o-lora-centered", f"{MAIN}/o-lora"),
    Control("full ATLAS vs LoRA on x - mu", f"{MAIN}/atlas", f"{COMMON}/centered-lora"),
    Control("full ATLAS vs O-LoRA on the centered covariance", f"{MAIN}/atlas", f"{COMMON}/o-lora-centered"),
    # The shared prompt: an atlas without prompt positions.
    Control("prompt states in the atlas: answer-only vs all (ATLAS)", f"{RESPONSE}/atlas", f"{MAIN}/atlas"),
    Control("prompt states in the atlas: answer-only vs all (Centered)", f"{RESPONSE}/centered", f"{MAIN}/centered"),
    Control(
        "atlas without prompt states: full ATLAS vs Weight-LoRA",
        f"{RESPONSE}/atlas",
        f"{MAIN}/weight-lora",
        PAPER_ATLAS_VS_LORA,
    ),
    Control(
        "atlas without prompt states: full ATLAS vs centering",
        f"{RESPONSE}/atlas",
        f"{RESPONSE}/centered",
        PAPER_ATLAS_VS_CENTERED,
    ),
    Control("atlas without prompt states: centering", f"{RESPONSE}/centered", f"{MAIN}/plain", PAPER_CENTERING),
    # The attention sink: the main atlas without position 0's state (the same in every context, norm ~150x the median).
    Control("sink state in the atlas: all but position 0 vs all (ATLAS)", f"{SINK}/atlas", f"{MAIN}/atlas"),
    Control("sink state in the atlas: all but position 0 vs all (Centered)", f"{SINK}/centered", f"{MAIN}/centered"),
    Control(
        "atlas without the sink state: full ATLAS vs Weight-LoRA",
        f"{SINK}/atlas",
        f"{MAIN}/weight-lora",
        PAPER_ATLAS_VS_LORA,
    ),
    Control(
        "atlas without the sink state: full ATLAS vs centering",
        f"{SINK}/atlas",
        f"{SINK}/centered",
        PAPER_ATLAS_VS_CENTERED,
    ),
    Control("atlas without the sink state: centering", f"{SINK}/centered", f"{MAIN}/plain", PAPER_CENTERING),
    # The retained domain: an atlas of another domain.
    Control("retained domain: CSQA atlas vs GSM8K atlas (ATLAS)", f"{CSQA}/atlas", f"{MAIN}/atlas"),
    Control("retained domain: CSQA atlas vs GSM8K atlas (Centered)", f"{CSQA}/centered", f"{MAIN}/centered"),
    Control("CSQA atlas: full ATLAS vs Weight-LoRA", f"{CSQA}/atlas", f"{MAIN}/weight-lora", PAPER_ATLAS_VS_LORA),
    Control("CSQA atlas: full ATLAS vs centering", f"{CSQA}/atlas", f"{CSQA}/centered", PAPER_ATLAS_VS_CENTERED),
    Control("CSQA atlas: centering", f"{CSQA}/centered", f"{MAIN}/plain", PAPER_CENTERING),
    # Every update masked on the prompt positions (applied after the assistant header only).
    Control(
        "answer-only update: full ATLAS vs Weight-LoRA", f"{ANSWER}/atlas", f"{ANSWER}/weight-lora", PAPER_ATLAS_VS_LORA
    ),
    Control("answer-only update: centering", f"{ANSWER}/centered", f"{ANSWER}/plain", PAPER_CENTERING),
    Control(
        "answer-only update: full ATLAS vs centering", f"{ANSWER}/atlas", f"{ANSWER}/centered", PAPER_ATLAS_VS_CENTERED
    ),
    Control("answer-only vs everywhere (ATLAS)", f"{ANSWER}/atlas", f"{MAIN}/atlas"),
    Control("answer-only vs everywhere (Weight-LoRA)", f"{ANSWER}/weight-lora", f"{MAIN}/weight-lora"),
    Control("answer-only vs everywhere (Centered)", f"{ANSWER}/centered", f"{MAIN}/centered"),
    Control("answer-only vs everywhere (Plain)", f"{ANSWER}/plain", f"{MAIN}/plain"),
    # Both: the atlas without the sink state, the update masked on the prompt (where that atlas's residual is large).
    Control(
        "sink-less atlas, answer-only update: full ATLAS vs Weight-LoRA",
        f"{SINK_ANSWER}/atlas",
        f"{ANSWER}/weight-lora",
        PAPER_ATLAS_VS_LORA,
    ),
    Control(
        "sink-less atlas, answer-only update: centering", f"{SINK_ANSWER}/centered", f"{ANSWER}/plain", PAPER_CENTERING
    ),
    Control("sink-less atlas: answer-only vs everywhere (ATLAS)", f"{SINK_ANSWER}/atlas", f"{SINK}/atlas"),
    Control("sink-less atlas: answer-only vs everywhere (Centered)", f"{SINK_ANSWER}/centered", f"{SINK}/centered"),
    Control("answer-only update: sink-less vs main atlas (ATLAS)", f"{SINK_ANSWER}/atlas", f"{ANSWER}/atlas"),
    Control("answer-only update: sink-less vs main atlas (Centered)", f"{SINK_ANSWER}/centered", f"{ANSWER}/centered"),
    # STM and TALR at the rate their own objective's validation loss picks (by CE they never learned).
    Control("STM: rate by its own objective vs by CE", f"{OWN}/stm", f"{MAIN}/stm"),
    Control("TALR: rate by its own objective vs by CE", f"{OWN}/talr", f"{MAIN}/talr"),
    Control("full ATLAS vs STM at its own objective's rate", f"{MAIN}/atlas", f"{OWN}/stm"),
    Control("full ATLAS vs TALR at its own objective's rate", f"{MAIN}/atlas", f"{OWN}/talr"),
    # The main comparisons at the resolution issue 32 asks for (224 MBPP+, 256 KL contexts, 3 checkpoints an
    # epoch, lr 1e-4..2e-2; configs/repro/resolution*.yaml), filled in as its runs finish over sessions.
    Control("resolution: full ATLAS vs Weight-LoRA", f"{RES}/atlas", f"{RES}/weight-lora", PAPER_ATLAS_VS_LORA),
    Control("resolution: centering", f"{RES}/centered", f"{RES}/plain", PAPER_CENTERING),
    Control("resolution: full ATLAS vs centering", f"{RES}/atlas", f"{RES}/centered", PAPER_ATLAS_VS_CENTERED),
    Control("resolution: full ATLAS vs STM (rate by CE)", f"{RES}/atlas", f"{RES}/stm"),
    Control("resolution: full ATLAS vs TALR (rate by CE)", f"{RES}/atlas", f"{RES}/talr"),
    Control("resolution: full ATLAS vs STM (rate by its own objective)", f"{RES}/atlas", f"{RES_OWN}/stm"),
    Control("resolution: full ATLAS vs TALR (rate by its own objective)", f"{RES}/atlas", f"{RES_OWN}/talr"),
]


@dataclass(frozen=True)
class Point:
    seed: int
    nll: float
    kl: float
    by_kind: dict[str, float] | None  # prompt / response means, when split


def _split(unit: dict) -> dict[str, float] | None:
    kinds = unit["kl"].get("by_kind") or unit.get("kl_split", {}).get("by_kind")
    return None if kinds is None else {k: kinds[k]["mean"] for k in KINDS}


def load_run(results: Path, run: str) -> list[Point] | None:
    """The scored checkpoints of every finished seed of `<experiment>/<method>` (None: not run yet)."""
    experiment, method = run.split("/")
    root = results / experiment
    if not (root / "experiment.json").is_file():
        return None
    stored = json.loads((root / "experiment.json").read_text())
    store = ResultStore(root, stored["fingerprint"], stored.get("method_fingerprints", {}))
    if method not in store.methods:
        return None
    seeds = [s for s in stored["config"]["seeds"] if store.read(store.run_path(method, s)) is not None]
    units = [u for u in store.units([method]) if u["seed"] in seeds and u["kl"]["mean"] > 0]
    return [Point(u["seed"], u["heldout_nll"], u["kl"]["mean"], _split(u)) for u in units] or None


def base_nll(results: Path, run: str) -> float | None:
    """The untrained backbone's held-out NLL, as `<experiment>` scored it (None: not scored yet)."""
    root = results / run.split("/")[0]
    stored = json.loads((root / "experiment.json").read_text())
    base = ResultStore(root, stored["fingerprint"]).read(root / "base.json")
    return None if base is None else base["heldout_nll"]


def learned(levels: list[float], base: float) -> bool:
    """Whether a pair shares an NLL level below the untrained base's. If not, it compares two models that
    did not learn the skill (as held-out NLL measures it), and its ratio says nothing about keeping
    behaviour while learning: the row is marked uninformative."""
    return min(levels) < base


def _best(points: list[Point], seed: int, level: float) -> Point:
    """The checkpoint of least KL among those of `seed` reaching NLL <= level."""
    return min((p for p in points if p.seed == seed and p.nll <= level), key=lambda p: p.kl)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def compare(a: list[Point], b: list[Point], n_levels: int) -> dict:
    """Ratios a/b at shared NLL levels over shared seeds: all positions, and per kind where both are split."""
    seeds = sorted({p.seed for p in a} & {p.seed for p in b})
    if not seeds:
        return {"seeds": []}
    cps = [Checkpoint(name, p.seed, p.nll, p.kl) for name, ps in (("a", a), ("b", b)) for p in ps if p.seed in seeds]
    levels = shared_levels(cps, "lower", n_levels)
    pairs = {s: [(_best(a, s, v), _best(b, s, v)) for v in levels] for s in seeds}
    out = {"seeds": seeds, "levels": levels, "all": _geomean([x.kl / y.kl for s in seeds for x, y in pairs[s]])}
    for kind in KINDS:  # over the seeds whose checkpoints at every level are split on both sides
        split = [
            s
            for s in seeds
            if all(x.by_kind and y.by_kind and x.by_kind[kind] and y.by_kind[kind] for x, y in pairs[s])
        ]
        if split:
            out[kind] = _geomean([x.by_kind[kind] / y.by_kind[kind] for s in split for x, y in pairs[s]])
            out[f"{kind}_seeds"] = split
        elif all(x.by_kind and x.by_kind[kind] == 0 for s in seeds for x, _ in pairs[s]):
            # The first moved none of these positions (answer-only updates: the prompt): a ratio of exactly 0, or
            # no ratio at all where the second moved none either.
            both = all(y.by_kind and y.by_kind[kind] == 0 for s in seeds for _, y in pairs[s])
            out[f"{kind}_zero"] = "both" if both else "first"
    return out


def per_seed(a: list[Point], b: list[Point], n_levels: int) -> dict[int, float]:
    """Each shared seed's ratio over all positions, at the NLL levels that seed's checkpoints share."""
    seeds = sorted({p.seed for p in a} & {p.seed for p in b})
    return {s: compare([p for p in a if p.seed == s], [p for p in b if p.seed == s], n_levels)["all"] for s in seeds}


def control_table(results: Path, n_levels: int = 8) -> str:
    lines = [
        "| control | first / second | seeds | shared NLL levels | KL ratio | per seed | on prompt positions | "
        "on answer positions | paper |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in CONTROLS:
        a, b = load_run(results, c.first), load_run(results, c.second)
        paper = "-" if c.paper is None else f"{c.paper:.3f}"
        pair = f"`{c.first}` / `{c.second}`"
        missing = [r for r, pts in ((c.first, a), (c.second, b)) if pts is None]
        if missing:
            lines.append(f"| {c.question} | {pair} | - | not run yet: {', '.join(missing)} | | | | | {paper} |")
            continue
        r = compare(a, b, n_levels)
        if not r["seeds"]:
            lines.append(f"| {c.question} | {pair} | 0 | no finished seed in common | | | | | {paper} |")
            continue

        def fmt(kind: str) -> str:
            if r.get(f"{kind}_zero"):
                return "0 on both sides" if r[f"{kind}_zero"] == "both" else "0 (the first moved none)"
            if kind not in r:
                return "not split"
            seeds = r[f"{kind}_seeds"]
            return f"{r[kind]:.3f}" + ("" if seeds == r["seeds"] else f" (seed {','.join(map(str, seeds))})")

        bases = [v for v in (base_nll(results, c.first), base_nll(results, c.second)) if v is not None]
        question = c.question
        if bases and not learned(r["levels"], min(bases)):
            question += f", *uninformative: no shared NLL level below the base's {min(bases):.4f}*"
        span = f"{r['levels'][0]:.4f}-{r['levels'][-1]:.4f} ({len(r['levels'])})"
        seeds = ", ".join(f"{v:.3f}" for v in per_seed(a, b, n_levels).values()) if len(r["seeds"]) > 1 else "-"
        lines.append(
            f"| {question} | {pair} | {','.join(map(str, r['seeds']))} | {span} | {r['all']:.3f} | {seeds} | "
            f"{fmt('prompt')} | {fmt('response')} | {paper} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.repro.controls", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=PROJECT_ROOT / "results" / "repro")
    parser.add_argument("--levels", type=int, default=8, help="NLL levels per pair (the experiments' nll_levels)")
    parser.add_argument("--docs", type=Path, default=None, help="also replace the controls section of this file")
    args = parser.parse_args(argv)
    text = control_table(args.results, args.levels)
    if args.docs:
        update_docs(args.docs, "controls", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
