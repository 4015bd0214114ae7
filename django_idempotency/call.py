"""What both modes of the protocol do with one request: claim, answer a duplicate, store.

:mod:`django_idempotency.atomic_mode` and :mod:`django_idempotency.lease_mode`
each read top to bottom as ``docs/concepts.rst`` describes them; the steps
they share, and the 409/422 answers, live here once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NoReturn

from django.db import DatabaseError, transaction
from django.dispatch import Signal
from django.http import HttpRequest, HttpResponseBase
from django.utils import timezone

from django_idempotency import observability, replay_cache, signals, store
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import DatabaseBusy, FingerprintMismatch, RequestInFlight
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import mask_key
from django_idempotency.models import IdempotencyKey
from django_idempotency.options import Options
from django_idempotency.responses import StoredResponse, capture, replay, replay_stored

logger = logging.getLogger("django_idempotency.core")

Handler = Callable[[], HttpResponseBase]
Finalize = Callable[[HttpResponseBase], HttpResponseBase]


@dataclass
class ProtectedCall:
    """One keyed request on its way through the protocol."""

    request: HttpRequest
    info: IdempotencyInfo
    handler: Handler
    finalize: Finalize
    options: Options
    sender: Any
    using: str
    started: float = field(default_factory=time.monotonic, init=False)

    def run(self) -> HttpResponseBase:
        raise NotImplementedError

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

    # The claim.

    def _new_claim(
        self, now: datetime, token: str = "", locked_until: datetime | None = None
    ) -> store.NewClaim:
        return store.NewClaim.of(
            self.info, now, ttl=self.options.ttl, token=token, locked_until=locked_until
        )

    def _raise_claim_error(self, exc: DatabaseError) -> NoReturn:
        try:
            store.claim_failed(self.using, exc)
        except store.DatabaseLocked as locked:
            # SQLite has one write lock for the whole database: its holder
            # may be a request for any key (docs/backends.rst, "SQLite").
            self._send(signals.wait_timed_out)
            self._send(signals.request_conflict)
            self._log(
                logging.INFO,
                "Database busy; answering 409 to idempotency key %s in scope %r",
                outcome="database_busy",
            )
            raise DatabaseBusy(retry_after=1) from locked
        except store.Busy as busy:
            self._send(signals.wait_timed_out)
            raise self._conflict(retry_after=1) from busy

    # A duplicate's answer: the stored response, 422 or 409.

    def _answer_duplicate(self, record: IdempotencyKey) -> HttpResponseBase:
        if record.fingerprint != self.info.fingerprint:
            self._send(signals.fingerprint_mismatch)
            self._log(
                logging.INFO,
                "Idempotency key %s in scope %r reused with a different request",
                outcome="mismatch",
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

    def _in_flight(self) -> RequestInFlight:
        """The answer when every claim attempt had to start over: try again in a second."""
        return self._conflict(retry_after=1)

    def _conflict(self, retry_after: float) -> RequestInFlight:
        self._send(signals.request_conflict)
        self._log(
            logging.INFO,
            "Idempotency key %s in scope %r is in flight; answering 409",
            outcome="conflict",
        )
        return RequestInFlight(retry_after=retry_after)

    # The handler's response.

    def _capture(self, response: HttpResponseBase) -> StoredResponse:
        conf = idempotency_settings
        return capture(response, conf.stored_headers, conf.max_stored_body)

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

    def _log(
        self,
        level: int,
        message: str,
        *args: Any,
        outcome: str | None = None,
        waited: bool = True,
        exc_info: bool = False,
    ) -> None:
        """Log about this request; ``message`` starts with its key (masked) and scope.

        ``outcome`` adds the structured fields (docs/observability.rst), with
        the time this request has waited unless ``waited`` is false.
        """
        extra = None
        if outcome is not None:
            started = self.started if waited else None
            extra = observability.log_fields(outcome, self.sender, self.info, started)
        logger.log(
            level,
            message,
            mask_key(self.info.key),
            self.info.scope,
            *args,
            extra=extra,
            exc_info=exc_info,
            # The caller's function and line, as when it logged itself.
            stacklevel=2,
        )

    def _send(self, signal: Signal) -> None:
        observability.record(signal, self.sender, self.request, self.info, self.started)
