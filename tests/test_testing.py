"""The helpers users run against their own views, run against ours."""

from __future__ import annotations

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import TestCase, TransactionTestCase
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.test import APIClient

from django_idempotency.testing import SEQUENTIAL_NOTE, assert_idempotent
from tests.models import Order


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
