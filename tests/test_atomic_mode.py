"""Atomic mode (atomic_mode.py): when a completed record expires."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.test import override_settings

from django_idempotency.models import IdempotencyKey
from tests.views import calls

pytestmark = pytest.mark.django_db(transaction=True)


def post(client, url: str = "/orders/"):
    return client.post(
        url,
        json.dumps({"item": "book"}),
        content_type="application/json",
        headers={"Idempotency-Key": "k"},
    )


class ExpiryTests:
    @override_settings(IDEMPOTENCY={"TTL": timedelta(seconds=1)})
    def test_handler_slower_than_ttl_is_still_replayed(self, client):
        # The claim set "now + TTL" before the handler ran; by the time the
        # response is stored that moment has passed, so the expiry restarts.
        first = post(client, "/orders/?hold=1.2")
        retry = post(client, "/orders/?hold=1.2")

        assert first.status_code == retry.status_code == 201
        assert retry["Idempotent-Replayed"] == "true"
        assert calls.value == 1
        record = IdempotencyKey.objects.get()
        assert record.expires_at - record.created_at >= timedelta(seconds=2)

    def test_fast_handler_keeps_the_expiry_its_claim_set(self, client):
        # Storing the response then changes no indexed column (a heap-only
        # update on PostgreSQL).
        post(client)

        record = IdempotencyKey.objects.get()
        assert record.expires_at - record.created_at == timedelta(hours=24)
