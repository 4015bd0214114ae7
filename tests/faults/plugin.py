"""Session-wide hooks of the fault suite: scale, SQLite skip, the report table.

Loaded from ``tests/conftest.py`` rather than ``tests/faults/conftest.py``
because pytest only honours command-line options registered by the first
conftests it loads, and because under pytest-xdist the controller, which
prints the summary, never imports the conftests of the workers' test
directories.

Scale: ``FAULTS_SCALE=full|ci`` decides. Without it, the suite runs at full
scale when every path on the command line is inside ``tests/faults`` (or
``--faults-full`` is given), and at CI scale inside the whole test suite.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.settings import BACKEND

SCALE_ENV = "FAULTS_SCALE"
FAULTS_DIR = Path(__file__).resolve().parent
ROOT = FAULTS_DIR.parent.parent
REPORT_PATH = ROOT / "docs" / "_generated" / "reliability.rst"
ROW_PROPERTY = "faults_row"
SQLITE_REASON = (
    "the fault suite needs a database server whose connections can be killed and "
    "which can be restarted (PostgreSQL, MariaDB); SQLite is embedded in the process"
)
COLUMNS = (
    ("scenario", "scenario"),
    ("requests", "requests sent"),
    ("faults", "faults injected"),
    ("keys", "keys"),
    ("effects", "effects"),
    ("duplicates", "duplicates"),
    ("lost", "lost"),
    ("server_errors", "5xx"),
)
BACKEND_TITLES = {"postgresql": "PostgreSQL", "mariadb": "MariaDB"}

_rows_key = pytest.StashKey[list[dict[str, Any]]]()


@dataclass(frozen=True)
class Row:
    """One scenario's line in the report."""

    scenario: str
    requests: int
    faults: int
    keys: int
    effects: int
    duplicates: int
    lost: int
    server_errors: int


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("faults", "fault suite (tests/faults)")
    group.addoption(
        "--faults-full",
        action="store_true",
        help="run the fault suite at full scale even inside the whole test suite",
    )
    group.addoption(
        "--faults-report",
        action="store_true",
        help=f"write {REPORT_PATH.relative_to(ROOT)} even at CI scale",
    )


def scale() -> str:
    return os.environ.get(SCALE_ENV, "ci")


def _only_faults(args: list[str]) -> bool:
    paths = [Path(arg.split("::", 1)[0]).resolve() for arg in args if not arg.startswith("-")]
    return bool(paths) and all(path.is_relative_to(FAULTS_DIR) for path in paths)


_config: pytest.Config


def pytest_configure(config: pytest.Config) -> None:
    # pytest_runtest_logreport is not handed the config; keep it for the rows.
    global _config
    _config = config
    config.stash[_rows_key] = []
    if hasattr(config, "workerinput"):
        return  # an xdist worker inherits the controller's decision through the environment
    chosen = os.environ.get(SCALE_ENV)
    if chosen is None:
        full = config.getoption("faults_full") or _only_faults(config.args)
        chosen = "full" if full else "ci"
    if chosen not in ("full", "ci"):
        raise pytest.UsageError(f"{SCALE_ENV} must be 'full' or 'ci', not {chosen!r}")
    os.environ[SCALE_ENV] = chosen


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if BACKEND != "sqlite":
        return
    skip = pytest.mark.skip(reason=SQLITE_REASON)
    for item in items:
        if item.path.is_relative_to(FAULTS_DIR):
            item.add_marker(skip)


def record_row(node: pytest.Item, row: Row) -> None:
    """Attach a row to the test's report; xdist carries it back to the controller."""
    node.user_properties.append((ROW_PROPERTY, json.dumps(asdict(row))))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call":
        return
    for name, value in report.user_properties:
        if name == ROW_PROPERTY:
            _config.stash[_rows_key].append(json.loads(value))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    rows = config.stash.get(_rows_key, [])
    if not rows:
        return
    terminalreporter.section(f"fault suite on {BACKEND}, {scale()} scale")
    for line in plain_table(rows):
        terminalreporter.write_line(line)
    if scale() == "full" or config.getoption("faults_report"):
        write_report(rows)
        terminalreporter.write_line(f"written to {REPORT_PATH.relative_to(ROOT)}")


def _cells(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [[title for _, title in COLUMNS]] + [
        [str(row[name]) for name, _ in COLUMNS] for row in rows
    ]


def plain_table(rows: list[dict[str, Any]]) -> list[str]:
    cells = _cells(rows)
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]

    def line(values: list[str]) -> str:
        first = values[0].ljust(widths[0])
        return "  ".join(
            [first, *(v.rjust(w) for v, w in zip(values[1:], widths[1:], strict=True))]
        )

    return [line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])]


def rst_table(rows: list[dict[str, Any]]) -> list[str]:
    """A reStructuredText simple table of the rows."""
    cells = _cells(rows)
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    rule = "  ".join("=" * w for w in widths)

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    return [rule, line(cells[0]), rule, *map(line, cells[1:]), rule]


SCENARIOS_RST = """\
What each scenario proves
~~~~~~~~~~~~~~~~~~~~~~~~~

Every scenario drives a real gunicorn (four sync workers) over HTTP with a
client that retries like a production one: a timeout per attempt, retries
with the same key, exponential backoff with full jitter, ``Retry-After``
honoured, and a retry budget shared by all its threads. After each scenario
the suite checks, row by row in the database, that every key the client saw
succeed has exactly one effect, that every success for a key carries that
same effect, and that once the client's retries are over every key has
exactly one effect: no duplicates, nothing lost.

load with duplicates
    Ten concurrent copies of every key, spread over four worker processes:
    the unique constraint, not process memory, decides who runs the handler;
    the other nine wait for it and replay its response.
worker crashes (atomic, lease)
    Workers are killed with ``SIGKILL`` at random during the load. In atomic
    mode the database rolls back the dead worker's effect with its claim, so
    the retry runs the handler once more, once. In lease mode the claim
    outlives the worker until its 2-second lease runs out; the retry then
    takes the key over, and the remote effect, keyed by
    ``request.idempotency.derive()``, is not repeated.
database connections killed
    The server's database connections are terminated mid-handler
    (``pg_terminate_backend``, MariaDB ``KILL``). The client sees an error,
    retries, and the half-done transaction left nothing behind; the workers
    reconnect on their own.
database restart
    The database server is stopped and started in the middle of the load.
    Requests fail while it is down; workers with persistent connections
    notice the dead connection through ``CONN_HEALTH_CHECKS`` and reconnect,
    and the service recovers without a restart of its own.
client timeouts (atomic, lease)
    The client gives up on each attempt long before the handler finishes.
    The original still completes; its retries get a ``409`` with
    ``Retry-After`` while it runs, then its stored response.
hostile input
    Random and invalid keys (non-ASCII, invalid UTF-8, control characters,
    over-long, huge headers), invalid-UTF-8 and deeply nested bodies, bodies
    over the stored-body limit, one key sent concurrently with different
    bodies, and one key sent from several scopes. Nothing is answered with a
    ``5xx``, no record is stored for a rejected request, and no scope ever
    receives another scope's response.
"""


def write_report(rows: list[dict[str, Any]]) -> None:
    """Rewrite this backend's section of the report, keeping the other backends' sections."""
    sections = {}
    if REPORT_PATH.exists():
        pattern = re.compile(r"^\.\. faults-backend: (\w+)\n(.*?)^\.\. faults-end\n", re.M | re.S)
        sections = {m.group(1): m.group(0) for m in pattern.finditer(REPORT_PATH.read_text())}
    title = BACKEND_TITLES.get(BACKEND, BACKEND)
    sections[BACKEND] = "\n".join(
        [
            f".. faults-backend: {BACKEND}",
            "",
            title,
            "~" * len(title),
            "",
            *rst_table(rows),
            "",
            ".. faults-end",
            "",
        ]
    )
    order = [name for name in BACKEND_TITLES if name in sections]
    order += sorted(set(sections) - set(order))
    text = "\n".join(
        [
            ".. Generated by the fault suite:",
            "   FAULTS_DB_RESTART=1 pytest tests/faults -m faults -n 1",
            "   (TEST_DATABASE=postgresql, then mariadb). Do not edit by hand.",
            "",
            SCENARIOS_RST,
            *(sections[name] for name in order),
        ]
    )
    REPORT_PATH.parent.mkdir(parents=True, exist_ok=True)
    REPORT_PATH.write_text(text.rstrip("\n") + "\n")
