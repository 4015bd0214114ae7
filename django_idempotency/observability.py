"""Where each outcome of a protected request becomes visible outside the package.

:func:`record`, called once per outcome, sends the signal, logs at
``DEBUG`` with structured fields and, with ``opentelemetry-api``
installed, sets span attributes and adds to a counter.

Counters are created on first use from the global meter provider (or
:func:`use_meter_provider`'s); created before the project sets its
provider, they are proxies that count into it once set, so start-up order
does not matter. Each carries only :data:`VIEW_ATTRIBUTE`, never a key or
a scope: those are unbounded, and a key is a bearer token.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from django.dispatch import Signal
from django.http import HttpRequest

from django_idempotency import __version__, signals
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import mask_key

logger = logging.getLogger(__name__)

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

    For tests: the global provider can be set only once per process.
    """
    global _provider, _counters
    with _lock:
        _provider = provider
        _counters = None


def add(metric: Metric, view: str) -> None:
    """Add one to ``metric`` for ``view``; nothing without ``opentelemetry-api``."""
    if _api is None:
        return
    (_counters or _create_counters())[metric.name].add(1, {VIEW_ATTRIBUTE: view})


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


#: The ``outcome`` of log records and of the ``idempotency.outcome`` span attribute.
OUTCOMES: dict[Signal, str] = {
    signals.key_claimed: "claimed",
    signals.response_stored: "stored",
    signals.response_replayed: "replayed",
    signals.request_conflict: "conflict",
    signals.fingerprint_mismatch: "mismatch",
    signals.claim_released: "released",
    signals.wait_timed_out: "wait_timed_out",
    signals.claim_taken_over: "taken_over",
    signals.claim_recovered: "recovered",
    signals.claim_held: "held",
}

#: The counter each outcome adds to; the others are not counted.
_COUNTED: dict[str, Metric] = {
    "claimed": CLAIMS,
    "replayed": REPLAYS,
    "mismatch": MISMATCHES,
    "conflict": CONFLICTS,
}

# Outcomes decided while claiming: their ``waited_ms`` is mostly waiting on an original.
_CLAIM_OUTCOMES = frozenset({"claimed", "replayed", "conflict", "mismatch", "wait_timed_out"})


def _load_trace() -> Any:
    # Imported once: a failed import on every request would scan sys.path.
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace


_trace = _load_trace()


def view_name(sender: Any) -> str:
    """``module.qualname`` of a view function or DRF view class, for logs and labels."""
    module = getattr(sender, "__module__", None)
    name = getattr(sender, "__qualname__", None) or type(sender).__qualname__
    return f"{module}.{name}" if module else name


def log_fields(
    outcome: str, sender: Any, info: IdempotencyInfo, started: float | None = None
) -> dict[str, Any]:
    """The ``extra=`` of a log record: flat, prefixed fields, the key masked."""
    fields: dict[str, Any] = {
        "idempotency_outcome": outcome,
        "idempotency_scope": info.scope,
        "idempotency_key": mask_key(info.key),
        "idempotency_view": view_name(sender),
        # 1, or n + 1 once a request took over a claim abandoned n times.
        "idempotency_attempt": info.attempt,
    }
    if started is not None:
        fields["idempotency_waited_ms"] = waited_ms(started)
    return fields


def waited_ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)


def record(
    signal: Signal,
    sender: Any,
    request: HttpRequest,
    info: IdempotencyInfo,
    started: float,
) -> None:
    """Send ``signal`` and report its outcome; ``started`` is the claim's :func:`time.monotonic`."""
    outcome = OUTCOMES[signal]
    # Each consumer is asked first whether it listens, so an unobserved request pays nothing.
    waited = started if outcome in _CLAIM_OUTCOMES else None
    if logger.isEnabledFor(logging.DEBUG):
        fields = log_fields(outcome, sender, info, waited)
        logger.debug(
            "Idempotency key %s in scope %r: %s",
            fields["idempotency_key"],
            info.scope,
            outcome,
            extra=fields,
        )
    if _trace is not None:
        span = _trace.get_current_span()
        if span.is_recording():
            _set_span_attributes(span, outcome, waited, info)
    if _api is not None:
        counted = _COUNTED.get(outcome)
        if counted is not None:
            (_counters or _create_counters())[counted.name].add(
                1, {VIEW_ATTRIBUTE: view_name(sender)}
            )
    # As Django's send(): no receivers is told before has_listeners() takes the lock.
    if not signal.receivers or not signal.has_listeners(sender):
        return
    # A receiver that raises must not turn a stored response into a 500 nor
    # leave a claimed key stuck: its error is logged, not raised.
    for receiver, result in signal.send_robust(sender=sender, request=request, idempotency=info):
        if isinstance(result, Exception):
            fields = log_fields(outcome, sender, info, waited)
            logger.error(
                "A receiver of the %s signal raised for idempotency key %s in scope %r: %r",
                outcome,
                fields["idempotency_key"],
                info.scope,
                result,
                exc_info=result,
                extra={**fields, "idempotency_receiver": getattr(receiver, "__qualname__", None)},
            )


def _set_span_attributes(
    span: Any, outcome: str, started: float | None, info: IdempotencyInfo
) -> None:
    waited = None if started is None else waited_ms(started)
    # A later outcome overwrites an earlier one: the span ends with the final.
    span.set_attribute("idempotency.outcome", outcome)
    span.set_attribute("idempotency.replayed", outcome == "replayed")
    span.set_attribute("idempotency.attempt", info.progress.attempt)
    if waited is not None:
        span.set_attribute("idempotency.waited_ms", waited)


def cache_looked_up(sender: Any, *, hit: bool) -> None:
    """Count a replay-cache lookup for the view or task ``sender``: a hit or a miss."""
    if _api is not None:
        add(CACHE_HITS if hit else CACHE_MISSES, view_name(sender))


def record_recovery(step: Literal["started", "completed"], sender: Any) -> None:
    """Count a step of recovering an abandoned claim for the view or task ``sender``.

    ``started`` before the ``recover`` policy runs; ``completed`` once the
    key is completed, by the policy's response or the handler run again.
    """
    add(RECOVERIES_STARTED if step == "started" else RECOVERIES_COMPLETED, view_name(sender))
