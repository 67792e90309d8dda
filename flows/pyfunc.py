"""Every published version as an MLflow pyfunc model.

    mlflow.pyfunc.load_model("models:/smollm2-135m.code@champion").predict({"prompt": ["..."]})
    mlflow models serve -m "models:/smollm2-135m.code@champion" --env-manager local

`ReleaseModel.load_context` rebuilds the chain from the version's own artifacts (the
release folder under artifacts/release) with atlas_core.release.load_folder, so the model
runs exactly what the ledger recorded: the manifest is checked against the folder's
manifest.sha256, every delta and atlas by sha256; the backbone is loaded by reference (name,
revision, weights sha256) unless the folder bundles it. ATLAS_DTYPE / ATLAS_DEVICE choose how it
loads; ATLAS_REQUIRE_SIDECAR=0 (a version published before manifest sidecars) and
ATLAS_VERIFY_BACKBONE=0 (a manifest that names no backbone weights) are the explicit opt-outs.
"""

from __future__ import annotations

import os
from types import MappingProxyType

import mlflow.pyfunc

SAMPLING_PARAMS = MappingProxyType(
    {
        "max_new_tokens": ("long", 256),
        "temperature": ("double", 0.0),
        "top_p": ("double", 1.0),
        "top_k": ("long", 0),
        "seed": ("long", -1),  # -1: none
    }
)


class ReleaseModel(mlflow.pyfunc.PythonModel):
    """Input: a DataFrame (or dict / list) of user messages in column `prompt`; output: a
    DataFrame with the reply in column `text`; params: the sampling settings (greedy by default)."""

    def load_context(self, context) -> None:
        from atlas_core.release import load_folder
        from evaluation.tiny import load_model

        self.release = load_folder(
            context.artifacts["release"],
            dtype=os.environ.get("ATLAS_DTYPE", "auto"),
            device=os.environ.get("ATLAS_DEVICE") or None,
            backbone_loader=load_model,
            verify_backbone=os.environ.get("ATLAS_VERIFY_BACKBONE") != "0",
            require_sidecar=os.environ.get("ATLAS_REQUIRE_SIDECAR") != "0",
        )

    def predict(self, context, model_input, params=None):
        import pandas as pd

        from evaluation.chat import Sampling, chat

        settings = {k: v for k, v in (params or {}).items() if k in SAMPLING_PARAMS}
        if settings.get("seed", -1) == -1:
            settings.pop("seed", None)
        replies = chat(self.release.model, self.release.tokenizer, _prompts(model_input), Sampling(**settings))
        return pd.DataFrame({"text": replies})


def _prompts(model_input) -> list[str]:
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        if "prompt" not in model_input.columns:
            raise ValueError(f"input: expected a column 'prompt', got columns {list(model_input.columns)}")
        prompts = model_input["prompt"].tolist()
    elif isinstance(model_input, dict):
        prompts = model_input.get("prompt")
        prompts = [prompts] if isinstance(prompts, str) else prompts
    else:
        prompts = [model_input] if isinstance(model_input, str) else list(model_input)
    # {"prompt": ["a", "b"]} reaches predict as one row holding the list: take its items
    prompts = [q for p in prompts for q in (p if isinstance(p, (list, tuple)) else [p])] if prompts else prompts
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"input 'prompt': expected one or more strings, got {prompts!r}")
    return prompts


def pyfunc_model():
    """The registry.PyfuncModel every version is published with."""
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    from registry import PyfuncModel

    signature = ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema([ColSpec("string", "text")]),
        params=ParamSchema([ParamSpec(k, t, d) for k, (t, d) in SAMPLING_PARAMS.items()]),
    )
    example = pd.DataFrame({"prompt": ["Write a Python function that returns the sum of two numbers."]})
    return PyfuncModel(ReleaseModel(), signature, example, _requirements())


def save_pyfunc(release, source, out, bundle_backbone: bool = False):
    """A release as a self-contained pyfunc model folder (`mlflow models serve -m out`); with
    `bundle_backbone` the backbone's files are inside too, for a host with no model cache."""
    import tempfile
    from pathlib import Path

    from atlas_core.export import export_folder
    from atlas_core.io import atomic_folder

    spec = pyfunc_model()
    with tempfile.TemporaryDirectory(prefix="atlas-pyfunc-") as tmp, atomic_folder(out) as model_dir:
        folder = export_folder(release, source, Path(tmp) / "release", bundle_backbone=bundle_backbone)
        model_dir.rmdir()  # save_model creates the folder itself
        mlflow.pyfunc.save_model(
            str(model_dir),
            python_model=spec.python_model,
            artifacts={"release": str(folder)},
            signature=spec.signature,
            input_example=spec.input_example,
            pip_requirements=spec.pip_requirements,
        )
    return Path(out)


def _requirements() -> list[str]:
    """What the model needs, pinned as installed here (`--env-manager local` uses this environment)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for package in ("torch", "transformers", "safetensors", "peft", "mlflow", "pandas"):
        try:
            out.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            continue
    return out
