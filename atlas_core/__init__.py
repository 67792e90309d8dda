"""ATLAS: input-conditioned residual updates that keep retained behaviour.

Pure torch + transformers. Imports no orchestration, tracking or database code.
"""

import importlib.abc
import importlib.util
import sys


class _RegisterWithPeft(importlib.abc.MetaPathFinder):
    """Register the ATLAS PEFT method (atlas_core.residual.peft) right after `peft` is imported,
    so `import atlas_core` costs nothing when PEFT is not used (importing PEFT takes seconds)."""

    def find_spec(self, name, path=None, target=None):
        if name != "peft":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("peft")
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            importlib.import_module("atlas_core.residual.peft")

        spec.loader.exec_module = exec_module
        return spec


if "peft" in sys.modules:
    importlib.import_module("atlas_core.residual.peft")
else:
    sys.meta_path.insert(0, _RegisterWithPeft())
