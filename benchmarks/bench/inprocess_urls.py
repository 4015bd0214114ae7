"""The in-process rows' views: the handler, ``@idempotent`` around it, and its SQL alone.

The DRF pair (the undecorated ``APIView`` and ``IdempotentMixin`` mixed into
it) is counted by :mod:`benchmarks.instructions`.
"""

from __future__ import annotations

from django.urls import path

from benchmarks.bench import views

urlpatterns = [
    path("plain/", views.plain),
    path("ours/", views.ours),
    path("statements-alone/", views.statements_alone),
    path("drf/", views.BenchAPIView.as_view()),
    path("ours-mixin/", views.OursMixinView.as_view()),
]
