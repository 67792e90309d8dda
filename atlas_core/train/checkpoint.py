"""Checkpoints: everything an exact resume needs, never pickled, each one appearing atomically.

    <run_dir>/checkpoints/step-000042/
        adapter.safetensors + adapter.json       the trained factors (save_adapter / WeightLoRA.save)
        optimizer.safetensors + optimizer.json   AdamW moments and step per parameter, torch RNG state
        state.json                               step, epoch, position in the epoch, seed, losses,
                                                 config hash, sha256 of both tensor files

A checkpoint is written into a hidden temporary folder and renamed into place, so a run
killed at any moment leaves either a complete checkpoint or none; `latest_checkpoint`
returns the newest one whose files verify.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..io import IntegrityError, atomic_write_json, load_verified, save_verified, sha256_file

CHECKPOINT_FORMAT = 1
STATE_FILE = "state.json"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    """AdamW state as flat named tensors: '<param>.<exp_avg|exp_avg_sq|step>'."""
    state = optimizer.state_dict()["state"]
    out = {}
    for i, name in enumerate(names):
        for key, value in state.get(i, {}).items():
            out[f"{name}.{key}"] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
    return out


def restore_optimizer(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor]) -> None:
    sd = optimizer.state_dict()  # param_groups come from the (hash-checked) config; lr is set every step
    state = {}
    for i, name in enumerate(names):
        entries = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == name}
        if entries:
            state[i] = entries
    sd["state"] = state
    optimizer.load_state_dict(sd)


def write_checkpoint(run_dir: str | Path, adapter, optimizer: torch.optim.Optimizer, state: dict) -> Path:
    """Write checkpoint `step-<state['step']>` atomically; returns its folder."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state['step']:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        names = [n for n, _ in adapter.named_trainable()]
        meta = {k: state[k] for k in ("step", "epoch", "seed", "config_hash")}
        adapter_manifest = adapter.save(tmp / "adapter.safetensors", meta)
        opt = optimizer_tensors(optimizer, names)
        opt["rng.torch"] = torch.get_rng_state()
        opt_manifest = save_verified(tmp / "optimizer.safetensors", opt, {**meta, "kind": "optimizer", "params": names})
        full_state = {
            **state,
            "format": CHECKPOINT_FORMAT,
            "files": {
                "adapter.safetensors": adapter_manifest["sha256"],
                "optimizer.safetensors": opt_manifest["sha256"],
            },
        }
        atomic_write_json(tmp / STATE_FILE, full_state)
        _fsync_dir(tmp)
        if final.exists():  # only when re-running a finished step; the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_state(path: str | Path) -> dict:
    """state.json of a checkpoint folder after checking both tensor files against it."""
    path = Path(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{path}: no readable {STATE_FILE} ({e})") from e
    for name, digest in state.get("files", {}).items():
        if not (path / name).is_file() or sha256_file(path / name) != digest:
            raise IntegrityError(f"{path}: {name} is missing or does not match its recorded sha256")
    if len(state.get("files", {})) != 2:
        raise IntegrityError(f"{path}: {STATE_FILE} does not list the adapter and optimizer files")
    return state


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint folders, oldest first (temporary folders excluded)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint whose files all verify; damaged newer ones are skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            read_state(path)
            return path
        except IntegrityError:
            continue
    return None


def load_checkpoint(path: str | Path, adapter, optimizer: torch.optim.Optimizer) -> dict:
    """Restore adapter weights, optimizer moments and the torch RNG from `path`; returns its state."""
    path = Path(path)
    state = read_state(path)
    adapter.load_weights(path / "adapter.safetensors")
    tensors, manifest = load_verified(path / "optimizer.safetensors", kind="optimizer")
    names = [n for n, _ in adapter.named_trainable()]
    if manifest.get("params") != names:
        raise IntegrityError(
            f"{path}: optimizer state is for parameters {manifest.get('params')}, the adapter has {names}"
        )
    torch.set_rng_state(tensors.pop("rng.torch"))
    restore_optimizer(optimizer, names, tensors)
    return state


def clean_temporary(run_dir: str | Path) -> None:
    """Remove half-written checkpoint folders left by a killed run."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)
