"""The helpers users run against their own views, run against ours."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.db.models.signals import post_save
from django.http import HttpRequest, HttpResponse
from django.test import Client, TestCase, TransactionTestCase
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.test import APIClient

from django_idempotency.testing import (
    SEQUENTIAL_NOTE,
    RaceSetupError,
    assert_idempotent,
    race_duplicates,
)
from tests.models import Order
from tests.views import calls


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


urlpatterns = [path("hand-made-replay/", hand_made_replay)]


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
        with pytest.raises(AssertionError, match=r"expected every duplicate replayed: .* 0 got"):
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
            ({"expect": "replay"}, ValueError, "expect must be None, 'replayed' or 'in_flight'"),
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
