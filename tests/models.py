from django.db import models


class Order(models.Model):
    """The business effect in tests: one row per handler run that committed."""

    item = models.CharField(max_length=100)
    quantity = models.IntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.item} x{self.quantity}"
