"""Sphinx configuration; the version comes from pyproject.toml."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import django

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

project = "django-idempotency"
author = "django-idempotency contributors"
copyright = "2026, django-idempotency contributors"
_pyproject = (ROOT / "pyproject.toml").read_text()
release = re.search(r'^version = "([^"]+)"', _pyproject, re.MULTILINE).group(1)
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx_copybutton",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
# _generated/ holds fragments that pages include, not pages of their own.
exclude_patterns = ["_build", "_generated"]
html_theme = "furo"
html_title = f"django-idempotency {release}"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
nitpicky = False
