"""One URL per variant; the path is also the variant's name in the tables."""

from __future__ import annotations

from django.conf import settings
from django.urls import path

from benchmarks.bench import views
from benchmarks.bench.peers import installed

#: Our variants and the undecorated baselines, by name.
VARIANTS = {
    "plain": views.plain,
    "ours": views.ours,
    "ours-lease": views.ours_lease,
    "plain-async": views.plain_async,
    "ours-async": views.ours_async,
    "drf": views.BenchAPIView.as_view(),
    "ours-mixin": views.OursMixinView.as_view(),
}
urlpatterns = [path(f"{variant}/", view) for variant, view in VARIANTS.items()]

_peers = set() if getattr(settings, "OURS_ONLY", False) else {peer.variant for peer in installed()}
if _peers:
    from benchmarks.bench import peer_views

    if "dik" in _peers:
        urlpatterns.append(path("dik/", peer_views.dik))
    if "drfi" in _peers:
        urlpatterns.append(path("drfi/", peer_views.DrfIdempotencyView.as_view()))
    if "drfik" in _peers:
        urlpatterns.append(path("drfik/", peer_views.DrfIdempotencyKeyView.as_view()))
