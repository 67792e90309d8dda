"""Training methods as plugins: the registry the trainer, the run configs, the chain and the export read.

Three tables, each filled by `register...` calls at the bottom of the module that defines the entry:

    methods      name -> Method          what trains: options, build, atlas variant, delta format
                                         (the run config's `adapter`; weight adapters: `lora.method`)
    objectives   kind -> Objective class the loss the trainer's loop calls (`train.objective.kind`)
    formats      kind -> DeltaFormat     how a saved delta loads, applies and exports (its manifest's "kind")

The built-in modules are listed in BUILTIN and imported the first time any table is read, so
registering is the only thing importing a method module does, and a method module may import
this one (and the trainer) without an import cycle. A method defined elsewhere registers itself
with a call:

    from atlas_core.methods import register, register_objective
    register(MyMethod())                  # then `adapter: my-method` in configs/train/my-method.yaml

(docs/ARCHITECTURE.md; tests/test_method_plugin.py registers a toy method end to end.)
"""

from __future__ import annotations

import importlib
import threading

from ..errors import InputError
from .base import DeltaFormat, Method, NoOptions

__all__ = [
    "BUILTIN",
    "DeltaFormat",
    "Method",
    "NoOptions",
    "WEIGHT_ADAPTER",
    "adapter_names",
    "delta_format",
    "format_of",
    "get",
    "method_for",
    "method_name",
    "names",
    "objective",
    "objective_kinds",
    "register",
    "register_format",
    "register_objective",
    "unregister",
    "unregister_objective",
    "weight_method_names",
]

BUILTIN = (
    "atlas_core.methods.residual",  # plain, centered, centered-distance, input-filter, atlas, global-pca, ...
    "atlas_core.methods.weight_lora",  # weight-lora (PEFT LoRA on layer l's o_proj)
    "atlas_core.train.baselines.lora_null",  # lora-null (v1 / v2)
    "atlas_core.train.baselines.oplora",  # oplora
    "atlas_core.train.baselines.olora",  # o-lora
    "atlas_core.train.baselines.corda",  # corda-kpm
    "atlas_core.train.baselines.clora",  # clora
    "atlas_core.train.baselines.toplora",  # toplora (+ its frozen format)
    "atlas_core.train.baselines.centered_lora",  # centered-lora, a control (+ its frozen format)
    "atlas_core.train.objectives",  # objectives ce, replay, output-kl
    "atlas_core.train.baselines.stm",  # objective stm
    "atlas_core.train.baselines.talr",  # objective talr
    "atlas_core.peft_lora",  # format peft-lora (a PEFT LoRA trained elsewhere)
)

WEIGHT_ADAPTER = "weight-lora"  # the run config's `adapter` of every weight adapter; `lora.method` says which

_methods: dict[str, Method] = {}
_objectives: dict[str, type] = {}
_formats: dict[str, DeltaFormat] = {}
_order: dict[tuple[str, str], tuple[int, int]] = {}  # (table, key) -> (built-in module's place, registration)
_lock = threading.RLock()
_loaded = _loading = False


def _builtins() -> None:
    """Import the built-in modules once (they register themselves); other threads wait until it is done."""
    global _loaded, _loading
    if _loaded:
        return
    with _lock:
        if _loaded or _loading:  # _loading: this thread is importing them (a module registering itself)
            return
        _loading = True
        try:
            for module in BUILTIN:
                importlib.import_module(module)
        finally:
            _loading = False
        _loaded = True


# ------------------------------------------------------------------------------ registering
def _add(table: dict, key: str, entry, what: str, replace: bool):
    if not key:
        raise ValueError(f"{what}: an entry needs a non-empty name, got {key!r}")
    if key in table and table[key] is not entry and not replace:
        raise ValueError(f"{what} {key!r} is registered already ({table[key]!r}); pass replace=True to replace it")
    module = getattr(entry, "__module__", None) or type(entry).__module__
    place = BUILTIN.index(module) if module in BUILTIN else len(BUILTIN)
    _order.setdefault((what, key), (place, len(_order)))
    table[key] = entry
    return entry


def _listed(table: dict, what: str) -> tuple[str, ...]:
    """The table's keys, the built-ins in BUILTIN's order (whoever imported them first), then plugins."""
    return tuple(sorted(table, key=lambda key: _order[(what, key)]))


def register_format(fmt: DeltaFormat, replace: bool = False) -> DeltaFormat:
    """Add how frozen deltas of kind `fmt.kind` load, apply and export."""
    return _add(_formats, fmt.kind, fmt, "delta format", replace)


def register(method: Method, replace: bool = False) -> Method:
    """Add a training method under `method.name` (and its delta format, if new)."""
    if method.delta.kind not in _formats:
        register_format(method.delta)
    elif _formats[method.delta.kind] is not method.delta and not replace:
        raise ValueError(
            f"method {method.name!r}: delta kind {method.delta.kind!r} belongs to another format; "
            "reuse that format object or pick another kind"
        )
    return _add(_methods, method.name, method, "method", replace)


def register_objective(cls: type, replace: bool = False) -> type:
    """Add an objective class (atlas_core.train.objectives.Objective) under `cls.kind`."""
    return _add(_objectives, cls.kind, cls, "objective", replace)


def unregister(name: str) -> None:
    """Remove a method (a plugin's; tests). Its delta format stays registered: files of that kind still load."""
    _methods.pop(name, None)
    _order.pop(("method", name), None)


def unregister_objective(kind: str) -> None:
    """Remove an objective (a plugin's; tests)."""
    _objectives.pop(kind, None)
    _order.pop(("objective", kind), None)


# ------------------------------------------------------------------------------ looking up
def get(name: str) -> Method:
    _builtins()
    if name not in _methods:
        raise InputError(f"method {name!r} is not registered; registered: {', '.join(names())}")
    return _methods[name]


def names() -> tuple[str, ...]:
    _builtins()
    return _listed(_methods, "method")


def adapter_names() -> tuple[str, ...]:
    """The values a run config's `adapter` may take: every method that is no weight adapter, and weight-lora."""
    return tuple(n for n in names() if not _methods[n].weight_adapter) + (WEIGHT_ADAPTER,)


def weight_method_names() -> tuple[str, ...]:
    """The values `lora.method` may take (adapter: weight-lora)."""
    return tuple(n for n in names() if _methods[n].weight_adapter)


def method_name(adapter: str, lora_method: str) -> str:
    """The method a run config trains: its `adapter`, or for adapter weight-lora its `lora.method`."""
    return lora_method if adapter == WEIGHT_ADAPTER else adapter


def method_for(run_config) -> Method:
    """The Method of a RunConfig (atlas_core.train.config)."""
    return get(method_name(run_config.adapter, run_config.lora.method))


def objective(kind: str) -> type:
    _builtins()
    if kind not in _objectives:
        raise InputError(f"objective {kind!r} is not registered; registered: {', '.join(objective_kinds())}")
    return _objectives[kind]


def objective_kinds() -> tuple[str, ...]:
    _builtins()
    return _listed(_objectives, "objective")


def delta_format(kind: str, where: str = "delta") -> DeltaFormat:
    """The format of saved deltas of this kind; `where` names the file in the refusal."""
    _builtins()
    if kind not in _formats:
        known = ", ".join(_listed(_formats, "delta format"))
        raise InputError(f"{where}: unknown delta kind {kind!r}; known: {known}")
    return _formats[kind]


def format_of(delta) -> DeltaFormat:
    """The format of a loaded frozen delta (by its `kind`)."""
    return delta_format(getattr(delta, "kind", type(delta).__name__), f"a {type(delta).__name__}")
