"""Running a task body at most once per (task name, key), without Celery.

:mod:`django_idempotency.tasks` adapts this to Celery; everything here works
on plain callables, so the protocol is tested once and the package still
imports without Celery. It uses the same table and the same statements as
views (:mod:`django_idempotency.store`): the scope is the task's name, the
fingerprint covers the task's arguments, and the stored response holds the
body's return value as JSON. See ``docs/tasks.rst``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NoReturn

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError, transaction
from django.utils import timezone

from django_idempotency import lease_connection, store
from django_idempotency.conf import idempotency_settings, to_timedelta
from django_idempotency.exceptions import TaskArgumentsMismatch, TaskInFlight, UnstorableResult
from django_idempotency.fields import fit_key_column
from django_idempotency.fingerprint import canonical_json
from django_idempotency.info import IdempotencyInfo
from django_idempotency.keys import mask_key
from django_idempotency.models import IdempotencyKey

logger = logging.getLogger(__name__)

#: The stored "response" of a task: its return value as a JSON document.
RESULT_STATUS = 200
RESULT_HEADERS = [["Content-Type", "application/json"]]

Body = Callable[[IdempotencyInfo], Any]


@dataclass(frozen=True)
class TaskOptions:
    """Per-task options; ``None`` follows the setting of the same name at run time."""

    atomic: bool | None = None
    ttl: timedelta | None = None
    wait: float | None = None
    lease: timedelta | None = None

    @classmethod
    def build(
        cls,
        *,
        atomic: bool | None = None,
        ttl: timedelta | float | None = None,
        wait: float | None = None,
        lease: timedelta | float | None = None,
    ) -> TaskOptions:
        """Validate the options when the task is defined, not when it first runs."""
        if atomic is not None and not isinstance(atomic, bool):
            raise TypeError(f"idempotent_task(atomic=...) must be True or False, not {atomic!r}.")
        if wait is not None and (
            isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0
        ):
            raise TypeError(f"idempotent_task(wait=...) must be seconds >= 0, not {wait!r}.")
        return cls(
            atomic=atomic,
            ttl=_duration("ttl", ttl),
            wait=None if wait is None else float(wait),
            lease=_duration("lease", lease),
        )


def _duration(name: str, value: timedelta | float | None) -> timedelta | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise TypeError(
            f"idempotent_task({name}=...) must be a timedelta or seconds, not {value!r}."
        )
    duration = to_timedelta(value)
    if duration <= timedelta(0):
        raise TypeError(f"idempotent_task({name}=...) must be positive, not {value!r}.")
    return duration


def task_key(value: object, task_name: str) -> str:
    """Check what a ``key=`` callable returned; a long key is stored as its digest."""
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"The key function of task {task_name!r} must return a non-empty string, "
            f"not {type(value).__name__}."
        )
    return fit_key_column(value)


def arguments_fingerprint(task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """SHA-256 over the arguments, canonicalised as JSON request bodies are.

    So ``charge(10)`` and ``charge(10.0)``, or keyword arguments in another
    order, are the same work, and any change of meaning is not.
    """
    try:
        document = json.dumps([list(args), dict(kwargs)], cls=DjangoJSONEncoder)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"The arguments of idempotent task {task_name!r} must be JSON-serialisable "
            f"to be fingerprinted: {exc}"
        ) from exc
    canonical = canonical_json(document.encode())
    assert canonical is not None  # it was just written as JSON
    return hashlib.sha256(b"task:" + canonical.encode()).hexdigest()


def run_once(
    *,
    task_name: str,
    key: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    body: Body,
    options: TaskOptions,
) -> Any:
    """Run ``body`` once per (task name, key); return its value, stored or fresh.

    Raises :class:`~django_idempotency.exceptions.TaskInFlight` when the
    original is still running (the caller schedules a retry), and
    :class:`~django_idempotency.exceptions.TaskArgumentsMismatch` when the key
    was used with other arguments.
    """
    conf = idempotency_settings
    run = _TaskRun(
        info=IdempotencyInfo(
            key=fit_key_column(key),
            scope=fit_key_column(task_name),
            fingerprint=arguments_fingerprint(task_name, args, kwargs),
        ),
        body=body,
        using=conf.database,
        ttl=options.ttl or conf.ttl,
        wait=conf.wait if options.wait is None else options.wait,
        lease=options.lease or conf.lease,
    )
    atomic = conf.atomic if options.atomic is None else options.atomic
    return run.atomic() if atomic else run.leased()


def _in_flight() -> TaskInFlight:
    # Every claim attempt had to start over: redeliver in a second.
    return TaskInFlight(retry_after=1)


def _encode(value: Any, task_name: str) -> bytes:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise UnstorableResult(
            f"Idempotent task {task_name!r} returned {type(value).__name__}, which cannot "
            f"be stored as JSON ({exc}). Return a JSON-serialisable value (dict, list, "
            "str, number, bool or None): duplicates get the stored value back."
        ) from exc


@dataclass
class _TaskRun:
    info: IdempotencyInfo
    body: Body
    using: str
    ttl: timedelta
    wait: float
    lease: timedelta

    def atomic(self) -> Any:
        """The claim, the body's writes and the stored value commit together."""
        # A deadlock that aborts the claim before the body ran is safe to
        # start over; nested in a caller's transaction, that one is lost too.
        return store.retrying(
            self._atomic_attempt, _in_flight, in_transaction=self._in_callers_transaction()
        )

    def _atomic_attempt(self) -> Any:
        store.prepare_connection(self.using, self.wait)
        body_started = False
        try:
            with transaction.atomic(using=self.using):
                claim = store.claim(self.using, self._new_claim(timezone.now()), self.wait)
                if claim.existing is not None:
                    return self._answer_duplicate(claim.existing)
                body_started = True
                payload = _encode(self.body(self.info), self.info.scope)
                store.complete(
                    self.using,
                    claim.record_id,
                    owner_token=None,
                    status_code=RESULT_STATUS,
                    headers=RESULT_HEADERS,
                    body=payload,
                    expires_at=None,
                )
                return json.loads(payload)
        except DatabaseError as exc:
            # SQLite waits at BEGIN, the others in the claim: either way a
            # database error before the body ran says what the claim met.
            if body_started:
                raise
            self._raise_claim_error(exc)

    def leased(self) -> Any:
        """The claim commits first; the body runs outside our transaction."""
        token = secrets.token_hex(16)
        claim = store.retrying(lambda: self._lease_claim(token), _in_flight)
        if claim.existing is not None:
            return self._answer_duplicate(claim.existing)
        try:
            value = self.body(self.info)
        except BaseException:
            self._release(claim.record_id, token)
            raise
        # The body has run: from here on the claim is never released, or a
        # redelivery would run it again (see docs/tasks.rst, "Lease mode").
        try:
            payload = _encode(value, self.info.scope)
        except UnstorableResult:
            self._log_claim_held("its return value cannot be stored as JSON")
            raise
        self._store(claim.record_id, token, payload)
        return json.loads(payload)

    def _store(self, record_id: int, token: str, payload: bytes) -> None:
        """Store the body's value, on a fresh connection if the first attempt fails.

        A long body can outlive its connection (a server restart, a killed
        session). If the value still cannot be stored, the claim stays held
        until the lease runs out: a duplicate waits rather than repeat the work.
        """
        try:
            completed = self._on_a_live_connection(
                lambda: store.complete(
                    self.using,
                    record_id,
                    owner_token=token,
                    status_code=RESULT_STATUS,
                    headers=RESULT_HEADERS,
                    body=payload,
                    expires_at=timezone.now() + self.ttl,
                )
            )
        except DatabaseError:
            if self._in_callers_transaction():
                raise  # which can no longer commit: the claim goes with it
            self._log_claim_held("its result could not be stored")
            return
        if not completed:
            logger.warning(
                "Lease for idempotency key %s of task %r ran out before the body "
                "finished; its result was not stored. Raise the task's lease above "
                "its longest run.",
                mask_key(self.info.key),
                self.info.scope,
            )

    def _release(self, record_id: int, token: str) -> None:
        """Give the key back after the body raised, so that a redelivery can run.

        Called while the body's exception propagates: a release that fails
        is logged, never raised, so that the body's own error is the one seen.
        """
        try:
            self._on_a_live_connection(lambda: store.release(self.using, record_id, token))
        except DatabaseError:
            if self._in_callers_transaction():
                return  # the claim rolls back with the caller's transaction
            logger.exception(
                "Could not release idempotency key %s of task %r after its body "
                "failed; duplicates wait until its lease runs out.",
                mask_key(self.info.key),
                self.info.scope,
            )

    def _on_a_live_connection(self, step: Callable[[], Any]) -> Any:
        # The statements match on the owner token, so they are safe to repeat.
        try:
            return step()
        except DatabaseError:
            if self._in_callers_transaction():
                raise  # a fresh connection would not see the claim
        with lease_connection.own_connection(self.using, fresh=True):
            return step()

    def _in_callers_transaction(self) -> bool:
        # Run inside a transaction (a test case's, say): the claim commits or
        # rolls back with it, and another connection cannot see it.
        return transaction.get_connection(self.using).in_atomic_block

    def _log_claim_held(self, reason: str) -> None:
        logger.error(
            "Idempotent task %r ran its body for key %s, but %s. The key stays "
            "claimed so that a redelivery does not run the body again; duplicates "
            "wait until its lease runs out.",
            self.info.scope,
            mask_key(self.info.key),
            reason,
            exc_info=True,
        )

    def _lease_claim(self, token: str) -> store.Claim:
        store.prepare_connection(self.using, self.wait)
        now = timezone.now()
        try:
            with transaction.atomic(using=self.using):
                return store.claim(
                    self.using, self._new_claim(now, token, now + self.lease), self.wait
                )
        except DatabaseError as exc:
            self._raise_claim_error(exc)

    def _new_claim(
        self, now: datetime, token: str = "", locked_until: datetime | None = None
    ) -> store.NewClaim:
        return store.NewClaim.of(
            self.info, now, ttl=self.ttl, token=token, locked_until=locked_until
        )

    def _raise_claim_error(self, exc: DatabaseError) -> NoReturn:
        """Raise what a database error met while claiming means for the message."""
        try:
            store.claim_failed(self.using, exc)
        except store.Busy as busy:
            # The original still holds its transaction after WAIT (or, on
            # SQLite, another writer holds the database's one write lock).
            raise TaskInFlight(retry_after=max(1.0, self.wait)) from busy

    def _answer_duplicate(self, record: IdempotencyKey) -> Any:
        if record.fingerprint != self.info.fingerprint:
            logger.info(
                "Idempotency key %s of task %r reused with different arguments",
                mask_key(self.info.key),
                self.info.scope,
            )
            raise TaskArgumentsMismatch(
                f"Idempotency key {mask_key(self.info.key)} of task {self.info.scope!r} "
                "was already used with different arguments; the original's result "
                "stands. Give different work a different key."
            )
        if record.state == IdempotencyKey.State.COMPLETED:
            stored = record.response_body
            return None if stored is None else json.loads(bytes(stored))
        # In progress: a lease-mode original still inside its lease.
        locked_until = record.locked_until or record.expires_at
        raise TaskInFlight(retry_after=(locked_until - timezone.now()).total_seconds())
