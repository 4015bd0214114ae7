from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import DefaultRouter

from example_project.provider.views import list_charges
from example_project.shop import views

router = DefaultRouter()
router.register("bookings", views.BookingViewSet, basename="booking")

urlpatterns = [
    path("", views.index, name="index"),
    path("admin/", admin.site.urls),
    path("checkout/", views.checkout, name="checkout"),
    path("orders/", views.create_order, name="create-order"),
    path("orders/<int:pk>/", views.order_detail, name="order-detail"),
    path("async-orders/", views.create_order_async, name="create-order-async"),
    path("payments/", views.create_payment, name="create-payment"),
    path("receipts/", views.request_receipt, name="request-receipt"),
    path("receipts/list/", views.list_receipts, name="list-receipts"),
    path("webhooks/provider/", views.provider_webhook, name="provider-webhook"),
    path("api/", include(router.urls)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("provider/charges/", list_charges, name="provider-charges"),
]
