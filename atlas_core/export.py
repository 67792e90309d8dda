"""Exporting a loaded release (atlas_core.release) for tools that know nothing of the platform.

    folder   the release folder itself (+ the backbone's files with bundle_backbone): for
             `flows.load_release(folder)` and `mlflow models serve` on an air-gapped host; its
             manifest.json is the loaded release's, with a manifest.sha256 sidecar to match
    peft     a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) that
             `PeftModel.from_pretrained(base, dir)` loads: a chain of LoRA deltas (the platform's
             Weight-LoRA, submitted PEFT LoRAs) as ONE LoRA adapter (what vLLM serves per
             request), a chain of ATLAS residuals as one adapter of the ATLAS PEFT method
             (atlas_core.residual.peft; needs `import atlas_core`); with `since`, only the deltas
             after an ancestor, to load on top of that ancestor
    merged   a plain transformers model folder with every LoRA delta folded into its weights

What a delta exports as is its delta format's (atlas_core.methods.DeltaFormat): `peft_method`
("lora", "atlas" or none) and `loras()` (the plain LoRAs it is made of, refused by a delta that
is none).

One LoRA from a chain. Deltas on one module add: W x + sum_i s_i B_i A_i x. Stacking the
factors, A = [A_1; A_2; ...] (sum r_i, d_in) and B = [s_1 B_1, s_2 B_2, ...] (d_out, sum r_i),
gives B A = sum_i s_i B_i A_i, which is PEFT's `add_weighted_adapter(combination_type="cat")`
with unit weights; the adapter's scaling is set to 1 (lora_alpha = r per module).
"""

from __future__ import annotations

import copy
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from . import methods
from .backbone import weights_folder, weights_sha256
from .chain import Chain
from .errors import InputError
from .io import atomic_folder, atomic_write_json
from .lora_delta import FrozenLoRA
from .release import LoadedRelease, write_manifest

FORMATS = ("folder", "peft", "merged")


def export_folder(release: LoadedRelease, source: str | Path, out: str | Path, bundle_backbone: bool = False) -> Path:
    """Copy the release folder; with `bundle_backbone`, the backbone's files go under backbone/:
    its own weight files when it was loaded from a folder (so they keep the sha256 the release
    names), else (a model built in-process) saved now and recorded as `bundle_weights_sha256`.

    manifest.json (and its sidecar, atlas_core.release.write_manifest) is written last from
    `release.manifest`, the manifest the release was verified and loaded with, so the export is the
    model that ran, whatever happened to the source's manifest since, and verifies on its own."""
    manifest = copy.deepcopy(release.manifest)
    with atomic_folder(out) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)  # its manifest.json and sidecar are replaced below
        origin = weights_folder(release.backbone.model)
        if not bundle_backbone or (tmp / "backbone").is_dir():
            pass
        elif origin is not None:
            shutil.copytree(origin, tmp / "backbone")
        else:
            with detached(release):  # the saved weights must be the plain backbone's
                release.backbone.model.save_pretrained(tmp / "backbone")
            release.backbone.tokenizer.save_pretrained(tmp / "backbone")
            manifest["backbone"]["bundle_weights_sha256"] = weights_sha256(release.backbone.model, tmp / "backbone")
        write_manifest(tmp, manifest)
    return Path(out)


@contextmanager
def detached(release: LoadedRelease):
    """The release's model without its chain for a moment (hooks removed, then attached again)."""
    release.detach()
    try:
        yield
    finally:
        release.attach()


def lora_factors(chain: Chain) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A (R, d_in), B (d_out, R)) with B A = the sum of the chain's LoRA updates there."""
    stacks: dict[str, tuple[list, list]] = {}
    for i, delta in enumerate(chain.deltas, start=1):
        for lora in _loras(i, delta):
            a_list, b_list = stacks.setdefault(lora.module_name, ([], []))
            a_list.append(lora.lora_A.float())
            b_list.append(lora.lora_B.float() * lora.scaling)
    return {m: (torch.cat(a), torch.cat(b, dim=1)) for m, (a, b) in stacks.items()}


def _loras(i: int, delta) -> list[FrozenLoRA]:
    """The plain LoRAs a delta is made of (a Weight-LoRA: one; a submitted PEFT LoRA: one per module);
    its format refuses a delta that is none (an ATLAS residual, TopLoRA)."""
    return methods.format_of(delta).loras(delta, f"delta {i} of the chain")


def chain_since(release: LoadedRelease, since: str | None) -> Chain:
    """The deltas of the release's chain after the version named `since` (None or "base": all).

    Exporting only what a version added on top of an ancestor gives the adapter a person trained
    there: `PeftModel.from_pretrained(load_release(line, since).model, DIR)` is the version again,
    also for a chain that mixes ATLAS residuals and LoRA deltas (e.g. a LoRA submitted on top of
    an ATLAS release), which no single PEFT adapter holds as a whole."""
    if since in (None, "base"):
        return release.chain
    names = [d.get("name") for d in release.manifest["chain"]]
    if since not in names:
        raise InputError(f"--since: {since!r} is not in {release.name}'s chain ({', '.join(map(str, names))})")
    return Chain(release.chain.deltas[names.index(since) + 1 :])


def export_peft(release: LoadedRelease, out: str | Path, since: str | None = None) -> Path:
    """The chain (after `since`) as one PEFT adapter: LoRA for LoRA deltas, the ATLAS method for residuals."""
    chain = chain_since(release, since)
    peft_methods = {methods.format_of(d).peft_method for d in chain.deltas}
    if not peft_methods:
        raise InputError(f"{release.name}: no delta to export" + (f" after {since}" if since else ""))
    if peft_methods == {"atlas"}:
        from .residual.peft import save_atlas_adapter

        with atomic_folder(out) as tmp:
            save_atlas_adapter(chain, release.model, release.manifest["backbone"]["name"], tmp)
        return Path(out)
    if "atlas" in peft_methods:  # one PEFT adapter holds one method; the others export as LoRA
        raise InputError(
            f"{release.name}: its chain mixes ATLAS residuals and LoRA deltas; one PEFT adapter holds "
            "one method: export with --format folder or mlflow, or the LoRA deltas alone with "
            "--since <the last ATLAS release>"
        )
    from peft import LoraConfig
    from safetensors.torch import save_file

    factors = lora_factors(chain)
    ranks = {m: a.shape[0] for m, (a, _) in factors.items()}
    top = max(ranks.values())
    config = LoraConfig(
        r=top,
        lora_alpha=top,
        target_modules=sorted(factors),
        lora_dropout=0.0,
        bias="none",
        rank_pattern=ranks,
        alpha_pattern=ranks,  # scaling alpha / r = 1 on every module
        base_model_name_or_path=release.manifest["backbone"]["name"],
        task_type="CAUSAL_LM",
    )
    tensors = {}
    for module, (a, b) in factors.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()  # (R, d_in)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()  # (d_out, R)
    with atomic_folder(out) as tmp:
        config.save_pretrained(tmp)
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        _provenance(release, tmp, since)
    return Path(out)


@torch.no_grad()
def export_merged(release: LoadedRelease, out: str | Path) -> Path:
    """A transformers folder with W + B A folded in for every LoRA delta (in fp32, then the model's dtype)."""
    factors = lora_factors(release.chain)
    model = release.backbone.model
    state = model.state_dict()
    for module, (a, b) in factors.items():
        key = f"{module}.weight"
        w = state[key]
        state[key] = (w.float() + (b.to(w.device) @ a.to(w.device))).to(w.dtype)  # (d_out, d_in)
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp, state_dict=state)
        release.tokenizer.save_pretrained(tmp)
        _provenance(release, tmp)
    return Path(out)


def _provenance(release: LoadedRelease, out: Path, since: str | None = None) -> None:
    """What the export was made from: the release's name, backbone reference and chain (by sha256),
    and the ancestor it applies on top of (`since`; None: the bare backbone)."""
    m = release.manifest
    atomic_write_json(
        out / "atlas_release.json",
        {
            "name": m["name"],
            "model": m.get("model"),
            "backbone": m["backbone"],
            "applies_on_top_of": since,
            "chain": [{k: d.get(k) for k in ("name", "method", "adapter_sha256", "atlas_sha256")} for d in m["chain"]],
        },
    )


def export(
    release: LoadedRelease,
    source: str | Path,
    fmt: str,
    out: str | Path,
    bundle_backbone: bool = False,
    since: str | None = None,
) -> Path:
    if since is not None and fmt != "peft":
        raise InputError(f"--since: only --format peft exports part of a chain, not --format {fmt}")
    if fmt == "folder":
        return export_folder(release, source, out, bundle_backbone)
    if fmt == "peft":
        return export_peft(release, out, since)
    if fmt == "merged":
        return export_merged(release, out)
    raise InputError(f"--format: expected one of {FORMATS}, got {fmt!r}")
