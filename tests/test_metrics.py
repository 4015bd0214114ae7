"""OpenTelemetry counters, read back with the SDK's in-memory reader.

Each test counts through a meter provider of its own, given to
:func:`django_idempotency.metrics.use_meter_provider`: the process-wide
provider can be set only once, and stays the application's.
"""

from __future__ import annotations

import builtins
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.cache import caches
from django.test import Client, override_settings
from opentelemetry import metrics as metrics_api
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from rest_framework.test import APIClient

from django_idempotency import metrics, observability
from django_idempotency.models import IdempotencyKey
from tests import views
from tests.clients import post_json
from tests.factories import IdempotencyKeyFactory

KEY = "metered-key-4711"
KEY_HEADER = {"Idempotency-Key": KEY}
VIEW = "tests.views.create_order"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "observability.rst"
REPLAY_CACHE = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "replay": {
        "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
        "LOCATION": "metrics-tests",
    },
}


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.use_meter_provider(provider)
    yield reader
    metrics.use_meter_provider(None)
    provider.shutdown()


def points(reader: InMemoryMetricReader) -> list[tuple[str, dict[str, Any], int]]:
    """Every data point read: (metric name, attributes, value)."""
    data = reader.get_metrics_data()
    found = []
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    found.append((metric.name, dict(point.attributes), point.value))
    return found


def counts(reader: InMemoryMetricReader) -> dict[tuple[str, str], int]:
    """(metric name, view): value, for every point with a non-zero value."""
    return {
        (name, attributes[metrics.VIEW_ATTRIBUTE]): value
        for name, attributes, value in points(reader)
        if value
    }


def post(client: Any, url: str = "/orders/", body: dict | None = None, key: str = KEY) -> Any:
    """``post_json`` with this module's key, which no metric attribute may carry."""
    return post_json(client, url, body or {"item": "a"}, key)


@pytest.mark.django_db
class OutcomeCounterTests:
    def test_claim_replay_and_mismatch_are_counted_for_the_view(self, client, reader):
        assert post(client).status_code == 201
        assert post(client)["Idempotent-Replayed"] == "true"
        assert post(client, body={"item": "b"}).status_code == 422

        assert counts(reader) == {
            ("idempotency.claims", VIEW): 1,
            ("idempotency.replays", VIEW): 1,
            ("idempotency.mismatches", VIEW): 1,
        }

    def test_duplicate_of_a_claim_in_progress_is_a_conflict(self, client, reader):
        post(client, "/orders/lease/")
        record = IdempotencyKey.objects.get()
        record.delete()
        IdempotencyKeyFactory(key=KEY, in_flight=True, fingerprint=record.fingerprint)
        reader.get_metrics_data()  # start from here: the claim above is counted already

        assert post(client, "/orders/lease/").status_code == 409

        assert counts(reader) == {
            ("idempotency.claims", "tests.views.create_order_lease"): 1,
            ("idempotency.conflicts", "tests.views.create_order_lease"): 1,
        }

    def test_drf_view_is_labelled_by_its_class(self, reader):
        client = APIClient()
        for _ in range(2):
            client.post("/drf/options-orders/", {"item": "a"}, format="json", headers=KEY_HEADER)
        view = "tests.drf_views.OptionsOrderViewSet"

        assert counts(reader) == {
            ("idempotency.claims", view): 1,
            ("idempotency.replays", view): 1,
        }

    def test_failed_attempts_are_claims_each(self, reader):
        client = Client(raise_request_exception=False)
        assert post(client, body={"item": "a", "status": 503}).status_code == 503
        assert post(client).status_code == 201

        assert counts(reader) == {("idempotency.claims", VIEW): 2}

    def test_request_without_key_counts_nothing(self, client, reader):
        client.post("/orders/", b"{}", content_type="application/json")

        assert counts(reader) == {}

    def test_attributes_name_the_view_and_never_the_key_or_scope(self, client, reader):
        post(client)
        post(client)
        post(client, body={"item": "b"})

        assert points(reader)
        for _name, attributes, _value in points(reader):
            assert attributes == {"idempotency.view": VIEW}
            assert all(KEY not in str(value) for value in attributes.values())
            assert all("anonymous" not in str(value) for value in attributes.values())


@pytest.fixture
def replay_cache() -> Iterator[None]:
    with override_settings(CACHES=REPLAY_CACHE, IDEMPOTENCY={"REPLAY_CACHE": "replay"}):
        yield
        # Its entries would outlive the records of this test's database.
        caches["replay"].clear()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("replay_cache")
class CacheCounterTests:
    def test_hits_and_misses_are_counted_for_the_view(self, client, reader):
        post(client)  # a miss: nothing cached yet; the claim caches the response
        post(client)  # a hit
        post(client, body={"item": "b"})  # another fingerprint: a miss, then 422

        assert counts(reader) == {
            ("idempotency.cache.misses", VIEW): 2,
            ("idempotency.cache.hits", VIEW): 1,
            ("idempotency.claims", VIEW): 1,
            ("idempotency.replays", VIEW): 1,
            ("idempotency.mismatches", VIEW): 1,
        }
        assert views.calls.value == 1

    def test_replay_from_the_database_after_an_eviction_is_a_miss(self, client, reader):
        post(client)
        caches["replay"].clear()
        assert post(client)["Idempotent-Replayed"] == "true"

        assert counts(reader) == {
            ("idempotency.cache.misses", VIEW): 2,
            ("idempotency.claims", VIEW): 1,
            ("idempotency.replays", VIEW): 1,
        }


class CacheLookupTests:
    def test_a_lookup_is_counted_with_the_view_it_was_for(self, reader):
        observability.cache_looked_up(views.create_order, hit=False)
        observability.cache_looked_up(views.create_order, hit=True)
        observability.cache_looked_up(views.OrderView, hit=True)

        assert counts(reader) == {
            ("idempotency.cache.misses", VIEW): 1,
            ("idempotency.cache.hits", VIEW): 1,
            ("idempotency.cache.hits", "tests.views.OrderView"): 1,
        }


class RecoveryCounterTests:
    def test_started_and_completed_are_counted_for_the_view_or_task(self, reader):
        observability.record_recovery("started", views.create_order)
        observability.record_recovery("started", views.create_order)
        observability.record_recovery("completed", views.create_order)
        observability.record_recovery("started", views.OrderView)

        assert counts(reader) == {
            ("idempotency.recoveries.started", VIEW): 2,
            ("idempotency.recoveries.completed", VIEW): 1,
            ("idempotency.recoveries.started", "tests.views.OrderView"): 1,
        }


class InstrumentTests:
    def test_names_units_and_descriptions(self, reader):
        for metric in metrics.METRICS:
            metrics.add(metric, VIEW)
        data = reader.get_metrics_data()
        (scope,) = data.resource_metrics[0].scope_metrics

        assert scope.scope.name == "django_idempotency"
        found = {m.name: (m.unit, m.description) for m in scope.metrics}
        assert found == {m.name: (m.unit, m.description) for m in metrics.METRICS}
        assert set(found) == {
            "idempotency.claims",
            "idempotency.replays",
            "idempotency.mismatches",
            "idempotency.conflicts",
            "idempotency.cache.hits",
            "idempotency.cache.misses",
            "idempotency.recoveries.started",
            "idempotency.recoveries.completed",
        }
        for metric in scope.metrics:
            assert metric.data.is_monotonic

    def test_every_metric_is_documented(self):
        text = DOCS.read_text()
        for metric in metrics.METRICS:
            assert f"``{metric.name}``" in text
            assert f"``{metric.unit}``" in text

    def test_the_global_meter_provider_is_left_to_the_application(self, reader):
        before = metrics_api.get_meter_provider()
        metrics.add(metrics.CLAIMS, VIEW)
        metrics.use_meter_provider(None)
        metrics.add(metrics.CLAIMS, VIEW)  # to the global provider: counted nowhere here

        assert metrics_api.get_meter_provider() is before
        assert counts(reader) == {("idempotency.claims", VIEW): 1}


@pytest.mark.django_db
def test_without_opentelemetry_nothing_is_imported_per_request(client, monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    tried: list[str] = []
    real_import = builtins.__import__

    def recording_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("opentelemetry"):
            tried.append(name)
        return real_import(name, *args, **kwargs)

    try:
        importlib.reload(observability)
        assert not observability.enabled
        monkeypatch.setattr(builtins, "__import__", recording_import)
        first = post(client)
        retry = post(client)
        observability.record_recovery("started", views.create_order)
    finally:
        monkeypatch.undo()
        importlib.reload(observability)
        importlib.reload(metrics)

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert tried == []
