"""Target scorers by name: the built-ins, or a user's `package.module:Factory`.

    scorer = build_scorer("reference-nll", {"source": "gsm8k", "limit": 64})
    ids = scorer.problem_ids()                          # fixed, file-order problem list
    values = scorer.score(model, tokenizer)             # {problem id: ProblemScore(answer, correct, value)}
    scorer.summarise(values)                            # the score: problems solved ('sum') or mean value ('mean')

Built-ins (options and their meaning: evaluation/scorers_builtin.py): mbpp-plus,
gsm8k-accuracy, csqa-choice, exact-match, reference-nll, response-match.

A user scorer is named "package.module:Factory": the module is imported, `Factory(**options)`
called, and the result must look like a TargetScorer (name, dataset, higher_is_better,
aggregate, problem_ids, score). It is wrapped so that its problem ids and scores are checked
on every call: exactly the listed ids, ProblemScore values, a 'sum' value equal to
`correct`, a 'mean' value written in `answer` (all the ledger keeps).

`build_scorer` is cheap (no model, no generation) and every error is a ConfigError
(a ValueError) naming `target.scorer` or `target.options.<key>`, so a flow can validate
every skill's scorer before any training starts. `check_scorer` is what an update config
runs when it loads: the same checks, except that a user's module is not imported yet.
A user scorer that breaks its contract while scoring raises InputError naming it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
from typing import Any

from atlas_core.errors import InputError
from atlas_core.typed_config import ConfigError
from evaluation.scorer_base import AGGREGATES, ProblemScore, TargetScorer, in_order, parse_options
from evaluation.scorers_builtin import BUILTIN_SCORERS

__all__ = ["SCORERS", "ProblemScore", "TargetScorer", "UserScorer", "build_scorer", "check_scorer"]

SCORERS: tuple[str, ...] = tuple(BUILTIN_SCORERS)


def build_scorer(name: str, options: dict | None = None) -> TargetScorer:
    """The scorer `name` (a built-in, or "package.module:Factory") with `options`."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"target.scorer: expected a scorer name, one of {list(SCORERS)} or 'package.module:Factory', got {name!r}"
        )
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"target.options: expected a mapping of option names to values, got {options!r}")
    if name in BUILTIN_SCORERS:
        cls = BUILTIN_SCORERS[name]
        try:
            return cls(parse_options(cls.Options, options))
        except ValueError as e:  # every message starts with "options..."
            raise ConfigError(f"target.{e}") from e
    if ":" in name:
        return _user_scorer(name, options or {})
    close = difflib.get_close_matches(name, SCORERS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"target.scorer: unknown scorer {name!r}{hint}; expected one of {list(SCORERS)} or 'package.module:Factory'"
    )


def check_scorer(name: str, options: dict | None = None) -> None:
    """build_scorer's checks, cheap enough for loading a config: a built-in is built (no model,
    no data set loaded; a file option is read and schema-checked); a user's
    'package.module:Factory' is checked for its form only (imported and called when the cycle
    builds it). Errors name `target.scorer` or `target.options.<key>`."""
    if isinstance(name, str) and name not in BUILTIN_SCORERS and ":" in name:
        _user_spec(name)
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"target.options: expected a mapping of option names to values, got {options!r}")
        return
    build_scorer(name, options)


# ------------------------------------------------------------------------------ user scorers
def _user_spec(spec: str) -> tuple[str, str]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not all(p.isidentifier() for p in module_name.split(".")) or not attr.isidentifier():
        raise ConfigError(f"target.scorer: expected 'package.module:Factory', got {spec!r}")
    return module_name, attr


def _user_scorer(spec: str, options: dict) -> UserScorer:
    module_name, attr = _user_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while it is imported
        raise ConfigError(
            f"target.scorer: cannot import module {module_name!r} of {spec!r} ({type(e).__name__}: {e})"
        ) from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"target.scorer: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ConfigError(f"target.scorer: {spec!r} is a {type(factory).__name__}, not a callable factory")
    _check_option_names(spec, factory, options)
    try:
        made = factory(**options)
    except Exception as e:  # the factory's own validation of its options
        message = str(e)
        if message.startswith("options."):
            raise ConfigError(f"target.{message}") from e
        raise ConfigError(f"target.options: {spec}(**options) raised {type(e).__name__}: {message}") from e
    return UserScorer(spec, made)


def _check_option_names(spec: str, factory: Any, options: dict) -> None:
    """A key the factory does not take (a typo) or a required one left out, named before the call."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no introspectable signature: the call itself will tell
        return
    params = signature.parameters
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key in options:
            if key not in takes:
                close = difflib.get_close_matches(key, takes, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"target.options.{key}: not an option of {spec}{hint}; its options: {takes}")
    missing = [n for n in takes if params[n].default is params[n].empty and n not in options]
    if missing:
        raise ConfigError(f"target.options.{missing[0]}: required by {spec}, not given")


class UserScorer(TargetScorer):
    """A user's scorer object, checked on construction and on every call (`inner` is the object)."""

    def __init__(self, spec: str, inner: Any):
        problems = []
        for attr in ("name", "dataset"):
            value = getattr(inner, attr, None)
            if not isinstance(value, str) or not value.strip():
                problems.append(f"{attr} is {value!r}, expected a non-empty string")
        if not isinstance(getattr(inner, "higher_is_better", None), bool):
            problems.append(f"higher_is_better is {getattr(inner, 'higher_is_better', None)!r}, expected true or false")
        if getattr(inner, "aggregate", None) not in AGGREGATES:
            problems.append(f"aggregate is {getattr(inner, 'aggregate', None)!r}, expected one of {list(AGGREGATES)}")
        for method in ("problem_ids", "score"):
            if not callable(getattr(inner, method, None)):
                problems.append(f"{method} is not a method")
        if problems:
            raise ConfigError(
                f"target.scorer: {spec} made a {type(inner).__name__} that is not a TargetScorer: "
                + "; ".join(problems)
            )
        self.spec, self.inner = spec, inner
        self.name, self.dataset = inner.name, inner.dataset
        self.higher_is_better, self.aggregate = inner.higher_is_better, inner.aggregate

    def problem_ids(self) -> list[str]:
        ids = self.inner.problem_ids()
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(q, str) for q in ids):
            raise InputError(f"{self.spec}: problem_ids() must return a non-empty list of strings, got {ids!r:.120}")
        if len(set(ids)) != len(ids):
            raise InputError(f"{self.spec}: problem_ids() repeats an id")
        return list(ids)

    def score(self, model: Any, tokenizer: Any) -> dict[str, ProblemScore]:
        got = self.inner.score(model, tokenizer)
        if not isinstance(got, dict):
            raise InputError(
                f"{self.spec}: score() must return a dict of problem id -> ProblemScore, got {type(got).__name__}"
            )
        ids = self.problem_ids()
        extra = sorted(set(got) - set(ids))
        if extra:
            raise InputError(f"{self.spec}: score() scored problems not in problem_ids(): {extra[:5]}")
        out = in_order(ids, got, self.spec)
        for q, s in out.items():
            self._check(q, s)
        return out

    def _check(self, q: str, s: Any) -> None:
        if not isinstance(s, ProblemScore):
            raise InputError(f"{self.spec}: score()[{q!r}] is a {type(s).__name__}, expected a ProblemScore")
        if self.aggregate == "sum" and s.value != float(s.correct):
            raise InputError(
                f"{self.spec}: score()[{q!r}].value is {s.value!r}; a 'sum' scorer's value is 1.0 "
                f"when correct, else 0.0 (correct is {s.correct})"
            )
        if self.aggregate == "mean" and not _holds(s.answer, s.value):
            raise InputError(
                f"{self.spec}: score()[{q!r}].answer is {s.answer!r}; a 'mean' scorer writes its value "
                f"({s.value!r}) as the answer, the only number the ledger keeps"
            )


def _holds(answer: str | None, value: float) -> bool:
    try:
        return math.isclose(float(answer), value, rel_tol=1e-6, abs_tol=1e-6)
    except (TypeError, ValueError):
        return False
