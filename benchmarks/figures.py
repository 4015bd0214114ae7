"""The charts the docs show under the benchmark tables, drawn from the tables' own rows.

Sections keep their figures in :class:`~benchmarks.report.Table` rows, as the
text they print (``"1104 (769-1468)"``). The charts read them back from
there, so a chart shows exactly what its table says, whether it is drawn at
the end of a run or later from the page that run wrote
(``benchmarks/run.py --redraw``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.charts import bar_chart, line_chart
from benchmarks.report import ChartsNotDrawn, Figure, Table, read_rst, write_rst

ROOT = Path(__file__).resolve().parent.parent
#: Where a run that rewrites the docs page writes its charts, and how the page refers to them.
CHART_DIR = ROOT / "docs" / "_static" / "benchmarks"
CHART_URI = "/_static/benchmarks"

#: (file name, alt text, caption) of each chart a section draws.
Drawn = list[tuple[str, str, str]]

#: What each kind of row of sections 2 and 5 is, by the end of its label.
KINDS = {
    "undecorated": "undecorated view",
    "first": "first request",
    "first requests": "first request",
    "replays": "replay",
}
#: How the undecorated row of each framework names it.
FRAMEWORKS = {"plain view": "Django view", "DRF APIView": "DRF view"}
#: Our variants' labels, as a package name beside the peers' names.
OURS = {
    "@idempotent": "django-idempotency\n@idempotent",
    "IdempotentMixin": "django-idempotency\nIdempotentMixin",
}
#: The in-process columns charted, and their names in the legend.
PATHS = {
    "undecorated": "undecorated view",
    "statements alone": "statements alone, no package",
    "first": "first request",
    "replay": "replay",
    "replay from Redis": "replay from the cache (Redis)",
    "replay from locmem": "replay from the cache (locmem)",
}
LOWER = "lower is better"


def is_docs_chart_dir(directory: Path) -> bool:
    """Whether ``directory`` holds the committed charts that the docs page shows."""
    return directory.resolve() == CHART_DIR.resolve()


def publish(
    tables: list[Table],
    facts: list[tuple[str, str]],
    command: str,
    *,
    page: Path | None,
    directories: Sequence[Path],
) -> list[Path]:
    """Write a run's page, then its charts into each of ``directories``; the charts written.

    The page comes first, so that a chart that fails to draw costs the run
    its charts, never its tables; once the docs' own charts are drawn, the
    page is written again with its figures. A failure is raised as
    :class:`ChartsNotDrawn` after every directory was tried.
    """
    if page is not None:
        write_rst(page, facts, command, tables)
    ending = source(command, dict(facts).get("date", "an unknown date"))
    written: list[Path] = []
    failures: list[str] = []
    for directory in dict.fromkeys(directories):
        try:
            written += draw(tables, directory, ending)
        except Exception as error:  # anything drawing raised: the tables are kept either way
            failures.append(f"{directory}: {type(error).__name__}: {error}")
            continue
        if page is not None and is_docs_chart_dir(directory):
            write_rst(page, facts, command, tables)
    if failures:
        kept = (
            f"The tables were written to {page}; once the cause is fixed, draw the charts from "
            "them with python3 benchmarks/run.py --redraw (--charts DIR for another directory)."
            if page is not None
            else "The tables are printed above."
        )
        raise ChartsNotDrawn(f"Charts could not be drawn: {'; '.join(failures)}. {kept}")
    return written


def draw(tables: list[Table], directory: Path, source: str) -> list[Path]:
    """Write the charts of the sections in ``tables`` into ``directory``; the files written.

    When ``directory`` is the docs' own, each charted table also gets its
    figures for the page, their captions ending with ``source`` (the
    command and the date). Sections without charts are left alone.
    """
    in_docs = is_docs_chart_dir(directory)
    written: list[Path] = []
    for table in tables:
        drawer = DRAWERS.get(table.title.split(".", 1)[0])
        if drawer is None:
            continue
        drawn = drawer(table, directory)
        if in_docs:
            table.figures = [
                Figure(f"{CHART_URI}/{name}", alt, f"{caption} {source}")
                for name, alt, caption in drawn
            ]
        written += [directory / name for name, _alt, _caption in drawn]
    return written


def source(command: str, date: str) -> str:
    """The end of every caption: how and when the figures were measured."""
    return f"Measured with ``{command}`` on {date}."


def redraw(page: Path, directory: Path) -> list[Path]:
    """Draw the charts again from the tables of ``page``, a page a full run wrote.

    Nothing is measured. With ``directory`` the docs' own, ``page`` is
    written again with the figures under their tables, and nothing else
    changed.
    """
    command, facts, tables = read_rst(page)
    date = dict(facts).get("date", "an unknown date")
    written = draw(tables, directory, source(command, date))
    if is_docs_chart_dir(directory):
        write_rst(page, facts, command, tables)
    return written


def _median(cell: str) -> float:
    """``"1104 (769-1468)"``, ``"3.4"`` or ``"+1420"`` as the number it starts with."""
    first = cell.split(" ", 1)[0].replace(",", "")
    try:
        return float(first)
    except ValueError:
        raise ValueError(f"{cell!r} does not start with a number") from None


# Section 2: the peers ------------------------------------------------------------


def _peers(table: Table, directory: Path) -> Drawn:
    rate, p50 = table.header.index("req/s"), table.header.index("p50 ms")
    figures: dict[str, dict[str, tuple[float, float]]] = {}
    baseline: tuple[str, tuple[float, float]] | None = None
    for row in table.rows:
        name, _, kind = row[0].rpartition(", ")
        measured = (_median(row[rate]), _median(row[p50]))
        if kind not in KINDS or (baseline is None and kind != "undecorated"):
            raise ValueError(
                f"Row {row[0]!r} of {table.title!r} is not '<variant>, undecorated', "
                "'<variant>, first' or '<variant>, replays' after its undecorated view."
            )
        if kind == "undecorated":
            baseline = (FRAMEWORKS.get(name, name), measured)
            continue
        assert baseline is not None
        package = f"{OURS.get(name, name)}\n({baseline[0]})"
        figures.setdefault(package, {KINDS["undecorated"]: baseline[1]})[KINDS[kind]] = measured
    categories = list(figures)
    kinds = list(dict.fromkeys(KINDS.values()))

    def series(which: int) -> dict[str, list[float]]:
        return {
            kind: [figures[package].get(kind, (math.nan,) * 2)[which] for package in categories]
            for kind in kinds
        }

    throughput, latency = "peers-throughput.svg", "peers-latency.svg"
    bar_chart(
        directory / throughput,
        "Throughput beside the other packages",
        "requests per second (higher is better)",
        categories,
        series(0),
    )
    bar_chart(
        directory / latency,
        "Median latency beside the other packages",
        f"median latency, ms ({LOWER})",
        categories,
        series(1),
    )
    how = (
        "each package's first requests and replays beside the undecorated view of the "
        "framework it needs, served by gunicorn with 4 sync workers on PostgreSQL with "
        "persistent connections; the medians of the table above (django-idempotency-key "
        "answers a replay with 409, its default)."
    )
    return [
        (
            throughput,
            "Bar chart of requests per second for each package: undecorated view, "
            "first request, replay.",
            f"Section 2, requests per second: {how}",
        ),
        (
            latency,
            "Bar chart of median latency in milliseconds for each package: undecorated view, "
            "first request, replay.",
            f"Section 2, median latency: {how}",
        ),
    ]


# Section 6: in one process ---------------------------------------------------------


def _inprocess(table: Table, directory: Path) -> Drawn:
    columns = {name: table.header.index(name) for name in PATHS if name in table.header}
    connections = table.header.index("connections")
    drawn: Drawn = []
    for mode, file_name, connected in (
        ("persistent", "inprocess-persistent.svg", "persistent connections"),
        ("per request", "inprocess-per-request.svg", "a connection per request"),
    ):
        setting = f"{connected} (CONN_MAX_AGE = {600 if mode == 'persistent' else 0})"
        # A database that was not running has "not run: ..." and no figures.
        rows = [
            row
            for row in table.rows
            if row[connections] == mode and not row[columns["undecorated"]].startswith("not run")
        ]
        if not rows:
            continue
        series = {
            PATHS[name]: [math.nan if row[index] == "-" else _median(row[index]) for row in rows]
            for name, index in columns.items()
        }
        series = {
            name: values
            for name, values in series.items()
            if not all(math.isnan(value) for value in values)
        }
        bar_chart(
            directory / file_name,
            f"Per request in one process, {connected}",
            f"microseconds per request ({LOWER})",
            [row[0] for row in rows],
            series,
        )
        baseline = (
            "the undecorated view and the first request's statements sent without the package"
            if "statements alone" in columns
            else "the undecorated view"
        )
        drawn.append(
            (
                file_name,
                f"Bar chart of microseconds per request in one process for each database, "
                f"{setting}: {', '.join(series)}.",
                f"Section 6, {setting}: the same handler through Django's test client, each "
                f"database in a process of its own, {baseline} beside the package's paths; the "
                "medians of the table above.",
            )
        )
    return drawn


# Section 7: behind added latency ----------------------------------------------------


def _latency(table: Table, directory: Path) -> Drawn:
    columns = {name: table.header.index(name) for name in PATHS if name in table.header}
    delays = [_median(row[0]) for row in table.rows]
    series = {
        PATHS[name]: [
            (delay, _median(row[index]))
            for delay, row in zip(delays, table.rows, strict=True)
            if row[index] != "-"
        ]
        for name, index in columns.items()
    }
    file_name = "latency.svg"
    line_chart(
        directory / file_name,
        "Per request behind added latency (PostgreSQL)",
        "added round trip (ms)",
        f"microseconds per request ({LOWER})",
        {name: points for name, points in series.items() if points},
    )
    return [
        (
            file_name,
            "Line chart of microseconds per request against the added round trip in "
            "milliseconds, one line per path.",
            "Section 7: the in-process paths on PostgreSQL with a persistent connection, every "
            "round trip delayed by the relay; the medians of the table above.",
        )
    ]


DRAWERS: dict[str, Callable[[Table, Path], Drawn]] = {
    "2": _peers,
    "6": _inprocess,
    "7": _latency,
}
