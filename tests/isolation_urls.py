"""The isolation table's URLs: ``/isolation/<view>/``, one per view of ``tests.isolation_views``."""

from functools import wraps

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import idempotent
from tests import isolation_views as views


def ping(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


def _without_wraps(view):  # type: ignore[no-untyped-def]
    """A project decorator that hides what it wraps, ``@idempotent``'s mark included."""

    def outer(request, *args, **kwargs):  # type: ignore[no-untyped-def]
        return view(request, *args, **kwargs)

    return outer


def _without_wraps_async(view):  # type: ignore[no-untyped-def]
    """:func:`_without_wraps` for an async view."""

    async def outer(request, *args, **kwargs):  # type: ignore[no-untyped-def]
        return await view(request, *args, **kwargs)

    return outer


def _with_wraps(view):  # type: ignore[no-untyped-def]
    """A project decorator that keeps what it wraps visible (``functools.wraps``)."""

    @wraps(view)
    def outer(request, *args, **kwargs):  # type: ignore[no-untyped-def]
        return view(request, *args, **kwargs)

    return outer


VIEWS = {
    "function": views.function_view,
    "class-based": views.ClassBasedView.as_view(),
    "async-function": views.async_function_view,
    "async-class-based": views.AsyncClassBasedView.as_view(),
    "api-view": views.api_view_function,
    "mixin-apiview": views.MixinAPIView.as_view(),
    "mixin-viewset": views.MixinViewSet.as_view({"post": "create"}),
    "mixin-session-on-drf-request": views.SessionOnTheDrfRequestAPIView.as_view(),
    "drf-method-decorator": views.MethodDecoratedAPIView.as_view(),
    "drf-dispatch-decorator": views.DispatchDecoratedAPIView.as_view(),
    "adrf-dispatch-decorator": views.DispatchDecoratedAdrfAPIView.as_view(),
    "drf-dispatch-subclass": views.DispatchDecoratedSubclassAPIView.as_view(),
    "async-dispatch-decorator": views.AsyncDispatchDecoratedView.as_view(),
    "adrf": views.AdrfMixinAPIView.as_view(),
    "hidden-function": _without_wraps(views.function_view),
    # DRF views whose class a project decorator hides: refused, with or without
    # protection of their own, under the middleware or @idempotent.
    "hidden-mixin-apiview": _without_wraps(views.MixinAPIView.as_view()),
    "hidden-plain-apiview": _without_wraps(views.PlainAPIView.as_view()),
    "decorated-hidden-plain-apiview": idempotent(_without_wraps(views.PlainAPIView.as_view())),
    "hidden-plain-adrf": _without_wraps_async(views.PlainAdrfAPIView.as_view()),
    # A DRF view inside a visible decorator: the middleware can neither call around it
    # nor claim before DRF's authentication, so it refuses.
    "wrapped-plain-apiview": _with_wraps(views.PlainAPIView.as_view()),
    # csrf_exempt changes nothing DRF's as_view() has not done.
    "csrf-exempt-plain-apiview": csrf_exempt(views.PlainAPIView.as_view()),
    "plain": views.plain_view,
    "async-plain": views.async_plain_view,
    "plain-api-view": views.plain_api_view,
    "plain-apiview": views.PlainAPIView.as_view(),
    "plain-viewset": views.PlainViewSet.as_view({"post": "create"}),
    "plain-adrf": views.PlainAdrfAPIView.as_view(),
    "plain-adrf-viewset": views.PlainAdrfViewSet.as_view({"post": "create"}),
}

urlpatterns = [path("isolation/ping/", ping)] + [
    path(f"isolation/{name}/", view, name=f"isolation-{name}") for name, view in VIEWS.items()
]
