"""Charts of benchmark results, written as SVG files that are the same for the same data.

Needs matplotlib (the ``bench`` dependency group). Every chart is drawn with
the ``Agg`` backend, a fixed hash salt and no date in its metadata, so that
running a benchmark again on the same figures rewrites no file.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

matplotlib.rcParams["svg.hashsalt"] = "django-idempotency"

#: Metadata that would differ between two runs on the same data.
_METADATA = {"Date": None}


def line_chart(
    path: Path,
    title: str,
    x_label: str,
    y_label: str,
    series: dict[str, list[tuple[float, float]]],
    *,
    log_y: bool = False,
) -> None:
    """One line per series, each a list of ``(x, y)`` points."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for name, points in series.items():
        axes.plot([x for x, _ in points], [y for _, y in points], label=name, linewidth=1)
    _finish(figure, axes, path, title, x_label, y_label, log_y)


def bar_chart(
    path: Path,
    title: str,
    y_label: str,
    categories: list[str],
    series: dict[str, list[float]],
    *,
    log_y: bool = False,
) -> None:
    """Grouped bars: one group per category, one bar per series in each."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(series), 1)
    for index, (name, values) in enumerate(series.items()):
        positions = [category + index * width for category in range(len(categories))]
        axes.bar(positions, values, width=width, label=name)
    axes.set_xticks([c + width * (len(series) - 1) / 2 for c in range(len(categories))])
    axes.set_xticklabels(categories)
    _finish(figure, axes, path, title, "", y_label, log_y)


def _finish(
    figure: plt.Figure,
    axes: plt.Axes,
    path: Path,
    title: str,
    x_label: str,
    y_label: str,
    log_y: bool,
) -> None:
    axes.set_title(title)
    if x_label:
        axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    if log_y:
        axes.set_yscale("log")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="svg", metadata=_METADATA)
    plt.close(figure)
