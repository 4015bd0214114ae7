"""The in-process rows' views: the handler, ``@idempotent`` around it, and its SQL alone."""

from __future__ import annotations

from django.urls import path

from benchmarks.bench import views

urlpatterns = [
    path("plain/", views.plain),
    path("ours/", views.ours),
    path("statements-alone/", views.statements_alone),
]
