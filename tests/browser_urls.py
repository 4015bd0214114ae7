"""The URLconf of ``tests/test_browsers.py``: the checkout under every adapter."""

from __future__ import annotations

from django.urls import path

from tests import browser_views as views

urlpatterns = [
    path("browser/ping/", views.ping),
    path("browser/checkout/", views.decorated, name="browser-checkout"),
    path("browser/required/", views.required),
    path("browser/lease/", views.lease),
    path("browser/signing-up/", views.signing_up_atomic),
    path("browser/signing-up-lease/", views.signing_up_lease),
    path("browser/slow/", views.slow),
    path("browser/slow-untagged/", views.slow_untagged),
    path("browser/slow-lease/", views.slow_lease),
    path("browser/async/", views.async_checkout),
    path("browser/plain/", views.checkout),
    path("browser/api/", views.ApiCheckout.as_view()),
    path("browser/closed-api/", views.ClosedApiCheckout.as_view()),
    path("browser/orders/<int:pk>/", views.order, name="browser-order"),
]
