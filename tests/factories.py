"""Records in every state, for tests that start from a stored row."""

from __future__ import annotations

from datetime import timedelta

import factory
from django.utils import timezone

from django_idempotency.models import IdempotencyKey

State = IdempotencyKey.State


def _ago(**delta: float):  # type: ignore[no-untyped-def]
    return factory.LazyFunction(lambda: timezone.now() - timedelta(**delta))


def _ahead(**delta: float):  # type: ignore[no-untyped-def]
    return factory.LazyFunction(lambda: timezone.now() + timedelta(**delta))


class IdempotencyKeyFactory(factory.django.DjangoModelFactory):
    """A completed record, replayable for a day; traits give the other states."""

    class Meta:
        model = IdempotencyKey

    class Params:
        # An in-progress lease-mode claim whose owner is still running.
        in_flight = factory.Trait(
            state=State.IN_PROGRESS,
            status_code=None,
            response_headers=None,
            response_body=None,
            owner_token=factory.Faker("hexify", text="^" * 32),
            locked_until=_ahead(minutes=5),
            expires_at=factory.SelfAttribute("locked_until"),
        )
        # A completed record past its TTL.
        expired = factory.Trait(created_at=_ago(hours=25), expires_at=_ago(seconds=1))
        # An in-progress claim whose owner died: its lease ran out.
        lease_expired = factory.Trait(
            state=State.IN_PROGRESS,
            status_code=None,
            response_headers=None,
            response_body=None,
            owner_token=factory.Faker("hexify", text="^" * 32),
            locked_until=_ago(seconds=1),
            expires_at=factory.SelfAttribute("locked_until"),
        )

    scope = "anonymous"
    key = factory.Sequence(lambda n: f"key-{n}")
    fingerprint = factory.Faker("hexify", text="^" * 64)
    state = State.COMPLETED
    status_code = 201
    response_headers = factory.LazyFunction(lambda: [["Content-Type", "application/json"]])
    response_body = b'{"ok": true}'
    owner_token = ""
    locked_until = None
    created_at = factory.LazyFunction(timezone.now)
    expires_at = _ahead(hours=24)
