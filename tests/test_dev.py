"""``dev.py test`` and the browser tests: Chromium installed, or a failure that names the fix."""

from __future__ import annotations

import os

import pytest

import dev

pytestmark = pytest.mark.skipif(
    os.environ.get("TEST_DATABASE", "sqlite") != "sqlite",
    reason="runs once, in the SQLite run: dev.py does not depend on the database",
)


@pytest.fixture
def no_chromium(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """No Chromium on the machine, and not root: what apt-get would have been asked is kept."""
    monkeypatch.setattr(dev.shutil, "which", lambda name: None)
    monkeypatch.setattr(dev.os, "geteuid", lambda: 1000)
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(dev, "run", lambda *args, **kwargs: ran.append(args) or 0)
    return ran


def test_a_missing_chromium_fails_where_the_browser_tests_must_run(no_chromium):
    with pytest.raises(SystemExit, match="apt-get install chromium"):
        dev.chromium_ready(required=True)
    assert no_chromium == []


def test_a_missing_chromium_elsewhere_is_a_note_naming_the_fix(no_chromium):
    note = dev.chromium_ready(required=False)

    assert note is not None and "skipped" in note and "apt-get install chromium" in note


def test_as_root_apt_get_installs_it(no_chromium, monkeypatch):
    monkeypatch.setattr(dev.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        dev.shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None
    )

    with pytest.raises(SystemExit):
        dev.chromium_ready(required=True)  # still missing afterwards: the install failed

    assert ("apt-get", "install", "-y", "-qq", "chromium") in no_chromium


def test_an_installed_chromium_needs_nothing(monkeypatch):
    monkeypatch.setattr(dev.shutil, "which", lambda name: f"/usr/bin/{name}")

    assert dev.chromium_ready(required=True) is None


def test_a_whole_run_gives_the_galera_tests_a_pytest_and_a_database_of_their_own(monkeypatch):
    monkeypatch.setenv("TEST_DATABASE_NAME", "idem")
    runs = dev._runs_of(["sqlite", "postgresql", "mariadb"], [])

    assert runs == [
        ("sqlite", {"TEST_DATABASE": "sqlite"}, []),
        ("postgresql", {"TEST_DATABASE": "postgresql"}, []),
        ("mariadb", {"TEST_DATABASE": "mariadb"}, ["--ignore=tests/test_galera.py"]),
        (
            "galera",
            {"TEST_DATABASE": "mariadb", "TEST_DATABASE_NAME": "idem_galera"},
            ["tests/test_galera.py"],
        ),
    ]


@pytest.mark.parametrize(
    ("backends", "args"),
    [
        (["sqlite", "mariadb"], ["-k", "claims"]),
        (["sqlite", "postgresql"], []),
        (["sqlite", "postgresql"], ["-k", "claims"]),
    ],
)
def test_a_selection_or_a_run_without_mariadb_is_one_pytest_per_backend(backends, args):
    runs = dev._runs_of(backends, args)

    assert runs == [(backend, {"TEST_DATABASE": backend}, args) for backend in backends]
