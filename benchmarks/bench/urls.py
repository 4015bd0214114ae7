"""One URL per variant; the path is also the variant's name in the tables."""

from __future__ import annotations

from django.conf import settings
from django.urls import path

from benchmarks.bench import views
from benchmarks.bench.peers import installed

urlpatterns = [
    path("plain/", views.plain),
    path("ours/", views.ours),
    path("ours-lease/", views.ours_lease),
    path("plain-async/", views.plain_async),
    path("ours-async/", views.ours_async),
    path("drf/", views.BenchAPIView.as_view()),
    path("ours-mixin/", views.OursMixinView.as_view()),
]

_peers = set() if getattr(settings, "OURS_ONLY", False) else {peer.variant for peer in installed()}
if _peers:
    from benchmarks.bench import peer_views

    if "dik" in _peers:
        urlpatterns.append(path("dik/", peer_views.dik))
    if "drfi" in _peers:
        urlpatterns.append(path("drfi/", peer_views.DrfIdempotencyView.as_view()))
    if "drfik" in _peers:
        urlpatterns.append(path("drfik/", peer_views.DrfIdempotencyKeyView.as_view()))
