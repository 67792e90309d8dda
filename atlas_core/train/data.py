"""Training data: plain (prompt, response) records -> token ids -> padded batches.

Callers hand in plain records (a list of (prompt_text, response_text) pairs, dicts with
"prompt"/"response", or bare strings for retained text); everything that touches the
tokenizer lives here. Supervision is the response tokens only: the prompt and the
response are tokenised separately, so the boundary is exact.

Data order is a pure function of (seed, epoch): a resumed run replays exactly the
batches the interrupted one would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_GOLDEN = 0x9E3779B1  # spreads (seed, epoch, stream) over distinct generator seeds


@dataclass(frozen=True)
class Example:
    prompt: str
    response: str
    id: str


@dataclass
class ExampleIssue:
    index: int
    id: str
    reason: str  # "empty response" | "too long (N > max_length)"
    action: str  # "skipped" | "truncated"


@dataclass
class TokenizedSet:
    """Token ids of one data set; example i supervises positions prompt_len[i] .. len-1."""

    name: str
    ids: list[torch.Tensor]  # each (T_i,) long
    prompt_len: torch.Tensor  # (N,) tokens before the first supervised token
    example_ids: list[str]
    issues: list[ExampleIssue] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(t) for t in self.ids])

    @property
    def target_tokens(self) -> int:
        return int((self.lengths - self.prompt_len).sum())

    def fingerprint(self) -> str:
        import hashlib

        digest = hashlib.sha256()
        for t, p in zip(self.ids, self.prompt_len.tolist()):
            digest.update(f"{p}:".encode() + t.numpy().tobytes())
        return digest.hexdigest()


def as_examples(records: Sequence, name: str = "data") -> list[Example]:
    """Normalise records: (prompt, response) pairs, {"prompt","response"[,"id"]} dicts, Example, or a
    bare string (all of it supervised: retained text for Replay/Output-KL)."""
    out = []
    for i, r in enumerate(records):
        if isinstance(r, Example):
            out.append(r)
        elif isinstance(r, str):
            out.append(Example("", r, f"{name}[{i}]"))
        elif isinstance(r, dict):
            if "prompt" not in r or "response" not in r:
                raise ValueError(f"{name}[{i}]: a record dict needs 'prompt' and 'response', got keys {sorted(r)}")
            out.append(Example(str(r["prompt"]), str(r["response"]), str(r.get("id", f"{name}[{i}]"))))
        elif isinstance(r, (tuple, list)) and len(r) == 2 and all(isinstance(x, str) for x in r):
            out.append(Example(r[0], r[1], f"{name}[{i}]"))
        else:
            raise ValueError(
                f"{name}[{i}]: expected a (prompt, response) pair of strings, a dict or a string, got {r!r:.80}"
            )
    return out


def render_chat(tokenizer, prompt: str, response: str) -> tuple[str, str]:
    """(prompt_text, response_text) in the tokenizer's chat format: the prompt as a user turn plus
    the assistant header, the response closed by the template's end-of-turn marker. Without a
    chat template: the texts unchanged, the response followed by the EOS token."""
    if not getattr(tokenizer, "chat_template", None):
        return prompt, response + (tokenizer.eos_token or "")
    user = [{"role": "user", "content": prompt}]
    head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=False)
    if full.startswith(head):
        return head, full[len(head) :].rstrip("\n")
    # templates that rewrite the assistant turn (e.g. thinking blocks): keep the generation header
    return head, response + (tokenizer.eos_token or "")


def tokenize(
    tokenizer,
    records: Sequence,
    max_length: int,
    on_bad_example: str = "raise",
    name: str = "data",
    add_special_tokens: bool | None = None,
) -> TokenizedSet:
    """Token ids of `records`. Empty responses and examples longer than `max_length` are handled by
    `on_bad_example`: 'raise' (all of them listed in one error), 'skip', or 'truncate' (cut the
    response; empty ones skipped). `add_special_tokens` (BOS...) defaults to: only without a
    chat template, whose rendered text already has them."""
    examples = as_examples(records, name)
    if add_special_tokens is None:
        add_special_tokens = not getattr(tokenizer, "chat_template", None)
    prompts = [e.prompt for e in examples]
    responses = [e.response for e in examples]
    p_ids = tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"] if examples else []
    r_ids = tokenizer(responses, add_special_tokens=False)["input_ids"] if examples else []
    ids, prompt_len, kept, issues = [], [], [], []
    for i, (e, p, r) in enumerate(zip(examples, p_ids, r_ids)):
        n = len(p) + len(r)
        if not r:
            issues.append(ExampleIssue(i, e.id, "empty response", "skipped"))
            continue
        if n > max_length:
            if on_bad_example == "truncate" and len(p) < max_length:
                issues.append(ExampleIssue(i, e.id, f"too long ({n} > max_length={max_length})", "truncated"))
                r = r[: max_length - len(p)]
            else:
                issues.append(ExampleIssue(i, e.id, f"too long ({n} > max_length={max_length})", "skipped"))
                continue
        ids.append(torch.tensor(p + r, dtype=torch.long))
        prompt_len.append(len(p))
        kept.append(e.id)
    if issues and on_bad_example == "raise":
        listed = "; ".join(f"#{x.index} ({x.id}): {x.reason}" for x in issues[:20])
        more = f" and {len(issues) - 20} more" if len(issues) > 20 else ""
        raise ValueError(
            f"{name}: {len(issues)} bad example(s): {listed}{more}. Fix the data, raise max_length, "
            f"or set on_bad_example to 'skip' or 'truncate'"
        )
    if not ids:
        raise ValueError(f"{name}: no usable examples ({len(examples)} given)")
    return TokenizedSet(name, ids, torch.tensor(prompt_len, dtype=torch.long), kept, issues)


# ------------------------------------------------------------------------------ order
def generator_for(seed: int, epoch: int, stream: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * _GOLDEN + epoch * 1_000_003 + stream * 7_919) % (2**63))


def epoch_batches(
    lengths: torch.Tensor, batch_size: int, seed: int, epoch: int, bucket_batches: int = 8
) -> list[list[int]]:
    """Batches of example indices for one epoch, a pure function of its arguments.

    Shuffle; sort by length inside windows of `bucket_batches` batches so each batch holds
    similar lengths (little padding); cut into batches; shuffle the batch order.
    """
    g = generator_for(seed, epoch)
    order = torch.randperm(len(lengths), generator=g)
    window = batch_size * bucket_batches
    batches = []
    for start in range(0, len(order), window):
        chunk = order[start : start + window]
        chunk = chunk[torch.sort(lengths[chunk], stable=True, descending=True).indices]
        batches += [chunk[i : i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def retained_indices(n: int, per_batch: int, seed: int, micro_step: int) -> list[int]:
    """Retained examples for global micro-batch `micro_step`: consecutive items of an endless
    sequence of seeded permutations of range(n) (one per pass), so a pure function of the step."""
    start = micro_step * per_batch
    out = []
    while len(out) < per_batch:
        p, offset = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=generator_for(seed, p, stream=1))
        out += perm[offset : offset + per_batch - len(out)].tolist()
    return out


# ------------------------------------------------------------------------------ batches
@dataclass
class Batch:
    ids: torch.Tensor  # (B, T) right-padded with pad_id
    mask: torch.Tensor  # (B, T) 1 on real tokens
    targets: torch.Tensor  # (B, T) the next token to predict at each position, -100 where unsupervised
    index: list[int]  # example indices in their set

    @property
    def num_targets(self) -> int:
        return int((self.targets != -100).sum())


def collate(data: TokenizedSet, index: Sequence[int], pad_id: int, all_positions: bool = False) -> Batch:
    """Right-padded batch (positions start at 0 for every row, as in the unpadded sequence).
    Supervised: predicting token t+1 at position t for response tokens, or every real token if
    `all_positions` (the Output-KL contexts)."""
    seqs = [data.ids[i] for i in index]
    lengths = torch.tensor([len(s) for s in seqs])
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    pos = torch.arange(ids.shape[1])[None, :]
    mask = (pos < lengths[:, None]).long()
    first = torch.zeros_like(lengths) if all_positions else data.prompt_len[list(index)]
    supervised = (pos + 1 >= first[:, None].clamp_min(1)) & (pos + 1 < lengths[:, None])
    nxt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], pad_id)], 1)
    targets = nxt.masked_fill(~supervised, -100)
    if all_positions:  # KL is defined at the last real position too (no next-token label needed)
        targets = targets.masked_fill((pos == lengths[:, None] - 1), 0)
    return Batch(ids, mask, targets, list(index))
