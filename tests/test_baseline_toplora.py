"""TopLoRA: B = 0 is exactly the base; a non-zero B makes a token-wise gated update
s B (Sigma_x A x) whose gate differs per token; the frozen form equals the trained one."""

import torch

from atlas_core.train.baselines.toplora import TopLoRA, toplora_rank
from tests.baseline_fixtures import batch, build, logits, o_proj, tiny


def test_B_zero_gives_the_base_model_exactly():
    model = tiny()
    ids, mask = batch()
    base = logits(model, ids, mask)
    adapter, _ = build(model, "toplora", rank=16)
    assert isinstance(adapter, TopLoRA) and adapter.rank == toplora_rank(16) == 11
    assert torch.equal(adapter.lora_B, torch.zeros_like(adapter.lora_B))
    assert torch.equal(logits(model, ids, mask), base)  # bit-identical
    adapter.remove()


def test_the_gate_changes_the_output_per_token():
    model = tiny()
    adapter, _ = build(model, "toplora", rank=16)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=g) * 0.1)
        adapter.gate.norm.weight.copy_(1 + 0.5 * torch.rand(adapter.rank, generator=g))  # a trained-looking gain
    module = o_proj(model)
    x = torch.randn(2, 5, module.base_layer.in_features, generator=g)  # (B, T, d_in)
    with torch.no_grad():
        got = module(x) - module.base_layer(x)  # the update per token, (B, T, d_out)
        A, B, theta, gain = adapter.lora_A, adapter.lora_B, adapter.gate.theta, adapter.gate.norm.weight
        z = x @ theta  # (B, T, r)
        eps = torch.finfo(z.dtype).eps
        sigma = torch.exp(z / torch.sqrt(z.square().mean(-1, keepdim=True) + eps) * gain)  # Sigma_x, by hand
        want = adapter.scaling * (sigma * (x @ A.T)) @ B.T
        plain = adapter.scaling * (x @ A.T) @ B.T  # the mutation: no gate
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got - plain).abs().max() > 1e-3
    spread = sigma.reshape(-1, adapter.rank).std(0)  # each of the r gate values varies across tokens
    assert bool((spread > 1e-2).all())
    adapter.remove()


def test_budget_is_about_2dr_at_round_2r_over_3():
    model = tiny()
    adapter, _ = build(model, "toplora", rank=16)
    d = 64
    assert adapter.num_trainable == 3 * d * 11 + 11  # A, B, Theta, gain at r_T = 11
    assert abs(adapter.num_trainable - 2 * d * 16) / (2 * d * 16) < 0.05
    adapter.remove()
