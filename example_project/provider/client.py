"""The fake payment provider's API, as a shop would call a remote one.

It stands in for a system outside the shop's database: each charge commits
on its own, so a crash of the caller cannot undo it, and, like real
providers, it answers a repeated idempotency key with the first charge
instead of charging again.
"""

from __future__ import annotations

import json

from django.conf import settings
from django.db import IntegrityError, transaction

from django_idempotency import webhooks
from example_project.provider.models import Charge


def charge(amount: int, idempotency_key: str) -> Charge:
    existing = Charge.objects.filter(idempotency_key=idempotency_key).first()
    if existing is not None:
        return existing
    try:
        with transaction.atomic():
            return Charge.objects.create(idempotency_key=idempotency_key, amount=amount)
    except IntegrityError:  # a concurrent call with the same key won
        return Charge.objects.get(idempotency_key=idempotency_key)


def settled_event(charge: Charge, event_id: str) -> tuple[bytes, dict[str, str]]:
    """The webhook the provider sends when ``charge`` settles: its body and signed headers.

    Standard Webhooks: the event id in ``webhook-id``, the same on every
    redelivery, and an HMAC over the id, a timestamp and the body.
    """
    body = json.dumps({"type": "charge.settled", "data": {"charge": charge.pk}}).encode()
    signature = webhooks.standard_signature(settings.PROVIDER_WEBHOOK_SECRET)
    return body, signature.headers(body, id=event_id)
