from django.db import models


class Charge(models.Model):
    """A charge at the fake provider: at most one per idempotency key, like Stripe's."""

    idempotency_key = models.CharField(max_length=255, unique=True)
    amount = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"charge {self.pk}: {self.amount}"
