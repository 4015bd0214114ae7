"""The protocol: run a handler at most once per (scope, key).

The decorator, the DRF mixin and the middleware are thin adapters over
:func:`protect`, which reads the key and hands the request to its mode:
:mod:`django_idempotency.atomic_mode` or :mod:`django_idempotency.lease_mode`
(the steps they share are in :mod:`django_idempotency.call`). Database
statements live in :mod:`django_idempotency.store`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from django.http import HttpRequest, HttpResponseBase

from django_idempotency.atomic_mode import AtomicCall
from django_idempotency.body import close_spools_with
from django_idempotency.call import Finalize, Handler, ProtectedCall
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import IdempotencyKeyRequired
from django_idempotency.fields import FINGERPRINT_COLUMN_LENGTH, fit_key_column
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import parse_key
from django_idempotency.lease_mode import LeaseCall
from django_idempotency.options import ViewOptions, resolve_options

__all__ = ["Finalize", "Handler", "protect"]


def protect(
    request: HttpRequest,
    handler: Handler,
    overrides: Mapping[str, Any] | ViewOptions,
    *,
    sender: Any,
    finalize: Finalize = lambda response: response,
) -> HttpResponseBase:
    """Run ``handler`` once per key and replay its response to every retry.

    ``finalize`` turns the handler's response into the bytes that will be
    sent (DRF rendering), so that what is stored is exactly what the client
    got. Raises an :class:`~django_idempotency.exceptions.IdempotencyError`
    for the 400/409/422 answers; adapters render those.
    """
    conf = idempotency_settings
    if not conf.enabled or hasattr(request, "idempotency"):
        # Disabled, or an outer layer (the middleware around a decorated view
        # it could not recognise) already protects this request: once is all.
        return handler()
    options = resolve_options(overrides)
    if request.method not in options.methods:
        return handler()
    header = conf.header
    raw_key = request.headers.get(header)
    if raw_key is None:
        if options.required:
            raise IdempotencyKeyRequired(f"This endpoint requires an {header} header.")
        return handler()
    key = parse_key(raw_key, conf.key_max_length, conf.key_min_length)
    info = IdempotencyInfo(
        key=key,
        scope=fit_key_column(options.scope(request)),
        fingerprint=_normalise_fingerprint(options.fingerprint(request)),
    )
    request.idempotency = info  # type: ignore[attr-defined]
    mode = AtomicCall if options.atomic else LeaseCall
    call = mode(request, info, handler, finalize, options, sender, conf.database)
    try:
        response = _run(call, conf.replay_cache)
    except BaseException:
        close_spools_with(request, None)
        raise
    close_spools_with(request, response)
    return response


def _run(call: ProtectedCall, cache_alias: str | None) -> HttpResponseBase:
    if cache_alias is not None:
        cached = call.replay_from_cache(cache_alias)
        if cached is not None:
            return cached
    return call.run()


def _normalise_fingerprint(fingerprint: str) -> str:
    # The column holds a SHA-256 hex digest; a custom function may return
    # anything, so longer values are digested rather than truncated.
    if len(fingerprint) <= FINGERPRINT_COLUMN_LENGTH:
        return fingerprint
    return hashlib.sha256(fingerprint.encode()).hexdigest()
