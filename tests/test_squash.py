"""`atlas squash`: a line's chain of LoRA deltas as one delta, recorded as a candidate and gated.

The line `sq` of the tiny model: a PEFT LoRA trained on the base (skill a), then one trained on
top of it (skill b), each submitted and promoted through the gate. The exact squash must give the
chain's logits; a truncated one its rank and a positive KL vs the chain; the exact squash, gated
with a tight policy, becomes the champion and still keeps skill a as a released skill.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.flows_fixtures import ledger_counts, use_state, write_yaml
from tests.test_submit import CODE, MATH, POLICY, TOL, _ids

MODEL = "tiny-llama.sq"
SQUASH_POLICY = POLICY | {
    "name": "squash",
    "min_target_gain": -0.01,
    "max_kl_vs_champion": {"gsm8k": 1e-4, "csqa": 1e-4, "released": 1e-4},
}


def atlas(*argv: str) -> int:
    from flows.cli import main

    return main(list(argv))


def atlas_json(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert atlas(*argv, "--json") == 0, argv
    return json.loads(out.getvalue())


def train_lora(out: Path, version: str | None, seed: int) -> torch.Tensor:
    """A PEFT LoRA trained a few steps on the line's `version` (None: the bare backbone), saved; its logits."""
    from peft import LoraConfig, get_peft_model

    from evaluation.tiny import load_model
    from flows import load_release

    base = load_model("tiny-llama", "float32").model if version is None else load_release(MODEL, version).model
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2})
    model = get_peft_model(base, config)
    optimiser = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    ids = torch.randint(3, 300, (4, 16), generator=torch.Generator().manual_seed(seed))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimiser.step()
        optimiser.zero_grad()
    model.eval()
    model.save_pretrained(out)
    with torch.no_grad():
        return model(_ids()).logits


@pytest.fixture(scope="module")
def line(prefect_harness, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sq")
    with pytest.MonkeyPatch.context() as mp:
        use_state(mp, tmp / "state")
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'state' / 'mlflow' / 'mlflow.db'}")
        policy = write_yaml(tmp / "p.yaml", POLICY | {"min_target_gain": -100.0})  # LoRAs trained on random tokens
        configs = {s: write_yaml(tmp / f"{s}.yaml", c | {"line": "sq"}) for s, c in (("a", CODE), ("b", MATH))}
        chain, parent, logits = [], None, None
        for skill, seed in (("a", 0), ("b", 1)):
            logits = train_lora(tmp / skill, parent, seed)
            where = (
                ["--line", "sq", "--backbone", "tiny-llama"]
                if parent is None
                else ["--line", MODEL, "--parent", parent]
            )
            made = atlas_json("submit", str(tmp / skill), *where, "--skill", skill)
            check = ["gate", "check", made["version"], "--config", configs[skill], "--policy", policy, "--promote"]
            assert atlas_json(*check)["promoted"]
            chain.append(parent := made["version"])
        yield {"state": tmp / "state", "tmp": tmp, "math": configs["b"], "chain": chain, "logits": logits}


def test_an_exact_squash_is_the_chain_and_passes_the_gate_keeping_every_released_skill(line):
    from flows import load_release
    from flows.lineage import chain_skill_specs
    from flows.platform import PlatformRef
    from flows.resources import scope
    from registry import get_model, resolve_version

    made = atlas_json("squash", "--line", MODEL, "--name", "sq-exact", "--contexts", "4")
    assert made["source"] == line["chain"][1] and made["deltas"] == 2 and made["new"] and made["rank"] is None
    assert {m: (r["rank_in"], r["rank_out"]) for m, r in made["modules"].items() if m.endswith("0.self_attn.q_proj")}
    assert {(r["rank_in"], r["rank_out"], r["dropped"]) for r in made["modules"].values()} == {(8, 8, 0), (4, 4, 0)}
    assert all(abs(kl) < 1e-6 for kl in made["kl_vs_source"].values()), made["kl_vs_source"]  # fp32 rounding
    squash = load_release(MODEL, "sq-exact", dtype="float32")
    assert [d["name"] for d in squash.manifest["chain"]] == ["sq-exact"]  # one delta, on the base
    with torch.no_grad():
        torch.testing.assert_close(squash.model(_ids()).logits, line["logits"], **TOL)

    counts = ledger_counts(line["state"])  # the same squash again: the version recorded the first time
    again = atlas_json("squash", "--line", MODEL, "--version", line["chain"][1], "--contexts", "4")
    assert again["version"] == "sq-exact" and not again["new"]
    assert ledger_counts(line["state"]) == counts

    policy = write_yaml(line["tmp"] / "squash.yaml", SQUASH_POLICY)
    gated = atlas_json("gate", "check", "sq-exact", "--config", line["math"], "--policy", policy, "--promote")
    assert gated["passed"] and gated["promoted"], gated["checks"]
    with scope(PlatformRef.from_environment()) as res:
        champion = resolve_version(res.ledger, get_model(res.ledger, MODEL).id, "champion")
        kept = chain_skill_specs(res.ledger, res.resolve_applied(champion))
    assert champion.name == "sq-exact"
    assert [s["name"] for s in kept] == ["a", "b", "b"]  # skill a, released two versions ago, is still kept


def test_a_truncated_squash_keeps_its_rank_and_reports_its_kl(line):
    from atlas_core.squash import truncated

    argv = ("--version", line["chain"][1], "--rank", "1", "--name", "sq-r1", "--contexts", "4")
    made = atlas_json("squash", "--line", MODEL, *argv)
    assert made["rank"] == 1 and all(m["rank_out"] == 1 for m in made["modules"].values())
    assert all(m["dropped"] > 0 for m in made["modules"].values())
    assert all(kl > 1e-6 for kl in made["kl_vs_source"].values()), made["kl_vs_source"]

    # the best rank-r approximation of B A (the SVD of the product, which is never formed)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 40, generator=g), torch.randn(30, 6, generator=g)
    a2, b2, dropped = truncated(a, b, 3)
    u, s, vh = torch.linalg.svd((b @ a).double())
    torch.testing.assert_close((b2 @ a2).double(), (u[:, :3] * s[:3]) @ vh[:3], rtol=0, atol=1e-4)
    assert dropped == pytest.approx(float((s[3:].square().sum() / s.square().sum()).sqrt()), rel=1e-6)


def test_what_cannot_be_squashed_gets_one_line_and_writes_nothing(line, capsys):
    counts = ledger_counts(line["state"])
    for argv, expected in (
        (["--line", MODEL, "--version", line["chain"][0]], "has one delta; an exact squash would be the same"),
        (["--line", MODEL, "--version", "base"], "is the base (no delta to squash)"),
        (["--line", MODEL, "--rank", "0"], "--rank: expected a positive integer, got 0"),
        (["--line", "nope"], "--line 'nope': no such line"),
        (
            ["--line", MODEL, "--domains", "gsm8k,poems"],
            "--domains: expected some of gsm8k, csqa, mbpp, got gsm8k, poems",
        ),
        (["--line", MODEL, "--contexts", "0"], "--contexts: expected a positive integer, got 0"),
    ):
        assert atlas("squash", *argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (argv, err)
    assert ledger_counts(line["state"]) == counts


def test_a_chain_holding_an_atlas_residual_is_refused_naming_it():
    from atlas_core.chain import Chain
    from atlas_core.errors import InputError
    from atlas_core.residual import AtlasResidual, ResidualConfig
    from atlas_core.squash import squash_chain
    from flows.squash import _check_squashable

    residual = AtlasResidual(ResidualConfig(variant="plain", layer=1, rank=2), 16)
    with pytest.raises(InputError, match="delta 1 of the chain is an ATLAS residual"):
        squash_chain(Chain([residual]), torch.nn.Linear(2, 2))
    v = SimpleNamespace(name="v2")
    applied = SimpleNamespace(deltas=(SimpleNamespace(name="v1"), SimpleNamespace(name="v2")))
    with pytest.raises(InputError, match="v2's chain holds v1, a delta of kind 'adapter', which is no plain LoRA"):
        _check_squashable(v, applied, Chain([residual, residual]), None)
