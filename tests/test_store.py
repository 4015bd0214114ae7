"""How the store waits, and what its errors mean, on each backend and driver.

Real connections throughout: a second thread holds the locks, and a
connection is closed and reopened where the bug lived in reconnecting.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory
from django.utils import timezone

from django_idempotency import clock, functions, idempotent, store
from django_idempotency.backends import base, postgresql
from django_idempotency.exceptions import CallInFlight, DatabaseBusy, TaskInFlight
from django_idempotency.models import IdempotencyKey
from tests.databases import claims_waiting, lock_timeout, new_claim
from tests.factories import IdempotencyKeyFactory
from tests.polling import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

only_postgresql = pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL")
only_sqlite = pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite")
only_mysql = pytest.mark.skipif(connection.vendor != "mysql", reason="MariaDB/MySQL")


def post(view: Callable[[HttpRequest], HttpResponse], key: str) -> HttpResponse:
    request = RequestFactory().post(
        "/", b"{}", content_type="application/json", headers={"Idempotency-Key": key}
    )
    response = view(request)
    # As Django's handler does once the response is sent: the body's copy closes with the
    # response, or after a refusal with the request.
    response.close()
    request.close()
    return response


class Holder:
    """Another connection, on its own thread, holding a write transaction open."""

    def __init__(self, write: Callable[[], object]) -> None:
        self.holding = threading.Event()
        self.done = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(write,))

    def _run(self, write: Callable[[], object]) -> None:
        try:
            with transaction.atomic():
                write()
                self.holding.set()
                self.done.wait(30)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            self.holding.set()
            connection.close()

    def __enter__(self) -> Holder:
        self.thread.start()
        assert self.holding.wait(30)
        assert not self.errors, self.errors
        return self

    def release_once_a_claim_waits(self) -> None:
        """Commit once a claim on another connection is blocked on the held row."""

        def release() -> None:
            try:
                wait_until(lambda: claims_waiting() >= 1, "a claim to wait on the held row")
            finally:
                self.done.set()
                connection.close()

        threading.Thread(target=release).start()

    def __exit__(self, *exc_info: object) -> None:
        self.done.set()
        self.thread.join(30)
        assert not self.errors, self.errors


def reopen_at_the_same_address() -> None:
    """Close the connection and open another, at the old one's address if CPython allows.

    CPython hands a freed object's memory to the next object of its size, so
    the new raw connection usually has the closed one's ``id()``: the case
    where a cache keyed by ``id()`` takes a fresh connection for the old one.
    """
    old = id(connection.connection)
    for _ in range(50):
        connection.close()
        connection.ensure_connection()
        if id(connection.connection) == old:
            return
    # Still a new connection: the test below stays meaningful, only less sharp.


@only_postgresql
class PostgresDriverTests:
    def test_the_environment_runs_the_driver_it_names(self):
        from django.db.backends.postgresql.psycopg_any import is_psycopg3

        expected = os.environ.get("TEST_POSTGRESQL_DRIVER")
        if not expected:
            pytest.skip("TEST_POSTGRESQL_DRIVER names no driver for this run")
        assert expected in ("psycopg", "psycopg2")
        assert is_psycopg3 == (expected == "psycopg")
        assert connection.Database.__name__ == expected
        connection.ensure_connection()
        assert repr(type(connection.connection)).startswith(f"<class '{expected}.")
        if expected == "psycopg2":
            # Django would prefer psycopg 3 if it could import it.
            assert importlib.util.find_spec("psycopg") is None


@only_postgresql
class PostgresErrorMeaningTests:
    def test_lock_timeout_is_busy(self):
        record = IdempotencyKeyFactory()
        holder = Holder(lambda: IdempotencyKey.objects.select_for_update().get(pk=record.pk))
        with holder, pytest.raises(store.Busy), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '100ms'")
            with store.explained("default"):
                IdempotencyKey.objects.select_for_update().get(pk=record.pk)

    def test_deadlock_is_retry(self):
        first, second = IdempotencyKeyFactory(), IdempotencyKeyFactory()
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def lock(one: int, other: int) -> None:
            try:
                with store.explained("default"), transaction.atomic():
                    IdempotencyKey.objects.select_for_update().get(pk=one)
                    barrier.wait(10)
                    IdempotencyKey.objects.select_for_update().get(pk=other)
            except BaseException as exc:
                errors.append(exc)
            finally:
                connection.close()

        threads = [
            threading.Thread(target=lock, args=(first.pk, second.pk)),
            threading.Thread(target=lock, args=(second.pk, first.pk)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

        assert [type(error) for error in errors] == [store.Retry]


@only_postgresql
class PostgresLockTimeoutAfterSecondPassTests:
    def original_commits_an_expired_record(self) -> Holder:
        # The original commits a record that has already expired while our
        # claim waits on it. Our first pass cannot see it (it committed after
        # the statement's snapshot), and the re-read finds it expired.
        def original() -> None:
            store.claim("default", new_claim("k", expires_in=-timedelta(hours=1)), wait=5)

        return Holder(original)

    def test_a_claim_that_waited_takes_the_expired_record_over_in_its_second_statement(self):
        # The new key's INSERT waited and then conflicted; the full claim
        # that follows sees the original's committed record, already expired.
        with self.original_commits_an_expired_record() as holder, transaction.atomic():
            holder.release_once_a_claim_waits()
            claim = store.claim("default", new_claim("k"), wait=3)

            assert claim.existing is None
            assert IdempotencyKey.objects.get(pk=claim.record_id).expires_at > timezone.now()

    def test_a_stale_look_starts_the_claim_over_in_its_savepoint(self, monkeypatch):
        # The full claim's own wait: its snapshot predates the original's commit.
        monkeypatch.setattr(postgresql, "claim_new", lambda *args: None)
        with self.original_commits_an_expired_record() as holder, transaction.atomic():
            holder.release_once_a_claim_waits()
            with pytest.raises(store.Retry) as retry, transaction.atomic():
                store.claim("default", new_claim("k"), wait=3)

            assert not retry.value.transaction_lost

    def test_view_keeps_its_lock_timeout_when_the_claim_looks_twice(self):
        # The second pass takes the record over, in a new savepoint of the
        # view's transaction: the bounded wait of the first went with the old one.
        def attempt() -> store.Claim:
            with transaction.atomic():
                return store.claim("default", new_claim("k"), wait=3)

        with self.original_commits_an_expired_record() as holder, transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '7s'")
            holder.release_once_a_claim_waits()
            try:
                claim = attempt()
            except store.Retry as retry:
                # Its own view of the record was stale: its savepoint is enough.
                assert not retry.transaction_lost
                claim = attempt()

            assert claim.existing is None
            assert lock_timeout() == "7s"

    def test_an_atomic_view_keeps_its_lock_timeout_when_its_claim_looks_twice(self):
        # The same, through the protocol: its second attempt must run in a new
        # savepoint, or the view's statements run with the claim's bounded wait.
        seen: list[str] = []

        @idempotent(scope=lambda request: "s")
        def view(request: HttpRequest) -> HttpResponse:
            seen.append(lock_timeout())
            return JsonResponse({}, status=201)

        with self.original_commits_an_expired_record() as holder, transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '7s'")
            holder.release_once_a_claim_waits()
            response = post(view, "k")

        assert response.status_code == 201
        assert seen == ["7s"]


@only_sqlite
class SqliteBusyTimeoutTests:
    def busy_timeout(self) -> int:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout")
            return cursor.fetchone()[0]

    def own_timeout(self) -> int:
        return round(connection.settings_dict["OPTIONS"].get("timeout", 5) * 1000)

    @pytest.mark.parametrize("atomic", [True, False])
    def test_handler_runs_with_the_connections_own_timeout(self, atomic):
        seen: list[int] = []

        @idempotent(wait=0.2, atomic=atomic)
        def view(request: HttpRequest) -> HttpResponse:
            seen.append(self.busy_timeout())
            return JsonResponse({}, status=201)

        assert post(view, "k").status_code == 201
        assert seen == [self.own_timeout()] != [200]
        assert self.busy_timeout() == self.own_timeout()

    def test_timeout_restored_when_begin_finds_the_database_locked(self):
        @idempotent(wait=0.2)
        def view(request: HttpRequest) -> HttpResponse:  # pragma: no cover - never runs
            return JsonResponse({}, status=201)

        with Holder(lambda: IdempotencyKeyFactory()):
            assert post(view, "other").status_code == 409
        assert self.busy_timeout() == self.own_timeout()

    def test_wait_applies_on_a_new_connection(self):
        @idempotent(wait=0.2)
        def view(request: HttpRequest) -> HttpResponse:
            return JsonResponse({}, status=201)

        assert post(view, "first").status_code == 201
        reopen_at_the_same_address()
        with Holder(lambda: IdempotencyKeyFactory()):
            started = time.monotonic()
            answer = post(view, "second")
            waited = time.monotonic() - started

        assert answer.status_code == 409
        assert waited < self.own_timeout() / 2000  # WAIT, not the connection's timeout


@only_sqlite
class SqliteDatabaseBusyTests:
    def test_another_keys_write_lock_is_database_busy_not_in_flight(self):
        @idempotent(wait=0.2)
        def view(request: HttpRequest) -> HttpResponse:  # pragma: no cover - never runs
            return JsonResponse({}, status=201)

        with Holder(lambda: IdempotencyKeyFactory(key="someone-else")):
            answer = post(view, "mine")

        assert answer.status_code == 409
        assert answer["Content-Type"] == "application/problem+json"
        assert answer["Retry-After"] == "1"
        problem = json.loads(answer.content)
        assert problem["type"].endswith(":database-busy")
        assert problem["title"] == "Database busy"
        assert "still being processed" not in problem["detail"]
        assert "database is busy" in problem["detail"]

    @pytest.mark.parametrize("kind", ["function", "task"])
    def test_a_function_or_task_meeting_that_lock_is_in_flight_for_a_second(self, kind):
        from django_idempotency.contrib.celery import TASK_VALUES

        def run() -> object:  # its body never runs
            return functions.run_once(
                scope="tests.charge",
                key="mine",
                arguments={},
                body=lambda info: "charged",
                options=functions.declare("tests.charge", wait=0.2),
                sender=None,
                kind=TASK_VALUES if kind == "task" else functions.VALUES,
            )

        holder = Holder(lambda: IdempotencyKeyFactory(key="someone-else"))
        with holder, pytest.raises(CallInFlight) as raised:
            run()

        assert isinstance(raised.value, TaskInFlight) == (kind == "task")
        assert not isinstance(raised.value, DatabaseBusy)
        assert raised.value.retry_after == 1
        assert not IdempotencyKey.objects.filter(key="mine").exists()


@only_mysql
class MysqlSessionWaitTests:
    def session_wait(self) -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
            return int(cursor.fetchone()[0])

    def test_wait_applies_on_a_new_connection(self, monkeypatch):
        # MySQL has no SET STATEMENT, so the wait is set once per session;
        # MariaDB runs that path too when it is told it is MySQL.
        connection.ensure_connection()
        monkeypatch.setattr(connection, "mysql_is_mariadb", False)
        with transaction.atomic():
            store.claim("default", new_claim("first"), wait=2)
        assert self.session_wait() == 2

        reopen_at_the_same_address()
        assert self.session_wait() != 2  # the server's default again
        with transaction.atomic():
            store.claim("default", new_claim("second"), wait=2)

        assert self.session_wait() == 2


def record_gone_for(monkeypatch: pytest.MonkeyPatch, looks: int) -> None:
    """The first ``looks`` claims find the record gone, as when a purge races them (SQLite)."""
    real_upsert, real_read = base.claim_upsert, base.read_record
    left = [looks]

    def upsert(connection: object, new: store.NewClaim, *args: object) -> store.Claim | None:
        return None if left[0] else real_upsert(connection, new, *args)  # type: ignore[arg-type]

    def read(connection: object, scope: str, key: str) -> store.Record | None:
        if left[0]:
            left[0] -= 1
            return None
        return real_read(connection, scope, key)  # type: ignore[arg-type]

    monkeypatch.setattr(base, "claim_upsert", upsert)
    monkeypatch.setattr(base, "read_record", read)


@only_sqlite
class ClaimRetryTests:
    """Every claim, of a view or a task in either mode, starts over in one loop:
    ``store.CLAIM_ATTEMPTS`` attempts in all, stale looks and deadlocks alike."""

    @pytest.mark.parametrize("atomic", [True, False])
    @pytest.mark.parametrize("looks", [1, store.CLAIM_ATTEMPTS - 1])
    def test_a_view_claim_starts_over_after_a_stale_look(self, monkeypatch, atomic, looks):
        record_gone_for(monkeypatch, looks)
        view = idempotent(atomic=atomic)(lambda request: JsonResponse({}, status=201))

        assert post(view, "k").status_code == 201
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED

    @pytest.mark.parametrize("atomic", [True, False])
    def test_a_view_answers_409_once_every_attempt_looked_stale(self, monkeypatch, atomic):
        record_gone_for(monkeypatch, store.CLAIM_ATTEMPTS)
        ran = []
        view = idempotent(atomic=atomic)(lambda request: ran.append(1) or JsonResponse({}))

        response = post(view, "k")

        assert response.status_code == 409
        assert response["Retry-After"] == "1"
        assert ran == [] and not IdempotencyKey.objects.exists()

    @pytest.mark.parametrize("atomic", [True, False])
    def test_a_task_claim_has_the_same_budget(self, monkeypatch, atomic):
        def run() -> object:
            from django_idempotency.contrib.celery import TASK_VALUES

            return functions.run_once(
                scope="tests.charge",
                key="k",
                arguments={},
                body=lambda info: "charged",
                options=functions.declare("tests.charge", atomic=atomic),
                sender=None,
                kind=TASK_VALUES,
            )

        record_gone_for(monkeypatch, store.CLAIM_ATTEMPTS)
        with pytest.raises(TaskInFlight):
            run()
        record_gone_for(monkeypatch, store.CLAIM_ATTEMPTS - 1)
        assert run() == "charged"


class StatementTests:
    """The statements' SQL and conversions, built once per vendor, read as the ORM does."""

    def test_a_read_record_holds_what_the_orm_reads(self):
        made = IdempotencyKeyFactory(
            checkpoints={"charged": {"id": 7}},
            attempt=2,
            retained_until=timezone.now() + timedelta(hours=1),
        )
        orm = IdempotencyKey.objects.get(pk=made.pk)

        record = base.read_record(connection, orm.scope, orm.key)

        assert record is not None and record.response is not None
        assert (record.id, record.fingerprint, record.owner_token) == (
            orm.pk,
            orm.fingerprint,
            orm.owner_token,
        )
        assert (record.created_at, record.expires_at) == (orm.created_at, orm.expires_at)
        assert record.retained_until == orm.retained_until
        assert record.created_at.tzinfo is not None and record.seen_at.tzinfo is not None
        assert record.response.status_code == orm.status_code
        assert record.response.headers == orm.response_headers
        assert bytes(record.response.body or b"") == bytes(orm.response_body)
        assert (record.attempt, record.checkpoints) == (2, {"charged": {"id": 7}})

    def test_a_cached_statement_reads_the_clock_a_test_moved(self):
        record = IdempotencyKeyFactory()
        real = base.read_record(connection, record.scope, record.key)
        assert real is not None
        when = real.seen_at - timedelta(days=3)

        clock.pin(when)
        try:
            pinned = base.read_record(connection, record.scope, record.key)
        finally:
            clock.pin(None)
        again = base.read_record(connection, record.scope, record.key)

        assert pinned is not None and again is not None
        assert abs(pinned.seen_at - when) < timedelta(milliseconds=1)
        assert again.seen_at >= real.seen_at

    @pytest.mark.parametrize(
        "duration",
        [timedelta(hours=1), -timedelta(seconds=1), timedelta(microseconds=1), timedelta(days=1)],
    )
    def test_a_durations_parameter_is_the_same_by_either_route(self, duration):
        by_vendor = clock.SECONDS[connection.vendor](duration)
        assert by_vendor == clock.seconds(connection, duration)


def test_no_backend_reads_before_claiming_and_waits_at_begin():
    # The replay lookup before a claim (store.find_completed) runs outside a
    # transaction and sets no wait of its own: a backend that waits at BEGIN,
    # as SQLite does, must leave retries to its claim.
    from django_idempotency.backends import BY_VENDOR, STANDARD

    for backend in [*BY_VENDOR.values(), STANDARD]:
        assert not (backend.reads_before_claiming and backend.waits_at_begin), backend
    assert BY_VENDOR["postgresql"].reads_before_claiming


@pytest.mark.parametrize("recovery_first", [True, False], ids=["recovery-first", "claim-first"])
def test_each_takeover_statement_is_cached_under_a_name_of_its_own(recovery_first):
    # A recovery policy's takeover and a claim's takeover of an expired record
    # are different statements: whichever is built first, the other gets its
    # own SQL from the cache (only an unpinned clock caches, as in production).
    base.STATEMENTS.clear()
    assert not clock.is_pinned()
    past = clock.read(connection) - timedelta(minutes=5)
    for key, token in [("abandoned", "dead-owner"), ("released", "")]:
        IdempotencyKeyFactory(
            scope="s",
            key=key,
            fingerprint="fp",
            state=IdempotencyKey.State.IN_PROGRESS,
            owner_token=token,
            expires_at=past,
            locked_until=past,
        )

    def claim_of(key: str, token: str) -> base.NewClaim:
        lease = timedelta(seconds=30)
        return base.NewClaim("s", key, "fp", token, lease, lease, timedelta(seconds=90))

    def recover() -> None:
        record = base.read_record(connection, "s", "abandoned")
        assert record is not None
        assert store.take_over("default", record, claim_of("abandoned", "policy")) is not None

    def take_over_released() -> None:
        with transaction.atomic():
            claimed = store.claim("default", claim_of("released", "claim"), 1.0)
        assert claimed.existing is None

    for step in [recover, take_over_released] if recovery_first else [take_over_released, recover]:
        step()
    owners = dict(IdempotencyKey.objects.values_list("key", "owner_token"))
    assert owners == {"abandoned": "policy", "released": "claim"}
