"""Training methods are plugins (atlas_core.methods): a toy method written here, one module's worth of
code plus one run config YAML, trains, saves, loads, stacks in a chain with another delta and
exports, with no file of the platform edited; and atlas_core imports without a cycle."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from atlas_core import methods
from atlas_core.backbone import decoder_layers_name, weights_sha256
from atlas_core.chain import Chain, load_delta
from atlas_core.export import export_folder, export_merged, export_peft
from atlas_core.io import IntegrityError, expect_shape, load_verified, save_verified
from atlas_core.lora_delta import FrozenLoRA
from atlas_core.methods import DeltaFormat, Method
from atlas_core.release import load_folder, write_manifest
from atlas_core.residual import ResidualConfig, attach, build_residual, save_adapter
from atlas_core.train import LoRAOptions, RunConfig, build_adapter, load_run_config, prepare_data, train
from atlas_core.train.objectives import Objective
from atlas_core.train.prefix_cache import full_hidden, upper_hidden
from atlas_core.typed_config import ConfigError, build, field
from evaluation.tiny import load_model
from tests.conftest import tiny_model
from tests.test_chain import trained_lora
from tests.train_fixtures import CharTokenizer, toy_pairs

ROOT = Path(__file__).resolve().parent.parent
TINY = "tiny-llama"


# ------------------------------------------------------------------ the toy method: one module's worth
@dataclass
class ToyOptions:
    gain: float = field("Multiplier of the update gain * B A x (the toy method's own option).", 2.0)

    def __post_init__(self) -> None:
        if not self.gain > 0:
            raise ConfigError(f"gain: expected a positive number, got {self.gain!r}")


class FrozenToy(FrozenLoRA):
    """A saved toy delta applied frozen: out = W x + gain * B A x (FrozenLoRA's hook, its own kind)."""

    kind = "toy-lora"


class ToyDelta(DeltaFormat):
    kind = "toy-lora"
    peft_method = "lora"

    def load(self, path, manifest, atlas_for):
        return FrozenToy.load(path)

    def loras(self, delta, where):
        return [delta]


class ToyAdapter:
    """Trainable: gain * B A x added to layer l's o_proj by a forward hook (no PEFT)."""

    def __init__(self, model: nn.Module, layer: int, rank: int, gain: float, seed: int):
        self.module_name = f"{decoder_layers_name(model)}.{layer}.self_attn.o_proj"
        base = model.get_submodule(self.module_name)
        d_out, d_in = base.weight.shape
        g = torch.Generator().manual_seed(seed)
        self.A = nn.Parameter(torch.randn(rank, d_in, generator=g) / d_in**0.5)  # (r, d_in)
        self.B = nn.Parameter(torch.zeros(d_out, rank))  # (d_out, r): the model starts unchanged
        self.layer, self.rank, self.gain, self.seed = layer, rank, gain, seed
        self.enabled, self.penalties = True, 0
        self._handle = base.register_forward_hook(self._hook)

    def _hook(self, _module, args, out):
        if not self.enabled:
            return out
        return out + (args[0] @ self.A.T @ self.B.T * self.gain).to(out.dtype)

    @property
    def cache_layer(self) -> int | None:
        return self.layer - 1 if self.layer > 0 else None

    def to(self, device) -> "ToyAdapter":
        self.A.data, self.B.data = self.A.data.to(device), self.B.data.to(device)
        return self

    def named_trainable(self):
        return [("lora_A", self.A), ("lora_B", self.B)]

    def describe(self) -> dict:
        return {"kind": "toy-lora", "layer": self.layer, "rank": self.rank, "gain": self.gain, "seed": self.seed}

    def penalty(self) -> torch.Tensor:  # the method's own term, which the objective adds once per step
        self.penalties += 1
        return 1e-3 * self.B.square().sum()

    def hidden(self, model, ids, mask, cached=None, enabled=True):
        self.enabled = enabled
        try:
            if cached is not None:
                return upper_hidden(model, self.cache_layer, cached, ids, mask)
            return full_hidden(model, ids, mask)
        finally:
            self.enabled = True

    def save(self, path, meta: dict) -> dict:
        manifest = {**meta, **self.describe(), "module": self.module_name, "scaling": self.gain}
        return save_verified(path, {"lora_A": self.A, "lora_B": self.B}, manifest)

    @torch.no_grad()
    def load_weights(self, path) -> None:
        tensors, _ = load_verified(path, kind="toy-lora")
        for name, p in self.named_trainable():
            expect_shape(name, tensors[name], tuple(p.shape), str(path))
            p.copy_(tensors[name])

    def remove(self) -> None:
        self._handle.remove()


class ToyMethod(Method):
    name = "toy"
    summary = "gain * B A x on layer l's o_proj (a test plugin)"
    options_cls = ToyOptions
    delta = ToyDelta()

    def build(self, run_config, model, atlas=None, stats=None):
        rc = run_config
        return ToyAdapter(model, rc.layer, rc.rank, self.options(rc).gain, rc.train.seed)


class ToyObjective(Objective):
    """Cross-entropy, counting the micro-batches the trainer's loop asked it for."""

    kind = "toy-ce"
    calls = 0

    def target_sum(self, run, batch):
        type(self).calls += 1
        return super().target_sum(run, batch)


TOY = ToyMethod()
TOY_YAML = """\
adapter: toy
layer: 2
rank: 4
options:
  gain: 2.0
train:
  lr: 3.0e-2
  epochs: 2
  batch_size: 4
  progress: false
  objective:
    kind: toy-ce
"""


@pytest.fixture
def toy():
    methods.register(TOY)
    methods.register_objective(ToyObjective)
    ToyObjective.calls = 0
    yield TOY
    methods.unregister(TOY.name)
    methods.unregister_objective(ToyObjective.kind)


# ------------------------------------------------------------------ the test
def _ids() -> torch.Tensor:
    return torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))


def _release(folder: Path, deltas: list[tuple[str, Path, dict]]) -> Path:
    """A release folder on the tiny-llama backbone whose chain is `deltas` (name, file, manifest)."""
    bb = load_model(TINY, "float32")
    chain = []
    for i, (name, path, manifest) in enumerate(deltas, start=1):
        stem = f"deltas/{i:02d}-{name}"
        (folder / "deltas").mkdir(parents=True, exist_ok=True)
        for suffix in (".safetensors", ".json"):
            shutil.copy(path.with_suffix(suffix), folder / f"{stem}{suffix}")
        entry = {"name": name, "method": name, "adapter": f"{stem}.safetensors", "adapter_sha256": manifest["sha256"]}
        chain.append(entry | {"atlas": None, "atlas_sha256": None})
    backbone = {"name": TINY, "revision": bb.revision, "weights_sha256": weights_sha256(bb.model)}
    write_manifest(folder, {"format": 2, "name": deltas[-1][0], "model": "toy", "chain": chain, "backbone": backbone})
    return folder


def test_a_toy_method_trains_saves_loads_stacks_and_exports_through_the_registry(toy, tmp_path):
    # one run config file names the method, its options and its objective
    path = tmp_path / "configs" / "train" / "toy.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(TOY_YAML)
    rc = load_run_config(path)
    assert rc.method == "toy" and methods.method_for(rc) is toy
    assert isinstance(rc.options, ToyOptions) and rc.options.gain == 2.0
    assert rc.to_dict()["options"] == {"gain": 2.0} and build(RunConfig, rc.to_dict()) == rc

    # build and train: the trainer's loop calls the registered objective, which adds the method's penalty
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapter = build_adapter(rc, model)
    assert isinstance(adapter, ToyAdapter) and adapter.gain == 2.0
    data = prepare_data(CharTokenizer(), toy_pairs(16), rc.train, val=toy_pairs(4, seed=5), chat=False)
    summary = train(model, adapter, data, rc.train, tmp_path / "run")
    assert summary.steps == 8 and summary.prefix_cache_layer == 1
    assert ToyObjective.calls == 8 and adapter.penalties == 8  # one micro-batch per step, the penalty once per step
    losses = json.loads((Path(summary.checkpoints[-1]) / "state.json").read_text())["train_losses"]
    assert adapter.B.abs().max() > 0 and sum(losses[-2:]) < sum(losses[:2])  # it learns
    ids = _ids()
    with torch.no_grad():
        trained = model(ids).logits
    saved = tmp_path / "toy.safetensors"
    manifest = adapter.save(saved, {"method": "toy"})
    adapter.remove()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    # load: chain.load_delta dispatches the file's kind to the toy's format
    delta = load_delta(saved, lambda sha: None)
    assert type(delta) is FrozenToy and delta.scaling == 2.0
    with torch.no_grad():
        with Chain([delta]).attached(model):
            torch.testing.assert_close(model(ids).logits, trained, rtol=1e-5, atol=1e-5)
        base = model(ids).logits

    # stack with another delta (a plain residual at layer 3): both apply, and come off again
    residual = build_residual(ResidualConfig(variant="plain", layer=3, rank=4), model)
    torch.nn.init.normal_(residual.B, std=0.3)
    save_adapter(tmp_path / "plain.safetensors", residual)
    other = load_delta(tmp_path / "plain.safetensors", lambda sha: None)
    chain = Chain([other, delta])
    assert chain.lowest_layer == 2
    with torch.no_grad():
        with chain.attached(model):
            stacked = model(ids).logits
        with attach(model, other), delta.attached(model):
            torch.testing.assert_close(stacked, model(ids).logits, rtol=0, atol=0)
        assert (stacked - trained).abs().max() > 1e-4
        torch.testing.assert_close(model(ids).logits, base, rtol=0, atol=0)
    assert all(not m._forward_hooks for m in model.modules())

    # export: a release whose chain is a Weight-LoRA and the toy delta (same o_proj shape on tiny-llama)
    bb = load_model(TINY, "float32")
    lora = trained_lora(bb.model, seed=1, layer=1)
    lora_manifest = lora.save(tmp_path / "lora.safetensors", {})
    lora.remove()
    deltas = [("v1", tmp_path / "lora.safetensors", lora_manifest), ("v2", saved, manifest)]
    folder = _release(tmp_path / "release", deltas)
    release = load_folder(folder, dtype="float32", backbone_loader=load_model)
    assert [type(d) for d in release.chain.deltas] == [FrozenLoRA, FrozenToy]
    with torch.no_grad():
        want = release.model(ids).logits
        release.detach()
        assert (want - release.model(ids).logits).abs().max() > 1e-4
        release.attach()

    from peft import PeftModel

    out = export_peft(release, tmp_path / "peft")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and len(config["target_modules"]) == 2
    peft_model = PeftModel.from_pretrained(load_model(TINY, "float32").model, str(out))
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(export_merged(release, tmp_path / "merged")).eval()
    again = load_folder(export_folder(release, folder, tmp_path / "copy"), dtype="float32", backbone_loader=load_model)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again.model(ids).logits, want, rtol=0, atol=0)


def test_the_toy_methods_options_are_validated_by_name(toy, tmp_path):
    path = tmp_path / "toy.yaml"
    for text, message in [
        (TOY_YAML.replace("gain: 2.0", "gain: -1"), r"options\.gain: expected a positive number"),
        (TOY_YAML.replace("gain: 2.0", "gian: 1"), r"options\.gian: unknown field"),
        (TOY_YAML.replace("adapter: toy", "adapter: plain"), r"options\.gain: unknown field; this block takes no"),
        (TOY_YAML.replace("kind: toy-ce", "kind: toy-kl"), r"train\.objective\.kind: expected one of"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_run_config(path)
    path.write_text(TOY_YAML.replace("options:\n  gain: 2.0\n", ""))
    assert load_run_config(path).options == ToyOptions()  # the defaults


def test_an_unregistered_method_or_delta_kind_is_refused_by_name(tmp_path):
    path = tmp_path / "toy.yaml"
    path.write_text(TOY_YAML)
    with pytest.raises(ConfigError, match="adapter: expected one of"):
        load_run_config(path)
    tensors = {"lora_A": torch.zeros(2, 8), "lora_B": torch.zeros(8, 2)}
    save_verified(tmp_path / "d.safetensors", tensors, {"kind": "no-such-kind", "layer": 0})
    with pytest.raises(IntegrityError, match="unknown delta kind 'no-such-kind'"):
        load_delta(tmp_path / "d.safetensors", lambda sha: None)


def test_built_in_methods_are_registered_with_what_they_need():
    assert set(methods.adapter_names()) >= {"atlas", "plain", "global-pca", "weight-lora"}
    assert methods.weight_method_names()[0] == "weight-lora" and "toplora" in methods.weight_method_names()
    assert methods.objective_kinds() == ("ce", "replay", "output-kl", "stm", "talr")
    assert methods.get("atlas").atlas_variant == "local" and methods.get("global-pca").atlas_variant == "global"
    assert methods.get("plain").atlas_variant is None and methods.get("clora").atlas_variant is None
    for name in methods.names():  # each method's options dataclass is where its run configs hold it
        method = methods.get(name)
        if method.weight_adapter:
            rc = RunConfig(adapter="weight-lora", lora=LoRAOptions(method=name))
        else:
            rc = RunConfig(adapter=name, atlas="atlas.safetensors")
        assert rc.method == name and methods.method_for(rc) is method
        assert method.options_cls is None or isinstance(method.options(rc), method.options_cls)
    with pytest.raises(ValueError, match="registered already"):
        methods.register(type(methods.get("plain"))("plain", "a second plain"))


# ------------------------------------------------------------------ no import cycles
def _module_graph() -> dict[str, set[str]]:
    """atlas_core module -> the atlas_core modules it imports anywhere in its file (functions too)."""
    files = {}
    for f in (ROOT / "atlas_core").rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        files[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    graph = {m: set() for m in files}
    for m, (f, is_pkg) in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = m.split(".") if is_pkg else m.split(".")[:-1]
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    graph[m].add(t)
    return graph


def test_atlas_core_has_no_import_cycle():
    graph = _module_graph()
    assert {"atlas_core.chain", "atlas_core.methods", "atlas_core.train.baselines.toplora"} <= set(graph)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("module", ["atlas_core.methods", "atlas_core.chain", *methods.BUILTIN])
def test_each_method_module_imports_alone_and_fills_the_registry(module):
    code = f"import {module}, atlas_core.methods as m; assert 'toplora' in m.names() and 'stm' in m.objective_kinds()"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
