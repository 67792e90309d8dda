"""An update applied at answer positions only: the masked control of issue 32 (docs/RESULTS.md).

    m[b, t] = 0  for t up to the end of row b's last assistant header (the rendered prompt: chat
                 template, instruction, question), 1 after it
    residual       h' = h + m * Delta(h)              (B, T, d) at layer l's output
    weight delta   y  = W x + m * (LoRA branch)(x)    (B, T, d_out) at layer l's o_proj, after the
                                                      method's own hooks on the branch

Every method's delta lives in layer l, and what layer l does after its attention is position-wise,
while its attention reads inputs the delta does not change. So under the gate a prompt position's
states are the frozen model's at every layer: its retained KL is exactly 0 for every method, and
an answer position sees only its own update (not one carried from the prompt through attention).
(choice) The mask covers the whole rendered prompt, the shared template with the question: the
positions the KL's "prompt" kind counts, so that the split checks the gate.

The mask is computed from the token ids of each forward. A pre-hook on the input embeddings reads
them in every model forward, partial passes above a prefix cache included (they run the model with
the lower layers replaced): in generation the prefill holds the header, so all of it is masked, and a
decoded token's call holds none, so it is updated. A residual applied to cached states runs before
any embedding, so its caller sets the mask first (the adapters' `hidden`, through their
`update_gate` attribute; the KL's `on_batch`). A mask serves one forward (the delta uses it once,
the LM head clears it): a delta call without one, or with one of another shape, is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .adapters import ResidualAdapter
from .lora import _ADAPTER_NAME


def answer_mask(ids: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
    """(B, T) 1.0 after the last occurrence of `header` (k,) in each row of `ids` (B, T), 0.0 up to
    its end; a row without one is all 1.0 (a decoding step)."""
    B, T = ids.shape
    k = len(header)
    positions = torch.arange(T, device=ids.device)
    if T < k:
        return torch.ones(B, T, device=ids.device)
    windows = ids.unfold(1, k, 1)  # (B, T - k + 1, k)
    hit = (windows == header.to(ids.device)).all(-1)  # (B, T - k + 1)
    start = torch.where(hit, positions[: T - k + 1], -1).max(1).values  # (B,) the last header's start, -1: none
    end = torch.where(start >= 0, start + k - 1, -1)  # (B,)
    return (positions[None, :] > end[:, None]).float()  # (B, T)


def assistant_header(tokenizer) -> list[int]:
    """The token ids the chat template puts before an answer (its generation header, e.g.
    `<|im_start|>assistant\\n`), as they appear in a rendered prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer: the answer-only gate needs a chat template (its assistant header ends the prompt)")
    user = [{"role": "user", "content": "x"}]
    bare = tokenizer.apply_chat_template(user, tokenize=False)
    head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    if not head.startswith(bare) or head == bare:
        raise ValueError("tokenizer: its chat template adds no assistant header to a prompt")
    ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    tail = tokenizer(head[len(bare) :], add_special_tokens=False)["input_ids"]
    if ids[len(ids) - len(tail) :] != tail:
        raise ValueError("tokenizer: the assistant header does not tokenise the same inside a prompt")
    return tail


class UpdateGate:
    """The answer-only mask on one adapter's update (module docstring). `attach` once the method's
    own hooks are in place; `detach` leaves model and adapter as they were."""

    def __init__(self, header: Sequence[int]):
        if not header:
            raise ValueError("header: expected the token ids of the assistant header, got none")
        self.header = torch.tensor(list(header))
        self.m: torch.Tensor | None = None  # (B, T) of the current forward
        self._handles: list = []
        self._adapter = None

    def set(self, ids: torch.Tensor) -> None:
        self.m = answer_mask(ids, self.header)

    def check(self, rows: Sequence[torch.Tensor], prompt_tokens: Sequence[int], where: str) -> None:
        """Refuse data whose prompts the header does not end: the gate must mask exactly the first
        `prompt_tokens[i]` positions of row i (T_i,), else it would update prompt positions silently."""
        for i, (ids, n) in enumerate(zip(rows, prompt_tokens)):
            masked = int((answer_mask(ids[None], self.header) == 0).sum())
            if masked != int(n):
                raise ValueError(
                    f"{where}[{i}]: the assistant header ends its prompt after {masked} tokens, the prompt has "
                    f"{int(n)}: the answer-only gate would not mask exactly the prompt"
                )

    def attach(self, model: nn.Module, adapter) -> "UpdateGate":
        if isinstance(adapter, ResidualAdapter):
            delta = adapter.residual  # its output is Delta(h)
        elif hasattr(adapter, "lora"):
            delta = adapter.lora.lora_B[_ADAPTER_NAME]  # its output is the branch's, scaled by PEFT after
        else:
            raise TypeError(f"adapter: the update gate knows residuals and LoRA branches, got {type(adapter).__name__}")
        self._handles = [
            model.get_input_embeddings().register_forward_pre_hook(lambda _module, args: self.set(args[0])),
            delta.register_forward_hook(self._gate),
            model.get_output_embeddings().register_forward_pre_hook(self._clear),  # before a partial pass stops there
        ]
        adapter.update_gate, self._adapter = self, adapter
        return self

    def _gate(self, _module, _args, out: torch.Tensor) -> torch.Tensor:
        m, self.m = self.m, None  # one delta call per forward: a later forward without `set` has none
        if m is None or tuple(m.shape) != tuple(out.shape[:2]):
            got = None if m is None else tuple(m.shape)
            raise RuntimeError(f"update gate: a mask of shape {tuple(out.shape[:2])} was expected, got {got}")
        return out * m[..., None].to(out)  # (B, T, d)

    def _clear(self, _module, _args) -> None:
        self.m = None  # a mask lives from a forward's embeddings to its head: never one of another pass

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._adapter is not None:
            self._adapter.update_gate, self._adapter = None, None
