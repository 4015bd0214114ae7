"""The ``key`` option: the key taken from the request itself (webhooks), not the header.

A provider's webhook carries no ``Idempotency-Key``; the event id in the
body, or a delivery id header of the provider's own, is what repeats when
the provider delivers twice. Everything but where the key comes from is
the view contract: fingerprint, scope, replay, 422, 409. The proof runs
over gunicorn: 20 concurrent deliveries of one event, one effect.
"""

from __future__ import annotations

import gc
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.test import AsyncClient, Client, override_settings
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.checks import check_settings, check_view_options
from django_idempotency.contrib.drf import IdempotentMixin
from django_idempotency.models import IdempotencyKey
from tests import webhook_views
from tests.models import Order
from tests.server import GunicornServer
from tests.server_fixtures import (  # noqa: F401  fixtures used by name
    SERVER_TESTS,
    control_dir_fixture,
    gunicorn_fixture,
)
from tests.views import calls
from tests.webhook_views import sign

REPLAYED = "Idempotent-Replayed"


def deliver(
    client: Client,
    event: dict[str, Any],
    url: str = "/webhooks/stripe/",
    *,
    signature: str | None = None,
    **headers: str,
) -> Any:
    """POST ``event`` as a Stripe-style provider would: JSON, signed, no Idempotency-Key."""
    body = json.dumps(event).encode()
    headers = {"Stripe-Signature": signature or sign(body), **headers}
    return client.post(url, body, content_type="application/json", headers=headers)


def github(
    client: Client, delivery: str | None, url: str = "/webhooks/github/", **data: Any
) -> Any:
    headers = {} if delivery is None else {"X-GitHub-Delivery": delivery}
    body = json.dumps({"action": "opened", **data})
    return client.post(url, body, content_type="application/json", headers=headers)


@pytest.fixture
def client() -> Client:
    return Client(raise_request_exception=False)


@pytest.fixture
def returned() -> Any:
    yield webhook_views.returned
    webhook_views.returned["key"] = None


@pytest.mark.django_db(transaction=True)
class KeyFromTheBodyTests:
    """The Stripe-style recipe: the signature checked first, then the effect once per event id."""

    def test_event_id_is_the_key_and_the_retry_replays_it(self, client):
        event = {"id": "evt_2", "type": "invoice.paid"}

        first = deliver(client, event)
        # The provider signs each delivery anew, at its own time: the
        # signature is no part of the fingerprint.
        body = json.dumps(event).encode()
        retry = deliver(client, event, signature=sign(body, int(time.time()) - 60))

        assert first.status_code == 200
        assert REPLAYED not in first
        assert retry.status_code == 200
        assert retry[REPLAYED] == "true"
        assert retry.content == first.content
        assert list(Order.objects.values_list("item", flat=True)) == ["evt_2"]
        record = IdempotencyKey.objects.get()
        assert (record.scope, record.key) == ("webhooks:stripe", "evt_2")
        assert calls.value == 1

    def test_forged_delivery_is_refused_before_any_key_is_claimed(self, client):
        event = {"id": "evt_3", "type": "invoice.paid"}

        forged = deliver(client, event, signature="t=1,v1=forged")

        assert forged.status_code == 400
        assert not IdempotencyKey.objects.exists()
        genuine = deliver(client, event)
        assert genuine.status_code == 200
        assert REPLAYED not in genuine
        assert Order.objects.count() == 1

    def test_other_body_under_the_same_event_id_is_422(self, client):
        deliver(client, {"id": "evt_4", "type": "invoice.paid"})

        other = deliver(client, {"id": "evt_4", "type": "invoice.voided"})

        assert other.status_code == 422
        assert other["Content-Type"] == "application/problem+json"
        assert Order.objects.count() == 1

    def test_idempotency_key_header_is_not_the_key(self, client):
        first = deliver(client, {"id": "evt_5"}, **{"Idempotency-Key": "same"})
        second = deliver(client, {"id": "evt_6"}, **{"Idempotency-Key": "same"})

        assert (first.status_code, second.status_code) == (200, 200)
        assert REPLAYED not in second
        assert sorted(IdempotencyKey.objects.values_list("key", flat=True)) == ["evt_5", "evt_6"]

    def test_equal_ids_of_two_providers_never_meet(self, client):
        deliver(client, {"id": "shared-id"})
        response = github(client, "shared-id")

        assert response.status_code == 200
        assert REPLAYED not in response
        assert sorted(IdempotencyKey.objects.values_list("scope", flat=True)) == [
            "webhooks:github",
            "webhooks:stripe",
        ]


@pytest.mark.django_db(transaction=True)
class KeyFromAHeaderTests:
    """The GitHub-style recipe: the provider's delivery id header."""

    def test_redelivery_runs_once(self, client):
        first = github(client, "72d3162e-cc78-11e3-81ab-4c9367dc0958")
        again = github(client, "72d3162e-cc78-11e3-81ab-4c9367dc0958")

        assert (first.status_code, again.status_code) == (200, 200)
        assert again[REPLAYED] == "true"
        assert again.content == first.content
        assert Order.objects.count() == 1

    def test_no_delivery_header_with_required_is_400(self, client):
        response = github(client, None, **{"Idempotency-Key": "header-key"})

        assert response.status_code == 400
        problem = response.json()
        assert problem["type"].endswith("idempotency-key-required")
        assert "none was found in the request" in problem["detail"]
        assert not Order.objects.exists()

    def test_dotted_path_key_is_imported_and_used(self, client):
        first = client.post("/webhooks/dotted/", headers={"X-Delivery": "d-1"})
        again = client.post("/webhooks/dotted/", headers={"X-Delivery": "d-1"})

        assert again[REPLAYED] == "true"
        assert first.content == again.content
        assert Order.objects.count() == 1

    def test_key_function_finding_none_runs_unprotected_without_required(self, client):
        client.post("/webhooks/dotted/", headers={"Idempotency-Key": "ignored"})
        client.post("/webhooks/dotted/", headers={"Idempotency-Key": "ignored"})

        assert Order.objects.count() == 2
        assert not IdempotencyKey.objects.exists()

    def test_other_methods_never_ask_the_key_function(self, client, returned):
        returned["key"] = 42  # would be refused if it were asked

        response = client.put("/webhooks/returned/")

        assert response.status_code == 200
        assert not IdempotencyKey.objects.exists()


@pytest.mark.django_db(transaction=True)
class KeyRulesTests:
    """SPEC 4.3's key rules apply to what the function returns; header syntax does not."""

    @pytest.mark.parametrize(
        ("value", "detail"),
        [
            ("", "is empty"),
            ("k" * 256, "is 256 characters long; the limit is 255"),
            ("evt 1", "visible ASCII"),
            ("évènement", "visible ASCII"),
            ("evt_1\n", "visible ASCII"),
            (12345, "is int, not a string"),
        ],
    )
    def test_bad_key_is_400_and_runs_nothing(self, client, returned, value, detail):
        returned["key"] = value

        response = client.post("/webhooks/returned/")

        assert response.status_code == 400
        assert response["Content-Type"] == "application/problem+json"
        assert response.json()["type"].endswith("invalid-idempotency-key")
        assert detail in response.json()["detail"]
        assert not Order.objects.exists()
        assert not IdempotencyKey.objects.exists()

    def test_key_longer_than_key_max_length_is_400(self, client, returned):
        returned["key"] = "k" * 11
        with override_settings(IDEMPOTENCY={"KEY_MAX_LENGTH": 10}):
            response = client.post("/webhooks/returned/")
        assert response.status_code == 400
        assert "the limit is 10" in response.json()["detail"]

    def test_key_shorter_than_key_min_length_is_400(self, client, returned):
        returned["key"] = "evt_1"
        with override_settings(IDEMPOTENCY={"KEY_MIN_LENGTH": 16}):
            response = client.post("/webhooks/returned/")
        assert response.status_code == 400
        assert "at least 16" in response.json()["detail"]
        assert not Order.objects.exists()

    @pytest.mark.parametrize("value", ['"quoted"', "a,b", '"a",b'])
    def test_header_syntax_does_not_apply(self, client, returned, value):
        returned["key"] = value

        first = client.post("/webhooks/returned/")
        again = client.post("/webhooks/returned/")

        assert first.status_code == 200
        assert again[REPLAYED] == "true"
        assert IdempotencyKey.objects.get().key == value

    def test_quoted_and_bare_values_are_two_keys(self, client, returned):
        # A header's "abc" is abc; a function's value is taken as it is.
        for value in ('"abc"', "abc"):
            returned["key"] = value
            client.post("/webhooks/returned/")
        assert Order.objects.count() == 2

    def test_key_function_value_is_exact_bytes(self, client, returned):
        for value in ("evt_ABC", "evt_abc"):
            returned["key"] = value
            client.post("/webhooks/returned/")
        assert Order.objects.count() == 2


@pytest.mark.django_db(transaction=True)
class KeyOnOtherViewsTests:
    def test_async_view(self):
        aclient = AsyncClient(raise_request_exception=False)

        def post() -> Any:
            return async_to_sync(aclient.post)("/webhooks/async/", headers={"X-Delivery": "a-1"})

        first, again = post(), post()

        assert (first.status_code, again.status_code) == (200, 200)
        assert again[REPLAYED] == "true"
        assert again.content == first.content
        assert Order.objects.count() == 1

    def test_async_view_without_a_key_runs_unprotected(self):
        aclient = AsyncClient(raise_request_exception=False)
        for _ in range(2):
            response = async_to_sync(aclient.post)("/webhooks/async/", headers={"X-Other": "x"})
            assert response.status_code == 200
        assert Order.objects.count() == 2
        assert not IdempotencyKey.objects.exists()

    def test_drf_mixin_attribute(self, client):
        first = github(client, "gh-1", url="/webhooks/drf/")
        again = github(client, "gh-1", url="/webhooks/drf/")
        missing = github(client, None, url="/webhooks/drf/")

        assert (first.status_code, again.status_code) == (201, 201)
        assert again[REPLAYED] == "true"
        assert again.content == first.content
        assert Order.objects.count() == 1
        assert missing.status_code == 400
        assert missing.json()["detail"].endswith("none was found in the request.")

    def test_mixin_key_as_a_plain_function_attribute_and_through_as_view(self, client):
        def delivery(request: Any) -> str | None:
            return request.headers.get("X-Delivery")

        class Plain(IdempotentMixin, APIView):
            idempotency_key = delivery

        class Given(IdempotentMixin, APIView):
            pass

        assert Plain._idempotency_options.resolve().key is delivery
        view = Given.as_view(idempotency_key=delivery)
        assert view.view_initkwargs["_idempotency_options"].resolve().key is delivery


class DefinitionTests:
    """A key that is neither a callable nor a dotted path fails where it is written."""

    @pytest.mark.parametrize("value", [42, "not a path", "tests.webhook_views.event_id\n", b"x"])
    def test_decorator_refuses_a_bad_key(self, value):
        with pytest.raises(ImproperlyConfigured, match=r"@idempotent\(key=\.\.\.\)") as raised:

            @idempotent(key=value)
            def view(request):  # pragma: no cover - never called
                raise AssertionError

        assert "f(request) -> str | None" in str(raised.value)

    def test_mixin_refuses_a_bad_key_when_the_class_is_created(self):
        with pytest.raises(ImproperlyConfigured, match=r"Broken\.idempotency_key has an invalid"):

            class Broken(IdempotentMixin, APIView):
                idempotency_key = 42

    def test_misspelt_mixin_attribute_is_refused(self):
        with pytest.raises(ImproperlyConfigured, match="Did you mean 'idempotency_key'"):

            class Misspelt(IdempotentMixin, APIView):
                idempotency_keys = "tests.webhook_views.event_id"

    def test_mixin_lists_the_attribute(self):
        assert IdempotentMixin.idempotency_key is None

    def test_dotted_path_that_fails_to_import_is_e118(self):
        @idempotent(key="tests.no_such_module.event_id")
        def broken_webhook(request):  # pragma: no cover - never called
            raise AssertionError

        [error] = [e for e in check_view_options() if "broken_webhook" in e.msg]
        assert error.id == "django_idempotency.E118"
        assert "@idempotent(key=...) on tests.test_webhooks." in error.msg
        del broken_webhook
        gc.collect()

    def test_key_in_the_settings_is_an_unknown_key(self):
        # A key belongs to a view: there is no project-wide default to set.
        refused = pytest.raises(ImproperlyConfigured, match=r"IDEMPOTENCY\['KEY'\] is not a known")
        with refused, override_settings(IDEMPOTENCY={"KEY": "tests.webhook_views.event_id"}):
            pass  # pragma: no cover - refused on entry
        with override_settings(
            IDEMPOTENCY={"KEY": "tests.webhook_views.event_id"},
            SILENCED_SYSTEM_CHECKS=["django_idempotency.E002"],
        ):
            assert [error.id for error in check_settings()] == ["django_idempotency.E002"]


#: Deliveries of one event the proof sends at once.
DELIVERIES = 20


@pytest.mark.parametrize("mode", ["atomic", "lease"])
@SERVER_TESTS[0]
@SERVER_TESTS[1]
@SERVER_TESTS[2]
class ConcurrentDeliveriesTests:
    """Over gunicorn: 20 deliveries of one event id at once, one effect, then replays."""

    def test_one_effect_and_the_original_answer(self, gunicorn: GunicornServer, mode: str):
        path = "/webhooks/stripe/" if mode == "atomic" else "/webhooks/stripe/lease/"
        url = f"{gunicorn.url}{path}?hold=0.5"
        event = json.dumps({"id": f"evt_storm_{mode}", "type": "invoice.paid"}).encode()

        def send(_: int) -> requests.Response:
            headers = {"Content-Type": "application/json", "Stripe-Signature": sign(event)}
            return requests.post(url, data=event, headers=headers, timeout=30)

        with ThreadPoolExecutor(max_workers=DELIVERIES) as pool:
            answers = list(pool.map(send, range(DELIVERIES)))

        statuses = Counter(answer.status_code for answer in answers)
        assert set(statuses) <= {200, 409}, (statuses, gunicorn.log())
        originals = [a for a in answers if a.status_code == 200 and REPLAYED not in a.headers]
        assert len(originals) == 1, statuses
        for answer in answers:
            if answer.status_code == 200:
                assert answer.content == originals[0].content
            else:
                assert answer.headers["Retry-After"]
                assert answer.headers["Content-Type"] == "application/problem+json"
        if mode == "atomic":
            # Duplicates wait for the original (WAIT, 5 s) and replay it.
            assert statuses == {200: DELIVERIES}
        assert Order.objects.count() == 1
        later = [send(0) for _ in range(3)]
        assert [a.status_code for a in later] == [200, 200, 200]
        assert all(a.headers[REPLAYED] == "true" for a in later)
        assert all(a.content == originals[0].content for a in later)
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED
