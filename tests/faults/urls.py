from django.urls import path

from tests.faults import views

urlpatterns = [
    path("orders/", views.create_order),
    path("orders/short-wait/", views.create_order_short_wait),
    path("charges/", views.create_charge),
    path("large/", views.large_response),
]
