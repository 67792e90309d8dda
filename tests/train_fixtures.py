"""Small things the training tests share: a character tokenizer for the tiny models and toy data."""

from __future__ import annotations

import torch

from atlas_core.atlas import AtlasConfig, fit_atlas
from atlas_core.backbone import hidden_at_layer


class CharTokenizer:
    """One token per character (ids 3..96), pad 0, bos 1, eos 2: fits the tiny models' 97-word vocabulary."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    eos_token = "\x02"  # decodes to the eos id
    chat_template = None

    def encode_one(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = [2 if c == "\x02" else 3 + ord(c) % 94 for c in text]
        return ([1] if add_special_tokens else []) + ids

    def __call__(self, texts, add_special_tokens: bool = True, **_):
        return {"input_ids": [self.encode_one(t, add_special_tokens) for t in texts]}


def toy_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Prompts of varying length whose response is a fixed function of the prompt (learnable)."""
    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghij"
    out = []
    for i in range(n):
        k = int(torch.randint(3, 12, (1,), generator=g))
        prompt = "".join(letters[int(j)] for j in torch.randint(0, 10, (k,), generator=g))
        out.append((f"q{prompt}:", prompt[::-1].upper()[:6] + "!"))
    return out


def retained_texts(n: int, seed: int = 1) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    words = ["one", "two", "three", "plus", "is", "four", "five", "="]
    return [
        " ".join(
            words[int(j)]
            for j in torch.randint(0, len(words), (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        )
        for _ in range(n)
    ]


def tiny_atlas(model, layer: int, texts, variant: str = "local"):
    """An atlas fitted on the tiny model's own layer-`layer` states (so routing is meaningful)."""
    tok = CharTokenizer()
    ids = [torch.tensor(tok.encode_one(t, True)) for t in texts]
    xs = [hidden_at_layer(model, layer, i[None], torch.ones_like(i)[None])[0] for i in ids]
    x = torch.cat(xs)
    return fit_atlas(x, AtlasConfig(num_charts=4, rank=4, variant=variant, num_vectors=len(x)), meta={"layer": layer})
