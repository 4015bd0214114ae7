"""The protocol: run a handler at most once per (scope, key).

The decorator and the DRF mixin are thin adapters over :func:`protect`, so
every rule of the HTTP contract lives here once. Database statements live
in :mod:`django_idempotency.store`.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections, transaction
from django.dispatch import Signal
from django.http import HttpRequest, HttpResponseBase
from django.utils import timezone

from django_idempotency import signals, store
from django_idempotency.conf import (
    RequestFunction,
    idempotency_settings,
    resolve_callable,
    to_timedelta,
)
from django_idempotency.exceptions import (
    FingerprintMismatch,
    IdempotencyKeyRequired,
    RequestInFlight,
)
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import mask_key, parse_key
from django_idempotency.models import IdempotencyKey
from django_idempotency.responses import capture, is_storable, replay

logger = logging.getLogger(__name__)

#: Per-view options; each defaults to the setting of the same name.
OPTION_NAMES = ("required", "ttl", "methods", "scope", "fingerprint", "atomic", "wait", "lease")
SCOPE_MAX_LENGTH = 255
FINGERPRINT_MAX_LENGTH = 64

Handler = Callable[[], HttpResponseBase]
Finalize = Callable[[HttpResponseBase], HttpResponseBase]


@dataclass(frozen=True)
class Options:
    required: bool
    ttl: timedelta
    methods: frozenset[str]
    scope: RequestFunction
    fingerprint: RequestFunction
    atomic: bool
    wait: float
    lease: timedelta


def check_options(options: Mapping[str, Any]) -> None:
    """Reject misspelt per-view options when the view is decorated, not per request."""
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"Unknown idempotency option(s): {', '.join(sorted(unknown))}. "
            f"Valid options are: {', '.join(OPTION_NAMES)}."
        )


def resolve_options(overrides: Mapping[str, Any]) -> Options:
    conf = idempotency_settings

    def pick(name: str) -> Any:
        value = overrides.get(name)
        return getattr(conf, name) if value is None else value

    return Options(
        required=bool(pick("required")),
        ttl=to_timedelta(pick("ttl")),
        methods=frozenset(method.upper() for method in pick("methods")),
        scope=resolve_callable(pick("scope"), "SCOPE"),
        fingerprint=resolve_callable(pick("fingerprint"), "FINGERPRINT"),
        atomic=bool(pick("atomic")),
        wait=float(pick("wait")),
        lease=to_timedelta(pick("lease")),
    )


def protect(
    request: HttpRequest,
    handler: Handler,
    overrides: Mapping[str, Any],
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
    key = parse_key(raw_key, conf.key_max_length)
    info = IdempotencyInfo(
        key=key,
        scope=_normalise_scope(options.scope(request)),
        fingerprint=_normalise_fingerprint(options.fingerprint(request)),
    )
    request.idempotency = info  # type: ignore[attr-defined]
    call = _ProtectedCall(request, info, handler, finalize, options, sender, conf.database)
    return call.run_atomic() if options.atomic else call.run_lease()


def _normalise_scope(scope: str) -> str:
    # The column is 255 wide; a longer scope (a long tenant name, a JWT
    # subject) is stored as its digest, which keeps it exact and unique.
    if len(scope) <= SCOPE_MAX_LENGTH:
        return scope
    return "sha256:" + hashlib.sha256(scope.encode()).hexdigest()


def _normalise_fingerprint(fingerprint: str) -> str:
    # The column holds a SHA-256 hex digest; a custom function may return
    # anything, so longer values are digested rather than truncated.
    if len(fingerprint) <= FINGERPRINT_MAX_LENGTH:
        return fingerprint
    return hashlib.sha256(fingerprint.encode()).hexdigest()


def _inside_transaction(using: str) -> bool:
    """Whether a transaction other than a test case's own is open.

    Lease mode must commit its claim before the view runs. The transaction
    Django's ``TestCase`` wraps each test in is tolerated, so lease-mode views
    stay testable there: on one connection the claim simply commits with the
    test's transaction.
    """
    blocks = connections[using].atomic_blocks
    return any(not getattr(block, "_from_testcase", False) for block in blocks)


class _Discard(Exception):
    """Leave the atomic block without committing, answering with ``response``."""

    def __init__(self, response: HttpResponseBase) -> None:
        self.response = response


@dataclass
class _ProtectedCall:
    request: HttpRequest
    info: IdempotencyInfo
    handler: Handler
    finalize: Finalize
    options: Options
    sender: Any
    using: str

    # Atomic mode (SPEC 4.1): claim, effect and stored response commit together.

    def run_atomic(self) -> HttpResponseBase:
        nested = connections[self.using].in_atomic_block
        for _ in range(store.CLAIM_ATTEMPTS):
            try:
                return self._atomic_attempt()
            except store.Retry:
                # A deadlock aborted our claim before the handler ran. On its
                # own transaction it is safe to start over; nested in the
                # request's transaction, that one is gone too.
                if nested:
                    break
        raise self._conflict(retry_after=1)

    def _atomic_attempt(self) -> HttpResponseBase:
        store.prepare_connection(self.using, self.options.wait)
        handler_started = False
        try:
            with transaction.atomic(using=self.using):
                now = timezone.now()
                claimed = store.claim(self.using, self._new_claim(now, "", None), self.options.wait)
                if isinstance(claimed, IdempotencyKey):
                    return self._answer_duplicate(claimed)
                handler_started = True
                self._send(signals.key_claimed)
                response = self.finalize(self.handler())
                if not is_storable(response):
                    raise _Discard(response)
                self._complete(claimed, None, response)
                return response
        except _Discard as discard:
            return discard.response
        except DatabaseError as exc:
            if handler_started:
                raise
            self._raise_claim_error(exc)
            raise

    # Lease mode (SPEC 4.2): the claim commits first; the handler runs outside.

    def run_lease(self) -> HttpResponseBase:
        if _inside_transaction(self.using):
            raise ImproperlyConfigured(
                "Lease mode (atomic=False) must commit its claim before the handler "
                "runs, but this request is already inside a transaction on "
                f"{self.using!r}. Exclude the view from ATOMIC_REQUESTS with "
                "django.db.transaction.non_atomic_requests (for a DRF @api_view, "
                "put @transaction.non_atomic_requests above @api_view), or use "
                "atomic mode."
            )
        token = secrets.token_hex(16)
        for _ in range(store.CLAIM_ATTEMPTS):
            try:
                claimed = self._lease_claim(token)
            except store.Retry:
                continue
            break
        else:
            raise self._conflict(retry_after=1)
        if isinstance(claimed, HttpResponseBase):
            return claimed
        self._send(signals.key_claimed)
        try:
            response = self.finalize(self.handler())
        except BaseException:
            store.release(self.using, claimed, token)
            raise
        if not is_storable(response):
            store.release(self.using, claimed, token)
            return response
        try:
            completed = self._complete(claimed, token, response)
        except DatabaseError:
            # Storing failed (the database went away, a body over the packet
            # limit): give the key back rather than leave it stuck for a lease.
            store.release(self.using, claimed, token)
            raise
        if not completed:
            logger.warning(
                "Lease for idempotency key %s in scope %r ran out before the handler "
                "finished; its response was not stored. Raise LEASE above the "
                "longest request your server allows.",
                mask_key(self.info.key),
                self.info.scope,
            )
        return response

    def _lease_claim(self, token: str) -> int | HttpResponseBase:
        store.prepare_connection(self.using, self.options.wait)
        now = timezone.now()
        lease_until = now + self.options.lease
        try:
            with transaction.atomic(using=self.using):
                claimed = store.claim(
                    self.using, self._new_claim(now, token, lease_until), self.options.wait
                )
                if isinstance(claimed, IdempotencyKey):
                    return self._answer_duplicate(claimed)
                return claimed
        except DatabaseError as exc:
            self._raise_claim_error(exc)
            raise

    # Shared steps.

    def _new_claim(self, now: Any, token: str, locked_until: Any) -> store.NewClaim:
        return store.NewClaim(
            scope=self.info.scope,
            key=self.info.key,
            fingerprint=self.info.fingerprint,
            owner_token=token,
            created_at=now,
            # A held lease expires with the lease, so that one index answers
            # both "may this be taken over?" and "may this be purged?".
            expires_at=locked_until or now + self.options.ttl,
            locked_until=locked_until,
        )

    def _complete(self, record_id: int, token: str | None, response: HttpResponseBase) -> bool:
        conf = idempotency_settings
        stored = capture(response, conf.stored_headers, conf.max_stored_body)
        return store.complete(
            self.using,
            record_id,
            owner_token=token,
            status_code=stored.status_code,
            headers=stored.headers,
            body=stored.body,
            # Atomic mode's claim already set the expiry (one transaction
            # earlier); a lease's claim expires with the lease, so reset it.
            expires_at=None if token is None else timezone.now() + self.options.ttl,
        )

    def _answer_duplicate(self, record: IdempotencyKey) -> HttpResponseBase:
        if record.fingerprint != self.info.fingerprint:
            self._send(signals.fingerprint_mismatch)
            logger.info(
                "Idempotency key %s in scope %r reused with a different request",
                mask_key(self.info.key),
                self.info.scope,
            )
            raise FingerprintMismatch
        if record.state == IdempotencyKey.State.COMPLETED:
            self._send(signals.response_replayed)
            return replay(record, idempotency_settings.replay_header)
        # An in-progress record committed by a lease-mode request still running.
        locked_until = record.locked_until or record.expires_at
        raise self._conflict(retry_after=(locked_until - timezone.now()).total_seconds())

    def _conflict(self, retry_after: float) -> RequestInFlight:
        self._send(signals.request_conflict)
        logger.info(
            "Idempotency key %s in scope %r is in flight; answering 409",
            mask_key(self.info.key),
            self.info.scope,
        )
        return RequestInFlight(retry_after=retry_after)

    def _raise_claim_error(self, exc: DatabaseError) -> None:
        meaning = store.classify(exc, self.using)
        if isinstance(meaning, store.Busy):
            raise self._conflict(retry_after=1) from exc
        if isinstance(meaning, store.Retry):
            raise meaning from exc
        if meaning is not exc:
            raise meaning from exc

    def _send(self, signal: Signal) -> None:
        signal.send(sender=self.sender, request=self.request, idempotency=self.info)
