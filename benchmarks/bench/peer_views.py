"""The same handler behind each peer package, used as each one documents.

Imported only when the peers are installed (the bench virtualenv), never
by the project's tests.

* django-idempotency-key: its opt-in middleware (in settings) and
  ``@idempotency_key`` on a plain Django view.
* drf-idempotency: its middleware, database backend (its default). Its
  ``@idempotent()`` decorator renders the view's response before DRF has
  given it a renderer, so on a view returning a DRF ``Response`` it fails
  with "AssertionError: .accepted_renderer not set on Response"; the
  middleware wraps the whole view and works.
* djangorestframework-idempotency-key: its middleware and
  ``@simple_idempotency_key_method`` on an ``APIView`` method.
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from benchmarks.bench.peers import is_installed
from benchmarks.bench.views import BenchAPIView, write_order

if is_installed("dik"):
    from idempotency_key.decorators import idempotency_key

    @idempotency_key
    def dik(request: HttpRequest) -> JsonResponse:
        data, status = write_order(request, "dik")
        return JsonResponse(data, status=status)


class OnItsPath:
    """A peer's project-wide middleware, limited to its own view's path.

    These middlewares claim a key for every POST that carries one, whatever
    the view, so unrestricted they would also run in front of the other
    variants.
    """

    prefix = ""
    middleware_class: type

    def __init__(self, get_response):
        self.get_response = get_response
        self.middleware = self.middleware_class(get_response)

    def __call__(self, request):
        if request.path.startswith(self.prefix):
            return self.middleware(request)
        return self.get_response(request)


if is_installed("drfi"):
    from drf_idempotency.middleware import IdempotencyMiddleware

    class DrfIdempotencyView(BenchAPIView):
        variant = "drfi"

    class DrfIdempotencyOnItsPath(OnItsPath):
        prefix = "/drfi/"
        middleware_class = IdempotencyMiddleware


if is_installed("drfik"):
    from rest_framework_idempotency_key.decorators import simple_idempotency_key_method
    from rest_framework_idempotency_key.middleware import IdempotencyKeyMiddleware

    class DrfIdempotencyKeyView(BenchAPIView):
        variant = "drfik"

        @simple_idempotency_key_method
        def post(self, request):
            return super().post(request)

    class DrfIdempotencyKeyOnItsPath(OnItsPath):
        prefix = "/drfik/"
        middleware_class = IdempotencyKeyMiddleware
