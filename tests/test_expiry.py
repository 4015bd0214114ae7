"""When a completed key expires, held to the one sentence the docs say it in.

"A completed response is replayed for ``TTL`` after it was stored; in atomic
mode the clock may start at the claim instead, at most 1% of ``TTL``
earlier." (http.rst, settings.rst, purge.rst and the OpenAPI description.)
The clock is Django's ``timezone.now``, replaced by one that moves only when
told: by the handler's duration, when the key is claimed, and by the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from unittest import mock

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_idempotency import clock as database_clock
from django_idempotency import signals
from django_idempotency.models import IdempotencyKey
from tests.clients import post
from tests.models import Order

TTL = timedelta(hours=1)
KEY = "ttl-key"
DOCS = Path(__file__).resolve().parent.parent / "docs"
# The sentence, as each page words it for its readers.
STATEMENT = "is replayed for ``TTL`` after it was stored"
ATOMIC_CAVEAT = "at most 1% of ``TTL`` earlier"


class Clock:
    """The database's clock (and ``timezone.now``) standing still until moved."""

    def __init__(self) -> None:
        self.now = timezone.now().replace(microsecond=0)

    @property
    def now(self) -> datetime:
        return self._now

    @now.setter
    def now(self, when: datetime) -> None:
        self._now = when
        database_clock.pin(when)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Iterator[Clock]:
    fixed = Clock()
    try:
        with mock.patch("django.utils.timezone.now", fixed):
            yield fixed
    finally:
        database_clock.pin(None)


@pytest.fixture
def handler_takes(clock: Clock) -> Iterator[list[timedelta]]:
    """Set ``handler_takes[0]``: the clock moves that much while the handler runs."""
    duration = [timedelta(0)]

    def run_handler(**kwargs: object) -> None:
        clock.now += duration[0]

    # key_claimed is sent once the key is this request's, just before the handler.
    signals.key_claimed.connect(run_handler, dispatch_uid="test-expiry")
    try:
        yield duration
    finally:
        signals.key_claimed.disconnect(dispatch_uid="test-expiry")


def plain_client() -> Client:
    return Client()


def drf_client() -> APIClient:
    client = APIClient()
    token = Token.objects.create(user=User.objects.create_user("ttl-user"))
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


VIEWS = {
    "atomic": [("/orders/", plain_client), ("/drf/orders/", drf_client)],
    "lease": [("/orders/lease/", plain_client), ("/drf/lease-orders/", drf_client)],
}


def stored_record(client: Client, url: str, clock: Clock) -> tuple[datetime, datetime, datetime]:
    """Send one request; its claim time, the time its response was stored, its expiry."""
    claimed_at = clock.now
    response = post(client, url, KEY, item="a")
    assert response.status_code == 201
    stored_at = clock.now  # nothing moves the clock after the handler
    return claimed_at, stored_at, IdempotencyKey.objects.get().expires_at


def assert_within_documented_window(stored_at: datetime, expires_at: datetime) -> None:
    assert stored_at + TTL - TTL / 100 <= expires_at <= stored_at + TTL


@pytest.fixture(autouse=True)
def ttl_of_an_hour(settings) -> None:
    settings.IDEMPOTENCY = {"TTL": TTL}


@pytest.mark.django_db
class ExpiryTests:
    @pytest.mark.parametrize(("url", "make_client"), VIEWS["atomic"])
    def test_atomic_fast_handler_keeps_the_claims_clock(
        self, clock, handler_takes, url, make_client
    ):
        handler_takes[0] = TTL / 200
        claimed_at, stored_at, expires_at = stored_record(make_client(), url, clock)

        assert expires_at == claimed_at + TTL
        assert_within_documented_window(stored_at, expires_at)

    @pytest.mark.parametrize(("url", "make_client"), VIEWS["atomic"])
    def test_atomic_slow_handler_starts_the_clock_when_stored(
        self, clock, handler_takes, url, make_client
    ):
        handler_takes[0] = TTL / 50
        _, stored_at, expires_at = stored_record(make_client(), url, clock)

        assert expires_at == stored_at + TTL

    @pytest.mark.parametrize(("url", "make_client"), VIEWS["lease"])
    @pytest.mark.parametrize("duration", [TTL / 200, TTL / 50])
    def test_lease_mode_starts_the_clock_when_stored(
        self, clock, handler_takes, url, make_client, duration
    ):
        handler_takes[0] = duration
        _, stored_at, expires_at = stored_record(make_client(), url, clock)

        assert expires_at == stored_at + TTL

    @pytest.mark.parametrize(("url", "make_client"), [*VIEWS["atomic"], *VIEWS["lease"]])
    def test_replayed_until_expiry_then_a_new_request(self, clock, handler_takes, url, make_client):
        handler_takes[0] = TTL / 200
        client = make_client()
        _, stored_at, expires_at = stored_record(client, url, clock)
        assert_within_documented_window(stored_at, expires_at)
        handler_takes[0] = timedelta(0)

        clock.now = expires_at - timedelta(milliseconds=1)
        retry = post(client, url, KEY, item="a")
        assert retry["Idempotent-Replayed"] == "true"
        assert Order.objects.count() == 1

        clock.now = expires_at
        late = post(client, url, KEY, item="a")
        assert not late.has_header("Idempotent-Replayed")
        assert Order.objects.count() == 2


class ExpiryStatementTests:
    """Every page that says when the TTL starts says it the same way."""

    @pytest.mark.parametrize("page", ["http.rst", "settings.rst", "purge.rst"])
    def test_page_states_the_one_truth(self, page):
        text = " ".join((DOCS / page).read_text().split())

        assert STATEMENT in text
        assert ATOMIC_CAVEAT in text

    @pytest.mark.parametrize(
        "contradiction",
        ["counted from the first request", "written when it is claimed", "from the moment its"],
    )
    @pytest.mark.parametrize("page", ["http.rst", "settings.rst", "purge.rst"])
    def test_page_has_no_other_truth(self, page, contradiction):
        text = " ".join((DOCS / page).read_text().split())

        assert contradiction not in text


def test_openapi_description_gives_clients_the_same_window():
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator(urlconf="tests.openapi_urls").get_schema(request=None, public=True)
    (parameter,) = [
        p
        for p in schema["paths"]["/orders/"]["post"]["parameters"]
        if p["name"] == "Idempotency-Key"
    ]

    assert (
        "Keys expire 1 hour after the response is stored, or at most 1% of that sooner"
        in parameter["description"]
    )
