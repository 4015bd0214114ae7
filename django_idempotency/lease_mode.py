"""Lease mode: the claim commits first; the handler runs outside any transaction of ours.

For handlers that call systems a rollback cannot undo (see "Lease mode" in
docs/concepts.rst). The claim holds the key for ``LEASE`` under an owner
token; the handler's response completes it, a failure releases it, and a
claim whose lease ran out may be taken over. Once the handler has
succeeded, the key is never released: a release would let a retry repeat
the effect.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.http import HttpResponseBase
from django.utils import timezone

from django_idempotency import lease_cleanup, lease_connection, signals, store
from django_idempotency.call import ProtectedCall
from django_idempotency.responses import StoredResponse, is_storable


@dataclass
class LeaseCall(ProtectedCall):
    #: Whether the lease's statements run on a connection of their own.
    own_connection: bool = field(default=False, init=False)
    token: str = field(default_factory=lambda: secrets.token_hex(16), init=False)
    #: What was stored, and until when, for the replay cache.
    stored: tuple[StoredResponse, datetime] | None = field(default=None, init=False)

    def run(self) -> HttpResponseBase:
        # Inside a transaction the request's connection cannot commit the
        # claim first: the lease's statements then use a connection of their
        # own (see docs/decorator.rst).
        self.own_connection = lease_connection.needs_own_connection(self.using)
        claim = store.retrying(self._claim, self._in_flight)
        if claim.existing is not None:
            return self._answer_duplicate(claim.existing)
        record_id = claim.record_id
        self._send(signals.key_claimed)
        try:
            response = self.finalize(self.handler())
        except BaseException:
            self._release(record_id)
            raise
        if not is_storable(response):
            self._release(record_id)
            return response
        stored = self._capture(response)
        if not self.own_connection:
            self._store(record_id, stored)
        elif self._request_transaction_will_roll_back():
            # The view's writes are lost with it: as for a failed handler.
            self._release(record_id)
        else:
            self._store_in_request_transaction(record_id, stored)
        return response

    def _claim(self) -> store.Claim:
        now = timezone.now()
        lease_until = now + self.options.lease
        try:
            with self._statements():
                store.prepare_connection(self.using, self.options.wait)
                with transaction.atomic(using=self.using):
                    return store.claim(
                        self.using, self._new_claim(now, self.token, lease_until), self.options.wait
                    )
        except DatabaseError as exc:
            self._raise_claim_error(exc)

    # Ending the lease: store the response, or give the key back.

    def _store(self, record_id: int, stored: StoredResponse) -> None:
        """Store a successful handler's response, without its body if the database refuses it.

        The effect has run, so the key is never released here. A body the
        database refuses (over MySQL's ``max_allowed_packet``, say) is
        dropped as one over ``MAX_STORED_BODY`` is, and status and headers
        are stored alone.
        """
        try:
            completed = self._on_a_live_connection(lambda: self._complete(record_id, stored))
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
                    lambda: self._complete(record_id, without_body)
                )
            except DatabaseError:
                self._log_not_stored()
                return
        # Sent only here, with the request's connection back in place, so
        # that a receiver's writes join the request's transaction.
        self._stored_or_lost(completed)

    def _store_in_request_transaction(self, record_id: int, stored: StoredResponse) -> None:
        """Store the response in the request's transaction, with the view's writes.

        The claim was committed by lease mode's own connection and is not
        locked, so the update does not wait. Record and effect then commit,
        or roll back, together; if the request's transaction rolls back
        after the view, the claim is released when the request finishes
        (see docs/decorator.rst).
        """
        completed: bool | None
        try:
            completed = self._complete_in_savepoint(record_id, stored)
        except DatabaseError:
            completed = self._complete_without_body(record_id, stored)
        lease_cleanup.release_unless_committed(self.using, lambda: self._release(record_id))
        if completed is not None:
            self._stored_or_lost(completed)

    def _complete_in_savepoint(self, record_id: int, stored: StoredResponse) -> bool:
        with transaction.atomic(using=self.using):
            return self._complete(record_id, stored)

    def _complete_without_body(self, record_id: int, stored: StoredResponse) -> bool | None:
        """Store status and headers alone once the database refused the body; ``None`` if not."""
        if stored.body:
            self._log_body_refused(stored)
            try:
                return self._complete_in_savepoint(record_id, replace(stored, body=None))
            except DatabaseError:
                pass
        self._log_not_stored()
        return None

    def _complete(self, record_id: int, stored: StoredResponse) -> bool:
        # A lease's claim expires with the lease: the record lives for TTL.
        expires_at = timezone.now() + self.options.ttl
        completed = self._store_response(record_id, self.token, stored, expires_at)
        if completed:
            self.stored = (stored, expires_at)
        return completed

    def _stored_or_lost(self, completed: bool) -> None:
        if not completed:
            self._log_lease_lost()
            return
        self._send(signals.response_stored)
        if self.stored is not None:
            self._cache_after_commit(*self.stored)

    def _release(self, record_id: int) -> None:
        """Give the key back after a failed handler, so that a retry can run."""
        try:
            released = self._on_a_live_connection(
                lambda: store.release(self.using, record_id, self.token)
            )
        except DatabaseError:
            if self._shares_the_request_transaction():
                return  # the failed statement rolls the claim back with the request
            # Raising would hide the handler's own error or response; the
            # lease still runs out.
            self._log(
                logging.ERROR,
                "Could not release idempotency key %s in scope %r; retries get 409 "
                "until its lease runs out.",
                exc_info=True,
            )
            return
        if released:
            self._send(signals.claim_released)

    # Which connection the lease's statements use.

    def _statements(self, *, fresh: bool = False) -> AbstractContextManager[Any]:
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
            with self._statements():
                return step()
        except DatabaseError:
            # Whether the connection is still usable cannot be told reliably
            # afterwards (Django may have dropped it already), and the
            # statements match on the owner token, so they are safe to repeat.
            if self._shares_the_request_transaction():
                raise
        with self._statements(fresh=True):
            return step()

    def _shares_the_request_transaction(self) -> bool:
        # A test case's transaction, or SQLite's (see docs/backends.rst): the
        # claim is not visible to another connection, and commits or rolls
        # back with the request.
        return not self.own_connection and connections[self.using].in_atomic_block

    def _request_transaction_will_roll_back(self) -> bool:
        connection = connections[self.using]
        return connection.needs_rollback or not lease_connection.is_usable(connection)

    # What the logs say when the lease cannot end as it should.

    def _log_body_refused(self, stored: StoredResponse) -> None:
        self._log(
            logging.WARNING,
            "The response body for idempotency key %s in scope %r (%d bytes) could "
            "not be stored; storing its status and headers only.",
            len(stored.body or b""),
            exc_info=True,
        )

    def _log_lease_lost(self) -> None:
        self._log(
            logging.WARNING,
            "Lease for idempotency key %s in scope %r ran out before the handler "
            "finished; its response was not stored. Raise LEASE above the "
            "longest request your server allows.",
            outcome="lease_lost",
            waited=False,
        )

    def _log_not_stored(self) -> None:
        self._log(
            logging.ERROR,
            "The response for idempotency key %s in scope %r could not be stored. "
            "The key stays claimed, so that a retry does not repeat the effect, "
            "and retries get 409 until its lease runs out.",
            exc_info=True,
        )
