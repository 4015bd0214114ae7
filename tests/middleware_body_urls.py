from django.urls import include, path

from django_idempotency import idempotency_exempt
from tests import middleware_body_views as views

UPLOADS = [
    path("upload/", views.upload_to_own_handler),
    path("refuse/", views.refuse_upload),
]

urlpatterns = [
    path("exempt/upload/", views.exempt_upload),
    path("exempt/refuse/", views.exempt_refuse_upload),
    path("exempt-include/", idempotency_exempt(include(UPLOADS))),
    path("own-key/upload/", views.upload_with_own_key),
    path("protected/", include(UPLOADS)),
    path("async/form/", views.async_form_order),
    path("async/form/decorated/", views.async_form_order_decorated),
    path("", include("tests.urls")),
]
