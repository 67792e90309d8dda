"""Using a release of a real (tiny) line: load_release from the ledger and from MLflow, the
pyfunc model, `mlflow models serve`, `atlas generate` / `atlas export`, flipped bytes on every
load path, and what the MLflow UI shows of the training runs.

Two cycles build the chain: v1 an ATLAS residual (skill a), v2 a Weight-LoRA on top (skill b).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.flows_fixtures import use_state, write_yaml

MODEL = "tiny-llama.use"
RETAINED = {
    "domains": ["csqa"],
    "kl_contexts": 6,
    "kl_max_tokens": 128,
    "gsm8k_questions": 2,
    "csqa_questions": 6,
    "max_new_tokens": 4,
    "batch_size": 4,
    "replay_examples": 8,
}
BASE = {
    "backbone": "tiny-llama",
    "dtype": "float32",
    "layer": 2,
    "line": "use",
    "retained": RETAINED,
    "atlas": {"num_vectors": 64, "charts": 4, "rank": 4},
    "train": {"epochs": 1, "lr": 1.0e-2, "batch_size": 4, "max_length": 512, "on_bad_example": "truncate"},
}


def _policy(name: str, method: str) -> dict:
    return {
        "name": name,
        "candidates": {"methods": [method], "seeds": [0]},
        "min_target_gain": 0,
        "max_kl_vs_champion": {"csqa": 50.0, "released": 50.0},
        "max_kl_vs_base": {"csqa": 50.0},
        "nfr": {"max_vs_champion": {"csqa": 1.0}, "max_vs_base": {"csqa": 1.0}},
        "no_regression": {"released": {"tolerance": 1000.0, "min_n": 4}},
    }  # skill a's reference-nll: 4 problems


@pytest.fixture(scope="module")
def line(prefect_harness, tmp_path_factory):
    """A state folder whose line `use` has champion v2 = base + ATLAS residual + Weight-LoRA."""
    tmp = tmp_path_factory.mktemp("use")
    with pytest.MonkeyPatch.context() as mp:
        use_state(mp, tmp / "state")
        from flows.update import update

        code = BASE | {
            "name": "a",
            "skill": "a",
            "data": {"source": "mbpp", "train_limit": 8, "val_limit": 4},
            "target": {"scorer": "reference-nll", "options": {"source": "mbpp", "limit": 4}},
        }
        math = BASE | {
            "name": "b",
            "skill": "b",
            "data": {"source": "gsm8k", "train_limit": 8, "val_limit": 4},
            "target": {"scorer": "reference-nll", "options": {"source": "gsm8k", "limit": 4}},
        }
        first = update(write_yaml(tmp / "a.yaml", code), write_yaml(tmp / "p1.yaml", _policy("p1", "atlas")))
        second = update(write_yaml(tmp / "b.yaml", math), write_yaml(tmp / "p2.yaml", _policy("p2", "weight-lora")))
        assert first.promoted and second.promoted, (first, second)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'state' / 'mlflow' / 'mlflow.db'}")
        yield {"state": tmp / "state", "v1": first.champion, "v2": second.champion, "tmp": tmp}


def _ids() -> torch.Tensor:
    return torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def platform_logits(version: str, ids: torch.Tensor) -> torch.Tensor:
    """The cycle's own adapted model: flows.resources' verified chain on its backbone."""
    from flows.platform import PlatformRef
    from flows.resources import scope
    from registry import get_model, resolve_version

    with scope(PlatformRef.from_environment()) as res:
        v = resolve_version(res.ledger, get_model(res.ledger, MODEL).id, version)
        applied = res.resolve_applied(v)
        model = res.load_backbone("tiny-llama", "float32").model
        with res.chain(applied).attached(model):
            return model(ids).logits


def test_load_release_from_the_ledger_is_the_platforms_adapted_model(line):
    from flows import load_release

    ids = _ids()
    release = load_release("use", "champion", dtype="float32", backbone="tiny-llama")
    assert release.name == line["v2"] and [d["name"] for d in release.manifest["chain"]] == [line["v1"], line["v2"]]
    assert release.manifest["backbone"]["weights_sha256"]  # recorded by the cycle, checked on every load
    with torch.no_grad():
        got = release.model(ids).logits
    torch.testing.assert_close(got, platform_logits(line["v2"], ids), rtol=0, atol=0)
    v1 = load_release(MODEL, line["v1"], dtype="float32")
    with torch.no_grad():
        torch.testing.assert_close(v1.model(ids).logits, platform_logits(line["v1"], ids), rtol=0, atol=0)
        assert (v1.model(ids).logits - got).abs().max() > 1e-4  # v2's LoRA is part of v2 only


def test_mlflow_pyfunc_model_generates_and_is_the_same_model(line):
    import mlflow.pyfunc
    import pandas as pd

    from flows import load_release

    ids = _ids()
    model = mlflow.pyfunc.load_model(f"models:/{MODEL}@champion")
    out = model.predict(pd.DataFrame({"prompt": ["Add two numbers.", "Hello"]}), params={"max_new_tokens": 3})
    assert list(out.columns) == ["text"] and len(out) == 2 and all(isinstance(t, str) for t in out["text"])
    as_dict = model.predict({"prompt": ["Add two numbers.", "Hello"]}, params={"max_new_tokens": 3})
    assert as_dict["text"].tolist() == out["text"].tolist()  # greedy: the same replies, whatever the input form
    inner = model.unwrap_python_model().release
    want = platform_logits(line["v2"], ids)
    with torch.no_grad():
        torch.testing.assert_close(inner.model(ids).logits, want, rtol=0, atol=0)
        direct = load_release(f"models:/{MODEL}@champion", dtype="float32")
        torch.testing.assert_close(direct.model(ids).logits, want, rtol=0, atol=0)
    assert model.metadata.signature.inputs.input_names() == ["prompt"]


def test_training_runs_end_finished_and_show_their_datasets(line):
    from mlflow import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("tiny-llama / use")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`ledger.training_run_id` != ''")
    assert len(runs) == 2
    for run in runs:
        assert run.info.status == "FINISHED" and run.info.end_time is not None
    names = sorted(d.dataset.name for run in runs for d in run.inputs.dataset_inputs)  # each run's training snapshot
    assert len(names) == 2 and names[0].startswith("gsm8k") and names[1].startswith("mbpp")


@contextmanager
def flipped(path: Path):
    """`path` with one bit flipped for the block, restored after it."""
    raw = path.read_bytes()
    bad = bytearray(raw)
    bad[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(bad))
    try:
        yield
    finally:
        path.write_bytes(raw)


def test_a_flipped_byte_is_rejected_on_the_ledger_and_the_mlflow_paths(line):
    import shutil

    import mlflow.pyfunc

    from atlas_core.io import IntegrityError
    from flows import load_release
    from registry import ArtifactCorruptedError

    # MLflow: a delta of the champion's stored model version.
    stored = next(
        p
        for p in (line["state"] / "mlflow" / "artifacts").rglob(f"01-{line['v1']}.safetensors")
        if f"versions/{line['v2']}/" in str(p)
    )  # v1's delta, as the champion v2's chain holds it
    sha = json.loads(stored.with_suffix(".json").read_text())["sha256"]
    with flipped(stored):
        with pytest.raises(IntegrityError, match=sha) as e:
            mlflow.pyfunc.load_model(f"models:/{MODEL}@champion")
        assert f"01-{line['v1']}.safetensors" in str(e.value)
        with pytest.raises(IntegrityError, match=sha):
            load_release(f"models:/{MODEL}@champion")
    # The ledger: the artifact store refuses the delta while the release folder is written ...
    shutil.rmtree(line["state"] / "cache" / "releases", ignore_errors=True)
    store_file = next(p for p in (line["state"] / "artifacts").rglob("*") if p.is_file() and p.name.startswith(sha))
    with flipped(store_file), pytest.raises(ArtifactCorruptedError, match=sha):
        load_release(MODEL, line["v1"], dtype="float32")
    # ... and a release folder already written is verified again on every load.
    load_release(MODEL, line["v1"], dtype="float32")
    cached = next((line["state"] / "cache" / "releases").rglob(f"01-{line['v1']}.safetensors"))
    with flipped(cached), pytest.raises(IntegrityError, match=sha):
        load_release(MODEL, line["v1"], dtype="float32")


def _atlas(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )


def test_atlas_generate_streams_writes_jsonl_and_rejects_bad_input(line, tmp_path):
    common = ["--backbone", "tiny-llama", "--line", "use", "--dtype", "float32", "--max-new-tokens", "3"]
    one = _atlas("generate", *common, "Add two numbers.")
    assert one.returncode == 0, one.stderr
    assert line["v2"] in one.stderr and one.stdout.strip()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Add two numbers."}\n"Hello"\n')
    out = tmp_path / "out.jsonl"
    many = _atlas("generate", *common, "--version", line["v1"], "--input", str(prompts), "--output", str(out))
    assert many.returncode == 0, many.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Add two numbers.", "Hello"] and {r["version"] for r in rows} == {line["v1"]}
    unknown = _atlas("generate", *common, "--version", "no-such-version", "hi")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert "no-such-version" in unknown.stderr and "matches 0 versions" in unknown.stderr
    prompts.write_text("{not json\n")
    bad = _atlas("generate", *common, "--input", str(prompts))
    assert bad.returncode == 2 and "line 1" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    neither = _atlas("generate", *common)
    assert neither.returncode == 2 and "one prompt or --input" in neither.stderr


def test_atlas_export_folder_loads_back_and_merged_refuses_a_residual(line, tmp_path):
    from flows import load_release

    common = ["--backbone", "tiny-llama", "--line", "use", "--dtype", "float32"]
    done = _atlas("export", "champion", *common, "--format", "folder", "--out", str(tmp_path / "v2"))
    assert done.returncode == 0, done.stderr
    ids = _ids()
    with torch.no_grad():
        got = load_release(str(tmp_path / "v2"), dtype="float32").model(ids).logits
    torch.testing.assert_close(got, platform_logits(line["v2"], ids), rtol=0, atol=0)
    merged = _atlas("export", "champion", *common, "--format", "merged", "--out", str(tmp_path / "merged"))
    assert merged.returncode == 2 and "input-conditioned" in merged.stderr
    lora_only = _atlas("export", line["v1"], *common, "--format", "peft", "--out", str(tmp_path / "peft"))
    assert (
        lora_only.returncode == 0
        and json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["peft_type"] == "ATLAS"
    )


def test_atlas_export_mlflow_bundles_the_backbone_into_a_pyfunc_model_folder(line, tmp_path, monkeypatch):
    import mlflow.pyfunc

    monkeypatch.setenv("ATLAS_DTYPE", "float32")  # the bundled folder loads like any model folder: auto may be bf16

    out = tmp_path / "served"
    done = _atlas(
        "export",
        "champion",
        "--backbone",
        "tiny-llama",
        "--line",
        "use",
        "--dtype",
        "float32",
        "--format",
        "mlflow",
        "--bundle-backbone",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert (out / "MLmodel").is_file() and (out / "artifacts" / "release" / "backbone" / "config.json").is_file()
    model = mlflow.pyfunc.load_model(str(out))  # no ledger, no registry: the folder is everything
    ids = _ids()
    with torch.no_grad():
        got = model.unwrap_python_model().release.model(ids).logits
    torch.testing.assert_close(got, platform_logits(line["v2"], ids), rtol=0, atol=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_mlflow_models_serve_answers_an_invocation(line):
    import urllib.request

    port = _free_port()
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen(
        [
            str(mlflow_cli),
            "models",
            "serve",
            "-m",
            f"models:/{MODEL}@champion",
            "--env-manager",
            "local",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ],
        env=os.environ
        | {
            "HF_HUB_OFFLINE": "1",  # it starts `uvicorn` from PATH
            "PATH": f"{mlflow_cli.parent}{os.pathsep}{os.environ['PATH']}",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 240
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.time() < deadline, (
                server.stdout.read() if server.poll() is not None else "timeout"
            )
            time.sleep(1)
        body = json.dumps({"dataframe_records": [{"prompt": "Add two numbers."}], "params": {"max_new_tokens": 3}})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", body.encode(), {"Content-Type": "application/json"}
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
        assert len(answer["predictions"]) == 1 and isinstance(answer["predictions"][0]["text"], str)
    finally:
        server.terminate()
        server.wait(timeout=30)
