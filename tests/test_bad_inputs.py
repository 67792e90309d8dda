"""A fuzz of bad inputs at every boundary a user touches: each is refused with an error that names
the file and the field (or line), and nothing is left half-written.

Boundaries: update configs, release policies, run configs and retained-domain specs (every leaf,
every wrong value its declared type admits, see ALLOWED), skill and retained-domain files (JSONL),
stored tensor files and their manifests (truncated, altered, mismatched), and a hash the
store does not hold (a ledger row whose artifact is gone).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path

import pytest
import torch
import yaml

from atlas_core.errors import InputError
from atlas_core.typed_config import ConfigError, build
from flows.config import load_update_config
from flows.policy import load_policy
from tests.flows_fixtures import PASSING_POLICY, TINY_CONFIG, write_yaml

# ------------------------------------------------------------------------------ the field fuzz
# Every leaf of every config kind a user writes, list elements and mapping values included, is
# set in turn to each wrong value that suits its declared type (the dataclass type hints, so a new
# field is fuzzed as soon as it exists), and the file is loaded as the platform loads it. Each must
# be refused with an InputError that names the leaf's dotted path (and the file). A wrong value
# that loads fails the test, unless (kind, path, probe) is listed here with the reason the field's
# own documentation gives for accepting it. `*` matches one path segment or index. Null where
# the type is Optional is valid by definition and never tried. Every entry must still be needed.
# Probes (`probes`): string 'no-such-name' (for a string field: an unknown name or a missing path),
# int 3, float 1.5, bool, null, list [1, 'x'], mapping {no_such_key: 1}, empty-list, empty-mapping,
# empty '', and for numbers zero, negative, huge (10**30 / 1e300), nan, inf, -inf, 'nan', 'inf'.
_UNBOUNDED = "a positive (or >= 0) number with no upper bound in its documentation; a huge one is valid, if unwise"
ALLOWED: dict[tuple[str, str, str], str] = {
    # Free names and labels: any string of the documented form is valid, so an unknown one is.
    ("update", "name", "string"): "a label for reports: any text",
    ("policy", "name", "string"): "a label recorded with each gate decision (with the policy's hash): any text",
    ("update", "skill", "string"): "the skill a release teaches: any name of letters, digits, '_', '.', '-'",
    ("update", "line", "string"): "a new line is created on first use: any name of letters, digits, '_', '.', '-'",
    (
        "update",
        "retained.domains[*].name",
        "string",
    ): "a JSONL domain's own name: any name of letters, digits, '_', '.', '-'",
    (
        "domain",
        "retained.domains[0].name",
        "string",
    ): "a JSONL domain's own name: any name of letters, digits, '_', '.', '-'",
    # Names and paths resolved only when the model or the adapter is built (they need the model,
    # the hub cache or files a cycle writes later); '' is refused at load.
    ("update", "backbone", "string"): "an alias, a local folder or a cached hub id, resolved when the model loads",
    ("run", "backbone", "string"): "an alias, a local folder or a cached hub id, resolved when the model loads",
    ("update", "execution.slots", "string"): "a Prefect global concurrency limit: checked to exist before anything "
    "trains, in work-pool mode (flows/candidates.py: require_work_pool)",
    ("run", "atlas", "string"): "read when the adapter is built; a cycle writes its own atlas path here",
    (
        "run",
        "lora.target",
        "string",
    ): "a projection inside layer l, checked against the model when the adapter is built",
    ("run", "lora.stats", "string"): "a retained-statistics file, read when the adapter is built",
    ("run", "lora.o_lora.past_files[*]", "string"): "weight-adapter files, read when the adapter is built",
    ("run", "lora.o_lora.past_files", "empty-list"): "the default: only past 'files' needs files (and refuses [])",
    # Zero where the documented range includes it.
    ("update", "data.holdout", "zero"): "0: no split, valid with val_source or a built-in source (refused otherwise)",
    ("update", "atlas.seed", "zero"): "a seed >= 0",
    ("policy", "candidates.seeds[*]", "zero"): "a seed in [0, 2**31)",
    ("run", "train.seed", "zero"): "a seed >= 0",
    (
        "run",
        "layer",
        "zero",
    ): "a layer index >= 0 (an update config asks for >= 1: retained KL caches the layers below)",
    ("update", "train.checkpoint_every_steps", "zero"): "0: checkpoints at epoch ends only",
    ("run", "train.checkpoint_every_steps", "zero"): "0: checkpoints at epoch ends only",
    ("run", "train.warmup_steps", "zero"): "0: no warmup (the default)",
    ("run", "train.weight_decay", "zero"): "0: no weight decay (the default)",
    ("run", "train.betas[*]", "zero"): "a beta in [0, 1)",
    ("run", "train.objective.teacher_cache_mib", "zero"): "0: never cache, recompute f0 every step",
    ("run", "residual.alpha", "zero"): "a filter strength in [0, 1]",
    ("run", "lora.clora.lam", "zero"): "a weight >= 0 (0: plain LoRA)",
    ("run", "lora.o_lora.lambda1", "zero"): "a weight >= 0 (0: plain LoRA)",
    ("policy", "min_target_gain", "zero"): "0: no regression on the taught skill",
    ("policy", "min_target_gain", "negative"): "a tolerance: the target may drop that much (a squash)",
    ("policy", "max_kl_vs_champion.*", "zero"): "a KL limit >= 0 (0: the outputs must not move)",
    ("policy", "max_kl_vs_base.*", "zero"): "a KL limit >= 0 (0: the outputs must not move)",
    ("policy", "max_kl_tail_vs_champion.*.*", "zero"): "a KL limit >= 0",
    ("policy", "max_kl_tail_vs_base.*.*", "zero"): "a KL limit >= 0",
    (
        "policy",
        "no_regression.*.tolerance",
        "zero",
    ): "a bound >= 0 (pass/fail: no n can prove it, refused once n is known)",
    ("policy", "max_csqa_choice_churn", "zero"): "a share in [0, 1]",
    # Empty mappings that mean 'none'.
    ("policy", "max_kl_tail_vs_champion", "empty-mapping"): "the default: tails not checked",
    ("policy", "max_kl_tail_vs_base", "empty-mapping"): "the default: tails not checked",
    (
        "policy",
        "no_regression",
        "empty-mapping",
    ): "valid until the line has a released skill (require_released, per cycle)",
    # Huge numbers where the range is open above.
    ("update", "train.lr", "huge"): _UNBOUNDED,
    ("update", "execution.heartbeat_timeout_s", "huge"): _UNBOUNDED + " (a silent candidate is waited for)",
    ("update", "target.options.solved_below", "huge"): _UNBOUNDED + " (every problem counts as solved)",
    ("policy", "min_target_gain", "huge"): "refused once the target's problem count is known (require_feasible_target)",
    ("policy", "max_kl_vs_champion.*", "huge"): _UNBOUNDED + " (no limit in effect)",
    ("policy", "max_kl_vs_base.*", "huge"): _UNBOUNDED + " (no limit in effect)",
    ("policy", "max_kl_tail_vs_champion.*.*", "huge"): _UNBOUNDED + " (no limit in effect)",
    ("policy", "max_kl_tail_vs_base.*.*", "huge"): _UNBOUNDED + " (no limit in effect)",
    ("policy", "no_regression.*.tolerance", "huge"): _UNBOUNDED + " (no limit in effect)",
    ("run", "train.lr", "huge"): _UNBOUNDED,
    ("run", "train.eps", "huge"): _UNBOUNDED,
    ("run", "train.weight_decay", "huge"): _UNBOUNDED,
    ("run", "train.grad_clip", "huge"): _UNBOUNDED + " (no clipping in effect)",
    ("run", "train.objective.ratio", "huge"): _UNBOUNDED,
    ("run", "train.objective.replay_weight", "huge"): _UNBOUNDED,
    ("run", "train.objective.beta", "huge"): _UNBOUNDED,
    ("run", "train.objective.stm_tau", "huge"): _UNBOUNDED + " (no token dropped)",
    ("run", "train.objective.teacher_cache_mib", "huge"): _UNBOUNDED + " (always cache)",
    ("run", "residual.scale", "huge"): _UNBOUNDED,
    ("run", "lora.alpha", "huge"): _UNBOUNDED,
    ("run", "lora.clora.lam", "huge"): _UNBOUNDED,
    ("run", "lora.o_lora.lambda1", "huge"): _UNBOUNDED,
}

UNKNOWN = "no-such-name"  # a string that is no known name, no existing path, no number
HUGE_INT, HUGE_FLOAT = 10**30, 1e300


def _cores(hint) -> tuple[list, bool]:
    """(the non-null types of a hint, whether null is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return [a for a in args if a is not type(None)], type(None) in args
    return [hint], False


def _kind(t) -> str:
    if dataclasses.is_dataclass(t):
        return "dataclass"
    origin = typing.get_origin(t)
    if origin in (list, tuple, dict):
        return origin.__name__
    return {str: "str", int: "int", float: "float", bool: "bool"}[t]


def probes(hint) -> list[tuple[str, object]]:
    """(label, wrong value) for a field of this type: every wrong type, and for numbers and
    strings the values their ranges usually exclude."""
    cores, optional = _cores(hint)
    kinds = {_kind(t) for t in cores}
    out = [("string", UNKNOWN)]  # for a string field: an unknown name / a missing path
    if not kinds & {"int", "float"}:
        out.append(("int", 3))
    if "float" not in kinds:
        out.append(("float", 1.5))
    if "bool" not in kinds:
        out.append(("bool", True))
    if not optional and "dataclass" not in kinds:  # a section left empty (`data:`, every line commented out) is
        out.append(("null", None))  # YAML null, and means its defaults (typed_config.build)
    out += [("list", [1, "x"]), ("mapping", {"no_such_key": 1})]
    if kinds & {"list", "tuple"}:
        out.append(("empty-list", []))
    if "dict" in kinds:
        out.append(("empty-mapping", {}))
    if "str" in kinds:
        out.append(("empty", ""))
    if kinds & {"int", "float"}:
        integer = "float" not in kinds
        out += [
            ("zero", 0),
            ("negative", -3 if integer else -0.5),
            ("huge", HUGE_INT if integer else HUGE_FLOAT),
            ("nan", math.nan),
            ("inf", math.inf),
            ("-inf", -math.inf),
            ("'nan'", "nan"),
            ("'inf'", "inf"),
        ]
    return out


def sites(value, hint, path: tuple, special):
    """(path, hint) of this node and of every node below it: dataclass fields, list and tuple
    elements, mapping values. `special(path, value, hint)` may give a node a narrower hint (a
    scorer's options, a retained domain's mapping)."""
    hint = special(path, value, hint)
    yield path, hint
    for t in _cores(hint)[0]:
        kind = _kind(t)
        if kind == "dataclass" and isinstance(value, dict):
            hints = typing.get_type_hints(t)
            for f in dataclasses.fields(t):
                yield from sites(value.get(f.name), hints[f.name], path + (f.name,), special)
        elif kind == "list" and isinstance(value, list):
            for i, v in enumerate(value):
                yield from sites(v, typing.get_args(t)[0], path + (i,), special)
        elif kind == "tuple" and isinstance(value, list):
            for i, (v, a) in enumerate(zip(value, typing.get_args(t))):
                yield from sites(v, a, path + (i,), special)
        elif kind == "dict" and isinstance(value, dict):
            for key, v in value.items():
                yield from sites(v, typing.get_args(t)[1], path + (key,), special)
        else:
            continue
        return


def dotted(path: tuple) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else f".{key}" if out else str(key)
    return out


def with_value(doc, path: tuple, value):
    """`doc` with the node at `path` replaced (the containers on the path are copied; loaders do
    not change the documents they are given)."""
    out = node = copy.copy(doc)
    for key in path[:-1]:
        node[key] = copy.copy(node[key])
        node = node[key]
    node[path[-1]] = value
    return out


def _plain(obj):
    return json.loads(json.dumps(obj))  # tuples -> lists, as YAML gives them


def _allowed(kind: str, path: str, label: str):
    for key in ALLOWED:
        k, pattern, probe = key
        if k == kind and probe == label and re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.\[\]]+"), path):
            return key
    return None


class _Files:
    """The user files the fuzz's configs point at (a skill set, a domain, an answer set)."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.skill, self.skill_val, self.domain, self.answers = (
            str(folder / n) for n in ("skill.jsonl", "skill-val.jsonl", "domain.jsonl", "answers.jsonl")
        )
        rows = {
            self.skill: [{"id": f"s{i}", "prompt": f"Task {i}", "response": f"Answer {i}"} for i in range(10)],
            self.skill_val: [{"id": f"v{i}", "prompt": f"Held {i}", "response": f"Answer {i}"} for i in range(4)],
            self.domain: [
                {"id": f"d{i}", "prompt": f"Question {i}?", "reference": f"Reply {i}.", "answer": str(i)}
                for i in range(8)
            ],
            self.answers: [{"id": f"a{i}", "prompt": f"Say {i}", "answer": str(i)} for i in range(4)],
        }
        for path, lines in rows.items():
            Path(path).write_text("".join(json.dumps(r) + "\n" for r in lines))


def _update_kind(files: _Files):
    from evaluation.domains import RetainedDomain
    from evaluation.scorer_base import parse_options
    from evaluation.scorers_builtin import BUILTIN_SCORERS
    from flows.config import UpdateConfig

    t = TINY_CONFIG
    domains = ["gsm8k", "csqa", {"name": "support", "file": files.domain, "gate_rows": 3, "checker": "exact"}]
    bases = [("tiny", t), ("tiny, a JSONL domain", t | {"retained": t["retained"] | {"domains": domains}})]
    for scorer, options in (
        ("mbpp-plus", {"limit": 4}),
        ("gsm8k-accuracy", {"limit": 4}),
        ("csqa-choice", {"limit": 4}),
        ("exact-match", {"file": files.answers, "limit": 2}),
        ("reference-nll", {"source": "gsm8k", "split": "test", "limit": 4}),
        ("response-match", {"source": files.skill, "limit": 2}),
    ):
        bases.append((f"tiny, {scorer}", t | {"target": {"scorer": scorer, "options": options}}))
    bases += [
        ("tiny, a JSONL skill", t | {"data": {"source": files.skill, "holdout": 0.25, "train_limit": 8}}),
        (
            "tiny, a JSONL skill and validation file",
            t | {"data": {"source": files.skill, "val_source": files.skill_val, "holdout": 0.0}},
        ),
    ]
    bases += [(f.name, yaml.safe_load(f.read_text())) for f in sorted(Path("configs/update").glob("*.yaml"))]

    def full(doc):
        out = _plain(dataclasses.asdict(build(UpdateConfig, doc)))
        cls = BUILTIN_SCORERS.get(out["target"]["scorer"])
        if cls is not None:
            out["target"]["options"] = _plain(dataclasses.asdict(parse_options(cls.Options, out["target"]["options"])))
        out["retained"]["domains"] = [
            d if isinstance(d, str) else _plain(dataclasses.asdict(RetainedDomain(**d)))
            for d in out["retained"]["domains"]
        ]
        return out

    def special(path, value, hint, root):
        if path == ("target", "options") and root["target"]["scorer"] in BUILTIN_SCORERS:
            return BUILTIN_SCORERS[root["target"]["scorer"]].Options
        if path[:2] == ("retained", "domains") and len(path) == 3:
            return str | RetainedDomain
        return hint

    return UpdateConfig, [(n, full(d)) for n, d in bases], special, lambda path, base, doc: load_update_config(path)


def _policy_kind(files: _Files):
    from flows.config import UpdateConfig
    from flows.policy import ReleasePolicy, load_cycle_policy

    tails = {
        "max_kl_tail_vs_champion": {"csqa": {"p95": 1.0, "max": 5.0}, "released": {"p99": 1.0}},
        "max_kl_tail_vs_base": {"gsm8k": {"max": 5.0}},
        "no_regression": {"released": {"tolerance": 0.5, "confidence": 0.9, "min_n": 4}},
    }
    pairs = [("tiny-pass", PASSING_POLICY | tails, build(UpdateConfig, TINY_CONFIG))]
    for policy, config in (("default", "default"), ("ci", "ci"), ("gsm8k-format", "gsm8k-format"), ("strict", "gpu")):
        pairs.append(
            (
                f"{policy}.yaml",
                yaml.safe_load(Path(f"configs/policy/{policy}.yaml").read_text()),
                load_update_config(f"configs/update/{config}.yaml"),
            )
        )
    configs = {name: config for name, _, config in pairs}
    bases = [(name, _plain(dataclasses.asdict(build(ReleasePolicy, doc)))) for name, doc, _ in pairs]
    loader = lambda path, base, doc: load_cycle_policy(path, configs[base])
    return ReleasePolicy, bases, lambda path, value, hint, root: hint, loader


def _run_kind(files: _Files):
    from atlas_core.train.config import RunConfig, load_run_config

    docs = [(f.name, yaml.safe_load(f.read_text())) for f in sorted(Path("configs/train").glob("*.yaml"))]
    docs += [
        (
            "o-lora, past files",
            {
                "adapter": "weight-lora",
                "lora": {"method": "o-lora", "o_lora": {"past": "files", "past_files": ["earlier.safetensors"]}},
            },
        ),
        ("clora, k", {"adapter": "weight-lora", "lora": {"method": "clora", "clora": {"k": 8}}}),
        ("plain, calibrated scale", {"adapter": "plain", "residual": {"scale": "calibrated"}}),
    ]
    bases = [(name, _plain(dataclasses.asdict(build(RunConfig, doc)))) for name, doc in docs]
    return RunConfig, bases, lambda path, value, hint, root: hint, lambda path, base, doc: load_run_config(path)


def _domain_kind(files: _Files):
    from evaluation.domains import RetainedDomain, validate_domains

    docs = [
        ("a JSONL domain", {"name": "support", "file": files.domain, "gate_rows": 3, "checker": "exact"}),
        ("a JSONL domain, default rows", {"name": "support.v2", "file": files.domain, "checker": "number"}),
        ("built-in by name", "gsm8k"),
        ("built-in as a mapping", {"name": "csqa"}),
    ]
    bases = [(n, d if isinstance(d, str) else _plain(dataclasses.asdict(RetainedDomain(**d)))) for n, d in docs]
    return (
        str | RetainedDomain,
        bases,
        lambda path, value, hint, root: hint,
        lambda path, base, doc: validate_domains([doc]),
    )


KINDS = {"update": _update_kind, "policy": _policy_kind, "run": _run_kind, "domain": _domain_kind}


@pytest.fixture
def yaml_in_memory(monkeypatch):
    """Loaders read registered documents by file name instead of parsing YAML (the first base of
    each kind still goes through a real YAML file): the fuzz loads thousands of documents."""
    import atlas_core.train.config as run_config_module
    import flows.config
    import flows.policy
    from atlas_core import typed_config

    memory: dict[str, object] = {}

    def load_yaml(path):
        name = Path(path).name
        return memory[name] if name in memory else typed_config.load_yaml(path)

    for module in (flows.config, flows.policy, run_config_module):
        monkeypatch.setattr(module, "load_yaml", load_yaml)
    return memory


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_leaf_of_every_config_kind_refuses_every_wrong_value_by_name(kind, tmp_path, yaml_in_memory):
    root_hint, bases, special, loader = KINDS[kind](_Files(tmp_path / "files"))
    failures, used, tried = [], set(), 0
    for number, (base_name, base) in enumerate(bases):
        through_file = number == 0
        for path, hint in sites(base, root_hint, (), lambda p, v, h: special(p, v, h, base)):
            if not path:
                continue
            name = dotted(path if kind != "domain" else ("retained", "domains", 0) + path)
            for label, wrong in probes(hint):
                tried += 1
                doc = with_value(base, path, wrong)
                file = tmp_path / "fuzz.yaml" if through_file else Path(f"fuzz-{kind}.yaml")
                if through_file:
                    write_yaml(file, doc)
                else:
                    yaml_in_memory[file.name] = doc
                try:
                    loader(str(file), base_name, doc)
                except InputError as e:
                    message = str(e)
                    named = re.search(re.escape(name) + r"(?![\w-])", message)
                    if not named or (kind != "domain" and str(file) not in message):
                        failures.append(
                            f"{base_name}: {name} = {label} ({wrong!r}) refused without naming "
                            f"{name} and the file: {message}"
                        )
                except Exception as e:
                    failures.append(f"{base_name}: {name} = {label} ({wrong!r}) raised {type(e).__name__}: {e}")
                else:
                    key = _allowed(kind, name, label)
                    if key is None:
                        failures.append(f"{base_name}: {name} = {label} ({wrong!r}) was accepted")
                    used.add(key)
    stale = [key for key in ALLOWED if key[0] == kind and key not in used]
    failures += [f"allow-list entry {key} is no longer needed: remove it" for key in stale]
    assert tried > 100
    assert not failures, f"{len(failures)} of {tried} wrong values:\n" + "\n".join(failures)


@pytest.mark.parametrize("which", ["config", "policy"])
def test_a_typo_in_a_field_name_is_named(which, tmp_path):
    base = TINY_CONFIG if which == "config" else PASSING_POLICY
    loader = load_update_config if which == "config" else (lambda p: load_policy(p, ["gsm8k", "csqa"]))
    for typo in ("retaned", "candidatez"):
        with pytest.raises(ConfigError, match=typo):
            loader(write_yaml(tmp_path / "typo.yaml", base | {typo: 1}))


def test_a_config_or_policy_that_is_not_yaml_or_not_a_mapping_is_named(tmp_path):
    for text in ("backbone: [unclosed", "- a\n- list", "\x00\x01"):  # (an empty file means the defaults)
        path = tmp_path / "broken.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match="broken.yaml"):
            load_update_config(path)
        with pytest.raises(ConfigError, match="broken.yaml") as e:
            load_policy(path)
        assert str(e.value).count("broken.yaml") == 1


@pytest.mark.parametrize("loader_name", ["load_skill_jsonl", "load_domain_jsonl"])
def test_every_broken_jsonl_line_is_named_by_file_and_line(loader_name, tmp_path):
    from evaluation import userdata

    loader = getattr(userdata, loader_name)
    good = (
        {"id": "a", "prompt": "p", "response": "r"}
        if loader_name == "load_skill_jsonl"
        else {"id": "a", "prompt": "p", "reference": "r"}
    )
    broken = [
        '{"id": "b", "prompt": ',
        "[1, 2]",
        json.dumps({k: v for k, v in good.items() if k != "prompt"}),
        json.dumps(good | {"prompt": 7}),
        json.dumps(good),
    ]  # the last: a duplicate id
    for line in broken:
        path = tmp_path / "set.jsonl"
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=r"set\.jsonl.*line 2"):
            loader(path)


def test_stored_tensor_files_refuse_truncation_alteration_and_a_foreign_manifest(tmp_path):
    from atlas_core.io import IntegrityError, load_verified, save_verified

    path = tmp_path / "adapter.safetensors"
    save_verified(path, {"B": torch.randn(8, 4)}, {"kind": "adapter"})
    original, manifest = path.read_bytes(), path.with_suffix(".json").read_text()
    cases = {
        "truncated": original[: len(original) // 2],
        "flipped": original[:-1] + bytes([original[-1] ^ 1]),
        "empty": b"",
    }
    for name, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(IntegrityError, match="adapter.safetensors"):
            load_verified(path)
    path.write_bytes(original)
    for name, text in {
        "not json": manifest[:-5],
        "other sha": manifest.replace('"sha256": "', '"sha256": "0'),
        "no sha": json.dumps({k: v for k, v in json.loads(manifest).items() if k != "sha256"}),
    }.items():
        path.with_suffix(".json").write_text(text)
        with pytest.raises(IntegrityError, match="adapter"):
            load_verified(path)
    path.with_suffix(".json").unlink()
    with pytest.raises(IntegrityError, match="adapter"):
        load_verified(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter.safetensors"]  # nothing else was written


def test_the_artifact_store_refuses_a_stored_file_altered_behind_its_back(tmp_path):
    from registry import ArtifactError, ArtifactStore

    store = ArtifactStore(tmp_path / "store")
    source = tmp_path / "atlas.safetensors"
    source.write_bytes(b"weights" * 100)
    info = store.put_file(source)
    stored = next(p for p in (tmp_path / "store").rglob("*") if p.is_file() and p.read_bytes() == source.read_bytes())
    stored.write_bytes(b"weights" * 99)
    with pytest.raises(ArtifactError, match=info.sha256[:12]):
        store.fetch(info.sha256, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()  # no half-fetched copy left behind


def test_a_sha256_the_store_does_not_hold_is_a_clear_error(tmp_path):
    """What a ledger row pointing at a lost artifact meets: an error naming the hash, no partial file."""
    from registry import ArtifactError, ArtifactStore

    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(ArtifactError, match="ab" * 32):
        store.fetch("ab" * 32, tmp_path / "adapter.safetensors")
    assert not (tmp_path / "adapter.safetensors").exists()


def test_a_policy_file_with_a_bad_threshold_names_the_domain(tmp_path):
    policy = PASSING_POLICY | {"max_kl_vs_champion": {"gsm8k": "low", "csqa": 0.1}}
    with pytest.raises(ConfigError, match=r"max_kl_vs_champion.*gsm8k"):
        load_policy(write_yaml(tmp_path / "p.yaml", policy), ["gsm8k", "csqa"])
    with pytest.raises(ConfigError, match=r"csqa"):  # a watched domain without a threshold
        load_policy(
            write_yaml(tmp_path / "q.yaml", PASSING_POLICY | {"max_kl_vs_base": {"gsm8k": 0.1}}), ["gsm8k", "csqa"]
        )
    assert yaml.safe_load(Path(tmp_path / "p.yaml").read_text())["max_kl_vs_champion"]["gsm8k"] == "low"


def test_a_ledger_version_whose_adapter_manifest_was_never_recorded_is_named(
    ledger, ledger_url, store, tmp_path, monkeypatch
):
    """A corrupted ledger row reference: the version's checkpoint carries no manifest hash."""
    from flows.platform import PlatformRef
    from flows.resources import scope
    from registry import LedgerError
    from tests.conftest_registry import make_candidates, unique_backbone

    monkeypatch.setenv("ATLAS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ATLAS_LEDGER_URL", ledger_url)
    monkeypatch.setenv("ATLAS_ARTIFACT_STORE", str(store.root_url))
    _, (version,) = make_candidates(ledger, store, unique_backbone(), seeds=(0,))
    with scope(PlatformRef.from_environment()) as res:
        with pytest.raises(LedgerError, match=rf"{version.name} \(id {version.id}\).*manifest"):
            res.delta(version)
    assert not (tmp_path / "state" / "cache").exists()  # nothing fetched
