"""One-off migration (issue 16): results written with the old whole-config fingerprint get the
per-method fingerprints of bench.repro.config, with nothing else in them changed.

    .venv/bin/python -m bench.repro.migrate results/repro/smollm2-l15 results/repro/smoke

Before this change one fingerprint, a sha256 of the whole config (methods and seeds included)
and of every method's training config, was in every file, so adding a method staled them all.
For each results folder the migration recomputes that old fingerprint from the config stored in
experiment.json and the method training configs in configs/train/, requires every file to carry
it (a file that does not is refused, naming it, and nothing is written), then rewrites only the
`fingerprint` field of each file (experiment.json also gets `method_fingerprints`). Files that
already carry their new fingerprint are left as they are, so a migration cut short can be rerun.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from atlas_core.io import atomic_write_json
from atlas_core.paths import PROJECT_ROOT
from atlas_core.train.config import load_run_config

from .config import experiment_fingerprint, method_fingerprint, method_identity
from .store import ResultStore, StaleResults


def legacy_fingerprint(config: dict) -> str:
    """The old ReproConfig.fingerprint() of a config dict (as stored in experiment.json)."""
    methods = {m["name"]: load_run_config(PROJECT_ROOT / m["config"]).to_dict() for m in config["methods"]}
    for d in methods.values():
        d.pop("atlas")
        d["train"].pop("progress")
    payload = {**config, "method_configs": methods}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def migrate(root: Path) -> int:
    """Rewrite the fingerprints of the results folder `root`; returns the number of files rewritten."""
    root = Path(root)
    path = root / "experiment.json"
    experiment = json.loads(path.read_text())
    config = experiment["config"]
    shared = experiment_fingerprint(config)
    store = ResultStore(
        root, shared, {m["name"]: method_fingerprint(shared, method_identity(m["config"])) for m in config["methods"]}
    )
    old = legacy_fingerprint(config)
    if experiment["fingerprint"] not in (old, shared):
        raise StaleResults(
            f"{path}: fingerprint {experiment['fingerprint'][:12]} is not the old whole-config "
            f"fingerprint {old[:12]} of its stored config and the method training configs "
            f"({', '.join(m['config'] for m in config['methods'])}): one of those changed since the "
            "results were written; restore its version from git history and migrate again"
        )
    todo = []
    for file in sorted(p for p in root.rglob("*.json") if p != path):
        record, new = json.loads(file.read_text()), store.expected(file)
        if record.get("fingerprint") == old:
            todo.append((file, {**record, "fingerprint": new}))
        elif record.get("fingerprint") != new:
            raise StaleResults(
                f"{file}: fingerprint {str(record.get('fingerprint'))[:12]} is neither the "
                f"experiment's old one {old[:12]} nor its new one {new[:12]}; not migrated "
                "(nothing was written)"
            )
    for file, record in todo:
        atomic_write_json(file, record)
    atomic_write_json(path, {**experiment, "fingerprint": shared, "method_fingerprints": store.methods})
    return len(todo)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip())
        return 2
    for root in argv:
        print(f"{root}: {migrate(Path(root))} files rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
