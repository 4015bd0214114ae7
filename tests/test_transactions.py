"""How the claim lives with the surrounding transaction and the schema."""

from __future__ import annotations

import json
import threading

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import Client

from django_idempotency import store
from django_idempotency.models import IdempotencyKey
from tests.databases import lock_timeout, new_claim
from tests.models import Order
from tests.views import calls, fail_next


def post(client: Client, url: str = "/orders/", key: str = "k"):
    return client.post(
        url,
        json.dumps({"item": "book"}),
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )


@pytest.fixture
def atomic_requests():
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    yield
    connection.settings_dict["ATOMIC_REQUESTS"] = False


@pytest.mark.django_db(transaction=True)
class AtomicRequestsTests:
    def test_atomic_mode_nests_and_commits_with_the_request(self, client, atomic_requests):
        first = post(client)
        retry = post(client)

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED

    def test_failure_rolls_back_record_with_the_request(self, atomic_requests):
        client = Client(raise_request_exception=False)
        fail_next.set()
        assert post(client).status_code == 500
        assert not IdempotencyKey.objects.exists()
        assert post(client).status_code == 201
        assert calls.value == 2

    def test_lease_mode_view_is_excluded_from_the_request_transaction(self, atomic_requests):
        client = Client(raise_request_exception=False)
        fail_next.set()
        assert post(client, "/orders/lease/").status_code == 500
        assert not IdempotencyKey.objects.exists()  # released, not stuck in progress
        assert post(client, "/orders/lease/").status_code == 201
        assert post(client, "/orders/lease/")["Idempotent-Replayed"] == "true"
        assert Order.objects.count() == 2  # lease mode cannot roll back the failed run's write

    def test_lease_mode_inside_a_transaction_commits_its_claim_first(self, rf):
        from tests.views import create_order_lease

        request = rf.post(
            "/orders/lease/",
            b"{}",
            content_type="application/json",
            headers={"Idempotency-Key": "k"},
        )
        with transaction.atomic():
            assert create_order_lease(request).status_code == 201
            if connection.vendor != "sqlite":  # SQLite: one connection, see docs/backends.rst
                assert in_progress_elsewhere("k")
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED


def in_progress_elsewhere(key: str) -> bool:
    """Whether another connection sees the claim committed, in progress."""
    seen: list[str] = []

    def read() -> None:
        try:
            seen.extend(IdempotencyKey.objects.filter(key=key).values_list("state", flat=True))
        finally:
            connection.close()

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(timeout=10)
    return seen == [IdempotencyKey.State.IN_PROGRESS]


@pytest.mark.django_db(transaction=True)
class MissingTableTests:
    def test_missing_table_says_to_migrate(self):
        with connection.schema_editor() as editor:
            editor.delete_model(IdempotencyKey)
        try:
            with pytest.raises(ImproperlyConfigured, match="migrate django_idempotency"):
                post(Client())
        finally:
            with connection.schema_editor() as editor:
                editor.create_model(IdempotencyKey)
        assert not Order.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL lock_timeout")
class PostgresLockTimeoutTests:
    def test_claim_restores_lock_timeout_for_the_handler(self):
        with transaction.atomic():
            before = lock_timeout()
            assert store.claim("default", new_claim("a"), wait=0.25).existing is None
            assert lock_timeout() == before

    def test_conflict_keeps_the_bounded_wait_for_its_read(self):
        with transaction.atomic():
            store.claim("default", new_claim("b"), wait=0.25)
        with transaction.atomic():
            claim = store.claim("default", new_claim("b"), wait=0.25)
            assert isinstance(claim.existing, IdempotencyKey)
            assert lock_timeout() == "250ms"
        assert lock_timeout() != "250ms"  # transaction-local


@pytest.mark.django_db
class LeaseInsideTestCaseTests:
    def test_lease_mode_view_is_testable_inside_a_test_case(self, client):
        first = post(client, "/orders/lease/")
        retry = post(client, "/orders/lease/")

        assert first.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1


class LeaseBySettingTests:
    def test_views_decorated_while_atomic_is_false_leave_atomic_requests(self, settings):
        from django_idempotency import idempotent

        settings.IDEMPOTENCY = {"ATOMIC": False}

        @idempotent
        def view(request):  # pragma: no cover - never called
            return None

        assert view._non_atomic_requests == set(settings.DATABASES)


@pytest.mark.django_db(transaction=True)
class LeaseStoreFailureTests:
    def test_failure_to_store_keeps_the_claim_after_the_effect(self, monkeypatch, caplog):
        # Releasing would let a retry repeat an effect that has run: the key
        # stays claimed until its lease runs out, as when a process dies.
        from django.db import DatabaseError

        def broken_complete(*args, **kwargs):
            raise DatabaseError("injected: storing the response failed")

        monkeypatch.setattr(store, "complete", broken_complete)
        client = Client(raise_request_exception=False)
        assert post(client, "/orders/lease/", key="store-fails").status_code == 201
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.IN_PROGRESS
        assert "could not be stored" in caplog.text
        assert "store-fails" not in caplog.text
        monkeypatch.undo()
        assert post(client, "/orders/lease/", key="store-fails").status_code == 409
        assert calls.value == 1

    def test_failure_to_store_an_empty_body_keeps_the_claim(self, monkeypatch, caplog):
        monkeypatch.setattr(store, "complete", broken)
        client = Client(raise_request_exception=False)
        assert post(client, "/lease/large/?size=0").status_code == 201
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.IN_PROGRESS
        assert "could not be stored. The key stays claimed" in caplog.text
        assert "storing its status and headers only" not in caplog.text

    def test_failure_to_release_keeps_the_handlers_own_error(self, monkeypatch, caplog):
        monkeypatch.setattr(store, "release", broken)
        fail_next.set()
        with pytest.raises(RuntimeError, match="handler failed after writing"):
            post(Client(), "/orders/lease/", key="release-fails")
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.IN_PROGRESS
        assert "Could not release idempotency key" in caplog.text
        assert "release-fails" not in caplog.text


@pytest.mark.django_db
class LeaseStoreFailureInsideTestCaseTests:
    def test_failure_to_store_fails_the_request_whose_transaction_holds_the_claim(
        self, monkeypatch
    ):
        # The claim commits or rolls back with the test's transaction, which
        # can no longer commit: the error is the request's.
        from django.db import DatabaseError

        monkeypatch.setattr(store, "complete", broken)
        with pytest.raises(DatabaseError, match="injected"):
            post(Client(), "/orders/lease/")

    def test_failure_to_release_keeps_the_handlers_own_error(self, monkeypatch, caplog):
        monkeypatch.setattr(store, "release", broken)
        fail_next.set()
        with pytest.raises(RuntimeError, match="handler failed after writing"):
            post(Client(), "/orders/lease/")
        assert "Could not release" not in caplog.text  # it goes with the transaction


def broken(*args, **kwargs):
    from django.db import DatabaseError

    raise DatabaseError("injected: the database refused the statement")


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL transaction ids")
class PostgresReplayWritesNothingTests:
    def test_replay_is_read_only_so_its_commit_needs_no_flush(self, client):
        from django_idempotency import signals

        seen: list[object] = []

        def inside_replay(**kwargs: object) -> None:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_current_xact_id_if_assigned()")
                seen.append(cursor.fetchone()[0])

        post(client)
        signals.response_replayed.connect(inside_replay)
        try:
            assert post(client)["Idempotent-Replayed"] == "true"
        finally:
            signals.response_replayed.disconnect(inside_replay)
        assert seen == [None]  # no transaction id: nothing was written or locked


@pytest.mark.django_db
@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL heap-only updates")
class PostgresHotUpdateTests:
    def counts(self) -> tuple[int, int]:
        # Within one open transaction these only grow; PostgreSQL 15 may
        # still hold an earlier transaction's unflushed counts, so compare.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = %s",
                [IdempotencyKey._meta.db_table],
            )
            return cursor.fetchone()

    def test_storing_the_response_is_a_heap_only_update(self, client):
        updates, hot_updates = self.counts()
        assert post(client).status_code == 201
        after_updates, after_hot_updates = self.counts()

        assert (after_updates - updates, after_hot_updates - hot_updates) == (1, 1)
