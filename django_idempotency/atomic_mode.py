"""Atomic mode: the claim, the handler's writes and the stored response commit together.

One transaction holds the whole request (see "Atomic mode" in
docs/concepts.rst). A duplicate's claim waits on the original's row lock,
then finds the committed response, or takes the key over if the original
rolled back; nothing is ever released, because a rollback releases it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db import DatabaseError, connections, transaction
from django.http import HttpResponseBase
from django.utils import timezone

from django_idempotency import signals, store
from django_idempotency.call import ProtectedCall
from django_idempotency.responses import is_storable


class _Discard(Exception):
    """Leave the atomic block without committing, answering with ``response``."""

    def __init__(self, response: HttpResponseBase) -> None:
        self.response = response


@dataclass
class AtomicCall(ProtectedCall):
    handler_started: bool = field(default=False, init=False)

    def run(self) -> HttpResponseBase:
        # A deadlock that aborts the claim before the handler runs is safe to
        # start over on a transaction of our own; nested in the request's
        # transaction, that one is gone too.
        in_transaction = connections[self.using].in_atomic_block
        return store.retrying(self._attempt, self._in_flight, in_transaction=in_transaction)

    def _attempt(self) -> HttpResponseBase:
        store.prepare_connection(self.using, self.options.wait)
        self.handler_started = False
        try:
            with transaction.atomic(using=self.using):
                claimed_at = timezone.now()
                claim = store.claim(self.using, self._new_claim(claimed_at), self.options.wait)
                if claim.existing is not None:
                    return self._answer_duplicate(claim.existing)
                return self._handle(claim.record_id, claimed_at)
        except _Discard as discard:
            return discard.response
        except DatabaseError as exc:
            # SQLite waits at BEGIN, the others in the claim: a database
            # error before the handler ran says what the claim met; after,
            # it is the handler's (or its COMMIT's) and propagates.
            if self.handler_started:
                raise
            self._raise_claim_error(exc)

    def _handle(self, record_id: int, claimed_at: datetime) -> HttpResponseBase:
        self.handler_started = True
        self._send(signals.key_claimed)
        response = self.finalize(self.handler())
        if not is_storable(response):
            # Roll the claim back with the handler's writes: a retry runs again.
            raise _Discard(response)
        stored = self._capture(response)
        claim_expires_at = claimed_at + self.options.ttl
        expires_at = self._expiry_on_completion(claimed_at)
        if self._store_response(record_id, None, stored, expires_at):
            self._send(signals.response_stored)
            self._cache_after_commit(stored, expires_at or claim_expires_at)
        return response

    def _expiry_on_completion(self, claimed_at: datetime) -> datetime | None:
        """The record's new expiry, or ``None`` to keep the one its claim set.

        The claim set ``now + TTL`` in this transaction; keeping it leaves
        every indexed column untouched, so PostgreSQL can store the response
        as a heap-only update. That is kept only while the handler took under
        1% of ``TTL``: a slower one (or a short ``TTL``) would otherwise
        commit a record already expired, or soon to be, and a retry could
        run the handler again.
        """
        now = timezone.now()
        if now - claimed_at < self.options.ttl / 100:
            return None
        return now + self.options.ttl
