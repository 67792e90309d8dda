"""What the baseline tests share: tiny models of chosen widths, retained statistics, a few real
training steps, and logits through the adapter or through a chain of saved deltas."""

from __future__ import annotations

import torch

from atlas_core.backbone import decoder_layers
from atlas_core.train import LoRAOptions, RunConfig, TrainConfig, build_adapter, prepare_data, train
from atlas_core.train.config import CLoRAOptions, LoRANullOptions, OLoRAOptions, OPLoRAOptions
from atlas_core.train.retained_stats import collect_stats
from tests.train_fixtures import CharTokenizer, retained_texts, toy_pairs

LAYER = 1
WEIGHT_METHODS = (
    "weight-lora",
    "lora-null",
    "lora-null-v2",
    "oplora",
    "o-lora",
    "corda-kpm",
    "clora",
    "toplora",
    "centered-lora",
)


def tiny(
    hidden: int = 64, heads: int = 4, head_dim: int | None = None, layers: int = 3, family: str = "llama", seed: int = 0
) -> torch.nn.Module:
    """A random causal LM; o_proj of each layer is (hidden, heads * head_dim)."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    extra = {} if head_dim is None else {"head_dim": head_dim}
    torch.manual_seed(seed)
    config = cls(
        vocab_size=97,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        **extra,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def retained_ids(n: int = 6, seed: int = 1) -> list[torch.Tensor]:
    tok = CharTokenizer()
    return [torch.tensor(tok.encode_one(t, True)) for t in retained_texts(n, seed)]


def stats_for(model, n: int = 6, layer: int = LAYER):
    return collect_stats(model, layer, retained_ids(n))


def run_config(method: str, rank: int = 4, layer: int = LAYER, **train) -> RunConfig:
    """adapter weight-lora with lora.method = `method` ("lora-null-v2": LoRA-Null in mode v2)."""
    opts = LoRAOptions(
        method="lora-null" if method == "lora-null-v2" else method,
        alpha=float(rank),
        lora_null=LoRANullOptions(mode="v2" if method == "lora-null-v2" else "v1"),
        oplora=OPLoRAOptions(k=train.pop("k", 16)),
        o_lora=OLoRAOptions(),
        clora=CLoRAOptions(),
    )
    return RunConfig(
        adapter="weight-lora",
        layer=layer,
        rank=rank,
        lora=opts,
        train=TrainConfig(progress=False, **({"lr": 2e-2, "epochs": 1, "batch_size": 4} | train)),
    )


def build(model, method: str, rank: int = 4, stats=None, **train):
    rc = run_config(method, rank, **train)
    return build_adapter(rc, model, stats=stats if stats is not None else stats_for(model)), rc


def train_steps(model, adapter, rc: RunConfig, run_dir, pairs: int = 16):
    """A few real optimizer steps (16 pairs, batch 4: 4 steps per epoch)."""
    data = prepare_data(CharTokenizer(), toy_pairs(pairs), rc.train, val=toy_pairs(4, seed=5))
    return train(model, adapter, data, rc.train, run_dir)


def batch(seed: int = 0, length: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 97, (2, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


@torch.no_grad()
def logits(model, ids, mask) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).logits.float()


def o_proj(model, layer: int = LAYER) -> torch.nn.Module:
    """The module at layer l's o_proj (the PEFT wrapper while an adapter is installed)."""
    return decoder_layers(model)[layer].self_attn.o_proj


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
