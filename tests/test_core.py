"""The core's rule for layers: a claim is marked on Django's request while its call runs.

An inner layer given that request, a framework's copy of it or Django's under it, runs inside
the claim; the same request sent through again once the call ended is a retry, protected as
any other.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import request_finished
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.test import RequestFactory

from django_idempotency import idempotent
from django_idempotency.models import IdempotencyKey
from tests import async_views, views
from tests.models import Order

BODY = json.dumps({"item": "book"})


def order_request(key: str = "key-1") -> HttpRequest:
    return RequestFactory().post(
        "/orders/", BODY, content_type="application/json", headers={"Idempotency-Key": key}
    )


@pytest.fixture(autouse=True)
def test_database_kept_open():
    """As Django's test client does: closing a response must not close the test's database."""
    request_finished.disconnect(close_old_connections)
    yield
    request_finished.connect(close_old_connections)


def answered(response: HttpResponseBase) -> HttpResponseBase:
    response.close()  # as a server does: the fingerprint's copy of the body closes with it
    return response


@pytest.mark.django_db
class SameRequestAgainTests:
    @pytest.mark.parametrize("view", [views.create_order, views.create_order_lease])
    def test_the_same_request_sent_through_again_is_replayed(self, view, reset_calls) -> None:
        request = order_request()
        first = answered(view(request))
        again = answered(view(request))

        assert first.status_code == again.status_code == 201
        assert again["Idempotent-Replayed"] == "true"
        assert again.content == first.content
        assert reset_calls.value == 1
        assert Order.objects.count() == 1

    def test_after_a_failure_the_same_request_claims_the_key_once_more(self, reset_calls) -> None:
        request = order_request()
        views.fail_next.set()
        with pytest.raises(RuntimeError, match="handler failed after writing"):
            views.create_order(request)
        retried = answered(views.create_order(request))
        again = answered(views.create_order(request))

        assert retried.status_code == 201 and "Idempotent-Replayed" not in retried
        assert again["Idempotent-Replayed"] == "true"
        assert reset_calls.value == 2  # the failed run, rolled back, and the retry
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED


@pytest.mark.django_db(transaction=True)
def test_an_async_view_given_the_same_request_again_replays(reset_calls) -> None:
    request = order_request()
    first = answered(async_to_sync(async_views.create_order)(request))
    again = answered(async_to_sync(async_views.create_order)(request))

    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert reset_calls.value == 1


@pytest.mark.django_db
def test_another_view_with_other_options_given_the_same_request_is_refused(reset_calls) -> None:
    # Same scope, key and fingerprint, so the same record: the lease-mode view would be
    # answered the atomic one's response, which options it does not share decided.
    request = order_request()
    answered(views.create_order(request))

    with pytest.raises(ImproperlyConfigured, match=r"with other options \(atomic\)"):
        views.create_order_lease(request)
    assert reset_calls.value == 1


@idempotent
def fails_inside(request: HttpRequest) -> JsonResponse:
    raise RuntimeError("the inner view failed")


@idempotent
def catches_and_reads_the_body(request: HttpRequest) -> JsonResponse:
    with contextlib.suppress(RuntimeError):
        fails_inside(request)
    return JsonResponse(json.loads(request.body), status=201)


@pytest.mark.django_db
def test_a_failed_inner_layer_leaves_the_body_to_its_caller() -> None:
    # The caller's layer copied the body for its fingerprint; the inner one must not close it.
    response = answered(catches_and_reads_the_body(order_request()))

    assert response.status_code == 201
    assert json.loads(response.content) == {"item": "book"}
    assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED


@idempotent
def reads_the_form_after_a_failed_call(request: HttpRequest) -> JsonResponse:
    with contextlib.suppress(RuntimeError):
        fails_inside(request)
    return JsonResponse({"item": request.POST["item"]}, status=201)


@pytest.mark.django_db
def test_a_failed_view_leaves_the_body_copy_its_caller_made_open() -> None:
    # A form without a key: the caller's layer copied the body looking for one and claimed
    # nothing; the failing view it calls must not close that copy, which the form reads.
    request = RequestFactory().post("/orders/", {"item": "book"})
    response = answered(reads_the_form_after_a_failed_call(request))

    assert json.loads(response.content) == {"item": "book"}
    assert not IdempotencyKey.objects.exists()
