from django.urls import path
from rest_framework.routers import SimpleRouter

from tests import drf_views

router = SimpleRouter()
router.register("orders", drf_views.OrderViewSet, basename="drf-order")
router.register("lease-orders", drf_views.LeaseOrderViewSet, basename="drf-lease-order")
router.register("put-orders", drf_views.PutOrderViewSet, basename="drf-put-order")
router.register("required-orders", drf_views.RequiredOrderViewSet, basename="drf-required-order")
router.register("options-orders", drf_views.OptionsOrderViewSet, basename="drf-options-order")
router.register("dotted-orders", drf_views.DottedOptionsOrderViewSet, basename="drf-dotted-order")
router.register("reads-data", drf_views.ReadsDataOrderViewSet, basename="drf-reads-data")
router.register("plain", drf_views.PlainOrderViewSet, basename="drf-plain")
router.register(
    "unprotected-orders", drf_views.UnprotectedOrderViewSet, basename="drf-unprotected-order"
)

router.register("exempt-create", drf_views.ExemptCreateViewSet, basename="drf-exempt-create")

urlpatterns = [
    path("decorated-create/", drf_views.DecoratedCreateView.as_view()),
    path("apiview/", drf_views.OrderAPIView.as_view()),
    path("generic/", drf_views.OrderCreateView.as_view()),
    path("template/", drf_views.TemplateOrderView.as_view()),
    path("api-lease/", drf_views.api_create_order_lease),
    path("api-lease-non-atomic/", drf_views.api_create_order_lease_non_atomic),
    path("hold/", drf_views.HoldView.as_view()),
    path("lease-hold/", drf_views.LeaseHoldView.as_view()),
    path("long-lease-hold/", drf_views.LongLeaseHoldView.as_view()),
    path("unprotected-apiview/", drf_views.UnprotectedOrderAPIView.as_view()),
    path("unprotected-api-view/", drf_views.unprotected_api_view),
    *router.urls,
]
