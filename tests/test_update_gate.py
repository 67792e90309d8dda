"""The answer-only update gate (atlas_core/train/update_gate.py): the mask after the last assistant
header, every method's update exactly absent at prompt positions (so their KL is exactly 0) and
present after them, the prefix-cache passes equal to full forwards, and cached generation equal to
generation by full forwards."""

import pytest
import torch

from atlas_core.backbone import hidden_at_layer, upper_hidden
from atlas_core.residual import ResidualConfig, attach, build_residual
from atlas_core.train.adapters import ResidualAdapter
from atlas_core.train.prefix_cache import head_logits
from atlas_core.train.update_gate import UpdateGate, answer_mask, assistant_header
from evaluation.kl import RetainedKL
from evaluation.tiny import tiny_tokenizer
from tests.baseline_fixtures import LAYER, WEIGHT_METHODS, build, logits, tiny

HEADER = [7, 8]


def test_mask_is_zero_up_to_the_end_of_the_last_header():
    ids = torch.tensor(
        [
            [1, 7, 8, 2, 3, 4],  # header at 1-2
            [7, 8, 1, 7, 8, 5],  # the last one counts: 3-4
            [1, 2, 3, 4, 5, 6],  # none: a decoding step, all updated
            [1, 2, 3, 4, 7, 8],  # header at the end: a prefill, all masked
        ]
    )
    want = torch.tensor(
        [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.float
    )
    assert torch.equal(answer_mask(ids, torch.tensor(HEADER)), want)
    assert torch.equal(answer_mask(torch.tensor([[7]]), torch.tensor(HEADER)), torch.ones(1, 1))


def test_the_header_is_the_chat_template_s_generation_prompt():
    tok = tiny_tokenizer()
    header = assistant_header(tok)
    user = [{"role": "user", "content": "add two numbers"}]
    head = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    ids = tok(head, add_special_tokens=False)["input_ids"]
    assert ids[-len(header) :] == header
    with pytest.raises(ValueError, match="needs a chat template"):
        assistant_header(tiny_tokenizer(chat=False))


def _ids() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Two rows: 4 prompt tokens ending in the header, then 6 answer tokens; the prompt length."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(10, 97, (2, 10), generator=g)
    ids[:, 2:4] = torch.tensor(HEADER)
    return ids, torch.ones_like(ids), 4


def _residual(model) -> ResidualAdapter:
    residual = build_residual(ResidualConfig(variant="plain", layer=LAYER, rank=4), model)
    with torch.no_grad():
        residual.B.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    return ResidualAdapter(residual)


def test_residual_update_is_m_times_delta_on_every_path():
    model = tiny()
    ids, mask, n_prompt = _ids()
    adapter = _residual(model)
    m = answer_mask(ids, torch.tensor(HEADER))[..., None]  # (B, T, 1)
    with torch.no_grad():
        h = hidden_at_layer(model, LAYER, ids, mask)  # (B, T, d)
        want = head_logits(model, upper_hidden(model, LAYER, h + m * adapter.residual(h), ids, mask)).float()
        ungated = head_logits(model, upper_hidden(model, LAYER, h + adapter.residual(h), ids, mask)).float()
    base = logits(model, ids, mask)
    gate = UpdateGate(HEADER).attach(model, adapter)
    with attach(model, adapter.residual):
        full = logits(model, ids, mask)
    with torch.no_grad():
        cached = head_logits(model, adapter.hidden(model, ids, mask, h.clone())).float()
    torch.testing.assert_close(full, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached, want, rtol=0, atol=1e-5)
    assert torch.equal(full[:, :n_prompt], base[:, :n_prompt])  # exactly the frozen model on the prompt
    assert (full[:, n_prompt:] - base[:, n_prompt:]).abs().max() > 1e-3  # the answer is updated
    assert (full[:, n_prompt:] - ungated[:, n_prompt:]).abs().max() > 1e-4  # without the prompt's update
    gate.detach()
    assert adapter.update_gate is None
    with attach(model, adapter.residual):
        torch.testing.assert_close(logits(model, ids, mask), ungated, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", WEIGHT_METHODS)
def test_every_weight_method_s_update_is_absent_on_the_prompt_and_present_after(method):
    model = tiny()
    ids, mask, n_prompt = _ids()
    base = logits(model, ids, mask)
    adapter, _ = build(model, method)
    with torch.no_grad():
        adapter.lora_B.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    ungated = logits(model, ids, mask)
    gate = UpdateGate(HEADER).attach(model, adapter)
    full = logits(model, ids, mask)
    with torch.no_grad():
        h = hidden_at_layer(model, adapter.cache_layer, ids, mask)
        cached = head_logits(model, adapter.hidden(model, ids, mask, h)).float()
    assert torch.equal(full[:, :n_prompt], base[:, :n_prompt])
    assert (full[:, n_prompt:] - base[:, n_prompt:]).abs().max() > 1e-3
    assert (ungated[:, :n_prompt] - base[:, :n_prompt]).abs().max() > 1e-3  # ungated, the prompt moves
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
    gate.detach()
    torch.testing.assert_close(logits(model, ids, mask), ungated, rtol=0, atol=0)
    adapter.remove()


@pytest.mark.parametrize("kind", ["residual", "weight-lora"])
def test_prompt_position_kl_is_exactly_zero_under_the_gate(kind):
    tok = tiny_tokenizer()
    model = tiny(hidden=64, layers=3)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    header = assistant_header(tok)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("what is 2 + 3?", "add 4 and 5", "how many legs has a cat?")
    ]
    contexts = [p + a for p, a in zip(prompts, ("it is 5", "9, the sum", "four legs"))]
    if kind == "residual":
        adapter = _residual(model)
        residual, layer = adapter.residual, LAYER  # applied to the cached prefix, above no embeddings
    else:
        adapter, _ = build(model, "weight-lora")
        with torch.no_grad():
            adapter.lora_B.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        residual, layer = None, adapter.cache_layer  # in the model: its pass runs the embeddings' hook
    kl = RetainedKL(model, tok, contexts, layer, batch_size=2, progress=False, prompts=prompts)
    if kind == "residual":
        reference = kl.reference()
    else:
        with adapter.disabled():
            reference = kl.reference()
    ungated = kl.kl(reference, residual)
    gate = UpdateGate(header).attach(model, adapter)
    gated = kl.kl(reference, residual, on_batch=gate.set)
    assert ungated.by_kind["prompt"].mean > 1e-4
    assert gated.by_kind["prompt"].mean == 0.0 and gated.by_kind["response"].mean > 1e-4
    if kind == "residual":
        with pytest.raises(RuntimeError, match="update gate: a mask of shape .* was expected, got None"):
            kl.kl(reference, residual)  # the residual runs before any embedding: without on_batch, no mask
    gate.detach()
    if kind == "weight-lora":
        adapter.remove()


def test_cached_generation_equals_full_forwards_under_the_gate():
    model = tiny()
    ids, _, n_prompt = _ids()
    prompt = ids[:1, :n_prompt]  # ends with the header
    adapter = _residual(model)
    gate = UpdateGate(HEADER).attach(model, adapter)
    with attach(model, adapter.residual), torch.no_grad():
        out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        seq = prompt
        for _ in range(5):  # each step a full forward: the mask sees the header, prompt masked
            nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)
    gate.detach()


def test_the_evaluation_s_batched_generation_equals_full_forwards_under_the_gate():
    """evaluation.generate (left-padded batches, a KV cache, finished rows leaving the batch) decodes
    under the gate what one full forward per token gives: prompt masked, generated tokens updated."""
    from evaluation.generate import generate

    tok = tiny_tokenizer()
    model = tiny()
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    adapter = _residual(model)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("what is 2 + 3?", "add", "how many legs has a cat?")
    ]
    gate = UpdateGate(assistant_header(tok)).attach(model, adapter)
    with attach(model, adapter.residual), torch.no_grad():
        got = generate(model, tok, prompts, max_new_tokens=6, batch_size=2, progress=False)
        want = []
        for p in prompts:
            seq = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
            new = []
            for _ in range(6):
                nxt = int(model(input_ids=seq).logits[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                new.append(nxt)
                seq = torch.cat([seq, torch.tensor([[nxt]])], 1)
            want.append(tok.decode(new, skip_special_tokens=True))
    gate.detach()
    with attach(model, adapter.residual), torch.no_grad():
        ungated = generate(model, tok, prompts, max_new_tokens=6, batch_size=2, progress=False)
    assert got == want
    assert got != ungated  # the gate changed what was generated: the comparison is not vacuous
