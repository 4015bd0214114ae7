"""One record per (scope, key): the durable truth about who owns a key."""

from __future__ import annotations

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_idempotency.fields import (
    FINGERPRINT_COLUMN_LENGTH,
    KEY_COLUMN_LENGTH,
    ExactCharField,
)


class IdempotencyKey(models.Model):
    class State(models.TextChoices):
        IN_PROGRESS = "in_progress", _("in progress")
        COMPLETED = "completed", _("completed")

    id = models.BigAutoField(primary_key=True)
    scope = ExactCharField(_("scope"), max_length=KEY_COLUMN_LENGTH)
    key = ExactCharField(_("key"), max_length=KEY_COLUMN_LENGTH)
    fingerprint = models.CharField(_("fingerprint"), max_length=FINGERPRINT_COLUMN_LENGTH)
    state = models.CharField(
        _("state"), max_length=16, choices=State.choices, default=State.IN_PROGRESS
    )
    # The stored response; a completed record with a NULL body replays without one.
    status_code = models.PositiveSmallIntegerField(_("status code"), null=True, blank=True)
    response_headers = models.JSONField(_("response headers"), null=True, blank=True)
    response_body = models.BinaryField(_("response body"), null=True, blank=True)
    # Lease mode: owned by this random token until locked_until; writes match on it.
    owner_token = models.CharField(_("owner token"), max_length=32, blank=True, default="")
    locked_until = models.DateTimeField(_("locked until"), null=True, blank=True)
    created_at = models.DateTimeField(_("created at"), default=timezone.now)
    # Lease mode: 1, or n + 1 after n takeovers of an abandoned claim; and the steps
    # its owners recorded as done, name to JSON data.
    attempt = models.PositiveIntegerField(_("attempt"), default=1)
    checkpoints = models.JSONField(_("checkpoints"), null=True, blank=True)
    # Equals locked_until while a lease is held: one indexed column answers "may this
    # key be taken over?" (django_idempotency.leases); the purge walks it too.
    expires_at = models.DateTimeField(_("expires at"))
    # Lease mode: the lease's end plus TTL. The purge keeps a claim left in progress
    # until then, for its retry's progress; NULL in atomic mode.
    retained_until = models.DateTimeField(_("retained until"), null=True, blank=True)

    class Meta:
        verbose_name = _("idempotency key")
        verbose_name_plural = _("idempotency keys")
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="idempotency_scope_key_uniq"),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="idempotency_expires_at_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.scope} / {self.state}"
