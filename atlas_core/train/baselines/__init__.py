"""The published weight-adapter baselines (spec BASELINES.md), each a WeightLoRA subclass on
layer l's o_proj, and the objective baselines STM and TALR (paired with any adapter).

    lora_null.py  LoRA-Null v1 / v2     null-space init from the retained covariance
    oplora.py     OPLoRA                LoRA projected off W's top-k singular subspaces
    olora.py      O-LoRA                L1 orthogonality to a frozen past subspace
    corda.py      CorDA-KPM             PEFT's CorDA, knowledge-preserved mode
    clora.py      CLoRA                 L2 penalty in fixed random orthonormal subspaces
    toplora.py    TopLoRA               token-wise gate between A and B (+ its frozen form)
    centered_lora.py  centered LoRA     a control: LoRA on the mean-subtracted input (+ its frozen form)
    stm.py        STM                   f0's hard response tokens dropped from the loss
    talr.py       TALR                  response tokens reweighted by the current model's NLL

Each module declares its options dataclass and registers its method (a WeightMethod,
atlas_core.methods.weight_lora) or its objective (atlas_core.train.objectives) with
atlas_core.methods, which lists them among its built-ins; `atlas_core.train.build_adapter` builds
the one a run config names.
"""
