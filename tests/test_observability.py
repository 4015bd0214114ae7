"""Outcomes made visible: signals, structured log fields, OpenTelemetry span attributes."""

from __future__ import annotations

import importlib
import logging
import sys
import threading

import pytest
from django.db import connection
from django.test import Client
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from django_idempotency import observability, signals
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import mask_key
from tests import views
from tests.clients import post_json

ALL_SIGNALS = (
    "key_claimed",
    "response_stored",
    "response_replayed",
    "request_conflict",
    "fingerprint_mismatch",
    "claim_released",
    "wait_timed_out",
)
KEY = "observed-key-0815"


@pytest.fixture
def received():
    events: list[str] = []
    receivers = {}
    for name in ALL_SIGNALS:

        def receiver(sender, request, idempotency, name=name, **kwargs):
            events.append(name)

        receivers[name] = receiver
        getattr(signals, name).connect(receiver)
    yield events
    for name, receiver in receivers.items():
        getattr(signals, name).disconnect(receiver)


@pytest.fixture(scope="module")
def tracing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("tests"), exporter
    provider.shutdown()


def post(client, url: str = "/orders/", body: dict | None = None, key: str = KEY):
    """``post_json`` with this module's key, which no record may show in clear."""
    return post_json(client, url, body or {"item": "a"}, key)


@pytest.mark.django_db
class SignalTests:
    def test_first_request_is_claimed_then_stored_and_retry_replayed(self, client, received):
        post(client)
        post(client)

        assert received == ["key_claimed", "response_stored", "response_replayed"]

    def test_unstored_response_sends_no_stored_signal(self, client, received):
        post(client, body={"item": "a", "status": 503})

        assert received == ["key_claimed"]

    def test_lease_handler_failure_releases_the_claim(self, received):
        client = Client(raise_request_exception=False)
        assert post(client, "/orders/lease/", {"raise": True}).status_code == 500
        assert post(client, "/orders/lease/", {"status": 503}).status_code == 503
        assert post(client, "/orders/lease/").status_code == 201

        assert received == [
            "key_claimed",
            "claim_released",
            "key_claimed",
            "claim_released",
            "key_claimed",
            "response_stored",
        ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.concurrency
def test_duplicate_past_wait_signals_wait_timed_out_then_conflict(received):
    claimed = threading.Event()
    signals.key_claimed.connect(lambda **kwargs: claimed.set(), weak=False, dispatch_uid="t")
    original: list = []

    def send_original() -> None:
        original.append(post(Client(), "/orders/short-wait/?hold=1.5"))
        connection.close()

    try:
        thread = threading.Thread(target=send_original)
        thread.start()
        assert claimed.wait(10)
        duplicate = post(Client(), "/orders/short-wait/?hold=1.5")
        thread.join(20)
    finally:
        signals.key_claimed.disconnect(dispatch_uid="t")
        connection.close()

    assert duplicate.status_code == 409
    assert original[0].status_code == 201
    assert "wait_timed_out" in received
    assert received.index("wait_timed_out") + 1 == received.index("request_conflict")


@pytest.mark.django_db
class LogFieldTests:
    def test_every_outcome_is_logged_with_structured_fields(self, client, caplog):
        caplog.set_level(logging.DEBUG, logger="django_idempotency")
        post(client)
        post(client)
        post(client, body={"item": "b"})

        outcomes = [
            record
            for record in caplog.records
            if getattr(record, "idempotency_outcome", None) is not None
        ]
        assert [r.idempotency_outcome for r in outcomes] == [
            "claimed",
            "stored",
            "replayed",
            "mismatch",  # the DEBUG record of the outcome
            "mismatch",  # the INFO record about the 422
        ]
        for record in outcomes:
            assert record.idempotency_key == mask_key(KEY)
            assert record.idempotency_scope == "anonymous"
            assert record.idempotency_view == "tests.views.create_order"
            assert record.idempotency_attempt == 1
        claim, stored, replayed = outcomes[:3]
        assert claim.idempotency_waited_ms >= 0
        assert replayed.idempotency_waited_ms >= 0
        assert not hasattr(stored, "idempotency_waited_ms")

    def test_key_never_appears_in_clear_in_any_record(self, client, caplog):
        caplog.set_level(logging.DEBUG)
        client = Client(raise_request_exception=False)
        for url, body in [
            ("/orders/", {"item": "a"}),
            ("/orders/", {"item": "a"}),
            ("/orders/", {"item": "b"}),
            ("/orders/lease/", {"raise": True}),
        ]:
            post(client, url, body)

        assert caplog.records
        for record in caplog.records:
            assert KEY not in record.getMessage()
            assert all(KEY not in str(value) for value in vars(record).values())

    def test_conflict_log_record_carries_the_fields(self, client, caplog):
        from django_idempotency.models import IdempotencyKey
        from tests.factories import IdempotencyKeyFactory

        post(client)
        record = IdempotencyKey.objects.get()
        record.delete()
        IdempotencyKeyFactory(key=KEY, in_flight=True, fingerprint=record.fingerprint)
        caplog.set_level(logging.INFO, logger="django_idempotency")

        assert post(client).status_code == 409
        (logged,) = [r for r in caplog.records if r.levelno == logging.INFO]
        assert logged.idempotency_outcome == "conflict"
        assert logged.idempotency_key == mask_key(KEY)


@pytest.mark.django_db
class MaskedInfoTests:
    """``request.idempotency`` may be logged as it is: its repr never holds the key."""

    def test_repr_masks_the_key_and_shows_scope_and_fingerprint_prefix(self):
        info = IdempotencyInfo(key="receipt-7", scope="user:42", fingerprint="ab" * 32)

        assert repr(info) == (
            f"IdempotencyInfo(key=<masked {mask_key('receipt-7')}>, scope='user:42', "
            f"fingerprint='{'ab' * 6}...')"
        )
        assert "receipt-7" not in repr(info)
        assert "receipt-7" not in str(info)
        assert "receipt-7" not in f"{[info]}"

    def test_a_receiver_that_logs_the_info_leaks_no_key(self, client, caplog):
        logger = logging.getLogger("tests.receivers")

        def receiver(sender, request, idempotency, **kwargs):
            logger.warning("replayed %r", idempotency)

        signals.response_replayed.connect(receiver)
        try:
            post(client)
            post(client)
        finally:
            signals.response_replayed.disconnect(receiver)
        (logged,) = [r.getMessage() for r in caplog.records if r.name == "tests.receivers"]
        assert KEY not in logged
        assert mask_key(KEY) in logged
        assert "scope='anonymous'" in logged


@pytest.mark.django_db
class OpenTelemetryTests:
    def test_span_gets_outcome_replayed_and_waited(self, client, tracing):
        tracer, exporter = tracing
        exporter.clear()
        with tracer.start_as_current_span("first"):
            post(client)
        with tracer.start_as_current_span("retry"):
            post(client)

        first, retry = exporter.get_finished_spans()
        assert first.attributes["idempotency.outcome"] == "stored"
        assert first.attributes["idempotency.replayed"] is False
        assert first.attributes["idempotency.waited_ms"] >= 0
        assert retry.attributes["idempotency.outcome"] == "replayed"
        assert retry.attributes["idempotency.replayed"] is True
        assert all(KEY not in str(value) for value in retry.attributes.values())

    def test_request_without_key_sets_nothing(self, client, tracing):
        tracer, exporter = tracing
        exporter.clear()
        with tracer.start_as_current_span("unprotected"):
            client.post("/orders/", b"{}", content_type="application/json")

        (span,) = exporter.get_finished_spans()
        assert not any(name.startswith("idempotency.") for name in span.attributes)

    def test_without_opentelemetry_nothing_is_set_and_requests_work(
        self, client, tracing, monkeypatch
    ):
        tracer, exporter = tracing
        exporter.clear()
        monkeypatch.setitem(sys.modules, "opentelemetry", None)
        try:
            importlib.reload(observability)
            assert observability._trace is None
            with tracer.start_as_current_span("first"):
                first = post(client)
            retry = post(client)
        finally:
            monkeypatch.undo()
            importlib.reload(observability)

        assert first.status_code == retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        (span,) = exporter.get_finished_spans()
        assert not any(name.startswith("idempotency.") for name in span.attributes)
        assert views.calls.value == 1


@pytest.mark.django_db
def test_a_log_record_names_the_function_that_logged(client, caplog):
    # Formatters with %(funcName)s, and error trackers grouping by it, see
    # where in the protocol a record comes from, not the logging helper.
    post(client)
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        assert post(client, body={"item": "pen"}).status_code == 422

    [record] = [r for r in caplog.records if "reused" in r.getMessage()]
    assert record.name == "django_idempotency.core"
    assert record.funcName == "_answer_duplicate"
