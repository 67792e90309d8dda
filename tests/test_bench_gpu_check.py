"""bench/gpu_check.py cannot rot: its --smoke run on the CPU prints every row of the table,
and asking for CUDA where there is none exits non-zero with a clear message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = [
    "residual operator bfloat16",
    "residual operator float32",
    "atlas fit N=256 d=64",
    "decoding batch 1",
    "decoding batch 8",
]


def run_script(*args: str, hide_gpus: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    if hide_gpus:  # so the refusal shows on a CUDA machine too
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "bench/gpu_check.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_smoke_run_on_the_cpu_prints_the_whole_table():
    result = run_script("--smoke")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "SMOKE RUN (tiny sizes, not a benchmark)" in out
    table = out[out.index("measurement") :].splitlines()
    assert table[0].split() == ["measurement", "ours", "baseline", "ratio", "paper"]
    for row in ROWS:
        line = next((t for t in table if t.startswith(row)), None)
        assert line is not None, f"row {row!r} missing from\n{out}"
        assert "nan" not in line.lower()
    assert any("10.4-11.1 us/tok" in t for t in table) and any("38.5 s" in t for t in table)
    assert sum("+2.5-3.1%" in t for t in table) == 2


def test_asking_for_cuda_without_a_device_fails_clearly():
    result = run_script("--only", "operator", hide_gpus=True)
    assert result.returncode == 2
    assert "CUDA was requested" in result.stderr and "--smoke" in result.stderr
