"""Promises the documentation makes about the project itself, held to the project."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from example_project import walkthrough

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def section(text: str, heading: str) -> str:
    """The body of the reStructuredText section titled ``heading``."""
    match = re.search(
        rf"^{re.escape(heading)}\n[-=^]+\n(.*?)(?=^\S[^\n]*\n[-=^]+\n|\Z)", text, re.M | re.S
    )
    assert match, f"no section {heading!r}"
    return match.group(1)


class ExamplePageTests:
    page = (DOCS / "example.rst").read_text()

    def test_transcript_shows_the_walkthrough_steps_in_order(self):
        transcript = section(self.page, "A walkthrough transcript")
        run = re.search(r"\(run (\w+)\)", transcript).group(1)
        shown = re.findall(r"^    (\d+)\. (.+)$", transcript, re.M)

        expected = [
            (str(number), title.format(run=run))
            for number, title in enumerate(walkthrough.STEPS.values(), start=1)
        ]
        assert shown == expected

    def test_what_it_shows_labels_each_step_once_in_order(self):
        bullets = re.findall(r"^\* (Steps? [^:]+):", self.page, re.M)
        covered: list[int] = []
        for label in bullets:
            if span := re.fullmatch(r"Steps (\d+) to (\d+)", label):
                covered += range(int(span[1]), int(span[2]) + 1)
            else:
                covered.append(int(re.fullmatch(r"Step (\d+)", label)[1]))

        assert covered == list(range(1, len(walkthrough.STEPS) + 1)), bullets

    def test_receipt_bullet_is_the_receipt_step(self):
        number = list(walkthrough.STEPS).index("receipt") + 1
        bullet = re.search(rf"^\* Step {number}: (.*?)(?=^\* |^\S)", self.page, re.M | re.S)

        assert bullet and "Celery worker" in bullet[1]


class InstallationPageTests:
    page = " ".join((DOCS / "installation.rst").read_text().split())

    def test_says_how_an_editable_install_keeps_mypy_working(self):
        assert "--config-settings editable_mode=compat" in self.page
        assert "[import-not-found]" in self.page
        assert "plain (non-editable) install" in self.page

    def test_celery_extra_is_what_idempotent_task_needs_and_brings_no_broker_client(self):
        pyproject = (ROOT / "pyproject.toml").read_text()
        extra = re.search(r"^celery = (\[.*\])$", pyproject, re.MULTILINE)
        # What the page says of the extra is what the extra is: Celery, no broker client.
        assert extra and ast.literal_eval(extra[1]) == ["celery>=5.3"]
        assert ":func:`~django_idempotency.tasks.idempotent_task`" in self.page
        assert "without a broker client" in self.page
        assert '"celery[redis]"' in self.page


@pytest.mark.parametrize("page", ["quickstart.rst", "installation.rst"])
def test_page_points_browsers_at_the_cors_settings(page):
    text = (DOCS / page).read_text()

    assert ":ref:`Browsers and CORS <cors>`" in text
    assert ".. _cors:\n\nBrowsers and CORS\n" in (DOCS / "http.rst").read_text()


def test_read_the_docs_builds_docs_conf_py_with_the_docs_group_and_fails_on_warnings():
    import yaml

    config = yaml.safe_load((ROOT / ".readthedocs.yaml").read_text())

    assert config["version"] == 2
    assert config["sphinx"] == {"configuration": "docs/conf.py", "fail_on_warning": True}
    assert (ROOT / config["sphinx"]["configuration"]).is_file()
    (install,) = config["python"]["install"]
    assert install == {"method": "pip", "path": "."}
    # The config file has no key for a dependency group: pip installs it, after the package.
    assert config["build"]["jobs"]["post_install"] == [
        'python -m pip install "pip>=25.1"',
        "python -m pip install --group docs",
    ]
    groups = (ROOT / "pyproject.toml").read_text().split("\n[dependency-groups]\n", 1)[1]
    assert re.search(r"^docs = \[", groups.split("\n[", 1)[0], re.MULTILINE)
    python = config["build"]["tools"]["python"]
    classifiers = (ROOT / "pyproject.toml").read_text()
    assert f'"Programming Language :: Python :: {python}"' in classifiers


def test_installation_page_warns_that_pip_upgrades_django_and_shows_a_pin():
    page = " ".join((DOCS / "installation.rst").read_text().split())

    assert "would therefore *upgrade Django*" in page
    assert 'python -m pip install django-idempotency "Django~=5.2.0"' in page


def test_migrating_page_knows_the_middleware():
    page = (DOCS / "migrating.rst").read_text()

    assert "django-idempotency has none" not in page
    assert "IdempotencyMiddleware" in page


def test_the_development_status_is_beta():
    # 0.x, with public names still being added: the API may grow, the contract holds.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'"Development Status :: [^"]+"', pyproject) == [
        '"Development Status :: 4 - Beta"'
    ]


#: Names 0.2.0's modules let projects import that this release removed,
#: each of which the changelog's "Removed" section must name with its replacement.
REMOVED_SINCE_0_2_0 = {
    "django_idempotency.middleware": ["VIEW_PROTECTORS", "is_exempt", "protects_itself"],
    "django_idempotency.decorators": ["PLACEMENT_CHECKS", "PLACEMENT_ADAPTERS"],
    "django_idempotency.store": ["prepare_connection", "retrying", "claiming"],
    "django_idempotency.fields": ["fit_key_column"],
    "django_idempotency.drf": [
        "ATTRIBUTE_PREFIX",
        "EXEMPT_ATTRIBUTE",
        "OPTION_NAMES",
        "decorated_options",
        "error_response",
        "finish",
        "guard",
        "handler_chain",
        "handler_name",
        "handler_options",
        "protect_after_authentication",
        "protect_for_middleware",
        "refuse_above_api_view",
        "view_options",
    ],
    "django_idempotency.spectacular": [
        "ERROR_COMPONENT",
        "PROBLEM_COMPONENT",
        "PROBLEM_CONTENT_TYPE",
        "TRANSIENT_STATUSES",
        "IdempotentSchemaMixin",
        "Layer",
        "Protected",
        "describe_duration",
        "idempotent_schema_class",
        "layers",
        "project_doc",
        "protection",
    ],
    "django_idempotency.tasks": ["TASK_VALUES", "TaskInFlight", "TaskArgumentsMismatch"],
    "django_idempotency.django_tasks": ["TASK_VALUES", "CALL_OPTION_NAMES"],
}


@pytest.mark.parametrize("module", sorted(REMOVED_SINCE_0_2_0))
def test_the_changelog_names_each_removed_name(module):
    import importlib

    changelog = (ROOT / "CHANGELOG.md").read_text()
    unreleased = changelog.split("\n## ", 2)[1]
    removed = re.search(r"^### Removed\n(.*?)(?=^### |\Z)", unreleased, re.M | re.S)
    assert removed, "no Removed section in the Unreleased changes"
    imported = importlib.import_module(module)

    for name in REMOVED_SINCE_0_2_0[module]:
        assert not hasattr(imported, name), f"{module}.{name} is still there"
        # `name`, `module.name` or `name(arguments)`.
        named = rf"`(?:[\w.]+\.)?{name}(?:\([^`]*\))?`"
        assert re.search(named, removed.group(1)), f"{module}.{name} is not named"
