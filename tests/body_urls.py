from django.urls import include, path

from tests import body_views

urlpatterns = [
    path("bodies/stream/", body_views.stream_body),
    path("bodies/stream/unprotected/", body_views.stream_body_unprotected),
    path("bodies/json-load/", body_views.stream_json),
    path("bodies/json-load/unprotected/", body_views.stream_json_unprotected),
    path("bodies/load/", body_views.load_body),
    path("bodies/load/unprotected/", body_views.load_body_unprotected),
    path("bodies/form/", body_views.form),
    path("bodies/drf-form/", body_views.FormAPIView.as_view()),
    path("bodies/drf-json/", body_views.JSONAPIView.as_view()),
    path("bodies/upload/<str:filename>/", body_views.UploadAPIView.as_view()),
    path("bodies/stream-json/", body_views.StreamJSONAPIView.as_view()),
    path("bodies/form-fields/", body_views.form_fields),
    path("bodies/form-fields/unprotected/", body_views.form_fields_unprotected),
    path("", include("tests.urls")),
]
