"""The reproduction runner on a tiny model: resume after interruption, a finished experiment
re-run does no training or scoring, and the results equal an uninterrupted run's."""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from atlas_core.atlas import AtlasConfig, fit_atlas
from atlas_core.extract import sample_activations
from atlas_core.paths import PROJECT_ROOT
from atlas_core.typed_config import ConfigError
from bench.repro import runner as runner_module
from bench.repro.config import repro_from_dict
from bench.repro.report import write_report
from bench.repro.run import main as run_main
from bench.repro.runner import Budget, Runner
from bench.repro.store import ResultStore, StaleResults
from bench.repro.workload import TargetScore, Workload
from evaluation.answers import Answer
from evaluation.tiny import tiny_llama, tiny_tokenizer
from tests.train_fixtures import toy_pairs

LAYER = 2
CONFIG = {
    "name": "tiny",
    "backbone": "tiny",
    "dtype": "float32",
    "layer": LAYER,
    "rank": 4,
    "methods": {
        "atlas": "configs/train/atlas.yaml",
        "plain": "configs/train/plain.yaml",
        "weight-lora": "configs/train/weight-lora.yaml",
    },
    "reference": "atlas",
    "seeds": [0, 1],
    "epochs": 2,
    "lr_grid": [3e-3, 1e-1],
    "eval": {
        "mbpp_plus_limit": 4,
        "heldout_limit": 4,
        "kl_contexts": 6,
        "churn_questions": 4,
        "kl_batch_size": 4,
        "nll_levels": 3,
    },
}


def _pairs(n: int, seed: int, prefix: str) -> list[dict]:
    return [{"prompt": p, "response": r, "id": f"{prefix}{i}"} for i, (p, r) in enumerate(toy_pairs(n, seed))]


class TinyWorld:
    """Builds the tiny workload and counts what the runner asks of it."""

    def __init__(self):
        self.calls = Counter()

    def __call__(self) -> Workload:
        self.calls["workload"] += 1
        tok = tiny_tokenizer()
        model = tiny_llama(len(tok), layers=4)
        texts = [f"The answer is {i} plus {i + 1}. #### {2 * i + 1}" for i in range(48)]
        x = sample_activations(model, tok, texts, LAYER, 96, progress=False)
        atlas = fit_atlas(x, AtlasConfig(num_charts=4, rank=4, num_vectors=96), meta={"layer": LAYER})
        probe = tok(["def add(a, b):\n    return a + b\n"], return_tensors="pt")
        with torch.no_grad():
            base_loss = float(model(**probe, labels=probe["input_ids"]).loss)

        def score_target(m, _tok) -> TargetScore:  # stands in for generation + EvalPlus
            self.calls["score_target"] += 1
            with torch.no_grad():
                loss = float(m(**probe, labels=probe["input_ids"]).loss)
            solved = max(0, min(40, 5 + int(2000 * (base_loss - loss))))
            ids = [f"Mbpp/{i}" for i in range(solved)]
            return TargetScore(40, solved, solved, ids, ids)

        def answer_retained(m, _tok) -> list:
            self.calls["answers"] += 1
            with torch.no_grad():
                top = [m(**tok([f"Question {i}:"], return_tensors="pt")).logits[0, -1].argmax() for i in range(4)]
            return [Answer(f"q{i}", str(int(t)), int(t) % 2 == 0) for i, t in enumerate(top)]

        contexts = [f"Question: {i} + {i} = ? Answer: {2 * i}. The answer is {2 * i}." for i in range(6)]
        return Workload(
            model,
            tok,
            _pairs(16, 0, "t"),
            _pairs(6, 1, "v"),
            _pairs(4, 2, "h"),
            contexts,
            score_target,
            answer_retained,
            atlas,
            info={"backbone": "tiny"},
            kl_prompts=[c[: c.index(" Answer:") + len(" Answer:")] for c in contexts],
        )


def _run(results: Path, state: Path, world: TinyWorld, minutes: float | None = None) -> bool:
    return Runner(repro_from_dict(CONFIG), results, state, world, Budget(minutes)).run()


def _unit_values(results: Path) -> dict:
    out = {}
    for path in sorted((results / "units").glob("*/*.json")):
        u = json.loads(path.read_text())
        out[path.relative_to(results).as_posix()] = (
            u["mbpp_plus"]["solved"],
            u["heldout_nll"],
            u["kl"]["mean"],
            u["val_loss"],
            u.get("gsm8k_answers"),
        )
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One uninterrupted run of the whole tiny experiment."""
    root = tmp_path_factory.mktemp("uninterrupted")
    world = TinyWorld()
    assert _run(root / "results", root / "state", world)
    return root, world


def test_full_run_stores_every_unit(finished):
    root, world = finished
    results = root / "results"
    units = _unit_values(results)
    assert len(units) == 3 * 2 * 2  # methods x seeds x epochs (one checkpoint per epoch)
    assert world.calls["score_target"] == len(units) + 1  # + the base model, nothing scored twice
    assert world.calls["answers"] == 3 * 2 + 1  # final checkpoints + base
    base = json.loads((results / "base.json").read_text())
    assert base["kl"]["mean"] == 0.0  # the zero residual is exactly the base model
    for method in ("atlas", "plain", "weight-lora"):
        lr = json.loads((results / "lr" / f"{method}.json").read_text())
        sweeps = {float(k): v for k, v in lr["val_loss"].items()}
        assert lr["best_lr"] == min(sweeps, key=sweeps.get)
        for seed in (0, 1):
            kls = [
                json.loads((results / "units" / method / f"seed{seed}-step{s:06d}.json").read_text())["kl"]["mean"]
                for s in (2, 4)
            ]
            assert all(k > 0 for k in kls)  # training moved the retained outputs
    # Every unit keeps each context's KL and both again by position kind (prompt + response = all).
    for path in (results / "units").glob("*/*.json"):
        kl = json.loads(path.read_text())["kl"]
        prompt, response = kl["by_kind"]["prompt"], kl["by_kind"]["response"]
        assert len(kl["per_context"]) == len(prompt["per_context"]) == len(response["per_context"]) == 6
        assert prompt["positions"] + response["positions"] == kl["positions"] and prompt["positions"] > 0
        weighted = prompt["mean"] * prompt["positions"] + response["mean"] * response["positions"]
        assert weighted == pytest.approx(kl["mean"] * kl["positions"], rel=1e-9)
        # seed 0 at the chosen rate is that rate's sweep run; seed 1 trains at the chosen rate only
        runs = root / "state" / "runs" / method
        assert sorted(p.name for p in (runs / "seed0").iterdir() if p.is_dir()) == ["lr-0.003", "lr-0.1"]
        assert [p.name for p in (runs / "seed1").iterdir()] == [f"lr-{lr['best_lr']:g}"]


def test_finished_experiment_rerun_does_no_work_and_same_report(finished, monkeypatch):
    root, _ = finished
    results = root / "results"
    first = write_report(results)

    def refuse(*_a, **_k):
        raise AssertionError("a finished experiment must not train or score")

    monkeypatch.setattr(runner_module, "train", refuse)
    world = TinyWorld()
    before = {p: p.read_bytes() for p in results.rglob("*.json")}
    assert _run(results, root / "state", world)
    assert world.calls == Counter()  # not even the model was loaded
    assert {p: p.read_bytes() for p in results.rglob("*.json")} == before
    assert write_report(results) == first
    assert "| atlas vs plain |" in first and "| atlas vs weight-lora |" in first


def test_budget_stops_and_resume_reproduces_uninterrupted_results(finished, tmp_path):
    root, _ = finished
    world = TinyWorld()
    sessions = 0
    while True:
        scored = world.calls["score_target"]
        if _run(tmp_path / "results", tmp_path / "state", world, minutes=0.0):  # stop after every unit
            break
        sessions += 1
        assert sessions < 60
        # A stop never falls between a run's last scored checkpoint and its record.
        results = tmp_path / "results"
        for final in results.glob("units/*/*.json"):
            unit = json.loads(final.read_text())
            if unit["final"]:
                assert (results / "runs" / f"{unit['method']}-seed{unit['seed']}.json").is_file()
        for method in CONFIG["methods"]:  # nor between a method's last sweep run and its rate choice
            if all((results / "sweep" / method / f"lr-{lr:g}.json").is_file() for lr in CONFIG["lr_grid"]):
                assert (results / "lr" / f"{method}.json").is_file()
    assert sessions > 10  # it really was cut into many sessions
    assert world.calls["score_target"] > scored  # the session that stores the last unit says it is complete
    assert world.calls["score_target"] == 3 * 2 * 2 + 1  # no unit was scored twice
    assert _unit_values(tmp_path / "results") == _unit_values(root / "results")


def test_killed_between_checkpoint_and_score_is_scored_on_resume(finished, tmp_path):
    root, _ = finished
    world = TinyWorld()
    original = world.__call__

    def dying():
        w = original()
        inner = w.score_target

        def score(m, tok):
            if world.calls["score_target"] == 3:  # base + 2 scored, then the session dies mid-unit
                raise KeyboardInterrupt
            return inner(m, tok)

        w.score_target = score
        return w

    with pytest.raises(KeyboardInterrupt):
        Runner(repro_from_dict(CONFIG), tmp_path / "results", tmp_path / "state", dying, Budget(None)).run()
    assert _run(tmp_path / "results", tmp_path / "state", world)
    assert _unit_values(tmp_path / "results") == _unit_values(root / "results")


def test_lost_state_dir_retrains_but_does_not_rescore(finished, tmp_path):
    root, _ = finished
    world = TinyWorld()
    shutil.copytree(root / "results", tmp_path / "results")
    for path in (tmp_path / "results" / "units" / "plain").glob("seed1-step000004.json"):
        path.unlink()  # the last unit of one run is missing, and the state dir is empty
    (tmp_path / "results" / "runs" / "plain-seed1.json").unlink()
    assert _run(tmp_path / "results", tmp_path / "state", world)
    assert world.calls["score_target"] == 1  # only the missing unit
    assert _unit_values(tmp_path / "results") == _unit_values(root / "results")


def test_train_seconds_cover_the_training_of_their_checkpoint_and_only_that(tmp_path, monkeypatch):
    """Every trained checkpoint's `train` lap holds its training; a first seed's run scores the
    checkpoints its sweep wrote at the chosen rate, which cost no training then, so they have none."""
    real_train, pause = runner_module.train, 0.3

    def slow_train(*args, on_checkpoint, **kwargs):
        def checkpoint(path, state):
            time.sleep(pause)  # stands in for the training steps before this checkpoint
            on_checkpoint(path, state)

        return real_train(*args, on_checkpoint=checkpoint, **kwargs)

    monkeypatch.setattr(runner_module, "train", slow_train)
    config = repro_from_dict({**CONFIG, "methods": {"plain": CONFIG["methods"]["plain"]}, "reference": "plain"})
    assert Runner(config, tmp_path / "results", tmp_path / "state", TinyWorld(), Budget(None)).run()
    units = [json.loads(p.read_text()) for p in sorted((tmp_path / "results" / "units" / "plain").glob("*.json"))]
    assert {u["seed"] for u in units} == {0, 1}
    for u in units:
        if u["seed"] == 0:
            assert "train" not in u["seconds"] and "train" not in u["cpu_seconds"]
        else:
            assert u["seconds"]["train"] >= pause


def test_other_configuration_is_refused(finished, tmp_path):
    root, _ = finished
    shutil.copytree(root / "results", tmp_path / "results")
    changed = {**CONFIG, "epochs": 3}
    with pytest.raises(StaleResults, match="another configuration"):
        Runner(repro_from_dict(changed), tmp_path / "results", tmp_path / "state", TinyWorld(), Budget(None)).run()


def test_added_method_and_seed_train_only_what_is_new(finished, tmp_path, monkeypatch):
    root, _ = finished
    shutil.copytree(root / "results", tmp_path / "results")
    before = {p: p.read_bytes() for p in (tmp_path / "results").rglob("*.json") if p.name != "experiment.json"}
    grown = {**CONFIG, "methods": {**CONFIG["methods"], "centered": "configs/train/centered.yaml"}}
    world = TinyWorld()
    assert Runner(repro_from_dict(grown), tmp_path / "results", tmp_path / "state", world, Budget(None)).run()
    assert world.calls["score_target"] == 2 * 2  # centered's 2 seeds x 2 checkpoints, nothing else
    assert all(p.read_bytes() == b for p, b in before.items())  # the other methods' files: untouched, valid
    assert "| atlas vs centered |" in write_report(tmp_path / "results")
    trained = []
    monkeypatch.setattr(runner_module.Runner, "run_one", lambda self, m, seed, lr: trained.append((m, seed)))
    Runner(
        repro_from_dict({**grown, "seeds": [0, 1, 2]}),
        tmp_path / "results",
        tmp_path / "state",
        TinyWorld(),
        Budget(None),
    ).run()
    assert trained == [(m, 2) for m in grown["methods"]]  # a new seed: only its runs, no sweep again


def test_methods_option_trains_only_the_named_methods_new_seeds(finished, tmp_path):
    root, _ = finished
    shutil.copytree(root / "results", tmp_path / "results")
    config = repro_from_dict({**CONFIG, "seeds": [0, 1, 2]})
    with pytest.raises(ConfigError, match="'lora'"):  # a misspelt name: refused before any work
        Runner(config, tmp_path / "results", tmp_path / "state", TinyWorld(), Budget(None)).run(["lora"])
    world = TinyWorld()
    runner = Runner(config, tmp_path / "results", tmp_path / "state", world, Budget(None))
    assert runner.run(["plain"])  # complete for the method it was asked to run
    assert world.calls["score_target"] == 2  # plain's seed 2 (2 checkpoints), nothing of atlas or weight-lora
    store = ResultStore.of(config, tmp_path / "results")
    assert store.run_done("plain", 2) and not store.run_done("atlas", 2) and not store.run_done("weight-lora", 2)
    assert not runner.complete()  # the experiment as a whole still misses their seed 2


def test_scoring_uses_the_workload_of_the_current_run(tmp_path):
    runner = Runner(repro_from_dict(CONFIG), tmp_path / "results", tmp_path / "state", TinyWorld(), Budget(None))
    runner.w = runner.make_workload()
    first = runner.scorer
    assert runner.scorer is first  # its caches (prefix caches, KL reference) kept while the workload is
    runner.w = runner.make_workload()  # what each run() does: a second call has a new model
    assert runner.scorer is not first and runner.scorer.w is runner.w


def test_run_command_refuses_an_unknown_method_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        run_main(
            [
                "--config",
                str(PROJECT_ROOT / "configs/repro/smollm2.yaml"),
                "--results",
                str(tmp_path),
                "--methods",
                "lora",
            ]
        )
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "methods: ['lora'] are not among this experiment's methods" in error and "weight-lora" in error
    assert not any(tmp_path.iterdir())  # refused before anything was recorded


def test_atlas_refit_on_another_cpu_is_accepted_only_if_it_is_the_same_fit(tmp_path):
    # A fresh state dir on another CPU refits the atlas with other SIMD rounding: another
    # sha256, the same partition. Another partition (or plan) must still be refused.
    store = ResultStore(tmp_path, "f" * 64)
    store.check_experiment({"name": "x"})
    meta = {"layer": 2, "chart_sizes": [3, 5], "inertia": 1000.0, "config": {"num_charts": 2}}
    store.record_atlas("a" * 64, meta)
    store.record_atlas("b" * 64, {**meta, "inertia": 1000.001})
    store.record_atlas("b" * 64, meta)  # seen before: recorded once
    stored = json.loads((tmp_path / "experiment.json").read_text())
    assert stored["atlas_sha256"] == "a" * 64 and stored["config"] == {"name": "x"}
    assert [r["sha256"] for r in stored["atlas_refits"]] == ["b" * 64]
    with pytest.raises(StaleResults, match="chart_sizes"):
        store.record_atlas("c" * 64, {**meta, "chart_sizes": [4, 4]})
    with pytest.raises(StaleResults, match="inertia"):
        store.record_atlas("c" * 64, {**meta, "inertia": 1000.1})
    assert json.loads((tmp_path / "experiment.json").read_text()) == stored  # refusals change nothing


def _strip_split(results: Path, method: str, seed: int) -> dict:
    """Rewrite a run's units as they were stored before the split (KL as one mean); returns the
    split each one had, by step."""
    before = {}
    for path in sorted((results / "units" / method).glob(f"seed{seed}-*.json")):
        unit = json.loads(path.read_text())
        before[unit["step"]] = unit["kl"]
        unit["kl"] = {k: unit["kl"][k] for k in ("mean", "positions", "contexts")}
        path.write_text(json.dumps(unit))
    return before


def test_kl_split_replay_adds_the_split_of_the_scored_run(finished, tmp_path):
    """A replay retrains the run and stores the split KL next to the stored mean: the same
    checkpoints, so the same mean and the same split a run scored with the split has."""
    from bench.repro.kl_split import KLReplay

    root, _ = finished
    results = tmp_path / "results"
    shutil.copytree(root / "results", results)
    before = _strip_split(results, "atlas", 0)
    world = TinyWorld()
    replay = KLReplay(repro_from_dict(CONFIG), results, tmp_path / "state", world)
    assert replay.replay("atlas", 0) == 2
    for step, original in before.items():
        unit = json.loads((results / "units" / "atlas" / f"seed0-step{step:06d}.json").read_text())
        split = unit["kl_split"]
        assert "by_kind" not in unit["kl"] and unit["kl"]["mean"] == original["mean"]  # the stored is kept
        assert split["mean"] == pytest.approx(original["mean"], rel=1e-6)
        for kind in ("prompt", "response"):
            assert split["by_kind"][kind]["mean"] == pytest.approx(original["by_kind"][kind]["mean"], rel=1e-6)
        assert split["replay_val_loss"] == pytest.approx(unit["val_loss"], rel=1e-9)
    assert replay.replay("atlas", 0) == 0  # resumable: nothing left to add
    assert world.calls == Counter(workload=1)  # KL only: no MBPP+, no answers


def test_kl_split_replay_of_another_run_is_refused(finished, tmp_path):
    from bench.repro.kl_split import KLReplay, ReplayMismatch

    root, _ = finished
    results = tmp_path / "results"
    shutil.copytree(root / "results", results)
    _strip_split(results, "plain", 1)
    path = results / "units" / "plain" / "seed1-step000002.json"
    unit = json.loads(path.read_text())
    unit["val_loss"] *= 1.01  # as if another training had been scored
    path.write_text(json.dumps(unit))
    with pytest.raises(ReplayMismatch, match="validation loss"):
        KLReplay(repro_from_dict(CONFIG), results, tmp_path / "state", TinyWorld()).replay("plain", 1)
    assert "kl_split" not in json.loads(path.read_text())


def test_rates_chosen_by_the_objective_s_own_validation_loss_are_recorded_with_both(tmp_path):
    """lr_select: objective: TALR's sweep runs store its own validation losses next to CE's, its rate
    record names both choices and the scored run trains at the own-objective one; a CE method's
    record is as under lr_select: ce."""
    config = repro_from_dict(
        {
            **CONFIG,
            "methods": {"plain": "configs/train/plain.yaml", "talr": "configs/train/talr.yaml"},
            "reference": "plain",
            "seeds": [0],
            "epochs": 1,
            "lr_select": "objective",
        }
    )
    assert Runner(config, tmp_path / "results", tmp_path / "state", TinyWorld(), Budget(None)).run()
    store = ResultStore.of(config, tmp_path / "results")
    rate = store.read(store.lr_path("talr"))
    assert rate["select"] == "objective" and set(rate["chosen"]) == {"ce", "objective"}
    own = {float(k): v for k, v in rate["val_objective"].items()}
    assert rate["best_lr"] == rate["chosen"]["objective"] == min(own, key=own.get)
    for lr in CONFIG["lr_grid"]:
        sweep = store.read(store.sweep_path("talr", lr))
        assert sweep["best_val_objective"] == min(sweep["val_objective"].values()) == own[lr]
    assert store.read(store.run_path("talr", 0))["lr"] == rate["best_lr"]
    plain = store.read(store.lr_path("plain"))
    assert "chosen" not in plain and "val_objective" not in store.read(store.sweep_path("plain", 3e-3))


class ChatWorld(TinyWorld):
    """TinyWorld whose KL contexts are chat-rendered (prompt + assistant header + answer), as the real
    workload's; `plain_contexts` keeps TinyWorld's, which no header ends."""

    def __init__(self, plain_contexts: bool = False):
        super().__init__()
        self.plain_contexts = plain_contexts

    def __call__(self) -> Workload:
        w = super().__call__()
        if not self.plain_contexts:
            tok = w.tokenizer
            prompts = [
                tok.apply_chat_template(
                    [{"role": "user", "content": f"{i} + {i} = ?"}], tokenize=False, add_generation_prompt=True
                )
                for i in range(6)
            ]
            w.kl_contexts, w.kl_prompts = (
                [p + f"{2 * i}. The answer is {2 * i}." for i, p in enumerate(prompts)],
                prompts,
            )
        self.model = w.model
        return w


def test_answer_only_updates_leave_every_prompt_position_s_kl_at_zero(tmp_path):
    """update_positions: answer: no method changes a prompt position (KL there exactly 0), every
    method still moves the answer positions, and the gates leave the model without hooks."""
    config = repro_from_dict({**CONFIG, "seeds": [0], "epochs": 1, "update_positions": "answer"})
    world = ChatWorld()
    assert Runner(config, tmp_path / "results", tmp_path / "state", world, Budget(None)).run()
    units = [json.loads(p.read_text()) for p in sorted((tmp_path / "results" / "units").glob("*/*.json"))]
    assert len(units) == 3
    for u in units:
        kinds = u["kl"]["by_kind"]
        assert kinds["prompt"]["mean"] == 0.0 and kinds["response"]["mean"] > 0, u["method"]
    embed, head = world.model.get_input_embeddings(), world.model.get_output_embeddings()
    assert not embed._forward_pre_hooks and not head._forward_pre_hooks
    with pytest.raises(ValueError, match=r"kl_contexts\[0\]: the assistant header ends its prompt after 0 tokens"):
        Runner(config, tmp_path / "r2", tmp_path / "s2", ChatWorld(plain_contexts=True), Budget(None)).run()
