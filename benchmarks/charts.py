"""SVG charts of benchmark figures, for the docs to commit.

Only the benchmark command and the tests import this module: matplotlib is in
the ``bench`` and ``test`` dependency groups, never a dependency of the
package. With one matplotlib version, the same input gives the same bytes (no
date, a fixed hash salt for the ids, text kept as text), so drawing a chart
again from the same figures leaves nothing to commit. Another version may
lay the same chart out differently (its ticks, paths and ids), so after an
upgrade the charts differ in bytes though not in what they say: their
titles, legends and the values on their bars. Charts have a white background and dark text, which
reads the same in the docs' light and dark themes.

Nothing here uses pyplot: each chart is a :class:`~matplotlib.figure.Figure`
of its own, saved by the SVG backend, so no global backend or figure state
is involved.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator

__all__ = ["bar_chart", "line_chart"]

INK = "#1f2328"
GRID = "#d0d7de"
#: Okabe and Ito's palette, told apart with most forms of colour blindness.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]
#: Typed loosely: matplotlib's stubs spell every rcParams name out as a Literal.
STYLE: dict[Any, Any] = {
    # The same ids in every file drawn from the same input.
    "svg.hashsalt": "django-idempotency-benchmarks",
    # Text as <text> elements: small files, and searchable, selectable labels.
    "svg.fonttype": "none",
    # Layout is measured with DejaVu Sans, which matplotlib ships; browsers
    # without it fall back to the next ones.
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Verdana", "Arial", "Helvetica"],
    "font.size": 10,
    "axes.titlesize": 12,
    "axes.titleweight": "bold",
    "figure.facecolor": "white",
    "axes.facecolor": "white",
    "savefig.facecolor": "white",
    "savefig.edgecolor": "white",
    "text.color": INK,
    "axes.labelcolor": INK,
    "axes.edgecolor": INK,
    "xtick.color": INK,
    "ytick.color": INK,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.grid.axis": "y",
    "axes.axisbelow": True,
    "grid.color": GRID,
    "grid.linewidth": 0.8,
    "legend.frameon": False,
}
#: A chart's width in inches: the docs show it at the width of the text (about 7.5
#: inches), so a wider one would shrink its lettering.
MIN_INCHES, MAX_INCHES = 6.4, 8.5
#: The width of one bar, and of one character of a category's label (8.5 pt), in inches.
BAR_INCHES, CHAR_INCHES = 0.3, 0.075
#: The most bars that still have room for their value written on them.
MAX_LABELLED_BARS = 20
#: A line chart measured at this many settings or fewer has a tick at each.
MAX_X_TICKS = 10
#: The width of one character of the legend (10 pt), in inches, with some to spare.
LEGEND_CHAR_INCHES = 0.085


def line_chart(
    path: Path,
    title: str,
    x_label: str,
    y_label: str,
    series: dict[str, list[tuple[float, float]]],
    *,
    log_y: bool = False,
) -> None:
    """Write an SVG line chart of ``series``: one line of ``(x, y)`` points per name.

    For a figure measured at several settings (rows, a delay, a batch size),
    where the trend matters more than any one point. Labels carry their
    units, such as ``"added round trip (ms)"``.
    """
    path = _svg_path(path)
    _text(title=title, x_label=x_label, y_label=y_label)
    if not series:
        raise ValueError("line_chart() needs at least one series: {name: [(x, y), ...]}.")
    for name, points in series.items():
        _text(**{"series name": name})
        if not points:
            raise ValueError(f"Series {name!r} has no points; leave it out or give (x, y) pairs.")
        for point in points:
            if len(point) != 2:
                raise ValueError(f"Series {name!r} has {point!r}; each point is one (x, y) pair.")
        _finite(f"series {name!r}", [value for point in points for value in point], log_y, 1)

    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(7.0, 4.2), layout="constrained")
        axes = figure.add_subplot()
        for number, (name, points) in enumerate(series.items()):
            xs, ys = zip(*sorted(points), strict=True)
            axes.plot(
                xs,
                ys,
                label=name,
                color=PALETTE[number % len(PALETTE)],
                marker=MARKERS[number % len(MARKERS)],
                linewidth=1.8,
                markersize=5,
            )
        axes.grid(True, axis="x")
        settings = sorted({x for points in series.values() for x, _y in points})
        if len(settings) <= MAX_X_TICKS:  # a tick at each setting measured
            axes.set_xticks(settings)
        if not log_y and all(y >= 0 for points in series.values() for _x, y in points):
            axes.set_ylim(bottom=0)
        _finish(figure, axes, title, y_label, len(series), log_y)
        axes.set_xlabel(x_label)
        axes.xaxis.set_major_formatter(FuncFormatter(_number))
        _save(figure, path, title)


def bar_chart(
    path: Path,
    title: str,
    y_label: str,
    categories: list[str],
    series: dict[str, list[float]],
    *,
    log_y: bool = False,
) -> None:
    """Write an SVG chart of grouped bars: one group per category, one bar per series.

    Each series has one value per category, in order; ``math.nan`` leaves
    that bar out (a figure that was not measured there). Each bar has its
    value written on it while the chart has few enough bars to read them.
    """
    path = _svg_path(path)
    _text(title=title, y_label=y_label)
    if not categories:
        raise ValueError("bar_chart() needs at least one category.")
    for category in categories:
        _text(category=category)
    if len(set(categories)) != len(categories):
        raise ValueError(f"Categories must differ from each other; got {categories!r}.")
    if not series:
        raise ValueError("bar_chart() needs at least one series: {name: [one value per category]}.")
    for name, values in series.items():
        _text(**{"series name": name})
        if len(values) != len(categories):
            raise ValueError(
                f"Series {name!r} has {len(values)} values for {len(categories)} categories; "
                "give one per category, math.nan where there is none."
            )
        _finite(f"series {name!r}", values, log_y, 0)
    if all(math.isnan(value) for values in series.values() for value in values):
        raise ValueError("Every value is math.nan: there is nothing to draw.")

    bars = len(categories) * len(series)
    group = 0.8  # of the space between two categories
    width = group / len(series)
    labels = [_wrap(category) for category in categories]
    longest = max(len(line) for label in labels for line in label.splitlines())
    per_category = max(len(series) * BAR_INCHES / group, longest * CHAR_INCHES + 0.15)
    inches = min(MAX_INCHES, max(MIN_INCHES, 1.0 + len(categories) * per_category))
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(inches, 4.6), layout="constrained")
        axes = figure.add_subplot()
        for number, (name, values) in enumerate(series.items()):
            offset = (number - (len(series) - 1) / 2) * width
            xs = [index + offset for index, value in enumerate(values) if not math.isnan(value)]
            heights = [value for value in values if not math.isnan(value)]
            drawn = axes.bar(
                xs, heights, width * 0.92, label=name, color=PALETTE[number % len(PALETTE)]
            )
            if bars <= MAX_LABELLED_BARS:
                axes.bar_label(
                    drawn, labels=[_number(value) for value in heights], padding=2, fontsize=7
                )
        axes.set_xticks(range(len(categories)), labels)
        axes.tick_params(axis="x", length=0, labelsize=8.5)
        axes.set_xlim(-0.6, len(categories) - 0.4)
        _finish(figure, axes, title, y_label, len(series), log_y)
        if not log_y:
            axes.margins(y=0.12)  # room for the values written above the bars
        _save(figure, path, title)


# Drawing --------------------------------------------------------------------------


def _finish(figure: Figure, axes: Axes, title: str, y_label: str, names: int, log_y: bool) -> None:
    axes.set_title(title, loc="left", pad=10)
    axes.set_ylabel(y_label)
    if log_y:
        axes.set_yscale("log")
        # 1, 2 and 5 of each power of ten: figures within one decade get ticks too.
        axes.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes.yaxis.set_major_formatter(FuncFormatter(_number))
    axes.yaxis.set_minor_formatter(FuncFormatter(lambda value, _position: ""))
    # As many columns as fit across the chart, at most three.
    longest = max(len(str(label)) for label in axes.get_legend_handles_labels()[1])
    fit = int(figure.get_figwidth() // (longest * LEGEND_CHAR_INCHES + 0.6))
    figure.legend(loc="outside lower center", ncols=max(1, min(names, 3, fit)))


def _save(figure: Figure, path: Path, title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No date and no matplotlib version: a redraw on another day or machine
    # with the same figures changes nothing.
    metadata = {"Date": None, "Creator": None, "Title": title}
    figure.savefig(path, format="svg", metadata=metadata)


def _number(value: float, _position: object = None) -> str:
    """``1234.5`` as ``1,234``, ``0.55`` as ``0.55``: what the tables show."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}".removesuffix(".0")
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _wrap(label: str) -> str:
    return "\n".join(
        "\n".join(textwrap.wrap(line, 18, break_long_words=False)) or line
        for line in label.splitlines()
    )


# Checking the input before anything is drawn or written ----------------------------


def _svg_path(path: Path) -> Path:
    path = Path(path)
    if path.suffix != ".svg":
        raise ValueError(f"{path} does not end in .svg; these charts are SVG files.")
    return path


def _text(**labels: str) -> None:
    for what, text in labels.items():
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"The {what.replace('_', ' ')} is empty; give it words (and units).")


def _finite(what: str, values: Iterable[float], log_y: bool, y_step: int) -> None:
    """Refuse infinities and non-numbers (``nan`` too, except as a missing bar).

    ``y_step`` is 1 where every other value is a y (points), 0 where each is
    (bars); only those must be positive on a log scale.
    """
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"The {what} has {value!r}; every value must be a number.")
        if math.isnan(value):
            if y_step:
                raise ValueError(f"The {what} has nan; leave that point out instead.")
            continue
        if math.isinf(value):
            raise ValueError(f"The {what} has {value}; every value must be finite.")
        is_y = not y_step or index % 2 == y_step
        if log_y and is_y and value <= 0:
            raise ValueError(
                f"The {what} has {value!r} on a log scale; only positive values can be drawn "
                "there (pass log_y=False)."
            )
