"""The engine (engine.py): atomic and lease mode around a view, and how each ends.

Lease mode: the claim commits first, the handler runs outside; also where
the request's connection cannot end the lease: after the connection died,
or when the database refuses the response's size. How lease mode meets
``ATOMIC_REQUESTS`` is in ``test_transactions.py``; every ending of
every adapter is in ``test_endings.py``.

Every test here is transactional and uses real connections: lease mode
commits its claim on its own, which a test wrapped in one transaction could
not show.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.test import Client, override_settings
from django.utils import timezone
from rest_framework.request import Request
from rest_framework.test import APIClient, APIRequestFactory

from django_idempotency import clock as database_clock
from django_idempotency import store
from django_idempotency.body import close_spools_with
from django_idempotency.fingerprint import request_fingerprint
from django_idempotency.info import IdempotencyInfo
from django_idempotency.models import IdempotencyKey
from tests import clients, drf_views
from tests.clients import LEASE_ORDERS, PAYLOAD, drf_post, reset_lease_views, send, token_client
from tests.databases import kill_connection
from tests.factories import IdempotencyKeyFactory
from tests.models import Order
from tests.polling import in_background, updating, wait_until
from tests.server import wait_for_file
from tests.views import calls, handler_connection_ids, resume

pytestmark = [pytest.mark.django_db(transaction=True)]

KEY = "lease-1"
State = IdempotencyKey.State
server_only = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="a server-side connection to kill"
)


@pytest.fixture
def client() -> tuple[APIClient, User]:
    return token_client()


@pytest.fixture(autouse=True)
def no_leftovers() -> None:
    reset_lease_views()


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)


def post(api: APIClient, url: str, key: str | None = KEY, **extra: Any) -> Any:
    return drf_post(api, url, key=key, **extra)


def fingerprint_of(url: str, data: Any = PAYLOAD) -> str:
    """The fingerprint the DRF view computes for ``post()``, after negotiating JSON."""
    request = Request(APIRequestFactory().post(url, data, format="json"))
    request.accepted_media_type = "application/json"
    try:
        return request_fingerprint(request)
    finally:
        close_spools_with(request, None)  # as the response would


def expired_lease(user: User, url: str = LEASE_ORDERS) -> Any:
    """``user``'s claim of ``KEY`` for ``post()`` to ``url``, whose lease has run out."""
    return IdempotencyKeyFactory(
        scope=f"user:{user.pk}", key=KEY, fingerprint=fingerprint_of(url), lease_expired=True
    )


def run_and_kill(url: str) -> Any:
    """Send a request whose handler loses its connection after writing its effect."""
    join = in_background(lambda: send(url))
    kill_connection(handler_connection_ids.get(timeout=20))
    resume.set()
    return join()


def retry_runs_the_handler(url: str) -> None:
    resume.set()  # the retry's handler does not wait
    retry = send(url)
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert calls.value == 2
    assert IdempotencyKey.objects.get().state == State.COMPLETED


class LeaseClaimTests:
    def test_claim_commits_before_the_handler_runs(self, client: Any) -> None:
        api, user = client
        before = timezone.now()
        join = in_background(lambda: post(api, f"{LEASE_ORDERS}?hold=1"))
        # The handler counts its call before it writes its row, so wait for
        # the row: the claim and the effect are then both committed, seen
        # from this thread's own connection, while the handler still holds.
        wait_until(lambda: calls.value == 1 and Order.objects.exists(), "the handler's effect")
        record = IdempotencyKey.objects.get()
        assert record.scope == f"user:{user.pk}"
        assert record.state == State.IN_PROGRESS
        assert re.fullmatch(r"[0-9a-f]{32}", record.owner_token)
        assert record.locked_until is not None
        assert before + timedelta(minutes=5) <= record.locked_until
        assert record.locked_until <= timezone.now() + timedelta(minutes=5)
        assert record.expires_at == record.locked_until
        assert Order.objects.count() == 1
        response = join()
        assert response.status_code == 201
        record.refresh_from_db()
        assert record.state == State.COMPLETED
        assert record.locked_until is None
        assert record.expires_at > timezone.now() + timedelta(hours=23)
        assert bytes(record.response_body) == response.content

    def test_handler_runs_outside_any_transaction(self, client: Any) -> None:
        api, _ = client
        response = post(api, f"{LEASE_ORDERS}info/")
        assert response.status_code == 200
        assert response.json()["in_atomic_block"] is False

    def test_owner_tokens_are_random(self, client: Any) -> None:
        api, _ = client
        tokens = set()
        for index in range(3):
            join = in_background(lambda i=index: post(api, f"{LEASE_ORDERS}?hold=0.5", key=f"t{i}"))
            wait_until(lambda i=index: calls.value == i + 1, "the handler to start")
            tokens.add(IdempotencyKey.objects.get(key=f"t{index}").owner_token)
            assert join().status_code == 201
        assert len(tokens) == 3

    def test_retry_after_completion_replays(self, client: Any) -> None:
        api, _ = client
        first = post(api, LEASE_ORDERS)
        retry = post(api, LEASE_ORDERS)
        assert first.status_code == retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert retry.content == first.content
        assert calls.value == 1


@pytest.mark.concurrency
class LeaseDuplicateTests:
    def test_duplicate_while_lease_held_is_409_with_retry_after(self, client: Any) -> None:
        api, _ = client
        join = in_background(lambda: post(api, f"{LEASE_ORDERS}?hold=1"))
        wait_until(lambda: calls.value == 1, "the handler to start")
        started = time.monotonic()
        duplicate = post(api, f"{LEASE_ORDERS}?hold=1")
        # Lease mode does not wait for the original: it answers at once.
        assert time.monotonic() - started < 0.9
        assert duplicate.status_code == 409
        # When to come back: after about as long as the original has run (here
        # well under a second), not the whole 300-second lease.
        assert duplicate["Retry-After"] == "1"
        assert duplicate.json()["detail"].startswith("A request with this idempotency key")
        original = join()
        assert original.status_code == 201
        assert calls.value == 1
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    @pytest.mark.parametrize(
        ("ran", "left", "expected"),
        [
            # About as long as the original has run so far...
            (40, 260, (40, 41, 42)),
            # ...but never past the lease, when it runs out sooner.
            (280, 20, (19, 20)),
        ],
    )
    def test_retry_after_follows_the_original_and_never_passes_the_lease(
        self, client: Any, ran: int, left: int, expected: tuple[int, ...]
    ) -> None:
        api, user = client
        IdempotencyKeyFactory(
            scope=f"user:{user.pk}",
            key=KEY,
            fingerprint=fingerprint_of(LEASE_ORDERS),
            in_flight=True,
            created_at=timezone.now() - timedelta(seconds=ran),
            locked_until=timezone.now() + timedelta(seconds=left),
        )
        response = post(api, LEASE_ORDERS)
        assert response.status_code == 409
        assert int(response["Retry-After"]) in expected

    def test_duplicate_with_other_body_while_held_is_422(self, client: Any) -> None:
        api, _ = client
        join = in_background(lambda: post(api, f"{LEASE_ORDERS}?hold=1"))
        wait_until(lambda: calls.value == 1, "the handler to start")
        token = IdempotencyKey.objects.get().owner_token
        response = drf_post(api, f"{LEASE_ORDERS}?hold=1", {"item": "other"}, key=KEY)
        assert response.status_code == 422
        assert IdempotencyKey.objects.get().owner_token == token
        assert join().status_code == 201

    def test_retry_after_is_at_least_one_second(self, client: Any) -> None:
        api, user = client
        IdempotencyKeyFactory(
            scope=f"user:{user.pk}",
            key=KEY,
            fingerprint=fingerprint_of(LEASE_ORDERS),
            in_flight=True,
            locked_until=timezone.now() + timedelta(milliseconds=300),
        )
        response = post(api, LEASE_ORDERS)
        assert response.status_code == 409
        assert response["Retry-After"] == "1"
        assert calls.value == 0


class LeaseReleaseTests:
    """A failed handler gives its claim back so that a retry can run."""

    @pytest.mark.parametrize("query", ["raise=1", "status=500", "status=503", "status=409"])
    def test_failure_releases_the_claim(self, client: Any, query: str) -> None:
        api, _ = client
        failed = post(api, f"{LEASE_ORDERS}?{query}")
        assert failed.status_code in (409, 500, 503)
        assert IdempotencyKey.objects.count() == 0
        # Lease mode runs the handler outside our transaction: its effect stays.
        assert Order.objects.count() == 1
        retry = post(api, LEASE_ORDERS)
        assert retry.status_code == 201
        assert "Idempotent-Replayed" not in retry
        assert calls.value == 2
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    def test_non_transient_4xx_is_stored(self, client: Any) -> None:
        api, _ = client
        assert post(api, f"{LEASE_ORDERS}?status=400").status_code == 400
        replay = post(api, f"{LEASE_ORDERS}?status=400")
        assert replay.status_code == 400
        assert replay["Idempotent-Replayed"] == "true"
        assert calls.value == 1


def assert_refused_as_not_stored(response: Any) -> None:
    """The refusal a key whose response could not be kept gives every retry."""
    assert response.status_code == 500
    assert response["Content-Type"] == "application/problem+json"
    assert response["Idempotent-Replayed"] == "true"
    assert json.loads(response.content)["type"].endswith(":result-not-stored")


def assert_every_retry_refused(url: str) -> None:
    """Its first request ran once; every retry gets the refusal, past the lease too."""
    assert_refused_as_not_stored(send(url, KEY))
    with database_clock.shifted(timedelta(hours=1)):  # past the lease, within the TTL
        assert_refused_as_not_stored(send(url, KEY))
    assert calls.value == 1
    assert Order.objects.count() == 1
    assert IdempotencyKey.objects.get().state == State.COMPLETED


class RenderFailureTests:
    """A response whose rendering fails after the handler returned: the handler has acted.

    The key is completed with a refusal, so that no retry runs the handler
    again: not at once, and not once the lease would have run out.
    """

    def test_lease_template_that_fails_to_render_completes_with_a_refusal(
        self, caplog: Any
    ) -> None:
        with caplog.at_level(logging.ERROR, logger="django_idempotency.core"):
            failed = send("/lease/unrenderable/", KEY)
        assert failed.status_code == 500
        assert "cannot be rendered or stored" in caplog.text
        assert_every_retry_refused("/lease/unrenderable/")

    def test_lease_drf_response_that_fails_to_render_completes_with_a_refusal(
        self, client: Any
    ) -> None:
        api, _ = client
        assert post(api, f"{LEASE_ORDERS}?unrenderable=1").status_code == 500
        assert_refused_as_not_stored(post(api, f"{LEASE_ORDERS}?unrenderable=1"))
        with database_clock.shifted(timedelta(hours=1)):
            assert_refused_as_not_stored(post(api, f"{LEASE_ORDERS}?unrenderable=1"))
        assert calls.value == 1
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    @pytest.mark.skipif(
        connection.vendor != "postgresql", reason="only PostgreSQL's jsonb refuses a NUL"
    )
    def test_lease_response_the_database_refuses_completes_with_a_refusal(
        self, caplog: Any
    ) -> None:
        # Its headers too: nothing of it can be written, on a fresh connection either.
        with caplog.at_level(logging.ERROR, logger="django_idempotency.core"):
            first = send("/lease/unwritable/", KEY)
        assert first.status_code == 201  # the client still gets the view's response
        assert "completing the key with a refusal instead" in caplog.text
        assert_every_retry_refused("/lease/unwritable/")

    def test_an_operator_delete_lets_it_run_again(self) -> None:
        send("/lease/unrenderable/", KEY)
        call_command("idempotency_keys", "delete", "anonymous", KEY, stdout=StringIO())
        assert send("/lease/unrenderable/", KEY).status_code == 500
        assert calls.value == 2

    def test_an_operator_release_runs_it_again_resuming_from_its_checkpoints(self) -> None:
        url = "/lease/unrenderable/until-resumed/"
        assert send(url, KEY).status_code == 500
        assert_refused_as_not_stored(send(url, KEY))
        out = StringIO()

        call_command("idempotency_keys", "release", "anonymous", KEY, stdout=out)

        assert "Released the refusal (500, its result was not stored)" in out.getvalue()
        assert "runs its handler again as attempt 2, resuming from its checkpoints (charged)" in (
            out.getvalue()
        )
        resumed = send(url, KEY)
        assert resumed.status_code == 201
        assert "Idempotent-Replayed" not in resumed
        charged = Order.objects.get(item="charged")
        assert json.loads(resumed.content) == {"order": charged.pk, "attempt": 2}
        replay = send(url, KEY)
        assert (replay.status_code, replay["Idempotent-Replayed"]) == (201, "true")
        assert replay.content == resumed.content
        assert calls.value == 2
        record = IdempotencyKey.objects.get()
        assert (record.state, record.status_code, record.attempt) == (State.COMPLETED, 201, 2)

    @pytest.mark.skipif(
        connection.vendor == "sqlite", reason="SQLite: the claim is the request's transaction's"
    )
    def test_a_release_resumes_only_from_checkpoints_whose_writes_committed(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # ATOMIC_REQUESTS: the charge's order rolls back with the request, while
        # its checkpoint and the refusal committed on the lease's connection.
        monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
        url = "/lease/unrenderable/until-resumed/class-based/"
        assert send(url, KEY).status_code == 500
        assert not Order.objects.exists()
        assert IdempotencyKey.objects.get().checkpoints is None

        call_command("idempotency_keys", "release", "anonymous", KEY, stdout=StringIO())
        # Not resumed from a charge that is gone (a 201 naming a missing order):
        # charged again, refused again, and rolled back with the request again.
        assert send(url, KEY).status_code == 500
        assert calls.value == 2
        assert not Order.objects.exists()
        assert IdempotencyKey.objects.get().checkpoints is None

    def test_the_refusal_names_the_command_that_lets_it_run_again(self) -> None:
        # Delete frees a refused key, whatever its handler recorded; release resumes it.
        send("/lease/unrenderable/", KEY)
        detail = json.loads(send("/lease/unrenderable/", KEY).content)["detail"]
        named = re.findall(r"manage\.py (idempotency_keys \w+)", detail)
        assert named == ["idempotency_keys delete"], detail
        call_command(*named[0].split(), "anonymous", KEY, stdout=StringIO())
        assert send("/lease/unrenderable/", KEY).status_code == 500
        assert calls.value == 2

    def test_atomic_template_that_fails_to_render_rolls_back_for_a_retry(self) -> None:
        # The failure rolls the handler's writes back with the claim: a retry may run.
        for _ in range(2):
            assert send("/orders/unrenderable/", KEY).status_code == 500
        assert calls.value == 2
        assert Order.objects.count() == 0
        assert IdempotencyKey.objects.count() == 0


class TakeoverTests:
    def test_expired_lease_is_taken_over_in_place(self, client: Any) -> None:
        api, user = client
        stale = expired_lease(user)
        response = post(api, LEASE_ORDERS)
        assert response.status_code == 201
        assert "Idempotent-Replayed" not in response
        record = IdempotencyKey.objects.get()
        # Taken over by the claim statement itself: same row, new owner.
        assert record.pk == stale.pk
        assert record.owner_token != stale.owner_token
        assert record.state == State.COMPLETED
        assert bytes(record.response_body) == response.content

    def test_expired_lease_with_other_body_is_taken_over(self, client: Any) -> None:
        api, user = client
        IdempotencyKeyFactory(scope=f"user:{user.pk}", key=KEY, lease_expired=True)
        assert post(api, LEASE_ORDERS).status_code == 201
        assert IdempotencyKey.objects.get().fingerprint == fingerprint_of(LEASE_ORDERS)

    def test_stale_owner_cannot_complete_or_release_after_takeover(self, client: Any) -> None:
        api, user = client
        stale = expired_lease(user)
        first = post(api, LEASE_ORDERS)
        completed = IdempotencyKey.objects.get()
        stale_response = store.StoredResponse(500, [], b"stale")
        assert (
            store.complete(
                "default",
                stale.pk,
                stale_response,
                owner_token=stale.owner_token,
                ttl=timedelta(days=9),
            )
            is False
        )
        assert store.release("default", stale.pk, stale.owner_token) is False
        after = IdempotencyKey.objects.get()
        assert (after.state, after.status_code, bytes(after.response_body)) == (
            State.COMPLETED,
            201,
            first.content,
        )
        assert after.expires_at == completed.expires_at

    @pytest.mark.concurrency
    def test_stale_owner_cannot_touch_the_new_owners_claim(self, client: Any) -> None:
        api, user = client
        stale = expired_lease(user, f"{LEASE_ORDERS}?hold=1")
        join = in_background(lambda: post(api, f"{LEASE_ORDERS}?hold=1"))
        wait_until(lambda: calls.value == 1, "the new owner to start")
        owner = IdempotencyKey.objects.get()
        assert owner.owner_token != stale.owner_token
        assert not store.complete(
            "default",
            stale.pk,
            store.StoredResponse(200, [], b"stale"),
            owner_token=stale.owner_token,
            ttl=timedelta(days=1),
        )
        assert not store.release("default", stale.pk, stale.owner_token)
        still = IdempotencyKey.objects.get()
        assert (still.state, still.owner_token) == (State.IN_PROGRESS, owner.owner_token)
        response = join()
        assert response.status_code == 201
        final = IdempotencyKey.objects.get()
        assert final.state == State.COMPLETED
        assert bytes(final.response_body) == response.content


@pytest.mark.concurrency
class LostLeaseTests:
    """A handler that outlives its lease: the next request takes over, the late one loses."""

    def test_late_owner_loses_to_the_takeover(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        monkeypatch.setenv(drf_views.CONTROL_DIR_ENV, str(tmp_path))
        api = APIClient(raise_request_exception=False)
        url = "/drf/lease-hold/"
        key = "lost-1"

        def send() -> Any:
            return api.post(url, {"item": "x"}, format="json", headers={"Idempotency-Key": key})

        late = in_background(send)
        wait_until(lambda: (tmp_path / f"{key}.pid").exists(), "the first owner to start")
        first_report = json.loads((tmp_path / f"{key}.pid").read_text())
        (tmp_path / f"{key}.pid").unlink()  # so that the next report is the takeover's
        held = IdempotencyKey.objects.get()
        duplicate = send()
        assert duplicate.status_code == 409
        assert duplicate["Retry-After"] in ("1", "2")
        # Past the 2 s lease, the next request takes the key over.
        wait_until(lambda: timezone.now() > held.locked_until, "the lease to run out", limit=5)
        with caplog.at_level(logging.WARNING, logger="django_idempotency.core"):
            new = in_background(send)
            wait_until(lambda: calls.value == 2, "the takeover to start")
            taken = IdempotencyKey.objects.get()
            assert taken.pk == held.pk
            assert taken.owner_token != held.owner_token
            second_report = wait_for_file(tmp_path / f"{key}.pid")
            (tmp_path / f"{key}.go").touch()
            new_response = new()
            late_response = late()
        assert new_response.status_code == late_response.status_code == 201
        assert second_report["payment"] == first_report["payment"]
        assert new_response.json()["payment"] == late_response.json()["payment"]
        record = IdempotencyKey.objects.get()
        assert record.state == State.COMPLETED
        assert record.owner_token == taken.owner_token
        assert bytes(record.response_body) == new_response.content
        assert "ran out before the handler finished" in caplog.text
        replay = send()
        assert replay["Idempotent-Replayed"] == "true"
        assert replay.content == new_response.content
        assert Order.objects.count() == 2


@pytest.mark.concurrency
class LeaseRaceTests:
    """Simultaneous duplicates in lease mode: one owner, the rest answered 409, no 500."""

    RACERS = 6

    def _race(self, api: APIClient, url: str) -> list[Any]:
        barrier = threading.Barrier(self.RACERS)

        def send() -> Any:
            barrier.wait(timeout=10)
            return post(api, url)

        joins = [in_background(send) for _ in range(self.RACERS)]
        return [join() for join in joins]

    def _assert_one_owner(self, responses: list[Any]) -> Any:
        statuses = sorted(response.status_code for response in responses)
        assert statuses == [201] + [409] * (self.RACERS - 1)
        for response in responses:
            if response.status_code == 409:
                assert int(response["Retry-After"]) >= 1
        assert calls.value == 1
        return next(response for response in responses if response.status_code == 201)

    def test_fresh_key(self, client: Any) -> None:
        api, _ = client
        winner = self._assert_one_owner(self._race(api, f"{LEASE_ORDERS}?hold=1"))
        assert bytes(IdempotencyKey.objects.get().response_body) == winner.content

    def test_expired_lease(self, client: Any) -> None:
        api, user = client
        stale = expired_lease(user, f"{LEASE_ORDERS}?hold=1")
        winner = self._assert_one_owner(self._race(api, f"{LEASE_ORDERS}?hold=1"))
        record = IdempotencyKey.objects.get()
        assert record.pk == stale.pk
        assert record.owner_token != stale.owner_token
        assert bytes(record.response_body) == winner.content


class DeriveTests:
    def test_derive_is_the_same_on_every_retry_and_takeover(self, client: Any) -> None:
        api, user = client
        url = f"{LEASE_ORDERS}info/"
        expected = IdempotencyInfo(KEY, f"user:{user.pk}", "").derive("payment")
        expired_lease(user, url)
        taken_over = post(api, url)
        assert taken_over.status_code == 200
        assert taken_over.json()["payment"] == expected
        assert post(api, url).json()["payment"] == expected
        other_key = post(api, url, key="lease-2").json()["payment"]
        assert other_key != expected


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
        replay = send(url)
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
            first = in_background(lambda: send(url, key))()
            retry = in_background(lambda: send(url, key))()
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


class ExpiryTests:
    """Atomic mode: when a completed record expires."""

    @pytest.fixture
    def plain(self) -> Client:
        return Client()

    @override_settings(IDEMPOTENCY={"TTL": timedelta(seconds=1)})
    def test_handler_slower_than_ttl_is_still_replayed(self, plain):
        # The claim set "now + TTL" before the handler ran; by the time the
        # response is stored that moment has passed, so the expiry restarts.
        first = clients.post(plain, "/orders/?hold=1.2")
        retry = clients.post(plain, "/orders/?hold=1.2")

        assert first.status_code == retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1
        record = IdempotencyKey.objects.get()
        assert record.expires_at - record.created_at >= timedelta(seconds=2)

    def test_fast_handler_keeps_the_expiry_its_claim_set(self, plain):
        # Storing the response then changes no indexed column (a heap-only
        # update on PostgreSQL).
        clients.post(plain, "/orders/")

        record = IdempotencyKey.objects.get()
        assert record.expires_at - record.created_at == timedelta(hours=24)


class CallersTransactionTests:
    """Inside a transaction of the caller's, the claim answers a retry (no lookup before it)."""

    def test_a_replay_in_a_transaction_opened_by_hand_is_answered_by_the_claim(self) -> None:
        # Autocommit turned off by hand is a transaction of the caller's too:
        # the read would start a MySQL snapshot early, and refilling the
        # replay cache on commit is refused outside atomic().
        from django.db import transaction

        from django_idempotency import idempotent_function

        runs: list[int] = []

        @idempotent_function(scope="test.charge", key=lambda order: f"order-{order}")
        def charge(order: int) -> int:
            runs.append(order)
            return order * 10

        caches = {
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "replay": {
                "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
                "LOCATION": "replay-lookup",
            },
        }
        assert charge(1) == 10
        with override_settings(CACHES=caches, IDEMPOTENCY={"REPLAY_CACHE": "replay"}):
            transaction.set_autocommit(False)
            try:
                assert charge(1) == 10
                transaction.commit()
            finally:
                transaction.set_autocommit(True)

        assert runs == [1]

    @pytest.mark.skipif(connection.vendor != "postgresql", reason="lock_timeout: PostgreSQL")
    def test_a_replay_inside_the_views_transaction_keeps_its_lock_timeout(self) -> None:
        from django.db import transaction

        from django_idempotency import idempotent_function
        from tests.databases import lock_timeout

        @idempotent_function(scope="test.charge", key=lambda order: f"order-{order}", wait=0.5)
        def charge(order: int) -> int:
            return order

        assert charge(2) == 2
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '7s'")
            assert charge(2) == 2  # answered by the claim, in a savepoint

            assert lock_timeout() == "7s"


def deadlock_with_a_heavier_transaction(row: int) -> None:
    """Make this transaction InnoDB's deadlock victim: share-lock ``row``, then both update it.

    Another connection writes more rows first, so InnoDB, which rolls back
    the transaction that has done less, picks this one. Returns once the
    other transaction has committed its update; raises the victim's 1213.
    """
    from django.db import transaction

    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM tests_order WHERE id = %s LOCK IN SHARE MODE", [row])

    other: list[int] = []

    def heavier() -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT CONNECTION_ID()")
            other.append(cursor.fetchone()[0])
            Order.objects.bulk_create([Order(item="heavier") for _ in range(50)])
            cursor.execute("SELECT id FROM tests_order WHERE id = %s LOCK IN SHARE MODE", [row])
            cursor.execute("UPDATE tests_order SET quantity = 2 WHERE id = %s", [row])

    join = in_background(heavier)

    wait_until(updating(other), "the other transaction to wait for our shared lock")
    try:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE tests_order SET quantity = 3 WHERE id = %s", [row])
    finally:
        join()


def deadlocking(scope: str, always: bool) -> tuple[Any, list[int], int]:
    """An ``idempotent_function`` that deadlocks on its first attempt (or on every one).

    Returns the function, the attempts it made, and the row the heavier
    transaction updates.
    """
    from django_idempotency import idempotent_function

    row = Order.objects.create(item="shared").pk
    attempts: list[int] = []

    @idempotent_function(key=lambda item: item, scope=scope)
    def place(item: str) -> int:
        attempts.append(len(attempts) + 1)
        if always or len(attempts) == 1:
            deadlock_with_a_heavier_transaction(row)
        return Order.objects.create(item=item).pk

    return place, attempts, row


class CheckpointBlocksTests:
    """Lease mode: a checkpoint recorded in an atomic block lasts only if that block commits.

    Each block is followed on its own, and what rolled back is put back
    when the claim is given back: here with no request cycle around the
    call (a worker's), where nothing else would put it back.
    """

    def run(self, fail: bool) -> dict[str, int]:
        """Create an order per step, each checkpointed in a block; step b's fails if ``fail``."""
        from django_idempotency.functions import run_once
        from django_idempotency.options import DeclaredOptions

        def body(info: IdempotencyInfo) -> dict[str, int]:
            for step in ("a", "b"):
                if step in info.checkpoints:
                    continue
                with transaction.atomic():
                    info.checkpoint(step, Order.objects.create(item=step).pk)
                    if step == "b" and fail:
                        raise RuntimeError("step b failed after its checkpoint")
            return info.checkpoints

        options = DeclaredOptions({"atomic": False}, lambda name: name)
        return run_once(
            scope="test.steps", key="k", arguments={}, body=body, options=options, sender=body
        )

    def test_the_retry_resumes_after_the_block_that_committed(self) -> None:
        with pytest.raises(RuntimeError, match="step b failed"):
            self.run(fail=True)
        record = IdempotencyKey.objects.get()
        assert (record.state, record.owner_token) == (State.IN_PROGRESS, "")
        assert set(record.checkpoints) == {"a"}

        steps = self.run(fail=False)
        assert Order.objects.filter(pk=steps["a"], item="a").exists()
        assert Order.objects.filter(pk=steps["b"], item="b").exists()
        assert Order.objects.filter(item="a").count() == 1
        assert Order.objects.filter(item="b").count() == 1

    def test_a_first_block_rolled_back_keeps_a_later_one_that_committed(self) -> None:
        from django_idempotency.functions import run_once
        from django_idempotency.options import DeclaredOptions

        def body(info: IdempotencyInfo) -> None:
            with contextlib.suppress(RuntimeError), transaction.atomic():
                info.checkpoint("a", Order.objects.create(item="a").pk)
                raise RuntimeError("step a rolled back")
            with transaction.atomic():
                info.checkpoint("b", Order.objects.create(item="b").pk)
            raise RuntimeError("the body failed after both steps")

        options = DeclaredOptions({"atomic": False}, lambda name: name)
        with pytest.raises(RuntimeError, match="after both steps"):
            run_once(
                scope="test.steps", key="k", arguments={}, body=body, options=options, sender=body
            )
        [b] = Order.objects.values_list("pk", flat=True)
        assert IdempotencyKey.objects.get().checkpoints == {"b": b}

    def run_again_in_the_call(self) -> dict[str, int]:
        """Step a in a block that fails once and is run again, skipping it if checkpointed."""
        from django_idempotency.functions import run_once
        from django_idempotency.options import DeclaredOptions

        failures = [RuntimeError("the block failed after step a")]

        def body(info: IdempotencyInfo) -> dict[str, int]:
            while True:
                try:
                    with transaction.atomic():
                        if "a" not in info.checkpoints:
                            info.checkpoint("a", Order.objects.create(item="a").pk)
                        if failures:
                            raise failures.pop()
                    return info.checkpoints
                except RuntimeError:
                    continue

        options = DeclaredOptions({"atomic": False}, lambda name: name)
        return run_once(
            scope="test.steps", key="k", arguments={}, body=body, options=options, sender=body
        )

    def test_a_block_run_again_in_the_same_call_redoes_the_step_that_rolled_back(self) -> None:
        steps = self.run_again_in_the_call()

        [a] = Order.objects.filter(item="a").values_list("pk", flat=True)
        assert steps == {"a": a}
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    def test_inside_an_outer_transaction_too(self) -> None:
        with transaction.atomic():
            steps = self.run_again_in_the_call()

        [a] = Order.objects.filter(item="a").values_list("pk", flat=True)
        assert steps == {"a": a}
        assert IdempotencyKey.objects.get().state == State.COMPLETED

    def test_a_checkpoint_in_an_inner_block_that_committed_stays_until_the_outer_rolls_back(
        self,
    ) -> None:
        from django_idempotency.functions import run_once
        from django_idempotency.options import DeclaredOptions

        seen: list[set[str]] = []

        def body(info: IdempotencyInfo) -> None:
            with contextlib.suppress(RuntimeError), transaction.atomic():
                with transaction.atomic():
                    info.checkpoint("a", Order.objects.create(item="a").pk)
                seen.append(set(info.checkpoints))  # its block committed, into the outer one
                raise RuntimeError("the outer block rolled back")
            seen.append(set(info.checkpoints))
            info.checkpoint("b")
            seen.append(set(info.checkpoints))

        options = DeclaredOptions({"atomic": False}, lambda name: name)
        run_once(scope="test.steps", key="k", arguments={}, body=body, options=options, sender=body)

        assert seen == [{"a"}, set(), {"b"}]
        assert not Order.objects.exists()


class ProjectHookFailed(Exception):
    """Raised at commit by an on-commit hook of the project's."""


#: Why the tests of a project's raising on-commit hook are expected to fail.
LIMIT = "a known limit: docs/recovery.rst, 'commit hooks that raise'"


class CommitHookBeforeTheCheckpointTests:
    """Lease mode: a project's on-commit hook registered before a checkpoint, raising at commit.

    Django runs a transaction's on-commit hooks in order and stops at the
    first that raises (unless it was registered ``robust=True``), so the
    callback that tells the package the checkpoint's block committed never
    runs, and the package cannot tell that commit from a rollback. A
    documented limit (docs/recovery.rst, "commit hooks that raise"): the
    committed step is taken for rolled back, and done again. The tests
    marked ``xfail`` say what should happen and fail until it does (strict:
    one that passes fails the run, so the page is then corrected). Its
    advice, a robust hook, keeps the step done once.
    """

    def hook(self, robust: bool) -> None:
        def fail() -> None:
            raise ProjectHookFailed("a project's on-commit hook failed")

        transaction.on_commit(fail, robust=robust)

    def run(self, body: Any) -> dict[str, int]:
        from django_idempotency.functions import run_once
        from django_idempotency.options import DeclaredOptions

        options = DeclaredOptions({"atomic": False}, lambda name: name)
        return run_once(
            scope="test.hooks", key="k", arguments={}, body=body, options=options, sender=body
        )

    def run_the_block_twice(self, robust: bool, after: bool = False) -> dict[str, int]:
        """Step a's block, run again after its commit raised; a is skipped if checkpointed.

        The hook is registered before step a's checkpoint, or ``after`` it.
        """

        def body(info: IdempotencyInfo) -> dict[str, int]:
            for _ in range(2):
                with contextlib.suppress(ProjectHookFailed), transaction.atomic():
                    if not after:
                        self.hook(robust)
                    if "a" not in info.checkpoints:
                        info.checkpoint("a", Order.objects.create(item="a").pk)
                    if after:
                        self.hook(robust)
            return info.checkpoints

        return self.run(body)

    @pytest.mark.xfail(strict=True, raises=AssertionError, reason=LIMIT)
    def test_in_the_call_a_committed_step_is_done_once(self) -> None:
        steps = self.run_the_block_twice(robust=False)

        # Today both blocks commit an order and neither checkpoint is shown.
        assert Order.objects.filter(item="a").count() == 1
        assert steps == {"a": Order.objects.get(item="a").pk}

    def test_a_robust_hook_keeps_the_committed_step_in_the_call(self) -> None:
        steps = self.run_the_block_twice(robust=True)

        [a] = Order.objects.filter(item="a").values_list("pk", flat=True)
        assert steps == {"a": a}

    def test_a_hook_registered_after_the_checkpoint_changes_nothing(self) -> None:
        steps = self.run_the_block_twice(robust=False, after=True)

        [a] = Order.objects.filter(item="a").values_list("pk", flat=True)
        assert steps == {"a": a}

    def fail_after_the_step_then_retry(self, robust: bool) -> tuple[dict[str, Any], dict[str, int]]:
        """Step a in a block, then a failure that gives the claim back; the retry's steps.

        Returns the checkpoints the given-back claim kept, and the retry's.
        """
        failing = [RuntimeError("the body failed after step a")]

        def body(info: IdempotencyInfo) -> dict[str, int]:
            if "a" not in info.checkpoints:
                with contextlib.suppress(ProjectHookFailed), transaction.atomic():
                    self.hook(robust)
                    info.checkpoint("a", Order.objects.create(item="a").pk)
            if failing:
                raise failing.pop()
            return info.checkpoints

        with pytest.raises(RuntimeError, match="failed after step a"):
            self.run(body)
        # Given back: kept with its checkpoints, or deleted if none is left.
        record = IdempotencyKey.objects.filter(scope="test.hooks").first()
        kept = {} if record is None else dict(record.checkpoints)
        assert record is None or (record.state, record.owner_token) == (State.IN_PROGRESS, "")
        return kept, self.run(body)

    @pytest.mark.xfail(strict=True, raises=AssertionError, reason=LIMIT)
    def test_after_a_release_a_committed_step_is_kept(self) -> None:
        kept, steps = self.fail_after_the_step_then_retry(robust=False)

        # Today the given-back claim keeps no checkpoint for the committed
        # order, and the retry does step a again.
        assert Order.objects.filter(item="a").count() == 1
        assert kept == steps == {"a": Order.objects.get(item="a").pk}

    def test_a_robust_hook_keeps_the_committed_step_after_a_release(self) -> None:
        kept, steps = self.fail_after_the_step_then_retry(robust=True)

        [a] = Order.objects.filter(item="a").values_list("pk", flat=True)
        assert kept == steps == {"a": a}


@pytest.mark.skipif(connection.vendor != "mysql", reason="InnoDB's deadlock error 1213")
class DeadlockTests:
    """A deadlock in the handler's own statements rolls the attempt back, and it starts over."""

    def test_a_deadlocked_handler_runs_again_and_only_the_retry_commits(self) -> None:
        place, attempts, row = deadlocking("tests.deadlock.place", always=False)

        placed = place("deadlocked")

        assert attempts == [1, 2]
        assert list(Order.objects.filter(item="deadlocked").values_list("pk", flat=True)) == [
            placed
        ]
        assert Order.objects.get(pk=row).quantity == 2  # the other transaction's update
        [record] = IdempotencyKey.objects.filter(key="deadlocked")
        assert record.state == State.COMPLETED
        assert place("deadlocked") == placed
        assert attempts == [1, 2]

    def test_a_handler_that_always_deadlocks_gives_up_with_in_flight(self) -> None:
        from django_idempotency.exceptions import CallInFlight

        place, attempts, _ = deadlocking("tests.deadlock.place_always", always=True)

        with pytest.raises(CallInFlight):
            place("always")

        assert len(attempts) == store.CLAIM_ATTEMPTS
        assert not Order.objects.filter(item="always").exists()
        assert not IdempotencyKey.objects.filter(key="always").exists()

    def test_a_deadlock_in_a_function_called_inside_another_claim_starts_that_one_over(
        self,
    ) -> None:
        # The server rolled back the outer claim's transaction too: only it can start over,
        # and then the inner call runs again instead of answering CallInFlight.
        from django_idempotency import idempotent_function

        place, attempts, _ = deadlocking("tests.deadlock.inner", always=False)
        outer: list[str] = []

        @idempotent_function(key=lambda item: item, scope="tests.deadlock.outer")
        def order(item: str) -> int:
            outer.append(item)
            return place(item)

        placed = order("nested")

        assert attempts == [1, 2]
        assert outer == ["nested", "nested"]
        assert list(Order.objects.filter(item="nested").values_list("pk", flat=True)) == [placed]
        records = IdempotencyKey.objects.filter(key="nested", state=State.COMPLETED)
        assert sorted(records.values_list("scope", flat=True)) == [
            "tests.deadlock.inner",
            "tests.deadlock.outer",
        ]

    @pytest.mark.django_db(transaction=True, databases=["default", "other"])
    def test_a_deadlock_while_another_alias_has_a_transaction_reaches_the_caller(self) -> None:
        # The server may have rolled that transaction back: starting over
        # here would let its caller commit the rest of it as if nothing happened.
        from django.db import OperationalError

        place, attempts, _ = deadlocking("tests.deadlock.other_alias", always=True)

        with pytest.raises(OperationalError), transaction.atomic(using="other"):
            place("other-alias")

        assert attempts == [1]
        assert not IdempotencyKey.objects.filter(key="other-alias").exists()

    @pytest.mark.django_db(transaction=True, databases=["default", "other"])
    def test_a_deadlock_while_another_alias_has_a_manual_transaction_reaches_the_caller(
        self,
    ) -> None:
        # The same with that transaction opened by hand (autocommit off): starting over
        # would write the attempt's row there again, and its caller would commit both.
        from django.db import OperationalError

        from django_idempotency import idempotent_function

        row = Order.objects.create(item="shared").pk
        attempts: list[int] = []

        @idempotent_function(key=lambda item: item, scope="tests.deadlock.manual")
        def place(item: str) -> int:
            attempts.append(len(attempts) + 1)
            Order.objects.using("other").create(item=f"side-{item}")
            if len(attempts) == 1:
                deadlock_with_a_heavier_transaction(row)
            return Order.objects.create(item=item).pk

        other = connections["other"]
        other.set_autocommit(False)
        try:
            with pytest.raises(OperationalError):
                place("manual")
            assert attempts == [1]
            assert Order.objects.using("other").filter(item="side-manual").count() == 1
        finally:
            other.rollback()
            other.set_autocommit(True)
        assert not Order.objects.using("other").filter(item="side-manual").exists()
        assert not IdempotencyKey.objects.filter(key="manual").exists()
