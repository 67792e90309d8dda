"""A long line: N releases on one line, each teaching a new skill from a JSONL file, measured per release.

    .venv/bin/python bench/long_line.py                           # the default backbone, 8 releases (the record)
    .venv/bin/python bench/long_line.py --backbone tiny-llama     # the CI smoke size (tests/test_long_line.py)

Skill k is a slice of MBPP's training problems as prompt/response pairs (JSONL), with 4 held-out
MBPP test problems scored by reference NLL; every release is one ATLAS candidate trained on top of
the champion (policy: no KL limit that a release could miss; the line must grow). Per release t:

- cycle: the `update` cycle's wall seconds, and its phases (lineage, atlas, candidates, gate, ...);
- load: seconds to load the champion as a verified release (flows.serving.load_release, warm cache,
  best of 3);
- decoding: greedy new tokens/s of the base and of the champion (its whole chain attached) at batch
  1 and 8, interleaved, best of 3, and the champion's overhead against the base;
- bytes: the champion's release folder (manifest and deltas; the backbone is referenced, not copied);
- KL vs the base per retained domain, OP_t and BWT_t of the line (flows.history).

The growth of a quantity over the line is the least-squares slope of its series against t (releases
2..N: release 1 pays one-time costs), divided by its mean: +10%/release means each release already on
the line adds a tenth of a typical release's cost.
`--json FILE` writes every number (the smoke test reads it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import machine, reading  # noqa: E402

SIZES = {  # backbone -> (pairs per skill, training overrides, retained set)
    "tiny-llama": (
        8,
        {"epochs": 1, "lr": 1.0e-2, "batch_size": 4, "max_length": 256},
        {"domains": ["csqa"], "kl_contexts": 6, "kl_max_tokens": 128, "csqa_questions": 6, "max_new_tokens": 4},
    ),
    "smollm2-135m": (
        20,
        # the main job's lr; 1 epoch at 2e-4 learnt too little (release 4 failed its target gain)
        {"epochs": 3, "lr": 1.0e-3, "batch_size": 4, "max_length": 512},
        {"domains": ["gsm8k", "csqa"], "kl_contexts": 32, "gsm8k_questions": 16, "csqa_questions": 32},
    ),
}


def write_skills(folder: Path, releases: int, per_skill: int) -> list[tuple[str, str, str]]:
    """(skill, training JSONL, held-out JSONL) per release: disjoint MBPP train (+ validation) and test slices, each
    skill's answers in a house style of its own (a header comment naming the skill), so every release
    has something new to learn and passes its target gain: plain MBPP slices are one skill, and a
    champion that learned code from earlier slices can already match a later slice's held-out NLL
    (measured: release 3 of the default backbone was rejected on target gain)."""
    from evaluation.data import mbpp_pairs

    train, test = mbpp_pairs("train") + mbpp_pairs("validation"), mbpp_pairs("test")
    if len(train) < releases * per_skill or len(test) < releases * 4:  # known before anything trains
        raise SystemExit(
            f"--releases {releases}: MBPP has {len(train)} train + validation pairs and {len(test)} test pairs, "
            f"{releases} skills need {releases * per_skill} and {releases * 4}"
        )
    out = []
    for k in range(releases):
        name = f"skill{k + 1}"
        data, held = folder / f"{name}.jsonl", folder / f"{name}-held.jsonl"
        for rows, path in ((train[k * per_skill : (k + 1) * per_skill], data), (test[k * 4 : (k + 1) * 4], held)):
            styled = [r | {"response": f"# {name} house style\n{r['response']}"} for r in rows]
            path.write_text("".join(json.dumps({f: r[f] for f in ("id", "prompt", "response")}) + "\n" for r in styled))
        out.append((name, str(data), str(held)))
    return out


def configs(folder: Path, backbone: str, skills) -> tuple[list[str], str]:
    import yaml

    per_skill, train, retained = SIZES[backbone]
    paths = []
    for name, data, held in skills:
        cfg = {
            "name": name,
            "backbone": backbone,
            "line": "long",
            "skill": name,
            "data": {"source": data, "val_source": held, "val_limit": 4},
            "target": {"scorer": "reference-nll", "options": {"source": held, "limit": 4}},
            "retained": retained,
            "train": train,
        }
        if backbone == "tiny-llama":
            cfg |= {"dtype": "float32", "layer": 2, "atlas": {"num_vectors": 64, "charts": 4, "rank": 4}}
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        paths.append(str(path))
    loose = {d: 100.0 for d in retained["domains"]}
    policy = {
        "name": "long-line",
        "candidates": {"methods": ["atlas"], "seeds": [0]},
        "min_target_gain": 0.0,
        "max_kl_vs_champion": loose | {"released": 100.0},
        "max_kl_vs_base": loose,
        "nfr": {"max_vs_champion": {"csqa": 1.0, "gsm8k": 1.0}, "max_vs_base": {"csqa": 1.0, "gsm8k": 1.0}},
        "no_regression": {"released": {"tolerance": 100.0, "min_n": 4}},
    }
    policy_path = folder / "policy.yaml"
    policy_path.write_text(yaml.safe_dump(policy))
    return paths, str(policy_path)


def decoding_rates(base, champion, new_tokens: int, repeat: int = 3) -> dict:
    """Greedy new tokens/s of base and champion at batch 1 and 8 (interleaved, best of `repeat`)."""
    import torch

    from evaluation.generate import _greedy_batch, _Stops

    tok = base.tokenizer
    tok.padding_side = "left"
    prompts = [f"Write a Python function that returns {i} plus its argument." for i in range(8)]
    never = _Stops(tok, [], (), None)  # every row decodes the full budget
    out = {}
    with torch.no_grad():
        for batch in (1, 8):
            enc = tok(prompts[:batch], return_tensors="pt", padding=True)
            best = {}
            for _ in range(repeat):
                for name, model in (("base", base.model), ("champion", champion.model)):
                    start = time.perf_counter()
                    _greedy_batch(model, enc["input_ids"], enc["attention_mask"], new_tokens, never)
                    best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
            base_rate, champ_rate = (batch * new_tokens / best[n] for n in ("base", "champion"))
            out[batch] = {"base": base_rate, "champion": champ_rate, "overhead": base_rate / champ_rate - 1}
    return out


def measure_release(model_name: str, new_tokens: int) -> dict:
    """Load time, decoding and folder bytes of the line's champion; OP, BWT and KL from the ledger."""
    from flows.history import line_history
    from flows.platform import open_platform
    from flows.serving import load_release, release_folder
    from registry import alias_holder, get_model

    with release_folder(model_name, "champion") as folder:  # written into the cache once
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    load_s = float("inf")
    for _ in range(3):  # best of 3: a load takes milliseconds on the tiny model
        start = time.perf_counter()
        champion = load_release(model_name, "champion")
        load_s = min(load_s, time.perf_counter() - start)
    base = load_release(model_name, "base")
    rates = decoding_rates(base, champion, new_tokens)
    p = open_platform()
    try:
        model = get_model(p.ledger, model_name)
        history = line_history(p.ledger, model.id, alias_holder(p.ledger, model.id).id)
        metrics = history.metrics()
    finally:
        p.close()
    return {"load_s": load_s, "bytes": size, "decoding": rates, "history": metrics}


def why_rejected(result) -> str:
    """Each candidate's failed gate checks (name, measured, threshold, detail), or why it failed."""
    from flows.platform import open_platform
    from registry import get_model, latest_gate_decision, resolve_version

    if result.failed:
        return str(result.failed)
    p = open_platform()
    try:
        model = get_model(p.ledger, result.model)
        out = []
        for name in result.candidates:
            decision = latest_gate_decision(p.ledger, resolve_version(p.ledger, model.id, name).id)
            failed = [f"{c.name} {c.measured} vs {c.threshold} ({c.detail})" for c in decision.checks if not c.passed]
            out.append(f"{name}: {'; '.join(failed)}")
        return " | ".join(out)
    finally:
        p.close()


def growth(series: list[float]) -> tuple[float, float]:
    """Least-squares slope of the series against the release index, as a share of its mean (the
    cost each release already on the line adds), and the slope's standard error on the same scale
    (how far timing noise alone moves it). Release 1 is left out (it pays the one-time costs: the
    first backbone load, Prefect's temporary server, cold file caches)."""
    ys = series[1:]
    n = len(ys)
    if n < 2:
        return float("nan"), float("nan")
    mean_t, mean_y = (n - 1) / 2, sum(ys) / n
    sxx = sum((t - mean_t) ** 2 for t in range(n))
    slope = sum((t - mean_t) * (y - mean_y) for t, y in enumerate(ys)) / sxx
    if n == 2:  # a line through two points: no residual to estimate the noise from
        return slope / mean_y, float("nan")
    residual = sum((y - mean_y - slope * (t - mean_t)) ** 2 for t, y in enumerate(ys)) / (n - 2)
    return slope / mean_y, (residual / sxx) ** 0.5 / mean_y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="smollm2-135m", choices=sorted(SIZES))
    parser.add_argument("--releases", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", default=None, help="write every measured number here")
    parser.add_argument("--state", default=None, help="keep the line's state folder here (default: a temporary one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="atlas-long-line-") as tmp:
        os.environ["ATLAS_STATE_DIR"] = args.state or str(Path(tmp) / "state")
        from flows.platform import configure_environment

        configure_environment()
        from flows.update import update

        per_skill = SIZES[args.backbone][0]
        paths, policy = configs(Path(tmp), args.backbone, write_skills(Path(tmp), args.releases, per_skill))
        print(f"machine: {machine()}")
        print(
            f"{args.backbone}: {args.releases} releases on one line, one ATLAS delta each; decoding "
            f"{args.new_tokens} new tokens a row, best of 3, base and champion interleaved"
        )
        # Every KL column is known before anything trains: the retained domains, then each skill.
        columns = SIZES[args.backbone][2]["domains"] + [f"skill{k + 1}" for k in range(args.releases)]
        print_header(columns)
        rows = []
        for t, config in enumerate(paths, start=1):
            start = time.perf_counter()
            with contextlib.redirect_stdout(sys.stderr):  # the trainer's summary is not a table row
                result = update(config, policy)
            cycle_s = time.perf_counter() - start
            if result.outcome != "promoted":
                raise SystemExit(f"release {t}: {result.outcome}: {why_rejected(result)}")
            rows.append(
                {"t": t, "cycle_s": cycle_s, "phases": result.seconds} | measure_release(result.model, args.new_tokens)
            )
            print_row(rows[-1], columns)  # as it comes: a later failure keeps the rows before it
    report(args, rows)


def print_header(columns: list[str]) -> None:
    """The table's header: KL vs the base on each retained domain and on each skill's held-out set."""
    head = f"{'t':>2} {'cycle s':>7} {'candidates s':>12} {'load s':>6} {'tok/s b1':>8} {'ovh b1':>7} "
    head += f"{'tok/s b8':>8} {'ovh b8':>7} {'bytes':>10} {'OP':>6} {'BWT':>7}"
    print(head + "".join(f" {'KL ' + c:>10}" for c in columns), flush=True)


def print_row(r: dict, columns: list[str]) -> None:
    """One release; a KL column the line does not measure yet (a later skill) prints as '-'."""
    d, h = r["decoding"], r["history"]
    kl = [h.get(f"line_kl_vs_base_{c}") for c in columns]
    cand = sum(v for k, v in r["phases"].items() if k.startswith("candidate"))
    print(
        f"{r['t']:2d} {r['cycle_s']:7.1f} {cand:12.1f} {r['load_s']:6.2f} "
        f"{d[1]['champion']:8.1f} {d[1]['overhead']:7.1%} "
        f"{d[8]['champion']:8.1f} {d[8]['overhead']:7.1%} {r['bytes']:10,d} {fmt(h.get('line_OP'), 6, 3)} "
        f"{fmt(h.get('line_BWT'), 7, 3)}" + "".join(f" {fmt(v, 10, 4)}" for v in kl),
        flush=True,
    )


def fmt(value, width: int, digits: int) -> str:
    """A number, or '-' where there is none (BWT before a second skill, KL of a skill not taught yet)."""
    if value is None or value != value:
        return f"{'-':>{width}}"
    return f"{value:{width}.{digits}f}"


def report(args, rows: list[dict]) -> None:
    # The cycle's stages alone: Prefect's end of a flow run rounds a cycle's wall time up to whole
    # seconds (tiny model, measured: 6.07, 6.07, 6.11, 6.08, 6.08, 7.08, 8.08 s), +-16% of a 6 s cycle.
    # The stages hold a candidate's subflow, whose end waits the same way (tiny model, measured:
    # 1.5-4.6 s for the same training), hence the standard errors next to the slopes.
    stage, stage_se = growth([sum(r["phases"].values()) for r in rows])
    load, load_se = growth([r["load_s"] for r in rows])
    summary = {
        "cycle_growth": growth([r["cycle_s"] for r in rows])[0],
        "stage_growth": stage,
        "stage_growth_se": stage_se,
        "load_growth": load,
        "load_growth_se": load_se,
        "overhead_b1_per_delta": rows[-1]["decoding"][1]["overhead"] / len(rows),
        "overhead_b8_per_delta": rows[-1]["decoding"][8]["overhead"] / len(rows),
    }
    print(
        "growth per release (least-squares slope over releases 2..N / their mean, +- its standard error): "
        f"cycle {summary['cycle_growth']:+.1%} (its stages {summary['stage_growth']:+.1%} "
        f"+- {summary['stage_growth_se']:.1%}), load {summary['load_growth']:+.1%} +- {summary['load_growth_se']:.1%}; "
        f"decoding overhead per delta at release {len(rows)}: "
        f"{summary['overhead_b1_per_delta']:.1%} (batch 1), {summary['overhead_b8_per_delta']:.1%} (batch 8)"
    )
    n, delta = len(rows), max(summary["overhead_b1_per_delta"], summary["overhead_b8_per_delta"])
    reading(
        f"a long line, {args.backbone}: growth per release already on the line",
        f"cycle {summary['cycle_growth']:+.1%} (its stages {summary['stage_growth']:+.1%}), "
        f"champion load {summary['load_growth']:+.1%}",
        "<= 10% each",
        "yes" if max(summary["cycle_growth"], summary["load_growth"]) <= 0.10 else "**no**",
    )
    reading(
        f"a long line, {args.backbone}: decoding with {n} ATLAS deltas",
        f"{rows[-1]['decoding'][1]['overhead']:+.1%} (batch 1), {rows[-1]['decoding'][8]['overhead']:+.1%} (batch 8):"
        f" {delta:.1%} per delta",
        "<= 2% per delta",
        "yes" if delta <= 0.02 else "**no**",
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=2, default=str))


if __name__ == "__main__":
    main()
