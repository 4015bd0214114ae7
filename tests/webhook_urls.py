from django.urls import path

from tests import webhook_preset_views as presets
from tests import webhook_views as views

urlpatterns = [
    path("stripe/", views.stripe_webhook),
    path("stripe/lease/", views.stripe_webhook_lease),
    path("github/", views.github_webhook),
    path("dotted/", views.dotted_key),
    path("returned/", views.returned_key),
    path("async/", views.async_webhook),
    path("drf/", views.DeliveryView.as_view()),
    # The presets of django_idempotency.webhooks, and the store option.
    path("preset/stripe/", presets.stripe_view),
    path("preset/stripe/lease/", presets.stripe_lease_view),
    path("preset/github/", presets.github_view),
    path("preset/github/drf/", presets.GitHubDeliveryView.as_view()),
    path("preset/standard/", presets.standard_view),
    path("preset/standard/async/", presets.standard_async_view),
    path("store/verdict/", presets.verdict_view),
    path("store/verdict/lease/", presets.verdict_lease_view),
    path("store/dotted/", presets.dotted_store_view),
]
