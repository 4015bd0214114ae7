"""What a release ships: the wheel holds the app and nothing else, the sdist the sources."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from datetime import date
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    os.environ.get("TEST_DATABASE", "sqlite") != "sqlite",
    reason="runs once, in the SQLite run: packaging does not depend on the database",
)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the sdist, then the wheel from it, as a release does."""
    outdir = tmp_path_factory.mktemp("dist")
    completed = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(outdir), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return outdir


def only(outdir: Path, pattern: str) -> Path:
    found = list(outdir.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {outdir}, found {found}"
    return found[0]


def test_wheel_holds_the_app_its_migrations_and_type_marker(dist: Path) -> None:
    with zipfile.ZipFile(only(dist, "*.whl")) as wheel:
        names = set(wheel.namelist())

    assert "django_idempotency/migrations/0001_initial.py" in names
    assert "django_idempotency/py.typed" in names
    templates = "django_idempotency/templates/admin/django_idempotency"
    assert f"{templates}/release_confirmation.html" in names
    assert "django_idempotency/management/commands/purge_idempotency_keys.py" in names
    # What a browser meets: the form tags and the page its errors are rendered from.
    assert "django_idempotency/templatetags/idempotency.py" in names
    assert "django_idempotency/templates/django_idempotency/problem.html" in names
    top_level = {name.split("/")[0] for name in names}
    unexpected = {entry for entry in top_level if entry != "django_idempotency"}
    assert all(entry.endswith(".dist-info") for entry in unexpected), (
        f"the wheel holds more than the app: {sorted(unexpected)}"
    )


def test_wheel_offers_the_user_extras_and_none_of_the_development_groups(dist: Path) -> None:
    with zipfile.ZipFile(only(dist, "*.whl")) as wheel:
        (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        headers = wheel.read(metadata).decode()

    extras = set(re.findall(r"^Provides-Extra: (\S+)$", headers, re.MULTILINE))
    assert extras == {
        "drf",
        "adrf",
        "celery",
        "postgres",
        "psycopg2",
        "mysql",
        "spectacular",
        "tasks",
        "opentelemetry",
        "example",
    }
    # The test, typing, lint and docs tools are dependency groups, which a wheel never carries.
    requires = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)", headers, re.MULTILINE)
    for tool in ("pytest", "mypy", "ruff", "sphinx", "coverage", "hypothesis"):
        assert tool not in requires


def test_sdist_holds_the_readme_license_changelog_docs_and_tests(dist: Path) -> None:
    with tarfile.open(only(dist, "*.tar.gz")) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}

    for required in (
        "README.rst",
        "LICENSE",
        "CHANGELOG.md",
        "pyproject.toml",
        "docs/index.rst",
        "docs/conf.py",
        ".readthedocs.yaml",
        "tests/conftest.py",
        "tests/settings.py",
        "example_project/settings.py",
        "django_idempotency/migrations/0001_initial.py",
    ):
        assert required in names, f"{required} is missing from the sdist"
    assert not any(name.startswith("docs/_build") for name in names)
    assert not any("__pycache__" in name or name.endswith(".sqlite3") for name in names)


def test_version_is_the_newest_dated_changelog_section() -> None:
    declared = re.search(
        r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
    ).group(1)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.+)$", changelog, re.MULTILINE)
    releases = [re.fullmatch(r"(\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})\)", h) for h in headings]

    # An "Unreleased" section may sit on top; every other section is a dated release.
    assert headings[0] == "Unreleased"
    assert all(releases[1:]), f"undated or malformed sections: {headings}"
    versions = [tuple(map(int, r[1].split("."))) for r in releases[1:] if r]
    dates = [date.fromisoformat(r[2]) for r in releases[1:] if r]
    assert releases[1] and releases[1][1] == declared
    assert versions == sorted(versions, reverse=True)
    assert dates == sorted(dates, reverse=True)


def test_last_release_for_dropped_django_is_an_older_release() -> None:
    installation = " ".join((ROOT / "docs" / "installation.rst").read_text().split())
    last = re.search(
        r"The last release of django-idempotency to support it is (\S+?);", installation
    )
    declared = re.search(
        r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
    ).group(1)

    assert last, "installation.rst no longer names the last release for the dropped Django"
    assert last[1] != declared
    assert f"## {last[1]} (" in (ROOT / "CHANGELOG.md").read_text()
