"""Run configs: YAML loading, validation errors that name the field, the config hub files."""

from pathlib import Path

import pytest

from atlas_core.train.config import ConfigError, RunConfig, TrainConfig, load_run_config
from atlas_core.typed_config import build

HUB = Path(__file__).resolve().parent.parent / "configs" / "train"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_round_trip_and_float_strings(tmp_path):
    path = write(
        tmp_path,
        "adapter: plain\nlayer: 3\ntrain:\n  lr: 2e-4\n  epochs: 2\n  betas: [0.9, 0.95]\n"
        "  objective:\n    kind: output-kl\n    beta: 1.0\n",
    )
    config = load_run_config(path)
    assert config.train.lr == pytest.approx(2e-4)  # YAML 1.1 reads 2e-4 as a string
    assert config.train.betas == (0.9, 0.95)
    assert config.train.objective.kind == "output-kl" and config.train.objective.beta == 1.0
    assert config.residual_config().variant == "plain" and config.residual_config().layer == 3
    assert build(RunConfig, config.to_dict()) == config


@pytest.mark.parametrize(
    "text, message",
    [
        ("train:\n  lr: fast\n", r"train\.lr: expected a number, got 'fast'"),
        ("train:\n  epochs: 2.5\n", r"train\.epochs: expected an integer"),
        ("train:\n  learning_rate: 1\n", r"train\.learning_rate: unknown field"),
        ("train:\n  objective:\n    kind: dpo\n", r"train\.objective\.kind: expected one of"),
        ("train:\n  objective:\n    beta: -1\n", r"train\.objective\.beta: expected a positive number"),
        ("train:\n  on_bad_example: ignore\n", r"train\.on_bad_example: expected one of"),
        ("adapter: atlas\n", r"atlas: adapter 'atlas' needs an atlas file"),
        ("adapter: lora\n", r"adapter: expected one of"),
        ("adapter: plain\nresidual:\n  scale: big\n", r"residual\.scale: "),
        ("train:\n  grad_clip: 0\n", r"train\.grad_clip: expected a positive number or null"),
        ("train: [1, 2]\n", r"train: expected a mapping"),
        # not a finite number, however YAML spells it
        ("train:\n  lr: .nan\n", r"train\.lr: expected a finite number, got nan"),
        ("train:\n  lr: .inf\n", r"train\.lr: expected a finite number, got inf"),
        ("train:\n  lr: -.inf\n", r"train\.lr: expected a finite number, got -inf"),
        ("train:\n  lr: nan\n", r"train\.lr: expected a finite number, got 'nan'"),
        ("train:\n  lr: 'inf'\n", r"train\.lr: expected a finite number, got 'inf'"),
        ("train:\n  lr: 1e999\n", r"train\.lr: expected a finite number, got '1e999'"),
        ("train:\n  objective:\n    beta: .nan\n", r"train\.objective\.beta: expected a finite number"),
        ("train:\n  betas: [0.9, .nan]\n", r"train\.betas\[1\]: expected a finite number"),
        ("train:\n  betas: [0.9, 1.0]\n", r"train\.betas\[1\]: expected a number in \[0, 1\)"),
        ("train:\n  seed: -1\n", r"train\.seed: expected an integer >= 0"),
        ("train:\n  epochs: 100000000000000000000\n", r"train\.epochs: expected an integer of at most 64 bits"),
        # options are checked whatever the adapter (residual options of a weight adapter too)
        ("adapter: weight-lora\nresidual:\n  alpha: .nan\n", r"residual\.alpha: expected a finite number"),
        ("adapter: weight-lora\nresidual:\n  alpha: 2\n", r"residual\.alpha: expected a value in \[0, 1\]"),
        (
            "adapter: weight-lora\nresidual:\n  scale: '-1'\n",
            r"residual\.scale: expected a positive number or 'calibrated'",
        ),
        ("adapter: weight-lora\nlora:\n  alpha: 0\n", r"lora\.alpha: expected a positive number"),
        ("adapter: weight-lora\nlora:\n  clora:\n    k: 0\n", r"lora\.clora\.k: expected a positive integer or null"),
        ("adapter: weight-lora\nlora:\n  target: ''\n", r"lora\.target: expected a non-empty string"),
    ],
)
def test_errors_name_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(write(tmp_path, text))


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="batch_size: expected a positive integer"):
        TrainConfig(batch_size=0)


def test_fingerprint_ignores_cadence_only():
    a, b = TrainConfig(), TrainConfig(progress=False, checkpoint_every_steps=7)
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != TrainConfig(lr=1e-3).fingerprint()


def test_every_hub_config_loads():
    files = sorted(HUB.glob("*.yaml"))
    assert len(files) >= 10
    adapters = {load_run_config(f).adapter for f in files}
    kinds = {load_run_config(f).train.objective.kind for f in files}
    assert {
        "atlas",
        "plain",
        "centered",
        "centered-distance",
        "input-filter",
        "global-pca",
        "random-local",
        "shuffled-patch",
        "weight-lora",
    } <= adapters
    assert kinds == {"ce", "replay", "output-kl", "stm", "talr"}
