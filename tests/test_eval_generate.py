"""Prompts, batched greedy generation, code extraction and conditional choice on a tiny random Llama."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from evaluation.choice import ChoiceSet, choose, label_token_ids
from evaluation.generate import extract_code, generate, truncate_after, truncate_at_stop
from evaluation.prompts import choice_message, code_message, math_message, render
from evaluation.tiny import tiny_llama, tiny_tokenizer

OPTIONS = ["bank", "library", "department store", "mall", "new york"]


@pytest.fixture(scope="module", params=[True, False], ids=["chat", "plain"])
def model_and_tokenizer(request):
    tok = tiny_tokenizer(chat=request.param)
    return tiny_llama(len(tok), seed=0), tok


def _prompts(tok) -> list[str]:
    return [
        render(tok, math_message("What is 2 + 3?"), "math"),
        render(tok, code_message("Write a function to add two numbers.", "assert add(1, 2) == 3"), "code"),
        render(tok, choice_message("Where is money kept?", OPTIONS), "choice"),
        render(tok, math_message("A train travels 60 km in 1.5 hours. What is its average speed in km/h?"), "math"),
    ]


def test_render_chat_and_plain() -> None:
    chat, plain = tiny_tokenizer(chat=True), tiny_tokenizer(chat=False)
    message = code_message("Write add.", "assert add(1, 2) == 3")
    assert render(chat, message, "code") == f"<s><|user|>{message}\n<|assistant|>"
    assert render(plain, message, "code") == f"{message}\n\n```python\n"
    assert "assert add(1, 2) == 3" in message and "```python" in message
    assert "The answer is N" in math_message("q")
    assert "A. bank\nB. library\nC. department store\nD. mall\nE. new york" in choice_message("s", OPTIONS)
    with pytest.raises(ValueError, match="unknown task"):
        render(chat, message, "poetry")


def _manual_greedy(model, tok, prompt: str, n: int) -> str:
    """Reference: unbatched greedy decoding by full forward passes, no cache, no padding."""
    ids = tok(prompt, return_tensors="pt", add_special_tokens=tok.chat_template is None)["input_ids"]
    start = ids.shape[1]
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=ids).logits[0, -1].argmax()
            if nxt.item() == tok.eos_token_id:
                break
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return tok.decode(ids[0, start:], skip_special_tokens=True)


def test_batched_generation_matches_manual_greedy(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    prompts = _prompts(tok)
    batched = generate(model, tok, prompts, max_new_tokens=12, batch_size=3, progress=False)
    assert batched == [_manual_greedy(model, tok, p, 12) for p in prompts]
    # Deterministic, order-preserving, independent of batch composition.
    assert generate(model, tok, prompts[::-1], max_new_tokens=12, batch_size=4, progress=False) == batched[::-1]
    assert tok.padding_side == "right"  # restored afterwards


def test_budget_and_stop_strings(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    prompts = _prompts(tok)
    full = generate(model, tok, prompts, max_new_tokens=16, batch_size=2, progress=False)
    # The budget: 4 new tokens give exactly the first 4 greedy tokens.
    short = generate(model, tok, prompts, max_new_tokens=4, batch_size=2, progress=False)
    assert short == [_manual_greedy(model, tok, p, 4) for p in prompts]
    # A stop string taken from the middle of one completion cuts that completion there.
    target = next(t for t in full if len(t) >= 8)
    stop = target[4:7]
    stopped = generate(model, tok, prompts, max_new_tokens=16, batch_size=2, stop=[stop], progress=False)
    for before, after in zip(full, stopped):
        assert after == truncate_at_stop(before, [stop])
    assert all(stop not in t for t in stopped)
    assert len(stopped[full.index(target)]) < len(target)


def test_stop_after_a_pattern_ends_that_row_early(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    prompts = _prompts(tok)
    full = generate(model, tok, prompts, max_new_tokens=16, batch_size=2, progress=False)
    target = next(t for t in full if len(t) >= 8)
    pattern = re.compile(re.escape(target[4:7]))
    stopped = generate(model, tok, prompts, max_new_tokens=16, batch_size=2, stop_after=pattern, progress=False)
    assert stopped == [truncate_after(t, pattern) for t in full]
    assert stopped[full.index(target)] == target[:7]
    # Generation itself stops: fewer forward passes than the 16-token budget needs.
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        generate(model, tok, [prompts[full.index(target)]], max_new_tokens=16, stop_after=pattern, progress=False)
    finally:
        handle.remove()
    assert len(calls) < 16


def _previous_generate(model, tok, prompt: str, n: int, eos: list[int], stop=(), stop_after=None) -> str:
    """The previous implementation, transformers' `generate`, one prompt at a time."""
    from transformers import GenerationConfig

    enc = tok(prompt, return_tensors="pt", add_special_tokens=tok.chat_template is None)
    config = GenerationConfig(
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
        stop_strings=list(stop) or None,
    )
    out = model.generate(**enc, generation_config=config, tokenizer=tok if stop else None)
    return truncate_after(
        truncate_at_stop(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True), stop), stop_after
    )


def _sharp(model):
    """A copy of the tiny model whose attention is sharp enough that positions change its argmax."""
    sharp = copy.deepcopy(model)
    with torch.no_grad():
        for layer in sharp.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    return sharp


@pytest.mark.parametrize("grow", [1, 128], ids=["cache-grows-every-step", "cache-grows-by-128"])
def test_equals_transformers_generate_with_rows_ending_at_different_steps(
    model_and_tokenizer, monkeypatch, grow
) -> None:
    # Rows end by an eos id (one picked from the longest prompt's completion, so a row in the middle
    # of a batch ends early), a stop string and a stop_after pattern; the ended rows leave the batch
    # and the rest must decode on unchanged.
    import evaluation.generate as g

    monkeypatch.setattr(g, "_GROW", grow)
    model, tok = _sharp(model_and_tokenizer[0]), model_and_tokenizer[1]
    prompts = _prompts(tok) + [
        render(tok, math_message("How many legs have " + "two " * i + "cats?"), "math") for i in range(1, 5)
    ]
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    free = generate(model, tok, prompts, max_new_tokens=24, batch_size=8, progress=False)
    enc = tok(prompts[longest], return_tensors="pt", add_special_tokens=tok.chat_template is None)
    early = int(model.generate(**enc, max_new_tokens=4, do_sample=False)[0, -1])  # its 4th new token
    model.generation_config.eos_token_id = [tok.eos_token_id, early]
    stop, after = free[1][5:8], re.compile(re.escape(free[2][6:9]))
    eos = g._eos_ids(model, tok)
    expected = [_previous_generate(model, tok, p, 24, eos, [stop], after) for p in prompts]
    assert len(expected[longest]) < len(free[longest]) and expected[1] != free[1] and expected[2] != free[2]
    rows: list[int] = []
    handle = model.register_forward_hook(
        lambda m, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        for batch_size in (1, 3, 8):
            rows.clear()
            got = generate(
                model,
                tok,
                prompts,
                max_new_tokens=24,
                batch_size=batch_size,
                stop=[stop],
                stop_after=after,
                progress=False,
            )
            assert got == expected, batch_size
        # In the batch of 8 the ended rows left: the rows per forward fall.
        assert rows[0] == 8 and rows[-1] < 8 and rows == sorted(rows, reverse=True)
        # A row that meets its stop string, or an eos, ends there: fewer steps than the budget.
        for i in (1, longest):
            rows.clear()
            generate(model, tok, [prompts[i]], max_new_tokens=24, stop=[stop], progress=False)
            assert len(rows) < 24
    finally:
        handle.remove()


def test_forward_hook_changes_generation(model_and_tokenizer) -> None:
    # An adapter attached by a forward hook must take effect without anything special here.
    model, tok = model_and_tokenizer
    prompts = _prompts(tok)[:2]
    plain = generate(model, tok, prompts, max_new_tokens=8, progress=False)
    steer = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 50
    handle = model.model.layers[0].register_forward_hook(
        lambda m, i, out: (out[0] + steer, *out[1:]) if isinstance(out, tuple) else out + steer
    )
    try:
        hooked = generate(model, tok, prompts, max_new_tokens=8, progress=False)
    finally:
        handle.remove()
    assert hooked != plain
    assert generate(model, tok, prompts, max_new_tokens=8, progress=False) == plain


def _choice_prompts(tok, n: int) -> list[str]:
    return [render(tok, choice_message("Where is money kept" + "?" * i, OPTIONS), "choice") for i in range(n)]


def _unbatched_label_logprobs(model, tok, prompt: str) -> torch.Tensor:
    enc = tok(prompt, return_tensors="pt", add_special_tokens=tok.chat_template is None)
    with torch.no_grad():
        return torch.log_softmax(model(**enc).logits[0, -1], dim=-1)[label_token_ids(tok)]


def test_choice_matches_unbatched_forward_and_follows_logits(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    prompts = _choice_prompts(tok, 5)
    result = choose(model, tok, prompts, batch_size=3, progress=False)
    ids = label_token_ids(tok)
    for prompt, row in zip(prompts, result.logprobs):
        assert torch.allclose(row, _unbatched_label_logprobs(model, tok, prompt), atol=1e-5)
    assert result.choices == ["ABCDE"[i] for i in result.logprobs.argmax(-1).tolist()]
    # Push the logit of label "C" up: every choice must become C.
    bias = torch.zeros(len(tok))
    bias[ids[2]] = 100.0
    handle = model.lm_head.register_forward_hook(lambda m, i, out: out + bias)
    try:
        forced = choose(model, tok, prompts, batch_size=2, progress=False)
    finally:
        handle.remove()
    assert forced.choices == ["C"] * 5
    gold = ["C", "C", "A", "B", "C"]
    assert forced.accuracy(gold) == pytest.approx(3 / 5)
    assert [a.correct for a in forced.answers([f"q{i}" for i in range(5)], gold)] == [True, True, False, False, True]


def _adding(steer: torch.Tensor):
    return lambda m, i, out: (out[0] + steer, *out[1:]) if isinstance(out, tuple) else out + steer


def _same(a, b) -> bool:
    return torch.allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0) and a.choices == b.choices


def test_choice_from_prefix_states_equals_full_forwards(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    prompts = _choice_prompts(tok, 7)  # batches of 3, 3, 1 with different amounts of left padding
    full = choose(model, tok, prompts, batch_size=3, progress=False)
    choices = ChoiceSet(model, tok, prompts, batch_size=3, layer=0)
    states = [h.clone() for h in choices.prefix()]  # the base model's, before anything is attached
    assert _same(choices.choose(progress=False), full)
    adopted = ChoiceSet(model, tok, prompts, batch_size=3, layer=0)  # as read back from disk
    adopted.use_prefix(states)
    assert _same(adopted.choose(progress=False), full)

    steer = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(2)) * 5
    # A delta above the prefix layer (layer 1): both paths see it, and it changes the answers.
    handle = model.model.layers[1].register_forward_hook(_adding(steer))
    try:
        above = choose(model, tok, prompts, batch_size=3, progress=False)
        assert _same(choices.choose(progress=False), above)
    finally:
        handle.remove()
    assert not torch.allclose(above.logprobs, full.logprobs, atol=1e-3)
    # A delta at the prefix layer: the stored states miss it, which is why flows.resources.prefix_serves
    # refuses them for such a version.
    handle = model.model.layers[0].register_forward_hook(_adding(steer))
    try:
        at = choose(model, tok, prompts, batch_size=3, progress=False)
        assert _same(choices.choose(progress=False), full) and not torch.allclose(at.logprobs, full.logprobs, atol=1e-3)
    finally:
        handle.remove()


def test_choice_prefix_states_are_checked(model_and_tokenizer) -> None:
    model, tok = model_and_tokenizer
    prompts = _choice_prompts(tok, 5)
    choices = ChoiceSet(model, tok, prompts, batch_size=3, layer=0)
    states = choices.prefix()
    assert [tuple(h.shape[:2]) for h in states] == [tuple(ids.shape) for ids, *_ in choices.batches]
    d = model.config.hidden_size
    wrong = {
        "batches": states[:1],
        "length": [states[0][:, 1:], states[1]],
        "width": [h[..., : d - 1] for h in states],
        "rank": [h[0] for h in states],
        "rows": [states[1], states[0]],
    }
    for name, bad in wrong.items():
        with pytest.raises(ValueError, match="prefix states"):
            ChoiceSet(model, tok, prompts, batch_size=3, layer=0).use_prefix(bad)
    for call in (lambda c: c.prefix(), lambda c: c.use_prefix(states)):
        with pytest.raises(ValueError, match="without a prefix layer"):
            call(ChoiceSet(model, tok, prompts, batch_size=3))


def test_choice_passes_left_padded_positions(model_and_tokenizer) -> None:
    # Llama's rotary attention only sees relative positions, which left padding does not shift; a
    # model with absolute position embeddings (GPT-2) answers differently at shifted positions.
    # The rows of one left-padded batch must answer as if each prompt ran alone, by full forwards
    # and through the prefix (lower layers) and the upper layers alike.
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = model_and_tokenizer[1]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tok),
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    ).eval()
    prompts = _choice_prompts(tok, 5)
    choices = ChoiceSet(model, tok, prompts, batch_size=5, layer=0)
    ids, mask, _, rows = choices.batches[0]
    assert (mask == 0).any(dim=1).sum() == 4  # one batch, every prompt but the longest padded
    alone = torch.stack([_unbatched_label_logprobs(model, tok, p) for p in prompts])
    for result in (choices.choose(progress=False), choose(model, tok, prompts, batch_size=5, progress=False)):
        assert torch.allclose(result.logprobs, alone, atol=1e-5)
    with torch.no_grad():  # what the padded rows would get at the positions 0..T-1 of the batch
        shifted = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, -1], dim=-1)
    assert not torch.equal(shifted[:, label_token_ids(tok)].argmax(-1), alone[rows].argmax(-1))

    # The layers above the prefix get the full forward's positions too (where rotary attention
    # is not shift-invariant, e.g. dynamic rope scaling, they would matter there as well).
    llama, seen = model_and_tokenizer[0], []
    upper = llama.model.layers[1].register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["position_ids"]), with_kwargs=True
    )
    try:
        choose(llama, tok, prompts, batch_size=5, progress=False)
        ChoiceSet(llama, tok, prompts, batch_size=5, layer=0).choose(progress=False)
    finally:
        upper.remove()
    assert len(seen) == 2 and all(torch.equal(p, choices.batches[0][2]) for p in seen)


@pytest.mark.parametrize(
    "completion, entry_point, expected",
    [
        (
            "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.",
            "add",
            "def add(a, b):\n    return a + b",
        ),
        (
            "```\nimport math\ndef f(x):\n    return math.sqrt(x)\n```",
            None,
            "import math\ndef f(x):\n    return math.sqrt(x)",
        ),
        (
            "```python\nprint(add(1, 2))\n```\n```py\ndef add(a, b):\n    return a + b\n```",
            "add",
            "def add(a, b):\n    return a + b",
        ),
        (
            "```python\ndef helper():\n    pass\n```\n```python\ndef add(a, b):\n    return a+b\n```",
            "add",
            "def add(a, b):\n    return a+b",
        ),
        ("```python\ndef add(a, b):\n    return a + b", "add", "def add(a, b):\n    return a + b"),  # unclosed fence
        (
            "```text\nnot code\n```\ndef add(a, b):\n    return a + b",
            None,
            "def add(a, b):\n    return a + b",
        ),  # non-python fence skipped
        ("The function:\ndef add(a, b):\n    return a + b\n", "add", "def add(a, b):\n    return a + b"),  # raw code
        ("return 1", None, "return 1"),
    ],
)
def test_extract_code(completion: str, entry_point: str | None, expected: str) -> None:
    assert extract_code(completion, entry_point) == expected


def test_task_pipelines_on_tiny_model() -> None:
    # End to end on real data with the tiny random model: shapes and bookkeeping, not quality.
    from evaluation.tasks import eval_csqa_choice, eval_gsm8k, eval_mbpp_plus

    tok = tiny_tokenizer(chat=True)
    model = tiny_llama(len(tok))
    math = eval_gsm8k(model, tok, limit=3, max_new_tokens=4)
    assert [a.id for a in math.answers] == ["gsm8k-test-0", "gsm8k-test-1", "gsm8k-test-2"]
    assert math.accuracy == sum(a.correct for a in math.answers) / 3
    csqa = eval_csqa_choice(model, tok, limit=4)
    assert len(csqa.answers) == 4 and all(a.answer in "ABCDE" for a in csqa.answers)
    code = eval_mbpp_plus(model, tok, limit=2, max_new_tokens=4)
    assert code.result.n == 2 and code.result.solved == 0  # random tokens do not solve MBPP+
    assert set(code.completions) == {"Mbpp/11", "Mbpp/12"}
