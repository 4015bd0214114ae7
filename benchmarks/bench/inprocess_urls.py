"""The in-process rows' two views: the undecorated handler and ``@idempotent`` around it."""

from __future__ import annotations

from django.urls import path

from benchmarks.bench import views

urlpatterns = [path("plain/", views.plain), path("ours/", views.ours)]
