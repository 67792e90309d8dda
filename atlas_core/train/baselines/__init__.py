"""The published weight-adapter baselines (spec BASELINES.md), each a WeightLoRA subclass on
layer l's o_proj, and the objective baselines STM and TALR (paired with any adapter).

    lora_null.py  LoRA-Null v1 / v2     null-space init from the retained covariance
    oplora.py     OPLoRA                LoRA projected off W's top-k singular subspaces
    olora.py      O-LoRA                L1 orthogonality to a frozen past subspace
    corda.py      CorDA-KPM             PEFT's CorDA, knowledge-preserved mode
    clora.py      CLoRA                 L2 penalty in fixed random orthonormal subspaces
    toplora.py    TopLoRA               token-wise gate between A and B (+ its frozen form)
    stm.py        STM                   f0's hard response tokens dropped from the loss
    talr.py       TALR                  response tokens reweighted by the current model's NLL

`build_weight_adapter(run_config, model, stats)` builds the one `run_config.lora.method` names.
"""

from __future__ import annotations

from ...io import IntegrityError
from ..lora import WeightLoRA
from ..retained_stats import RetainedStats


def build_weight_adapter(config, model, stats: RetainedStats | None = None) -> WeightLoRA:
    """The weight adapter of a RunConfig (adapter: weight-lora): plain LoRA or the baseline
    `config.lora.method` names. Methods that need the retained statistics take `stats`, or
    load `config.lora.stats`."""
    o = config.lora
    common = dict(
        model=model, layer=config.layer, rank=config.rank, alpha=o.alpha, target=o.target, seed=config.train.seed
    )
    if o.needs_stats and stats is None:
        if o.stats is None:
            raise ValueError(
                f"lora.method: {o.method!r} needs the retained statistics: pass stats= "
                "(atlas_core.train.retained_stats) or set lora.stats to a stats file"
            )
        try:
            stats = RetainedStats.load(o.stats)
        except IntegrityError as e:
            raise ValueError(f"lora.stats: {e}") from e
    if o.method == "weight-lora":
        return WeightLoRA(**common)
    if o.method == "lora-null":
        from .lora_null import LoRANull

        return LoRANull(**common, stats=stats, mode=o.lora_null.mode)
    if o.method == "oplora":
        from .oplora import OPLoRA

        return OPLoRA(**common, k=o.oplora.k)
    if o.method == "o-lora":
        from .olora import OLoRA

        return OLoRA(**common, lam=o.o_lora.lambda1, past=o.o_lora.past, stats=stats, past_files=o.o_lora.past_files)
    if o.method == "corda-kpm":
        from .corda import CordaKPM

        return CordaKPM(**common, stats=stats)
    if o.method == "clora":
        from .clora import CLoRA

        return CLoRA(**common, lam=o.clora.lam, k=o.clora.k)
    if o.method == "toplora":
        from .toplora import TopLoRA

        return TopLoRA(**common)
    raise ValueError(f"lora.method: unknown method {o.method!r}")
