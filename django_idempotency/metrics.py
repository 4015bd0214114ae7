"""Counters through the OpenTelemetry metrics API, when ``opentelemetry-api`` is installed.

:mod:`django_idempotency.observability` calls :func:`add` for each outcome
worth counting. Without ``opentelemetry-api`` every call returns at once:
the import is tried once, when this module loads, never per request.

The counters are created on first use from the global meter provider, or
from the one given to :func:`use_meter_provider`. Created before the
project sets its provider, they are the API's proxies, which start
counting into the real provider once it is set, so the order in which the
project and this package start up does not matter. Every counter carries
one attribute, :data:`VIEW_ATTRIBUTE`, never a key or a scope: those are
unbounded, and a key is a bearer token. See the observability page of the
docs for the names and the dashboard built on them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from django_idempotency import __version__

#: The attribute naming the view (``module.qualname``) or task on every counter.
VIEW_ATTRIBUTE = "idempotency.view"
#: The instrumentation scope the counters are created under.
METER_NAME = "django_idempotency"


@dataclass(frozen=True)
class Metric:
    """One counter: its OpenTelemetry name, unit and description."""

    name: str
    unit: str
    description: str


CLAIMS = Metric(
    "idempotency.claims",
    "{claim}",
    "Keys claimed: requests whose handler runs under the key. Counts attempts: "
    "a claim rolled back (atomic) or released (lease) is claimed again by its retry.",
)
REPLAYS = Metric(
    "idempotency.replays",
    "{replay}",
    "Duplicates answered with the stored response, from the database or the replay cache.",
)
MISMATCHES = Metric(
    "idempotency.mismatches",
    "{request}",
    "Keys reused with a different request (another fingerprint), answered 422.",
)
CONFLICTS = Metric(
    "idempotency.conflicts",
    "{request}",
    "Duplicates that arrived while the original was in progress, answered 409.",
)
CACHE_HITS = Metric(
    "idempotency.cache.hits",
    "{lookup}",
    "Replay cache lookups that found the completed response.",
)
CACHE_MISSES = Metric(
    "idempotency.cache.misses",
    "{lookup}",
    "Replay cache lookups that fell through to the database (no entry, "
    "another fingerprint, an expired entry or a failing cache).",
)
RECOVERIES_STARTED = Metric(
    "idempotency.recoveries.started",
    "{recovery}",
    "Abandoned claims (a lease that ran out) a request began to recover.",
)
RECOVERIES_COMPLETED = Metric(
    "idempotency.recoveries.completed",
    "{recovery}",
    "Recoveries of abandoned claims that ended with the key completed.",
)

METRICS = (
    CLAIMS,
    REPLAYS,
    MISMATCHES,
    CONFLICTS,
    CACHE_HITS,
    CACHE_MISSES,
    RECOVERIES_STARTED,
    RECOVERIES_COMPLETED,
)


def _load_metrics_api() -> Any:
    try:
        from opentelemetry import metrics
    except ImportError:
        return None
    return metrics


_api = _load_metrics_api()
#: Whether anything is counted at all: ``opentelemetry-api`` is installed.
enabled = _api is not None

_lock = threading.Lock()
_provider: Any = None
_counters: dict[str, Any] | None = None  # by metric name


def use_meter_provider(provider: Any) -> None:
    """Count through ``provider`` from now on; ``None`` goes back to the global one.

    OpenTelemetry lets a process set its global meter provider once, so a
    test suite that wants to read the counters (with the SDK's
    ``InMemoryMetricReader``) gives its own provider here and takes it back
    afterwards, leaving the global one to the application.
    """
    global _provider, _counters
    with _lock:
        _provider = provider
        _counters = None


def add(metric: Metric, view: str) -> None:
    """Add one to ``metric`` for ``view``; nothing without ``opentelemetry-api``."""
    if _api is None:
        return
    counters = _counters if _counters is not None else _create_counters()
    counters[metric.name].add(1, {VIEW_ATTRIBUTE: view})


def _create_counters() -> dict[str, Any]:
    global _counters
    with _lock:
        # Another thread may have created them while this one waited.
        if _counters is None:
            meter = _api.get_meter(METER_NAME, __version__, meter_provider=_provider)
            _counters = {
                metric.name: meter.create_counter(
                    metric.name, unit=metric.unit, description=metric.description
                )
                for metric in METRICS
            }
        return _counters
