import pytest
import torch
from torch import nn

import atlas_core.backbone as backbone_module
from atlas_core.backbone import cpu_has_bf16, decoder_layers, hidden_at_layer, resolve_dtype, run_from_layer
from tests.conftest import FAMILIES, tiny_model


def test_decoder_layers_found(tiny):
    layers = decoder_layers(tiny)
    assert len(layers) == 4 and isinstance(layers, nn.ModuleList)


def test_unrecognised_stack_is_a_clear_error():
    class NoStack(nn.Module):
        config = type("C", (), {"num_hidden_layers": 3})()

        def __init__(self):
            super().__init__()
            self.blocks_of_something = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(ValueError, match="no decoder layer stack found.*blocks_of_something"):
        decoder_layers(NoStack())


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_hidden_at_layer_matches_full_forward(tiny, tokens, layer):
    ids, mask = tokens
    full = tiny(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    h = hidden_at_layer(tiny, layer, ids, mask)
    # hidden_states[0] is the embedding output; the last entry is after the final norm
    expected = full.hidden_states[layer + 1] if layer + 1 < len(full.hidden_states) - 1 else None
    if expected is not None:
        torch.testing.assert_close(h, expected, rtol=0, atol=0)
    torch.testing.assert_close(run_from_layer(tiny, layer, h, ids, mask), full.logits, rtol=1e-5, atol=1e-5)


def test_hidden_at_layer_stops_early(tiny, tokens):
    ids, mask = tokens
    ran = []
    handles = [m.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, m in enumerate(decoder_layers(tiny))]
    head = tiny.get_output_embeddings().register_forward_hook(lambda *a: ran.append("head"))
    hidden_at_layer(tiny, 1, ids, mask)
    for h in handles + [head]:
        h.remove()
    assert ran == [0, 1]


def test_run_from_layer_skips_lower_layers_and_restores_them(tiny, tokens):
    ids, mask = tokens
    layers = decoder_layers(tiny)
    originals = list(layers)
    ran = []
    handles = [m.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, m in enumerate(layers)]
    h = torch.randn(2, 12, 64)
    run_from_layer(tiny, 1, h, ids, mask)
    for hd in handles:
        hd.remove()
    assert ran == [2, 3]
    assert list(layers) == originals


def test_bad_layer_index(tiny, tokens):
    with pytest.raises(ValueError, match="layer: expected 0 <= layer < 4"):
        hidden_at_layer(tiny, 4, *tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_families_split_and_rejoin_exactly(family, tokens):
    """Llama, Qwen2/3, Mistral, Gemma 1/2 and GLM-4: the stack is found, and running layers
    0..l then l+1..L gives the full forward's logits."""
    model = tiny_model(family)
    ids, mask = tokens
    assert len(decoder_layers(model)) == 4
    full = model(input_ids=ids, attention_mask=mask).logits
    h = hidden_at_layer(model, 1, ids, mask)
    torch.testing.assert_close(run_from_layer(model, 1, h, ids, mask), full, rtol=1e-5, atol=1e-5)


def test_dtype_names_resolve_and_auto_follows_the_hardware(monkeypatch):
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype: expected one of"):
        resolve_dtype("fp16")
    monkeypatch.setattr(backbone_module, "native_bf16", lambda: True)
    assert resolve_dtype("auto") is torch.bfloat16
    monkeypatch.setattr(backbone_module, "native_bf16", lambda: False)
    assert resolve_dtype("auto") is torch.float32


def test_cpu_bf16_is_read_from_the_cpu_flags():
    avx2 = "flags\t\t: fpu sse2 avx avx2 fma f16c"
    assert not cpu_has_bf16(avx2)
    assert cpu_has_bf16(avx2 + " avx512f avx512_bf16") and cpu_has_bf16(avx2 + " amx_bf16 amx_tile")
    assert not cpu_has_bf16("flags: avx512_bf16x")  # whole flags only


def test_contiguous_head_input_feeds_the_head_a_contiguous_slice_with_the_same_logits() -> None:
    # transformers' logits_to_keep=1 slices the last position (strided); torch's CPU linear is then
    # ~100x slower. Inside the context the head sees a contiguous tensor and returns the same logits.
    from atlas_core.backbone import contiguous_head_input
    from evaluation.tiny import tiny_llama

    model = tiny_llama(64)
    ids = torch.randint(3, 64, (3, 7))
    seen: list[bool] = []
    # A forward hook sees the input the head ran on (after every pre-hook).
    handle = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].is_contiguous()))
    try:
        with torch.no_grad():
            plain = model(input_ids=ids, logits_to_keep=1).logits
            with contiguous_head_input(model):
                fixed = model(input_ids=ids, logits_to_keep=1).logits
            after = model(input_ids=ids, logits_to_keep=1).logits
    finally:
        handle.remove()
    assert seen == [False, True, False]  # strided without it, contiguous inside, the hook gone after
    assert torch.equal(plain, fixed) and torch.equal(plain, after)


def test_sampled_positions_start_at_first_when_it_is_given():
    # `first` keeps a text's prompt positions out of the calibration sample (issue 32's post-prompt atlas).
    from atlas_core.errors import InputError
    from atlas_core.extract import sample_activations
    from evaluation.tiny import tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), layers=2)
    texts = ["The answer is 4 plus 5. #### 9", "def add(a, b): return a + b", "print('hello world')"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    first = [len(i) - 2 for i in ids]  # only each text's last two positions may be drawn
    x = sample_activations(model, tok, texts, 1, 6, per_example=2, first=first, progress=False)  # (6, d)
    for k, row in enumerate(ids):
        states = hidden_at_layer(model, 1, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))[0]
        want = states[-2:].float()  # (2, d)
        got = x[2 * k : 2 * k + 2]
        assert any(torch.allclose(got, w, atol=1e-5) for w in (want, want.flip(0)))
    anywhere = sample_activations(model, tok, texts, 1, 6, per_example=2, progress=False)
    assert not torch.allclose(anywhere, x)  # without `first`, earlier positions are drawn too
    with pytest.raises(InputError, match="example 0 has 1 tokens to sample from"):
        sample_activations(model, tok, texts, 1, 6, per_example=2, first=[len(ids[0]) - 1, 0, 0], progress=False)
