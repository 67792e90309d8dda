"""CorDA in knowledge-preserved mode (Yang et al., NeurIPS 2024, arXiv 2406.05223), through PEFT.

PEFT's CorDA (`init_lora_weights="corda"`, `CordaConfig(corda_method="kpm")`) decomposes
W C (C: the retained o_proj input covariance) by SVD, W C = U S V^T, and initialises the adapter
from the r SMALLEST components, the ones the retained inputs use least:

    B0 = U_r sqrt(S_r / s),  A0 = sqrt(S_r / s) V_r^T C^{-1},   base weight W - s B0 A0

`preprocess_corda` runs before PEFT wraps the projection. Its covariance is our retained
statistics' `cov_corda` (atlas_core.train.retained_stats: the very formula of PEFT's hook, on the
retained calibration contexts, stored content-addressed), handed to PEFT as its covariance file,
so PEFT does the decomposition and the init and nothing is computed twice.

PEFT rewrites the base weight to W - s B0 A0. (choice, as LoRA-Null) the original W is put
back at once and the frozen s B0 A0 is subtracted inside the LoRA branch instead: the same
function, a bit-identical backbone (f0 = the adapter switched off, and a version never
re-applies CorDA onto a mutated model), and the delta relative to the original W is saved as
the factors [A; A0], [B, -B0] (rank 2r) that a chain applies.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ...methods import register
from ...methods.weight_lora import WeightMethod
from ..retained_stats import RetainedStats
from .lora_null import LoRANull


class CordaKPM(LoRANull):
    method = "corda-kpm"

    def __init__(self, model, layer: int, rank: int, alpha: float, target: str, seed: int, stats: RetainedStats):
        super().__init__(model, layer, rank, alpha, target, seed, stats, mode="v1")

    def _peft_options(self) -> dict:
        from peft.tuners.lora.config import CordaConfig

        self._tmp = tempfile.TemporaryDirectory(prefix="corda-")
        self._cov_file = str(Path(self._tmp.name) / "covariance.pt")
        return {
            "init_lora_weights": "corda",
            "corda_config": CordaConfig(corda_method="kpm", covariance_file=self._cov_file, verbose=False),
        }

    def _before_inject(self, model, config) -> None:
        from peft.tuners.lora.corda import preprocess_corda

        d_in = self.base.weight.shape[1]
        C = self.stats.matrix("cov_corda", self.layer, self.target, d_in).float().to(self.base.weight.device)
        torch.save({self.module_name: C}, self._cov_file)
        self._W = self.base.weight.detach().clone()  # the original W, put back after PEFT's init
        try:
            preprocess_corda(model, config, run_model=None)  # reads the covariance file: no forward runs
        finally:
            self._tmp.cleanup()

    def _init_factors(self, g: torch.Generator) -> None:
        # PEFT has initialised A0, B0 from the smallest components and set the weight to W - s B0 A0.
        self.A0, self.B0 = self.lora_A.detach().clone(), self.lora_B.detach().clone()  # (r, d_in), (d_out, r)
        self.base.weight.data = self._W
        del self._W


class CordaKPMMethod(WeightMethod):
    name = "corda-kpm"
    summary = "PEFT's CorDA, knowledge-preserved mode: init from the smallest components of SVD(W C)"
    adapter_class = CordaKPM
    uses_stats = True

    def adapter_kwargs(self, run_config, stats) -> dict:
        return {"stats": stats}


register(CordaKPMMethod())
