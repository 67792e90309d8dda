"""The CUDA code paths of the atlas fit, the residual operator, training and retained KL, each
compared with the same computation on the CPU.

Tests marked `cuda` run where torch.cuda.is_available() and show a visible skip ("needs a
CUDA device") elsewhere; tests/ci_plugin.py lets exactly these skip under CI=true when the
machine has no CUDA device. The first tests run everywhere: a simulated device (a CPU tensor
subclass that refuses to meet a plain CPU tensor, as a CUDA tensor would) checks that the
atlas fit keeps every tensor it creates on its input's device, and a move to the meta device
checks that the residual's operand cache follows the module.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from atlas_core.atlas import AtlasConfig, fit_atlas
from atlas_core.residual import AtlasResidual, ResidualConfig, attach, build_residual
from bench.atlas_fit import clustered
from bench.residual_operator import random_atlas

pytest_plugins = ["pytester"]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VARIANTS = ["atlas", "centered", "centered-distance", "input-filter", "plain"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, both brought to the CPU in fp64."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------- a simulated CUDA device
class DeviceMix(RuntimeError):
    pass


class OnDevice(torch.Tensor):
    """A CPU tensor standing for a CUDA one: an op that mixes it with a plain CPU tensor (other
    than a 0-dim one, or an index into it) or with a CPU generator raises, as CUDA does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return torch.device("cuda", 0)  # so code that passes device=x.device asks for "cuda"
        if getattr(func, "__name__", "") == "cpu":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)  # cpu() of a CPU tensor is itself
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(isinstance(t, cls) for t in tensors):
            if kwargs.get("generator") is not None:
                raise DeviceMix(f"{func.__name__}: a CPU generator with a CUDA tensor")
            if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
                if not isinstance(args[0], cls) and args[0].ndim and isinstance(args[1], cls):
                    raise DeviceMix(f"{func.__name__}: a CUDA index into a CPU tensor")
            elif any(not isinstance(t, cls) and t.ndim for t in tensors):
                raise DeviceMix(f"{func.__name__}: CPU and CUDA tensors in one op")
        return super().__torch_function__(func, types, args, kwargs)


class SimulatedCuda(TorchFunctionMode):
    """Turns device="cuda" (factories, .to) into the CPU and marks the result OnDevice."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        moved = False

        def to_cpu(leaf):
            nonlocal moved
            if (isinstance(leaf, torch.device) and leaf.type == "cuda") or leaf == "cuda":
                moved = True
                return torch.device("cpu")
            return leaf

        args, kwargs = pytree.tree_map(to_cpu, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if moved:
            return pytree.tree_map(lambda t: t.as_subclass(OnDevice) if type(t) is torch.Tensor else t, out)
        if func is torch.Tensor.to and any(str(a) == "cpu" for a in pytree.tree_leaves((args[1:], kwargs))):
            return out.as_subclass(torch.Tensor)
        return out


def test_the_simulated_device_refuses_what_cuda_refuses():
    with SimulatedCuda():
        x = torch.randn(4, 3).to("cuda")
        assert isinstance(x, OnDevice) and x.device.type == "cuda"
        assert isinstance(x[torch.tensor([0, 2])], OnDevice)  # a CPU index into a device tensor is fine
        assert isinstance(torch.zeros(3, device=x.device) + x, OnDevice)
        assert type(x.cpu()) is torch.Tensor
        with pytest.raises(DeviceMix, match="CPU and CUDA"):
            x + torch.zeros(3)
        with pytest.raises(DeviceMix, match="generator"):
            torch.multinomial(x[0].abs(), 2, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"restarts": 3},
        {"variant": "random-local"},
        {"variant": "shuffled-patch"},
        {"equal_support": 40},
        {"num_charts": 1},
        {"rank": 16},
    ],
    ids=["local", "restarts", "random-local", "shuffled-patch", "equal-support", "one-chart", "basis-completed"],
)
def test_fit_atlas_keeps_its_tensors_on_the_input_device_simulated(kwargs):
    """Every tensor fit_atlas creates follows x's device (random draws come from the CPU
    generator and are moved), and the result equals the CPU fit exactly."""
    n = 40 if kwargs.get("rank") == 16 else 300  # ~10 members a chart < m = 16: bases get completed
    x = clustered(n, 32, 4)
    config = AtlasConfig(**{"num_charts": 4, "rank": 4, "num_vectors": n, **kwargs})
    with SimulatedCuda():
        on_device = fit_atlas(x.to("cuda"), config)
    on_cpu = fit_atlas(x, config)
    for name in ("centers", "bases", "sigma", "calibration"):
        got = getattr(on_device, name)
        assert isinstance(got, OnDevice), f"{name} left the device"
        assert torch.equal(got.as_subclass(torch.Tensor), getattr(on_cpu, name)), name
    assert on_device.tau == on_cpu.tau and on_device.meta == on_cpu.meta


def test_residual_operand_cache_follows_a_device_move():
    """module.to() keeps A's version counter; the cached operands must not outlive the move
    (a CPU cache in a CUDA forward would fail). The meta device stands in for CUDA here."""
    residual = AtlasResidual(ResidualConfig(variant="atlas", layer=0, rank=4, top_n=2), 64, random_atlas(64, 8, 4))
    with torch.no_grad():
        residual(torch.randn(3, 64))  # fills the cache on the CPU
        assert residual._cache["U_A"].device.type == "cpu"
        residual.to("meta")
        out = residual(torch.randn(3, 64, device="meta"))
    assert out.device.type == "meta" and residual._cache["U_A"].device.type == "meta"


def test_ci_lets_cuda_tests_skip_only_without_a_device(pytester, monkeypatch):
    """Under CI=true a skip fails the run, except a test marked `cuda` on a machine without CUDA."""
    pytester.makepyfile("""
        import pytest

        @pytest.mark.cuda
        @pytest.mark.skipif(True, reason="needs a CUDA device")
        def test_on_the_gpu():
            pass

        @pytest.mark.skipif(True, reason="data files not available")
        def test_needs_data():
            pass
    """)
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest("-p", "tests.ci_plugin", "-rs")
    if torch.cuda.is_available():  # a device exists: a skipped CUDA test is a failure like any other
        result.assert_outcomes(errors=2)
    else:
        result.assert_outcomes(skipped=1, errors=1)
        result.stdout.fnmatch_lines(["*SKIPPED*needs a CUDA device*"])


# ---------------------------------------------------------------------- on a CUDA device
@pytest.mark.cuda
@needs_cuda
def test_fit_atlas_on_cuda_matches_cpu():
    """Well-separated clusters, so both devices make the same assignments: same chart sizes,
    centers and singular values to 1e-4 relative, the same spans (projectors to 1e-3)."""
    x = clustered(2000, 256, 8)
    config = AtlasConfig(num_charts=8, rank=8, num_vectors=2000)
    cpu, gpu = fit_atlas(x, config), fit_atlas(x.cuda(), config)
    assert gpu.centers.device.type == gpu.bases.device.type == gpu.sigma.device.type == "cuda"
    assert gpu.meta["chart_sizes"] == cpu.meta["chart_sizes"]
    assert gpu.meta["inertia"] == pytest.approx(cpu.meta["inertia"], rel=1e-4)
    assert gpu.tau == pytest.approx(cpu.tau, rel=1e-4)
    assert rel_err(gpu.centers, cpu.centers) < 1e-4
    assert rel_err(gpu.sigma, cpu.sigma) < 1e-4
    # Basis columns are defined up to sign: compare the projectors U_c U_c^T.
    proj = lambda b: b.cpu().double() @ b.cpu().double().transpose(1, 2)
    assert rel_err(proj(gpu.bases), proj(cpu.bases)) < 1e-3


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_residual_forward_and_backward_on_cuda_match_cpu(variant, dtype):
    """Delta(h) on CUDA vs the CPU in fp32 (normwise relative error < 1e-5); in bf16 against the
    CPU fp32 result (< 4e-2: CPU bf16 itself is 1.4e-2 off at these sizes). The same module
    runs on the CPU first, so a stale CPU operand cache would fail here too. fp32 also compares
    the gradients of A and B (training's path)."""
    atlas = random_atlas(256, 16, 8)
    residual = AtlasResidual(ResidualConfig(variant=variant, layer=0, rank=8, top_n=4, scale="calibrated"), 256, atlas)
    torch.nn.init.normal_(residual.B, std=0.1, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(3)
    h = (atlas.centers[torch.arange(512) % 16] + torch.randn(512, 256, generator=g)).view(4, 128, 256)  # (B, T, d)
    with torch.no_grad():
        want = residual(h)  # fp32 on the CPU: the reference
        residual(h.to(dtype))  # fills the operand cache on the CPU
    residual.cuda()
    with torch.no_grad():
        got = residual(h.to("cuda", dtype))
    assert got.device.type == "cuda" and got.dtype == dtype and got.shape == h.shape
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 4e-2)
    if dtype == torch.float32:
        cpu_residual = copy.deepcopy(residual).cpu()
        grads = []
        for module, x in ((cpu_residual, h), (residual, h.cuda())):
            module.zero_grad()
            (module(x) ** 2).sum().backward()
            grads.append([module.A.grad, module.B.grad])
        for cpu_grad, gpu_grad in zip(*grads):
            assert gpu_grad.device.type == "cuda" and rel_err(gpu_grad, cpu_grad) < 1e-4


@pytest.mark.cuda
@needs_cuda
def test_attached_residual_logits_on_cuda_match_cpu():
    """The decoding path: a residual attached to a model on CUDA (moved there by attach)."""
    from tests.conftest import tiny_model
    from tests.train_fixtures import tiny_atlas, toy_pairs

    model = tiny_model("llama")
    atlas = tiny_atlas(model, 1, [p + r for p, r in toy_pairs(40)])
    residual = build_residual(ResidualConfig(variant="atlas", layer=1, rank=4, scale="calibrated"), model, atlas)
    torch.nn.init.normal_(residual.B, std=0.3, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attach(model, residual):
        want = model(input_ids=ids).logits
    model.cuda()
    with torch.no_grad(), attach(model, residual):
        got = model(input_ids=ids.cuda()).logits
    assert residual.A.device.type == "cuda"
    assert rel_err(got, want) < 1e-5


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-cache"])
def test_train_on_cuda_matches_cpu(tmp_path, prefix_cache):
    """Four optimizer steps of a full ATLAS residual on the tiny model, fp32: the same loss
    curve (1e-4 nats a step) and the same factors (1e-3 relative) on both devices."""
    from atlas_core.train import TrainConfig, prepare_data, train
    from tests.conftest import tiny_model
    from tests.train_fixtures import CharTokenizer, tiny_atlas, toy_pairs

    pairs = toy_pairs(40)
    config = TrainConfig(lr=3e-2, epochs=1, batch_size=8, prefix_cache=prefix_cache, progress=False)
    data = prepare_data(CharTokenizer(), pairs[:32], config, val=pairs[32:], chat=False)
    results = []
    for device in ("cpu", "cuda"):
        model = tiny_model("llama")
        atlas = tiny_atlas(model, 2, [p + r for p, r in pairs])
        residual = build_residual(ResidualConfig(variant="atlas", layer=2, rank=4, scale="calibrated"), model, atlas)
        summary = train(model.to(device), residual, data, config, tmp_path / device)
        assert residual.A.device.type == device
        results.append((summary, residual.A.detach().cpu(), residual.B.detach().cpu()))
    (cpu, a_cpu, b_cpu), (gpu, a_gpu, b_gpu) = results
    assert gpu.steps == cpu.steps == 4
    assert gpu.final_train_loss == pytest.approx(cpu.final_train_loss, abs=1e-4)
    assert gpu.final_val_loss == pytest.approx(cpu.final_val_loss, abs=1e-4)
    assert rel_err(a_gpu, a_cpu) < 1e-3 and rel_err(b_gpu, b_cpu) < 1e-3


@pytest.mark.cuda
@needs_cuda
def test_retained_kl_on_cuda_matches_cpu():
    """RetainedKL with the model on CUDA: the same mean and per-context KL (1e-4 relative)."""
    from evaluation.kl import RetainedKL
    from evaluation.tiny import tiny_llama, tiny_tokenizer
    from tests.test_kl import CONTEXTS

    tok = tiny_tokenizer()
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(0)) + 2 * torch.randn(6, 64).repeat(50, 1)
    atlas = fit_atlas(x, AtlasConfig(num_charts=6, rank=4, num_vectors=300), meta={"layer": 1})
    results = []
    for device in ("cpu", "cuda"):
        model = tiny_llama(len(tok), layers=4).to(device)
        champion = build_residual(ResidualConfig(variant="atlas", layer=1, seed=2), model, atlas)
        candidate = build_residual(ResidualConfig(variant="centered", layer=1, seed=3), model, atlas)
        for i, r in enumerate((champion, candidate)):
            torch.nn.init.normal_(r.B, std=0.3, generator=torch.Generator().manual_seed(i))
            r.to(device)
        kl = RetainedKL(model, tok, CONTEXTS, layer=1, batch_size=2, progress=False)
        results.append((kl.kl(kl.reference(), candidate), kl.kl(kl.reference(champion), candidate)))
    for cpu, gpu in zip(*results):
        assert cpu.mean > 1e-4
        assert gpu.mean == pytest.approx(cpu.mean, rel=1e-4)
        assert gpu.per_context == pytest.approx(cpu.per_context, rel=1e-4)
        assert gpu.positions == cpu.positions
