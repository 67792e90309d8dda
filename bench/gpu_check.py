"""GPU check: the residual operator per token, the atlas fit and the decoding overhead of an
ATLAS residual on one CUDA device, each next to its baseline and the paper's figure. Random
weights and synthetic data only: nothing is downloaded.

    .venv/bin/python bench/gpu_check.py            # one CUDA device (about 2-4 min on an H100/H200)
    .venv/bin/python bench/gpu_check.py --smoke    # tiny sizes on the CPU: the script runs, not a benchmark

It measures
- the full ATLAS residual (d=4096, K=32 charts, top n=4, chart rank m=16, r=16, bf16) in
  us/token against one d x 4d matmul on the same tokens (CUDA events, median of repeats);
- the atlas fit (k-means++ / Lloyd + local PCA) at N=4096 vectors, d=4096;
- greedy decoding tokens/s of a randomly initialised ~1.2B-parameter Llama (bf16) with and
  without a residual attached at its middle layer, batch 1 and 8, best of 3, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from atlas_core.atlas import AtlasConfig, fit_atlas
from atlas_core.residual import AtlasResidual, ResidualConfig, attach
from bench.atlas_fit import clustered
from bench.residual_operator import random_atlas

# Full sizes (the paper's settings) and the --smoke sizes that run in seconds on a CPU.
FULL = dict(
    d=4096,
    k=32,
    n=4,
    m=16,
    r=16,
    tokens=8192,
    op_repeat=20,
    fit_n=4096,
    fit_d=4096,
    fit_repeat=2,
    llama=dict(
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    prompt=32,
    new_tokens=128,
    gen_repeat=3,
)
SMOKE = dict(
    d=64,
    k=8,
    n=2,
    m=4,
    r=4,
    tokens=256,
    op_repeat=3,
    fit_n=256,
    fit_d=64,
    fit_repeat=1,
    llama=dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=97,
    ),
    prompt=8,
    new_tokens=8,
    gen_repeat=1,
)
PAPER = {"operator": "10.4-11.1 us/tok", "fit": "38.5 s", "decoding": "+2.5-3.1%"}


def progress(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeat: int, warmup: int = 3) -> float:
    """Median seconds of fn() after warmup; CUDA events on a GPU (kernel time, not launch time)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)  # ms -> s
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def wall_seconds(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


# ---------------------------------------------------------------------- the three measurements
def residual_operator(s: dict, device: torch.device) -> list[tuple]:
    """us/token of the full residual vs one d x 4d matmul, bf16 (the paper's) and fp32."""
    progress(f"residual operator: d={s['d']} K={s['k']} n={s['n']} m={s['m']} r={s['r']}, {s['tokens']} tokens")
    atlas = random_atlas(s["d"], s["k"], s["m"])
    residual = AtlasResidual(ResidualConfig(variant="atlas", layer=0, rank=s["r"], top_n=s["n"]), s["d"], atlas)
    torch.nn.init.normal_(residual.B, std=0.02)
    residual.to(device)
    g = torch.Generator().manual_seed(1)
    # Tokens near the centers, as real hidden states are: routing then has real top-n choices.
    h = atlas.centers[torch.arange(s["tokens"]) % s["k"]] + torch.randn(s["tokens"], s["d"], generator=g)  # (N, d)
    up = torch.randn(s["d"], 4 * s["d"], generator=g) / s["d"] ** 0.5  # (d, 4d): an MLP up-projection
    rows = []
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            x, w = h.to(device, dtype), up.to(device, dtype)
            t_res = median_seconds(lambda: residual(x), device, s["op_repeat"])
            t_mm = median_seconds(lambda: x @ w, device, s["op_repeat"])
            us = 1e6 / s["tokens"]
            name = str(dtype).split(".")[-1]
            progress(f"  {name}: residual {t_res * us:.3f} us/tok, matmul {t_mm * us:.3f} us/tok")
            rows.append(
                (
                    f"residual operator {name}",
                    f"{t_res * us:.3f} us/tok",
                    f"{t_mm * us:.3f} us/tok",
                    f"{t_res / t_mm:.1%}",
                    PAPER["operator"] if dtype == torch.bfloat16 else "",
                )
            )
    return rows


def atlas_fit(s: dict, device: torch.device) -> list[tuple]:
    """Wall seconds of fit_atlas on the device (best of fit_repeat), after a small warm-up fit
    (CUDA context, cuBLAS/cuSOLVER handles)."""
    n, d, k, m = s["fit_n"], s["fit_d"], s["k"], s["m"]
    progress(f"atlas fit: N={n} d={d} K={k} m={m}, generating data")
    x = clustered(n, d, k).to(device)  # (N, d), the same data as bench/atlas_fit.py
    config = AtlasConfig(num_charts=k, rank=m, num_vectors=n)
    fit_atlas(x[: max(8 * k, n // 8)], AtlasConfig(num_charts=k, rank=m, num_vectors=max(8 * k, n // 8)))
    times = []
    for i in range(s["fit_repeat"]):
        seconds = wall_seconds(lambda: fit_atlas(x, config), device)
        times.append(seconds)
        progress(f"  fit {i + 1}/{s['fit_repeat']}: {seconds:.2f} s")
    return [(f"atlas fit N={n} d={d}", f"{min(times):.2f} s", "", "", PAPER["fit"])]


def decoding(s: dict, device: torch.device) -> list[tuple]:
    """Greedy generate tokens/s, base vs a residual attached at the middle layer, batch 1 and 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = s["llama"]
    config = LlamaConfig(**cfg, max_position_embeddings=s["prompt"] + s["new_tokens"] + 8, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a CPU init of 1.2B weights takes minutes
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    layer = cfg["num_hidden_layers"] // 2
    progress(f"decoding: random Llama, {params / 1e9:.2f}B parameters, residual at layer {layer}")
    atlas = random_atlas(cfg["hidden_size"], s["k"], s["m"])
    residual = AtlasResidual(
        ResidualConfig(variant="atlas", layer=layer, rank=s["r"], top_n=s["n"]), cfg["hidden_size"], atlas
    )
    torch.nn.init.normal_(residual.B, std=0.01)
    g = torch.Generator().manual_seed(2)

    def tokens_per_s(ids: torch.Tensor) -> float:
        def run():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=s["new_tokens"],
                min_new_tokens=s["new_tokens"],
                do_sample=False,
                pad_token_id=0,
            )

        return ids.shape[0] * s["new_tokens"] / wall_seconds(run, device)

    rows = []
    with torch.no_grad():
        for batch in (1, 8):
            ids = torch.randint(1, cfg["vocab_size"], (batch, s["prompt"]), generator=g).to(device)  # (B, T)
            tokens_per_s(ids)  # warm-up: kernels, allocator
            base, adapted = [], []
            for i in range(s["gen_repeat"]):  # interleaved, so both see the same clocks
                base.append(tokens_per_s(ids))
                with attach(model, residual):
                    adapted.append(tokens_per_s(ids))
                progress(
                    f"  batch {batch}, round {i + 1}/{s['gen_repeat']}: base {base[-1]:.1f}, "
                    f"adapted {adapted[-1]:.1f} tok/s"
                )
            b, a = max(base), max(adapted)
            rows.append(
                (f"decoding batch {batch}", f"{a:.1f} tok/s", f"{b:.1f} tok/s", f"{b / a - 1:+.1%}", PAPER["decoding"])
            )
    return rows


def table(rows: list[tuple]) -> str:
    header = ("measurement", "ours", "baseline", "ratio", "paper")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (runs on the CPU in seconds; not a benchmark)")
    parser.add_argument("--device", default=None, help="cuda (default), or cpu with --smoke")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["operator", "fit", "decoding"],
        default=["operator", "fit", "decoding"],
        help="run only these measurements",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: CUDA was requested (device {device}) but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). Run it on a machine with a CUDA "
            "device, or pass --smoke to check the script on the CPU.",
            file=sys.stderr,
        )
        return 2
    sizes = SMOKE if args.smoke else FULL
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    started = time.perf_counter()
    rows = []
    for part, fn in (("operator", residual_operator), ("fit", atlas_fit), ("decoding", decoding)):
        if part in args.only:
            rows += fn(sizes, device)
    kind = "SMOKE RUN (tiny sizes, not a benchmark)" if args.smoke else "benchmark"
    print(f"\ngpu_check {kind} on {where}, torch {torch.__version__}, {time.perf_counter() - started:.0f} s in all")
    print(
        f"operator: median of {sizes['op_repeat']} (CUDA events on a GPU); fit: best of {sizes['fit_repeat']}; "
        f"decoding: greedy, {sizes['new_tokens']} new tokens after {sizes['prompt']}, best of {sizes['gen_repeat']}; "
        "ratio = ours / baseline, decoding: base / adapted - 1"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
