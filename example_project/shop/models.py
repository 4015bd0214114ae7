from django.conf import settings
from django.db import models


class Order(models.Model):
    """Placed through a plain Django view protected by ``@idempotent``."""

    item = models.CharField(max_length=100)
    quantity = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.quantity} x {self.item}"


class Booking(models.Model):
    """Made through a DRF viewset with ``IdempotentMixin``."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    slot = models.CharField(max_length=100)
    guests = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.slot} for {self.guests}"


class Payment(models.Model):
    """Taken in lease mode: the charge happens at the (fake) provider."""

    reference = models.CharField(max_length=100)
    amount = models.PositiveIntegerField()
    charge_id = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    #: How many times the provider's "charge.settled" webhook took effect: 1 at most.
    settlements = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.reference}: {self.amount}"


class Receipt(models.Model):
    """Written by the ``send_receipt`` Celery task: one per order, however often it is sent."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="receipts")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"receipt for order {self.order_id}"
