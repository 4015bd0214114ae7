"""The benchmark charts: valid SVG, the same bytes for the same figures, and true to their tables.

The same bytes hold for one matplotlib version: the committed charts are
compared with their tables by what they say, which another version keeps.
matplotlib is in the ``test`` dependency group (through ``bench``), so these
always run; nothing here is timed.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from benchmarks import figures
from benchmarks.charts import bar_chart, line_chart
from benchmarks.figures import CHART_DIR, CHART_URI, draw, publish, redraw
from benchmarks.report import ChartsNotDrawn, Figure, Table, read_rst, write_rst
from benchmarks.suite import DOCS_TABLE, SECTIONS, UsageError, run_all

ROOT = Path(__file__).resolve().parent.parent
SVG = "{http://www.w3.org/2000/svg}"

BAR = {
    "title": "Throughput beside the other packages",
    "y_label": "requests per second (higher is better)",
    "categories": ["django-idempotency\n@idempotent", "django-idempotency-key"],
    "series": {"undecorated view": [1104.0, 1104.0], "first request": [571.0, math.nan]},
}
LINE = {
    "title": "Per request behind added latency",
    "x_label": "added round trip (ms)",
    "y_label": "microseconds per request",
    "series": {"first request": [(0.0, 4139.0), (0.5, 7289.0), (1.0, 11577.0)]},
}


def texts(path: Path) -> list[str]:
    """Every piece of text the SVG shows, one entry per line of a label."""
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    return [element.text for element in root.iter(f"{SVG}text") if element.text]


def said(path: Path) -> list[str]:
    """What the chart says whatever matplotlib drew it: every text but the tick labels.

    Titles, axis labels, legends and the values on the bars are the
    chart's own words and figures; the ticks (which values the axis marks,
    how a long category is broken) are matplotlib's layout, which a new
    version may change. Sorted: the order the artists are drawn in is
    layout too.
    """

    def walk(element: ET.Element, in_tick: bool) -> list[str]:
        group = element.get("id") or ""
        in_tick = in_tick or group.startswith(("xtick_", "ytick_"))
        own = [element.text] if element.tag == f"{SVG}text" and element.text else []
        if in_tick:
            own = []
        return own + [text for child in element for text in walk(child, in_tick)]

    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    return sorted(walk(root, False))


def section_2() -> Table:
    """A section 2 table as a run makes it."""
    table = Table(
        "2. Throughput and latency (gunicorn, 4 sync workers)",
        ["variant", "req/s", "x undecorated", "p50 ms"],
    )
    table.add("plain view, undecorated", "1104 (769-1468)", "1 (baseline)", "3.4")
    table.add("@idempotent, first requests", "571 (455-628)", "0.55 (0.39-0.64)", "6.8")
    table.add("@idempotent, replays", "1323 (942-1527)", "1.21 (0.90-1.63)", "2.9")
    return table


class ChartTests:
    def test_bar_chart_twice_gives_the_same_valid_svg(self, tmp_path):
        first, second = tmp_path / "first.svg", tmp_path / "second.svg"
        bar_chart(first, **BAR)
        bar_chart(second, **BAR)

        assert first.read_bytes() == second.read_bytes()
        shown = texts(first)
        assert BAR["title"] in shown
        assert BAR["y_label"] in shown
        assert {"django-idempotency", "@idempotent", "undecorated view", "first request"} <= set(
            shown
        )
        # The values written on the bars; the missing one has none.
        assert shown.count("1,104") == 2
        assert "571" in shown
        assert "nan" not in " ".join(shown)

    def test_line_chart_twice_gives_the_same_valid_svg(self, tmp_path):
        first, second = tmp_path / "first.svg", tmp_path / "second.svg"
        line_chart(first, **LINE)
        line_chart(second, **LINE)

        assert first.read_bytes() == second.read_bytes()
        shown = texts(first)
        assert {LINE["title"], LINE["x_label"], LINE["y_label"], "first request"} <= set(shown)

    def test_log_scale_within_one_decade_still_has_labelled_ticks(self, tmp_path):
        path = tmp_path / "chart.svg"
        series = {"batch 5000": [(1e5, 50000.0), (1e6, 61000.0)], "batch 1000": [(1e5, 20000.0)]}
        line_chart(path, **{**LINE, "series": series}, log_y=True)

        assert {"20,000", "50,000", "100,000", "1,000,000"} <= set(texts(path))

    def test_another_process_draws_the_same_bytes(self, tmp_path):
        # What a commit needs: a chart drawn again by another run, with
        # another hash seed, is the same file.
        here = tmp_path / "here.svg"
        there = tmp_path / "there.svg"
        bar_chart(here, **BAR)
        code = (
            "import json, sys; from pathlib import Path; from benchmarks.charts import bar_chart; "
            "bar_chart(Path(sys.argv[1]), **json.loads(sys.argv[2]))"
        )
        env = {**os.environ, "PYTHONHASHSEED": "12345"}
        command = [sys.executable, "-c", code, str(there), json.dumps(BAR)]
        subprocess.run(command, cwd=ROOT, env=env, check=True)

        assert there.read_bytes() == here.read_bytes()

    def test_svg_carries_no_date_and_no_raster(self, tmp_path):
        path = tmp_path / "chart.svg"
        line_chart(path, **LINE)

        svg = path.read_text()
        assert "<dc:date>" not in svg
        assert "<image" not in svg  # text as text, shapes as paths
        assert 'style="fill: #ffffff"' in svg  # a white background in either theme

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"series": {"first request": [571.0]}}, "give one per category"),
            ({"categories": ["a", "a"], "series": {"s": [1.0, 2.0]}}, "must differ"),
            ({"series": {"first request": [0.0, 2.0]}, "log_y": True}, "only positive values"),
            ({"series": {"first request": [math.inf, 2.0]}}, "must be finite"),
            ({"series": {"first request": [math.nan, math.nan]}}, "nothing to draw"),
            ({"title": " "}, "title is empty"),
            ({"file": "chart.png"}, "does not end in .svg"),
        ],
    )
    def test_bad_bar_input_is_refused_and_writes_nothing(self, tmp_path, change, message):
        change = dict(change)
        path = tmp_path / "out" / change.pop("file", "chart.svg")
        arguments = {**BAR, "path": path, **change}

        with pytest.raises(ValueError, match=message):
            bar_chart(**arguments)
        assert not (tmp_path / "out").exists()

    def test_bad_line_input_is_refused_and_writes_nothing(self, tmp_path):
        path = tmp_path / "out" / "chart.svg"

        with pytest.raises(ValueError, match="leave that point out"):
            line_chart(path, **{**LINE, "series": {"first": [(0.0, math.nan)]}})
        with pytest.raises(ValueError, match="has no points"):
            line_chart(path, **{**LINE, "series": {"first": []}})
        assert not path.parent.exists()


#: Charts that ``benchmarks/purge.py`` draws from its own run, not from the results page.
PURGE_CHARTS = {"purge-latency.svg", "purge-rate.svg"}


def page_charts() -> list[Path]:
    return [path for path in CHART_DIR.glob("*.svg") if path.name not in PURGE_CHARTS]


def test_every_committed_chart_is_shown_and_every_chart_shown_is_committed():
    docs = Path(__file__).resolve().parent.parent / "docs"
    shown = {
        name
        for page in docs.glob("*.rst")
        for name in re.findall(r"_static/benchmarks/([\w.-]+\.svg)", page.read_text())
    }
    generated = DOCS_TABLE.read_text()
    shown |= set(re.findall(r"benchmarks/([\w.-]+\.svg)", generated))

    assert shown == {path.name for path in CHART_DIR.glob("*.svg")}
    assert shown >= PURGE_CHARTS


class PageFiguresTests:
    """The charts drawn from the tables of the page the last full run wrote."""

    def test_page_reads_back_as_written(self, tmp_path):
        command, facts, tables = read_rst(DOCS_TABLE)
        copy = tmp_path / "benchmarks.rst"
        write_rst(copy, facts, command, tables)

        assert copy.read_bytes() == DOCS_TABLE.read_bytes()

    def test_each_figure_of_the_page_is_a_committed_chart(self):
        _command, _facts, tables = read_rst(DOCS_TABLE)
        uris = {figure.uri for table in tables for figure in table.figures}

        assert uris == {f"{CHART_URI}/{path.name}" for path in page_charts()}
        assert {
            f"{CHART_URI}/{name}" for name in ("peers-throughput.svg", "inprocess-persistent.svg")
        } <= uris

    def test_committed_charts_show_the_page_tables(self, tmp_path):
        # Drawn again from the tables, each chart says what the committed one
        # says: its title, labels, legend and every value on its bars. Not
        # its ticks, which another matplotlib version may place elsewhere.
        written = redraw(DOCS_TABLE, tmp_path)

        assert {path.name for path in written} == {path.name for path in page_charts()}
        for path in written:
            assert said(path) == said(CHART_DIR / path.name), path.name

    def test_what_a_chart_says_leaves_out_its_ticks_and_nothing_else(self, tmp_path):
        committed = CHART_DIR / "peers-throughput.svg"
        svg = committed.read_text()
        # Ticks another version might place (1,500 for 1,400), and a changed bar value.
        other_ticks = tmp_path / "other-ticks.svg"
        other_ticks.write_text(svg.replace(">1,400<", ">1,500<").replace(">(DRF view)<", ">x<"))
        other_value = tmp_path / "other-value.svg"
        other_value.write_text(svg.replace(">571<", ">572<"))
        assert other_ticks.read_text() != svg and other_value.read_text() != svg

        assert said(other_ticks) == said(committed)
        assert said(other_value) != said(committed)
        assert {"Throughput beside the other packages", "replay", "571"} <= set(said(committed))
        assert "1,400" not in said(committed)

    def test_charts_outside_the_docs_leave_the_tables_without_figures(self, tmp_path):
        table = section_2()
        table.figures = [Figure("/_static/old.svg", "old", "old")]
        other = Table("3. Duplicate storms", ["variant"])

        written = draw([table, other], tmp_path, "Measured with ``x`` on a day.")

        assert [path.name for path in written] == ["peers-throughput.svg", "peers-latency.svg"]
        assert table.figures == [Figure("/_static/old.svg", "old", "old")]
        assert "571" in texts(tmp_path / "peers-throughput.svg")

    def test_row_of_unknown_shape_is_refused(self, tmp_path):
        table = Table("2. Throughput", ["variant", "req/s", "p50 ms"])
        table.add("@idempotent, first requests", "571", "6.8")

        with pytest.raises(ValueError, match="after its undecorated view"):
            draw([table], tmp_path, "")


FACTS = [("date", "2026-12-20"), ("Python", "3.12.8")]


class PublishTests:
    """A run's page and charts: the tables are kept whatever the charts do."""

    def test_a_chart_that_fails_keeps_the_page_and_says_how_to_redraw(self, tmp_path):
        broken = Table("2. Throughput", ["variant", "req/s", "p50 ms"])
        broken.add("@idempotent, first requests", "571", "6.8")
        storms = Table("3. Duplicate storms", ["variant", "runs"])
        storms.add("@idempotent", "1")
        page = tmp_path / "benchmarks.rst"

        with pytest.raises(ChartsNotDrawn, match=r"--redraw") as raised:
            publish([broken, storms], FACTS, "cmd", page=page, directories=[tmp_path / "charts"])

        assert "after its undecorated view" in str(raised.value)
        assert str(page) in str(raised.value)
        command, facts, tables = read_rst(page)
        assert (command, facts) == ("cmd", FACTS)
        assert [(table.title, table.rows) for table in tables] == [
            ("2. Throughput", [["@idempotent, first requests", "571", "6.8"]]),
            ("3. Duplicate storms", [["@idempotent", "1"]]),
        ]

    def test_the_docs_charts_are_drawn_into_the_page_once_drawn(self, tmp_path, monkeypatch):
        docs_charts = tmp_path / "_static" / "benchmarks"
        monkeypatch.setattr(figures, "CHART_DIR", docs_charts)
        page = tmp_path / "benchmarks.rst"
        elsewhere = tmp_path / "elsewhere"

        written = publish(
            [section_2()], FACTS, "cmd", page=page, directories=[elsewhere, docs_charts]
        )

        assert sorted(path.relative_to(tmp_path).as_posix() for path in written) == [
            "_static/benchmarks/peers-latency.svg",
            "_static/benchmarks/peers-throughput.svg",
            "elsewhere/peers-latency.svg",
            "elsewhere/peers-throughput.svg",
        ]
        (table,) = read_rst(page)[2]
        assert [figure.uri for figure in table.figures] == [
            f"{CHART_URI}/peers-throughput.svg",
            f"{CHART_URI}/peers-latency.svg",
        ]
        assert all(figure.caption.endswith("``cmd`` on 2026-12-20.") for figure in table.figures)


class DocsChartsRefusedTests:
    """``--charts docs/_static/benchmarks`` only with the page: else they disagree."""

    @pytest.mark.parametrize(
        ("write_docs", "only"),
        [(True, ("inprocess",)), (False, SECTIONS)],
        ids=["only-a-section", "no-docs"],
    )
    def test_the_docs_chart_directory_without_the_page_is_refused(self, write_docs, only):
        committed = {path: path.read_bytes() for path in CHART_DIR.glob("*.svg")}
        relative = Path(os.path.relpath(CHART_DIR))

        with pytest.raises(UsageError, match="Give --charts another directory") as raised:
            run_all(
                quick=True,
                write_docs=write_docs,
                command="cmd",
                only=only,
                charts=relative,
            )

        assert "docs/_generated/benchmarks.rst" in str(raised.value)
        assert {path: path.read_bytes() for path in CHART_DIR.glob("*.svg")} == committed
