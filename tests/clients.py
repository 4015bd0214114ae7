"""Requests the test modules send to the test views, and the clients they send them with.

``post`` sends the JSON order ``{"item": "book"}`` with an Idempotency-Key
through Django's WSGI or ASGI handler, ``post_json`` any JSON body, and
``get`` a GET with headers; ``send`` posts through a new client, as a
server would for each request. ``token_client`` and ``drf_post`` do the
same for the DRF views, as a user with a token. ``http_post`` posts to a
running server over HTTP. ``reset_lease_views`` puts back the switches of
the lease views that hold or fail on a test's word (``tests.views``).
"""

from __future__ import annotations

import json
from typing import Any

import requests
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.test import AsyncClient, Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from tests.views import fail_after_view, fail_at_commit, handler_connection_ids, resume

PAYLOAD = {"item": "book", "quantity": 2}
LEASE_ORDERS = "/drf/lease-orders/"


def post(
    client: Client | AsyncClient,
    url: str,
    key: str | None = "k",
    *,
    headers: dict[str, str] | None = None,
    **data: Any,
) -> Any:
    """POST ``{"item": "book", **data}`` as JSON, with ``key`` as its Idempotency-Key."""
    return post_json(client, url, {"item": "book", **data}, key, headers=headers)


def post_json(
    client: Client | AsyncClient,
    url: str,
    body: Any,
    key: str | None = "k",
    *,
    headers: dict[str, str] | None = None,
) -> Any:
    """POST ``body`` as JSON, exactly as given, with ``key`` as its Idempotency-Key.

    For bodies other than an order of a book: every field is in the
    fingerprint, and some steer the test views (``status``, ``raise``), so
    such a test states its body whole.
    """
    headers = dict(headers or {})
    if key is not None:
        headers["Idempotency-Key"] = key
    return _sync(client, "post")(
        url, json.dumps(body), content_type="application/json", headers=headers
    )


def get(client: Client | AsyncClient, url: str, **headers: str) -> Any:
    """GET ``url`` with ``headers`` through Django's WSGI or ASGI handler."""
    return _sync(client, "get")(url, headers=headers)


def _sync(client: Client | AsyncClient, method: str) -> Any:
    """``client``'s ``method``, called as a sync test calls it under either handler."""
    call = getattr(client, method)
    return call if isinstance(client, Client) else async_to_sync(call)


def send(url: str, key: str = "k", *, asgi: bool = False, **data: Any) -> Any:
    """``post`` through a new client, which answers 500 where the view raised."""
    client = AsyncClient if asgi else Client
    return post(client(raise_request_exception=False), url, key, **data)


def token_client(username: str = "alice") -> tuple[APIClient, User]:
    """A DRF client that authenticates as a new user ``username`` by token."""
    user = User.objects.create_user(username)
    token = Token.objects.create(user=user)
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client, user


def drf_post(
    client: APIClient, url: str, data: Any = PAYLOAD, key: str | None = "k-1", **extra: Any
) -> Any:
    """POST ``data`` as DRF's JSON, with ``key`` as its Idempotency-Key."""
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post(url, data, format="json", headers=headers, **extra)


def http_post(
    url: str,
    body: Any,
    key: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 15,
) -> requests.Response:
    """POST ``body`` as JSON to a running server, with ``key`` as its Idempotency-Key.

    Over a real connection, not through a test client: for the tests of
    what a server's processes, threads and event loop make of requests.
    """
    headers = {"Idempotency-Key": key, **(headers or {})}
    return requests.post(url, json=body, headers=headers, timeout=timeout)


def reset_lease_views() -> None:
    """Clear what a lease view's earlier test may have left: its switches and reports."""
    resume.clear()
    fail_at_commit.clear()
    fail_after_view.clear()
    while not handler_connection_ids.empty():
        handler_connection_ids.get_nowait()
