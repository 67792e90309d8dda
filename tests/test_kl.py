"""Retained-output KL with prefix and reference caches, against a naive two-forward version."""

import pytest
import torch
import torch.nn.functional as F

from atlas_core.atlas import AtlasConfig, fit_atlas
from atlas_core.residual import ResidualConfig, attach, build_residual
from evaluation.kl import RetainedKL
from evaluation.tiny import tiny_llama, tiny_tokenizer

CONTEXTS = [
    "Question: What is 2 + 3? Answer: 5",
    "def add(a, b):\n    return a + b\n",
    "The answer is 42. #### 42",
    "A. bank\nB. library",
    "print('hello world')",
]


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), layers=4)
    x = torch.randn(300, 64) + 2 * torch.randn(6, 64).repeat(50, 1)
    atlas = fit_atlas(x, AtlasConfig(num_charts=6, rank=4, num_vectors=300), meta={"layer": 1})
    return model, tok, atlas


def residual(model, atlas, seed, std=0.3, variant="atlas"):
    r = build_residual(ResidualConfig(variant=variant, layer=1, seed=seed), model, atlas)
    torch.nn.init.normal_(r.B, std=std, generator=torch.Generator().manual_seed(seed))
    return r


def naive_kl(model, tok, contexts, ref_residual, residual):
    """Two full forwards per context, one context at a time, no padding at all."""
    total, count = 0.0, 0
    for text in contexts:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            if ref_residual is None:
                ref = model(input_ids=ids).logits
            else:
                with attach(model, ref_residual):
                    ref = model(input_ids=ids).logits
            with attach(model, residual):
                new = model(input_ids=ids).logits
        p = F.softmax(ref[0].double(), -1)
        kl = (p * (p.log() - F.log_softmax(new[0].double(), -1))).sum(-1)
        total += float(kl.sum())
        count += kl.numel()
    return total / count


def test_kl_zero_for_identical_models(setup):
    model, tok, atlas = setup
    kl = RetainedKL(model, tok, CONTEXTS, layer=1, batch_size=2, progress=False)
    assert kl.kl(kl.reference()).mean == pytest.approx(0.0, abs=1e-7)
    r = residual(model, atlas, seed=0)
    ref = kl.reference(r)
    assert kl.kl(ref, r).mean == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_kl_matches_naive_against_base(setup, batch_size):
    model, tok, atlas = setup
    r = residual(model, atlas, seed=1)
    kl = RetainedKL(model, tok, CONTEXTS, layer=1, batch_size=batch_size, progress=False)
    result = kl.kl(kl.reference(), r)
    assert result.mean > 1e-4
    assert result.mean == pytest.approx(naive_kl(model, tok, CONTEXTS, None, r), rel=1e-4)
    assert result.positions == sum(len(tok(c, add_special_tokens=False)["input_ids"]) for c in CONTEXTS)
    per = [naive_kl(model, tok, [c], None, r) for c in CONTEXTS]
    assert result.per_context == pytest.approx(per, rel=1e-4)


def test_kl_against_a_released_version_and_cache_reuse(setup):
    model, tok, atlas = setup
    champion, candidate = residual(model, atlas, seed=2), residual(model, atlas, seed=3, variant="centered")
    kl = RetainedKL(model, tok, CONTEXTS, layer=1, batch_size=2, progress=False)
    ref = kl.reference(champion)
    prefix_before = [h.clone() for h in kl.prefix()]
    first = kl.kl(ref, candidate).mean
    assert first == pytest.approx(naive_kl(model, tok, CONTEXTS, champion, candidate), rel=1e-4)
    # the caches are reused as they are: a second checkpoint does not recompute the prefix
    calls = []
    hook = model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    kl.kl(ref, residual(model, atlas, seed=4))
    hook.remove()
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(prefix_before, kl.prefix()))
    assert kl.cache_bytes() == sum(h.numel() * 4 for h in prefix_before)


def test_one_pass_against_several_references_equals_separate_passes(setup):
    model, tok, atlas = setup
    champion, candidate = residual(model, atlas, seed=2), residual(model, atlas, seed=5)
    kl = RetainedKL(model, tok, CONTEXTS, layer=1, batch_size=2, progress=False)
    base_ref, champ_ref = kl.reference(), kl.reference(champion)
    separate = [kl.kl(base_ref, candidate), kl.kl(champ_ref, candidate)]
    calls = []  # the candidate's upper layers run once per batch for both references
    hook = model.model.layers[-1].register_forward_hook(lambda *a: calls.append(1))
    both = kl.kl_many([base_ref, champ_ref, base_ref], candidate)  # the base given twice: measured once
    hook.remove()
    assert len(calls) == len(kl.batches)
    for got, want in zip(both, [*separate, separate[0]]):
        assert got.mean == want.mean and got.per_context == want.per_context  # the same arithmetic: bit-identical
    assert separate[0].mean != separate[1].mean


def test_residual_at_the_wrong_layer_is_refused(setup):
    model, tok, atlas = setup
    kl = RetainedKL(model, tok, CONTEXTS, layer=2, progress=False)
    with pytest.raises(ValueError, match="prefix cache ends at 2"):
        kl.kl(kl.reference(), residual(model, atlas, seed=0))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_reference_logits_from_final_hidden_match_the_forward(family, tokens):
    """The reference cache keeps pre-head hidden states; the head (with Gemma 2's logit
    soft-capping) must turn them back into exactly the model's logits."""
    from atlas_core.backbone import full_hidden, head_logits
    from tests.conftest import tiny_model

    model = tiny_model(family)
    ids, mask = tokens
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        final = full_hidden(model, ids, mask)
    torch.testing.assert_close(head_logits(model, final), logits, rtol=0, atol=0)


def naive_kl_positions(model, tok, text, residual):
    """KL(base || base + residual) at each position of one context: two full forwards, no padding."""
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with attach(model, residual):
            new = model(input_ids=ids).logits
    p = F.softmax(ref[0].double(), -1)
    return (p * (p.log() - F.log_softmax(new[0].double(), -1))).sum(-1)  # (T,)


# Each context cut after its prompt; the last two: no prompt at all, and nothing but prompt.
PROMPTS = ["Question: What is 2 + 3? Answer:", "def add(a, b):", "The answer is", "", "print('hello world')"]


@pytest.mark.parametrize("batch_size", [1, 2])
def test_kl_by_position_kind_equals_a_hand_split(setup, batch_size):
    model, tok, atlas = setup
    r = residual(model, atlas, seed=5)
    kl = RetainedKL(model, tok, CONTEXTS, layer=1, batch_size=batch_size, progress=False, prompts=PROMPTS)
    result = kl.kl(kl.reference(), r)
    sums, counts, per_context = {"prompt": 0.0, "response": 0.0}, {"prompt": 0, "response": 0}, []
    for text, prompt in zip(CONTEXTS, PROMPTS):
        n = len(tok(prompt, add_special_tokens=False)["input_ids"]) if prompt else 0
        assert (
            tok(text, add_special_tokens=False)["input_ids"][:n] == tok(prompt, add_special_tokens=False)["input_ids"]
        )
        values = naive_kl_positions(model, tok, text, r)
        parts = {"prompt": values[:n], "response": values[n:]}
        for kind, v in parts.items():
            sums[kind] += float(v.sum())
            counts[kind] += v.numel()
        per_context.append({k: float(v.mean()) if v.numel() else None for k, v in parts.items()})
    for kind in ("prompt", "response"):
        part = result.by_kind[kind]
        assert part.positions == counts[kind]
        assert part.mean == pytest.approx(sums[kind] / counts[kind], rel=1e-4)
        for got, want in zip(part.per_context, per_context):
            assert (got != got) if want[kind] is None else got == pytest.approx(want[kind], rel=1e-4)
    # The two kinds partition the positions: their count-weighted means give the mean over all.
    prompt, response = result.by_kind["prompt"], result.by_kind["response"]
    assert prompt.positions + response.positions == result.positions
    weighted = (prompt.mean * prompt.positions + response.mean * response.positions) / result.positions
    assert weighted == pytest.approx(result.mean, rel=1e-9)
    assert counts["prompt"] > 0 and counts["response"] > 0 and sums["prompt"] > 0


def test_without_prompts_there_is_no_split_and_a_prompt_must_begin_its_context(setup):
    model, tok, atlas = setup
    kl = RetainedKL(model, tok, CONTEXTS, layer=1, progress=False)
    assert kl.kl(kl.reference()).by_kind is None
    with pytest.raises(ValueError, match="context 1 does not start with its prompt"):
        RetainedKL(model, tok, CONTEXTS, layer=1, progress=False, prompts=[PROMPTS[0], "class", *PROMPTS[2:]])
    with pytest.raises(ValueError, match="one per context"):
        RetainedKL(model, tok, CONTEXTS, layer=1, progress=False, prompts=PROMPTS[:2])
