"""Shared bits of the benchmark scripts: timing and a description of the machine."""

from __future__ import annotations

import ctypes
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


def peak_rss_added(fn: Callable[[], object]) -> tuple[object, float]:
    """(fn(), MiB by which the process's peak resident set rose during the call). Linux/glibc:
    freed heap memory is first returned to the system (malloc_trim), so what an earlier call left
    in the allocator is not counted as free room; writing 5 to /proc/self/clear_refs then resets
    the peak (VmHWM) to the current size."""

    def status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith(field)))

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS:")
    out = fn()
    return out, (status_kib("VmHWM:") - before) / 1024


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from atlas_core.backbone import native_bf16

    return (
        f"{cpu}, {os.cpu_count()} cores, native bf16 {'yes' if native_bf16() else 'no'}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def reading(benchmark: str, measured: str, target: str, met: str) -> None:
    """One row of docs/BENCHMARKS.md's Reading table: bench/run_all.py collects these lines from
    every section's output (with the section's date, commit and machine), so no figure there is typed."""
    import json

    print("reading: " + json.dumps({"benchmark": benchmark, "measured": measured, "target": target, "met": met}))
