#!/usr/bin/env python3
"""Developer entry points that need nothing but Python.

    python3 dev.py serve   # virtualenv, SQLite migrations, example server on :8000
    python3 dev.py walkthrough  # while serve runs: a guided tour over real HTTP
    python3 dev.py test    # the test suite on SQLite, plus PostgreSQL and MariaDB when reachable
    python3 dev.py lint    # ruff, ruff format, mypy, makemigrations --check
    python3 dev.py docs    # build the docs with warnings as errors
    python3 dev.py matrix [ENV ...] [-- PYTEST ARGS]  # tox envs (all of tox.ini by default)

The first run creates ``.venv`` next to this file and installs the project
into it; later runs reuse it. Set ``REQUIRE_BACKENDS=postgresql,mariadb`` to
make an unreachable database server a failure instead of a note (CI does).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import venv
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / ("Scripts" if os.name == "nt" else "bin") / "python"
SERVERS = {"postgresql": ("127.0.0.1", 5432), "mariadb": ("127.0.0.1", 3306)}


def run(*args: str | Path, env: dict[str, str] | None = None, check: bool = True) -> int:
    completed = subprocess.run([str(a) for a in args], cwd=ROOT, env=env)
    if check and completed.returncode != 0:
        sys.exit(completed.returncode)
    return completed.returncode


def prepare_venv(where: Path, name: str, fingerprint: str, install: Callable[[Path], None]) -> Path:
    """The Python of the virtualenv ``where``, made if missing, with ``install`` done for ``name``.

    ``install(python)`` runs again only when ``name``'s ``fingerprint``
    changes: ``where/.installed`` keeps a ``name:fingerprint`` line for each
    name installed. ``benchmarks/run.py`` makes ``.venv-bench`` with this too.
    """
    python = where / PYTHON.relative_to(VENV)
    if not python.exists():
        print(f"Creating a virtualenv in {where.relative_to(ROOT)} ...", flush=True)
        venv.create(where, with_pip=True)
        run(python, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    stamp = where / ".installed"
    lines = stamp.read_text().splitlines() if stamp.exists() else []
    done = dict(line.rpartition(":")[::2] for line in lines)
    if done.get(name) != fingerprint:
        install(python)
        done[name] = fingerprint
        stamp.write_text("".join(f"{key}:{value}\n" for key, value in done.items()))
    return python


def ensure_venv(extras: str, groups: str = "") -> None:
    """Create .venv and install the project with ``extras`` and ``groups`` unless already done.

    Both are comma-separated names: ``extras`` of the project's published
    extras, ``groups`` of the dependency groups in pyproject.toml.
    """
    project = f".[{extras}]" if extras else "."
    group_args = [arg for group in groups.split(",") if group for arg in ("--group", group)]
    name = " ".join([project, *group_args])

    def install(python: Path) -> None:
        print(f"Installing {name} into the virtualenv ...", flush=True)
        # --group needs pip 25.1 or later; a virtualenv made with an older pip gets one.
        run(python, "-m", "pip", "install", "--quiet", "pip>=25.1")
        run(python, "-m", "pip", "install", "--quiet", "-e", project, *group_args)

    # A changed pyproject.toml installs again.
    fingerprint = str((ROOT / "pyproject.toml").stat().st_mtime_ns)
    prepare_venv(VENV, name, fingerprint, install)


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def mysqlclient_ready() -> bool:
    """Install mysqlclient if missing; it compiles, so it needs the MariaDB headers."""
    probe = [str(PYTHON), "-c", "import MySQLdb"]
    if subprocess.run(probe, cwd=ROOT, capture_output=True).returncode == 0:
        return True
    print("Installing mysqlclient for the MariaDB run ...", flush=True)
    code = run(PYTHON, "-m", "pip", "install", "--quiet", "-e", ".[mysql]", check=False)
    return code == 0


#: Debian's package: the browser tests drive it, never a browser Playwright downloads.
CHROMIUM_PACKAGE = "chromium"


def apt_install(package: str, why: str) -> None:
    """``apt-get install package`` when run as root on Debian; nothing elsewhere."""
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"Installing {package} for {why} (apt-get) ...", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run("apt-get", "update", "-qq", env=env, check=False)
        run("apt-get", "install", "-y", "-qq", package, env=env, check=False)


def chromium_ready(required: bool) -> str | None:
    """Install Chromium with apt-get when missing and run as root; a note if it stays missing.

    The browser tests fail without it where they must run (``required``:
    CI, or ``REQUIRE_BACKENDS`` set), so that is a failure here too, named
    before any test runs; elsewhere they are skipped, and the note says so.
    """
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        return None
    apt_install(CHROMIUM_PACKAGE, "the browser tests")
    if shutil.which("chromium"):
        return None
    fix = f"apt-get install {CHROMIUM_PACKAGE} (as root), then run the tests again"
    if required:
        sys.exit(f"Chromium is missing, and the browser tests must run here: {fix}.")
    return f"browser tests: skipped, Chromium is missing ({fix})"


GALERA_LIBRARY = Path("/usr/lib/galera/libgalera_smm.so")


def galera_ready(backends: list[str]) -> tuple[str | None, bool]:
    """Start the three-node Galera cluster for the cluster tests, if it can be.

    Returns a note when the cluster is not there (its tests are then skipped,
    or fail under ``REQUIRE_GALERA=1``), and whether this call started it, so
    that the run stops what it started. Starting needs root and Debian's
    ``galera-4`` and ``mariadb-server``; the nodes use loopback ports of
    their own (``.ci/galera.sh``), never the MariaDB on 3306.
    """
    if "mariadb" not in backends:
        return None, False
    script = ["bash", str(ROOT / ".ci" / "galera.sh")]
    if subprocess.run([*script, "status"], cwd=ROOT, capture_output=True).returncode == 0:
        return None, False
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    if root and GALERA_LIBRARY.exists() and shutil.which("mariadbd"):
        print("Starting a three-node Galera cluster for its tests ...", flush=True)
        if subprocess.run([*script, "start"], cwd=ROOT).returncode == 0:
            return None, True
    return (
        "galera: cluster tests skipped, no cluster (as root, with galera-4 and "
        "mariadb-server installed: .ci/galera.sh start)",
        False,
    )


def serve() -> None:
    ensure_venv("example")
    run(PYTHON, "manage.py", "migrate", "--noinput", "-v", "0")
    print(
        "\nThe example shop is starting on http://127.0.0.1:8000/ (SQLite, no server needed).\n"
        "Try, in another terminal:\n\n"
        "  curl -i -X POST http://127.0.0.1:8000/orders/ -H 'Idempotency-Key: order-1' \\\n"
        "       -H 'Content-Type: application/json' -d '{\"item\": \"book\"}'\n"
        "  # the same command again: same 201, same body, plus Idempotent-Replayed: true\n"
        "  curl -i -X POST http://127.0.0.1:8000/orders/ -H 'Idempotency-Key: order-1' \\\n"
        "       -H 'Content-Type: application/json' -d '{\"item\": \"lamp\"}'\n"
        "  # same key, different body: 422\n"
        "  curl -i -X POST http://127.0.0.1:8000/async-orders/ -H 'Idempotency-Key: order-2' \\\n"
        "       -H 'Content-Type: application/json' -d '{\"item\": \"mug\"}'\n"
        "  # an async view: the same rules\n\n"
        "Or run the guided tour in another terminal: python3 dev.py walkthrough\n"
        "Or open http://127.0.0.1:8000/checkout/ in a browser and double-click Pay: "
        "one order.\n",
        flush=True,
    )
    # An ASGI server, so that the async view is served as production would serve it.
    os.execv(
        str(PYTHON),
        [
            str(PYTHON),
            "-m",
            "uvicorn",
            "example_project.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            "8000",
        ],
    )


def walkthrough(args: list[str]) -> None:
    ensure_venv("example")
    run(PYTHON, "-m", "example_project.walkthrough", *args)


def test(pytest_args: list[str]) -> None:
    ensure_venv("postgres", "test")
    required = {b for b in os.environ.get("REQUIRE_BACKENDS", "").split(",") if b}
    unknown = required - {"sqlite", *SERVERS}
    if unknown:
        sys.exit(f"REQUIRE_BACKENDS names unknown backends: {', '.join(sorted(unknown))}")
    backends = ["sqlite"]
    notes: list[str] = []
    for name, (host, port) in SERVERS.items():
        if not reachable(host, port):
            notes.append(f"{name}: not run, nothing answers on {host}:{port}")
        elif name == "mariadb" and not mysqlclient_ready():
            notes.append("mariadb: not run, mysqlclient could not be built (needs libmariadb-dev)")
        else:
            backends.append(name)
    galera_note, galera_started = galera_ready(backends)
    if galera_note:
        notes.append(galera_note)
    browser_note = chromium_ready(bool(required) or bool(os.environ.get("CI")))
    if browser_note is not None:
        notes.append(browser_note)
    missing = required - set(backends)
    if missing:
        for note in notes:
            print(note, file=sys.stderr)
        sys.exit(f"Required backends not available: {', '.join(sorted(missing))}")
    if len(backends) > 1 and shutil.which("faketime") is None:
        # The clock-fault tests run app servers with a wrong clock beside a
        # right one; without faketime they would not run, and say nothing.
        apt_install("faketime", "the clock-fault tests")
    if len(backends) > 1 and shutil.which("faketime") is None:
        sys.exit(
            "faketime is not installed; the clock-fault tests (tests/test_clocks.py) need it. "
            "Install it: 'apt-get install faketime' (Debian/Ubuntu) or "
            "'brew install libfaketime' (macOS)."
        )

    for stale in ROOT.glob(".coverage*"):
        stale.unlink()
    # One pytest per backend, all at once: most of a run is spent waiting on
    # servers, workers and timeouts, so the backends share the cores well.
    # Each has its own databases (a SQLite file per process, a server's own
    # test database) and its own queues; output is printed per backend.
    started = time.monotonic()
    runs = []
    for backend, settings, args in _runs_of(backends, pytest_args):
        log = ROOT / f".test-{backend}.log"
        env = {**os.environ, **settings}
        with log.open("w") as out:
            process = subprocess.Popen(
                [
                    str(PYTHON),
                    "-m",
                    "coverage",
                    "run",
                    "--parallel-mode",
                    "-m",
                    "pytest",
                    *args,
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        runs.append((backend, process, log))
    ended: dict[str, float] = {}
    while len(ended) < len(runs):
        for backend, process, _ in runs:
            if backend not in ended and process.poll() is not None:
                ended[backend] = time.monotonic() - started
        time.sleep(0.5)
    results: list[tuple[str, int, str, float]] = []
    for backend, process, log in runs:
        output = log.read_text()
        log.unlink()
        print(f"\n=== tests on {backend} ===", flush=True)
        sys.stdout.write(output)
        results.append((backend, process.returncode, _summary_line(output), ended[backend]))

    # Branch coverage of the package, all backends together. The floor
    # (fail_under in pyproject.toml) holds for a whole run on every backend;
    # a selection of tests, or a machine without a database server, is told
    # its figure but not failed for it.
    subprocess.run([str(PYTHON), "-m", "coverage", "combine", "-q"], cwd=ROOT)
    report = subprocess.run([str(PYTHON), "-m", "coverage", "report", "--skip-covered"], cwd=ROOT)
    whole_run = not pytest_args and set(backends) == {"sqlite", *SERVERS}
    coverage_ok = report.returncode == 0 or not whole_run
    print("\n=== summary ===")
    for backend, code, summary, seconds in results:
        verdict = "ok" if code == 0 else f"FAILED (pytest exit {code})"
        print(f"{backend:<11} {verdict:<22} {summary} [{seconds:.0f}s]")
    if report.returncode != 0:
        verdict = "FAILED" if whole_run else "not enforced (a partial run)"
        print(f"coverage    below the floor in pyproject.toml: {verdict}")
    for note in notes:
        print(note)
    # Exit 5 (no tests collected) is a failure here too.
    if galera_started:
        subprocess.run(["bash", str(ROOT / ".ci" / "galera.sh"), "stop"], cwd=ROOT)
    sys.exit(0 if coverage_ok and all(code == 0 for _, code, _, _ in results) else 1)


def _runs_of(
    backends: list[str], pytest_args: list[str]
) -> list[tuple[str, dict[str, str], list[str]]]:
    """Each pytest to start: its name, its settings and its arguments.

    One per backend. In a whole run the Galera cluster's tests, minutes of app servers
    on two nodes, run beside the MariaDB run instead of at its end, under a test
    database name of their own (so a database of their own on the cluster).
    """
    galera = "tests/test_galera.py"
    split = not pytest_args and "mariadb" in backends
    runs = [
        (
            backend,
            {"TEST_DATABASE": backend},
            [f"--ignore={galera}"] if split and backend == "mariadb" else pytest_args,
        )
        for backend in backends
    ]
    if split:
        name = os.environ.get("TEST_DATABASE_NAME", "idempotency")
        settings = {"TEST_DATABASE": "mariadb", "TEST_DATABASE_NAME": f"{name}_galera"}
        runs.append(("galera", settings, [galera]))
    return runs


def _summary_line(output: str) -> str:
    for line in reversed(output.splitlines()):
        if re.search(r"\d+ (passed|failed|errors?|skipped)", line) or "no tests ran" in line:
            return line.strip("= ").strip()
    return "(no pytest summary)"


def _interpreter(groups: str, args: list[str]) -> Path:
    """The Python to run with: ``.venv``'s, or with ``--here`` the one running this script.

    tox's ``lint`` and ``docs`` envs call ``dev.py lint --here`` and
    ``dev.py docs --here`` from their own virtualenvs, so each list of
    commands is written once, here.
    """
    if "--here" in args:
        return Path(sys.executable)
    ensure_venv("", groups)
    return PYTHON


def lint(args: list[str]) -> None:
    python = _interpreter("lint", args)
    run(python, "-m", "ruff", "check", ".")
    run(python, "-m", "ruff", "format", "--check", ".")
    # tests/typed_usage.py: what a type checker tells a user of the decorators.
    run(python, "-m", "mypy", "django_idempotency", "tests/typed_usage.py")
    run(python, "manage.py", "makemigrations", "--check", "--dry-run")


def docs(args: list[str]) -> None:
    python = _interpreter("docs", args)
    run(python, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


def matrix(args: list[str]) -> None:
    """Run tox envs, with every pyenv-installed CPython on PATH for the interpreters.

    ``matrix ENV ... [-- PYTEST ARGS]``: the arguments after ``--`` replace
    the envs' default selection of tests. Each call has a tox work folder of
    its own (``.tox/<envs>``), so that several can run at once.
    """
    envs, pytest_args = (
        (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    )
    ensure_venv("postgres", "test")
    # tox.ini's dependency_groups needs tox 4.22 or later; pip does nothing when it is there.
    run(PYTHON, "-m", "pip", "install", "--quiet", "tox>=4.22")
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    extra_paths = [str(p / "bin") for p in sorted(pyenv.glob("3.*"))] if pyenv.is_dir() else []
    env = {**os.environ, "PATH": os.pathsep.join([*extra_paths, os.environ.get("PATH", "")])}
    selection = ["-e", ",".join(envs)] if envs else []
    workdir = ROOT / ".tox" / ("+".join(envs) or "all")
    # Several envs four side by side (each has its own test databases,
    # tox.ini): most of a run waits on servers and timeouts.
    parallel = ["--parallel", "4", "--parallel-live"] if len(envs) != 1 else []
    tail = ["--", *pytest_args] if pytest_args else []
    run(PYTHON, "-m", "tox", "--workdir", workdir, *parallel, *selection, *tail, env=env)


def main() -> None:
    command, *rest = sys.argv[1:] or ["help"]
    if command == "serve":
        serve()
    elif command == "walkthrough":
        walkthrough(rest)
    elif command == "test":
        test(rest)
    elif command == "lint":
        lint(rest)
    elif command == "docs":
        docs(rest)
    elif command == "matrix":
        matrix(rest)
    else:
        print(__doc__)
        sys.exit(0 if command == "help" else 2)


if __name__ == "__main__":
    main()
