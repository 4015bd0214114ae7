from django.db import models


class Order(models.Model):
    """The business effect in tests: one row per handler run that committed."""

    item = models.CharField(max_length=100)
    quantity = models.IntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.item} x{self.quantity}"


class RemoteCharge(models.Model):
    """A charge at a stand-in payment provider that deduplicates by its reference.

    Lease-mode handlers run outside our transaction, so a handler taken over
    after a crash runs again; the provider's unique reference (the handler
    passes ``request.idempotency.derive(...)``) is what keeps it one charge.
    """

    reference = models.CharField(max_length=64, unique=True)
    item = models.CharField(max_length=300)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.item


class Publication(models.Model):
    """A task handed off by a webhook receiver, recorded when its transaction commits."""

    event = models.CharField(max_length=100)

    def __str__(self) -> str:
        return self.event
