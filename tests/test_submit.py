"""Adapters trained elsewhere join a line: `atlas submit` + `atlas gate check` on a tiny line.

The line `ext` has champion v1 = base + an ATLAS residual (one update cycle). A person then
trains on top of it with PEFT, as the README documents: load_release -> get_peft_model (LoRA on
q_proj / v_proj of every layer and on one MLP projection, per-module rank and alpha, rsLoRA)
-> a few optimiser steps -> save_pretrained -> atlas submit -> atlas gate check --promote.
The new champion must then be that trained PeftModel on every path a user serves it from.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.flows_fixtures import ledger_counts, use_state, write_yaml

MODEL = "tiny-llama.ext"
RETAINED = {
    "domains": ["gsm8k", "csqa"],
    "kl_contexts": 6,
    "kl_max_tokens": 128,
    "gsm8k_questions": 2,
    "csqa_questions": 6,
    "max_new_tokens": 4,
    "batch_size": 4,
    "generation_batch_size": 2,
    "replay_examples": 8,
}
BASE = {
    "backbone": "tiny-llama",
    "dtype": "float32",
    "layer": 2,
    "line": "ext",
    "retained": RETAINED,
    "atlas": {"num_vectors": 64, "charts": 4, "rank": 4},
    "train": {"epochs": 1, "lr": 1.0e-2, "batch_size": 4, "max_length": 512, "on_bad_example": "truncate"},
}
CODE = BASE | {
    "name": "a",
    "skill": "a",
    "data": {"source": "mbpp", "train_limit": 8, "val_limit": 4},
    "target": {"scorer": "reference-nll", "options": {"source": "mbpp", "limit": 4}},
}
MATH = BASE | {
    "name": "b",
    "skill": "b",
    "data": {"source": "gsm8k", "train_limit": 8, "val_limit": 4},
    "target": {"scorer": "reference-nll", "options": {"source": "gsm8k", "limit": 4}},
}
POLICY = {
    "name": "loose",
    "candidates": {"methods": ["atlas"], "seeds": [0]},
    "min_target_gain": 0,
    "max_kl_vs_champion": {"gsm8k": 50.0, "csqa": 50.0, "released": 50.0},
    "max_kl_vs_base": {"gsm8k": 50.0, "csqa": 50.0},
    "nfr": {"max_vs_champion": {"gsm8k": 1.0, "csqa": 1.0}, "max_vs_base": {"gsm8k": 1.0, "csqa": 1.0}},
    "no_regression": {"released": {"tolerance": 1000.0, "min_n": 2}},
}
TOL = dict(rtol=0, atol=1e-5)  # fp32: hooks and PEFT's layers sum the same terms in another order


@pytest.fixture(scope="module")
def line(prefect_harness, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ext")
    with pytest.MonkeyPatch.context() as mp:
        use_state(mp, tmp / "state")
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'state' / 'mlflow' / 'mlflow.db'}")
        from flows.update import update

        first = update(write_yaml(tmp / "a.yaml", CODE), write_yaml(tmp / "p.yaml", POLICY))
        assert first.promoted, first
        yield {
            "state": tmp / "state",
            "v1": first.champion,
            "tmp": tmp,
            "config": write_yaml(tmp / "b.yaml", MATH),
            "policy": str(tmp / "p.yaml"),
        }


def _ids() -> torch.Tensor:
    return torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(3))


def train_with_peft(out: Path, version: str = "champion", **lora) -> torch.Tensor:
    """What a user does: LoRA with PEFT on top of a release, a few steps, save; returns its logits."""
    from peft import LoraConfig, get_peft_model

    from flows import load_release

    release = load_release(MODEL, version, dtype="float32")
    options = dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "model.layers.1.mlp.up_proj"],
        rank_pattern={"v_proj": 2},
        alpha_pattern={"up_proj": 3},
        use_rslora=True,
        lora_dropout=0.0,
    )
    model = get_peft_model(release.model, LoraConfig(**(options | lora)))
    optimiser = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    ids = torch.randint(3, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimiser.step()
        optimiser.zero_grad()
    model.eval()
    model.save_pretrained(out)
    with torch.no_grad():
        return model(_ids()).logits


def atlas(*argv: str) -> int:
    from flows.cli import main

    return main(list(argv))


def test_a_peft_lora_trained_on_the_champion_is_submitted_gated_promoted_and_served(
    line, tmp_path, capsys, monkeypatch
):
    from peft import PeftModel

    import evaluation.tasks
    from flows import load_release

    want = train_with_peft(tmp_path / "adapter")
    assert atlas("submit", str(tmp_path / "adapter"), "--line", MODEL, "--skill", "b", "--json") == 0
    submitted = json.loads(capsys.readouterr().out)
    assert submitted["parent"] == line["v1"] and submitted["kind"] == "peft-lora" and submitted["new"]
    name = submitted["version"]
    # Submitting the same adapter onto the same parent again records nothing.
    counts = ledger_counts(line["state"])
    assert atlas("submit", str(tmp_path / "adapter"), "--line", MODEL, "--skill", "b", "--json") == 0
    assert json.loads(capsys.readouterr().out)["version"] == name and ledger_counts(line["state"]) == counts

    decode, batchings = evaluation.tasks.eval_gsm8k, []
    monkeypatch.setattr(
        evaluation.tasks, "eval_gsm8k", lambda *a, **k: batchings.append(k["batch_size"]) or decode(*a, **k)
    )
    code = atlas("gate", "check", name, "--config", line["config"], "--policy", line["policy"], "--promote", "--json")
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["passed"] and result["promoted"] and result["champion"] == name, result
    names = {c["name"] for c in result["checks"]}
    assert {
        "target_gain_vs_champion",
        "kl_vs_champion[csqa]",
        "kl_vs_base[csqa]",
        "kl_vs_champion[a]",
        "no_regression[a]",
    } <= names  # the released skill a is kept like for a trained candidate

    _the_skill_it_passed_with_is_kept_for_later_cycles(line, name)
    ids = _ids()
    champion = load_release(MODEL, "champion", dtype="float32")
    assert [d["name"] for d in champion.manifest["chain"]] == [line["v1"], name]
    with torch.no_grad():
        torch.testing.assert_close(champion.model(ids).logits, want, **TOL)
        served = load_release(f"models:/{MODEL}@champion", dtype="float32")  # the MLflow pyfunc's release
        torch.testing.assert_close(served.model(ids).logits, want, **TOL)
    out = tmp_path / "peft-export"
    assert (
        atlas("export", "champion", "--model", MODEL, "--format", "peft", "--since", line["v1"], "--out", str(out)) == 0
    )
    parent = load_release(MODEL, line["v1"], dtype="float32")
    with torch.no_grad():
        torch.testing.assert_close(PeftModel.from_pretrained(parent.model, out)(ids).logits, want, **TOL)

    kl = next(c["measured"] for c in result["checks"] if c["name"] == "kl_vs_champion[csqa]")
    assert sorted(batchings) == [1, 2]  # the candidate as configured; the champion again at half the batch
    _noise_floor_is_zero_in_fp32(line, result)
    v1 = load_release(MODEL, line["v1"], dtype="float32").model  # parent.model now holds PEFT's LoRA layers
    assert kl == pytest.approx(whole_forward_kl(line, v1, champion.model), rel=1e-4, abs=1e-7)

    capsys.readouterr()
    assert atlas("history", "--model", MODEL) == 0
    history = capsys.readouterr().out
    row = next(r for r in history.splitlines() if name in r and "promote" in r)
    assert "submitted peft" in row and line["v1"] in row  # its source, and v1 as what it replaced
    assert str((tmp_path / "adapter").resolve()) in row
    assert atlas("compare", "--model", MODEL, line["v1"], name) == 0
    assert f"B = {name} (submitted peft sha256:{submitted['sha256'][:12]}" in capsys.readouterr().out
    assert atlas("gate", "--model", MODEL, "--explain", name) == 0


def _the_skill_it_passed_with_is_kept_for_later_cycles(line, name: str) -> None:
    """A passing submitted version's run records the config's skill spec: the next cycle of another
    skill finds both skills of the chain (flows.lineage.chain_skill_specs) and keeps them."""
    from flows.cycle import Applied
    from flows.lineage import chain_skill_specs
    from registry import default_ledger_url, get_version, init_db, version_chain

    with init_db(default_ledger_url(line["state"])) as ledger:
        v = get_version(ledger, _version_id(line, name))
        specs = chain_skill_specs(ledger, Applied(v, tuple(version_chain(ledger, v.id))))
    assert [s["name"] for s in specs] == ["a", "b"] and specs[1]["target"]["options"]["source"] == "gsm8k"


def _noise_floor_is_zero_in_fp32(line, result: dict) -> None:
    """The champion (v1) re-decoded in another batching (GSM8K one question at a time instead of
    two, CSQA in whole forwards of 2 instead of prefix states in 4) answers in fp32 exactly as in
    the gate's: its noise floor is F = G = W = 0, shown beside the candidate's flips, and its
    re-decoded answers are stored (once per champion) under <dataset>#b<batch>."""
    from registry import default_ledger_url, get_answers, init_db

    for domain, n in (("gsm8k", RETAINED["gsm8k_questions"]), ("csqa", RETAINED["csqa_questions"])):
        check = next(c for c in result["checks"] if c["name"] == f"nfr_upper_vs_champion[{domain}]")
        assert "noise floor F=0 G=0 W=0" in check["detail"], check
    with init_db(default_ledger_url(line["state"])) as ledger:
        stored = {d for d, _ in get_answers(ledger, _version_id(line, line["v1"]))}
    assert {"gsm8k@4tok#b1", "csqa-choice#b2"} <= stored, stored
    report = Path(result["report"]).read_text().split("## Answer flips and the noise floor")[1]
    row = next(r for r in report.splitlines() if r.startswith(f"| {result['version']} | csqa |"))
    assert row.endswith(f"| 0/0/0 of {RETAINED['csqa_questions']} |"), row


@torch.no_grad()
def whole_forward_kl(line, reference, model) -> float:
    """KL(reference || model) per token over the gate's csqa contexts, by whole forwards: the
    submitted LoRA changes layer 0, so no prefix below it may be cached (ctx.kl_layer = -1)."""
    import torch.nn.functional as F

    from flows.config import load_update_config
    from flows.lineage import resolve_lineage
    from flows.platform import PlatformRef
    from flows.policy import load_policy
    from flows.resources import scope

    cfg, ref = load_update_config(line["config"]), PlatformRef.from_environment()
    with scope(ref) as res:
        texts = res.gate_texts(resolve_lineage(cfg, load_policy(line["policy"]), ref), "csqa")
        tokenizer = res.load_backbone("tiny-llama", "float32").tokenizer
    total, positions = 0.0, 0
    for text in texts:
        ids = torch.tensor(
            [
                tokenizer(text, add_special_tokens=False, truncation=True, max_length=RETAINED["kl_max_tokens"])[
                    "input_ids"
                ]
            ]
        )
        ref, got = (F.log_softmax(m(ids).logits.float(), dim=-1) for m in (reference, model))
        total += float(F.kl_div(got, ref, log_target=True, reduction="sum"))
        positions += ids.shape[1]
    return total / positions


def test_lora_options_are_applied_as_peft_applies_them(line, tmp_path):
    """rank_pattern, alpha_pattern and rsLoRA: the frozen delta's scaling per module is PEFT's own."""
    from peft import PeftModel

    from atlas_core.peft_lora import from_peft_folder
    from evaluation.tiny import load_model

    train_with_peft(tmp_path / "adapter", version="base")
    base = load_model("tiny-llama", "float32").model
    lora_set = from_peft_folder(tmp_path / "adapter", base)
    peft_model = PeftModel.from_pretrained(load_model("tiny-llama", "float32").model, tmp_path / "adapter")
    theirs = {
        name.removeprefix("base_model.model."): m.scaling["default"]
        for name, m in peft_model.named_modules()
        if isinstance(getattr(m, "scaling", None), dict)
    }  # LoRA layers (attention's scaling is a float)
    ours = {lora.module_name: lora.scaling for lora in lora_set.loras}
    assert ours == pytest.approx(theirs) and len(ours) == 4 * 2 + 1
    assert {lora.layer for lora in lora_set.loras} == {0, 1, 2, 3} and lora_set.layer == 0


def _refused(capsys, *argv: str) -> str:
    assert atlas(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_submissions_get_one_line_and_write_nothing(line, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    from evaluation.tiny import tiny_llama, tiny_tokenizer

    good = tmp_path / "good"
    train_with_peft(good)
    counts, stored = ledger_counts(line["state"]), sorted((line["state"] / "artifacts").rglob("*"))

    other = get_peft_model(
        tiny_llama(len(tiny_tokenizer()), seed=0, hidden_size=32, layers=4), LoraConfig(r=2, target_modules=["q_proj"])
    )
    other.save_pretrained(tmp_path / "shapes")
    assert "is not a Linear of shape" in _refused(capsys, "submit", str(tmp_path / "shapes"), "--line", MODEL)

    for option, value in (
        ("use_dora", True),
        ("lora_bias", True),
        ("modules_to_save", ["lm_head"]),
        ("init_lora_weights", "pissa"),
        ("fan_in_fan_out", True),
    ):
        folder = tmp_path / option
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
        config = json.loads((good / "adapter_config.json").read_text()) | {option: value}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        assert option in _refused(capsys, "submit", str(folder), "--line", MODEL)

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    assert "adapter_config.json" in _refused(capsys, "submit", str(missing), "--line", MODEL)

    # The platform's own delta file and a release folder carry sha256s: one flipped byte is refused.
    from atlas_core.peft_lora import from_peft_folder
    from evaluation.tiny import load_model

    delta = tmp_path / "delta" / "d.safetensors"
    from_peft_folder(good, load_model("tiny-llama", "float32").model).save(delta)
    raw = bytearray(delta.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    delta.write_bytes(bytes(raw))
    assert "sha256 mismatch" in _refused(capsys, "submit", str(delta), "--line", MODEL)

    assert "--line: expected letters" in _refused(capsys, "submit", str(good), "--line", "no such/line")
    assert "matches 0 versions" in _refused(capsys, "submit", str(good), "--line", MODEL, "--parent", "v9")
    assert ledger_counts(line["state"]) == counts
    assert sorted((line["state"] / "artifacts").rglob("*")) == stored


def _version_id(line, name: str) -> int:
    from registry import default_ledger_url, get_model, init_db, resolve_version

    with init_db(default_ledger_url(line["state"])) as ledger:
        return resolve_version(ledger, get_model(ledger, MODEL).id, name).id


def test_gate_check_refuses_bad_input_before_anything_runs(line, tmp_path, capsys):
    counts = ledger_counts(line["state"])
    assert "teaches skill" in _refused(
        capsys,
        "gate",
        "check",
        f"#{_version_id(line, line['v1'])}",
        "--config",
        line["config"],
        "--policy",
        line["policy"],
    )
    assert "is the base" in _refused(
        capsys, "gate", "check", "base", "--config", line["config"], "--policy", line["policy"]
    )
    assert "matches 0 versions" in _refused(
        capsys, "gate", "check", "v9", "--config", line["config"], "--policy", line["policy"]
    )
    assert "no-such.yaml" in _refused(
        capsys, "gate", "check", "x", "--config", line["config"], "--policy", str(tmp_path / "no-such.yaml")
    )
    assert ledger_counts(line["state"]) == counts


def test_a_lora_only_chain_exports_merged_and_peft_and_every_source_form_is_one_version(line, tmp_path, capsys):
    """A LoRA submitted onto the base: merged weights and one PEFT adapter give the trained model;
    the same delta from an MLflow run URI or a release folder is the version already recorded."""
    import mlflow
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from evaluation.tiny import load_model

    want = train_with_peft(tmp_path / "adapter", version="base")
    assert (
        atlas(
            "submit",
            str(tmp_path / "adapter"),
            "--line",
            MODEL,
            "--parent",
            "base",
            "--skill",
            "b",
            "--name",
            "lora-only",
            "--json",
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["version"] == "lora-only"
    assert "has that name already" in _refused(
        capsys, "submit", str(tmp_path / "adapter"), "--line", MODEL, "--parent", line["v1"], "--name", "lora-only"
    )
    ids = _ids()
    for fmt in ("merged", "peft"):
        assert atlas("export", "lora-only", "--model", MODEL, "--format", fmt, "--out", str(tmp_path / fmt)) == 0
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32)
        torch.testing.assert_close(merged(ids).logits, want, **TOL)
        peft = PeftModel.from_pretrained(load_model("tiny-llama", "float32").model, tmp_path / "peft")
        torch.testing.assert_close(peft(ids).logits, want, **TOL)

    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(tmp_path / "adapter"), "adapter")
    from atlas_core.peft_lora import from_peft_folder

    delta = tmp_path / "delta" / "lora.safetensors"  # the platform's own delta file of the same adapter
    from_peft_folder(tmp_path / "adapter", load_model("tiny-llama", "float32").model).save(delta)
    assert atlas("export", "lora-only", "--model", MODEL, "--format", "folder", "--out", str(tmp_path / "folder")) == 0
    capsys.readouterr()
    counts = ledger_counts(line["state"])
    for source in (f"runs:/{run.info.run_id}/adapter", str(tmp_path / "folder"), str(delta)):
        assert atlas("submit", source, "--line", MODEL, "--parent", "base", "--skill", "b", "--json") == 0
        again = json.loads(capsys.readouterr().out)
        assert again["version"] == "lora-only" and not again["new"], (source, again)
    assert ledger_counts(line["state"]) == counts


def test_the_first_adapter_of_a_new_line_starts_it_on_the_base(line, tmp_path, capsys):
    from flows import load_release

    want = train_with_peft(tmp_path / "adapter", version="base")
    assert "first adapter sits on the base" in _refused(
        capsys, "submit", str(tmp_path / "adapter"), "--backbone", "tiny-llama", "--line", "fresh", "--parent", "v1"
    )
    assert atlas("submit", str(tmp_path / "adapter"), "--backbone", "tiny-llama", "--line", "fresh", "--json") == 0
    made = json.loads(capsys.readouterr().out)
    assert made["model"] == "tiny-llama.fresh" and made["parent"] == "tiny-llama-base" and made["new"]
    with torch.no_grad():
        got = load_release("tiny-llama.fresh", made["version"], dtype="float32").model(_ids()).logits
    torch.testing.assert_close(got, want, **TOL)


def test_an_atlas_residual_joins_from_a_release_folder_or_as_a_delta_file_whose_atlas_is_known(line, tmp_path, capsys):
    """v1's ATLAS residual exported as a release folder and submitted onto the base is v1's model
    again; its bare delta file is the same version (its atlas is in the ledger now); a delta file
    routing with an atlas nobody recorded is refused, naming the way that works."""
    from flows import load_release

    assert atlas("export", line["v1"], "--model", MODEL, "--format", "folder", "--out", str(tmp_path / "v1")) == 0
    capsys.readouterr()
    assert (
        atlas(
            "submit",
            str(tmp_path / "v1"),
            "--line",
            MODEL,
            "--parent",
            "base",
            "--skill",
            "a",
            "--name",
            "a-again",
            "--json",
        )
        == 0
    )
    made = json.loads(capsys.readouterr().out)
    assert made["kind"] == "adapter" and made["version"] == "a-again" and made["new"]
    ids = _ids()
    with torch.no_grad():
        want = load_release(MODEL, line["v1"], dtype="float32").model(ids).logits
        got = load_release(MODEL, "a-again", dtype="float32").model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    delta = next((tmp_path / "v1" / "deltas").glob("*.safetensors"))
    assert atlas("submit", str(delta), "--line", MODEL, "--parent", "base", "--skill", "a", "--json") == 0
    again = json.loads(capsys.readouterr().out)
    assert again["version"] == "a-again" and not again["new"]

    manifest = json.loads(delta.with_suffix(".json").read_text()) | {"atlas_sha256": "0" * 64}
    delta.with_suffix(".json").write_text(json.dumps(manifest))
    assert "submit a release folder" in _refused(capsys, "submit", str(delta), "--line", MODEL, "--parent", "base")
