"""Retained-output KL: how far a model's next-token distributions moved on retained contexts.

KL(p_ref || p_model) over the full vocabulary at every non-padding position of shared
teacher-forced contexts (prompt + reference answer: identical tokens for every model),
averaged over positions (spec section 5).

Given each context's prompt, the KL is also split by position kind: a *prompt* position's hidden
state has seen prompt tokens only (positions 0..n_prompt - 1, the last of which predicts the first
answer token), a *response* position's has seen some of the reference answer. Every context of a
domain shares its chat template and instruction, so its prompt positions repeat across contexts
(and across the atlas's calibration rows); the split says how much of the mean they carry:
mean = (n_p mean_p + n_r mean_r) / (n_p + n_r).

What is fixed is computed once per context set and reused for every checkpoint:
- the frozen prefix: layer-l hidden states (layers 0..l never run again), and
- the reference: its final pre-head hidden states (d numbers a position instead of V
  probabilities; its logits are one LM-head GEMM away, so no reference layer runs again).
A checkpoint then costs layers l+1..L plus two LM-head GEMMs per position, instead of two
full forwards. Memory: positions x d x (2 bytes in bf16, 4 in fp32) for each of the two
caches, e.g. 512 contexts x 300 tokens x 576 x 4 B = 354 MB each for SmolLM2 in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from atlas_core.backbone import full_hidden, head_logits, hidden_at_layer, hidden_size, upper_hidden
from atlas_core.residual import AtlasResidual

POSITION_KINDS = ("prompt", "response")


@dataclass
class KLPart:
    """The KL over one kind of position (POSITION_KINDS)."""

    mean: float | None  # nats per position over this kind's positions; None: there are none (not measured)
    positions: int
    per_context: list[float]  # each context's mean over its positions of this kind (NaN: it has none)


@dataclass
class KLResult:
    mean: float  # nats per position, averaged over all non-padding positions
    per_context: list[float]  # mean KL of each context, in the caller's order
    positions: int
    by_kind: dict[str, KLPart] | None = None  # POSITION_KINDS -> its part; None: no prompts were given

    def to_record(self) -> dict:
        """JSON-ready: the mean, each context's, and both per position kind when split; NaN (a
        context without a position of a kind) as None."""
        num = lambda v: None if v != v else v
        record = {
            "mean": num(self.mean),
            "positions": self.positions,
            "contexts": len(self.per_context),
            "per_context": [num(v) for v in self.per_context],
        }
        if self.by_kind is not None:
            record["by_kind"] = {
                k: {"mean": p.mean, "positions": p.positions, "per_context": [num(v) for v in p.per_context]}
                for k, p in self.by_kind.items()
            }
        return record


def kl_per_position(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) (..., ) in fp32 over the last (vocabulary) dimension."""
    return kl_of_log_probs(F.log_softmax(ref_logits.float(), dim=-1), F.log_softmax(logits.float(), dim=-1))


def kl_of_log_probs(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) (..., ) from fp32 log-probabilities (..., V)."""
    return F.kl_div(logp, ref_logp, log_target=True, reduction="none").sum(-1)


# Positions per LM-head GEMM in `kl_many`: (128, V) fp32 logits (25 MB for a 49k vocabulary) stay
# under the allocator's mmap threshold, so the buffers are reused; whole-batch logits were mapped
# and zeroed again for every batch (measured: 1.6x faster head + KL, bench/eval_candidate.py).
HEAD_CHUNK = 128


def adopted_states(
    states: Sequence[torch.Tensor], shapes: Sequence[torch.Size], model: torch.nn.Module
) -> list[torch.Tensor]:
    """Prefix states (one (B, T, d) tensor per batch of token ids of `shapes`) checked and moved to
    the model's device: states of another batching or another model would be silently wrong."""
    if len(states) != len(shapes):
        raise ValueError(f"prefix states: expected {len(shapes)} batches, got {len(states)}")
    d = hidden_size(model)
    for shape, h in zip(shapes, states):
        if h.ndim != 3 or tuple(h.shape) != (*shape, d):
            raise ValueError(f"prefix states: expected a batch of shape {(*shape, d)}, got {tuple(h.shape)}")
    dev = next(model.parameters()).device
    return [h.to(dev) for h in states]


def prompt_token_counts(
    tokenizer, contexts: Sequence[str], prompts: Sequence[str], context_ids: Sequence[Sequence[int]]
) -> torch.Tensor:
    """(C,) how many of each context's tokens (`context_ids`, as the KL tokenised them) belong to
    its prompt: the prompt's own tokens that the context's tokenisation starts with (a template's
    turn marker ends the prompt, so no token straddles the boundary; if one did, it would count
    as the response's)."""
    if len(prompts) != len(contexts):
        raise ValueError(f"prompts: expected one per context ({len(contexts)}), got {len(prompts)}")
    counts = []
    heads = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    for i, (context, prompt, head, ids) in enumerate(zip(contexts, prompts, heads, context_ids)):
        if not context.startswith(prompt):
            raise ValueError(f"prompts: context {i} does not start with its prompt")
        n = min(len(head), len(ids))
        counts.append(next((t for t in range(n) if head[t] != ids[t]), n))
    return torch.tensor(counts)


class RetainedKL:
    """KL of adapted checkpoints against a reference on one fixed set of contexts.

    `layer` is where the frozen prefix ends: a residual must sit at this layer; a change
    inside layer l (Weight-LoRA on its o_proj) needs the prefix to end at l - 1. Layer -1: a
    delta changes layer 0 (e.g. a submitted LoRA on every layer), nothing below it can be
    cached, and every pass runs the whole model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        contexts: Sequence[str],
        layer: int,
        batch_size: int = 4,
        max_length: int = 1024,
        progress: bool = True,
        prompts: Sequence[str] | None = None,
    ):
        """`prompts`: each context's prompt (the context must start with it), to split the KL by
        position kind (KLResult.by_kind); None: the mean and per-context values only."""
        if not contexts:
            raise ValueError("contexts: expected at least one retained context")
        self.model, self.layer, self.progress = model, layer, progress
        enc = tokenizer(list(contexts), add_special_tokens=False, truncation=True, max_length=max_length)
        lengths = torch.tensor([len(ids) for ids in enc["input_ids"]])
        if (lengths == 0).any():
            raise ValueError(f"contexts: context {int((lengths == 0).nonzero()[0])} is empty after tokenisation")
        self.lengths = lengths  # (C,) tokens of each context, in the caller's order
        # (C,) how many of them are prompt positions; None: no prompts given, no split
        self.prompt_tokens = (
            None if prompts is None else prompt_token_counts(tokenizer, contexts, prompts, enc["input_ids"])
        )
        order = torch.argsort(lengths, descending=True, stable=True)  # similar lengths share a batch: little padding
        self.order = order
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for start in range(0, len(order), batch_size):
            rows = [enc["input_ids"][int(i)] for i in order[start : start + batch_size]]
            width = max(len(r) for r in rows)
            # Right padding: real tokens keep positions 0..n-1 whatever their batch.
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            self.batches.append((ids, mask))
        # (B, T) per batch: 1 at a response position, 0 at a prompt position (and at padding)
        counts = self.prompt_tokens if self.prompt_tokens is not None else torch.zeros_like(lengths)
        self.response_at = [
            (torch.arange(ids.shape[1]) >= counts[order[start : start + batch_size], None]).long() * mask
            for start, (ids, mask) in zip(range(0, len(order), batch_size), self.batches)
        ]
        self._prefix: list[torch.Tensor] | None = None
        self.positions = int(lengths.sum())

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def prefix(self) -> list[torch.Tensor]:
        """Layer-l hidden states of every batch, computed on first use (layers 0..l only)."""
        if self.layer < 0:
            raise ValueError("the KL runs whole forwards (layer -1): it has no prefix states")
        if self._prefix is None:
            dev = self._device()
            self._prefix = [
                hidden_at_layer(self.model, self.layer, ids.to(dev), mask.to(dev))
                for ids, mask in tqdm(self.batches, desc="KL prefix cache", disable=not self.progress)
            ]
        return self._prefix

    def use_prefix(self, states: list[torch.Tensor]) -> None:
        """Adopt prefix states computed before (e.g. stored on disk) for these same contexts."""
        self._prefix = adopted_states(states, [ids.shape for ids, _ in self.batches], self.model)

    def cache_bytes(self) -> int:
        """Memory held by the prefix cache (the reference cache holds the same again)."""
        return sum(h.numel() * h.element_size() for h in self._prefix or [])

    @torch.no_grad()
    def _upper(self, i: int, residual: AtlasResidual | None) -> torch.Tensor:
        """Final (pre-head) hidden states of batch i with `residual` (or none) at the prefix layer."""
        ids, mask = self.batches[i]
        dev = self._device()
        if self.layer < 0:  # no prefix: the whole model, attached deltas included
            if residual is not None:
                raise ValueError("residual: a whole-model KL (layer -1) takes attached deltas only")
            return full_hidden(self.model, ids.to(dev), mask.to(dev))
        h = self.prefix()[i]
        if residual is not None:
            if residual.config.layer != self.layer:
                raise ValueError(
                    f"residual: sits at layer {residual.config.layer}, the prefix cache ends at {self.layer}"
                )
            h = h + residual(h)
        return upper_hidden(self.model, self.layer, h, ids.to(dev), mask.to(dev))

    @torch.no_grad()
    def reference(self, residual: AtlasResidual | None = None) -> list[torch.Tensor]:
        """The reference's final hidden states per batch: the base model, or a released
        version given by its residual."""
        return [
            self._upper(i, residual)
            for i in tqdm(range(len(self.batches)), desc="KL reference", disable=not self.progress)
        ]

    @torch.no_grad()
    def kl(
        self,
        reference: list[torch.Tensor],
        residual: AtlasResidual | None = None,
        on_batch: Callable[[torch.Tensor], None] | None = None,
    ) -> KLResult:
        """Mean KL(p_ref || p_model) where the model is the backbone with `residual` attached
        at the prefix layer (None: the backbone as it is, e.g. with LoRA injected above).
        `on_batch(ids)`: called with each batch's token ids (B, T) before its pass (e.g. an
        update gate's `set`: a pass from the prefix cache never runs the embeddings)."""
        return self.kl_many([reference], residual, on_batch)[0]

    @torch.no_grad()
    def kl_many(
        self,
        references: Sequence[list[torch.Tensor]],
        residual: AtlasResidual | None = None,
        on_batch: Callable[[torch.Tensor], None] | None = None,
    ) -> list[KLResult]:
        """`kl` against several references (e.g. the base and the champion) in one pass: the
        model's layers l+1..L, its LM head and log-softmax run once per batch for all of them,
        and a reference given twice (the same list object) is measured once."""
        for reference in references:
            if len(reference) != len(self.batches):
                raise ValueError(f"reference: expected {len(self.batches)} batches, got {len(reference)}")
        distinct = list({id(r): r for r in references}.values())
        sums = [torch.zeros(len(self.order), 2, dtype=torch.float64) for _ in distinct]  # (C, kind) KL sums
        row = 0
        for i in tqdm(range(len(self.batches)), desc="KL", disable=not self.progress):
            ids, mask = self.batches[i]
            if on_batch is not None:
                on_batch(ids.to(self._device()))
            real = mask.bool().to(self._device())
            h = self._upper(i, residual)[real]  # (N, d): real positions only, padding never reaches the head
            refs = [reference[i][real] for reference in distinct]
            # (N,): 2 * (the context's row in the batch) + (1 at a response position)
            slot = (real.nonzero()[:, 0].cpu() * 2 + self.response_at[i][real.cpu()]).long()
            batch_sums = [torch.zeros(2 * len(mask), dtype=torch.float64) for _ in distinct]
            for start in range(0, len(h), HEAD_CHUNK):
                part = slice(start, start + HEAD_CHUNK)
                logp = F.log_softmax(head_logits(self.model, h[part]).float(), dim=-1)  # (n, V)
                for j, ref in enumerate(refs):
                    ref_logp = F.log_softmax(head_logits(self.model, ref[part]).float(), dim=-1)
                    batch_sums[j].index_add_(0, slot[part], kl_of_log_probs(ref_logp, logp).cpu().double())
            for j, per_slot in enumerate(batch_sums):
                sums[j][self.order[row : row + len(mask)]] = per_slot.view(-1, 2)
            row += len(mask)
        results = {id(r): self._result(s) for r, s in zip(distinct, sums)}
        return [results[id(r)] for r in references]

    def _result(self, sums: torch.Tensor) -> KLResult:
        """A KLResult from the (C, 2) KL sums of each context's prompt and response positions."""
        lengths, total = self.lengths.double(), sums.sum(1)  # (C,), (C,)
        result = KLResult(
            mean=float(total.sum()) / self.positions,
            per_context=(total / lengths).tolist(),
            positions=self.positions,
        )
        if self.prompt_tokens is None:
            return result
        counts = torch.stack([self.prompt_tokens.double(), lengths - self.prompt_tokens.double()], 1)  # (C, 2)
        per_context = sums / counts  # (C, 2); NaN where a context has no position of a kind (0 / 0)
        result.by_kind = {
            kind: KLPart(
                mean=float(sums[:, k].sum() / counts[:, k].sum()) if counts[:, k].sum() > 0 else None,
                positions=int(counts[:, k].sum()),
                per_context=per_context[:, k].tolist(),
            )
            for k, kind in enumerate(POSITION_KINDS)
        }
        return result
