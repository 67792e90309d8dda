"""Comparing methods at shared target requirements (ATLAS_METHOD.md section 6).

Input: checkpoints as records (method, seed, target level, retained KL). A *run* is one
(method, seed). A checkpoint *reaches* level k when its level is >= k (direction "higher",
e.g. MBPP+ problems solved) or <= k (direction "lower", e.g. held-out NLL).

1. Shared levels: every run must reach every level. With "higher", k runs up to the smallest
   per-run maximum, from the largest per-run minimum (below a run's own minimum all its
   checkpoints qualify, so lower levels add nothing); "lower" mirrors this. Integer
   levels give every integer in that range; float levels need an explicit list or a grid
   of `n_grid` evenly spaced values (one value when the range is a single point).
2. A run's value at k: the lowest KL among its checkpoints that reach k.
3. Per seed and k: ratio = value(method) / value(baseline). Summary: geometric mean of the
   ratios over all (seed, k); reduction = 1 - ratio. Each seed (geometric mean over its k)
   and each level (geometric mean over seeds) is counted as favouring the method (< 1),
   the baseline (> 1) or neither.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Checkpoint:
    method: str
    seed: int
    level: float  # target score: solved count, or e.g. NLL
    kl: float  # retained KL (nats/token), > 0
    name: str = ""


@dataclass(frozen=True)
class MatchedComparison:
    method: str
    baseline: str
    direction: str
    levels: list[float]
    seeds: list[int]
    values: dict[str, dict[int, list[float]]]  # method -> seed -> min KL per level
    ratios: dict[int, list[float]]  # seed -> ratio per level
    ratio: float  # geometric mean over seeds and levels
    reduction: float  # 1 - ratio
    seed_ratios: dict[int, float]
    level_ratios: list[float]
    favour_seeds: dict[str, int] = field(default_factory=dict)  # {method, baseline, tie} -> count
    favour_levels: dict[str, int] = field(default_factory=dict)


def _reaches(level: float, k: float, direction: str) -> bool:
    return level >= k if direction == "higher" else level <= k


def _runs(checkpoints: Iterable[Checkpoint]) -> dict[tuple[str, int], list[Checkpoint]]:
    runs: dict[tuple[str, int], list[Checkpoint]] = defaultdict(list)
    for c in checkpoints:
        if not (math.isfinite(c.kl) and c.kl > 0 and math.isfinite(c.level)):
            raise ValueError(
                f"checkpoint {c.name or (c.method, c.seed)}: KL must be finite and > 0 and the "
                f"level finite (got kl={c.kl}, level={c.level})"
            )
        runs[(c.method, c.seed)].append(c)
    return dict(runs)


def shared_levels(
    checkpoints: Sequence[Checkpoint], direction: str = "higher", n_grid: int | None = None
) -> list[float]:
    """The levels every run reaches (see the module docstring)."""
    if direction not in ("higher", "lower"):
        raise ValueError(f"direction must be 'higher' or 'lower', not {direction!r}")
    runs = _runs(checkpoints)
    if not runs:
        raise ValueError("no checkpoints")
    lowest = max(min(c.level for c in cs) for cs in runs.values())
    highest = min(max(c.level for c in cs) for cs in runs.values())
    # The reachable end is hard: no run may be asked for more than its best. The other end
    # is where levels stop adding information (every checkpoint of some run qualifies); it
    # is clipped to the hard end when the runs' level ranges do not overlap.
    if direction == "higher":
        lo, hi = min(lowest, highest), highest
    else:
        lo, hi = lowest, max(highest, lowest)
    if n_grid is None:
        if not all(float(c.level).is_integer() for c in checkpoints):
            raise ValueError("levels are not integers: pass explicit `levels` or `n_grid`")
        return [float(k) for k in range(int(lo), int(hi) + 1)]
    if n_grid < 1:
        raise ValueError("n_grid must be >= 1")
    if n_grid == 1 or lo == hi:  # one level when the range collapses: repeats would count it n times
        return [lo]
    return [lo + (hi - lo) * i / (n_grid - 1) for i in range(n_grid - 1)] + [hi]  # ends exact


def min_kl_at(run: Sequence[Checkpoint], level: float, direction: str = "higher") -> float:
    """Lowest KL among a run's checkpoints that reach `level`."""
    eligible = [c.kl for c in run if _reaches(c.level, level, direction)]
    if not eligible:
        raise ValueError(f"run {run[0].method}/seed {run[0].seed} has no checkpoint reaching {level}")
    return min(eligible)


def _geomean(values: Iterable[float]) -> float:
    logs = [math.log(v) for v in values]
    return math.exp(sum(logs) / len(logs))


def _favour(ratios: Iterable[float], method: str, baseline: str, tol: float = 1e-12) -> dict[str, int]:
    counts = {method: 0, baseline: 0, "tie": 0}
    for r in ratios:
        counts[method if r < 1 - tol else baseline if r > 1 + tol else "tie"] += 1
    return counts


def matched_comparison(
    checkpoints: Sequence[Checkpoint],
    method: str,
    baseline: str,
    direction: str = "higher",
    levels: Sequence[float] | None = None,
    n_grid: int | None = None,
) -> MatchedComparison:
    """Compare `method` with `baseline` at shared levels (default: every shared integer level)."""
    pair = [c for c in checkpoints if c.method in (method, baseline)]
    runs = _runs(pair)
    seeds = sorted({s for m, s in runs if m == method})
    missing = sorted(set(seeds) ^ {s for m, s in runs if m == baseline})
    if not seeds:
        raise ValueError(f"no checkpoints for method {method!r}")
    if missing:
        raise ValueError(f"seeds {missing} are not present for both {method!r} and {baseline!r}")
    levels = list(levels) if levels is not None else shared_levels(pair, direction, n_grid)
    values = {
        m: {s: [min_kl_at(runs[(m, s)], k, direction) for k in levels] for s in seeds} for m in (method, baseline)
    }
    ratios = {s: [a / b for a, b in zip(values[method][s], values[baseline][s])] for s in seeds}
    seed_ratios = {s: _geomean(r) for s, r in ratios.items()}
    level_ratios = [_geomean(ratios[s][i] for s in seeds) for i in range(len(levels))]
    ratio = _geomean(r for rs in ratios.values() for r in rs)
    return MatchedComparison(
        method,
        baseline,
        direction,
        levels,
        seeds,
        values,
        ratios,
        ratio,
        1 - ratio,
        seed_ratios,
        level_ratios,
        _favour(seed_ratios.values(), method, baseline),
        _favour(level_ratios, method, baseline),
    )


def _fmt_level(k: float) -> str:
    return str(int(k)) if float(k).is_integer() else f"{k:.4g}"


def markdown_table(cmp: MatchedComparison, level_name: str = "solved >= k") -> str:
    """Per level: each method's KL (geometric mean over seeds) and the ratio; then the summary."""
    m, b = cmp.method, cmp.baseline
    lines = [f"| {level_name} | {m} KL | {b} KL | {m}/{b} |", "|---:|---:|---:|---:|"]
    for i, k in enumerate(cmp.levels):
        km = _geomean(cmp.values[m][s][i] for s in cmp.seeds)
        kb = _geomean(cmp.values[b][s][i] for s in cmp.seeds)
        lines.append(f"| {_fmt_level(k)} | {km:.4g} | {kb:.4g} | {cmp.level_ratios[i]:.3f} |")
    lines += [
        "",
        f"Geometric-mean ratio {m}/{b} over {len(cmp.seeds)} seeds x {len(cmp.levels)} levels: "
        f"{cmp.ratio:.3f} (reduction {100 * cmp.reduction:.1f}%).",
        f"Seeds favouring {m}: {cmp.favour_seeds[m]}, {b}: {cmp.favour_seeds[b]}, tie: {cmp.favour_seeds['tie']}. "
        f"Levels favouring {m}: {cmp.favour_levels[m]}, {b}: {cmp.favour_levels[b]}, tie: {cmp.favour_levels['tie']}.",
    ]
    return "\n".join(lines) + "\n"
