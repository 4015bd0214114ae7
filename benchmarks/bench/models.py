"""The handler's one-row write, which also counts executions per key."""

from __future__ import annotations

from django.db import models


class BenchOrder(models.Model):
    """One row per handler execution.

    ``key`` and ``nonce`` say which request ran the handler, so a storm can
    count executions per key and tell the original request from its
    duplicates. The app label is explicit so the test suite can use the
    model without installing the bench app.
    """

    variant = models.CharField(max_length=32)
    key = models.CharField(max_length=255, blank=True, default="")
    nonce = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        app_label = "bench"
        indexes = [models.Index(fields=["variant", "key"], name="bench_variant_key_idx")]

    def __str__(self) -> str:
        return f"{self.variant} {self.key}"
