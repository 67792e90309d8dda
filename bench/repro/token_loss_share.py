"""How much of the training loss each objective puts on the tokens f0 finds hard.

STM and TALR both steer the loss away from response tokens the frozen f0 predicts badly (STM
drops every token with f0 perplexity > 2.5 for the whole run; TALR weighs each token by
exp(-l_t / tau) of the current model). At f0 (the start of training) this measures, over the
training set's first epoch of batches, the share of

    CE    sum_t l_t            (plain CE: Weight-LoRA and every weight baseline)
    TALR  sum_t w_t l_t        (atlas_core.train.baselines.talr.talr_weights, per batch)
    STM   0 by construction    (the hard tokens are the ones it drops)

that falls on the hard tokens (f0 NLL > ln 2.5), next to their share of the tokens. It loads the
backbone and scores the training set once with f0 (~2 min with loading); nothing is written.

    .venv/bin/python -m bench.repro.token_loss_share --config configs/repro/smollm2.yaml
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline, like the runner
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see BENCHMARKS.md)

import torch

from atlas_core.train.baselines.stm import f0_token_nll, stm_drop
from atlas_core.train.baselines.talr import talr_weights
from atlas_core.train.data import epoch_batches

from .config import load_repro_config
from .runner import default_runner


def loss_shares(nll: Sequence[torch.Tensor], batches: Sequence[Sequence[int]], tau: float = 2.5) -> dict[str, float]:
    """Shares of the hard tokens (NLL > ln tau) in the token count, the CE sum and the TALR-weighted
    sum, over `batches` (lists of example indices; TALR normalises within each batch).
    `nll[i]`: example i's per-token response NLLs (n_i,)."""
    tokens = hard_tokens = ce = hard_ce = talr = hard_talr = 0.0
    for index in batches:
        losses = torch.cat([nll[i] for i in index])  # (N,)
        rows = torch.cat([torch.full((len(nll[i]),), r) for r, i in enumerate(index)])  # (N,)
        hard = torch.cat(stm_drop([nll[i] for i in index], tau))  # (N,) bool
        wl = talr_weights(losses, rows) * losses
        tokens, hard_tokens = tokens + len(losses), hard_tokens + float(hard.sum())
        ce, hard_ce = ce + float(losses.sum()), hard_ce + float(losses[hard].sum())
        talr, hard_talr = talr + float(wl.sum()), hard_talr + float(wl[hard].sum())
    if tokens == 0:
        raise ValueError("batches: no response tokens")
    return {"tokens": hard_tokens / tokens, "ce": hard_ce / ce, "talr": hard_talr / talr, "stm": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--tau", type=float, default=2.5, help="perplexity above which a token is hard (STM's tau)")
    args = parser.parse_args()
    config = load_repro_config(args.config)
    runner = default_runner(config)
    runner.w = runner.make_workload()
    # STM's and TALR's training set and batches are Weight-LoRA's (the rate plays no part at f0)
    rc, _ = runner._train_config("weight-lora", config.seeds[0], config.lr_grid[0])
    data = runner._train_data(rc.train)
    with runner._adapter(rc) as adapter:  # switched off: f0
        nll = f0_token_nll(runner.w.model, adapter, data.train, None, data.pad_id)
    batches = epoch_batches(data.train.lengths, rc.train.batch_size, config.seeds[0], 0, rc.train.bucket_batches)
    shares = loss_shares(nll, batches, args.tau)
    print(f"hard tokens: f0 NLL > ln {args.tau:g} = {math.log(args.tau):.3f}, first epoch's {len(batches)} batches")
    for name, share in shares.items():
        print(f"  {name:6s} {share:7.1%}")


if __name__ == "__main__":
    main()
