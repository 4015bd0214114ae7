from importlib.util import find_spec

from django.urls import path

from tests import async_views, middleware_views

urlpatterns = [
    path("orders/", async_views.create_order),
    path("orders/lease/", async_views.create_order_lease),
    path("orders/checkpointing/", async_views.checkpointing_order),
    path("orders/short-lease/", async_views.create_order_short_lease),
    path("orders/required/", async_views.create_order_required),
    path("orders/plain/", async_views.create_order_plain),
    path("orders/exempt/", async_views.create_order_exempt),
    path("orders/class-based/", async_views.OrderView.as_view()),
    path("ping/", async_views.ping),
    path("orders/publish/", async_views.create_order_and_publish),
    path("sync/plain/", middleware_views.create_order),
    path("sync/from-data/", middleware_views.create_order_from_data),
    path("sync/from-data-decorated/", middleware_views.create_order_from_data_decorated),
    path("sync/exempt/", middleware_views.create_order_exempt),
    path("sync/exempt-class/", middleware_views.ExemptOrderView.as_view()),
    path("sync/hidden-decorated/", middleware_views.hidden_decorated),
    path("sync/hidden-store/", middleware_views.hidden_store),
    path("sync/hidden-scoped/", middleware_views.hidden_scoped),
    path("sync/hidden-lease/", middleware_views.hidden_lease),
    path("sync/hidden-scoped-outer-lease/", middleware_views.hidden_scoped_outer_lease),
    path("sync/hidden-scoped-exempt/", middleware_views.hidden_scoped_exempt),
    path("sync/hidden-scoped-by-class/", middleware_views.hidden_scoped_by_class),
    path("sync/hidden-scoped-async/", middleware_views.hidden_scoped_async),
    path("sync/hidden-drf-scoped/", middleware_views.hidden_drf_scoped),
    path("sync/hidden-drf-default/", middleware_views.hidden_drf_default),
    path("sync/hidden-drf-plain/", middleware_views.hidden_drf_plain),
    path("sync/decorated-hidden-drf-plain/", middleware_views.decorated_hidden_drf_plain),
    path("sync/claim/", middleware_views.claim_seen_from_outside),
    path("sync/durable/", middleware_views.create_order_durable),
    path("sync/refuse/<str:refusal>/", middleware_views.create_order_then_refuse),
    path("sync/token-auth/", middleware_views.create_order_token_auth),
    path("sync/unrenderable/", middleware_views.create_order_unrenderable),
]

if find_spec("adrf") is not None:
    from tests import adrf_views

    urlpatterns += [
        path("adrf/apiview/", adrf_views.OrderAPIView.as_view()),
        path("adrf/lower-case-override/", adrf_views.LowerCaseOverrideAPIView.as_view()),
        path("adrf/delegating/", adrf_views.DelegatingAPIView.as_view()),
        path("adrf/viewset/", adrf_views.OrderViewSet.as_view({"post": "create"})),
    ]
