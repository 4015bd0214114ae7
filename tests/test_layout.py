"""How the package is put together: which module may import which."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "django_idempotency"
pytestmark = pytest.mark.skipif(
    os.environ.get("TEST_DATABASE", "sqlite") != "sqlite",
    reason="runs once, in the SQLite run: the source does not depend on the database",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every package module ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found.update(name for name in [node.module, *names] if name in known)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(paths)
    return {name: imports_of(path, known) - {name} for name, path in paths.items()}


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or ``None``."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for imported in sorted(graph[name]):
            # The package itself re-exports; its own imports are not a layer.
            if imported == "django_idempotency":
                continue
            cycle = visit(imported, [*path, name])
            if cycle:
                return cycle
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name, [])
        if cycle:
            return cycle
    return None


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert "django_idempotency.core" in graph  # the graph was read

    assert cycle_in(graph) is None


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}

    assert cycle_in(graph) == ["a", "b", "c", "a"]


def test_rest_framework_is_named_only_by_its_integrations_and_the_apps_wiring():
    # DRF is an optional extra: the rest of the package must import without
    # it. The app config imports the DRF integration when DRF is installed,
    # so that it registers what it knows (how DRF requests are answered);
    # the middleware only asks whether a view is DRF's, importing nothing.
    naming = {
        module_name(path) for path in PACKAGE.rglob("*.py") if "rest_framework" in path.read_text()
    }

    assert naming <= {
        "django_idempotency.apps",
        "django_idempotency.drf",
        "django_idempotency.middleware",
        "django_idempotency.spectacular",
    }
