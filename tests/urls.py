from django.urls import include, path

from tests import views

urlpatterns = [
    path("orders/", views.create_order),
    path("orders/unprotected/", views.create_order_unprotected),
    path("orders/required/", views.create_order_required),
    path("orders/lease/", views.create_order_lease),
    path("orders/short-wait/", views.create_order_short_wait),
    path("orders/token-auth/", views.create_order_token_auth),
    path("orders/class-based/", views.OrderView.as_view()),
    path("orders/class-based-lease/", views.LeaseOrderView.as_view()),
    path("orders/lease-then-fail/", views.LeaseThenFailView.as_view()),
    path("orders/lease-then-fail-once/", views.LeaseThenFailOnceView.as_view()),
    path("orders/lease-checkpoint-then-fail/", views.LeaseCheckpointThenFailOnceView.as_view()),
    path("orders/function-then-fail/", views.function_then_fail),
    path("lease/outlive-connection/", views.lease_outliving_connection),
    path("lease/outlive-connection/class-based/", views.LeaseOutlivingConnectionView.as_view()),
    path("lease/large/", views.lease_large_response),
    path("lease/unrenderable/", views.lease_unrenderable),
    path("lease/unrenderable/class-based/", views.LeaseUnrenderableView.as_view()),
    path("orders/unrenderable/", views.atomic_unrenderable),
    path("binary/", views.binary_response),
    path("large/", views.large_response),
    path("stream/", views.streaming_response),
    path("info/", views.idempotency_info),
    path("api/orders/", views.api_create_order),
    path("drf/", include("tests.drf_urls")),
    path("async/", include("tests.async_urls")),
    path("faults/", include("tests.faults.urls")),
    path("recovery/", include("tests.recovery_urls")),
    path("webhooks/", include("tests.webhook_urls")),
]
