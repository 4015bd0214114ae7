"""The engine: run a body at most once per (scope, key), for every adapter.

Each adapter describes itself in a :class:`Kind`; the claim, a duplicate's answer and what
happens when a body ends (docs/concepts.rst, "How a handler ends") are decided here, once.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, TypeVar

from django.core.handlers.asgi import ASGIRequest
from django.core.signals import request_finished, request_started
from django.db import (
    DatabaseError,
    DataError,
    Error,
    IntegrityError,
    ProgrammingError,
    connections,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from django.dispatch import Signal

from django_idempotency import leases, observability, replay_cache, signals, store
from django_idempotency.body import django_request, when_closed
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import IdempotencyError
from django_idempotency.info import IdempotencyInfo, ProgressWriter
from django_idempotency.keys import mask_key
from django_idempotency.lease_connection import LeaseConnection
from django_idempotency.options import Options
from django_idempotency.recovery import Abandoned
from django_idempotency.store import StoredResponse

logger = logging.getLogger("django_idempotency.core")

T = TypeVar("T")


#: Errors about what a statement was given, not about the connection: a result that meets
#: one of them on a fresh connection too cannot be written. (A lost connection, a failover or
#: a lock timeout leaves the effect's answer unknown: the key stays claimed, as for a crash.)
_REFUSED_CONTENT = (DataError, IntegrityError, ProgrammingError)


class Ending(enum.Enum):
    """How a body that raised ended, as far as the key is concerned."""

    #: An error: atomic mode rolls back; lease mode gives the claim back for a retry.
    FAILED = "failed"
    #: Cancelled or exited: the body may have acted, so a lease is never given back.
    UNKNOWN = "unknown"
    #: Finished on purpose without a value (Celery's ``Ignore``): completed, writes commit.
    COMPLETED = "completed"


def plain_ending(exc: BaseException) -> Ending:
    """An ``Exception`` is a failure; anything else (``CancelledError``, ``SystemExit``) unknown."""
    return Ending.FAILED if isinstance(exc, Exception) else Ending.UNKNOWN


@dataclass(frozen=True)
class Kind:
    """What one kind of adapter (views, functions, tasks) tells the engine."""

    #: The result as stored, or ``None`` (a 5xx): nothing is kept, as after a failure.
    encode: Callable[[Any], StoredResponse | None]
    #: What a duplicate gets from a stored result.
    decode: Callable[[StoredResponse], Any]
    #: A duplicate's errors: the original still runs (seconds to wait); the key is other work's.
    in_flight: Callable[[float], IdempotencyError]
    mismatch: Callable[[], IdempotencyError]
    #: Lease mode: the refusal that completes a key whose result cannot be kept, so that
    #: the body, which acted, never reruns.
    unstorable: Callable[[], StoredResponse]
    #: For :class:`store.DatabaseLocked`; ``None``: ``in_flight(1)``.
    database_busy: Callable[[], IdempotencyError] | None = None
    ending: Callable[[BaseException], Ending] = plain_ending
    #: Stored for ``Ending.COMPLETED`` (``None``: this kind's bodies never end so).
    ended_on_purpose: StoredResponse | None = None
    #: Stored when the database refuses the body (MySQL's ``max_allowed_packet``).
    without_body: Callable[[StoredResponse], StoredResponse] = lambda stored: replace(
        stored, body=None
    )
    #: What the first call returns (a function's JSON value); ``None``: its own result.
    fresh: Callable[[Any, StoredResponse], Any] | None = None
    #: Refuses, naming the fix, a policy's answer that is neither ``None`` nor storable.
    check_answer: Callable[[Callable[..., Any], Any], None] = lambda policy, answer: None
    #: How a recovery policy is called: ``f(request, abandoned)`` or ``f(abandoned)``.
    ask: Callable[[Callable[..., Any], Any, Abandoned], Any] = lambda policy, request, abandoned: (
        policy(request, abandoned)
    )


#: The connections whose atomic-mode claim is open around the running body: a claim made in
#: the body on one of them (a protected function a view calls) is inside that claim's
#: transaction. Connections, not aliases: a thread's connection of the same alias is another.
_atomic_claims: contextvars.ContextVar[tuple[BaseDatabaseWrapper, ...]] = contextvars.ContextVar(
    "django_idempotency_atomic_claims", default=()
)


@dataclass(frozen=True)
class _Owned:
    """The claim a lease-mode call holds: where its statements run, its record, its token."""

    connection: LeaseConnection
    record_id: int
    token: str


@dataclass(frozen=True)
class _Recorded:
    """A lease-mode checkpoint: the names it set; ``committed`` is non-empty once it commits."""

    added: dict[str, Any]
    committed: list[bool]
    marker: Callable[[], None] | None = None


@dataclass
class Call:
    """One protected call on its way through the engine."""

    info: IdempotencyInfo
    options: Options
    kind: Kind
    #: Who is protected, for signals and logs: the view, task or function.
    sender: Any
    #: Sent with the signals: the request, or ``None`` for tasks and functions.
    request: Any = None
    #: Lease mode: the policy asked about an abandoned claim; ``None``: take it over.
    recover: Callable[..., Any] | None = None
    #: Turns a result into what is stored and sent (a view's response rendered). Not
    #: part of the body: in lease mode it fails after the body acted, and must not release.
    finish: Callable[[Any], Any] = lambda result: result
    using: str = field(default_factory=lambda: idempotency_settings.database)
    started: float = field(default_factory=time.monotonic, init=False)
    #: Lease mode: the checkpoints at the start, and what each checkpoint since added.
    _progress_at_start: dict[str, Any] | None = field(default=None, init=False)
    _progress_log: list[_Recorded] = field(default_factory=list, init=False)
    _put_back_at_request_end: bool = field(default=False, init=False)

    def run(self, body: Callable[[], T]) -> T:
        """Run ``body`` unless its key is already done; return its result or the stored one."""
        cache_alias = idempotency_settings.replay_cache
        if cache_alias is not None:
            cached = replay_cache.lookup(cache_alias, self.info, self.using)
            observability.cache_looked_up(self.sender, hit=cached is not None)
            if cached is not None:
                self._send(signals.response_replayed)
                return self.kind.decode(cached)
        connection = connections[self.using]
        # The caller's transaction: atomic(), or autocommit turned off by hand.
        in_transaction = connection.in_atomic_block or not connection.get_autocommit()
        if not in_transaction and store.reads_before_claiming(connection):
            # A replay in one indexed read, without a transaction. Inside the caller's
            # transaction the read would change what it sees, so the claim decides.
            try:
                completed = store.find_completed(connection, self.info.scope, self.info.key)
            except store.Busy as busy:
                raise self._busy(busy) from busy
            if completed is not None:
                return self._answer_duplicate(completed)
        atomic = self.options.atomic
        lease = None if atomic else LeaseConnection.for_alias(self.using)
        token = leases.NO_OWNER if lease is None else secrets.token_hex(16)
        # The one place a claim starts over (a deadlock, a lost Galera certification, a
        # stale record); not when a deadlock lost the caller's own transaction too. When that
        # transaction is an enclosing atomic-mode claim's, the error is that claim's to start
        # over with: a replay, where a 409 is all this claim could answer.
        enclosed = in_transaction and connection in _atomic_claims.get()  # by identity
        for _ in range(store.CLAIM_ATTEMPTS):
            try:
                if lease is None:
                    return self._atomic(body, connection)
                claim = self._lease_claim(lease, token)
            except store.Retry as retry:
                if retry.transaction_lost and in_transaction and atomic:
                    if enclosed and store.lost_transaction(self.using, retry):
                        # The enclosing claim's transaction is lost with ours: it starts
                        # over, or, with another database's transaction open, fails with
                        # the error (an answer would commit that one's writes).
                        if store.lost_race(self.using, retry):
                            raise
                        raise retry.__cause__ or retry  # noqa: B904  the database's own error
                    break
                continue
            except store.Busy as busy:
                raise self._busy(busy) from busy
            except DatabaseError as exc:
                if not atomic or not store.lost_race(self.using, exc):
                    raise
                if enclosed:
                    raise
                if in_transaction:
                    break
                continue
            return self._leased(body, lease, token, claim)
        raise self._gave_up()

    def _atomic(self, body: Callable[[], Any], connection: BaseDatabaseWrapper) -> Any:
        """Atomic mode: claim, body and stored result commit together, or none does.

        Raises :class:`store.Retry` (or a MySQL deadlock, as late as ``COMMIT``) to start over
        and :class:`store.Busy` when the wait ran out; :meth:`run` answers both.
        """
        finished_by: BaseException | None = None
        using = self.using
        with ExitStack() as block:
            new = store.NewClaim.of(self.info, ttl=self.options.ttl, lease=None)
            claim = store.claim(using, new, self.options.wait, opening=block, connection=connection)
            if claim.existing is not None:
                return self._answer_duplicate(claim.existing)

            def write(checkpoints: dict[str, Any] | None) -> bool:
                # In the claim's own transaction: nothing to renew, nobody to fence.
                if checkpoints is None:
                    return True
                return store.record_progress(
                    using, claim.record_id, owner_token=None, checkpoints=checkpoints
                )

            progress = self.info.progress
            progress.attempt, progress.checkpoints = claim.attempt, dict(claim.checkpoints)
            progress.write = write
            enclosing = _atomic_claims.set((*_atomic_claims.get(), connection))
            try:
                # observability.record, not _send: the hot path's one frame less.
                observability.record(
                    signals.key_claimed, self.sender, self.request, self.info, self.started
                )
                result = self.finish(body())
            except BaseException as exc:
                # Raising leaves the block: the claim rolls back with the body's writes.
                if self.kind.ending(exc) is not Ending.COMPLETED:
                    raise
                finished_by, result = exc, None
            finally:
                progress.write = None
                _atomic_claims.reset(enclosing)
            ended = self.kind.ended_on_purpose
            if finished_by is not None:
                stored = ended
            elif self.options.store is None:
                stored = self.kind.encode(result)
            else:
                stored = self._encode(result)
            if stored is None:
                # Not stored: undo the claim with the body's writes, answer as it did.
                transaction.set_rollback(True, using=using)
                return result
            # Keep the claim's expiry if the body took under 1% of TTL (a heap-only update on
            # PostgreSQL); a slower body would commit a record nearly expired, for a retry to rerun.
            ttl = self.options.ttl
            grace = ttl / 100
            store.complete(
                using,
                claim.record_id,
                stored,
                owner_token=None,
                ttl=ttl,
                grace=grace,
                connection=connection,
            )
            observability.record(
                signals.response_stored, self.sender, self.request, self.info, self.started
            )
            cache_alias = idempotency_settings.replay_cache
            if cache_alias is not None:
                self._cache_after_commit(cache_alias, stored, ttl - grace)
        if finished_by is not None:
            raise finished_by
        fresh = self.kind.fresh
        return result if fresh is None else fresh(result, stored)

    def _encode(self, result: Any) -> StoredResponse | None:
        """What is kept of ``result`` (``None``: nothing): the kind's rule, then ``store``'s."""
        stored = self.kind.encode(result)
        accepts = self.options.store
        if stored is None or accepts is None:
            return stored
        verdict = accepts(result)
        if not isinstance(verdict, bool):
            raise TypeError(
                f"The store option {accepts!r} returned {type(verdict).__name__}, not a bool: "
                "return True for a response that completes the key, False otherwise."
            )
        return stored if verdict else None

    # Lease mode: the claim commits first, the body runs outside our transaction.

    def _leased(
        self, body: Callable[[], Any], lease: LeaseConnection, token: str, claim: store.Claim
    ) -> Any:
        record = claim.existing
        if record is None:
            return self._run_leased(body, _Owned(lease, claim.record_id, token), claim)
        if self.recover is not None and record.abandoned():
            return self._recover(body, lease, token, record)
        return self._answer_duplicate(record)

    def _lease_claim(self, lease: LeaseConnection, token: str) -> store.Claim:
        new = self._new_claim(token, self.options.lease)
        # explained() covers the COMMIT too, where Galera reports a lost certification.
        with lease.statements(), store.explained(self.using), ExitStack() as block:
            # With a recovery policy, an abandoned claim is left for it to decide.
            take_over = self.recover is None
            return store.claim(
                self.using, new, self.options.wait, take_over_abandoned=take_over, opening=block
            )

    def _run_leased(
        self, body: Callable[[], Any], owned: _Owned, claim: store.Claim, *, counted: bool = False
    ) -> Any:
        """Run the body on a claimed key; ``counted``: a recovery policy's takeover, counted."""
        try:
            with self._progress(claim, lambda cps: self._record_progress(owned, cps)):
                if claim.attempt > 1:
                    self._send(signals.claim_taken_over)
                    if not counted:
                        observability.record_recovery("started", self.sender)
                self._send(signals.key_claimed)
                result = body()
        except BaseException as exc:
            self._end_lease_on(exc, owned)
            raise
        try:
            result = self.finish(result)
            stored = self._encode(result)
        except Exception:
            # Rendering or encoding failed after the body acted: complete the key with a
            # refusal, so that no retry runs it again.
            self._log(
                logging.ERROR,
                "The body for idempotency key %s in scope %r ran, but its result cannot "
                "be rendered or stored. The key is completed with a refusal that every "
                "retry receives, so that the effect is not repeated; an operator can "
                "delete it (manage.py idempotency_keys delete).",
                outcome="unstorable",
                waited=False,
                exc_info=True,
            )
            self._refuse(owned)
            raise
        if stored is None:
            self._release(owned)
            return result
        if self._complete_lease(owned, stored) and claim.attempt > 1:
            observability.record_recovery("completed", self.sender)
        return result if self.kind.fresh is None else self.kind.fresh(result, stored)

    def _refuse(self, owned: _Owned) -> None:
        """Complete the key with the kind's refusal, committed at once, as a checkpoint is.

        It must outlive the caller's transaction, about to roll back: the body may have acted
        elsewhere. (On SQLite or in a test's transaction the claim goes with it anyway.)
        """
        stored, ttl = self.kind.unstorable(), self.options.ttl
        # Kept for an operator's release: only committed checkpoints. Inside the
        # caller's transaction they are put back when the request ends.
        surviving = None if connections[self.using].in_atomic_block else self._settle_progress()

        def refuse() -> bool:
            if surviving is not None:
                store.restore_progress(self.using, owned.record_id, owned.token, surviving)
            return store.complete(
                self.using, owned.record_id, stored, owner_token=owned.token, ttl=ttl
            )

        try:
            completed = owned.connection.run(refuse, at_once=True)
        except Error:
            if owned.connection.shares_request_transaction():
                return  # the claim rolls back with the caller's transaction
            # Raising would hide the body's own error; the lease still runs out.
            self._log(
                logging.ERROR,
                "Could not complete idempotency key %s in scope %r with its refusal; "
                "retries get 409 until its lease runs out.",
                exc_info=True,
            )
            return
        if completed:
            self._stored(stored, ttl)
            return
        self._log(
            logging.WARNING,
            "Lease for idempotency key %s in scope %r ran out before the handler "
            "finished; its refusal was not stored. Raise LEASE above the "
            "longest request your server allows.",
            outcome="lease_lost",
            waited=False,
        )

    def _record_progress(self, owned: _Owned, checkpoints: dict[str, Any] | None) -> bool:
        """Write checkpoints (or only renew the lease) now, fenced by the owner's token."""
        written = owned.connection.run(
            lambda: store.record_progress(
                self.using,
                owned.record_id,
                owner_token=owned.token,
                checkpoints=checkpoints,
                lease=self.options.lease,
                ttl=self.options.ttl,
            ),
            at_once=True,
        )
        if written and checkpoints is not None:
            self._note_progress(owned, checkpoints)
        return written

    def _note_progress(self, owned: _Owned, checkpoints: dict[str, Any]) -> None:
        """Remember what a checkpoint added, and whether its block commits.

        The checkpoint commits at once, but the writes it records may roll back with their
        block; a retry must not skip them, so :meth:`_settle_progress` puts such checkpoints back.
        """
        # Against those in force: a step run again after its block rolled
        # back may record what it recorded then (SQLite reuses the ids).
        before = self._checkpoints_in_force()
        if self._progress_at_start is None:
            self._progress_at_start = dict(before)
        added = {
            name: value
            for name, value in checkpoints.items()
            if name not in before or before[name] != value
        }
        committed: list[bool] = []
        if not connections[self.using].in_atomic_block:
            # Committed, or in the caller's manual transaction on this same connection.
            self._progress_log.append(_Recorded(added, [True]))
            return

        def marker() -> None:
            committed.append(True)

        self._progress_log.append(_Recorded(added, committed, marker))
        # Dropped, never called, if the block it is registered in rolls back.
        transaction.on_commit(marker, using=self.using)
        if not self._put_back_at_request_end:
            self._put_back_at_request_end = True
            self._put_back_progress_at_request_end(owned)

    def _checkpoints_in_force(self) -> dict[str, Any]:
        """What ``request.idempotency.checkpoints`` shows: those whose blocks did not roll back.

        A marker neither run nor still waiting was dropped with its rolled-back block.
        """
        log = self._progress_log
        if all(recorded.committed for recorded in log):
            return self.info.progress.checkpoints
        # (savepoint ids, callback, robust), as Django keeps them.
        waiting = {id(entry[1]) for entry in connections[self.using].run_on_commit}
        in_force = dict(self._progress_at_start or {})
        for recorded in log:
            if recorded.committed or id(recorded.marker) in waiting:
                in_force.update(recorded.added)
        return in_force

    def _settle_progress(self) -> dict[str, Any] | None:
        """The checkpoints whose transactions committed, once all ended; ``None`` if all did.

        Settles once: the rest leave this attempt's checkpoints.
        """
        log, self._progress_log = self._progress_log, []
        if all(recorded.committed for recorded in log):
            return None
        surviving = dict(self._progress_at_start or {})
        for recorded in log:
            if recorded.committed:
                surviving.update(recorded.added)
        self.info.progress.checkpoints = surviving
        return surviving

    def _put_back_progress_at_request_end(self, owned: _Owned) -> None:
        using = self.using

        def restore() -> None:
            surviving = self._settle_progress()
            if surviving is None:
                return
            try:
                store.restore_progress(using, owned.record_id, owned.token, surviving)
            except Error:
                self._log(
                    logging.ERROR,
                    "Could not discard the checkpoints of idempotency key %s in scope %r "
                    "that rolled back with the request.",
                    exc_info=True,
                )

        at_request_end(using, restore, self.request)

    def _recover(
        self, body: Callable[[], Any], lease: LeaseConnection, token: str, record: store.Record
    ) -> Any:
        """Ask the recovery policy about an abandoned claim: take over, complete, or hold."""
        if record.fingerprint != self.info.fingerprint:
            # The key stays bound to the work that may have half happened.
            return self._answer_duplicate(record)
        assert self.recover is not None
        observability.record_recovery("started", self.sender)
        abandoned = Abandoned(
            scope=self.info.scope,
            key=self.info.key,
            created_at=record.created_at,
            attempt=record.attempt,
            checkpoints=dict(record.checkpoints),
        )
        answer = self.kind.ask(self.recover, self.request, abandoned)
        self.kind.check_answer(self.recover, answer)
        if answer is None:
            new = self._new_claim(token, self.options.lease)
            taken = lease.run(lambda: store.take_over(self.using, record, new), at_once=True)
            if taken is None:
                raise self._conflict(retry_after=1)  # another request took it first
            return self._run_leased(body, _Owned(lease, record.id, token), taken, counted=True)
        # Rendered as a handler's response is: a DRF or template response has no bytes yet.
        answer = self.finish(answer)
        stored = self._encode(answer)
        if stored is None:
            self._send(signals.claim_held)
            self._log(
                logging.WARNING,
                "Idempotency key %s in scope %r was abandoned by its owner (attempt %d); "
                "the recovery policy holds it.",
                record.attempt,
                outcome="held",
            )
            return answer
        ttl = self.options.ttl
        settled = lease.run(lambda: store.settle(self.using, record, stored, ttl=ttl), at_once=True)
        if not settled:
            # Settled or taken over meanwhile, or its owner renewed its lease: in flight again.
            raise self._conflict(retry_after=1)
        self._send(signals.claim_recovered)
        self._stored(stored, ttl)
        observability.record_recovery("completed", self.sender)
        return answer if self.kind.fresh is None else self.kind.fresh(answer, stored)

    def _end_lease_on(self, exc: BaseException, owned: _Owned) -> None:
        ending = self.kind.ending(exc)
        if ending is Ending.FAILED:
            self._release(owned)
        elif ending is Ending.COMPLETED:
            stored = self.kind.ended_on_purpose
            if stored is not None:
                self._complete_lease(owned, stored)
        else:
            self._log(
                logging.WARNING,
                "The handler for idempotency key %s in scope %r ended with %s, which "
                "leaves its effect unknown; the key stays claimed until its lease runs out.",
                type(exc).__name__,
                outcome="held",
                waited=False,
            )

    def _complete_lease(self, owned: _Owned, stored: StoredResponse) -> bool:
        """Store a finished body's result; whether it was. Never releases the key.

        On the lease's own connection this joins the request's transaction, to commit with the
        body's writes; :func:`release_unless_committed` releases the claim if that rolls back.
        """
        lease = owned.connection
        if lease.own and lease.request_transaction_will_roll_back():
            # The body's writes are lost with it: as for a failed body.
            self._release(owned)
            return False
        ttl = self.options.ttl

        def complete(result: StoredResponse) -> bool:
            def update() -> bool:
                return store.complete(
                    self.using, owned.record_id, result, owner_token=owned.token, ttl=ttl
                )

            if lease.own:
                # The claim is committed and unlocked: the update does not wait.
                with transaction.atomic(using=self.using):
                    return update()
            return lease.run(update)

        if lease.own:
            # Before storing: a failed store takes the request's transaction down with it.
            release_unless_committed(self.using, lambda: self._release(owned), self.request)
        outcome = self._complete_or_without_body(complete, stored, lease, owned)
        if outcome is None:
            return False
        completed, stored = outcome
        # Sent now, on the request's connection, so a receiver's writes join its transaction.
        if completed:
            self._stored(stored, ttl)
            return True
        self._log(
            logging.WARNING,
            "Lease for idempotency key %s in scope %r ran out before the handler "
            "finished; its result was not stored. Raise LEASE above the "
            "longest request your server allows.",
            outcome="lease_lost",
            waited=False,
        )
        return False

    def _complete_or_without_body(
        self,
        complete: Callable[[StoredResponse], bool],
        stored: StoredResponse,
        lease: LeaseConnection,
        owned: _Owned,
    ) -> tuple[bool, StoredResponse] | None:
        """Complete with ``stored``, else with ``Kind.without_body`` of it: the key completes.

        Returns the outcome and what was stored; ``None`` if neither could be, and the key
        is still claimed: then, if the database refused what it was given (the error is about
        the content, not the connection), the key is completed with the kind's refusal.
        """
        attempts = [stored] if not stored.body else [stored, self.kind.without_body(stored)]
        for attempt in attempts:
            try:
                return complete(attempt), attempt
            except Error as error:
                if lease.shares_request_transaction():
                    raise  # which can no longer commit: the claim goes with it
                if lease.own and lease.request_transaction_will_roll_back():
                    # The failed store took the request's transaction down: its writes roll back,
                    # so the request must fail. The claim is released when it ends.
                    raise
                if attempt is not attempts[-1]:
                    self._log(
                        logging.WARNING,
                        "The response body for idempotency key %s in scope %r (%d bytes) "
                        "could not be stored; storing its status and headers only.",
                        len(attempt.body or b""),
                        exc_info=True,
                    )
                    continue
                refused = isinstance(error, _REFUSED_CONTENT)
                self._log(
                    logging.ERROR,
                    "The result for idempotency key %s in scope %r could not be stored; "
                    + (
                        "completing the key with a refusal instead, which every retry gets, "
                        "so that none repeats the effect."
                        if refused
                        else "the key stays claimed, so that a retry does not repeat the "
                        "effect, and retries get 409 until its lease runs out."
                    ),
                    exc_info=True,
                )
                if refused:
                    # On a fresh connection too: a result that cannot be written. The body
                    # has acted, so no retry may run it again.
                    self._refuse(owned)
        return None

    def _release(self, owned: _Owned) -> None:
        """Give the key back after a failed body, so that a retry can run.

        A claim with (committed) checkpoints keeps them and its attempt, for the retry to resume;
        one without is deleted.
        """
        lease = owned.connection
        checkpoints: dict[str, Any] | None = None
        if not connections[self.using].in_atomic_block:
            # All this attempt's transactions ended: put back what rolled back, before a
            # retry can take the key.
            checkpoints = self._settle_progress()
        keep = leases.carries_checkpoints(self.info.progress.checkpoints)
        try:
            released = lease.run(
                lambda: store.release(
                    self.using,
                    owned.record_id,
                    owned.token,
                    keep_progress=keep,
                    checkpoints=checkpoints,
                    ttl=self.options.ttl,
                )
            )
        except Error:
            if lease.shares_request_transaction():
                return  # the failed statement rolls the claim back with the request
            # Raising would hide the body's own error or response; the lease still runs out.
            self._log(
                logging.ERROR,
                "Could not release idempotency key %s in scope %r; retries get 409 "
                "until its lease runs out.",
                exc_info=True,
            )
            return
        if released:
            self._send(signals.claim_released)

    # What both modes share: the claim, a duplicate's answer, the stored result.

    @contextmanager
    def _progress(self, claim: store.Claim, write: ProgressWriter) -> Iterator[None]:
        """While the body runs, ``request.idempotency`` records progress through ``write``."""
        progress = self.info.progress
        progress.attempt, progress.checkpoints = claim.attempt, dict(claim.checkpoints)
        progress.write = write
        progress.in_force = self._checkpoints_in_force
        try:
            yield
        finally:
            progress.write = None

    def _new_claim(self, token: str, lease: timedelta | None) -> store.NewClaim:
        return store.NewClaim.of(self.info, ttl=self.options.ttl, token=token, lease=lease)

    def _busy(self, busy: store.Busy) -> IdempotencyError:
        """The answer when the wait for the key ran out, or SQLite stayed busy."""
        self._send(signals.wait_timed_out)
        if not isinstance(busy, store.DatabaseLocked):
            return self._conflict(retry_after=1)
        self._send(signals.request_conflict)
        self._log(
            logging.INFO,
            "Database busy; answering 409 to idempotency key %s in scope %r",
            outcome="database_busy",
        )
        busy_error = self.kind.database_busy
        return self.kind.in_flight(1) if busy_error is None else busy_error()

    def _answer_duplicate(self, record: store.Record) -> Any:
        if record.fingerprint != self.info.fingerprint:
            self._send(signals.fingerprint_mismatch)
            self._log(
                logging.INFO,
                "Idempotency key %s in scope %r reused with a different request",
                outcome="mismatch",
            )
            raise self.kind.mismatch()
        if record.response is not None:
            observability.record(
                signals.response_replayed, self.sender, self.request, self.info, self.started
            )
            cache_alias = idempotency_settings.replay_cache
            if cache_alias is not None:
                # A replay from the database refills a cache that lost the entry.
                lifetime = record.expires_at - record.seen_at
                self._cache_after_commit(cache_alias, record.response, lifetime)
            return self.kind.decode(record.response)
        # A held lease: retry after about as long as it has run, never after its lease
        # runs out; both by the database's clock.
        running = max(1.0, record.running_for.total_seconds())
        raise self._conflict(retry_after=min(running, record.held_for.total_seconds()))

    def _gave_up(self) -> IdempotencyError:
        """The answer when every claim attempt had to start over: try again in a second."""
        return self._conflict(retry_after=1)

    def _conflict(self, retry_after: float) -> IdempotencyError:
        self._send(signals.request_conflict)
        self._log(
            logging.INFO,
            "Idempotency key %s in scope %r is in flight; answering 409",
            outcome="conflict",
        )
        return self.kind.in_flight(retry_after)

    def _stored(self, stored: StoredResponse, lifetime: timedelta) -> None:
        self._send(signals.response_stored)
        cache_alias = idempotency_settings.replay_cache
        if cache_alias is not None:
            self._cache_after_commit(cache_alias, stored, lifetime)

    def _cache_after_commit(self, alias: str, stored: StoredResponse, lifetime: timedelta) -> None:
        """Cache a stored answer once its record commits; one that rolls back is never cached.

        ``lifetime``: the record's remaining life, by the database's clock.
        """
        info, using = self.info, self.using
        transaction.on_commit(
            lambda: replay_cache.put(alias, info, stored, lifetime, using), using=using
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
        """Log ``message`` with the masked key and scope first, then ``args``.

        ``outcome`` adds docs/observability.rst's fields, with the time waited if ``waited``.
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


# The request's end. Lease mode on its own connection stores the response inside the
# request's transaction; if that rolls back after the view returned, the committed claim is
# released when the request ends (docs/decorator.rst). A view's release is tied to its request
# object (under ASGI the view and the request's close run in different contexts), and, under
# ASGI, to request_finished in the view's thread too: Django's ASGI handler does not close the
# request of a view it cancelled (the client went away), but sends request_finished in that
# thread once the view has ended. A function's release is tied to request_finished, under
# WSGI only: under ASGI request_started runs in a context the function does not see.
# Elsewhere the key stays claimed until its lease runs out.

Release = Callable[[], None]

# The releases of this request cycle's functions; ``None`` outside one.
_pending: contextvars.ContextVar[list[Release] | None] = contextvars.ContextVar(
    "django_idempotency_pending_leases", default=None
)


def release_unless_committed(using: str, release: Release, request: Any) -> None:
    """Call ``release`` when the request ends, unless ``using``'s transaction committed.

    ``request`` is the view's request, or ``None`` for a function's call.
    """
    if not in_request_cycle(request):
        return  # nothing would ask
    committed: list[bool] = []
    transaction.on_commit(lambda: committed.append(True), using=using)

    def release_if_rolled_back() -> None:
        if not committed:
            release()

    at_request_end(using, release_if_rolled_back, request)


def in_request_cycle(request: Any) -> bool:
    """Whether :func:`at_request_end` has a request cycle to wait for."""
    return request is not None or _pending.get() is not None


def at_request_end(using: str, then: Release, request: Any) -> None:
    """Call ``then`` when the request ends, if ``using``'s transactions (a test's) ended by then."""
    pending = _pending.get() if request is None else None
    if request is None and pending is None:
        return

    def when_ended() -> None:
        # Logged here, once, so that the others still give back what is theirs: on the normal
        # path Django's loop that closes the response would swallow the error.
        try:
            if not connections[using].in_atomic_block:
                then()
        except Exception:
            logger.exception("A release at the end of a request failed.")

    if pending is not None:
        pending.append(when_ended)
        return
    http_request = django_request(request)
    if not isinstance(http_request, ASGIRequest):
        when_closed(http_request, when_ended)
        return
    once = _once(when_ended)
    when_closed(http_request, once)
    unclosed: list[Release] | None = getattr(_this_thread, "unclosed", None)
    if unclosed is not None:  # in the thread the handler began the request in
        unclosed.append(once)


def _once(callback: Release) -> Release:
    """``callback``, run at the first call only: the request's close or request_finished."""
    left = [callback]

    def call_once() -> None:
        try:
            first = left.pop()
        except IndexError:
            return
        first()

    return call_once


# What the views of the ASGI request this thread began left for its end; None between requests.
_this_thread = threading.local()


def _request_started(**kwargs: Any) -> None:
    _pending.set([])
    _this_thread.unclosed = []


def _request_finished(sender: Any = None, **kwargs: Any) -> None:
    pending = _pending.get()
    _pending.set(None)
    for release in pending or ():
        release()
    if sender is None:  # not an ASGI handler's: a response closed inside a view, a test client
        return
    unclosed: list[Release] = getattr(_this_thread, "unclosed", None) or []
    _this_thread.unclosed = None
    if not unclosed:
        return
    # What is left runs only when Django did not close the request (a view it cancelled), in a
    # thread that ends with it: close the connections the releases open, and only those (a
    # test's transaction keeps its connection open through the request). The connections set
    # up so far only: all() would make one for every alias.
    set_up = connections.all(initialized_only=True)
    was_open = {id(each) for each in set_up if each.connection is not None}
    for release in unclosed:
        release()
    for each in connections.all(initialized_only=True):
        if id(each) not in was_open:
            each.close_if_unusable_or_obsolete()


request_started.connect(_request_started, dispatch_uid="django_idempotency.engine.request_started")
request_finished.connect(
    _request_finished, dispatch_uid="django_idempotency.engine.request_finished"
)
