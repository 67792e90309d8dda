"""The structure docs/ARCHITECTURE.md describes, checked: packages import one way, `flows` keeps no
module-level mutable state, and importing a package changes nothing in the environment."""

from __future__ import annotations

import ast
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import types
from contextvars import ContextVar
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("atlas_core", "evaluation", "registry", "flows")
# What each package may import of ours (docs/ARCHITECTURE.md): one way, nothing back.
ALLOWED = {
    "atlas_core": set(),
    "evaluation": {"atlas_core"},
    "registry": set(),
    "flows": {"atlas_core", "evaluation", "registry"},
}


def _imports_of(path: Path) -> set[str]:
    """Top-level names of every module imported anywhere in the file (function bodies included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_one_way(package):
    wrong = {
        str(path.relative_to(REPO)): sorted(found)
        for path in sorted((REPO / package).rglob("*.py"))
        if (found := (_imports_of(path) & set(PACKAGES)) - ALLOWED[package] - {package})
    }
    assert wrong == {}, f"{package} may import only {sorted(ALLOWED[package]) or 'nothing of ours'}"


def _flows_modules() -> list[types.ModuleType]:
    import flows

    return [importlib.import_module(f"flows.{m.name}") for m in pkgutil.iter_modules(flows.__path__)]


def test_flows_keeps_no_module_level_mutable_state():
    """Resources live in flows.resources.Resources, opened by an entry point: no module of `flows`
    holds a mutable container, a memoised function or a `global` statement (constants are tuples,
    frozensets or read-only mappings; the one ContextVar is scoped by `scope`)."""
    mutable = (dict, list, set, bytearray)
    found = []
    for module in _flows_modules():
        for name, value in vars(module).items():
            if name.startswith("__"):
                continue
            if isinstance(value, mutable) or hasattr(value, "cache_info"):
                found.append(f"{module.__name__}.{name}: {type(value).__name__}")
            if isinstance(value, ContextVar) and module.__name__ != "flows.resources":
                found.append(f"{module.__name__}.{name}: a ContextVar outside flows.resources")
        tree = ast.parse(Path(module.__file__).read_text())
        found += [f"{module.__name__}: global {n.names}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    assert found == []


def test_importing_any_module_changes_no_environment_variable():
    """Entry points set the environment (flows.platform.configure_environment, called by `atlas`
    and open_platform); importing a module of ours never does."""
    code = (
        "import importlib, json, os, pkgutil\n"
        "import torch, transformers, prefect, peft, mlflow  # what they set themselves is theirs\n"
        "before = dict(os.environ)\n"
        f"for package in {PACKAGES!r}:\n"
        "    root = importlib.import_module(package)\n"
        "    for m in pkgutil.walk_packages(root.__path__, package + '.'):\n"
        "        if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "print(json.dumps(sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k))))"
    )
    settings = ("PREFECT_HOME", "HF_", "TOKENIZERS", "MLFLOW_", "MPLCONFIGDIR", "OMP_WAIT_POLICY", "TRANSFORMERS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(settings)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
