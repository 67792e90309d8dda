"""Retained statistics: second moments of the inputs of layer l's o_proj on retained contexts.

Several weight-adapter baselines (spec BASELINES.md) steer their update away from what the
retained domains use, through the input covariance of the adapted projection:

    X_ret      (N, d_in)   o_proj inputs at layer l, every real token of the retained contexts
    mu = 1/N sum_t x_t     (d_in,)                                        the centered LoRA's offset
    C = X_ret^T X_ret      (d_in, d_in)                                   O-LoRA's A_past
    C_c = C - N mu mu^T    (d_in, d_in), the centered covariance          O-LoRA's, past: pca-centered
    C_max = sum_seq (X_seq / max|X_seq|)^T (X_seq / max|X_seq|)            LoRA-Null (its official code
                                                                          scales each sequence by 1 / max|x|)
    C_corda = 1/n_seq sum_seq (X_seq / |max X_seq|)^T (...)                PEFT's CorDA hook, exactly
                                                                          (its max is signed, then abs)

All come from one pass (a forward hook, padding masked out, float64 sums) and are
stored in one verified file (atlas_core.io) named by a content key: the backbone's name, the
layer and module, the retained token ids, and a probe (sha256 of the o_proj inputs of the
first context, so another backbone, dtype or parent chain never reuses a file). Computed
once per (backbone, layer, retained data); `retained_stats` loads it when it exists.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..backbone import decoder_layers
from ..io import IntegrityError, config_hash, expect_shape, load_verified, save_verified
from ..paths import state_dir
from .data import TokenizedSet

STATS_FORMAT = 2  # 2: the mean input (format-1 files have another content key, so they are never read)
KINDS = ("cov", "cov_max", "cov_corda")  # stored; "cov_centered" is derived from cov and mean
MATRICES = (*KINDS, "cov_centered")


@dataclass
class RetainedStats:
    layer: int
    target: str  # module inside the decoder layer, e.g. self_attn.o_proj
    cov: torch.Tensor  # (d_in, d_in) float64, C = X^T X
    cov_max: torch.Tensor  # (d_in, d_in) float64, per-sequence 1 / max|x| (LoRA-Null)
    cov_corda: torch.Tensor  # (d_in, d_in) float64, PEFT CorDA's convention
    tokens: int
    sequences: int
    mean: torch.Tensor  # (d_in,) float64, mu = the mean input over the tokens
    key: str = ""  # content key (file name) once stored
    sha256: str | None = None

    def matrix(self, kind: str, layer: int, target: str, d_in: int) -> torch.Tensor:
        """One of MATRICES, checked against the adapter that asks for it."""
        if kind not in MATRICES:
            raise ValueError(f"stats: kind must be one of {MATRICES}, got {kind!r}")
        self._check(layer, target)
        if kind == "cov_centered":  # sum_t (x_t - mu)(x_t - mu)^T
            m = self.cov - self.tokens * torch.outer(self.mean, self.mean)
        else:
            m = getattr(self, kind)
        if tuple(m.shape) != (d_in, d_in):
            raise ValueError(f"stats: {kind} is {tuple(m.shape)}, the adapted projection has d_in = {d_in}")
        return m

    def input_mean(self, layer: int, target: str, d_in: int) -> torch.Tensor:
        """mu (d_in,), checked against the adapter that asks for it."""
        self._check(layer, target)
        if tuple(self.mean.shape) != (d_in,):
            raise ValueError(f"stats: the mean is {tuple(self.mean.shape)}, the adapted projection has d_in = {d_in}")
        return self.mean

    def _check(self, layer: int, target: str) -> None:
        if (self.layer, self.target) != (layer, target):
            raise ValueError(
                f"stats: collected at layer {self.layer} {self.target}, the adapter is at layer {layer} {target}"
            )

    def save(self, path: str | Path) -> dict:
        manifest = save_verified(
            path,
            {**{k: getattr(self, k) for k in KINDS}, "mean": self.mean},
            {
                "kind": "retained-stats",
                "format": STATS_FORMAT,
                "layer": self.layer,
                "target": self.target,
                "tokens": self.tokens,
                "sequences": self.sequences,
                "key": self.key,
            },
        )
        self.sha256 = manifest["sha256"]
        return manifest

    @classmethod
    def load(cls, path: str | Path) -> "RetainedStats":
        tensors, m = load_verified(path, kind="retained-stats")
        try:
            d = tensors["cov"].shape[0]
            for k in KINDS:
                expect_shape(k, tensors[k], (d, d), str(path))
            expect_shape("mean", tensors["mean"], (d,), str(path))
            return cls(
                m["layer"],
                m["target"],
                *(tensors[k] for k in KINDS),
                m["tokens"],
                m["sequences"],
                tensors["mean"],
                m["key"],
                m["sha256"],
            )
        except KeyError as e:
            raise IntegrityError(f"{path}: retained statistics lack {e}") from e


def _sequences(data: TokenizedSet | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    seqs = list(data.ids) if isinstance(data, TokenizedSet) else [torch.as_tensor(s, dtype=torch.long) for s in data]
    if not seqs or any(s.ndim != 1 or len(s) == 0 for s in seqs):
        raise ValueError("retained: expected a non-empty list of non-empty 1-D token id tensors")
    return seqs


def _module(model: nn.Module, layer: int, target: str) -> nn.Linear:
    layers = decoder_layers(model)
    module = layers[layer].get_submodule(target)
    return getattr(module, "base_layer", module)  # a PEFT wrapper: its input is the Linear's input


@torch.no_grad()
def _inputs(model: nn.Module, module: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, d_in) inputs of `module` on a right-padded batch (the forward stops after it)."""
    seen = []

    class _Stop(Exception):
        pass

    def hook(_m, args):
        seen.append(args[0].detach())
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen[0]


@torch.no_grad()
def collect_stats(
    model: nn.Module, layer: int, data, target: str = "self_attn.o_proj", batch_size: int = 8
) -> RetainedStats:
    """One pass over the retained contexts `data` (token id sequences or a TokenizedSet)."""
    seqs = _sequences(data)
    module = _module(model, layer, target)
    device = module.weight.device
    d_in = module.in_features
    sums = {k: torch.zeros(d_in, d_in, dtype=torch.float64, device=device) for k in KINDS}
    total = torch.zeros(d_in, dtype=torch.float64, device=device)
    tokens = 0
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        lengths = torch.tensor([len(s) for s in chunk])
        ids = nn.utils.rnn.pad_sequence(chunk, batch_first=True).to(device)  # (B, T), right-padded
        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long().to(device)
        x = _inputs(model, module, ids, mask).double() * mask[..., None]  # (B, T, d_in), padding zeroed
        max_abs = x.abs().amax(dim=(1, 2))  # (B,) per sequence
        signed = torch.where(mask[..., None].bool(), x, torch.full_like(x, -torch.inf)).amax(dim=(1, 2)).abs()  # (B,)
        sums["cov"] += torch.einsum("btd,bte->de", x, x)
        total += x.sum(dim=(0, 1))  # padding is zero
        xm = x / max_abs.clamp_min(1e-30)[:, None, None]
        sums["cov_max"] += torch.einsum("btd,bte->de", xm, xm)
        xc = x / signed.clamp_min(1e-30)[:, None, None]
        sums["cov_corda"] += torch.einsum("btd,bte->de", xc, xc)
        tokens += int(lengths.sum())
    sums["cov_corda"] /= len(seqs)  # PEFT divides by its sample count (one sequence per forward)
    return RetainedStats(layer, target, *(sums[k].cpu() for k in KINDS), tokens, len(seqs), (total / tokens).cpu())


def stats_key(model: nn.Module, layer: int, data, target: str = "self_attn.o_proj", backbone: str = "") -> str:
    """Content key of the statistics `collect_stats` would compute."""
    seqs = _sequences(data)
    tokens = hashlib.sha256()
    for s in seqs:
        tokens.update(f"{len(s)}:".encode() + s.numpy().tobytes())
    module = _module(model, layer, target)
    first = seqs[0][None].to(module.weight.device)
    probe = _inputs(model, module, first, torch.ones_like(first))
    probe_sha = hashlib.sha256(probe.float().cpu().numpy().tobytes()).hexdigest()
    return config_hash("retained-stats", STATS_FORMAT, backbone, layer, target, tokens.hexdigest(), probe_sha)


def retained_stats(
    model: nn.Module,
    layer: int,
    data,
    target: str = "self_attn.o_proj",
    backbone: str = "",
    cache_dir: str | Path | None = None,
    batch_size: int = 8,
) -> RetainedStats:
    """The statistics for (model, layer, retained data): loaded from `cache_dir` (default
    <state>/retained-stats) if stored under their content key, else computed and stored."""
    layers = decoder_layers(model)
    layer = len(layers) // 2 if layer == -1 else layer
    key = stats_key(model, layer, data, target, backbone)
    path = Path(cache_dir if cache_dir is not None else state_dir() / "retained-stats") / f"{key}.safetensors"
    if path.is_file():
        return RetainedStats.load(path)
    stats = collect_stats(model, layer, data, target, batch_size)
    stats.key = key
    stats.save(path)
    return stats
