"""ATLAS: input-conditioned residual updates that keep retained behaviour.

Pure torch + transformers. Imports no orchestration, tracking or database code.
"""

import importlib
import importlib.abc
import sys
import warnings


class _RegisterWithPeft(importlib.abc.MetaPathFinder):
    """Registers the ATLAS PEFT method (atlas_core.residual.peft) when PEFT's module is executed,
    so `import atlas_core` costs nothing while PEFT is not used (importing PEFT takes seconds), and
    `PeftModel.from_pretrained(base, atlas_export)` works whatever was imported first.

    Why it stays in sys.meta_path: a finder is asked on every `find_spec("peft")`, and most are no
    import. transformers asks `importlib.util.find_spec("peft")` to see whether PEFT is installed
    (is_peft_available, e.g. inside from_pretrained, hence flows.load_release) long before anything
    imports it. So the finder only wraps the found loader's exec_module (a fresh loader per spec:
    a spec that is never executed changes nothing) and is never removed: registration happens
    when, and in whichever process, `import peft` really runs. It is idempotent (the registering
    module is imported once). If PEFT was imported before atlas_core, it registers at once."""

    def find_spec(self, name, path=None, target=None):
        if name != "peft":
            return None
        spec = None
        for finder in sys.meta_path:  # the spec the rest of the import system would give
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def _register() -> None:
    # A PEFT release whose API the method no longer fits must not break `import peft` for every
    # user of this process: warn, and `PeftModel.from_pretrained` of an ATLAS export says KeyError.
    try:
        importlib.import_module("atlas_core.residual.peft")
    except Exception as e:
        warnings.warn(f"atlas_core: the ATLAS PEFT method could not be registered with PEFT: {e!r}", stacklevel=2)


if "peft" in sys.modules:
    _register()
elif not any(type(f).__name__ == _RegisterWithPeft.__name__ for f in sys.meta_path):  # one, even on a reload
    sys.meta_path.insert(0, _RegisterWithPeft())
