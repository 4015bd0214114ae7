"""``protection.view_protection``: whether a view is protected, and how, for every asker.

The middleware, DRF's adapter and the OpenAPI extension all ask it; what
each then does with the answer is tested where it is done
(``test_middleware.py``, ``test_drf.py``, ``test_spectacular.py``).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework import generics, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotency_exempt, idempotent
from django_idempotency.contrib.drf import IdempotentMixin
from django_idempotency.protection import middleware_options, view_protection
from tests.models import Order


def plain(request: Any) -> HttpResponse:
    return HttpResponse()


@idempotent(ttl=60)
def decorated(request: Any) -> HttpResponse:
    return HttpResponse()


@idempotency_exempt
def exempt(request: Any) -> HttpResponse:
    return HttpResponse()


class DecoratedPost(View):
    @method_decorator(idempotent)
    def post(self, request: Any) -> HttpResponse:
        return HttpResponse()


class Unprotected(APIView):
    def post(self, request: Any) -> Response:
        return Response()


class WithMixin(IdempotentMixin, APIView):
    idempotency_ttl = 60

    def post(self, request: Any) -> Response:
        return Response()


class OrderSerializer(serializers.ModelSerializer):
    class Meta:
        model = Order
        fields = ["item"]


class DecoratedCreate(generics.CreateAPIView):
    serializer_class = OrderSerializer

    @method_decorator(idempotent(ttl=30))
    def create(self, request: Any, *args: Any, **kwargs: Any) -> Response:
        return Response(status=201)


@method_decorator(idempotent(ttl=10), name="dispatch")
class DecoratedDispatchWithMixin(IdempotentMixin, APIView):
    def post(self, request: Any) -> Response:
        return Response()


class ExemptCreate(generics.CreateAPIView):
    serializer_class = OrderSerializer

    @method_decorator(idempotency_exempt)
    def create(self, request: Any, *args: Any, **kwargs: Any) -> Response:
        return Response(status=201)


class PlainViewTests:
    def test_a_view_that_protects_nothing_is_the_middlewares_to_protect(self):
        found = view_protection(plain, "POST")

        assert found.middleware is not None
        assert found.middleware() == (plain, middleware_options(plain))
        assert not found.protects_itself and not found.exempt

    def test_a_decorated_view_is_left_to_itself(self):
        found = view_protection(decorated, "POST")

        assert found.protects_itself
        assert found.middleware is None

    def test_a_decorated_handler_protects_its_class_based_view(self):
        assert view_protection(DecoratedPost.as_view(), "POST").protects_itself

    def test_an_exempt_view_is_left_alone(self):
        found = view_protection(exempt, "POST")

        assert found.exempt
        assert found.middleware is None

    def test_opting_out_for_another_database_keeps_atomic_mode(self) -> None:
        def view(request: Any) -> HttpResponse:
            return HttpResponse()

        view._non_atomic_requests = {"other"}  # type: ignore[attr-defined]
        assert "atomic" not in middleware_options(view).given
        view._non_atomic_requests = {"default"}  # type: ignore[attr-defined]
        assert middleware_options(view).given["atomic"] is False


class DRFViewTests:
    def test_a_drf_view_that_protects_nothing_is_given_the_mixin_for_the_middleware(self):
        view = Unprotected.as_view()

        found = view_protection(view, "POST")

        assert found.layers == ()
        assert found.middleware is not None
        made, options = found.middleware()
        assert made is not view
        assert issubclass(made.cls, IdempotentMixin)
        assert issubclass(made.cls, Unprotected)
        assert options.given == {}
        # Made once per view.
        assert view_protection(view, "POST").middleware() == (made, options)

    def test_the_mixins_options_are_its_layer(self):
        [layer] = view_protection(WithMixin.as_view(), "POST").layers

        assert layer.options.resolve().ttl.total_seconds() == 60
        assert not layer.problem_details

    def test_a_decorated_method_the_handler_hands_the_request_to_is_a_layer(self):
        found = view_protection(DecoratedCreate.as_view(), "POST")

        [layer] = found.layers
        assert layer.options.resolve().ttl.total_seconds() == 30
        assert found.middleware is None

    def test_layers_come_in_the_order_a_request_meets_them(self):
        dispatch, mixin = view_protection(DecoratedDispatchWithMixin.as_view(), "POST").layers

        assert dispatch.problem_details
        assert dispatch.options.resolve().ttl.total_seconds() == 10
        assert not mixin.problem_details

    def test_an_exempt_method_the_handler_hands_the_request_to_leaves_the_view_alone(self):
        found = view_protection(ExemptCreate.as_view(), "POST")

        assert found.exempt
        assert found.middleware is None

    def test_a_method_without_a_handler_is_drfs_405(self):
        found = view_protection(Unprotected.as_view(), "PATCH")

        assert found.layers == ()
        assert found.middleware is None
