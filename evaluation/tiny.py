"""A tiny randomly initialised Llama and a byte-level BPE tokenizer, built in-process.

For tests and smoke runs of the evaluation code: nothing is downloaded. The tokenizer is
trained on a handful of strings, so every byte is encodable and decoding round-trips; the
chat template is a minimal one (<|user|> ... <|assistant|>).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_BACKBONE = "tiny-llama"  # the backbone name of the seeded toy (tests and smoke runs)
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The answer is 42. #### 42",
    "Question: What is 2 + 3? Answer: 5",
    "A. bank\nB. library\nC. store\nD. mall\nE. park",
    "```python\nprint('hello world')\n```",
    "Answer: A Answer: B Answer: C Answer: D Answer: E",
]


def tiny_tokenizer(chat: bool = True, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Byte-level BPE; with `chat`, a chat template is attached."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=specials[3:],
    )
    if chat:
        tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def tiny_llama(vocab_size: int, seed: int = 0, hidden_size: int = 64, layers: int = 2) -> LlamaForCausalLM:
    """A random 2-layer Llama in float32, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def load_model(name: str, dtype: str = "auto"):
    """An `atlas_core.backbone.Backbone` in `dtype` (a name from DTYPES, 'auto' included);
    TINY_BACKBONE is a seeded random 4-layer fp32 toy, anything else atlas_core.backbone.load_backbone."""
    from atlas_core.backbone import Backbone, decoder_layers, load_backbone

    if name != TINY_BACKBONE:
        return load_backbone(name, dtype)
    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), seed=0, hidden_size=64, layers=4)
    model.config.max_position_embeddings = 2048  # GSM8K contexts in a 400-token BPE run long
    return Backbone(TINY_BACKBONE, f"tiny-seed0-d64-l4-v{len(tokenizer)}", model, tokenizer, decoder_layers(model))
