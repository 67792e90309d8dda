"""Shared fixtures: tiny randomly initialised decoder models built in-process (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: see flows/platform.py

import pytest
import torch

# ci_plugin: under CI=true a skipped test fails the run; the other two provide the shared fixtures
# (ledger, store, bridge, ...; prefect_harness, state) to every test module by name.
pytest_plugins = ["tests.ci_plugin", "tests.conftest_registry", "tests.flows_fixtures"]

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


FAMILIES = ("llama", "qwen3", "qwen2", "mistral", "gemma", "gemma2", "glm4")


def tiny_model(family: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A 4-layer, d=64 causal LM of the given family with random weights."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_class = {
        "llama": "LlamaConfig",
        "qwen3": "Qwen3Config",
        "qwen2": "Qwen2Config",
        "mistral": "MistralConfig",
        "gemma": "GemmaConfig",
        "gemma2": "Gemma2Config",
        "glm4": "Glm4Config",
    }[family]
    extra = {} if family in ("llama", "qwen2", "mistral") else {"head_dim": 16}
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**TINY, **extra, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(params=["llama", "qwen3"])
def tiny(request) -> torch.nn.Module:
    return tiny_model(request.param)


@pytest.fixture
def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch: (input_ids (2, 12), attention_mask (2, 12)), row 1 left-padded by 3."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, TINY["vocab_size"], (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask
