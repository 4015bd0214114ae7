"""The URLconf of ``tests/test_admin_browser.py``: Django's admin and its static files."""

from __future__ import annotations

from pathlib import Path

import django.contrib.admin
from django.contrib import admin
from django.urls import path
from django.views.static import serve

ADMIN_STATIC = Path(django.contrib.admin.__file__).parent / "static"

urlpatterns = [
    path("admin/", admin.site.urls),
    # What a deployment's web server serves; no staticfiles app in the tests.
    path("static/<path:path>", serve, {"document_root": ADMIN_STATIC}),
]
