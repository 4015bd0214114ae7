#!/usr/bin/env python3
"""Run every benchmark against PostgreSQL and write the docs table.

    python3 benchmarks/run.py            # the full run (about 30 minutes)
    python3 benchmarks/run.py --quick    # a smoke run (under 5 minutes)
    python3 benchmarks/run.py --only per-request   # one section (repeatable)
    python3 benchmarks/run.py --redraw   # the charts again, from the docs page's tables

Needs a Python 3.10+ and a PostgreSQL server on 127.0.0.1 (settings from
``PGHOST``/``PGPORT``/``PGUSER``/``PGPASSWORD``); the in-process rows also
use MariaDB on 127.0.0.1:3306 (``MYSQL_*``) and Redis on 127.0.0.1:6379
(``BENCH_REDIS_URL``), and drop only their own rows when one is missing. The first run makes
``.venv-bench/`` with the project, its peers and the load tools, so the
peer packages never enter the project's own environment; every later run
re-executes itself inside that virtualenv.

Sections: SQL statements per request, throughput and latency under
gunicorn (persistent connections, then a connection per request with and
without the replay cache), duplicate storms, the purge, async views under
uvicorn, per-request time in one process on each database, and PostgreSQL
behind added latency. Each prints one table; all of
them are written, with the machine and versions they ran on, to
``docs/_generated/benchmarks.rst``, and the charts of the peers and of the
in-process rows to ``docs/_static/benchmarks/`` (``--charts DIR`` writes
the charts of any run into ``DIR``). The page is written before the charts:
a chart that fails to draw ends the run with an error, its tables kept.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-bench"
#: What the bench itself needs. Django stays on 5.2 because drf-idempotency
#: caps it there.
REQUIREMENTS = [
    "Django>=5.2,<5.3",
    "djangorestframework>=3.15",
    "psycopg[binary,pool]>=3.1.8",
    "gunicorn>=22",
    "uvicorn>=0.30",
    "requests>=2.31",
    "py-spy>=0.3",
    "redis>=4.5",
]
#: Drivers for the in-process rows of other databases; one that fails to
#: install drops only its rows.
OPTIONAL = ["mysqlclient>=2.2"]
#: The packages a Django user would pick instead, each installed on its own
#: so that one that fails to install only drops out of the comparison.
PEERS = [
    "django-idempotency-key",
    "drf-idempotency",
    "djangorestframework-idempotency-key",
]


def _in_bench_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def _install(python: Path) -> None:
    from dev import run

    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    print("Installing the project, the load tools and the peer packages ...", flush=True)
    # --group needs pip 25.1 or later; a virtualenv made with an older pip gets one.
    run(*pip, "pip>=25.1")
    # The bench group of pyproject.toml: what the charts are drawn with.
    run(*pip, "-e", f"{ROOT}[drf,postgres]", *REQUIREMENTS, "--group", "bench")
    for optional in OPTIONAL:
        if run(*pip, optional, check=False):
            print(f"  {optional} did not install; its rows are left out.", flush=True)
    for peer in PEERS:
        if run(*pip, peer, check=False):
            print(f"  {peer} did not install; it is left out.", flush=True)


def _bootstrap() -> None:
    """Create or refresh ``.venv-bench`` and re-execute this script inside it.

    The virtualenv is made as ``dev.py`` makes ``.venv``; a hash of the
    requirements skips the pip round trips on later runs.
    """
    from dev import prepare_venv

    # pyproject.toml holds the bench group: a change to it installs again.
    pyproject = (ROOT / "pyproject.toml").read_text()
    listed = "\n".join([*REQUIREMENTS, *OPTIONAL, *PEERS, pyproject])
    wanted = hashlib.sha256(listed.encode()).hexdigest()
    python = prepare_venv(VENV, "bench", wanted, _install)
    os.execv(str(python), [str(python), str(Path(__file__).resolve()), *sys.argv[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument(
        "--no-docs", action="store_true", help="print the tables only; leave the docs file alone"
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="SECTION",
        help="run only this section (repeatable): statements, throughput, storms, "
        "per-request, async, purge, inprocess, latency; the docs file is left alone",
    )
    parser.add_argument(
        "--charts",
        type=Path,
        metavar="DIR",
        help="write the charts of the sections run into DIR (a run that rewrites the docs page "
        "writes them into docs/_static/benchmarks/ in any case; no other run may write there)",
    )
    parser.add_argument(
        "--redraw",
        action="store_true",
        help="run nothing: draw the charts again from the tables of docs/_generated/"
        "benchmarks.rst (into docs/_static/benchmarks/, or DIR of --charts)",
    )
    options = parser.parse_args()
    # The repository root: dev.py, and the benchmarks package inside the virtualenv.
    sys.path.insert(0, str(ROOT))
    if not _in_bench_venv():
        _bootstrap()
    if options.redraw:
        from benchmarks.figures import CHART_DIR, redraw
        from benchmarks.suite import DOCS_TABLE

        for path in redraw(DOCS_TABLE, (options.charts or CHART_DIR).resolve()):
            print(f"Wrote {path}")
        return
    from benchmarks.report import ChartsNotDrawn
    from benchmarks.suite import SECTIONS, UsageError, run_all

    unknown = sorted(set(options.only or ()) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    command = "python3 benchmarks/run.py" + (" --quick" if options.quick else "")
    try:
        run_all(
            quick=options.quick,
            write_docs=not options.no_docs,
            command=command,
            only=options.only or SECTIONS,
            charts=options.charts.resolve() if options.charts else None,
        )
    except UsageError as error:
        parser.error(str(error))
    except ChartsNotDrawn as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
