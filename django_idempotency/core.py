"""The protocol: run a handler at most once per (scope, key).

The decorator and the DRF mixin are thin adapters over :func:`protect`, so
every rule of the HTTP contract lives here once. Database statements live
in :mod:`django_idempotency.store`.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, NoReturn

from django.db import DatabaseError, connections, transaction
from django.dispatch import Signal
from django.http import HttpRequest, HttpResponseBase
from django.utils import timezone

from django_idempotency import (
    lease_cleanup,
    lease_connection,
    observability,
    replay_cache,
    signals,
    store,
)
from django_idempotency.body import close_spools_with
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import (
    DatabaseBusy,
    FingerprintMismatch,
    IdempotencyKeyRequired,
    RequestInFlight,
)
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import mask_key, parse_key
from django_idempotency.models import IdempotencyKey
from django_idempotency.options import Options, ViewOptions, resolve_options
from django_idempotency.responses import (
    StoredResponse,
    capture,
    is_storable,
    replay,
    replay_stored,
)

logger = logging.getLogger(__name__)

SCOPE_MAX_LENGTH = 255
FINGERPRINT_MAX_LENGTH = 64

Handler = Callable[[], HttpResponseBase]
Finalize = Callable[[HttpResponseBase], HttpResponseBase]


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
        scope=_normalise_scope(options.scope(request)),
        fingerprint=_normalise_fingerprint(options.fingerprint(request)),
    )
    request.idempotency = info  # type: ignore[attr-defined]
    call = _ProtectedCall(request, info, handler, finalize, options, sender, conf.database)
    try:
        response = _run(call, conf.replay_cache, atomic=options.atomic)
    except BaseException:
        close_spools_with(request, None)
        raise
    close_spools_with(request, response)
    return response


def _run(call: _ProtectedCall, cache_alias: str | None, *, atomic: bool) -> HttpResponseBase:
    if cache_alias is not None:
        cached = call.replay_from_cache(cache_alias)
        if cached is not None:
            return cached
    return call.run_atomic() if atomic else call.run_lease()


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
    own_connection: bool = field(default=False, init=False)
    started: float = field(default_factory=time.monotonic, init=False)
    claimed_at: datetime | None = field(default=None, init=False)
    #: The expiry this request's claim wrote, which atomic mode's completion keeps.
    claim_expires_at: Any = field(default=None, init=False)
    #: What lease mode stored, and until when, for the replay cache.
    lease_stored: tuple[StoredResponse, datetime] | None = field(default=None, init=False)

    # The replay cache (docs/settings.rst, "Replay cache"): never the authority.

    def replay_from_cache(self, alias: str) -> HttpResponseBase | None:
        """Replay a completed response from the cache, or ``None`` to ask the database."""
        stored = replay_cache.lookup(alias, self.info)
        if stored is None:
            return None
        self._send(signals.response_replayed)
        return replay_stored(stored, idempotency_settings.replay_header)

    def _cache_after_commit(self, stored: StoredResponse, expires_at: Any) -> None:
        alias = idempotency_settings.replay_cache
        if alias is None:
            return
        info = self.info
        # Immediately when nothing is left to commit (a lease's own
        # connection), else once the record's transaction has committed.
        transaction.on_commit(
            lambda: replay_cache.put(alias, info, stored, expires_at), using=self.using
        )

    # Atomic mode (docs/concepts.rst): claim, effect and stored response commit together.

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
                now = self.claimed_at = timezone.now()
                claimed = store.claim(self.using, self._new_claim(now, "", None), self.options.wait)
                if isinstance(claimed, IdempotencyKey):
                    return self._answer_duplicate(claimed)
                handler_started = True
                self._send(signals.key_claimed)
                response = self.finalize(self.handler())
                if not is_storable(response):
                    raise _Discard(response)
                self._complete(claimed, None, self._capture(response))
                return response
        except _Discard as discard:
            return discard.response
        except DatabaseError as exc:
            if handler_started:
                raise
            self._raise_claim_error(exc)
            raise

    # Lease mode (docs/concepts.rst): the claim commits first; the handler runs outside.

    def run_lease(self) -> HttpResponseBase:
        # Inside a transaction the request's connection cannot commit the
        # claim first: the lease's statements then use a connection of their
        # own (see docs/decorator.rst).
        self.own_connection = lease_connection.needs_own_connection(self.using)
        token = secrets.token_hex(16)
        claimed = store.retrying(lambda: self._lease_claim(token))
        if claimed is None:
            raise self._conflict(retry_after=1)
        if isinstance(claimed, IdempotencyKey):
            return self._answer_duplicate(claimed)
        record_id = claimed
        self._send(signals.key_claimed)
        try:
            response = self.finalize(self.handler())
        except BaseException:
            self._release(record_id, token)
            raise
        if not is_storable(response):
            self._release(record_id, token)
            return response
        stored = self._capture(response)
        if not self.own_connection:
            self._store_lease_response(record_id, token, stored)
        elif self._request_transaction_will_roll_back():
            # The view's writes are lost with it: as for a failed handler.
            self._release(record_id, token)
        else:
            self._store_in_request_transaction(record_id, token, stored)
        return response

    def _store_in_request_transaction(
        self, record_id: int, token: str, stored: StoredResponse
    ) -> None:
        """Store the response in the request's transaction, with the view's writes.

        The claim was committed by lease mode's own connection and is not
        locked, so the update does not wait. Record and effect then commit,
        or roll back, together; if the request's transaction rolls back
        after the view, the claim is released when the request finishes
        (see docs/decorator.rst).
        """
        completed: bool | None
        try:
            completed = self._complete_in_savepoint(record_id, token, stored)
        except DatabaseError:
            completed = self._complete_without_body(record_id, token, stored)
        lease_cleanup.release_unless_committed(self.using, lambda: self._release(record_id, token))
        if completed:
            self._lease_response_stored()
        elif completed is False:
            self._log_lease_lost()

    def _complete_in_savepoint(self, record_id: int, token: str, stored: StoredResponse) -> bool:
        with transaction.atomic(using=self.using):
            return self._lease_complete(record_id, token, stored)

    def _complete_without_body(
        self, record_id: int, token: str, stored: StoredResponse
    ) -> bool | None:
        """Store status and headers alone once the database refused the body; ``None`` if not."""
        if stored.body:
            self._log_body_refused(stored)
            try:
                return self._complete_in_savepoint(record_id, token, replace(stored, body=None))
            except DatabaseError:
                pass
        self._log_not_stored()
        return None

    def _request_transaction_will_roll_back(self) -> bool:
        connection = connections[self.using]
        return connection.needs_rollback or not lease_connection.is_usable(connection)

    def _lease_claim(self, token: str) -> int | IdempotencyKey:
        now = timezone.now()
        lease_until = now + self.options.lease
        try:
            with self._lease_statements():
                store.prepare_connection(self.using, self.options.wait)
                with transaction.atomic(using=self.using):
                    return store.claim(
                        self.using, self._new_claim(now, token, lease_until), self.options.wait
                    )
        except DatabaseError as exc:
            self._raise_claim_error(exc)
            raise

    def _lease_statements(self, *, fresh: bool = False) -> AbstractContextManager[Any]:
        if self.own_connection or fresh:
            return lease_connection.own_connection(self.using, fresh=fresh)
        return nullcontext()

    def _on_a_live_connection(self, step: Callable[[], Any]) -> Any:
        """Run a lease statement; if its connection has died, again on a fresh one.

        A handler can outlive its connection (a server restart, a killed
        session, a network cut). The statements that end its lease must not
        die with it, or the key stays stuck until the lease runs out.
        """
        try:
            with self._lease_statements():
                return step()
        except DatabaseError:
            # Whether the connection is still usable cannot be told reliably
            # afterwards (Django may have dropped it already), and the
            # statements match on the owner token, so they are safe to repeat.
            if self._shares_the_request_transaction():
                raise
        with self._lease_statements(fresh=True):
            return step()

    def _shares_the_request_transaction(self) -> bool:
        # A test case's transaction, or SQLite's (see docs/backends.rst): the
        # claim is not visible to another connection, and commits or rolls
        # back with the request.
        return not self.own_connection and connections[self.using].in_atomic_block

    def _release(self, record_id: int, token: str) -> None:
        """Give the key back after a failed handler, so that a retry can run."""
        try:
            released = self._on_a_live_connection(
                lambda: store.release(self.using, record_id, token)
            )
        except DatabaseError:
            if self._shares_the_request_transaction():
                return  # the failed statement rolls the claim back with the request
            # Raising would hide the handler's own error or response; the
            # lease still runs out.
            logger.exception(
                "Could not release idempotency key %s in scope %r; retries get 409 "
                "until its lease runs out.",
                mask_key(self.info.key),
                self.info.scope,
            )
            return
        if released:
            self._send(signals.claim_released)

    def _store_lease_response(self, record_id: int, token: str, stored: StoredResponse) -> None:
        """Store a successful handler's response, without its body if the database refuses it.

        The effect has run, so the key is never released here: a release
        would let a retry run it again. A body the database refuses (over
        MySQL's ``max_allowed_packet``, say) is dropped as one over
        ``MAX_STORED_BODY`` is, and status and headers are stored alone.
        """
        try:
            completed = self._on_a_live_connection(
                lambda: self._lease_complete(record_id, token, stored)
            )
        except DatabaseError:
            if self._shares_the_request_transaction():
                raise  # which can no longer commit: the claim goes with it
            if not stored.body:
                self._log_not_stored()
                return
            self._log_body_refused(stored)
            without_body = replace(stored, body=None)
            try:
                completed = self._on_a_live_connection(
                    lambda: self._lease_complete(record_id, token, without_body)
                )
            except DatabaseError:
                self._log_not_stored()
                return
        # Sent only here, with the request's connection back in place, so
        # that a receiver's writes join the request's transaction.
        if completed:
            self._lease_response_stored()
        else:
            self._log_lease_lost()

    def _lease_complete(self, record_id: int, token: str, stored: StoredResponse) -> bool:
        # A lease's claim expires with the lease: the record lives for TTL.
        expires_at = timezone.now() + self.options.ttl
        completed = self._store_response(record_id, token, stored, expires_at)
        if completed:
            self.lease_stored = (stored, expires_at)
        return completed

    def _lease_response_stored(self) -> None:
        """Signal the stored response and offer it to the replay cache once it commits."""
        self._send(signals.response_stored)
        if self.lease_stored is not None:
            self._cache_after_commit(*self.lease_stored)

    def _log_body_refused(self, stored: StoredResponse) -> None:
        logger.warning(
            "The response body for idempotency key %s in scope %r (%d bytes) could "
            "not be stored; storing its status and headers only.",
            mask_key(self.info.key),
            self.info.scope,
            len(stored.body or b""),
            exc_info=True,
        )

    def _log_lease_lost(self) -> None:
        logger.warning(
            "Lease for idempotency key %s in scope %r ran out before the handler "
            "finished; its response was not stored. Raise LEASE above the "
            "longest request your server allows.",
            mask_key(self.info.key),
            self.info.scope,
            extra=observability.log_fields("lease_lost", self.sender, self.info),
        )

    def _log_not_stored(self) -> None:
        logger.error(
            "The response for idempotency key %s in scope %r could not be stored. "
            "The key stays claimed, so that a retry does not repeat the effect, "
            "and retries get 409 until its lease runs out.",
            mask_key(self.info.key),
            self.info.scope,
            exc_info=True,
        )

    # Shared steps.

    def _new_claim(self, now: Any, token: str, locked_until: Any) -> store.NewClaim:
        self.claim_expires_at = now + self.options.ttl
        return store.NewClaim(
            scope=self.info.scope,
            key=self.info.key,
            fingerprint=self.info.fingerprint,
            owner_token=token,
            created_at=now,
            # A held lease expires with the lease, so that one index answers
            # both "may this be taken over?" and "may this be purged?".
            expires_at=locked_until or self.claim_expires_at,
            locked_until=locked_until,
        )

    def _capture(self, response: HttpResponseBase) -> StoredResponse:
        conf = idempotency_settings
        return capture(response, conf.stored_headers, conf.max_stored_body)

    def _complete(self, record_id: int, token: str | None, stored: StoredResponse) -> bool:
        new_expiry = self._expiry_on_completion(token)
        completed = self._store_response(record_id, token, stored, new_expiry)
        if completed:
            self._send(signals.response_stored)
            self._cache_after_commit(stored, new_expiry or self.claim_expires_at)
        return completed

    def _store_response(
        self, record_id: int, token: str | None, stored: StoredResponse, expires_at: Any
    ) -> bool:
        return store.complete(
            self.using,
            record_id,
            owner_token=token,
            status_code=stored.status_code,
            headers=stored.headers,
            body=stored.body,
            expires_at=expires_at,
        )

    def _expiry_on_completion(self, token: str | None) -> datetime | None:
        """The record's new expiry, or ``None`` to keep the one its claim set.

        A lease's claim expires with the lease, so its expiry is always reset.
        Atomic mode's claim set ``now + TTL`` one transaction earlier; keeping
        it leaves every indexed column untouched, so PostgreSQL can store the
        response as a heap-only update. That is kept only while the handler
        took under 1% of ``TTL``: a slower one (or a short ``TTL``) would
        otherwise commit a record already expired, or soon to be, and a
        retry could run the handler again.
        """
        now = timezone.now()
        claimed_at = self.claimed_at
        if token is None and claimed_at is not None and now - claimed_at < self.options.ttl / 100:
            return None
        return now + self.options.ttl

    def _answer_duplicate(self, record: IdempotencyKey) -> HttpResponseBase:
        if record.fingerprint != self.info.fingerprint:
            self._send(signals.fingerprint_mismatch)
            logger.info(
                "Idempotency key %s in scope %r reused with a different request",
                mask_key(self.info.key),
                self.info.scope,
                extra=observability.log_fields("mismatch", self.sender, self.info, self.started),
            )
            raise FingerprintMismatch
        if record.state == IdempotencyKey.State.COMPLETED:
            self._send(signals.response_replayed)
            response = replay(record, idempotency_settings.replay_header)
            if idempotency_settings.replay_cache is not None:
                # A replay from the database refills a cache that lost the
                # entry (evicted, restarted), for the record's remaining life.
                stored = StoredResponse(
                    record.status_code or 200, record.response_headers or [], record.response_body
                )
                self._cache_after_commit(stored, record.expires_at)
            return response
        # An in-progress record committed by a lease-mode request still running.
        locked_until = record.locked_until or record.expires_at
        raise self._conflict(retry_after=(locked_until - timezone.now()).total_seconds())

    def _conflict(self, retry_after: float) -> RequestInFlight:
        self._send(signals.request_conflict)
        logger.info(
            "Idempotency key %s in scope %r is in flight; answering 409",
            mask_key(self.info.key),
            self.info.scope,
            extra=observability.log_fields("conflict", self.sender, self.info, self.started),
        )
        return RequestInFlight(retry_after=retry_after)

    def _raise_claim_error(self, exc: DatabaseError) -> NoReturn:
        try:
            store.claim_failed(self.using, exc)
        except store.DatabaseLocked as locked:
            # SQLite has one write lock for the whole database: its holder
            # may be a request for any key (docs/backends.rst, "SQLite").
            self._send(signals.wait_timed_out)
            self._send(signals.request_conflict)
            logger.info(
                "Database busy; answering 409 to idempotency key %s in scope %r",
                mask_key(self.info.key),
                self.info.scope,
                extra=observability.log_fields(
                    "database_busy", self.sender, self.info, self.started
                ),
            )
            raise DatabaseBusy(retry_after=1) from locked
        except store.Busy as busy:
            self._send(signals.wait_timed_out)
            raise self._conflict(retry_after=1) from busy

    def _send(self, signal: Signal) -> None:
        observability.record(signal, self.sender, self.request, self.info, self.started)
