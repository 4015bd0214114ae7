"""The helpers users run against their own views, run against ours."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.core.signals import request_finished, request_started
from django.db import connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.signals import post_save
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, TestCase, TransactionTestCase
from django.test.client import MULTIPART_CONTENT
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.test import APIClient

from django_idempotency import idempotent, races, signals
from django_idempotency.models import IdempotencyKey
from django_idempotency.testing import (
    SEQUENTIAL_NOTE,
    RaceSetupError,
    assert_idempotent,
    race_duplicates,
)
from tests.models import Order
from tests.pooler import Pooler, server_address
from tests.views import _create_order, calls


def order_count() -> int:
    return Order.objects.count()


@csrf_exempt
def hand_made_replay(request: HttpRequest) -> HttpResponse:
    """Answers as a protected view would, except for what ``?keep`` names.

    The first request makes an order and answers a body too large to store;
    later ones answer as replays of it, with an empty body. ``?keep=...``
    lists headers that describe a body which the replays wrongly carry.
    """
    if b"_assert_idempotent_changed" in request.body:
        return HttpResponse(status=422)
    if not Order.objects.filter(item="hand-made").exists():
        Order.objects.create(item="hand-made")
        response = HttpResponse(b"x" * 2_000_000, content_type="text/csv", status=201)
        response["ETag"] = '"first"'
        response["Location"] = "/exports/1/"
        return response
    replay = HttpResponse(b"", status=201)
    del replay["Content-Type"]
    keep = request.GET.get("keep", "")
    if "content-type" in keep:
        replay["Content-Type"] = "text/csv"
    if "etag" in keep:
        replay["ETag"] = '"second"'
    replay["Location"] = "/exports/1/"
    replay["Idempotent-Replayed"] = "true"
    return replay


@idempotent(wait=0)
def create_order_without_waiting(request: HttpRequest) -> HttpResponse:
    """Atomic, but a duplicate does not wait for the original: it gets 409 at once."""
    return _create_order(request)


urlpatterns = [
    path("hand-made-replay/", hand_made_replay),
    path("orders/", create_order_without_waiting),
]


@contextmanager
def duplicates_held_at_request_start(until: threading.Event) -> Iterator[threading.Event]:
    """Hold each duplicate's thread when its request starts, until ``until`` is set.

    Yields an event set once every held thread has been let through (bounded).
    """
    held: list[threading.Thread] = []

    def hold(**kwargs: object) -> None:
        if threading.current_thread().name.startswith("race-duplicate-"):
            held.append(threading.current_thread())
            assert until.wait(30), "the test never let the duplicate through"

    request_started.connect(hold, weak=False, dispatch_uid="test-duplicates-held")
    try:
        yield until
    finally:
        request_started.disconnect(dispatch_uid="test-duplicates-held")
        until.set()
        for thread in held:
            thread.join(30)
            assert not thread.is_alive(), f"{thread.name} did not end"


@contextmanager
def own_connection(**settings: object) -> Iterator[BaseDatabaseWrapper]:
    """A connection of the test's own to the default database (or as ``settings`` change it).

    It is closed on the way out, whether the test passed or not.
    """
    opened = connections.create_connection("default")
    opened.settings_dict = {**opened.settings_dict, **settings}
    try:
        opened.ensure_connection()
        yield opened
    finally:
        opened.close()


class PytestUsageTests:
    @pytest.mark.django_db
    def test_protected_view_passes_inside_a_transaction_sequentially(self, client):
        check = assert_idempotent(client, "post", "/orders/", {"item": "a"}, effect=order_count)

        assert check.concurrent is False
        assert check.note == SEQUENTIAL_NOTE
        assert check.mismatch is not None and check.mismatch.status_code == 422
        assert len(check.duplicates) == 5

    @pytest.mark.django_db(transaction=True)
    def test_protected_view_passes_with_concurrent_duplicates(self, client):
        check = assert_idempotent(
            client, "post", "/orders/?hold=0.2", {"item": "a"}, effect=order_count, duplicates=8
        )

        assert check.concurrent is True
        assert check.note == ""
        assert order_count() == 1

    @pytest.mark.django_db
    def test_unprotected_view_fails_the_check(self, client):
        with pytest.raises(AssertionError, match="not a replay"):
            assert_idempotent(
                client, "post", "/orders/unprotected/", {"item": "a"}, effect=order_count
            )

    @pytest.mark.django_db
    def test_view_without_visible_effect_fails_the_check(self, client):
        with pytest.raises(AssertionError, match="no visible effect"):
            assert_idempotent(client, "post", "/orders/", {"item": "a"}, effect=lambda: 0)

    @pytest.mark.django_db
    @pytest.mark.urls("tests.browser_urls")
    def test_a_form_view_sent_json_fails_naming_the_content_type_to_pass(self, client):
        # This helper sends a dict as JSON; a view reading request.POST sees no fields.
        with pytest.raises(
            AssertionError,
            match=r"answered 200\. .*content_type=django\.test\.client\.MULTIPART_CONTENT",
        ):
            assert_idempotent(
                client, "post", "/browser/checkout/", {"item": "a"}, effect=order_count
            )

        check = assert_idempotent(
            client,
            "post",
            "/browser/checkout/",
            {"item": "a"},
            effect=order_count,
            content_type=MULTIPART_CONTENT,
        )

        assert check.first.status_code == 302
        assert check.mismatch is not None and check.mismatch.status_code == 422
        assert order_count() == 1
        # Any client, DRF's too: a urlencoded body and its content type.
        other = assert_idempotent(
            APIClient(),
            "post",
            "/browser/checkout/",
            "item=b",
            effect=order_count,
            content_type="application/x-www-form-urlencoded",
            changed_data="item=c",
        )
        assert (other.first.status_code, order_count()) == (302, 2)

    @pytest.mark.django_db
    def test_insisting_on_concurrency_inside_a_transaction_says_why_not(self, client):
        with pytest.raises(AssertionError, match="transaction=True"):
            assert_idempotent(
                client, "post", "/orders/", {"item": "a"}, effect=order_count, concurrent=True
            )

    @pytest.mark.django_db
    def test_large_bodies_are_checked_as_replayed_without_body(self, client):
        check = assert_idempotent(client, "post", "/large/", {}, effect=order_count)
        assert check.retry.content == b""

    @pytest.mark.django_db
    def test_streamed_bodies_are_checked_as_replayed_without_body(self, client):
        check = assert_idempotent(client, "post", "/stream/", {}, effect=order_count)
        assert check.retry.content == b""

    @pytest.mark.django_db
    @pytest.mark.urls("tests.test_testing")
    def test_replay_without_body_and_without_body_headers_passes(self, client):
        check = assert_idempotent(client, "post", "/hand-made-replay/", {}, effect=order_count)
        assert not check.retry.has_header("Content-Type")

    @pytest.mark.django_db
    @pytest.mark.urls("tests.test_testing")
    def test_replay_without_body_but_with_its_headers_fails_the_check(self, client):
        with pytest.raises(AssertionError, match="empty body with content-type: 'text/csv'"):
            assert_idempotent(
                client,
                "post",
                "/hand-made-replay/?keep=content-type,etag",
                {},
                effect=order_count,
            )

    @pytest.mark.django_db
    @pytest.mark.urls("tests.test_testing")
    def test_replay_without_body_but_with_another_etag_fails_the_check(self, client):
        with pytest.raises(AssertionError, match="empty body with etag: '\"second\"'"):
            assert_idempotent(
                client, "post", "/hand-made-replay/?keep=etag", {}, effect=order_count
            )

    @pytest.mark.django_db
    def test_drf_api_client_is_supported(self):
        check = assert_idempotent(
            APIClient(), "post", "/api/orders/", {"item": "a"}, effect=order_count
        )
        assert check.first.status_code == 201


class UnittestUsageTests(TestCase):
    def test_works_from_a_test_case(self):
        check = assert_idempotent(
            self.client, "post", "/orders/", {"item": "a"}, effect=order_count
        )
        self.assertFalse(check.concurrent)


class UnittestTransactionalUsageTests(TransactionTestCase):
    def test_works_concurrently_from_a_transaction_test_case(self):
        check = assert_idempotent(
            self.client, "post", "/orders/?hold=0.1", {"item": "a"}, effect=order_count
        )
        self.assertTrue(check.concurrent)


class RaceDuplicatesTests:
    """Duplicates sent while the original is held inside the view, its key claimed."""

    @pytest.mark.django_db(transaction=True)
    def test_atomic_view_makes_duplicates_wait_and_replays_to_them(self, client):
        race = race_duplicates(
            client, "post", "/orders/", {"item": "a"}, effect=order_count, expect="replayed"
        )

        assert order_count() == 1
        assert calls.value == 1
        # Every duplicate was seen waiting in the database for the held
        # original: the race took place.
        assert race.waited == [True] * 5
        assert race.outcomes == ["replayed"] * 5
        assert race.replayed == 5 and race.in_flight == 0
        assert all(answer.content == race.original.content for answer in race.duplicates)
        assert "5 waited for it in the database, 5 got its replay" in race.note

    @pytest.mark.django_db(transaction=True)
    def test_lease_view_answers_duplicates_409_while_the_original_is_held(self, client):
        race = race_duplicates(
            client,
            "post",
            "/orders/lease/",
            {"item": "a"},
            effect=order_count,
            duplicates=4,
            expect="in_flight",
        )

        assert order_count() == 1
        assert race.waited == [False] * 4
        assert [answer.status_code for answer in race.duplicates] == [409] * 4
        assert all(answer.has_header("Retry-After") for answer in race.duplicates)
        assert race.original.status_code == 201

    @pytest.mark.django_db(transaction=True)
    def test_expecting_replays_from_a_lease_view_fails(self, client):
        with pytest.raises(
            AssertionError,
            match=r"expected every duplicate replayed \(the original was held outside a "
            r"transaction\): .* 0 got",
        ):
            race_duplicates(
                client,
                "post",
                "/orders/lease/",
                {"item": "a"},
                effect=order_count,
                duplicates=2,
                expect="replayed",
            )

    @pytest.mark.django_db(transaction=True)
    def test_unprotected_view_raced_has_several_effects_and_fails(self, client):
        # Held once it has written its order, as the protected view's
        # transaction would be; the duplicates run meanwhile.
        with pytest.raises(AssertionError, match=r"the effect happened 4 times: .* 0 to 4"):
            race_duplicates(
                client,
                "post",
                "/orders/unprotected/",
                {"item": "a"},
                effect=order_count,
                duplicates=3,
                hold_on=post_save,
                hold_sender=Order,
            )

        # The control: the race ran, and without a key every request acted.
        assert order_count() == 4
        assert calls.value == 4

    @pytest.mark.django_db(transaction=True)
    def test_atomic_view_held_after_writing_its_effect_still_has_one(self, client):
        race = race_duplicates(
            client,
            "post",
            "/orders/",
            {"item": "a"},
            effect=order_count,
            hold_on=post_save,
            hold_sender=Order,
            expect="replayed",
        )

        assert order_count() == 1
        assert race.waited == [True] * 5

    @pytest.mark.django_db(transaction=True)
    def test_unprotected_view_never_claims_so_the_race_says_so(self, client):
        with pytest.raises(AssertionError, match="without claiming its idempotency key"):
            race_duplicates(client, "post", "/orders/unprotected/", {}, effect=order_count)

        assert order_count() == 1  # the original alone: no duplicate was sent

    @pytest.mark.django_db
    def test_inside_a_transaction_names_the_transactional_test(self, client):
        with pytest.raises(RaceSetupError, match=r"django_db\(transaction=True\)"):
            race_duplicates(client, "post", "/orders/", {"item": "a"}, effect=order_count)

        assert order_count() == 0  # nothing was sent

    @pytest.mark.django_db(transaction=True)
    def test_client_factory_and_drf_api_client(self):
        race = race_duplicates(
            APIClient, "post", "/api/orders/", {"item": "a"}, effect=order_count, duplicates=3
        )

        assert race.original.status_code == 201
        assert order_count() == 1

    @pytest.mark.django_db(transaction=True)
    def test_effect_that_is_no_number_is_refused_before_anything_is_sent(self, client):
        with pytest.raises(TypeError, match="a number or a tuple of numbers"):
            race_duplicates(client, "post", "/orders/", {}, effect=Order.objects.last)

        assert order_count() == 0

    @pytest.mark.django_db(transaction=True)
    @pytest.mark.parametrize(
        ("options", "error", "message"),
        [
            ({"duplicates": 0}, ValueError, "duplicates must be 1 or more"),
            (
                {"expect": "replay"},
                ValueError,
                "expect must be None, 'replayed', 'in_flight' or 'either'",
            ),
            ({"hold_on": "post_save"}, TypeError, "hold_on must be a django.dispatch.Signal"),
            ({"hold_sender": Order}, TypeError, "hold_sender needs hold_on"),
        ],
    )
    def test_bad_options_are_refused_before_anything_is_sent(self, client, options, error, message):
        with pytest.raises(error, match=re.escape(message)):
            race_duplicates(client, "post", "/orders/", {}, effect=order_count, **options)

        assert order_count() == 0

    @pytest.mark.django_db(transaction=True)
    @pytest.mark.urls("tests.async_urls")
    def test_async_view_through_the_test_client(self, client):
        # The async views write an audit order beside each order.
        race = race_duplicates(
            client, "post", "/orders/", {"item": "a"}, effect=order_count, one_effect=2
        )

        assert race.outcomes == ["replayed"] * 5
        assert race.waited == [True] * 5
        assert order_count() == 2

    @pytest.mark.django_db(transaction=True)
    def test_tuple_effects_change_once_each(self, client):
        race = race_duplicates(
            client,
            "post",
            "/orders/",
            {"item": "a"},
            effect=lambda: (order_count(), Order.objects.filter(item="a").count()),
            duplicates=2,
        )

        assert race.replayed == 2

    @pytest.mark.django_db(transaction=True)
    def test_default_expectation_follows_where_the_original_was_held(self, client):
        atomic = race_duplicates(client, "post", "/orders/", {"item": "a"}, effect=order_count)
        lease = race_duplicates(
            client, "post", "/orders/lease/", {"item": "b"}, effect=order_count, duplicates=2
        )

        assert atomic.expected == "replayed" and atomic.outcomes == ["replayed"] * 5
        assert lease.expected == "in_flight" and lease.outcomes == ["in_flight"] * 2

    @pytest.mark.django_db(transaction=True)
    @pytest.mark.urls("tests.test_testing")
    def test_atomic_view_whose_duplicates_do_not_wait_fails_by_default(self, client):
        # wait=0: a duplicate of the held original gets 409 instead of its
        # answer, which is not what a retry of an atomic view is promised. On
        # SQLite the wait is a 1 ms busy timeout, not none: a duplicate caught
        # inside it may still get the replay, so at least one 409 is what fails
        # the race, and every duplicate is one or the other.
        with pytest.raises(
            AssertionError,
            match=r"expected every duplicate replayed \(the original was held inside a "
            r"transaction\): .* pass expect='either'",
        ) as failed:
            race_duplicates(
                client, "post", "/orders/", {"item": "a"}, effect=order_count, duplicates=3
            )

        counts = re.search(r"(\d+) got its replay, (\d+) got 409", str(failed.value))
        assert counts is not None, str(failed.value)
        replayed, conflicts = int(counts[1]), int(counts[2])
        assert conflicts >= 1 and replayed + conflicts == 3, str(failed.value)
        assert order_count() == 1

    @pytest.mark.django_db(transaction=True)
    @pytest.mark.urls("tests.test_testing")
    def test_either_accepts_duplicates_that_stopped_waiting(self, client):
        race = race_duplicates(
            client,
            "post",
            "/orders/",
            {"item": "a"},
            effect=order_count,
            duplicates=3,
            expect="either",
        )

        assert race.expected == "either"
        assert race.outcomes == ["in_flight"] * 3
        assert len(race.waited) == len(race.duplicates) == 3

    @pytest.mark.django_db(transaction=True)
    def test_waiting_reported_before_any_claim_started_fails(self, client, monkeypatch):
        # A detector that calls every duplicate waiting at once: the original
        # is let go before any duplicate has reached its claim (each is held
        # until the original has answered), and the duplicates then meet a
        # committed original and get its replay. The race did not happen.
        monkeypatch.setattr(races, "_waiting", lambda using, watches: set(range(len(watches))))
        original_answered = threading.Event()

        def answered(**kwargs: object) -> None:
            if threading.current_thread().name == "race-original":
                original_answered.set()

        request_finished.connect(answered, weak=False, dispatch_uid="test-original-answered")
        try:
            with (
                duplicates_held_at_request_start(original_answered),
                pytest.raises(
                    AssertionError,
                    match=r"were not waiting when it was let go, so the race did not take "
                    r"place: duplicate 1 had not started its claim when the original was let "
                    r"go \(it started [0-9.]+ s after\)",
                ),
            ):
                race_duplicates(
                    client, "post", "/orders/", {"item": "a"}, effect=order_count, duplicates=3
                )
        finally:
            request_finished.disconnect(dispatch_uid="test-original-answered")

        # The control: the duplicates were replays of a committed original.
        assert order_count() == 1
        assert calls.value == 1

    @pytest.mark.django_db(transaction=True)
    def test_waited_means_waiting_when_the_original_was_let_go(self, client):
        # Each duplicate counted as waiting was still in its claim when the
        # original went, and its claim returned after: it got the replay.
        let_go: list[float] = []
        watched: list[races._Watch] = []
        real_check = races._check_sightings

        def check(seen, sightings, watches, at):  # type: ignore[no-untyped-def]
            let_go.append(at)
            watched.extend(watches)
            return real_check(seen, sightings, watches, at)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(races, "_check_sightings", check)
            race = race_duplicates(
                client, "post", "/orders/", {"item": "a"}, effect=order_count, duplicates=3
            )

        assert race.waited == [True] * 3
        for watch in watched:
            assert watch.started is not None and watch.started < let_go[0]
            assert watch.returned is not None and watch.returned > let_go[0]

    @pytest.mark.django_db(transaction=True)
    def test_duplicates_blocked_outside_the_claim_are_named_with_the_fix(self, client):
        gate = threading.Event()
        with (
            duplicates_held_at_request_start(gate),
            pytest.raises(AssertionError) as failed,
        ):
            race_duplicates(
                client,
                "post",
                "/orders/",
                {"item": "a"},
                effect=order_count,
                duplicates=2,
                timeout=0.5,
            )

        message = str(failed.value)
        assert "2 of 2 duplicates neither answered nor were seen waiting" in message
        assert (
            "duplicate 1 has no claim statement running: it is blocked outside the "
            "idempotency claim (a lock or an event in the view, a middleware, a connection "
            "pool), or needs longer: pass a larger timeout=" in message
        )
        for name in ("race-duplicate-1", "race-duplicate-2"):
            assert f"{name} is still running and keeps its database connection" in message
        assert "race-original" not in message  # let go, it answered
        assert order_count() == 1

    @pytest.mark.django_db(transaction=True)
    def test_duplicates_stuck_in_the_database_have_their_sessions_ended(self, client):
        if connection.vendor == "sqlite":
            pytest.skip("SQLite has no server session to end")
        # Another session holds a lock the duplicates ask for before their claim.
        holder = connections.create_connection("default")
        lock = (
            ("SELECT pg_advisory_lock(7301)", "SELECT pg_advisory_unlock(7301)")
            if connection.vendor == "postgresql"
            else ("SELECT GET_LOCK('race-test', 30)", "SELECT RELEASE_LOCK('race-test')")
        )
        with holder.cursor() as cursor:
            cursor.execute(lock[0])

        def take_the_lock(**kwargs: object) -> None:
            if threading.current_thread().name.startswith("race-duplicate-"):
                with connection.cursor() as cursor:
                    cursor.execute(lock[0])

        request_started.connect(take_the_lock, weak=False, dispatch_uid="test-take-the-lock")
        try:
            with pytest.raises(AssertionError) as failed:
                race_duplicates(
                    client,
                    "post",
                    "/orders/",
                    {"item": "a"},
                    effect=order_count,
                    duplicates=1,
                    timeout=0.5,
                )
        finally:
            request_started.disconnect(dispatch_uid="test-take-the-lock")
            with holder.cursor() as cursor:
                cursor.execute(lock[1])
            holder.close()

        message = str(failed.value)
        assert "duplicate 1 has no claim statement running" in message
        assert re.search(
            r"race-duplicate-1 was still running: its database session \d+ was "
            r"ended",
            message,
        ), message
        for thread in threading.enumerate():
            if thread.name == "race-duplicate-1":  # ends once its session is gone
                thread.join(10)
                assert not thread.is_alive()

    @pytest.mark.django_db(transaction=True)
    def test_a_database_behind_a_pooler_is_refused_and_no_other_session_is_ended(self, client):
        if connection.vendor == "sqlite":
            pytest.skip("SQLite has no server, nor a pooler in front of one")
        lock = (
            ("SELECT pg_advisory_lock(7302)", "SELECT pg_advisory_unlock(7302)")
            if connection.vendor == "postgresql"
            else (
                "SELECT GET_LOCK('pooled-race-test', 30)",
                "SELECT RELEASE_LOCK('pooled-race-test')",
            )
        )

        def take_the_lock(**kwargs: object) -> None:
            if threading.current_thread().name.startswith("race-duplicate-"):
                with connection.cursor() as cursor:
                    cursor.execute(lock[0])

        settings = connections.settings["default"]
        server = server_address(settings, connection.vendor)
        if server is None:
            pytest.skip(
                "the test settings give the database no HOST, so the stand-in pooler does "
                "not know where the server is: set TEST_DATABASE_HOST"
            )
        # The stand-in listens on 127.0.0.1 and passes each connection on to
        # the server where the settings reach it, over TCP or a Unix socket.
        reached = {"HOST": settings["HOST"], "PORT": settings["PORT"]}
        # Another client's session on the same server: the pooler hands its
        # id to the test's connections, as a transaction pooler hands out the
        # id of a server connection that runs other clients' work. The
        # holder holds a lock the duplicates ask for: they get stuck.
        with own_connection() as bystander, own_connection() as holder:
            session = races._session_id(bystander)
            assert session is not None
            with holder.cursor() as cursor:
                cursor.execute(lock[0])
            request_started.connect(take_the_lock, weak=False, dispatch_uid="test-pooled-lock")
            try:
                with Pooler(server, session, connection.vendor) as pooler:
                    settings.update(HOST="127.0.0.1", PORT=str(pooler.port))
                    connection.close()
                    try:
                        with pytest.raises(RaceSetupError) as refused:
                            race_duplicates(
                                client,
                                "post",
                                "/orders/",
                                {"item": "a"},
                                effect=order_count,
                                duplicates=1,
                                timeout=0.5,
                            )
                    finally:
                        settings.update(reached)
                        connection.close()
            finally:
                request_started.disconnect(dispatch_uid="test-pooled-lock")
                with holder.cursor() as cursor:
                    cursor.execute(lock[1])

            with bystander.cursor() as cursor:  # still connected: nothing ended it
                cursor.execute("SELECT 1")

        message = str(refused.value)
        pooler = "PgBouncer" if connection.vendor == "postgresql" else "ProxySQL"
        assert f"through a connection pooler or proxy (such as {pooler})" in message
        assert f"the one it was given when it connected ({session})" in message
        assert "give DATABASES['default'] the server's HOST and PORT, not the pooler's" in message
        assert order_count() == 0  # refused before anything was sent

    @pytest.mark.django_db(transaction=True)
    def test_a_session_on_another_database_is_never_ended(self):
        if connection.vendor == "sqlite":
            pytest.skip("SQLite has no server session to end")
        with own_connection(
            NAME="postgres" if connection.vendor == "postgresql" else "information_schema"
        ) as other:
            session = races._session_id(other)

            said = races._end_sessions(
                "default", ["race-duplicate-1"], {"race-duplicate-1": session}
            )

            assert said == (
                f"race-duplicate-1 is still running; its database session {session} is no "
                "longer on this database, and was left alone"
            )
            with other.cursor() as cursor:
                cursor.execute("SELECT 1")

    @pytest.mark.django_db(transaction=True)
    def test_called_from_async_code_is_refused_with_the_fix(self, client):
        async def scenario() -> None:
            race_duplicates(client, "post", "/orders/", {"item": "a"}, effect=order_count)

        with pytest.raises(RaceSetupError) as refused:
            async_to_sync(scenario)()

        assert "race_duplicates() was called from async code" in str(refused.value)
        assert "Call it from a sync test" in str(refused.value)
        assert "await sync_to_async(race_duplicates)(client, ...)" in str(refused.value)
        assert order_count() == 0

    @pytest.mark.django_db(transaction=True)
    def test_called_from_async_code_through_sync_to_async_races(self, client):
        async def scenario() -> list[str]:
            race = await sync_to_async(race_duplicates)(
                client, "post", "/orders/", {"item": "a"}, effect=order_count, duplicates=2
            )
            return race.outcomes

        assert async_to_sync(scenario)() == ["replayed", "replayed"]
        assert order_count() == 1

    @pytest.mark.django_db(transaction=True)
    def test_called_from_async_code_races_where_django_allows_it(self, client, monkeypatch):
        monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

        async def scenario() -> list[str]:
            try:
                return race_duplicates(
                    client, "post", "/orders/", {"item": "a"}, effect=order_count, duplicates=2
                ).outcomes
            finally:
                connections.close_all()  # the event loop's thread's own, opened for effect()

        assert async_to_sync(scenario)() == ["replayed", "replayed"]
        assert order_count() == 1

    @pytest.mark.django_db(transaction=True)
    @pytest.mark.parametrize("client_of", [AsyncClient, lambda: AsyncClient(), AsyncClient()])
    def test_async_client_is_refused_with_the_fix(self, client_of):
        with pytest.raises(TypeError, match=r"AsyncClient is not supported: .* Pass a Client"):
            race_duplicates(client_of, "post", "/orders/", {"item": "a"}, effect=order_count)

        assert order_count() == 0

    @pytest.mark.django_db(transaction=True)
    def test_client_answering_no_response_is_refused(self):
        class Silent:
            def post(self, *args: object, **kwargs: object) -> None:
                return None

        with pytest.raises(TypeError, match=r"post\(\) returned None, not a response"):
            race_duplicates(Silent, "post", "/orders/", {"item": "a"}, effect=order_count)

    @pytest.mark.django_db(transaction=True)
    def test_a_duplicate_without_a_response_is_not_dropped(self):
        # Below race_duplicates: the duplicates' list stays aligned with waited.
        def send() -> HttpResponse | None:
            if threading.current_thread().name == "race-original":
                return Client().post(
                    "/orders/",
                    "{}",
                    content_type="application/json",
                    headers={"Idempotency-Key": "race-without-response"},
                )
            return None

        with pytest.raises(AssertionError, match="duplicate 1 ended without a response"):
            races.run(
                send,  # type: ignore[arg-type]
                2,
                hold_on=signals.key_claimed,
                hold_sender=None,
                hold_name="key_claimed",
                using="default",
                table=IdempotencyKey._meta.db_table,
                timeout=10,
            )


IN_MEMORY_RACE = """
import os
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
from django.conf import settings
settings.DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
import django
django.setup()
from django.db import connection
connection.creation.create_test_db(verbosity=0)
from django.test import Client
from django_idempotency.testing import RaceSetupError, race_duplicates
from tests.models import Order
try:
    race_duplicates(Client, "post", "/orders/", {}, effect=Order.objects.count)
except RaceSetupError as refused:
    print(connection.settings_dict["NAME"])
    print(refused)
print("orders:", Order.objects.count())
"""


def test_in_memory_sqlite_is_refused_with_the_fix():
    # Django's test runner turns ":memory:" into a shared-cache database, as
    # it would for a project's own tests; a process of its own, to have one.
    completed = subprocess.run(
        [sys.executable, "-c", IN_MEMORY_RACE],
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "TEST_DATABASE": "sqlite"},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert completed.returncode == 0, completed.stderr
    assert "mode=memory&cache=shared" in completed.stdout
    assert "it is an in-memory SQLite database" in completed.stdout
    assert "DATABASES['default']['TEST']['NAME'] = 'test.sqlite3'" in completed.stdout
    assert completed.stdout.endswith("orders: 0\n")


class RaceDuplicatesUnittestTests(TransactionTestCase):
    def test_works_from_a_transaction_test_case(self):
        race = race_duplicates(
            Client, "post", "/orders/", {"item": "a"}, effect=order_count, duplicates=3
        )
        self.assertEqual(race.replayed, 3)


class RaceDuplicatesInsideTestCaseTests(TestCase):
    def test_refused_inside_a_test_case(self):
        with self.assertRaisesMessage(RaceSetupError, "Use TransactionTestCase"):
            race_duplicates(self.client, "post", "/orders/", {"item": "a"}, effect=order_count)
