"""The report on a hand-made results folder gives the comparison numbers worked out by hand,
and the experiment config refuses bad files with the field named."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from atlas_core.train.config import ConfigError
from bench.repro.config import load_repro_config, repro_from_dict
from bench.repro.report import update_docs, write_report
from bench.repro.store import ResultStore

REPO = Path(__file__).resolve().parent.parent

CONFIG = {
    "name": "hand",
    "methods": [{"name": "atlas", "config": "a"}, {"name": "plain", "config": "p"}],
    "reference": "atlas",
    "extra_pairs": [],
    "seeds": [0, 1],
    "lr_grid": [1e-3, 1e-2],
    "eval": {"nll_levels": 3},
}
# (solved, held-out NLL, KL) per checkpoint; NLL = 2 - solved / 10, so both comparisons see the same order
RUNS = {
    ("atlas", 0): [(10, 1.0, 0.01), (12, 0.8, 0.02), (14, 0.6, 0.04)],
    ("plain", 0): [(10, 1.0, 0.02), (12, 0.8, 0.04), (14, 0.6, 0.08)],
    ("atlas", 1): [(11, 0.9, 0.01), (13, 0.7, 0.03)],
    ("plain", 1): [(11, 0.9, 0.04), (14, 0.6, 0.06)],
}
BASE_ANSWERS = [("q1", "1", True), ("q2", "2", True), ("q3", "5", False), ("q4", "7", False)]
FINAL_ANSWERS = [("q1", "1", True), ("q2", "9", False), ("q3", "3", True), ("q4", "7", False)]  # F=1, G=1, W=0


def _answers(rows):
    return [{"id": i, "answer": a, "correct": c} for i, a, c in rows]


@pytest.fixture
def results(tmp_path):
    store = ResultStore(tmp_path, "f" * 64, {"atlas": "a" * 64, "plain": "b" * 64})
    store.check_experiment(CONFIG)
    store.write(
        store.base_path(),
        {
            "mbpp_plus": {"n": 20, "solved": 8, "base_solved": 9},
            "heldout_nll": 1.1,
            "kl": {"mean": 0.0},
            "gsm8k_answers": _answers(BASE_ANSWERS),
            "seconds": {},
        },
    )
    for method in ("atlas", "plain"):
        store.write(store.lr_path(method), {"best_lr": 1e-3, "val_loss": {}})
        for lr, loss in ((1e-3, 0.9), (1e-2, 1.2)):
            store.write(
                store.sweep_path(method, lr), {"method": method, "lr": lr, "best_val_loss": loss, "diverged": False}
            )
    for (method, seed), points in RUNS.items():
        for step, (solved, nll, kl) in enumerate(points, start=1):
            final = step == len(points)
            store.write(
                store.unit_path(method, seed, step),
                {
                    "method": method,
                    "seed": seed,
                    "step": step,
                    "epoch": float(step),
                    "final": final,
                    "mbpp_plus": {"n": 20, "solved": solved, "base_solved": solved + 1},
                    "heldout_nll": nll,
                    "kl": {"mean": kl},
                    "seconds": {"kl": 2.0, "mbpp_plus": 4.0},
                    **({"gsm8k_answers": _answers(FINAL_ANSWERS)} if final else {}),
                },
            )
        store.write(
            store.run_path(method, seed),
            {
                "method": method,
                "seed": seed,
                "steps": list(range(1, len(points) + 1)),
                "steps_per_epoch": 1,
                "train_seconds": 30.0 * len(points),
            },
        )
    return tmp_path


def test_report_gives_the_hand_computed_comparisons(results):
    text = write_report(results)
    # shared solved levels: max of run minima 11 .. min of run maxima 13; per (seed, k) ratios
    # seed 0: .02/.04, .02/.04, .04/.08 = .5 each; seed 1: .01/.04 = .25, .03/.06, .03/.06 = .5
    ratio = math.exp((5 * math.log(0.5) + math.log(0.25)) / 6)
    row = f"| atlas vs plain | 11-13 (3) | {ratio:.3f} | +{100 * (1 - ratio):.1f}% | 2/2 | 3/3 |"
    assert row in text
    # NLL levels 0.7, 0.8, 0.9 (3 evenly spaced over the range every run reaches) match 13, 12, 11
    assert f"| atlas vs plain | 0.7000-0.9000 (3) | {ratio:.3f} | +{100 * (1 - ratio):.1f}% | 2/2 | 3/3 |" in text
    # churn of the final checkpoints vs base: F=1, G=1, W=0 of 4 -> churn 0.5, NFR 0.25
    assert "| atlas | 2 | 4 | 0.500 -> 0.500 | 1.0 | 1.0 | 0.0 | 0.500 | 0.250 |" in text
    assert "| atlas | 0.9000 | 1.2000 | 0.001 |" in text  # sweep table: best val loss per rate, chosen rate
    assert "| atlas | 3 | 1 | 14.0/20 | 15.0/20 | 0.6000 | 0.04 |" in text  # epoch 3: only seed 0 has it
    assert "| training, per epoch | 4 runs | 30.0 | - |" in text and "| kl | 10 | 2.0 | - |" in text
    for png in ("tradeoff_solved.png", "tradeoff_nll.png", "churn.png"):
        assert (results / png).stat().st_size > 1000
    assert write_report(results) == text  # from the files only: the same every time


def test_unfinished_runs_stay_out_of_the_comparison(results):
    (results / "runs" / "plain-seed1.json").unlink()
    text = write_report(results)
    # only seed 0 is finished for both: all its ratios are 0.5 over levels 10..14
    assert "| atlas vs plain | 10-14 (5) | 0.500 | +50.0% | 1/1 | 5/5 |" in text
    assert "Finished runs: 3 of 4" in text


def test_common_levels_are_those_every_method_reaches(results):
    """A third method reaching only 12-13 solved (NLL 0.8-0.7) narrows the common tables' levels
    for every pair; the pairwise tables keep each pair's own."""
    import json

    path = results / "experiment.json"
    stored = json.loads(path.read_text())
    methods = CONFIG["methods"] + [{"name": "narrow", "config": "n"}]
    store = ResultStore(results, "f" * 64, {**stored["method_fingerprints"], "narrow": "c" * 64})
    store.check_experiment({**CONFIG, "methods": methods})
    for seed in (0, 1):
        for step, (solved, nll) in enumerate(((12, 0.8), (13, 0.7)), start=1):
            store.write(
                store.unit_path("narrow", seed, step),
                {
                    "method": "narrow",
                    "seed": seed,
                    "step": step,
                    "epoch": float(step),
                    "final": False,
                    "mbpp_plus": {"n": 20, "solved": solved, "base_solved": solved},
                    "heldout_nll": nll,
                    "kl": {"mean": 0.05},
                    "seconds": {},
                },
            )
        store.write(
            store.run_path("narrow", seed),
            {"method": "narrow", "seed": seed, "steps": [1, 2], "steps_per_epoch": 1, "train_seconds": 60.0},
        )
    text = write_report(results)
    pairwise, common = text.split("#### The same at levels every finished method")
    assert "| atlas vs plain | 11-13 (3) |" in pairwise
    # at k = 12, 13 (NLL 0.8, 0.7): seed 0 .02/.04, .04/.08; seed 1 .03/.06 twice -> 0.5 everywhere
    assert "| atlas vs plain | 12-13 (2) | 0.500 | +50.0% | 2/2 | 2/2 |" in common
    assert "| atlas vs plain | 0.7000-0.8000 (3) | 0.500 | +50.0% | 2/2 | 3/3 |" in common
    assert "| atlas vs narrow | 12-13 (2) |" in common


def test_target_table_gives_each_runs_lowest_kl_at_the_fixed_targets(results):
    """Targets NLL <= 0.75 and 70% of 20 problems (14 solved): seed 1 of atlas reaches the NLL target
    (0.7, KL .03) but not 14 solved; every other run reaches both at its KL-.04/.08/.06 checkpoint."""
    path = results / "experiment.json"
    stored = json.loads(path.read_text())
    stored["config"]["targets"] = {"heldout_nll": 0.75, "mbpp_plus_share": 0.7}
    path.write_text(json.dumps(stored))
    table = write_report(results).split("#### Lowest KL at fixed targets")[1].split("####")[0]
    assert "held-out NLL <= 0.75: seeds reaching" in table and "MBPP+ >= 14/20: seeds reaching" in table
    # NLL: atlas .04 (s0), .03 (s1); plain .08, .06 -> ratio .5 in both seeds; solved: atlas only s0
    atlas_kl = math.sqrt(0.04 * 0.03)
    assert f"| atlas | 2/2 | {atlas_kl:.4g} | - | 1/2 | 0.04 | - |" in table
    assert (
        f"| plain | 2/2 | {math.sqrt(0.08 * 0.06):.4g} | 0.500 (2) | 2/2 | {math.sqrt(0.08 * 0.06):.4g} | 0.500 (1) |"
        in table
    )
    stored["config"]["targets"] = {"heldout_nll": 0.5}  # no run gets that low
    path.write_text(json.dumps(stored))
    table = write_report(results).split("#### Lowest KL at fixed targets")[1]
    assert "| plain | 0/2 | not reached | - | 2/2 |" in table  # default share 0.1875 of 20: 4 solved


def test_targets_count_problems_as_the_issue_does():
    from bench.repro.config import TargetSpec

    assert TargetSpec().solved(32) == 6 and TargetSpec().solved(224) == 42 and TargetSpec().solved(20) == 4
    assert TargetSpec(mbpp_plus_share=0.07).solved(100) == 7  # 0.07 * 100 is 7.000000000000001 in floats
    with pytest.raises(ConfigError, match="targets.mbpp_plus_share: expected a share in"):
        repro_from_dict({**GOOD, "targets": {"mbpp_plus_share": 6}})
    with pytest.raises(ConfigError, match="targets.heldout_nll: expected a positive NLL"):
        repro_from_dict({**GOOD, "targets": {"heldout_nll": 0}})
    assert (
        repro_from_dict({**GOOD, "targets": {"heldout_nll": 0.8}}).fingerprint() == repro_from_dict(GOOD).fingerprint()
    )


def test_docs_section_is_replaced_in_place(tmp_path):
    doc = tmp_path / "RESULTS.md"
    doc.write_text("# Results\n\nintro\n")
    update_docs(doc, "x", "first")
    update_docs(doc, "x", "second")
    text = doc.read_text()
    assert text.startswith("# Results\n\nintro\n") and "second" in text and "first" not in text
    assert text.count("<!-- repro:x:begin -->") == 1


GOOD = {
    "name": "t",
    "methods": {"atlas": "configs/train/atlas.yaml", "plain": "configs/train/plain.yaml"},
    "seeds": [0, 1],
    "lr_grid": [2e-4, "1e-3"],
}


def test_config_parses_and_names_bad_fields():
    config = repro_from_dict(GOOD)
    assert config.lr_grid == [2e-4, 1e-3] and config.run_config("plain", 1, 1e-3).train.seed == 1
    assert config.run_config("atlas", 0, 1e-3).layer == 15
    for change, message in [
        ({"seeds": []}, "seeds: expected a non-empty list"),
        ({"lr_grid": [1e-3, "fast"]}, r"lr_grid\[1\]: expected a number"),
        ({"eval": {"kl_contexts": 0}}, "eval.kl_contexts: expected a positive integer"),
        ({"eval": {"kl_context": 5}}, "eval.kl_context: unknown field"),
        ({"methods": {"x": "configs/train/nope.yaml"}}, "methods.x: config file"),
        ({"reference": "lora"}, "reference: expected one of the methods"),
        ({"extra_pairs": ["plain"]}, "extra_pairs: expected 'method:baseline'"),
        ({"dtype": "fp16"}, "dtype: expected one of"),
        ({"epochs": "5"}, "epochs: expected an integer"),
        ({"colour": 1}, "colour: unknown field"),
    ]:
        with pytest.raises(ConfigError, match=message):
            repro_from_dict({**GOOD, **change})
    with pytest.raises(ConfigError, match="lr_grid: field is missing"):
        repro_from_dict({k: v for k, v in GOOD.items() if k != "lr_grid"})


def test_the_committed_experiment_keeps_its_fingerprint():
    # Fields added to the config since (atlas.positions) leave the stored results valid.
    stored = json.loads((REPO / "results" / "repro" / "smollm2-l15" / "experiment.json").read_text())
    assert load_repro_config(REPO / "configs" / "repro" / "smollm2.yaml").fingerprint() == stored["fingerprint"]


def test_fingerprint_follows_what_changes_results():
    config = repro_from_dict(GOOD)
    a, methods = config.fingerprint(), config.method_fingerprints()
    assert repro_from_dict(dict(GOOD)).fingerprint() == a
    assert repro_from_dict({**GOOD, "eval": {"kl_contexts": 64}}).fingerprint() != a
    assert repro_from_dict({**GOOD, "lr_grid": [2e-4]}).fingerprint() != a
    # An atlas sampled on response positions only is another experiment; 'all' (the default) is the one before.
    atlas = dict(GOOD.get("atlas") or {})
    assert repro_from_dict({**GOOD, "atlas": atlas | {"positions": "all"}}).fingerprint() == a
    assert repro_from_dict({**GOOD, "atlas": atlas | {"positions": "response"}}).fingerprint() != a
    assert repro_from_dict({**GOOD, "atlas": atlas | {"positions": "after-first"}}).fingerprint() not in (
        a,
        repro_from_dict({**GOOD, "atlas": atlas | {"positions": "response"}}).fingerprint(),
    )
    grown = repro_from_dict(
        {
            **GOOD,
            "seeds": [0, 1, 2],
            "name": "u",
            "reference": "plain",
            "methods": {**GOOD["methods"], "weight-lora": "configs/train/weight-lora.yaml"},
        }
    )
    assert grown.fingerprint() == a  # more seeds and methods, another name or reference: the same units
    assert {m: grown.method_fingerprints()[m] for m in methods} == methods
    assert methods["atlas"] != methods["plain"]
    assert repro_from_dict({**GOOD, "layer": 14}).method_fingerprints()["atlas"] != methods["atlas"]


def test_methods_without_results_are_listed_as_not_run_yet(results):
    import json

    path = results / "experiment.json"
    stored = json.loads(path.read_text())
    methods = CONFIG["methods"] + [{"name": "lora-null", "config": "l"}]
    ResultStore(results, "f" * 64, {**stored["method_fingerprints"], "lora-null": "c" * 64}).check_experiment(
        {**CONFIG, "methods": methods}
    )
    text = write_report(results)
    assert "| atlas vs lora-null | not run yet (lora-null) | | | | |" in text  # every comparison table
    assert (
        text.count("not run yet (lora-null)") == 4
        and "| lora-null |" not in text.split("fixed targets")[1]
        and "Not run yet: lora-null." in text
    )
    assert "| lora-null | - | 0 | not run yet | | | |" in text and "| lora-null | - | - | - |" in text
    assert "Finished runs: 4 of 6" in text and "| atlas vs plain | 11-13 (3) |" in text


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "repro").glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_experiment_config_loads(path):
    config = load_repro_config(path)
    assert config.name and config.methods


def test_atlas_positions_name_each_contexts_first_drawable_position():
    """'all': any; 'response': after the prompt's tokens; 'after-first': all but position 0 (the sink)."""
    from bench.repro.workload import first_positions
    from evaluation.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    prompts = ["<|user|>Add 4 and 5.<|assistant|>", "<|user|>Name a colour.<|assistant|>"]
    texts = [prompts[0] + "4 plus 5 is 9.", prompts[1] + "Red."]
    assert first_positions("all", tok, prompts, texts) is None
    assert first_positions("after-first", tok, prompts, texts) == [1, 1]
    counts = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    assert list(first_positions("response", tok, prompts, texts)) == counts and min(counts) > 1
