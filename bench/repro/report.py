"""Tables and plots of an experiment, from its results files only (no model, no scoring).

    text = write_report(Path("results/repro/smollm2-l15"))   # report.md + PNGs in that folder

Only finished runs (runs/<method>-seed<s>.json) enter the comparisons; a comparison uses the
seeds both of its methods have finished. Two matched comparisons (evaluation.compare):
  - at shared integer MBPP+ solved counts k (base + plus tests; the paper's protocol), and
  - at shared held-out NLL levels: `eval.nll_levels` evenly spaced values over the NLL range
    every run of the pair reaches (lower is better: a checkpoint reaches level v if its NLL <= v).
A third table gives each run's lowest KL at fixed targets (config `targets`: held-out NLL <= 0.84,
MBPP+ >= 6 of 32 by default), which the shared ranges above need not include.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from atlas_core.io import atomic_write_bytes
from evaluation.answers import Answer
from evaluation.compare import Checkpoint, matched_comparison, min_kl_at, shared_levels
from evaluation.plots import churn_bars, tradeoff_plot
from flows.compare import answer_churn

from .config import TargetSpec
from .store import ResultStore

BEGIN, END = "<!-- repro:{name}:begin -->", "<!-- repro:{name}:end -->"


def _load(root: Path) -> dict:
    """The stored results of the config's methods and seeds, each file checked against the
    fingerprints experiment.json records (a method added but not run has none yet)."""
    experiment = json.loads((root / "experiment.json").read_text())
    config = experiment["config"]
    store = ResultStore(root, experiment["fingerprint"], experiment.get("method_fingerprints", {}))
    methods = _methods(config)
    runs = {(m, s): store.read(store.run_path(m, s)) for m in methods for s in config["seeds"]}
    runs = {key: run for key, run in runs.items() if run is not None}
    all_units = store.units(methods)
    units = [u for u in all_units if (u["method"], u["seed"]) in runs]
    return {
        "config": config,
        "experiment": experiment,
        "base": store.read(store.base_path()),
        "sweeps": store.sweeps(methods),
        "lrs": {m: store.read(store.lr_path(m)) for m in methods},
        "runs": runs,
        "units": units,
        "all_units": all_units,
    }


def _not_run(r: dict) -> list[str]:
    """The methods without a finished run."""
    finished = {m for m, _ in r["runs"]}
    return [m for m in _methods(r["config"]) if m not in finished]


def _methods(config: dict) -> list[str]:
    return [m["name"] for m in config["methods"]]


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _fmt(k: float) -> str:
    return str(int(k)) if float(k).is_integer() else f"{k:.4f}"


def _checkpoints(units: list[dict], level: str) -> list[Checkpoint]:
    get = (lambda u: float(u["mbpp_plus"]["solved"])) if level == "solved" else (lambda u: u["heldout_nll"])
    return [
        Checkpoint(u["method"], u["seed"], get(u), u["kl"]["mean"], f"{u['method']}/s{u['seed']}/{u['step']}")
        for u in units
        if u["kl"]["mean"] > 0
    ]


def comparison_table(r: dict, level: str, common: bool = False) -> tuple[str, list]:
    """One row per compared pair: geometric-mean KL ratio, reduction, seeds and levels favouring.
    Levels: those both runs of each pair reach, or with `common` those every finished run of every
    method reaches (one range for all rows, as the paper's table of the seven baselines)."""
    config = r["config"]
    pairs = [(config["reference"], m) for m in _methods(config) if m != config["reference"]]
    pairs += [tuple(p.split(":")) for p in config.get("extra_pairs", [])]
    cps = _checkpoints(r["units"], level)
    direction, n_grid = ("higher", None) if level == "solved" else ("lower", config["eval"]["nll_levels"])
    levels = shared_levels(cps, direction, n_grid) if common and cps else None
    rows, details = [], []
    pending = _not_run(r)
    for method, baseline in pairs:
        missing = [m for m in (method, baseline) if m in pending]
        if missing:
            rows.append(f"| {method} vs {baseline} | not run yet ({', '.join(missing)}) | | | | |")
            continue
        seeds = sorted({c.seed for c in cps if c.method == method} & {c.seed for c in cps if c.method == baseline})
        pair = [c for c in cps if c.method in (method, baseline) and c.seed in seeds]
        if not seeds:
            rows.append(f"| {method} vs {baseline} | no finished seeds in common | | | | |")
            continue
        cmp = matched_comparison(pair, method, baseline, direction, levels=levels, n_grid=n_grid)
        span = f"{_fmt(cmp.levels[0])}-{_fmt(cmp.levels[-1])}" if len(cmp.levels) > 1 else _fmt(cmp.levels[0])
        rows.append(
            f"| {method} vs {baseline} | {span} ({len(cmp.levels)}) | {cmp.ratio:.3f} | "
            f"{100 * cmp.reduction:+.1f}% | {cmp.favour_seeds[method]}/{len(seeds)} | "
            f"{cmp.favour_levels[method]}/{len(cmp.levels)} |"
        )
        details.append(cmp)
    what = "MBPP+ solved >= k" if level == "solved" else "held-out NLL <= v"
    head = [
        f"| pair | shared levels ({what}; count) | KL ratio (geo. mean) | KL reduction | "
        "seeds favouring the first | levels favouring the first |",
        "|---|---|---:|---:|---:|---:|",
    ]
    return "\n".join(head + rows) + "\n", details


def target_table(r: dict) -> str:
    """Per method and target: the seeds whose run reaches it, the lowest KL of a checkpoint that does
    (geometric mean over those seeds), and reference KL / method KL over the seeds both reach it."""
    if not r["units"]:
        return "(no finished runs yet)\n"
    config = r["config"]
    targets = TargetSpec(**config.get("targets", {}))
    n = r["units"][0]["mbpp_plus"]["n"]
    kinds = [("nll", targets.heldout_nll, "lower", f"held-out NLL <= {targets.heldout_nll:g}")]
    kinds.append(("solved", targets.solved(n), "higher", f"MBPP+ >= {targets.solved(n)}/{n}"))
    reference, methods = config["reference"], [m for m in _methods(config) if m not in _not_run(r)]
    cells = {m: [] for m in methods}
    for level, target, direction, _ in kinds:
        runs = defaultdict(list)
        for c in _checkpoints(r["units"], level):
            runs[(c.method, c.seed)].append(c)
        lowest = {}
        for key, run in runs.items():
            try:
                lowest[key] = min_kl_at(run, target, direction)
            except ValueError:  # no checkpoint of this run reaches the target
                pass
        for m in methods:
            seeds = sorted(s for (method, s) in runs if method == m)
            mine = {s: lowest[(m, s)] for s in seeds if (m, s) in lowest}
            both = [s for s in mine if (reference, s) in lowest]
            kl = f"{_geomean(mine.values()):.4g}" if mine else "not reached"
            ratio = "-"
            if m != reference and both:
                ratio = f"{_geomean(lowest[(reference, s)] / mine[s] for s in both):.3f} ({len(both)})"
            cells[m] += [f"{len(mine)}/{len(seeds)}", kl, ratio]
    head = "| method | " + " | ".join(
        f"{name}: seeds reaching | lowest KL | {reference} / method (seeds)" for *_, name in kinds
    )
    lines = [head + " |", "|---|" + "---:|" * 3 * len(kinds)]
    lines += [f"| {m} | " + " | ".join(cells[m]) + " |" for m in methods]
    return "\n".join(lines) + "\n"


def checkpoint_table(r: dict) -> str:
    """Per method and epoch: mean solved over finished seeds, mean NLL, geometric-mean KL."""
    base = r["base"]
    lines = [
        "| method | epoch | seeds | MBPP+ solved (plus) | base tests | held-out NLL | retained KL |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    if base:
        m = base["mbpp_plus"]
        lines.append(
            f"| base | 0 | - | {m['solved']}/{m['n']} | {m['base_solved']}/{m['n']} | "
            f"{base['heldout_nll']:.4f} | {base['kl']['mean']:.2g} |"
        )
    groups = defaultdict(list)
    for u in r["units"]:
        groups[(u["method"], round(u["epoch"], 3))].append(u)
    order = {m: i for i, m in enumerate(_methods(r["config"]))}
    for (method, epoch), us in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        n = us[0]["mbpp_plus"]["n"]
        mean = lambda f: sum(map(f, us)) / len(us)
        lines.append(
            f"| {method} | {epoch:g} | {len(us)} | {mean(lambda u: u['mbpp_plus']['solved']):.1f}/{n} | "
            f"{mean(lambda u: u['mbpp_plus']['base_solved']):.1f}/{n} | {mean(lambda u: u['heldout_nll']):.4f} | "
            f"{_geomean(u['kl']['mean'] for u in us):.4g} |"
        )
    lines += [f"| {m} | - | 0 | not run yet | | | |" for m in _not_run(r)]
    return "\n".join(lines) + "\n"


def sweep_table(r: dict) -> str:
    grid = r["config"]["lr_grid"]
    lines = [
        "| method | " + " | ".join(f"lr {lr:g}" for lr in grid) + " | chosen |",
        "|---|" + "---:|" * (len(grid) + 1),
    ]
    by = {(s["method"], s["lr"]): s for s in r["sweeps"]}
    for m in _methods(r["config"]):
        cells = []
        for lr in grid:
            s = by.get((m, lr))
            cells.append("-" if s is None else "diverged" if s["diverged"] else f"{s['best_val_loss']:.4f}")
        chosen = r["lrs"].get(m)
        best = "-" if chosen is None else f"{chosen['best_lr']:g}"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {best} |")
    return "\n".join(lines) + "\n"


def churn_table(r: dict) -> tuple[str, dict]:
    """GSM8K answer churn / NFR of each finished run's final checkpoint against the base model."""
    if not r["base"] or "gsm8k_answers" not in r["base"]:
        return "(no base answers yet)\n", {}
    ref = {a["id"]: Answer(a["id"], a["answer"], a["correct"]) for a in r["base"]["gsm8k_answers"]}
    per_method = defaultdict(list)
    for u in r["units"]:
        if u.get("final") and "gsm8k_answers" in u:
            per_method[u["method"]].append(
                answer_churn(ref, [Answer(a["id"], a["answer"], a["correct"]) for a in u["gsm8k_answers"]])
            )
    lines = [
        "| method | seeds | n | accuracy (base -> new) | F | G | W | churn | NFR |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pooled = {}
    for m in _methods(r["config"]):
        cs = per_method.get(m)
        if not cs:
            continue
        mean = lambda f: sum(map(f, cs)) / len(cs)
        lines.append(
            f"| {m} | {len(cs)} | {cs[0].n} | {cs[0].accuracy_ref:.3f} -> {mean(lambda c: c.accuracy_new):.3f} | "
            f"{mean(lambda c: c.F):.1f} | {mean(lambda c: c.G):.1f} | {mean(lambda c: c.W):.1f} | "
            f"{mean(lambda c: c.churn):.3f} | {mean(lambda c: c.nfr):.3f} |"
        )
        pooled[m] = {k: sum(getattr(c, k) for c in cs) for k in ("n", "F", "G", "W")}
    return "\n".join(lines) + "\n(F, G, W, churn and NFR: means over seeds.)\n", pooled


def cost_table(r: dict) -> str:
    """Measured seconds per phase of a scored checkpoint (means over units; wall clock and CPU
    seconds of this process and its EvalPlus children) and the trainer's seconds per epoch."""
    wall, cpu = defaultdict(list), defaultdict(list)
    for u in ([r["base"]] if r["base"] else []) + r["all_units"]:
        for k, v in u["seconds"].items():
            wall[k].append(v)
        for k, v in u.get("cpu_seconds", {}).items():
            cpu[k].append(v)
    mean = lambda v: f"{sum(v) / len(v):.1f}" if v else "-"
    lines = ["| phase | units | mean wall s | mean CPU s |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {len(v)} | {mean(v)} | {mean(cpu.get(k, []))} |" for k, v in sorted(wall.items())]
    per_epoch = [
        run["train_seconds"] / (run["steps"][-1] / run["steps_per_epoch"]) for run in r["runs"].values() if run["steps"]
    ]
    if per_epoch:
        lines.append(f"| training, per epoch | {len(per_epoch)} runs | {mean(per_epoch)} | - |")
    return (
        "\n".join(lines) + "\n(`train`: wall time from the previous unit to this checkpoint: training, validation, "
        "checkpoint writing, and for a run's first checkpoint its setup; only checkpoints trained in their own unit: "
        "a first seed's run scores the checkpoints its sweep wrote at the chosen rate, and a resumed run those an "
        "ended session wrote, whose training is in the per-epoch row.)\n"
    )


def write_report(root: Path) -> str:
    """Render report.md (and the PNGs) in `root`; returns the markdown."""
    root = Path(root)
    r = _load(root)
    name = r["config"]["name"]
    solved_table, _ = comparison_table(r, "solved")
    nll_table, _ = comparison_table(r, "nll")
    common_solved, _ = comparison_table(r, "solved", common=True)
    common_nll, _ = comparison_table(r, "nll", common=True)
    churn, pooled = churn_table(r)
    done = sorted(f"{m}/seed{s}" for m, s in r["runs"])
    expected = len(r["config"]["methods"]) * len(r["config"]["seeds"])
    parts = [
        f"### Experiment `{name}`\n",
        f"Finished runs: {len(done)} of {expected} ({', '.join(done) or 'none'}); scored checkpoints of finished "
        f"runs: {len(r['units'])} (all stored: {len(r['all_units'])}).\n",
        *([f"Not run yet: {', '.join(_not_run(r))}.\n"] if _not_run(r) else []),
        f"#### Learning rate per method (best validation loss on MBPP validation, seed {r['config']['seeds'][0]})\n",
        sweep_table(r),
        "#### Checkpoints (means over finished seeds)\n",
        checkpoint_table(r),
        "#### Matched comparison at shared MBPP+ solved counts\n",
        solved_table,
        f"#### Matched comparison at shared held-out NLL levels ({r['config']['eval']['nll_levels']} evenly spaced)\n",
        nll_table,
        "#### The same at levels every finished method and seed reaches (one range for every row, "
        "as the paper's table of the seven baselines)\n",
        common_solved,
        common_nll,
        "#### Lowest KL at fixed targets (each run's checkpoint with the lowest KL among those reaching the "
        "target; the ratio over the seeds where both runs reach it)\n",
        target_table(r),
        "#### GSM8K answer churn of the final checkpoints vs the base model\n",
        churn,
        "#### Measured cost\n",
        cost_table(r),
    ]
    cps = _checkpoints(r["units"], "solved")
    if cps:
        for level, file, label, direction in (
            ("solved", "tradeoff_solved.png", "MBPP+ problems solved", "higher"),
            ("nll", "tradeoff_nll.png", "held-out NLL (nats/token)", "lower"),
        ):
            points = _checkpoints(r["units"], level)
            try:
                shared = shared_levels(
                    points, direction, None if level == "solved" else r["config"]["eval"]["nll_levels"]
                )
            except ValueError:
                shared = None
            tradeoff_plot(
                points,
                root / file,
                direction,
                level_label=label,
                shared=shared,
                title=f"{name}: retained KL vs {label}",
            )
        parts.append(
            f"![KL vs solved](../results/repro/{name}/tradeoff_solved.png) "
            f"![KL vs NLL](../results/repro/{name}/tradeoff_nll.png)\n"
        )
    if pooled:
        churn_bars(pooled, root / "churn.png", title=f"{name}: GSM8K answer churn vs base (pooled over seeds)")
        parts.append(f"![churn](../results/repro/{name}/churn.png)\n")
    text = "\n".join(parts)
    atomic_write_bytes(root / "report.md", text.encode())
    return text


def update_docs(doc: Path, name: str, text: str) -> None:
    """Replace the experiment's marked section of `doc` (added at the end if absent)."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    current = doc.read_text() if doc.is_file() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        current = head + block + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + block + "\n"
    atomic_write_bytes(doc, current.encode())
