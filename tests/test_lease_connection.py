"""Lease mode where the request's connection cannot end the lease: inside a
transaction (``ATOMIC_REQUESTS``), after the connection died, or when the
database refuses the response's size.

Every test here is transactional and uses real connections: the claim and
the stored response are committed on a connection of their own, which one
test-wide transaction could not show.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.test import AsyncClient, Client, override_settings

from django_idempotency import signals
from django_idempotency.models import IdempotencyKey
from tests.models import Order
from tests.polling import in_background, wait_until
from tests.views import (
    calls,
    fail_after_view,
    fail_at_commit,
    handler_connection_ids,
    resume,
)

pytestmark = [pytest.mark.django_db(transaction=True)]

State = IdempotencyKey.State
BODY = b'{"item": "book"}'
server_only = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="a server-side connection to kill"
)


def post(url: str, key: str = "k") -> Any:
    client = Client(raise_request_exception=False)
    return client.post(url, BODY, content_type="application/json", headers={"Idempotency-Key": key})


def apost(url: str, key: str = "k") -> Any:
    """``post`` through Django's ASGI handler."""
    client = AsyncClient(raise_request_exception=False)
    return async_to_sync(client.post)(
        url, BODY, content_type="application/json", headers={"Idempotency-Key": key}
    )


def kill(server_id: int) -> None:
    """End another connection from the server side, as an administrator or a failover would."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_terminate_backend(%s)", [server_id])
            assert cursor.fetchone()[0] is True
        else:
            cursor.execute(f"KILL {int(server_id)}")


def run_and_kill(url: str) -> Any:
    """Send a request whose handler loses its connection after writing its effect."""
    join = in_background(lambda: post(url))
    kill(handler_connection_ids.get(timeout=20))
    resume.set()
    return join()


@pytest.fixture(autouse=True)
def no_leftovers() -> Any:
    resume.clear()
    fail_at_commit.clear()
    fail_after_view.clear()
    while not handler_connection_ids.empty():
        handler_connection_ids.get_nowait()
    yield


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)


def retry_runs_the_handler(url: str) -> None:
    resume.set()  # the retry's handler does not wait
    retry = post(url)
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert calls.value == 2
    assert IdempotencyKey.objects.get().state == State.COMPLETED


@pytest.mark.usefixtures("atomic_requests")
class AtomicRequestsTests:
    """Lease mode where ``ATOMIC_REQUESTS`` cannot see that the view left it."""

    @pytest.mark.parametrize("url", ["/orders/class-based-lease/", "/drf/api-lease/"])
    def test_lease_view_inside_the_request_transaction_replays(self, url: str) -> None:
        first = post(url)
        retry = post(url)
        assert first.status_code == retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert calls.value == 1
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    def test_failure_inside_the_request_transaction_releases(self) -> None:
        client = Client(raise_request_exception=False)
        url = "/orders/class-based-lease/"
        failed = client.post(
            url,
            b'{"item": "book", "raise": true}',
            content_type="application/json",
            headers={"Idempotency-Key": "k"},
        )
        assert failed.status_code == 500
        assert not IdempotencyKey.objects.exists()
        assert Order.objects.count() == 0  # rolled back with the request
        assert post(url).status_code == 201
        assert calls.value == 2

    @server_only
    def test_claim_commits_before_the_handler_runs(self) -> None:
        join = in_background(lambda: post("/orders/class-based-lease/?hold=1"))
        wait_until(lambda: calls.value == 1, "the handler to start")
        # Seen from another connection: the claim is committed, the view's
        # own write is still inside the request's transaction.
        record = IdempotencyKey.objects.get()
        assert record.state == State.IN_PROGRESS
        assert Order.objects.count() == 0
        duplicate = post("/orders/class-based-lease/?hold=1")
        assert duplicate.status_code == 409
        assert int(duplicate["Retry-After"]) > 200
        assert join().status_code == 201
        record.refresh_from_db()
        assert record.state == State.COMPLETED
        assert Order.objects.count() == 1

    @server_only
    def test_response_is_stored_in_the_request_transaction(self, rf: Any) -> None:
        # The response is stored by the request's own connection, inside its
        # transaction: other connections see the committed claim until the
        # request commits, and then the record and the view's write at once.
        # A crash between the two can no longer commit one without the other.
        from tests.views import create_order_lease

        request = rf.post(
            "/orders/lease/",
            BODY,
            content_type="application/json",
            headers={"Idempotency-Key": "k"},
        )
        with transaction.atomic():
            assert create_order_lease(request).status_code == 201
            assert IdempotencyKey.objects.get().state == State.COMPLETED
            seen_elsewhere = in_background(
                lambda: (IdempotencyKey.objects.get().state, Order.objects.count())
            )()
            assert seen_elsewhere == (State.IN_PROGRESS, 0)
        assert IdempotencyKey.objects.get().state == State.COMPLETED
        assert Order.objects.count() == 1

    @server_only
    def test_rolled_back_outside_a_request_cycle_keeps_the_key_claimed(self, rf: Any) -> None:
        # With no request to finish, nothing releases the claim: the record
        # and the view's write roll back together, and the key stays claimed
        # until its lease runs out (see docs/decorator.rst).
        from tests.views import create_order_lease

        request = rf.post(
            "/orders/lease/",
            BODY,
            content_type="application/json",
            headers={"Idempotency-Key": "k"},
        )
        with pytest.raises(RuntimeError), transaction.atomic():
            assert create_order_lease(request).status_code == 201
            raise RuntimeError("the request failed after the view")
        assert IdempotencyKey.objects.get().state == State.IN_PROGRESS
        assert Order.objects.count() == 0
        assert post("/orders/lease/").status_code == 409

    @pytest.mark.skipif(connection.vendor != "postgresql", reason="foreign keys checked at COMMIT")
    def test_request_failing_at_commit_releases_the_key(self) -> None:
        # The view returned, its response was stored in the request's
        # transaction, then COMMIT failed: effect and record are both gone,
        # and the claim is released when the request finishes.
        fail_at_commit.set()
        self.request_failing_after_the_view_releases_the_key()

    def test_request_failing_after_the_view_releases_the_key(self) -> None:
        fail_after_view.set()
        self.request_failing_after_the_view_releases_the_key()

    def test_request_failing_after_the_view_releases_the_key_under_asgi(self) -> None:
        # Under ASGI the view and the request's end run on executor threads:
        # the release still belongs to this request.
        fail_after_view.set()
        self.request_failing_after_the_view_releases_the_key(first=apost)

    def request_failing_after_the_view_releases_the_key(
        self, first: Callable[[str], Any] = post
    ) -> None:
        url = "/orders/lease-then-fail/"
        assert first(url).status_code == 500
        assert not IdempotencyKey.objects.exists()
        assert Order.objects.count() == 0
        retry = post(url)
        assert retry.status_code == 201
        assert "Idempotent-Replayed" not in retry
        replay = post(url)
        assert replay["Idempotent-Replayed"] == "true"
        assert replay.content == retry.content
        assert calls.value == 2
        assert Order.objects.count() == 1
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    @server_only
    def test_signal_receivers_run_on_the_request_connection(self) -> None:
        # A receiver's own writes (an audit row) must join the request's
        # transaction, not land on lease mode's connection.
        seen: list[tuple[str, Any]] = []

        def receiver(signal: Any, **kwargs: Any) -> None:
            seen.append((signal_names[signal], connections[DEFAULT_DB_ALIAS]))

        signal_names = {
            signals.key_claimed: "key_claimed",
            signals.response_stored: "response_stored",
            signals.claim_released: "claim_released",
        }
        for signal in signal_names:
            signal.connect(receiver)
        try:
            assert post("/orders/class-based-lease/").status_code == 201
            fail_after_view.set()
            assert post("/orders/lease-then-fail/", key="k2").status_code == 500
        finally:
            for signal in signal_names:
                signal.disconnect(receiver)
        request_connection = connections[DEFAULT_DB_ALIAS]
        assert [name for name, _ in seen] == [
            "key_claimed",
            "response_stored",
            "key_claimed",
            "response_stored",
            "claim_released",
        ]
        assert all(used is request_connection for _, used in seen)

    @server_only
    def test_own_connection_is_closed_after_each_use(self) -> None:
        # CONN_MAX_AGE = 0: no second connection is held while a view runs.
        join = in_background(lambda: post("/orders/class-based-lease/?hold=1"))
        wait_until(lambda: calls.value == 1, "the handler to start")
        # The server lists a new connection with a slight delay under load.
        wait_until(lambda: self.connections_to_the_database() >= 2, "the view's connection")
        assert self.connections_to_the_database() == 2  # this test's and the view's
        assert join().status_code == 201

    def connections_to_the_database(self) -> int:
        """Connections from this process only: other processes may use the server too."""
        ours = own_tcp_ports()
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(
                    "SELECT client_port FROM pg_stat_activity WHERE datname = current_database()"
                )
                ports = [row[0] for row in cursor.fetchall()]
            else:
                cursor.execute(
                    "SELECT HOST FROM information_schema.PROCESSLIST WHERE DB = DATABASE()"
                )
                ports = [
                    int(host.rsplit(":", 1)[1]) for (host,) in cursor.fetchall() if ":" in host
                ]
        return sum(1 for port in ports if port in ours)


def own_tcp_ports() -> set[int]:
    """The local ports of this process's TCP sockets, read from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@server_only
class LostConnectionTests:
    """The handler's connection is killed from the server side while it runs."""

    @pytest.mark.parametrize(
        "url", ["/lease/outlive-connection/", "/lease/outlive-connection/class-based/"]
    )
    def test_handler_raising_after_losing_its_connection_releases(self, url: str) -> None:
        assert run_and_kill(f"{url}?raise=1").status_code == 500
        assert not IdempotencyKey.objects.exists()
        retry_runs_the_handler(url)

    def test_handler_answering_after_losing_its_connection_is_stored(self) -> None:
        url = "/lease/outlive-connection/"
        response = run_and_kill(url)
        assert response.status_code == 201
        record = IdempotencyKey.objects.get()
        assert record.state == State.COMPLETED
        assert bytes(record.response_body) == b"created"
        resume.set()  # were the handler to run again, it would not wait
        replay = post(url)
        assert replay.status_code == 201
        assert replay["Idempotent-Replayed"] == "true"
        assert replay.content == b"created"
        assert calls.value == 1
        assert Order.objects.count() == 1

    @pytest.mark.usefixtures("atomic_requests")
    @pytest.mark.parametrize("query", ["", "?raise=1"])
    def test_lost_request_transaction_releases(self, query: str) -> None:
        # Under ATOMIC_REQUESTS the view's write dies with its connection:
        # the request failed, so a retry runs it again.
        url = "/lease/outlive-connection/class-based/"
        assert run_and_kill(f"{url}{query}").status_code == 500
        assert not IdempotencyKey.objects.exists()
        assert Order.objects.count() == 0
        retry_runs_the_handler(url)
        assert Order.objects.count() == 1


@pytest.mark.skipif(connection.vendor != "mysql", reason="MySQL's max_allowed_packet")
class OversizedBodyTests:
    def test_body_over_max_allowed_packet_is_stored_without_it(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT @@max_allowed_packet")
            limit = cursor.fetchone()[0]
        url = f"/lease/large/?size={limit + 1024}"
        key = "oversized-body-key"
        with (
            override_settings(IDEMPOTENCY={"MAX_STORED_BODY": 4 * limit}),
            caplog.at_level(logging.WARNING, "django_idempotency"),
        ):
            # Each request in a thread of its own, on a connection of its own,
            # as a server would after the refused packet broke the first one.
            first = in_background(lambda: post(url, key))()
            retry = in_background(lambda: post(url, key))()
        assert first.status_code == 201
        assert len(first.content) == limit + 1024
        record = IdempotencyKey.objects.get()
        assert record.state == State.COMPLETED
        assert record.response_body is None
        # Stored as a body over MAX_STORED_BODY is: status and headers only.
        assert retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry["Location"] == "/exports/1/"
        assert retry.content == b""
        assert calls.value == 1
        assert "could not be stored; storing its status and headers only" in caplog.text
        assert key not in caplog.text
