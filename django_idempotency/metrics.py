"""The OpenTelemetry counters, importable here as documented; they live in :mod:`.observability`."""

from django_idempotency.observability import (
    CACHE_HITS,
    CACHE_MISSES,
    CLAIMS,
    CONFLICTS,
    METER_NAME,
    METRICS,
    MISMATCHES,
    RECOVERIES_COMPLETED,
    RECOVERIES_STARTED,
    REPLAYS,
    VIEW_ATTRIBUTE,
    Metric,
    add,
    enabled,
    use_meter_provider,
)

__all__ = [
    "CACHE_HITS",
    "CACHE_MISSES",
    "CLAIMS",
    "CONFLICTS",
    "METER_NAME",
    "METRICS",
    "MISMATCHES",
    "RECOVERIES_COMPLETED",
    "RECOVERIES_STARTED",
    "REPLAYS",
    "VIEW_ATTRIBUTE",
    "Metric",
    "add",
    "enabled",
    "use_meter_provider",
]
