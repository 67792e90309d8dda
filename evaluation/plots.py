"""Figures for reports: the KL-vs-target trade-off, churn bars and a line's history, saved as PNG (Agg backend)."""

from __future__ import annotations

import io
import math
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from atlas_core.io import atomic_write_bytes
from atlas_core.paths import state_dir
from evaluation.compare import Checkpoint, min_kl_at

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, never a display), its font cache kept
    with the project's other state rather than in ~/.cache; set up on first use, not at import."""
    os.environ.setdefault("MPLCONFIGDIR", str(state_dir() / "matplotlib"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _frontier(checkpoints: Sequence[Checkpoint], direction: str) -> tuple[list[float], list[float]]:
    """A method's trade-off line: at each of its levels, the geometric mean over seeds of
    each seed's lowest KL reaching that level (seeds that do not reach it are left out)."""
    runs: dict[int, list[Checkpoint]] = defaultdict(list)
    for c in checkpoints:
        runs[c.seed].append(c)
    xs, ys = [], []
    for level in sorted({c.level for c in checkpoints}):
        values = []
        for run in runs.values():
            try:
                values.append(min_kl_at(run, level, direction))
            except ValueError:
                continue
        xs.append(level)
        ys.append(math.exp(sum(math.log(v) for v in values) / len(values)))
    return xs, ys


def _save(fig: Figure, path: str | Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


def tradeoff_plot(
    checkpoints: Sequence[Checkpoint],
    path: str | Path,
    direction: str = "higher",
    level_label: str = "MBPP+ problems solved",
    kl_label: str = "retained KL (nats/token)",
    title: str = "Retained KL vs target score",
    shared: Sequence[float] | None = None,
) -> Path:
    """One line per method (its KL frontier over seeds) plus every checkpoint as a dot.

    `shared`: the matched levels, shaded (one level: a grey line). For direction "lower" the x axis is inverted so
    better is always to the right."""
    by_method: dict[str, list[Checkpoint]] = defaultdict(list)
    for c in checkpoints:
        by_method[c.method].append(c)
    many = len(by_method) > 10  # the default cycle has 10 colours: beyond, 20 colours and a marker per method
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4 if many else 6.4, 4.2))
    for i, (method, cps) in enumerate(sorted(by_method.items())):
        color = plt.get_cmap("tab20")(i % 20) if many else f"C{i}"
        marker = "os^Dv<>PX*"[i % 10] if many else "o"
        ax.scatter([c.level for c in cps], [c.kl for c in cps], s=10, alpha=0.35, color=color, marker=marker)
        xs, ys = _frontier(cps, direction)
        ax.plot(xs, ys, marker=marker, ms=3, color=color, label=method)
    if shared and min(shared) == max(shared):  # a span of zero width would not show
        ax.axvline(shared[0], color="grey", lw=4, alpha=0.3, label="shared level")
    elif shared:
        ax.axvspan(min(shared), max(shared), color="grey", alpha=0.12, label="shared levels")
    ax.set_yscale("log")
    if direction == "lower":
        ax.invert_xaxis()
    ax.set_xlabel(level_label)
    ax.set_ylabel(kl_label)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if many:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend()
    return _save(fig, path)


def churn_bars(
    churn_by_model: Mapping[str, Mapping[str, float]], path: str | Path, title: str = "Answer churn vs reference"
) -> Path:
    """Stacked F / G / W rates (share of questions) per model; `churn_by_model[name]` holds
    at least n, F, G, W (e.g. `flows.compare.Churn.as_dict()`)."""
    names = list(churn_by_model)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(names) + 2), 4.0))
    bottom = [0.0] * len(names)
    for key, label, color in (
        ("F", "F: correct -> wrong", "C3"),
        ("G", "G: wrong -> correct", "C2"),
        ("W", "W: wrong -> other wrong", "C7"),
    ):
        heights = [churn_by_model[n][key] / churn_by_model[n]["n"] for n in names]
        ax.bar(names, heights, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("share of questions")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def history_figure(
    releases: Sequence[str], panels: Sequence[tuple[str, str, Mapping[str, Sequence[float | None]]]]
) -> Figure:
    """A release line across releases t = 0..T: one axis per panel (title, y label, series label ->
    a value per release, None where nothing was measured), so each axis carries one unit only."""
    t = list(range(len(releases)))
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    plt = _pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.8 * rows), squeeze=False)
    for ax, (title, ylabel, series) in zip(axes.flat, panels):
        for label, values in series.items():
            points = [(x, v) for x, v in zip(t, values) if v is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set(xlabel="release t", ylabel=ylabel, title=title)
        ax.set_xticks(t, [f"{x}" for x in t])
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        fig.delaxes(ax)
    fig.tight_layout()
    return fig


def line_history_plot(
    releases: Sequence[str], panels: Sequence[tuple[str, str, Mapping[str, Sequence[float | None]]]], path: str | Path
) -> Path:
    """history.png: `history_figure` saved (the panels of flows.history.LineHistory.panels)."""
    return _save(history_figure(releases, panels), path)
