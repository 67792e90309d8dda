"""Shared bits of the benchmark scripts: timing and a description of the machine."""
from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch


def timeit(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of `fn` over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from atlas_core.backbone import native_bf16

    return (f"{cpu}, {os.cpu_count()} cores, native bf16 {'yes' if native_bf16() else 'no'}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")
