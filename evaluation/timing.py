"""Wall seconds of the steps inside an update cycle (each answer set, EvalPlus, KL per domain,
training per candidate, publishing), summed per process until taken.

Code times a step with `with phase("KL csqa"): ...`; flows.update takes the table once per
cycle and reports it next to the stage-level one, so a user sees where a cycle's time goes.
"""

from __future__ import annotations

from contextlib import contextmanager
from time import perf_counter
from typing import Iterator

_seconds: dict[str, float] = {}


@contextmanager
def phase(name: str) -> Iterator[None]:
    start = perf_counter()
    try:
        yield
    finally:
        _seconds[name] = _seconds.get(name, 0.0) + perf_counter() - start


def take() -> dict[str, float]:
    """The steps timed since the last call, in the order they first ran; the table starts afresh."""
    out = dict(_seconds)
    _seconds.clear()
    return out
