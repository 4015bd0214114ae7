"""Where each outcome of a protected request becomes visible outside the package.

:mod:`django_idempotency.core` calls :func:`record` once per outcome. This
module turns that into the signal, a ``DEBUG`` log record with structured
fields, and, when ``opentelemetry-api`` is installed, attributes on the
current span and a counter (:mod:`django_idempotency.metrics`), so the
protocol code carries one line per outcome instead of four. The replay
cache reports its lookups with :func:`cache_looked_up`, and recovery of
abandoned claims its steps with :func:`record_recovery`. See the
observability page of the docs.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from django.dispatch import Signal
from django.http import HttpRequest

from django_idempotency import metrics, signals
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import mask_key

logger = logging.getLogger(__name__)

#: The ``outcome`` field of log records and the ``idempotency.outcome`` span
#: attribute, by signal.
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
_COUNTED: dict[str, metrics.Metric] = {
    "claimed": metrics.CLAIMS,
    "replayed": metrics.REPLAYS,
    "mismatch": metrics.MISMATCHES,
    "conflict": metrics.CONFLICTS,
}

# Outcomes decided while claiming the key: their ``waited_ms`` is the time the
# request spent getting there, mostly waiting on an in-flight original.
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
    """The ``extra=`` of a log record: structured fields, the key masked.

    Prefixed, so that they never collide with :class:`logging.LogRecord`'s own
    attributes, and flat, so JSON formatters and structlog's ``ExtraAdder``
    pick them up as they are.
    """
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
    """Send ``signal`` and report its outcome to the log and the current span.

    ``started`` is the :func:`time.monotonic` reading taken when the request
    began claiming its key.
    """
    outcome = OUTCOMES[signal]
    # Each consumer is asked first whether it listens: a request with no
    # DEBUG logging, no span and no receiver pays for none of them.
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
    if metrics.enabled:
        counted = _COUNTED.get(outcome)
        if counted is not None:
            metrics.add(counted, view_name(sender))
    if not signal.has_listeners(sender):
        return
    # Receivers are the project's code (metrics, audit) running inside the
    # protocol: one that raises must not turn a stored response into a 500,
    # nor leave a claimed key stuck, so its error is logged, not raised.
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
    # Later outcomes of the same request overwrite earlier ones, so the span
    # ends with the final one (claimed, then stored).
    span.set_attribute("idempotency.outcome", outcome)
    span.set_attribute("idempotency.replayed", outcome == "replayed")
    span.set_attribute("idempotency.attempt", info.progress.attempt)
    if waited is not None:
        span.set_attribute("idempotency.waited_ms", waited)


def cache_looked_up(sender: Any, *, hit: bool) -> None:
    """Count a replay-cache lookup for the view or task ``sender``: a hit or a miss."""
    if metrics.enabled:
        metrics.add(metrics.CACHE_HITS if hit else metrics.CACHE_MISSES, view_name(sender))


def record_recovery(step: Literal["started", "completed"], sender: Any) -> None:
    """Count a step of recovering an abandoned claim for the view or task ``sender``.

    ``started`` when a request finds a claim whose lease ran out and sets
    about recovering it (before the project's ``recover`` policy runs);
    ``completed`` when that recovery ended with the key completed, by the
    policy's response or by the handler run again.
    """
    counted = metrics.RECOVERIES_STARTED if step == "started" else metrics.RECOVERIES_COMPLETED
    metrics.add(counted, view_name(sender))
