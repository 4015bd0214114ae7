"""``IdempotentMixin`` on async DRF views from ``adrf`` (the optional ``adrf`` extra)."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.test import AsyncClient
from rest_framework.authtoken.models import Token

from django_idempotency.models import IdempotencyKey
from tests import clients
from tests.models import Order
from tests.views import calls

pytest.importorskip("adrf")
pytestmark = pytest.mark.django_db(transaction=True)

URLS = ["/async/adrf/apiview/", "/async/adrf/viewset/"]


@pytest.fixture
def user() -> User:
    return User.objects.create_user("alice")


def post(user: User, url: str, key: str, **data: object):
    """``clients.post`` through a new ASGI client, as ``user`` with a token."""
    token = Token.objects.get_or_create(user=user)[0].key
    client = AsyncClient(raise_request_exception=False)
    return clients.post(client, url, key, headers={"Authorization": f"Token {token}"}, **data)


@pytest.mark.parametrize("url", URLS)
def test_async_handler_runs_once_in_the_claims_transaction(user: User, url: str) -> None:
    first = post(user, url, "k")
    retry = post(user, url, "k")

    assert first.status_code == 201
    assert json.loads(first.content)["in_transaction"] is True
    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert calls.value == 1
    # Scoped after DRF authentication, from the token's user.
    assert IdempotencyKey.objects.get().scope == f"user:{user.pk}"


def test_a_lower_case_method_override_is_protected(user: User) -> None:
    # DRF dispatches on "put" as on "PUT": the async handler runs once per key.
    url = "/async/adrf/lower-case-override/"
    token = Token.objects.get_or_create(user=user)[0].key
    headers = {"Authorization": f"Token {token}", "X-HTTP-Method-Override": "put"}
    first = clients.post(AsyncClient(raise_request_exception=False), url, "k-put", headers=headers)
    retry = clients.post(AsyncClient(raise_request_exception=False), url, "k-put", headers=headers)

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true" and retry.content == first.content
    assert calls.value == 1


def test_a_handler_called_by_the_protected_one_runs_inside_its_claim(user: User) -> None:
    # PATCH's async handler awaits POST's, also protected, with a cloned request: the
    # key is claimed once, by the handler DRF called.
    url = "/async/adrf/delegating/"
    token = Token.objects.get_or_create(user=user)[0].key
    client = AsyncClient(raise_request_exception=False)
    send = async_to_sync(client.patch)
    headers = {"Authorization": f"Token {token}", "Idempotency-Key": "k-delegated"}
    first = send(url, "{}", content_type="application/json", headers=headers)
    retry = send(url, "{}", content_type="application/json", headers=headers)

    assert first.status_code == 201, first.content
    assert retry["Idempotent-Replayed"] == "true" and retry.content == first.content
    assert calls.value == 1


@pytest.mark.parametrize("url", URLS)
def test_async_handler_that_raises_commits_nothing(user: User, url: str) -> None:
    assert post(user, url, "boom", **{"raise": True}).status_code == 500
    assert Order.objects.count() == 0
    assert IdempotencyKey.objects.count() == 0
    assert post(user, url, "boom").status_code == 201


@pytest.mark.parametrize("url", URLS)
def test_conflicts_are_drf_errors(user: User, url: str) -> None:
    post(user, url, "same")
    mismatch = post(user, url, "same", item="lamp")
    assert mismatch.status_code == 422
    assert mismatch["Content-Type"] == "application/json"
