"""`import atlas_core` makes ATLAS a PEFT method whatever the process imported or called before:
each import order runs in a fresh interpreter (import state is per process), loads one ATLAS
export with `PeftModel.from_pretrained` and must give the platform's logits.

The orders that matter are those that touch `peft` before or around `import atlas_core`:
transformers asks `importlib.util.find_spec("peft")` (is_peft_available) long before anything
imports PEFT, and that query must not use up the registration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atlas_core.export import export_folder, export_peft
from atlas_core.release import load_folder
from evaluation.tiny import load_model
from tests.test_release_export import TINY, _ids, platform_logits, write_release

ROOT = Path(__file__).resolve().parents[1]

ORDERS = {
    # a fresh process; importing atlas_core alone must not import PEFT (seconds)
    "fresh": "import atlas_core\nassert 'peft' not in sys.modules, 'import atlas_core imported peft'",
    "find_spec_first": "import importlib.util\nassert importlib.util.find_spec('peft')\nimport atlas_core\nimport peft",
    "atlas_core_then_find_spec": "import atlas_core, importlib.util\nimportlib.util.find_spec('peft')\n"
    "importlib.util.find_spec('peft')",
    "transformers_checks_peft_first": "import transformers\nassert transformers.utils.is_peft_available()\n"
    "import atlas_core",
    "atlas_core_then_transformers_checks_peft": "import atlas_core, transformers\n"
    "assert transformers.utils.is_peft_available()",
    "peft_first": "import peft\nimport atlas_core",
    "peft_submodule_first": "import peft.config\nimport atlas_core",
    # what flows.load_release does: transformers' from_pretrained (of the bundled backbone) looks
    # for PEFT before anything imports it
    "load_folder_first": "import atlas_core\nfrom atlas_core.release import load_folder\n"
    "load_folder(BUNDLED, dtype='float32')",
}

CHECK = """
import torch
from peft import PeftModel
from evaluation.tiny import load_model
want = torch.load(WANT)
model = PeftModel.from_pretrained(load_model(TINY, "float32").model, OUT)
with torch.no_grad():
    torch.testing.assert_close(model(want["ids"]).logits, want["logits"], rtol=1e-5, atol=1e-5)
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, str]:
    """A chain of two ATLAS residuals as a release folder with its backbone bundled (loaded by
    transformers' from_pretrained, as a real backbone is), its PEFT export and the chain's logits."""
    tmp = tmp_path_factory.mktemp("atlas-peft")
    folder, ids = write_release(tmp, ("atlas", "atlas")), _ids()
    release = load_folder(folder, dtype="float32", backbone_loader=load_model)
    out = export_peft(release, tmp / "peft")
    bundled = export_folder(release, folder, tmp / "bundled", bundle_backbone=True)
    torch.save({"ids": ids, "logits": platform_logits(folder, ids)}, tmp / "want.pt")
    return {"BUNDLED": str(bundled), "OUT": str(out), "WANT": str(tmp / "want.pt"), "TINY": TINY}


@pytest.mark.parametrize("order", list(ORDERS))
def test_an_atlas_export_loads_with_peft_whatever_was_imported_first(exported, order):
    names = "".join(f"{k} = {v!r}\n" for k, v in exported.items())
    code = f"import sys\n{names}{ORDERS[order]}\n{CHECK}"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"order {order!r} failed:\n{done.stderr[-3000:]}"


def test_registration_is_idempotent():
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
    from peft.utils import PeftType

    from atlas_core.residual import peft as atlas_peft

    atlas_peft.register()
    atlas_peft.register()
    assert PEFT_TYPE_TO_TUNER_MAPPING[PeftType.ATLAS] is atlas_peft.AtlasPeftModel
    assert list(PeftType.__members__).count("ATLAS") == 1
