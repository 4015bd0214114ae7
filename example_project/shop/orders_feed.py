"""Orders that arrive as messages (a marketplace's feed): each placed once per message id."""

from __future__ import annotations

from typing import Any

from django_idempotency import idempotent_function
from example_project.shop.models import Order


@idempotent_function(key=lambda message_id, order: message_id, scope="shop.orders-feed")
def place_order(message_id: str, order: dict[str, Any]) -> dict[str, Any]:
    """Atomic mode: the order and the record of ``message_id`` commit together.

    A redelivered message (the same id, the same body) gets this value back
    without a second order; the same id with another body raises
    ``ArgumentsMismatch``.
    """
    placed = Order.objects.create(item=order["item"], quantity=order.get("quantity", 1))
    return {"order": placed.pk}
