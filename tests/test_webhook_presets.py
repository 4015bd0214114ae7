"""Webhooks that never lose an event: the presets, the ``store`` option and the signatures.

A provider redelivers until it gets a 2xx. Each preset
(``django_idempotency.webhooks``) keys by the provider's event or delivery
id, fingerprints that id alone, scopes by provider, keeps the record past
the provider's redelivery window and stores a 2xx only, so a 404 ("no such
order yet") is not replayed to the next delivery. The proof runs through
the test client on every backend and over gunicorn (sequential and
concurrent deliveries) on PostgreSQL, MariaDB and SQLite.
"""

from __future__ import annotations

import gc
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.core.exceptions import ImproperlyConfigured
from django.test import AsyncClient, Client, override_settings
from rest_framework.views import APIView

from django_idempotency import idempotent, idempotent_function, webhooks
from django_idempotency.checks import check_view_options
from django_idempotency.contrib.drf import IdempotentMixin
from django_idempotency.models import IdempotencyKey
from django_idempotency.testing import assert_idempotent
from tests import webhook_preset_views as views
from tests.models import Order, Publication
from tests.server import GunicornServer
from tests.server_fixtures import controlled

REPLAYED = "Idempotent-Replayed"


@dataclass(frozen=True)
class Provider:
    """One preset's receiver: where it is and how its provider signs a delivery."""

    name: str
    path: str
    #: The record's scope.
    scope: str
    #: The provider's documented redelivery window, which the record must outlast.
    window: timedelta
    #: ``(event_id, order, envelope) -> (body, headers)``, signed as the provider would.
    build: Callable[[str | None, str, int], tuple[bytes, dict[str, str]]]
    #: Where the id was missing from, as the 400 says.
    source: str


def _stripe(event_id: str | None, order: str, envelope: int) -> tuple[bytes, dict[str, str]]:
    event: dict[str, Any] = {"type": "order.paid", "data": {"order": order}}
    if event_id is not None:
        event["id"] = event_id
    # Stripe counts down the endpoints still to be told: the envelope changes.
    event["pending_webhooks"] = envelope
    body = json.dumps(event).encode()
    return body, views.stripe.headers(body)


def _github(event_id: str | None, order: str, envelope: int) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"action": "paid", "data": {"order": order}, "hook": envelope}).encode()
    headers = views.github.headers(body)
    if event_id is not None:
        headers["X-GitHub-Delivery"] = event_id
    return body, headers


def _standard(event_id: str | None, order: str, envelope: int) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"type": "order.paid", "data": {"order": order}, "n": envelope}).encode()
    if event_id is None:
        # The id is signed with the body: a delivery without one is unsigned.
        return body, {"webhook-timestamp": str(int(time.time()))}
    # Each attempt is signed anew, at its own time.
    return body, views.standard.headers(body, id=event_id, timestamp=int(time.time()) - envelope)


STRIPE = Provider(
    "stripe",
    "/webhooks/preset/stripe/",
    "webhook:stripe",
    timedelta(days=3),
    _stripe,
    'the event\'s "id" in the JSON body',
)
GITHUB = Provider(
    "github",
    "/webhooks/preset/github/",
    "webhook:github",
    timedelta(days=7),
    _github,
    "the X-GitHub-Delivery header",
)
STANDARD = Provider(
    "standard",
    "/webhooks/preset/standard/",
    "webhook:standard",
    timedelta(hours=75, minutes=30),
    _standard,
    "the webhook-id header",
)
PRESETS = [STRIPE, GITHUB, STANDARD]
#: The same receivers under other adapters: the DRF mixin, an async view, lease mode.
RECEIVERS = [
    *PRESETS,
    replace(GITHUB, name="github-drf", path="/webhooks/preset/github/drf/"),
    replace(STANDARD, name="standard-async", path="/webhooks/preset/standard/async/"),
    replace(STRIPE, name="stripe-lease", path="/webhooks/preset/stripe/lease/"),
]


def new_event() -> str:
    return f"evt_{uuid.uuid4().hex[:12]}"


def new_order() -> str:
    name = f"order-{uuid.uuid4().hex[:8]}"
    Order.objects.create(item=name, quantity=0)
    return name


def paid(order: str) -> int:
    """How many times ``order`` was marked paid: the effect."""
    return Order.objects.get(item=order).quantity


def publications(event_id: str) -> int:
    return Publication.objects.filter(event=event_id).count()


@pytest.fixture
def client() -> Client:
    return Client(raise_request_exception=False)


def deliver(
    client: Client,
    provider: Provider,
    event_id: str | None,
    order: str,
    envelope: int = 1,
    **extra: str,
) -> Any:
    body, headers = provider.build(event_id, order, envelope)
    headers.update(extra)
    if provider.name.endswith("async"):
        from asgiref.sync import async_to_sync

        send = async_to_sync(AsyncClient(raise_request_exception=False).post)
        return send(provider.path, body, content_type="application/json", headers=headers)
    return client.post(provider.path, body, content_type="application/json", headers=headers)


#: Signatures made with a secret the receivers do not have: fresh, well formed, forged.
FORGERS = {
    "webhook:stripe": webhooks.stripe_signature("whsec_not-the-endpoints"),
    "webhook:github": webhooks.github_signature("not-the-endpoints"),
    "webhook:standard": webhooks.standard_signature("whsec_bm90LXRoZS1lbmRwb2ludHMtc2VjcmV0"),
}


def forge(provider: Provider, event: str, order: str) -> tuple[bytes, dict[str, str]]:
    """A delivery like the provider's, signed now with another secret."""
    body, headers = provider.build(event, order, 1)
    forger = FORGERS[provider.scope]
    if provider.scope == "webhook:standard":
        return body, forger.headers(body, id=event)
    return body, {**headers, **forger.headers(body)}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("provider", RECEIVERS, ids=lambda p: p.name)
class PresetTests:
    def test_a_redelivery_with_a_changed_envelope_replays(self, client, provider):
        event, order = new_event(), new_order()

        first = deliver(client, provider, event, order, envelope=1)
        again = deliver(client, provider, event, order, envelope=0)

        assert first.status_code == 200, first.content
        assert REPLAYED not in first
        assert again.status_code == 200
        assert again[REPLAYED] == "true"
        assert again.content == first.content
        assert paid(order) == 1
        assert publications(event) == 1
        record = IdempotencyKey.objects.get()
        assert (record.scope, record.key) == (provider.scope, event)

    def test_the_record_outlasts_the_providers_redelivery_window(self, client, provider):
        event = new_event()

        deliver(client, provider, event, new_order())

        record = IdempotencyKey.objects.get()
        assert record.expires_at - record.created_at > provider.window

    def test_a_404_is_not_stored_and_the_event_runs_once_the_order_exists(self, client, provider):
        event, order = new_event(), f"order-{uuid.uuid4().hex[:8]}"

        unknown = deliver(client, provider, event, order)

        assert unknown.status_code == 404
        assert not IdempotencyKey.objects.exists()
        Order.objects.create(item=order, quantity=0)
        later = deliver(client, provider, event, order, envelope=0)
        last = deliver(client, provider, event, order, envelope=0)
        assert later.status_code == 200
        assert REPLAYED not in later
        assert last[REPLAYED] == "true"
        assert paid(order) == 1
        assert publications(event) == 1

    def test_a_delivery_without_the_id_is_400_and_claims_nothing(self, client, provider):
        order = new_order()

        response = deliver(client, provider, None, order)

        assert response.status_code == 400
        # DRF's exception handler renders the mixin's errors; plain views answer problem+json.
        drf = provider.name.endswith("drf")
        assert response["Content-Type"] == (
            "application/json" if drf else "application/problem+json"
        )
        if provider.scope != "webhook:standard":
            # Standard Webhooks sign the id: without one, the signature fails first.
            assert provider.source in response.json()["detail"]
        assert not IdempotencyKey.objects.exists()
        assert paid(order) == 0

    def test_a_forged_delivery_claims_nothing(self, client, provider):
        event, order = new_event(), new_order()
        body, headers = forge(provider, event, order)

        refused = client.post(provider.path, body, content_type="application/json", headers=headers)

        assert refused.status_code == 400
        assert not IdempotencyKey.objects.exists()
        genuine = deliver(client, provider, event, order)
        assert genuine.status_code == 200
        assert REPLAYED not in genuine
        assert paid(order) == 1


@pytest.mark.django_db(transaction=True)
class StoreOptionTests:
    """``store`` narrows which responses complete the key; a refused one is a 5xx's ending."""

    @pytest.fixture(autouse=True)
    def verdict(self) -> Iterator[dict[str, Any]]:
        yield views.verdict
        views.verdict["value"] = True

    def post(self, client: Client, path: str, key: str = "k-1") -> Any:
        return client.post(
            path, {}, content_type="application/json", headers={"Idempotency-Key": key}
        )

    def test_a_refused_response_rolls_back_and_the_retry_runs(self, client, verdict):
        verdict["value"] = False

        first = self.post(client, "/webhooks/store/verdict/")

        assert first.status_code == 201
        assert not IdempotencyKey.objects.exists()
        assert not Order.objects.exists()
        verdict["value"] = True
        retry = self.post(client, "/webhooks/store/verdict/")
        again = self.post(client, "/webhooks/store/verdict/")
        assert REPLAYED not in retry
        assert again[REPLAYED] == "true"
        assert Order.objects.count() == 1

    def test_it_only_narrows_a_5xx_is_never_stored(self, client, verdict):
        first = self.post(client, "/webhooks/store/verdict/?status=503")

        assert first.status_code == 503
        assert not IdempotencyKey.objects.exists()
        assert not Order.objects.exists()

    def test_a_verdict_that_is_not_a_bool_is_an_error_and_stores_nothing(self, client, verdict):
        verdict["value"] = "yes"

        response = self.post(client, "/webhooks/store/verdict/")

        assert response.status_code == 500
        assert not IdempotencyKey.objects.exists()
        assert not Order.objects.exists()

    def test_lease_mode_a_verdict_that_is_not_a_bool_completes_the_key_with_a_refusal(
        self, client, verdict
    ):
        # The view has acted: it must never run again for this key, whatever comes.
        verdict["value"] = "yes"

        first = self.post(client, "/webhooks/store/verdict/lease/")
        verdict["value"] = True
        again = self.post(client, "/webhooks/store/verdict/lease/")

        assert first.status_code == 500
        assert again.status_code == 500
        assert again.json()["type"].endswith("result-not-stored")
        assert again[REPLAYED] == "true"
        assert Order.objects.filter(item="verdict-lease").count() == 1
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED

    def test_a_dotted_path(self, client):
        refused = self.post(client, "/webhooks/store/dotted/?status=400")
        kept = self.post(client, "/webhooks/store/dotted/?status=201")
        replay = self.post(client, "/webhooks/store/dotted/?status=201")

        assert refused.status_code == 400
        assert REPLAYED not in kept
        assert replay[REPLAYED] == "true"
        assert Order.objects.count() == 1

    def test_lease_mode_releases_a_refused_response(self, client):
        event, order = new_event(), f"order-{uuid.uuid4().hex[:8]}"

        unknown = deliver(
            client, replace(STRIPE, path="/webhooks/preset/stripe/lease/"), event, order
        )

        assert unknown.status_code == 404
        assert not IdempotencyKey.objects.exists()


class StoreDefinitionTests:
    """A ``store`` that is neither a callable nor a dotted path fails where it is written."""

    @pytest.mark.parametrize("value", [True, 42, "not a path"])
    def test_the_decorator_refuses_it(self, value):
        with pytest.raises(ImproperlyConfigured, match=r"@idempotent\(store=\.\.\.\)") as raised:

            @idempotent(store=value)
            def view(request):  # pragma: no cover - never called
                raise AssertionError

        assert "f(response) -> bool" in str(raised.value)

    def test_an_async_store_is_refused(self):
        async def accept(response: Any) -> bool:  # pragma: no cover - never called
            return True

        with pytest.raises(ImproperlyConfigured, match="not async"):

            @idempotent(store=accept)
            def view(request):  # pragma: no cover - never called
                raise AssertionError

    def test_the_mixin_refuses_it_when_the_class_is_created(self):
        with pytest.raises(ImproperlyConfigured, match=r"Broken\.idempotency_store has an invalid"):

            class Broken(IdempotentMixin, APIView):
                idempotency_store = 42

    def test_the_mixin_lists_the_attribute(self):
        assert IdempotentMixin.idempotency_store is None

    def test_a_dotted_path_that_fails_to_import_is_e118(self):
        @idempotent(store="tests.no_such_module.accept")
        def broken_store(request):  # pragma: no cover - never called
            raise AssertionError

        [error] = [e for e in check_view_options() if "broken_store" in e.msg]
        assert error.id == "django_idempotency.E118"
        del broken_store
        gc.collect()

    def test_store_is_no_setting(self):
        refused = pytest.raises(
            ImproperlyConfigured, match=r"IDEMPOTENCY\['STORE'\] is not a known"
        )
        with refused, override_settings(IDEMPOTENCY={"STORE": "x.y"}):
            pass  # pragma: no cover - refused on entry

    def test_functions_take_no_store(self):
        with pytest.raises(TypeError, match="unexpected keyword argument 'store'"):
            idempotent_function(key=lambda: "k", store=webhooks.success_only)

    def test_presets_are_plain_dicts_of_options(self):
        for preset in (webhooks.STRIPE, webhooks.GITHUB, webhooks.STANDARD):
            assert preset["required"] is True
            assert preset["store"] is webhooks.success_only
            idempotent(**preset)(lambda request: None)  # every value passes its option's rule

    def test_a_body_nested_past_pythons_limit_has_no_event_id(self):
        from django.test import RequestFactory

        request = RequestFactory().post("/", b"[" * 100_000, content_type="application/json")

        assert webhooks.STRIPE["key"](request) is None

    def test_success_only(self):
        class Answer:
            def __init__(self, status_code: int) -> None:
                self.status_code = status_code

        assert [webhooks.success_only(Answer(s)) for s in (199, 200, 204, 299, 300, 404)] == [
            False,
            True,
            True,
            True,
            False,
            False,
        ]


class SignatureTests:
    """The signature checks, on requests made by Django's request factory."""

    def request(self, body: bytes, headers: dict[str, str]) -> Any:
        from django.test import RequestFactory

        return RequestFactory().post("/", body, content_type="application/json", headers=headers)

    def test_stripe_accepts_any_of_several_v1_while_a_secret_is_rolled(self):
        body = b'{"id": "evt_1"}'
        good = views.stripe.headers(body)["Stripe-Signature"]
        timestamp, digest = good.split(",")
        rolled = {"Stripe-Signature": f"{timestamp},v1={'0' * 64},{digest}"}

        assert views.stripe.is_valid(self.request(body, rolled))

    def test_stripe_refuses_an_old_timestamp_and_a_changed_body(self):
        body = b'{"id": "evt_1"}'
        old = views.stripe.headers(body, timestamp=int(time.time()) - 301)

        assert not views.stripe.is_valid(self.request(body, old))
        assert not views.stripe.is_valid(
            self.request(b'{"id": "evt_2"}', views.stripe.headers(body))
        )
        assert not views.stripe.is_valid(self.request(body, {}))

    def test_github_checks_the_body(self):
        body = b'{"action": "opened"}'

        assert views.github.is_valid(self.request(body, views.github.headers(body)))
        assert not views.github.is_valid(self.request(body + b" ", views.github.headers(body)))

    def test_standard_accepts_any_of_several_signatures(self):
        body = b'{"type": "x"}'
        headers = views.standard.headers(body, id="msg_1")
        headers["webhook-signature"] = "v1a,c29tZQ== " + headers["webhook-signature"]

        assert views.standard.is_valid(self.request(body, headers))
        headers["webhook-id"] = "msg_2"  # the id is signed
        assert not views.standard.is_valid(self.request(body, headers))

    def test_a_secret_read_when_checked(self):
        secret = {"value": "one"}
        signature = webhooks.github_signature(lambda: secret["value"])
        body = b"{}"
        headers = signature.headers(body)
        secret["value"] = "two"

        assert not signature.is_valid(self.request(body, headers))

    @pytest.mark.parametrize(
        "headers",
        [
            {"Stripe-Signature": "t={now},v1=\u00e9"},
            {"Stripe-Signature": "t=" + "9" * 400 + ",v1=00"},
            {"Stripe-Signature": "t=,v1="},
            {"Stripe-Signature": "t={now},t={now},v1=00"},
        ],
    )
    def test_a_malformed_stripe_header_is_refused_not_an_error(self, headers):
        body = b'{"id": "evt_1"}'
        now = str(int(time.time()))
        sent = {name: value.replace("{now}", now) for name, value in headers.items()}

        assert views.stripe.is_valid(self.request(body, sent)) is False

    def test_a_malformed_github_or_standard_header_is_refused_not_an_error(self):
        body = b"{}"
        assert not views.github.is_valid(
            self.request(body, {"X-Hub-Signature-256": "sha256=\u00e9"})
        )
        headers = views.standard.headers(body, id="msg_1")
        for bad in ({"webhook-signature": "v1,\u00e9"}, {"webhook-timestamp": "9" * 400}):
            assert not views.standard.is_valid(self.request(body, {**headers, **bad}))

    def test_a_stripe_timestamp_ahead_of_this_host_is_accepted_as_stripe_does(self):
        body = b'{"id": "evt_1"}'
        ahead = views.stripe.headers(body, timestamp=int(time.time()) + 3600)

        assert views.stripe.is_valid(self.request(body, ahead))

    def test_a_standard_timestamp_past_the_tolerance_either_way_is_refused(self):
        body = b"{}"
        for shift in (-301, 301):
            headers = views.standard.headers(body, id="msg_1", timestamp=int(time.time()) + shift)
            assert not views.standard.is_valid(self.request(body, headers))

    @pytest.mark.parametrize("secret", ["", b"", "whsec_"])
    def test_an_empty_secret_is_refused_where_it_is_written(self, secret):
        maker = webhooks.standard_signature if secret == "whsec_" else webhooks.github_signature
        with pytest.raises(ImproperlyConfigured, match="secret"):
            maker(secret)

    def test_an_empty_secret_read_at_delivery_is_an_error_never_a_pass(self):
        signature = webhooks.github_signature(lambda: "")

        with pytest.raises(ImproperlyConfigured, match="set the endpoint's secret"):
            signature.is_valid(self.request(b"{}", {"X-Hub-Signature-256": "sha256=00"}))

    def test_a_secret_of_the_wrong_type_is_refused_where_it_is_written(self):
        with pytest.raises(TypeError, match=r"lambda: settings\.WEBHOOK_SECRET"):
            webhooks.stripe_signature(42)  # type: ignore[arg-type]

    def test_a_standard_secret_that_is_not_base64_says_so(self):
        with pytest.raises(ImproperlyConfigured, match="does not decode"):
            webhooks.standard_signature("whsec_not base64!")


@pytest.mark.django_db(transaction=True)
class AssertIdempotentTests:
    """The testing helper on a signed webhook: ``sign=`` and ``changed_body_replays=``."""

    def check(self, client: Client, order: str, **extra: Any) -> Any:
        event = {"id": new_event(), "type": "order.paid", "data": {"order": order}}
        return assert_idempotent(
            client,
            "post",
            "/webhooks/preset/stripe/",
            event,
            effect=lambda: paid(order),
            sign=views.stripe.headers,
            **extra,
        )

    def test_a_signed_stripe_receiver(self, client):
        order = new_order()

        check = self.check(client, order, changed_body_replays=True)

        assert check.mismatch is not None and check.mismatch[REPLAYED] == "true"
        assert paid(order) == 1

    def test_without_changed_body_replays_the_helper_expects_422(self, client):
        with pytest.raises(AssertionError, match="expected 422"):
            self.check(client, new_order())


# Over gunicorn, on every backend: gunicorn's workers share SQLite's file.

#: Deliveries of one event sent one after another, then at once.
SEQUENTIAL, CONCURRENT = 5, 10


@pytest.fixture(scope="module")
def webhook_server(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GunicornServer]:
    control = tmp_path_factory.mktemp("webhooks-control")
    settings = "tests.recovery_server_settings"
    with controlled(GunicornServer, settings, control, tmp_path_factory) as server:
        yield server


def send(
    server: GunicornServer, provider: Provider, event: str | None, order: str, **kw: Any
) -> requests.Response:
    body, headers = provider.build(event, order, kw.pop("envelope", 1))
    headers.update(kw.pop("headers", {}))
    query = kw.pop("query", "")
    return requests.post(
        f"{server.url}{provider.path}{query}",
        data=body,
        headers={"Content-Type": "application/json", **headers},
        timeout=30,
    )


@pytest.mark.server
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("provider", PRESETS, ids=lambda p: p.name)
class OverGunicornTests:
    def test_sequential_then_concurrent_deliveries_have_one_effect(self, webhook_server, provider):
        event, order = new_event(), new_order()

        answers = [
            send(webhook_server, provider, event, order, envelope=n, query="?hold=0.2")
            for n in range(SEQUENTIAL)
        ]
        with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
            answers += list(
                pool.map(
                    lambda n: send(webhook_server, provider, event, order, envelope=n),
                    range(CONCURRENT),
                )
            )

        statuses = Counter(answer.status_code for answer in answers)
        assert statuses == {200: SEQUENTIAL + CONCURRENT}, (statuses, webhook_server.log())
        originals = [a for a in answers if REPLAYED not in a.headers]
        assert len(originals) == 1
        assert all(a.content == originals[0].content for a in answers)
        assert paid(order) == 1
        assert publications(event) == 1
        record = IdempotencyKey.objects.get(scope=provider.scope, key=event)
        assert record.state == IdempotencyKey.State.COMPLETED
        assert record.expires_at - record.created_at > provider.window

    def test_concurrent_first_deliveries_have_one_effect(self, webhook_server, provider):
        event, order = new_event(), new_order()

        with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
            answers = list(
                pool.map(
                    lambda n: send(
                        webhook_server, provider, event, order, envelope=n, query="?hold=0.5"
                    ),
                    range(CONCURRENT),
                )
            )

        statuses = Counter(answer.status_code for answer in answers)
        # Atomic mode: every duplicate waits for the original and replays it.
        assert statuses == {200: CONCURRENT}, (statuses, webhook_server.log())
        assert sum(REPLAYED not in a.headers for a in answers) == 1
        assert paid(order) == 1
        assert publications(event) == 1

    def test_a_404_is_not_stored_then_the_event_runs_once(self, webhook_server, provider):
        event, order = new_event(), f"order-{uuid.uuid4().hex[:8]}"

        unknown = [send(webhook_server, provider, event, order) for _ in range(2)]

        assert [a.status_code for a in unknown] == [404, 404]
        assert not IdempotencyKey.objects.filter(key=event).exists()
        Order.objects.create(item=order, quantity=0)
        with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
            later = list(
                pool.map(lambda n: send(webhook_server, provider, event, order), range(CONCURRENT))
            )
        assert Counter(a.status_code for a in later) == {200: CONCURRENT}
        assert paid(order) == 1
        assert publications(event) == 1

    def test_a_forged_delivery_claims_nothing(self, webhook_server, provider):
        event, order = new_event(), new_order()
        body, headers = forge(provider, event, order)

        forged = requests.post(
            f"{webhook_server.url}{provider.path}",
            data=body,
            headers={"Content-Type": "application/json", **headers},
            timeout=30,
        )

        assert forged.status_code == 400
        assert not IdempotencyKey.objects.filter(key=event).exists()
        assert paid(order) == 0
        assert send(webhook_server, provider, event, order).status_code == 200
        assert paid(order) == 1
