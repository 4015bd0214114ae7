"""The endings table's URLs: ``/endings/<row>/<mode>/`` for every row and mode."""

from django.http import HttpRequest, JsonResponse
from django.urls import path

from tests.endings_views import MODES, ROWS


def ping(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


urlpatterns = [path("endings/ping/", ping)] + [
    path(f"endings/{row}/{mode}/", build(atomic), name=f"endings-{row}-{mode}")
    for row, build in ROWS.items()
    for mode, atomic in MODES.items()
]
