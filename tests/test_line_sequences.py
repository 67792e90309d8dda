"""A line survives any sequence of operations: a seeded random-sequence runner on the tiny model.

A team runs a line for months: cycles of several skills on fresh snapshots, rollbacks,
re-nominations, reruns, a changed policy, a new backbone revision, crashes. `Line` performs
these operations as a user does (the `update` flow, `atlas rollback` / `atlas renominate`) and
after every step checks what must always hold:

- no operation fails unless a crash was injected into it (every input here is valid, so a
  failure is one the platform should have refused before training, or a bug);
- an idle cycle writes nothing: the ledger, the artifact store, MLflow and the reports are
  byte-identical before and after;
- the champion of every line on the current backbone revision loads and verifies, and runs;
- the ledger's champion, MLflow's `champion` alias and the release history agree;
- version names are unique within a line;
- a retired (rolled-back) version is never promoted again unless re-nominated first;
- every released skill of the champion keeps evaluable retained contexts (training and held-out pairs).

CI runs `SEQUENCES` (fixed seeds, a fixed number of steps); `ATLAS_LINE_SEQUENCES=SEEDS:STEPS`
(e.g. 20:16) runs a longer search. A failure prints its sequence: paste it into `REGRESSIONS`.
Concurrent cycles on PostgreSQL are in tests/test_line_concurrency.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.flows_fixtures import write_yaml
from tests.test_flows_continual import BASE, policy, write_pairs

SKILLS = ("a", "b", "c")
OPS = ("cycle", "snapshot", "rollback", "renominate", "rerun", "policy", "revision", "crash")
WEIGHTS = (6, 2, 2, 1, 2, 1, 1, 2)
STAGES = ("training", "evaluation", "publish")

# Sequences that once broke a line (each op as `Line.run` takes it).
REGRESSIONS = {
    # A data refresh of a released skill as a JSONL snapshot without held-out pairs, after two
    # rollbacks to the base: the next cycle of another skill trained, then failed for lack of the
    # refreshed skill's retained contexts (a skill from a snapshot now keeps a held-out split).
    "refresh-without-held-out-then-another-skill": [
        ("cycle", "a"),
        ("cycle", "b"),
        ("rollback",),
        ("rollback",),
        ("snapshot", "no-val"),
        ("cycle", "a"),
        ("cycle", "b"),
    ],
    # Snapshots pruned to the newest while the champion was trained on an older one: the chain
    # records files that are gone (released skills now read the copies kept in the store).
    "old-snapshots-removed": [
        ("cycle", "a"),
        ("snapshot", "val"),
        ("prune",),
        ("cycle", "b"),
        ("cycle", "a"),
        ("snapshot", "no-val"),
        ("prune",),
        ("cycle", "c"),
    ],
}
SEQUENCES = [(37, 10), (104, 10)]  # (seed, steps): between them every operation and every crash stage


class InjectedCrash(RuntimeError):
    """The crash a step injects into one stage of a cycle."""


@dataclass
class Line:
    """The files of a three-skill line and what the runner knows about it."""

    root: Path
    state: Path
    patches: pytest.MonkeyPatch  # the backbone revision in use (the state fixture's own patches stay apart)
    log: list = field(default_factory=list)
    snapshots: int = 0
    revision: int = 0
    strict: bool = False
    last_cycle: tuple | None = None  # (skill, policy path) of the previous step when it was a finished cycle

    def __post_init__(self) -> None:
        from evaluation.data import gsm8k_pairs, mbpp_pairs

        self.code = mbpp_pairs("train")
        cfg = self.root / "cfg"
        cfg.mkdir(parents=True)
        self.folder = self.root / "a-snapshots"
        self.folder.mkdir()
        self.held = write_pairs(self.root / "a-held-out.jsonl", mbpp_pairs("test")[:4])
        self.write_snapshot(with_val=True)
        c_file = write_pairs(self.root / "c.jsonl", gsm8k_pairs("train")[20:32])  # one file, held out by hash
        c_eval = write_pairs(self.root / "c-eval.jsonl", gsm8k_pairs("test")[:4])
        self.config = {
            "a": str(cfg / "a.yaml"),
            "b": write_yaml(
                cfg / "b.yaml",
                BASE
                | {
                    "name": "b",
                    "skill": "b",
                    "data": {"source": "gsm8k", "train_limit": 8, "val_limit": 4},
                    "target": {"scorer": "reference-nll", "options": {"source": "gsm8k", "limit": 4}},
                },
            ),
            "c": write_yaml(
                cfg / "c.yaml",
                BASE
                | {
                    "name": "c",
                    "skill": "c",
                    "data": {"source": c_file, "val_limit": 4},
                    "target": {"scorer": "reference-nll", "options": {"source": c_eval, "limit": 4}},
                },
            ),
        }
        self.policies = {
            False: write_yaml(cfg / "pass.yaml", policy("tiny-pass")),
            True: write_yaml(
                cfg / "strict.yaml", policy("tiny-strict", max_kl_vs_champion={"csqa": 1e-12, "released": 1e-12})
            ),
        }

    # ---------------------------------------------------------------- operations
    def write_snapshot(self, with_val: bool) -> None:
        """A new snapshot of skill A in its folder (written under a hidden name, then renamed),
        and A's config with or without a held-out file."""
        self.snapshots += 1
        rows = self.code[8 * (self.snapshots - 1) % 48 :][:8]
        name = f"{self.snapshots:04d}.jsonl"
        write_pairs(self.folder / f".{name}", rows)
        os.replace(self.folder / f".{name}", self.folder / name)
        data = {"source": str(self.folder), "val_limit": 4} | ({"val_source": self.held} if with_val else {})
        write_yaml(
            self.root / "cfg" / "a.yaml",
            BASE
            | {
                "name": "a",
                "skill": "a",
                "data": data,
                "target": {"scorer": "reference-nll", "options": {"source": self.held, "limit": 4}},
            },
        )

    def cycle(self, skill: str, crash: str | None = None) -> dict | None:
        from flows.update import update

        where = {
            "training": "flows.training.train_run",
            "evaluation": "flows.evaluate.record_candidate",
            "publish": "flows.release.publish",
        }

        def boom(*args, **kwargs):
            raise InjectedCrash(f"injected crash in {crash}")

        before = self.fingerprint()
        with pytest.MonkeyPatch.context() as mp:
            if crash is not None:
                mp.setattr(where[crash], boom)
            try:
                result = update(self.config[skill], self.policies[self.strict])
            except InjectedCrash:
                return None
        if result.outcome == "idle":
            assert self.fingerprint() == before, f"an idle cycle wrote something: {result.reason}"
        return result

    def cli(self, *args: str) -> int:
        from flows.cli import main

        return main(list(args))

    def current_line(self) -> str:
        """The line on the backbone revision in use (named before its first cycle creates it)."""
        from registry import model_name_for

        rev = _revision_in_use()
        mine = [name for name, revision in self.lines().items() if revision == rev]
        return mine[0] if mine else model_name_for("tiny-llama", "assistant")

    def lines(self) -> dict[str, str]:
        """Every line of the state: name -> backbone revision."""
        from sqlalchemy import select

        from registry import models as m

        p = _open()
        try:
            with p.ledger.transaction() as s:
                return {
                    r.name: b.revision
                    for r, b in s.execute(
                        select(m.RegisteredModel, m.Backbone).join(
                            m.Backbone, m.RegisteredModel.backbone_id == m.Backbone.id
                        )
                    )
                }
        finally:
            p.close()

    def use_revision(self, revision: int) -> None:
        """The tiny backbone at another 'revision' (another seed: other weights, another revision id)."""
        import evaluation.tiny as tiny

        self.patches.undo()
        self.revision = revision
        if revision == 0:
            return
        original = tiny.load_model

        def load_model(name: str, dtype: str = "auto"):
            from atlas_core.backbone import Backbone, decoder_layers

            if name != tiny.TINY_BACKBONE:
                return original(name, dtype)
            bb = original(name, dtype)
            model = tiny.tiny_llama(len(bb.tokenizer), seed=revision, hidden_size=64, layers=4)
            model.config.max_position_embeddings = bb.model.config.max_position_embeddings
            return Backbone(
                bb.name, bb.revision.replace("seed0", f"seed{revision}"), model, bb.tokenizer, decoder_layers(model)
            )

        self.patches.setattr(tiny, "load_model", load_model)

    def run(self, op: tuple) -> None:
        """One operation; op = (name, *arguments) as `REGRESSIONS` lists them."""
        self.log.append(op)
        name, *args = op
        finished = None
        if name == "cycle":
            finished = self.cycle(args[0]) and (args[0], self.policies[self.strict])
        elif name == "crash":
            self.cycle(args[0], crash=args[1])
        elif name == "rerun":
            skill, policy_path = finished = self.last_cycle
            assert policy_path == self.policies[self.strict]
            again = self.cycle(skill)
            assert again.outcome == "idle", f"a rerun of a finished cycle was not idle: {again}"
        elif name == "snapshot":
            self.write_snapshot(with_val=args[0] == "val")
        elif name == "prune":  # a team keeps only the newest snapshot
            for old in sorted(self.folder.glob("*.jsonl"))[:-1]:
                old.unlink()
        elif name == "policy":
            self.strict = not self.strict
        elif name == "revision":
            self.use_revision(1 - self.revision)
        elif name == "rollback":
            line, holder = self.current_line(), self.champion_of(self.current_line())
            code = self.cli("rollback", "--model", line, "--reason", "sequence test")
            assert code == (0 if holder is not None else 2), f"rollback exit {code} with champion {holder}"
        elif name == "renominate":
            retired = self.retired(self.current_line())
            if retired:
                assert self.cli("renominate", retired[0], "--model", self.current_line(), "--reason", "again") == 0
            else:  # nothing retired: refused with one line
                assert self.cli("renominate", "base", "--model", self.current_line(), "--reason", "again") == 2
        self.last_cycle = finished or None
        self.check()

    def random_op(self, rng: random.Random) -> tuple:
        name = rng.choices(OPS, WEIGHTS)[0]
        if name == "rerun" and self.last_cycle is None:
            name = "cycle"
        if name == "cycle":
            return ("cycle", rng.choice(SKILLS))
        if name == "crash":
            return ("crash", rng.choice(SKILLS), rng.choice(STAGES))
        if name == "snapshot":
            return ("snapshot", rng.choice(("val", "no-val")))
        return (name,)

    # ---------------------------------------------------------------- what the runner reads
    def champion_of(self, line: str):
        from registry import alias_holder, get_model

        p = _open()
        try:
            try:
                return alias_holder(p.ledger, get_model(p.ledger, line).id)
            except Exception:
                return None
        finally:
            p.close()

    def retired(self, line: str) -> list[str]:
        from registry import get_model, list_versions

        p = _open()
        try:
            try:
                return [v.name for v in list_versions(p.ledger, get_model(p.ledger, line).id) if v.status == "retired"]
            except Exception:
                return []
        finally:
            p.close()

    def fingerprint(self) -> dict[str, str]:
        """Everything a cycle could write: both databases row by row, the store's and the reports' files."""

        def db(path: Path) -> str:
            if not path.is_file():
                return "-"
            with sqlite3.connect(path) as con:
                return hashlib.sha256("\n".join(con.iterdump()).encode()).hexdigest()

        def files(folder: Path) -> str:
            names = (
                sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
            )
            return hashlib.sha256("\n".join(names).encode()).hexdigest()

        return {
            "ledger": db(self.state / "ledger.db"),
            "mlflow": db(self.state / "mlflow" / "mlflow.db"),
            "store": files(self.state / "artifacts"),
            "mlflow artifacts": files(self.state / "mlflow" / "artifacts"),
            "reports": files(self.state / "reports"),
        }

    # ---------------------------------------------------------------- invariants
    def check(self) -> None:
        rev, lines = _revision_in_use(), self.lines()
        p = _open()
        try:
            for name, revision in lines.items():
                check_line(p, name, loads=revision == rev)
        finally:
            p.close()


def _open():
    from flows.platform import open_platform

    return open_platform()


def _revision_in_use() -> str:
    from evaluation.tiny import load_model

    return load_model("tiny-llama", "float32").revision


def check_line(p, name: str, loads: bool) -> None:
    """The invariants of one line (see the module docstring)."""
    import torch

    from flows.lineage import chain_skill_specs
    from flows.skills import released_skills, require_evaluable
    from registry import alias_holder, get_model, list_releases, list_versions, version_chain

    model = get_model(p.ledger, name)
    holder = alias_holder(p.ledger, model.id)
    versions = list_versions(p.ledger, model.id)
    names = [v.name for v in versions]
    assert len(names) == len(set(names)), f"{name}: version names repeat: {names}"

    # ledger, MLflow alias and history agree
    from mlflow.exceptions import MlflowException

    try:
        aliases = p.bridge.client.get_registered_model(name).aliases
    except MlflowException:
        aliases = {}
    alias = aliases.get("champion")
    assert (None if alias is None else str(alias)) == (holder.mlflow_version if holder else None), (
        f"{name}: MLflow champion alias {aliases.get('champion')} but the ledger's champion is {holder}"
    )
    releases = [r for r in list_releases(p.ledger, model.id) if r.action != "renominate"]
    if releases:
        last = releases[-1]
        expected = holder.id if holder else next(v.id for v in versions if v.is_base)
        assert last.version_id == expected, (
            f"{name}: the history ends at version #{last.version_id}, champion #{expected}"
        )
    else:
        assert holder is None

    # a retired version is promoted again only after a re-nomination
    retired: set[int] = set()
    for r in list_releases(p.ledger, model.id):
        if r.action == "rollback" and r.previous_version_id is not None:
            retired.add(r.previous_version_id)
        elif r.action == "renominate":
            retired.discard(r.version_id)
        elif r.action == "promote":
            assert r.version_id not in retired, (
                f"{name}: retired version #{r.version_id} promoted without re-nomination"
            )

    if holder is None:
        return
    # the released skills keep evaluable retained contexts; the champion loads, verifies and runs
    from flows.cycle import Applied

    chain = version_chain(p.ledger, holder.id)
    for spec in released_skills(
        chain_skill_specs(p.ledger, Applied(holder, tuple(chain)), p.store, p.state / "cache" / "snapshots"),
        training="",
    ):
        require_evaluable(spec, "released")
    if loads:
        from flows.serving import load_release

        release = load_release(name, "champion")
        assert release.name == holder.name and len(release.chain) == len(chain)
        ids = release.tokenizer("def f(x): return x", return_tensors="pt").input_ids
        with torch.no_grad():
            assert torch.isfinite(release.model(ids).logits).all()
        release.detach()


@pytest.fixture
def patches():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_a_sequence_that_once_broke_a_line(prefect_harness, state, tmp_path, patches, name):
    line = Line(tmp_path / "line", state, patches)
    for op in REGRESSIONS[name]:
        _run(line, op)


def _sequences() -> list[tuple[int, int]]:
    wanted = os.environ.get("ATLAS_LINE_SEQUENCES")
    if not wanted:
        return SEQUENCES
    seeds, steps = (int(x) for x in wanted.split(":"))
    return [(seed, steps) for seed in range(seeds)]


@pytest.mark.parametrize("seed,steps", _sequences())
def test_a_random_sequence_of_operations_keeps_the_line_whole(prefect_harness, state, tmp_path, patches, seed, steps):
    line, rng = Line(tmp_path / "line", state, patches), random.Random(seed)
    for _ in range(steps):
        _run(line, line.random_op(rng))


def _run(line: Line, op: tuple) -> None:
    try:
        line.run(op)
    except BaseException as e:
        raise AssertionError(f"sequence {json.dumps(line.log)} failed at {op}: {type(e).__name__}: {e}") from e
