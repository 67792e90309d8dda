"""STM, selective token masking (Wu et al., NeurIPS 2025, arXiv 2501.14315; code
appier-research/robust-llm-finetunes).

Once, before training, the frozen f0 scores every response token of the (chat-templated)
training set; every token with perplexity above tau is dropped from the loss for the whole run:

    drop_t = [ NLL_f0(y_t | prompt, y_<t) > ln tau ],   tau = 2.5  (ln 2.5 = 0.916)

The mask is a function of the training set and f0 only, so it is computed once and cached
under a content key: the training set's fingerprint, tau, and a probe of f0 (sha256 of its
final hidden states on the first example, so another backbone, dtype or parent chain misses).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ...io import IntegrityError, config_hash, load_verified, save_verified
from ...methods import register_objective
from ...paths import state_dir
from ..data import Batch, TokenizedSet, collate
from ..objectives import Objective, Run, mean_loss, selected_logits

STM_FORMAT = 1


@torch.no_grad()
def f0_token_nll(model, adapter, data: TokenizedSet, cache, pad_id: int, batch_size: int = 16) -> list[torch.Tensor]:
    """Per example, f0's NLL of each response token (adapter switched off): list of (n_i,) fp32."""
    out: list[torch.Tensor | None] = [None] * len(data)
    for start in range(0, len(data), batch_size):
        batch = collate(data, list(range(start, min(start + batch_size, len(data)))), pad_id)
        logits, targets = selected_logits(model, adapter, batch, cache, enabled=False)  # (N, V), (N,)
        nll = F.cross_entropy(logits, targets, reduction="none").cpu()
        counts = (batch.targets != -100).sum(1).tolist()
        for i, chunk in zip(batch.index, nll.split(counts)):
            out[i] = chunk
    return out


def stm_drop(nll: list[torch.Tensor], tau: float) -> list[torch.Tensor]:
    """Per example, True where the token leaves the loss: NLL > ln tau (perplexity > tau)."""
    return [x > math.log(tau) for x in nll]


def apply_drop(batch: Batch, drop: list[torch.Tensor]) -> Batch:
    """The batch with the dropped response tokens unsupervised (targets -100)."""
    sel = batch.targets != -100  # (B, T); row-major order = each example's response tokens in order
    flat = torch.cat([drop[i] for i in batch.index])
    if int(sel.sum()) != len(flat):
        raise ValueError(f"stm: the mask covers {len(flat)} tokens, the batch supervises {int(sel.sum())}")
    targets = batch.targets.clone()
    targets[sel] = torch.where(flat, torch.full_like(targets[sel], -100), targets[sel])
    return Batch(batch.ids, batch.mask, targets, batch.index)


def _probe(model, adapter, data: TokenizedSet) -> str:
    ids = data.ids[0][None].to(next(model.parameters()).device)
    with torch.no_grad():
        h = adapter.hidden(model, ids, torch.ones_like(ids), None, enabled=False)
    return hashlib.sha256(h.float().cpu().numpy().tobytes()).hexdigest()


def stm_mask(
    model,
    adapter,
    data: TokenizedSet,
    cache,
    pad_id: int,
    tau: float = 2.5,
    batch_size: int = 16,
    cache_dir: str | Path | None = None,
) -> tuple[list[torch.Tensor], dict]:
    """(per-example drop masks, info) for the training set `data`, from the cache when stored."""
    key = config_hash("stm-mask", STM_FORMAT, tau, data.fingerprint(), _probe(model, adapter, data))
    path = Path(cache_dir if cache_dir is not None else state_dir() / "stm-masks") / f"{key}.safetensors"
    counts = (data.lengths - data.prompt_len.clamp_min(1)).tolist()  # response tokens per example
    if path.is_file():
        tensors, manifest = load_verified(path, kind="stm-mask")
        if manifest.get("counts") != counts:
            raise IntegrityError(f"{path}: mask for other examples")
        drop = list(tensors["drop"].bool().split(counts))
    else:
        drop = stm_drop(f0_token_nll(model, adapter, data, cache, pad_id, batch_size), tau)
        save_verified(
            path,
            {"drop": torch.cat(drop).to(torch.uint8)},
            {"kind": "stm-mask", "format": STM_FORMAT, "tau": tau, "key": key, "counts": counts},
        )
    total = sum(counts)
    dropped = int(sum(int(d.sum()) for d in drop))
    return drop, {"key": key, "tau": tau, "dropped": dropped, "tokens": total, "path": str(path)}


class STM(Objective):
    """CE without the response tokens f0 finds hard (perplexity > stm_tau), masked once per training set."""

    kind = "stm"
    own_fields = ("stm_tau",)  # a field added for STM leaves the other objectives' run keys as they were

    def setup(self, run: Run) -> dict:
        tau, batch_size = self.config.stm_tau, run.config.cache_batch_size
        self.drop, info = stm_mask(
            run.model, run.adapter, run.data.train, run.cache("train"), run.data.pad_id, tau, batch_size
        )
        note = (
            f"STM: {info['dropped']:,} of {info['tokens']:,} response tokens dropped (f0 perplexity > {info['tau']:g})"
        )
        self.val_drop = None  # the same rule on the validation set: STM's own validation loss
        if run.data.val is not None:
            self.val_drop, _ = stm_mask(
                run.model, run.adapter, run.data.val, run.cache("val"), run.data.pad_id, tau, batch_size
            )
        return {"stm": info, "notes": [note]}

    def target_batch(self, batch: Batch) -> Batch:
        return apply_drop(batch, self.drop)

    def validation_loss(self, run: Run) -> float | None:
        """CE over the validation tokens f0 does not find hard (the tokens STM would train on); None
        when the rule drops them all (no own loss to record)."""
        if self.val_drop is None or all(bool(d.all()) for d in self.val_drop):
            return None
        return mean_loss(
            run.model,
            run.adapter,
            run.data.val,
            run.cache("val"),
            run.data.pad_id,
            run.config.cache_batch_size,
            target_batch=lambda batch: apply_drop(batch, self.val_drop),
        )


register_objective(STM)
