"""The lock is the environment: constraints.txt lists exactly the distributions installed here, at
the versions installed (what `pip freeze --exclude-editable` would write; local labels such as
`+cpu` ignored on both sides, as scripts/lock.sh strips them).

The constraints file is the one this environment was installed from: ATLAS_CONSTRAINTS (relative
to the repository root, as in scripts/install.sh), default constraints.txt. scripts/lock.sh runs
the suite with ATLAS_CONSTRAINTS naming its candidate lock, so this holds during a lock run too."""

from __future__ import annotations

import json
import os
import re
import site
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)$")


def canonical(name: str) -> str:
    """PEP 503 name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """The version without its local label, normalised (2.13.0+cpu -> 2.13.0)."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return version.split("+", 1)[0]
    try:
        return Version(version).public
    except InvalidVersion:
        return version.split("+", 1)[0]


def constraints_file() -> Path | None:
    name = os.environ.get("ATLAS_CONSTRAINTS") or "constraints.txt"
    if name == "none":
        return None
    path = Path(name)
    return path if path.is_absolute() else ROOT / path


def read_lock(path: Path) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """{canonical name: (name as written, version)}, and the lines that are not `name==version`."""
    pins: dict[str, tuple[str, str]] = {}
    bad: list[str] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        if match is None:
            bad.append(f"line {number}: {raw!r} is not a name==version pin")
            continue
        key = canonical(match[1])
        if key in pins:
            bad.append(f"line {number}: {match[1]} pinned twice")
        pins[key] = (match[1], match[2])
    return pins, bad


def _editable(dist: metadata.Distribution) -> bool:
    try:
        info = json.loads(dist.read_text("direct_url.json") or "{}")
    except (OSError, ValueError):
        return False
    return bool(info.get("dir_info", {}).get("editable"))


def installed() -> dict[str, tuple[str, str]]:
    """What `pip freeze --exclude-editable` lists: every distribution in the environment's site
    directories (not the repository's own egg-info that pytest's sys.path would show), but
    editable ones, pip, and (Python < 3.12, as pip does) setuptools, distribute and wheel."""
    skip = {"pip"} | ({"setuptools", "distribute", "wheel"} if sys.version_info < (3, 12) else set())
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    found: dict[str, tuple[str, str]] = {}
    for dist in metadata.distributions(path=[d for d in dirs if os.path.isdir(d)]):
        name = dist.metadata["Name"]
        if not name or canonical(name) in skip or canonical(name) in found or _editable(dist):
            continue
        found[canonical(name)] = (name, dist.version)
    return found


def differences(lock: dict[str, tuple[str, str]], env: dict[str, tuple[str, str]]) -> list[str]:
    out = []
    for key in sorted(set(lock) | set(env)):
        if key not in lock:
            out.append(f"installed, not in the lock: {env[key][0]}=={env[key][1]}")
        elif key not in env:
            out.append(f"in the lock, not installed: {lock[key][0]}=={lock[key][1]}")
        elif public(lock[key][1]) != public(env[key][1]):
            out.append(f"{env[key][0]}: lock {lock[key][1]}, installed {env[key][1]}")
    return out


def test_lock_matches_the_environment():
    path = constraints_file()
    if path is None:
        pytest.skip("ATLAS_CONSTRAINTS=none: installed unpinned, no lock to compare with")
    if not path.is_file():
        pytest.skip(f"no constraints file {path}: installed unpinned (bash scripts/lock.sh writes it)")
    lock, bad = read_lock(path)
    problems = bad + differences(lock, installed())
    assert not problems, (
        f"{path} and this environment ({sys.prefix}) differ; install it with `bash scripts/install.sh`"
        " (rm -rf the venv first if it holds packages the lock dropped) or refresh the lock with"
        " `bash scripts/lock.sh`:\n  " + "\n  ".join(problems)
    )


def test_differences_are_listed():
    """The comparison itself: local labels ignored on both sides, names per PEP 503."""
    lock = {"torch": ("torch", "2.13.0"), "pyyaml": ("PyYAML", "6.0.4"), "gone": ("gone", "1.0")}
    env = {"torch": ("torch", "2.13.0+cpu"), "pyyaml": ("PyYAML", "6.0.5"), "extra": ("Extra", "0.1")}
    assert differences(lock, env) == [
        "installed, not in the lock: Extra==0.1",
        "in the lock, not installed: gone==1.0",
        "PyYAML: lock 6.0.4, installed 6.0.5",
    ]
    assert differences({"torch": ("torch", "2.13.0+cpu")}, {"torch": ("torch", "2.13.0")}) == []
    assert canonical("Foo.Bar_baz--qux") == "foo-bar-baz-qux"
