"""Resume: a run killed at any point continues from its last complete checkpoint and ends with
exactly the weights of an uninterrupted run with the same seed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atlas_core.residual import ResidualConfig, build_residual
from atlas_core.train import TrainConfig, latest_checkpoint, prepare_data, read_state, train
from tests.conftest import tiny_model
from tests.train_fixtures import CharTokenizer, toy_pairs

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from atlas_core.residual import ResidualConfig, build_residual
from atlas_core.train import TrainConfig, prepare_data, train
from tests.conftest import tiny_model
from tests.train_fixtures import CharTokenizer, tiny_atlas, toy_pairs

run_dir, stall_at = Path(sys.argv[1]), int(sys.argv[2])
model = tiny_model("llama", seed=0)
pairs = toy_pairs(40)
atlas = tiny_atlas(model, 2, [p + r for p, r in pairs])
residual = build_residual(ResidualConfig(variant="atlas", layer=2, rank=4, scale="calibrated", seed=0), model, atlas)
config = TrainConfig(lr=3e-2, epochs=3, batch_size=4, grad_accum=2, checkpoint_every_steps=2, schedule="cosine",
                     warmup_steps=2, weight_decay=0.01, progress=False)
data = prepare_data(CharTokenizer(), pairs[:32], config, val=pairs[32:], chat=False)

def stall(path, state):
    if state["step"] == stall_at:  # the parent SIGKILLs us while we wait here, mid-epoch
        (run_dir / "stalled").write_text(str(state["step"]))
        time.sleep(600)

train(model, residual, data, config, run_dir, on_checkpoint=stall)
"""


def run_worker(script: Path, run_dir: Path, stall_at: int = 0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, str(script), str(run_dir), str(stall_at)], cwd=ROOT, env=env)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    last = latest_checkpoint(run_dir)
    assert read_state(last)["finished"]
    return load_file(str(last / "adapter.safetensors"))


def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    reference = run_worker(script, whole)
    victim = run_worker(script, killed, stall_at=6)  # 4 steps per epoch: step 6 is mid epoch 1
    deadline = time.time() + 120
    while not (killed / "stalled").exists():
        assert victim.poll() is None and time.time() < deadline, "worker ended before reaching step 6"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert read_state(latest_checkpoint(killed))["step"] == 6
    assert run_worker(script, killed).wait(timeout=120) == 0  # resumes from step 6
    assert reference.wait(timeout=120) == 0
    a, b = final_weights(killed), final_weights(whole)
    assert set(a) == {"A", "B", "s", "s_d"} == set(b)
    for k in a:  # bit-identical (s_d is NaN: unused by full ATLAS)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True)
    sa, sb = read_state(latest_checkpoint(killed)), read_state(latest_checkpoint(whole))
    assert sa["train_losses"] == sb["train_losses"] and sa["val_losses"] == sb["val_losses"]


class Crash(Exception):
    pass


def test_resume_skips_damaged_and_half_written_checkpoints(tmp_path):
    def run(run_dir, crash_at=None):
        model = tiny_model("llama")
        residual = build_residual(ResidualConfig(variant="plain", layer=2, rank=4), model)
        config = TrainConfig(lr=3e-2, epochs=2, batch_size=8, checkpoint_every_steps=1, progress=False)
        data = prepare_data(CharTokenizer(), toy_pairs(32), config, chat=False)

        def crash(path, state):
            if state["step"] == crash_at:
                raise Crash

        train(model, residual, data, config, run_dir, on_checkpoint=crash)
        return residual

    whole = run(tmp_path / "whole")
    with pytest.raises(Crash):
        run(tmp_path / "crashed", crash_at=6)
    ckpts = tmp_path / "crashed" / "checkpoints"
    (ckpts / "step-000006" / "adapter.safetensors").write_bytes(b"torn write")  # newest one damaged
    (ckpts / ".step-000007.abc.tmp").mkdir()  # and a half-written one
    assert latest_checkpoint(tmp_path / "crashed").name == "step-000005"
    resumed = run(tmp_path / "crashed")
    assert torch.equal(resumed.A, whole.A) and torch.equal(resumed.B, whole.B)
    assert not (ckpts / ".step-000007.abc.tmp").exists()
