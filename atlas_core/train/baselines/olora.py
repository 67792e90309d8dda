"""O-LoRA (Wang et al., EMNLP 2023 Findings, arXiv 2310.14152; code cmnfriend/O-LoRA): LoRA whose
A is pushed orthogonal to a frozen "past" subspace.

    loss = L_task + lambda1 * sum_ij |A_past A^T|_ij        (entrywise L1 of the r_past x r matrix)

lambda1 = 0.5, no L2 term (the paper's lambda2 = 0), A_past frozen. In a continual sequence
A_past is the earlier releases' A matrices (`past: files`, their lora_A rows stacked). For a
single update (choice, default `past: pca`): the top-r eigenvectors of the retained input
covariance C = X_ret^T X_ret, as rows, i.e. the directions the retained domains use most.
`past: pca-centered` (a control, issue 32): the same from the centered covariance C - N mu mu^T,
so the retained mean direction, which dominates C, is not what A is pushed away from.
The rest is plain LoRA (PEFT), saved as plain factors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...io import load_verified
from ...methods import register
from ...methods.weight_lora import WeightMethod
from ...typed_config import ConfigError, field
from ..lora import WeightLoRA
from ..retained_stats import RetainedStats

PAST = ("pca", "pca-centered", "files")


@dataclass
class OLoRAOptions:
    lambda1: float = field("Weight of sum |A_past A^T| (the paper: 0.5).", 0.5)
    past: str = field(
        "The frozen past subspace: 'pca' = top-r eigenvectors of the retained input covariance "
        "(choice, one update); 'pca-centered' = the same of the centered covariance (a control); "
        "'files' = the lora_A of earlier adapters (past_files).",
        "pca",
    )
    past_files: list[str] = field("Weight-adapter files whose lora_A rows form A_past (past: files).", factory=list)

    def __post_init__(self) -> None:
        if self.past not in PAST:
            raise ConfigError(f"past: expected one of {PAST}, got {self.past!r}")
        if self.lambda1 < 0:
            raise ConfigError(f"lambda1: expected >= 0, got {self.lambda1!r}")
        if self.past == "files" and not self.past_files:
            raise ConfigError("past_files: past 'files' needs at least one adapter file")
        for i, path in enumerate(self.past_files):
            if not path.strip():
                raise ConfigError(f"past_files[{i}]: expected the path of a weight-adapter file, got {path!r}")


def olora_penalty(A: torch.Tensor, A_past: torch.Tensor, lam: float) -> torch.Tensor:
    """lambda1 * sum |A_past A^T|: A (r, d_in), A_past (r_past, d_in)."""
    if A.ndim != 2 or A_past.ndim != 2 or A.shape[1] != A_past.shape[1]:
        raise ValueError(
            f"olora: expected A (r, d_in) and A_past (r_past, d_in), got {tuple(A.shape)}, {tuple(A_past.shape)}"
        )
    return lam * (A_past @ A.T).abs().sum()


class OLoRA(WeightLoRA):
    method = "o-lora"

    def __init__(
        self,
        model,
        layer: int,
        rank: int,
        alpha: float,
        target: str,
        seed: int,
        lam: float = 0.5,
        past: str = "pca",
        stats: RetainedStats | None = None,
        past_files: Sequence[str] = (),
    ):
        if past not in PAST:
            raise ValueError(f"o_lora.past: expected one of {PAST}, got {past!r}")
        if past != "files" and stats is None:
            raise ValueError(f"o_lora.past {past!r} needs the retained statistics (stats=)")
        if past == "files" and not past_files:
            raise ValueError("o_lora.past 'files' needs past_files: earlier adapters' files")
        self.lam, self.past, self.stats, self.past_files = float(lam), past, stats, list(past_files)
        self.stats_key = stats.key if stats is not None else None
        super().__init__(model, layer, rank, alpha, target, seed)

    def _setup(self) -> None:
        d_in = self.lora_A.shape[1]
        if self.past != "files":
            kind = "cov" if self.past == "pca" else "cov_centered"
            _, vecs = torch.linalg.eigh(self.stats.matrix(kind, self.layer, self.target, d_in))  # ascending
            self.A_past = vecs[:, -self.rank :].T.flip(0).float().contiguous()  # (r, d_in): top-r, largest first
        else:
            self.A_past = torch.cat(
                [load_verified(p, kind="weight-lora")[0]["lora_A"].float() for p in self.past_files]
            )
            if self.A_past.shape[1] != d_in:
                raise ValueError(f"o_lora.past_files: their A has d_in {self.A_past.shape[1]}, this projection {d_in}")
        self.A_past = self.A_past.to(self.lora_A.device)

    def to(self, device) -> "OLoRA":
        super().to(device)
        self.A_past = self.A_past.to(device)
        return self

    def penalty(self) -> torch.Tensor:
        return olora_penalty(self.lora_A, self.A_past, self.lam)

    def describe(self) -> dict:
        return super().describe() | {
            "lambda1": self.lam,
            "past": self.past,
            "stats_key": self.stats_key,
            "past_rows": int(self.A_past.shape[0]),
        }


class OLoRAMethod(WeightMethod):
    name = "o-lora"
    summary = "LoRA + lambda1 * sum |A_past A^T|: A pushed orthogonal to a frozen past subspace"
    adapter_class = OLoRA
    options_cls, options_block = OLoRAOptions, "o_lora"

    def stats_needed(self, lora) -> bool:
        return lora.o_lora.past != "files"

    def adapter_kwargs(self, run_config, stats) -> dict:
        o = run_config.lora.o_lora
        return {"lam": o.lambda1, "past": o.past, "stats": stats, "past_files": o.past_files}


register(OLoRAMethod())
