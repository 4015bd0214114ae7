from __future__ import annotations

import pytest

from django_idempotency import signals
from tests import views
from tests.clients import post

pytestmark = pytest.mark.django_db


@pytest.fixture
def received():
    events: list[tuple[str, object, object]] = []
    receivers = {}
    for name in ("key_claimed", "response_replayed", "request_conflict", "fingerprint_mismatch"):

        def receiver(sender, request, idempotency, name=name, **kwargs):
            events.append((name, sender, idempotency))

        receivers[name] = receiver
        getattr(signals, name).connect(receiver)
    yield events
    for name, receiver in receivers.items():
        getattr(signals, name).disconnect(receiver)


def test_claim_replay_and_mismatch_are_signalled_with_the_view_and_info(client, received):
    post(client, "/orders/", item="a")
    post(client, "/orders/", item="a")
    post(client, "/orders/", item="b")

    assert [name for name, _, _ in received] == [
        "key_claimed",
        "response_replayed",
        "fingerprint_mismatch",
    ]
    for _, sender, info in received:
        assert sender is views.create_order.__wrapped__
        assert info.key == "k"
        assert info.scope == "anonymous"


def test_conflict_is_signalled(client, received):
    from tests.factories import IdempotencyKeyFactory

    post(client, "/orders/", item="a")
    from django_idempotency.models import IdempotencyKey

    record = IdempotencyKey.objects.get()
    record.delete()
    IdempotencyKeyFactory(key="k", in_flight=True, fingerprint=record.fingerprint)
    response = post(client, "/orders/", item="a")

    assert response.status_code == 409
    assert 1 <= int(response["Retry-After"]) <= 300
    assert received[-1][0] == "request_conflict"


def test_keys_are_never_logged_in_clear(client, caplog):
    import logging

    from django_idempotency.keys import mask_key
    from django_idempotency.models import IdempotencyKey
    from tests.factories import IdempotencyKeyFactory

    secret = "secret-key-4711"
    caplog.set_level(logging.DEBUG)
    for item in ("a", "a", "b"):  # claim, replay, mismatch
        post(client, "/orders/", secret, item=item)
    record = IdempotencyKey.objects.get()
    record.delete()
    IdempotencyKeyFactory(key=secret, in_flight=True, fingerprint=record.fingerprint)
    post(client, "/orders/", secret, item="a")

    assert caplog.records, "expected the replay, mismatch and conflict to be logged"
    assert all(secret not in r.getMessage() for r in caplog.records)
    assert any(mask_key(secret) in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("url", ["/orders/", "/orders/lease/"])
@pytest.mark.parametrize("name", ["key_claimed", "response_stored"])
def test_a_receiver_that_raises_changes_no_answer(client, caplog, url, name):
    from django_idempotency.models import IdempotencyKey
    from tests.views import calls

    def broken(**kwargs):
        raise RuntimeError("the metrics backend is down")

    getattr(signals, name).connect(broken)
    try:
        first = post(client, url, item="a")
        retry = post(client, url, item="a")
    finally:
        getattr(signals, name).disconnect(broken)

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert calls.value == 1
    assert IdempotencyKey.objects.get().state == IdempotencyKey.State.COMPLETED
    assert "the metrics backend is down" in caplog.text
    assert "'k'" not in caplog.text
