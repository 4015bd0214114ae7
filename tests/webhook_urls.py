from django.urls import path

from tests import webhook_views as views

urlpatterns = [
    path("stripe/", views.stripe_webhook),
    path("stripe/lease/", views.stripe_webhook_lease),
    path("github/", views.github_webhook),
    path("dotted/", views.dotted_key),
    path("returned/", views.returned_key),
    path("async/", views.async_webhook),
    path("drf/", views.DeliveryView.as_view()),
]
